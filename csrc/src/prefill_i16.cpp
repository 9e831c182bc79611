// The int16 product of a quantized layer for many rows (a prefill's; issue 47, item 3), with
// AVX-512 VNNI: each row of x rounded to int16 per block of 32 inputs (its scale amax / 32767),
// the layer's codes widened to int16 and laid out 32 outputs a tile, [block][pair of inputs][32
// outputs][2], and `vpdpwssd` (32 products an instruction, summed in int32 lanes: one lane an
// output) where the float32 path does 16 a fused multiply-add. Each block's int32 sums are
// converted and scaled by the group's scale times the block's, and each group adds its bias
// times the sum of x over the group (exact x, not rounded), so per output:
//
//   y = sum_blocks s_g x_scale_b sum_k q_k xq_k  +  sum_g b_g sum_{k in g} x_k
//
// The only rounding beyond float32's is x's to int16: |y - y_f32| <= sum_k |s_g q_k| x_scale_b / 2,
// about 1.5e-5 of the largest |x| of a block per unit of weight, a thousandth of what rounding
// the weights to 4 or 5 bits costs. The block sums cannot overflow: 32 * 32767 * 255 < 2^31.
//
// Up to kFewRows rows of x (decode: a tied LM head's product under the ``int16_head`` plan) take no
// tiles: each output row's codes are widened in order and each block of 32 is one vpdpwssd
// against x's block (few_rows), the same arithmetic and bound; the 262,144 x 640 8-bit head of
// Gemma-3-270M at one row, two threads of the Xeon VM: 7.6-8.6 ms against the float32 kernel's
// 10.7-11.8 (which stays compute-bound there: prefetching its rows did not help it).
//
// With int8 activations on (set_int8_activations, opt-in; tiles.cpp's comment) x is rounded to
// int8 per block of 32 and its groups' sums are of the rounded x; the codes go as bytes (tiles of
// [block][quad][32 outputs][4], or each output row's in order for a few rows) to vpdpbusd, 64
// products an instruction; the bound is sum_k |s q_k + b| x_scale_b / 2 with x's scale amax / 127.
//
// It runs where the CPU has AVX-512 F, BW, VNNI and VBMI (vnni_available()); the caller checks
// (backends/cpu/quantized.py: the ``int16_rows`` plan). Measured on the AMD EPYC VM (2 vCPUs):
// 128 x 640 by 2,048 rows of 5-bit codes 0.97 ms against OpenBLAS's float32 product of the
// dequantized weight, 2.1 ms (tools/vnni_gemm_probe.c, docs/performance.md).
#include "primitives.h"

#include <algorithm>
#include <atomic>
#include <array>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include "mlx/backend/cpu/encoder.h"

#include "i16.h"
#include "kernels.h"
#include "simd.h"
#include "threadpool.h"
#include "util.h"

