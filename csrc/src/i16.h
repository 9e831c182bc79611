// What the int16 products share (prefill_i16.cpp's many-row and few-row paths, tiles.cpp's
// tiled layers): x rounded to int16 per block of 32 inputs with the block's scale (amax / 32767)
// and each group's exact sum, and the target attribute their AVX-512 VNNI code is compiled with.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "simd.h"

namespace mlxinfer::i16 {
constexpr int kBlock = 32; // inputs per x scale (and per int32 sum)
} // namespace mlxinfer::i16

#if defined(MLXINFER_X86)
#include <immintrin.h>

#define MLXINFER_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma")))

namespace mlxinfer::i16 {

struct Problem {
  int M = 0, N = 0, K = 0, gs = 0, bits = 0;
  const float* x = nullptr; // (M, K)
  const uint32_t* w = nullptr; // (N, K * bits / 32)
  const float* scales = nullptr; // (N, G)
  const float* biases = nullptr; // (N, G)
  const int16_t* xq = nullptr; // (M, K)
  const float* xscale = nullptr; // (M, K / 32)
  const float* xsum = nullptr; // (M, G)
  float* y = nullptr; // (M, N)
};

// Row m of x as int16 per block of 32 (round to nearest), the blocks' scales and the groups' sums.
MLXINFER_VNNI inline void prepare_row(const Problem& p, int m, int16_t* xq, float* xscale, float* xsum) {
  const float* xr = p.x + static_cast<size_t>(m) * p.K;
  const int blocks = p.K / kBlock, per_group = p.gs / kBlock;
  for (int b = 0; b < blocks; ++b) {
    const __m512 a = _mm512_loadu_ps(xr + b * kBlock), c = _mm512_loadu_ps(xr + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    // A non-finite x makes its block's scale NaN, so its rows' outputs are NaN (not wrapped ints).
    const bool finite = std::isfinite(amax);
    const float scale = !finite ? std::nanf("") : amax > 0.0f ? amax / 32767.0f : 0.0f;
    const __m512 inv = _mm512_set1_ps(finite && amax > 0.0f ? 32767.0f / amax : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
    const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock), _mm512_cvtsepi32_epi16(qa));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock + 16),
                        _mm512_cvtsepi32_epi16(qc));
    xscale[b] = scale;
    const float s = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
    xsum[b / per_group] = b % per_group == 0 ? s : xsum[b / per_group] + s;
  }
}

} // namespace mlxinfer::i16

#endif // MLXINFER_X86
