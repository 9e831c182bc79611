// What the int16 products share (prefill_i16.cpp's many-row and few-row paths, tiles.cpp's
// tiled layers): x rounded to int16 per block of 32 inputs with the block's scale (amax / 32767)
// and each group's exact sum, and the target attribute their AVX-512 VNNI code is compiled with.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace mlxinfer::i16 {
constexpr int kBlock = 32; // inputs per x scale (and per int32 sum)
} // namespace mlxinfer::i16

#if defined(MLXINFER_X86)
#include <immintrin.h>

#define MLXINFER_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma")))
// The tiles' 512-bit path and prepare_row: AVX-512 F and BW only (Skylake-SP; VNNI's
// vpdpwssd is emitted as an instruction where the CPU has it, tiles.cpp), no VBMI (Cascade Lake).
#define MLXINFER_WIDE_TILES __attribute__((target("avx512f,avx512bw,avx2,fma")))

namespace mlxinfer::i16 {

struct Problem {
  int M = 0, N = 0, K = 0, gs = 0, bits = 0;
  const float* x = nullptr; // (M, K)
  const uint32_t* w = nullptr; // (N, K * bits / 32)
  const float* scales = nullptr; // (N, G)
  const float* biases = nullptr; // (N, G)
  const int16_t* xq = nullptr; // (M, K)
  const int8_t* x8 = nullptr; // (M, K): x in int8 instead (tiles.cpp's int8 activations)
  const float* xscale = nullptr; // (M, K / 32)
  const float* xsum = nullptr; // (M, G)
  float* y = nullptr; // (M, N)
};

// Row m of x rounded to T per block of 32 (to nearest, saturated), the blocks' scales and the
// groups' sums. int16: scale amax / 32767, the sums of x itself. int8 (tiles.cpp's int8
// activations, opt-in): scale amax / 127, and the sums of the rounded x (scale times its codes'
// exact sum): the biases then meet the same x as the codes, so an output's error is that of the
// dequantized weights times x's rounding, sum_k |s q_k + b| (not |s q_k|: an affine layer's
// codes are uncentered, its biases about -8 s at 4 bits) x_scale_b / 2; with x's own sums the
// codes' share of the error stood alone (SmolLM2: perplexity +1.68 % against +0.41 %).
template <typename T>
MLXINFER_WIDE_TILES inline void prepare_row_as(const Problem& p, int m, T* xq, float* xscale,
                                               float* xsum) {
  constexpr float kLevels = std::is_same_v<T, int8_t> ? 127.0f : 32767.0f;
  const float* xr = p.x + static_cast<size_t>(m) * p.K;
  const int blocks = p.K / kBlock, per_group = p.gs / kBlock;
  for (int b = 0; b < blocks; ++b) {
    const __m512 a = _mm512_loadu_ps(xr + b * kBlock), c = _mm512_loadu_ps(xr + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    // A non-finite x makes its block's scale NaN, so its rows' outputs are NaN (not wrapped ints).
    const bool finite = std::isfinite(amax);
    const float scale = !finite ? std::nanf("") : amax > 0.0f ? amax / kLevels : 0.0f;
    const __m512 inv = _mm512_set1_ps(finite && amax > 0.0f ? kLevels / amax : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
    const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, inv));
    float s;
    if constexpr (std::is_same_v<T, int8_t>) {
      const __m128i ba = _mm512_cvtsepi32_epi8(qa), bc = _mm512_cvtsepi32_epi8(qc);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), ba);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16), bc);
      s = scale * static_cast<float>(_mm512_reduce_add_epi32(
                      _mm512_add_epi32(_mm512_cvtepi8_epi32(ba), _mm512_cvtepi8_epi32(bc))));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock), _mm512_cvtsepi32_epi16(qa));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock + 16),
                          _mm512_cvtsepi32_epi16(qc));
      s = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
    }
    xscale[b] = scale;
    xsum[b / per_group] = b % per_group == 0 ? s : xsum[b / per_group] + s;
  }
}