namespace mlxinfer {

namespace {

using i16::kBlock;
constexpr int kTile = 32; // outputs per tile: two 16-lane vectors
// Up to this many rows of x take few_rows (each output row's codes widened in order, no tile);
// more, the tiles.
constexpr int kFewRows = 4;
// How far ahead few_rows asks for the lines of its rows, in bytes of codes (6-12 KB timed alike
// on the Xeon VM).
constexpr size_t kAheadBytes = 8192;

bool detect_vnni() {
#if defined(MLXINFER_X86)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

const bool g_vnni = detect_vnni();

#if defined(MLXINFER_X86)

using i16::prepare_row;
using i16::Problem;

// Row n's K codes from MLX's little-endian bit stream (8 codes in BITS bytes), as int16 (T), 64
// at a time: the 8 units' bytes spread one unit a 64-bit lane (vpermb), each lane's 8 codes cut
// out as bytes (vpmultishiftqb: code j is the 8 bits from bit j * BITS, masked), then widened;
// or as bytes (T uint8_t: int8 activations' vpdpbusd reads them unsigned), whole 64s written (a
// row's last 32 with 32 zeros after them: `out` has room up to padded64(K)).
template <int BITS, typename T = int16_t>
MLXINFER_VNNI void row_codes(const uint8_t* __restrict src, T* __restrict out, int K) {
  alignas(64) static constexpr auto kSpread = [] {
    std::array<uint8_t, 64> t{};
    for (int u = 0; u < 8; ++u) {
      for (int i = 0; i < 8; ++i) {
        t[8 * u + i] = static_cast<uint8_t>(u * BITS + i);
      }
    }
    return t;
  }();
  alignas(64) static constexpr auto kShift = [] {
    std::array<uint8_t, 64> t{};
    for (int i = 0; i < 64; ++i) {
      t[i] = static_cast<uint8_t>((i % 8) * BITS);
    }
    return t;
  }();
  const __m512i spread = _mm512_load_si512(kSpread.data());
  const __m512i shift = _mm512_load_si512(kShift.data());
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << BITS) - 1));
  for (int k = 0; k < K; k += 64) {
    const int n = std::min(64, K - k); // 64, or the row's last 32
    const uint8_t* unit = src + static_cast<size_t>(k) / 8 * BITS;
    __m512i v;
    if constexpr (BITS == 8) {
      v = _mm512_maskz_loadu_epi8(n == 64 ? ~__mmask64{0} : 0xFFFFFFFFull, unit);
    } else {
      const __mmask64 bytes = (__mmask64{1} << (n / 8 * BITS)) - 1; // 8 * BITS < 64 bytes
      v = _mm512_maskz_loadu_epi8(bytes, unit);
      v = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift, _mm512_permutexvar_epi8(spread, v)),
                           mask);
    }
    if constexpr (std::is_same_v<T, uint8_t>) {
      _mm512_storeu_si512(out + k, v); // past n: zeros (the masked load's)
    } else {
      _mm512_storeu_si512(out + k, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v)));
      if (n == 64) {
        _mm512_storeu_si512(out + k + 32, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1)));
      }
    }
  }
}

template <typename T>
using CodesFn = void (*)(const uint8_t*, T*, int);

// row_codes for a width, as int16 (T) or bytes.
template <typename T = int16_t>
CodesFn<T> codes_fn(int bits) {
  switch (bits) {
    case 2:
      return row_codes<2, T>;
    case 3:
      return row_codes<3, T>;
    case 4:
      return row_codes<4, T>;
    case 5:
      return row_codes<5, T>;
    case 6:
      return row_codes<6, T>;
    default:
      return row_codes<8, T>;
  }
}

// The 16 x 16 32-bit elements r[0..16) (rows) transposed in place (r[c]: column c), in three
// steps: 32-bit then 64-bit interleaves within 128-bit lanes, then the lanes.
MLXINFER_VNNI inline void transpose16(__m512i (&r)[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) { // b[4i + k], lane L: rows 4i..4i+3 of column 4L + k
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i d0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x88);
    const __m512i d1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xDD);
    const __m512i e0 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x88);
    const __m512i e1 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xDD);
    r[k] = _mm512_shuffle_i32x4(d0, e0, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(d0, e0, 0xDD);
    r[4 + k] = _mm512_shuffle_i32x4(d1, e1, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(d1, e1, 0xDD);
  }
}

#endif // MLXINFER_X86

#if defined(MLXINFER_X86)

// Rows m0..m0+R of x against the tile's 32 outputs n0..n0+32 (tile: its codes laid out by
// lay_tile, ts/tb: its scales and biases [group][32]). int16 codes (T): [block][pair][32 outputs]
// [2], a pair's two vectors each one vpdpwssd against x's int16 pair; bytes (int8 activations):
// [block][quad][32 outputs][4], a quad's two vectors each one vpdpbusd against x's 4 int8 values.
// Either way a step of the block is 128 bytes, two vectors of 16 outputs.
template <int R, typename T>
MLXINFER_VNNI void tile_rows(const Problem& p, const T* tile, const float* ts, const float* tb,
                             int m0, int n0) {
  constexpr bool kBytes = std::is_same_v<T, uint8_t>;
  constexpr int kSteps = kBytes ? 8 : 16; // steps a block of 32 inputs
  constexpr int kStep = 128 / sizeof(T), kHalf = kStep / 2; // elements a step, a vector
  const int blocks = p.K / kBlock, per_group = p.gs / kBlock;
  __m512 C[R][2];
  for (int r = 0; r < R; ++r) {
    C[r][0] = C[r][1] = _mm512_setzero_ps();
  }
  for (int b = 0; b < blocks; ++b) {
    __m512i A[R][2];
    for (int r = 0; r < R; ++r) {
      A[r][0] = A[r][1] = _mm512_setzero_si512();
    }
    const T* wb = tile + static_cast<size_t>(b) * kSteps * kStep;
    for (int i = 0; i < kSteps; ++i) {
      const __m512i w0 = _mm512_load_si512(wb + i * kStep);
      const __m512i w1 = _mm512_load_si512(wb + i * kStep + kHalf);
      for (int r = 0; r < R; ++r) {
        const size_t at = static_cast<size_t>(m0 + r) * p.K + b * kBlock + i * (kBlock / kSteps);
        int32_t x4; // two int16 or four int8 values of x
        std::memcpy(&x4, kBytes ? static_cast<const void*>(p.x8 + at) : p.xq + at, 4);
        const __m512i xb = _mm512_set1_epi32(x4);
        if constexpr (kBytes) {
          A[r][0] = _mm512_dpbusd_epi32(A[r][0], w0, xb);
          A[r][1] = _mm512_dpbusd_epi32(A[r][1], w1, xb);
        } else {
          A[r][0] = _mm512_dpwssd_epi32(A[r][0], xb, w0);
          A[r][1] = _mm512_dpwssd_epi32(A[r][1], xb, w1);
        }
      }
    }
    i16::scale_block<R>(p, ts, tb, m0, b, b / per_group, b % per_group == per_group - 1, A, C);
  }
  i16::store_rows<R>(p, m0, n0, C);
}

// Outputs [n0, n0 + 32): codes as int16 [block][pair][32 outputs][2], scales and biases
// [group][32 outputs]. The 32 rows' codes go to `rows` (32 x K), then are transposed by pairs.
MLXINFER_VNNI void lay_tile(const Problem& p, int n0, int16_t* tile, float* ts, float* tb,
                            int16_t* rows) {
  const CodesFn<int16_t> codes = codes_fn(p.bits);
  const size_t row_bytes = static_cast<size_t>(p.K) * p.bits / 8;
  const int G = p.K / p.gs;
  const auto* w = reinterpret_cast<const uint8_t*>(p.w);
  for (int j = 0; j < kTile; ++j) {
    codes(w + (n0 + j) * row_bytes, rows + static_cast<size_t>(j) * p.K, p.K);
    for (int g = 0; g < G; ++g) {
      ts[g * kTile + j] = p.scales[static_cast<size_t>(n0 + j) * G + g];
      tb[g * kTile + j] = p.biases[static_cast<size_t>(n0 + j) * G + g];
    }
  }
  // Pairs 16 at a time: for each half of the tile, its 16 rows' pairs transposed to 16
  // vectors of the 16 outputs' pair (K is a multiple of 32: of 16 pairs).
  for (int P0 = 0; P0 < p.K / 2; P0 += 16) {
    for (int half = 0; half < 2; ++half) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        r[j] = _mm512_load_si512(rows + static_cast<size_t>(16 * half + j) * p.K + 2 * P0);
      }
      transpose16(r);
      for (int c = 0; c < 16; ++c) {
        _mm512_store_si512(tile + static_cast<size_t>(P0 + c) * 2 * kTile + half * kTile, r[c]);
      }
    }
  }
}

// The few-row paths' lines of the rows about kAheadBytes of codes on (codes, scales, biases;
// each R rows' contiguous): decode streams the weights from memory once, and one core of the Xeon
// VM keeps too few lines in flight by its hardware prefetchers alone (the 262,144 x 640 8-bit
// head, two threads: 12.1 ms without these, 7.6-8.4 with; the float kernel 10.7-11.3 either
// way). Here the scales' and biases'; returns how many rows ahead (the codes' own, in the loop).
template <int R>
MLXINFER_VNNI inline int fetch_scales_ahead(const Problem& p, int n, size_t row_bytes) {
  const int G = p.K / p.gs;
  const int ahead = std::max(R, static_cast<int>(kAheadBytes / row_bytes));
  if (n + ahead + R <= p.N) {
    const size_t at = static_cast<size_t>(n + ahead) * G, bytes = static_cast<size_t>(R) * G * 4;
    for (size_t o = 0; o < bytes; o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p.scales + at) + o, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p.biases + at) + o, _MM_HINT_T0);
    }
  }
  return ahead;
}