MLXINFER_WIDE_TILES inline void prepare_row(const Problem& p, int m, int16_t* xq, float* xscale,
                                            float* xsum) {
  prepare_row_as<int16_t>(p, m, xq, xscale, xsum);
}

MLXINFER_WIDE_TILES inline void prepare_row_i8(const Problem& p, int m, int8_t* xq, float* xscale,
                                               float* xsum) {
  prepare_row_as<int8_t>(p, m, xq, xscale, xsum);
}

// 16 scales or biases as float32: float32 ones, or float16 ones (any 2-byte S) converted.
template <typename S>
MLXINFER_WIDE_TILES inline __m512 load16(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(p);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// The int16 and int8 products' epilogue of a block b of 32 inputs: rows m0.. m0 + R - 1's int32
// sums A (32 outputs, two vectors) into C, times the group g's scales (ts: a tile's [group][32])
// and the row's block scale; at the group's `last` block, its biases (tb; nullptr: a tiled
// symmetric layer's, tiles.cpp) times the row's group sum of x.
template <int R, typename S>
MLXINFER_WIDE_TILES inline void scale_block(const Problem& p, const S* ts, const S* tb, int m0,
                                            int b, int g, bool last, const __m512i (&A)[R][2],
                                            __m512 (&C)[R][2]) {
  const int blocks = p.K / kBlock, G = p.K / p.gs;
  const __m512 s0 = load16(ts + g * 32), s1 = load16(ts + g * 32 + 16);
  for (int r = 0; r < R; ++r) {
    const __m512 sx = _mm512_set1_ps(p.xscale[static_cast<size_t>(m0 + r) * blocks + b]);
    C[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(A[r][0]), _mm512_mul_ps(s0, sx), C[r][0]);
    C[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(A[r][1]), _mm512_mul_ps(s1, sx), C[r][1]);
  }
  if (last) { // tb nullptr: a symmetric layer's biases, -2^(bits - 1) times its scales (exact)
    const __m512 sym = _mm512_set1_ps(-static_cast<float>(1 << (p.bits - 1)));
    const __m512 b0 = tb != nullptr ? load16(tb + g * 32) : _mm512_mul_ps(s0, sym);
    const __m512 b1 = tb != nullptr ? load16(tb + g * 32 + 16) : _mm512_mul_ps(s1, sym);
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(p.xsum[static_cast<size_t>(m0 + r) * G + g]);
      C[r][0] = _mm512_fmadd_ps(b0, xs, C[r][0]);
      C[r][1] = _mm512_fmadd_ps(b1, xs, C[r][1]);
    }
  }
}

// C's R rows to y's outputs n0 .. n0 + 31.
template <int R>
MLXINFER_WIDE_TILES inline void store_rows(const Problem& p, int m0, size_t n0, const __m512 (&C)[R][2]) {
  for (int r = 0; r < R; ++r) {
    float* yr = p.y + static_cast<size_t>(m0 + r) * p.N + n0;
    _mm512_storeu_ps(yr, C[r][0]);
    _mm512_storeu_ps(yr + 16, C[r][1]);
  }
}

// The int8 products' target (tiles.cpp, AVX-512 VNNI's vpdpbusd; pdep for the 5-/6-bit planes).
#define MLXINFER_I8 __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,bmi2")))

#define MLXINFER_I16_AVX2 __attribute__((target("avx2,fma,f16c")))