// The few-row paths' outputs n .. n + R - 1 of row m: the two accumulators' lanes summed, plus
// the biases times x's group sums.
template <int R>
MLXINFER_VNNI inline void few_outputs(const Problem& p, int m, int n, const __m512 (&t0)[R],
                                      const __m512 (&t1)[R]) {
  const int G = p.K / p.gs;
  const float* xsum = p.xsum + static_cast<size_t>(m) * G;
  for (int r = 0; r < R; ++r) {
    const float* br = p.biases + static_cast<size_t>(n + r) * G;
    p.y[static_cast<size_t>(m) * p.N + n + r] =
        _mm512_reduce_add_ps(_mm512_add_ps(t0[r], t1[r])) + dot_f32_avx512(br, xsum, G);
  }
}

// ss[r][b] = the group's scale of output row n + r times x's block scale xs[b], for R rows.
template <int R>
MLXINFER_VNNI inline void block_scales(const Problem& p, int n, const float* xs, float* ss) {
  const int blocks = p.K / kBlock, G = p.K / p.gs, per_group = p.gs / kBlock;
  for (int r = 0; r < R; ++r) {
    const float* sr = p.scales + static_cast<size_t>(n + r) * G;
    float* out = ss + static_cast<size_t>(r) * blocks;
    if (per_group == 1) {
      for (int b = 0; b < blocks; b += 16) {
        const __mmask16 k = blocks - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (blocks - b)) - 1);
        _mm512_mask_storeu_ps(out + b, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sr + b),
                                                        _mm512_maskz_loadu_ps(k, xs + b)));
      }
    } else {
      for (int b = 0; b < blocks; ++b) {
        out[b] = sr[b / per_group] * xs[b];
      }
    }
  }
}

// Round K up to a multiple of 64: the byte rows' stride (row_codes writes whole 64s).
inline int padded64(int K) {
  return (K + 63) / 64 * 64;
}

// lay_tile for int8 activations (bytes): the 32 rows' codes as bytes to `rows` (32 x padded64(K)), then
// each half's 16 rows transposed by quads (4 bytes: one int32) 16 at a time, so vector c holds
// quad c of the 16 outputs; `tile` holds padded64(K) / 4 quads (the last ones' zeros unread).
MLXINFER_VNNI void lay_tile(const Problem& p, int n0, uint8_t* tile, float* ts, float* tb,
                               uint8_t* rows) {
  const CodesFn<uint8_t> codes = codes_fn<uint8_t>(p.bits);
  const size_t row_bytes = static_cast<size_t>(p.K) * p.bits / 8;
  const int G = p.K / p.gs, stride = padded64(p.K);
  const auto* w = reinterpret_cast<const uint8_t*>(p.w);
  for (int j = 0; j < kTile; ++j) {
    codes(w + (n0 + j) * row_bytes, rows + static_cast<size_t>(j) * stride, p.K);
    for (int g = 0; g < G; ++g) {
      ts[g * kTile + j] = p.scales[static_cast<size_t>(n0 + j) * G + g];
      tb[g * kTile + j] = p.biases[static_cast<size_t>(n0 + j) * G + g];
    }
  }
  for (int Q0 = 0; Q0 < stride / 4; Q0 += 16) {
    for (int half = 0; half < 2; ++half) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        r[j] = _mm512_loadu_si512(rows + static_cast<size_t>(16 * half + j) * stride + 4 * Q0);
      }
      transpose16(r);
      for (int c = 0; c < 16; ++c) {
        _mm512_store_si512(tile + (static_cast<size_t>(Q0 + c) * 2 + half) * 2 * kTile, r[c]);
      }
    }
  }
}

// Blocks blk and blk + 1 (`two`: else blk alone) of R output rows (their codes as bytes, 64 a
// load) against x's int8: one vpdpbusd, lanes 0-7 the first block's sums, 8-15 the second's,
// each scaled by its block's ss.
template <int R>
MLXINFER_VNNI inline void few_step_i8(const uint8_t* codes, size_t stride, const float* ss,
                                      const int8_t* x8, int blocks, int blk, bool two,
                                      __m512 (&t)[R]) {
  const __mmask64 k = two ? ~__mmask64{0} : 0xFFFFFFFFull;
  const __m512i xv = _mm512_maskz_loadu_epi8(k, x8 + blk * kBlock);
  for (int r = 0; r < R; ++r) {
    const __m512i c = _mm512_maskz_loadu_epi8(k, codes + r * stride + blk * kBlock);
    const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, xv);
    const float* sr = ss + r * blocks + blk;
    const __m512 sv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sr[0]),
                                           _mm512_set1_ps(two ? sr[1] : 0.0f));
    t[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, t[r]);
  }
}

// few_rows for int8 activations: each output row's codes as bytes (8-bit: read in place), two
// blocks a vpdpbusd, then the biases' term from the rounded x's sums.
template <int BITS, int R>
MLXINFER_VNNI void few_rows_i8(const Problem& p, int n, uint8_t* codes, float* ss) {
  const int blocks = p.K / kBlock;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const auto* w = reinterpret_cast<const uint8_t*>(p.w) + static_cast<size_t>(n) * row_bytes;
  const uint8_t* rows = w;
  size_t stride = row_bytes;
  if constexpr (BITS != 8) {
    stride = padded64(p.K);
    for (int r = 0; r < R; ++r) {
      row_codes<BITS, uint8_t>(w + r * row_bytes, codes + static_cast<size_t>(r) * stride, p.K);
    }
    rows = codes;
  }
  const int ahead = fetch_scales_ahead<R>(p, n, row_bytes); // as few_rows
  for (int m = 0; m < p.M; ++m) {
    const int8_t* x8 = p.x8 + static_cast<size_t>(m) * p.K;
    const float* xs = p.xscale + static_cast<size_t>(m) * blocks;
    block_scales<R>(p, n, xs, ss);
    __m512 t0[R], t1[R];
    for (int r = 0; r < R; ++r) {
      t0[r] = t1[r] = _mm512_setzero_ps();
    }
    const auto* next = reinterpret_cast<const char*>(w) + static_cast<size_t>(ahead) * row_bytes;
    const bool fetch = m == 0 && n + ahead + R <= p.N;
    int b = 0;
    for (; b + 4 <= blocks; b += 4) {
      if (fetch) {
        for (int r = 0; r < R; ++r) {
          _mm_prefetch(next + r * row_bytes + static_cast<size_t>(b) * kBlock * BITS / 8, _MM_HINT_T0);
          _mm_prefetch(next + r * row_bytes + static_cast<size_t>(b + 2) * kBlock * BITS / 8,
                       _MM_HINT_T0);
        }
      }
      few_step_i8<R>(rows, stride, ss, x8, blocks, b, true, t0);
      few_step_i8<R>(rows, stride, ss, x8, blocks, b + 2, true, t1);
    }
    for (; b < blocks; b += 2) {
      few_step_i8<R>(rows, stride, ss, x8, blocks, b, b + 2 <= blocks, t0);
    }
    few_outputs<R>(p, m, n, t0, t1);
  }
}

template <int BITS>
MLXINFER_VNNI void few_rows_span_i8(const Problem& p, int n0, int n1) {
  constexpr int R = 4;
  aligned_vector<uint8_t> codes(BITS == 8 ? 0 : static_cast<size_t>(R) * padded64(p.K));
  std::vector<float> ss(static_cast<size_t>(R) * (p.K / kBlock));
  int n = n0;
  for (; n + R <= n1; n += R) {
    few_rows_i8<BITS, R>(p, n, codes.data(), ss.data());
  }
  for (; n < n1; ++n) {
    few_rows_i8<BITS, 1>(p, n, codes.data(), ss.data());
  }
}

// Block `blk` of R output rows against x's block: t[r] += float(codes . xq) * ss[r][blk].
template <int BITS, int R>
MLXINFER_VNNI inline void few_step(const Problem& p, const uint8_t* w, size_t row_bytes,
                                   const int16_t* codes, const float* ss, const int16_t* xq,
                                   int blocks, int blk, __m512 (&t)[R]) {
  const __m512i xv = _mm512_loadu_si512(xq + blk * kBlock);
  for (int r = 0; r < R; ++r) {
    __m512i c;
    if constexpr (BITS == 8) {
      c = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + blk * kBlock)));
    } else {
      c = _mm512_loadu_si512(codes + static_cast<size_t>(r) * p.K + blk * kBlock);
    }
    const __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), c, xv);
    t[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(ss[r * blocks + blk]), t[r]);
  }
}