// prepare_row in 256-bit vectors (tiles.cpp's AVX2 path): the same int16 codes, scales and
// sums bit for bit, the reductions in the order _mm512_reduce_max_ps / _mm512_reduce_add_ps take.
MLXINFER_I16_AVX2 inline void prepare_row_avx2(const Problem& p, int m, int16_t* xq, float* xscale,
                                               float* xsum) {
  const float* xr = p.x + static_cast<size_t>(m) * p.K;
  const int blocks = p.K / kBlock, per_group = p.gs / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < blocks; ++b) {
    const float* at = xr + b * kBlock;
    const __m256 a0 = _mm256_loadu_ps(at), a1 = _mm256_loadu_ps(at + 8);
    const __m256 c0 = _mm256_loadu_ps(at + 16), c1 = _mm256_loadu_ps(at + 24);
    // max(|a|, |c|) lane by lane as one 512-bit vector's halves, then the reduction's tree
    const __m256 lo = _mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, c0));
    const __m256 hi = _mm256_max_ps(_mm256_andnot_ps(sign, a1), _mm256_andnot_ps(sign, c1));
    const __m256 t3 = _mm256_max_ps(hi, lo);
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m128 t10 = _mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
    const float amax = _mm_cvtss_f32(t10);
    const bool finite = std::isfinite(amax);
    const float scale = !finite ? std::nanf("") : amax > 0.0f ? amax / 32767.0f : 0.0f;
    const __m256 inv = _mm256_set1_ps(finite && amax > 0.0f ? 32767.0f / amax : 0.0f);
    const __m256 q[4] = {a0, a1, c0, c1};
    for (int i = 0; i < 4; ++i) { // to nearest, saturated to int16 (as _mm512_cvtsepi32_epi16)
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(q[i], inv));
      const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 8 * i), packed);
    }
    xscale[b] = scale;
    const __m256 s3 = _mm256_add_ps(_mm256_add_ps(a1, c1), _mm256_add_ps(a0, c0));
    const __m128 s6 = _mm_add_ps(_mm256_extractf128_ps(s3, 1), _mm256_castps256_ps128(s3));
    const __m128 s8 = _mm_add_ps(s6, _mm_shuffle_ps(s6, s6, _MM_SHUFFLE(1, 0, 3, 2)));
    const float s = _mm_cvtss_f32(s8) + _mm_cvtss_f32(_mm_shuffle_ps(s8, s8, _MM_SHUFFLE(1, 1, 1, 1)));
    xsum[b / per_group] = b % per_group == 0 ? s : xsum[b / per_group] + s;
  }
}

// prepare_row_i8 without AVX-512 (tiles.cpp's AVX2 int8 path): the same codes, scales and sums
// bit for bit (the block's max is exact in any order; x * (127 / amax) rounded to nearest even
// in float32 as cvtps does; the codes' sum exact), one value at a time past the max.
MLXINFER_I16_AVX2 inline void prepare_row_i8_avx2(const Problem& p, int m, int8_t* xq, float* xscale,
                                                  float* xsum) {
  const float* xr = p.x + static_cast<size_t>(m) * p.K;
  const int blocks = p.K / kBlock, per_group = p.gs / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < blocks; ++b) {
    const float* at = xr + b * kBlock;
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(at + 8 * i)));
    }
    const __m128 h = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
    const __m128 h2 = _mm_max_ps(h, _mm_shuffle_ps(h, h, _MM_SHUFFLE(1, 0, 3, 2)));
    const float amax = _mm_cvtss_f32(_mm_max_ps(h2, _mm_shuffle_ps(h2, h2, _MM_SHUFFLE(0, 1, 0, 1))));
    // a NaN in the block: _mm256_max_ps may drop it, so the block is checked as prepare_row_i8's
    bool finite = std::isfinite(amax);
    for (int i = 0; i < kBlock && finite; ++i) {
      finite = std::isfinite(at[i]);
    }
    const float scale = !finite ? std::nanf("") : amax > 0.0f ? amax / 127.0f : 0.0f;
    const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
    int isum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const float v = std::nearbyint(at[i] * inv);
      const int q = finite ? static_cast<int>(std::clamp(v, -128.0f, 127.0f)) : 0;
      xq[b * kBlock + i] = static_cast<int8_t>(q);
      isum += q;
    }
    xscale[b] = scale;
    const float s = scale * static_cast<float>(isum);
    xsum[b / per_group] = b % per_group == 0 ? s : xsum[b / per_group] + s;
  }
}

} // namespace mlxinfer::i16

#endif // MLXINFER_X86