// A few rows of x (a decode step's): no tiles. Each output row's codes are widened in order
// (8-bit: straight from memory by vpmovzxbw; other widths through row_codes into `codes`) and
// each block of 32 is one vpdpwssd against x's block, its int32 lanes converted and scaled by
// the group's scale times the block's x scale (`ss`, per output row), two float accumulators a
// row; then the biases' term as in tile_rows. R output rows a pass for independent chains.
template <int BITS, int R>
MLXINFER_VNNI void few_rows(const Problem& p, int n, int16_t* codes, float* ss) {
  const int blocks = p.K / kBlock;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const auto* w = reinterpret_cast<const uint8_t*>(p.w) + static_cast<size_t>(n) * row_bytes;
  if constexpr (BITS != 8) {
    for (int r = 0; r < R; ++r) {
      row_codes<BITS>(w + r * row_bytes, codes + static_cast<size_t>(r) * p.K, p.K);
    }
  }
  const int ahead = fetch_scales_ahead<R>(p, n, row_bytes);
  for (int m = 0; m < p.M; ++m) {
    const int16_t* xq = p.xq + static_cast<size_t>(m) * p.K;
    const float* xs = p.xscale + static_cast<size_t>(m) * blocks;
    block_scales<R>(p, n, xs, ss);
    __m512 t0[R], t1[R];
    for (int r = 0; r < R; ++r) {
      t0[r] = t1[r] = _mm512_setzero_ps();
    }
    int b = 0;
    const auto* next = reinterpret_cast<const char*>(w) + static_cast<size_t>(ahead) * row_bytes;
    const bool fetch = m == 0 && n + ahead + R <= p.N;
    for (; b + 2 <= blocks; b += 2) {
      if (fetch) { // a line (8-bit: 64 codes) of each row's codes, spread over the pass
        for (int r = 0; r < R; ++r) {
          _mm_prefetch(next + r * row_bytes + static_cast<size_t>(b) * kBlock * BITS / 8, _MM_HINT_T0);
        }
      }
      few_step<BITS, R>(p, w, row_bytes, codes, ss, xq, blocks, b, t0);
      few_step<BITS, R>(p, w, row_bytes, codes, ss, xq, blocks, b + 1, t1);
    }
    if (b < blocks) {
      few_step<BITS, R>(p, w, row_bytes, codes, ss, xq, blocks, b, t0);
    }
    few_outputs<R>(p, m, n, t0, t1);
  }
}

template <int BITS>
MLXINFER_VNNI void few_rows_span(const Problem& p, int n0, int n1) {
  constexpr int R = 4;
  aligned_vector<int16_t> codes(BITS == 8 ? 0 : static_cast<size_t>(R) * p.K);
  std::vector<float> ss(static_cast<size_t>(R) * (p.K / kBlock));
  int n = n0;
  for (; n + R <= n1; n += R) {
    few_rows<BITS, R>(p, n, codes.data(), ss.data());
  }
  for (; n < n1; ++n) {
    few_rows<BITS, 1>(p, n, codes.data(), ss.data());
  }
}

void run_few(const Problem& p) {
  using Fn = void (*)(const Problem&, int, int);
  Fn fn = p.x8 != nullptr
      ? (p.bits == 2   ? few_rows_span_i8<2>
             : p.bits == 3 ? few_rows_span_i8<3>
             : p.bits == 4 ? few_rows_span_i8<4>
             : p.bits == 5 ? few_rows_span_i8<5>
             : p.bits == 6 ? few_rows_span_i8<6>
                           : few_rows_span_i8<8>)
      : p.bits == 2 ? few_rows_span<2>
      : p.bits == 3 ? few_rows_span<3>
      : p.bits == 4 ? few_rows_span<4>
      : p.bits == 5 ? few_rows_span<5>
      : p.bits == 6 ? few_rows_span<6>
                    : few_rows_span<8>;
  const size_t bytes = static_cast<size_t>(p.N) * p.K * p.bits / 8;
  parallel_rows(p.N, 8, bytes, [&](int n0, int n1) { fn(p, n0, n1); });
}

// Many rows through tiles laid per product: int16 codes (x in int16) or bytes (int8 x).
template <typename T>
void run_tiles(const Problem& p) {
  const size_t bytes = static_cast<size_t>(p.N) * p.K * p.bits / 8;
  parallel_rows(p.N, kTile, bytes, [&](int n0, int n1) {
    const int G = p.K / p.gs, stride = std::is_same_v<T, uint8_t> ? padded64(p.K) : p.K;
    aligned_vector<T> tile(static_cast<size_t>(stride) * kTile), rows(tile.size());
    aligned_vector<float> ts(static_cast<size_t>(G) * kTile), tb(ts.size());
    for (int n = n0; n < n1; n += kTile) {
      lay_tile(p, n, tile.data(), ts.data(), tb.data(), rows.data());
      int m = 0;
      for (; m + 4 <= p.M; m += 4) {
        tile_rows<4, T>(p, tile.data(), ts.data(), tb.data(), m, n);
      }
      switch (p.M - m) {
        case 3:
          tile_rows<3, T>(p, tile.data(), ts.data(), tb.data(), m, n);
          break;
        case 2:
          tile_rows<2, T>(p, tile.data(), ts.data(), tb.data(), m, n);
          break;
        case 1:
          tile_rows<1, T>(p, tile.data(), ts.data(), tb.data(), m, n);
          break;
        default:
          break;
      }
    }
  });
}

void run(const Problem& p) {
  if (p.M <= kFewRows) {
    return run_few(p);
  }
  if (p.x8 != nullptr) {
    return run_tiles<uint8_t>(p);
  }
  run_tiles<int16_t>(p);
}

// What a product reads besides x: the codes (contiguous), the scales and biases as f32 (read in
// place where they are f32 and contiguous: a 262k-row head's are 42 MB; else converted), and x's
// rows as int16 blocks with their scales and group sums. p.N, K, M, gs, bits and x are set.
struct Operands {
  std::vector<float> sf, bf;
  std::vector<uint32_t> wcopy;
  aligned_vector<int16_t> xq;
  aligned_vector<int8_t> x8;
  std::vector<float> xscale, xsum;

  void prepare(Problem& p, const mx::array& w, const mx::array& sc, const mx::array& bi) {
    const bool in_place = sc.dtype() == mx::float32 && sc.flags().row_contiguous &&
        bi.dtype() == mx::float32 && bi.flags().row_contiguous;
    if (!in_place) {
      sf.resize(sc.size());
      bf.resize(bi.size());
      to_f32(sc, sf.data());
      to_f32(bi, bf.data());
    }
    p.w = contiguous_words(w, wcopy);
    p.scales = in_place ? sc.data<float>() : sf.data();
    p.biases = in_place ? bi.data<float>() : bf.data();
    const int blocks = p.K / kBlock, G = p.K / p.gs;
    const bool i8 = int8_activations(); // x in int8 (set_int8_activations), else int16
    if (i8) {
      x8.resize(static_cast<size_t>(p.M) * p.K);
    } else {
      xq.resize(static_cast<size_t>(p.M) * p.K);
    }
    xscale.resize(static_cast<size_t>(p.M) * blocks);
    xsum.resize(static_cast<size_t>(p.M) * G);
    for (int m = 0; m < p.M; ++m) {
      float* xs = xscale.data() + static_cast<size_t>(m) * blocks;
      float* sums = xsum.data() + static_cast<size_t>(m) * G;
      if (i8) {
        i16::prepare_row_i8(p, m, x8.data() + static_cast<size_t>(m) * p.K, xs, sums);
      } else {
        prepare_row(p, m, xq.data() + static_cast<size_t>(m) * p.K, xs, sums);
      }
    }
    p.x8 = i8 ? x8.data() : nullptr;
    p.xq = xq.data();
    p.xscale = xscale.data();
    p.xsum = xsum.data();
  }
};

#endif // MLXINFER_X86

class QuantizedMatmulI16 : public mx::UnaryPrimitive {
 public:
  QuantizedMatmulI16(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer quantized_matmul_i16] has no GPU kernel");
  }
  const char* name() const override {
    return "MlxinferQuantizedMatmulI16";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmulI16&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_;
  int bits_;
};

void QuantizedMatmulI16::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = encoder_for(stream(), inputs, out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                    w = mx::array::unsafe_weak_copy(inputs[1]),
                    sc = mx::array::unsafe_weak_copy(inputs[2]),
                    bi = mx::array::unsafe_weak_copy(inputs[3]),
                    out = mx::array::unsafe_weak_copy(out),
                    gs = group_size_,
                    bits = bits_]() mutable {
#if defined(MLXINFER_X86)
    Problem p;
    p.N = w.shape(0);
    p.K = static_cast<int>(static_cast<int64_t>(w.shape(1)) * 32 / bits);
    p.M = p.K == 0 ? 0 : static_cast<int>(x.size() / p.K);
    p.gs = gs;
    p.bits = bits;
    if (p.M == 0 || p.N == 0) {
      return;
    }
    aligned_vector<float> xf(x.size());
    to_f32(x, xf.data());
    p.x = xf.data();
    Operands operands;
    operands.prepare(p, w, sc, bi);
    const bool direct = out.dtype() == mx::float32;
    std::vector<float> yf(direct ? 0 : out.size());
    p.y = direct ? out.data<float>() : yf.data();
    run(p);
    if (!direct) {
      write_out(yf.data(), out);
    }
#else
    throw std::runtime_error("[mlxinfer quantized_matmul_i16] needs AVX-512 VNNI (x86-64)");
#endif
  });
}

std::atomic<int> g_int16_decode_rows{0};

} // namespace

bool vnni_available() {
  return g_vnni && current_isa() == kAvx512 && vbmi_allowed();
}

void set_int16_decode_rows(int rows) {
  g_int16_decode_rows.store(std::clamp(rows, 0, kFewRows), std::memory_order_relaxed);
}

int int16_decode_rows() {
  return g_int16_decode_rows.load(std::memory_order_relaxed);
}

bool int16_decode(const float* x, int M, const mx::array& w, const mx::array& sc,
                  const mx::array& bi, int gs, int bits, int mode, float* y) {
#if defined(MLXINFER_X86)
  if (M < 1 || M > int16_decode_rows() || mode != kAffine || !vnni_available() ||
      !(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8) ||
      !(gs == 32 || gs == 64 || gs == 128)) {
    return false;
  }
  Problem p;
  p.N = w.shape(0);
  p.K = static_cast<int>(static_cast<int64_t>(w.shape(1)) * 32 / bits);
  p.M = M;
  p.gs = gs;
  p.bits = bits;
  if (p.K % gs != 0 || p.N == 0) {
    return false;
  }
  p.x = x;
  Operands operands;
  operands.prepare(p, w, sc, bi);
  p.y = y;
  run_few(p);
  return true;
#else
  (void)x, (void)M, (void)w, (void)sc, (void)bi, (void)gs, (void)bits, (void)mode, (void)y;
  return false;
#endif
}

mx::array quantized_matmul_i16(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  const char* op = "[mlxinfer quantized_matmul_i16] ";
  if (!vnni_available()) {
    throw std::invalid_argument(std::string(op) +
                                "needs AVX-512 F, BW, VNNI and VBMI at the kernels' ISA level, found " +
                                isa_name(current_isa()) + (g_vnni ? "" : " without VNNI or VBMI"));
  }
  const int64_t K = check_affine(op, w, scales, biases, group_size, bits);
  if (w.shape(0) % kTile != 0) {
    throw std::invalid_argument(std::string(op) + "w: expected a multiple of 32 rows, found shape " +
                                shape_str(w.shape()));
  }
  const int N = w.shape(0);
  if (x.ndim() < 1 || x.shape(-1) != K || !is_float(x.dtype())) {
    throw std::invalid_argument(std::string(op) + "x: expected a float array of shape (..., " +
                                std::to_string(K) + "), found " + shape_str(x.shape()));
  }
  if (stream.device == mx::Device::gpu) {
    return mx::quantized_matmul(x, w, scales, biases, true, group_size, bits, "affine", stream);
  }
  auto out_shape = x.shape();
  out_shape.back() = N;
  return mx::array(out_shape, mx::promote_types(x.dtype(), scales.dtype()),
                   std::make_shared<QuantizedMatmulI16>(stream, group_size, bits),
                   {x, w, scales, biases});
}

} // namespace mlxinfer
