// The kernels. Each output row n streams its packed weights once and multiplies them
// with up to four rows of x held in cache; the 4-bit and 8-bit codes are widened to
// f32 in registers (never written out dequantized).
//
// Per group g of a row: sum_k x_k (s_g q_k + b_g) = s_g * sum_k x_k q_k + b_g * sum_k x_k,
// so the inner loop is one FMA per weight and the bias term costs one FMA per group.
#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define MLXINFER_X86 1
#endif

namespace mlxinfer {

namespace {

Isa detect_isa() {
#if defined(MLXINFER_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return __builtin_cpu_supports("avx512f") ? kAvx512 : kAvx2;
  }
#endif
  return kScalar;
}

const Isa g_best = detect_isa();
std::atomic<int> g_max{kAvx512};

bool detect_f16c() {
#if defined(MLXINFER_X86)
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// The matvec's vector paths widen float16 with F16C (every AVX2 CPU has it; checked anyway).
const bool g_f16c = detect_f16c();

// Scalar widening of the 16-bit float types (bit-exact: both fit in f32).
inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_f32(uint16_t h) {
  return bits_to_f32(static_cast<uint32_t>(h) << 16);
}

// F. Giesen's half_to_float_fast5: exact for every value, branches only for inf/nan and
// zero/subnormals (rare in weights), so the widening loop stays cheap.
inline float f16_to_f32(uint16_t h) {
  constexpr uint32_t shifted_exp = 0x7C00u << 13;
  uint32_t u = static_cast<uint32_t>(h & 0x7FFFu) << 13;
  const uint32_t exp = shifted_exp & u;
  u += (127 - 15) << 23;
  if (exp == shifted_exp) { // inf / nan
    u += (128 - 16) << 23;
  } else if (exp == 0) { // zero / subnormal: renormalised by a subtraction
    u += 1u << 23;
    u = std::bit_cast<uint32_t>(std::bit_cast<float>(u) - std::bit_cast<float>(113u << 23));
  }
  return bits_to_f32(u | static_cast<uint32_t>(h & 0x8000u) << 16);
}

template <WeightType WT>
inline float weight_at(const void* w, size_t i) {
  if constexpr (WT == kF32) {
    return static_cast<const float*>(w)[i];
  } else if constexpr (WT == kBF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(w)[i]);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(w)[i]);
  }
}

// ----------------------------------------------------------------------------
// Portable path
// ----------------------------------------------------------------------------

void qmv_rows_scalar(const QmvProblem& p, int n0, int n1) {
  const int G = p.K / p.group_size;
  const int per_word = 32 / p.bits;
  const uint32_t mask = (1u << p.bits) - 1u;
  const int words_per_row = p.K / per_word;
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = p.w + static_cast<size_t>(n) * words_per_row;
    const float* s = p.scales + static_cast<size_t>(n) * G;
    const float* b = p.biases + static_cast<size_t>(n) * G;
    for (int m = 0; m < p.M; ++m) {
      const float* x = p.x + static_cast<size_t>(m) * p.K;
      const float* xs = p.xsum + static_cast<size_t>(m) * G;
      float total = 0.0f;
      for (int g = 0; g < G; ++g) {
        float acc = 0.0f;
        const int k0 = g * p.group_size;
        for (int k = k0; k < k0 + p.group_size; ++k) {
          uint32_t word = wr[k / per_word];
          float q = static_cast<float>((word >> ((k % per_word) * p.bits)) & mask);
          acc += x[k] * q;
        }
        total += s[g] * acc + b[g] * xs[g];
      }
      p.y[static_cast<size_t>(m) * p.N + n] = total;
    }
  }
}

// A row of 16-bit weights is widened once into `row` and then read by every x row.
template <WeightType WT>
void matvec_rows_scalar(const MatvecProblem& p, int n0, int n1) {
  std::vector<float> row(WT == kF32 ? 0 : p.K);
  for (int n = n0; n < n1; ++n) {
    const size_t off = static_cast<size_t>(n) * p.K;
    const float* wr;
    if constexpr (WT == kF32) {
      wr = static_cast<const float*>(p.w) + off;
    } else {
      for (int k = 0; k < p.K; ++k) {
        row[k] = weight_at<WT>(p.w, off + k);
      }
      wr = row.data();
    }
    for (int m = 0; m < p.M; ++m) {
      const float* x = p.x + static_cast<size_t>(m) * p.K;
      float acc = 0.0f;
      for (int k = 0; k < p.K; ++k) {
        acc += x[k] * wr[k];
      }
      p.y[static_cast<size_t>(m) * p.N + n] = acc;
    }
  }
}

// ----------------------------------------------------------------------------
// AVX2 + FMA path (compiled for that target, chosen at run time)
// ----------------------------------------------------------------------------
#if defined(MLXINFER_X86)

#define MLXINFER_AVX2 __attribute__((target("avx2,fma")))

MLXINFER_AVX2 inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

// One 16-weight chunk as two vectors of 8 f32 codes, matched with xp[0:8], xp[8:16].
// 4-bit: 8 bytes hold 16 codes; low nibbles are the even k, high nibbles the odd k
// (xp is x de-interleaved to match). 8-bit: two runs of 8 bytes, k in order (xp == x).
template <int BITS>
MLXINFER_AVX2 inline void unpack16(const uint8_t* src, __m256& a, __m256& b) {
  if constexpr (BITS == 4) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
    a = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
    b = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  } else {
    a = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
    b = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8))));
  }
}

// M rows of x against one output row. U chunks of 16 per step (independent
// accumulators hide the FMA latency when M is small).
template <int BITS, int M, int U>
MLXINFER_AVX2 void qmv_row_avx2(
    const QmvProblem& p,
    const uint8_t* wr,
    const float* s,
    const float* b,
    int m0,
    int n) {
  const int G = p.K / p.group_size;
  const int gs = p.group_size;
  constexpr int bytes16 = 16 * BITS / 8; // bytes per 16 codes
  __m256 tot[M];
  float bias_part[M];
  for (int m = 0; m < M; ++m) {
    tot[m] = _mm256_setzero_ps();
    bias_part[m] = 0.0f;
  }
  const float* xrow[M];
  for (int m = 0; m < M; ++m) {
    xrow[m] = p.xp + static_cast<size_t>(m0 + m) * p.K;
  }
  for (int g = 0; g < G; ++g) {
    __m256 acc[M][2 * U];
    for (int m = 0; m < M; ++m) {
      for (int u = 0; u < 2 * U; ++u) {
        acc[m][u] = _mm256_setzero_ps();
      }
    }
    const int k0 = g * gs;
    const uint8_t* wg = wr + static_cast<size_t>(k0) * BITS / 8;
    for (int c = 0; c < gs; c += 16 * U) {
      for (int u = 0; u < U; ++u) {
        __m256 qa, qb;
        unpack16<BITS>(wg + (c / 16 + u) * bytes16, qa, qb);
        for (int m = 0; m < M; ++m) {
          const float* xk = xrow[m] + k0 + c + 16 * u;
          acc[m][2 * u] = _mm256_fmadd_ps(qa, _mm256_loadu_ps(xk), acc[m][2 * u]);
          acc[m][2 * u + 1] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(xk + 8), acc[m][2 * u + 1]);
        }
      }
    }
    const __m256 sv = _mm256_set1_ps(s[g]);
    for (int m = 0; m < M; ++m) {
      __m256 a = acc[m][0];
      for (int u = 1; u < 2 * U; ++u) {
        a = _mm256_add_ps(a, acc[m][u]);
      }
      tot[m] = _mm256_fmadd_ps(a, sv, tot[m]);
      bias_part[m] += b[g] * p.xsum[static_cast<size_t>(m0 + m) * G + g];
    }
  }
  for (int m = 0; m < M; ++m) {
    p.y[static_cast<size_t>(m0 + m) * p.N + n] = hsum256(tot[m]) + bias_part[m];
  }
}

// One row of x against R output rows at once (decode), as qmv_rows1_avx512.
template <int BITS, int R>
MLXINFER_AVX2 void qmv_rows1_avx2(const QmvProblem& p, const uint8_t* w, size_t row_bytes, int n) {
  const int G = p.K / p.group_size;
  const int gs = p.group_size;
  __m256 tot[R][2];
  float bias_part[R];
  const uint8_t* wr[R];
  const float* sr[R];
  const float* br[R];
  for (int r = 0; r < R; ++r) {
    tot[r][0] = tot[r][1] = _mm256_setzero_ps();
    bias_part[r] = 0.0f;
    wr[r] = w + (n + r) * row_bytes;
    sr[r] = p.scales + static_cast<size_t>(n + r) * G;
    br[r] = p.biases + static_cast<size_t>(n + r) * G;
  }
  for (int g = 0; g < G; ++g) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    const int k0 = g * gs;
    for (int c = 0; c < gs; c += 16) {
      const float* xk = p.xp + k0 + c;
      const __m256 xa = _mm256_loadu_ps(xk), xb = _mm256_loadu_ps(xk + 8);
      const size_t off = static_cast<size_t>(k0 + c) * BITS / 8;
      for (int r = 0; r < R; ++r) {
        __m256 qa, qb;
        unpack16<BITS>(wr[r] + off, qa, qb);
        acc[r][0] = _mm256_fmadd_ps(qa, xa, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qb, xb, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 sv = _mm256_set1_ps(sr[r][g]);
      tot[r][0] = _mm256_fmadd_ps(acc[r][0], sv, tot[r][0]);
      tot[r][1] = _mm256_fmadd_ps(acc[r][1], sv, tot[r][1]);
      bias_part[r] += br[r][g] * p.xsum[g];
    }
  }
  for (int r = 0; r < R; ++r) {
    p.y[n + r] = hsum256(_mm256_add_ps(tot[r][0], tot[r][1])) + bias_part[r];
  }
}

template <int BITS>
MLXINFER_AVX2 void qmv_rows_avx2(const QmvProblem& p, int n0, int n1) {
  const int G = p.K / p.group_size;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w);
  if (p.M == 1) { // decode: two output rows per pass
    int n = n0;
    for (; n + 2 <= n1; n += 2) {
      qmv_rows1_avx2<BITS, 2>(p, w, row_bytes, n);
    }
    if (n < n1) {
      qmv_rows1_avx2<BITS, 1>(p, w, row_bytes, n);
    }
    return;
  }
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    const float* s = p.scales + static_cast<size_t>(n) * G;
    const float* b = p.biases + static_cast<size_t>(n) * G;
    // The row's weights stay in L1 across the chunks of x rows.
    int m = 0;
    for (; m + 4 <= p.M; m += 4) {
      qmv_row_avx2<BITS, 4, 1>(p, wr, s, b, m, n);
    }
    switch (p.M - m) {
      case 3:
        qmv_row_avx2<BITS, 3, 1>(p, wr, s, b, m, n);
        break;
      case 2:
        qmv_row_avx2<BITS, 2, 2>(p, wr, s, b, m, n);
        break;
      case 1:
        qmv_row_avx2<BITS, 1, 2>(p, wr, s, b, m, n);
        break;
      default:
        break;
    }
  }
}

#define MLXINFER_AVX512 __attribute__((target("avx512f,avx2,fma")))
// Output rows per pass of a one-row (decode) product: 2 beat 1 and 4 on this machine
// (csrc/README.md, "Measured").
#ifndef QMV_R
#define QMV_R 2
#endif

// One 32-weight chunk as two vectors of 16 f32 codes, matched with xp[0:16], xp[16:32]
// (4-bit: xp de-interleaved per 32; 8-bit: in order).
template <int BITS>
MLXINFER_AVX512 inline void unpack32(const uint8_t* src, __m512& a, __m512& b) {
  if constexpr (BITS == 4) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    a = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
    b = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  } else {
    a = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
    b = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
  }
}

template <int BITS, int M, int U>
MLXINFER_AVX512 void qmv_row_avx512(
    const QmvProblem& p,
    const uint8_t* wr,
    const float* s,
    const float* b,
    int m0,
    int n) {
  const int G = p.K / p.group_size;
  const int gs = p.group_size;
  constexpr int bytes32 = 32 * BITS / 8;
  // A running total per accumulator: each group's partial products are scaled into it
  // (no dependent adds per group, and registers only: indexing totals by the group's
  // parity kept them on the stack, a store-to-load chain per group).
  __m512 tot[M][2 * U];
  float bias_part[M];
  const float* xrow[M];
  for (int m = 0; m < M; ++m) {
    for (int u = 0; u < 2 * U; ++u) {
      tot[m][u] = _mm512_setzero_ps();
    }
    bias_part[m] = 0.0f;
    xrow[m] = p.xp + static_cast<size_t>(m0 + m) * p.K;
  }
  for (int g = 0; g < G; ++g) {
    __m512 acc[M][2 * U];
    for (int m = 0; m < M; ++m) {
      for (int u = 0; u < 2 * U; ++u) {
        acc[m][u] = _mm512_setzero_ps();
      }
    }
    const int k0 = g * gs;
    const uint8_t* wg = wr + static_cast<size_t>(k0) * BITS / 8;
    for (int c = 0; c < gs; c += 32 * U) {
      for (int u = 0; u < U; ++u) {
        __m512 qa, qb;
        unpack32<BITS>(wg + (c / 32 + u) * bytes32, qa, qb);
        for (int m = 0; m < M; ++m) {
          const float* xk = xrow[m] + k0 + c + 32 * u;
          acc[m][2 * u] = _mm512_fmadd_ps(qa, _mm512_loadu_ps(xk), acc[m][2 * u]);
          acc[m][2 * u + 1] = _mm512_fmadd_ps(qb, _mm512_loadu_ps(xk + 16), acc[m][2 * u + 1]);
        }
      }
    }
    const __m512 sv = _mm512_set1_ps(s[g]);
    for (int m = 0; m < M; ++m) {
      for (int u = 0; u < 2 * U; ++u) {
        tot[m][u] = _mm512_fmadd_ps(acc[m][u], sv, tot[m][u]);
      }
      bias_part[m] += b[g] * p.xsum[static_cast<size_t>(m0 + m) * G + g];
    }
  }
  for (int m = 0; m < M; ++m) {
    __m512 t = tot[m][0];
    for (int u = 1; u < 2 * U; ++u) {
      t = _mm512_add_ps(t, tot[m][u]);
    }
    p.y[static_cast<size_t>(m0 + m) * p.N + n] = _mm512_reduce_add_ps(t) + bias_part[m];
  }
}

// One row of x against R output rows at once (decode): x's two vectors per chunk are
// loaded once for the R rows, and the per-group work (scale, bias) of the R rows overlaps.
template <int BITS, int R, int U>
MLXINFER_AVX512 void qmv_rows1_avx512(
    const QmvProblem& p,
    const uint8_t* w,
    size_t row_bytes,
    int n) {
  const int G = p.K / p.group_size;
  const int gs = p.group_size;
  __m512 tot[R][2 * U];
  float bias_part[R];
  const uint8_t* wr[R];
  const float* sr[R];
  const float* br[R];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < 2 * U; ++u) {
      tot[r][u] = _mm512_setzero_ps();
    }
    bias_part[r] = 0.0f;
    wr[r] = w + (n + r) * row_bytes;
    sr[r] = p.scales + static_cast<size_t>(n + r) * G;
    br[r] = p.biases + static_cast<size_t>(n + r) * G;
  }
  for (int g = 0; g < G; ++g) {
    __m512 acc[R][2 * U];
    for (int r = 0; r < R; ++r) {
      for (int u = 0; u < 2 * U; ++u) {
        acc[r][u] = _mm512_setzero_ps();
      }
    }
    const int k0 = g * gs;
    for (int c = 0; c < gs; c += 32 * U) {
      for (int u = 0; u < U; ++u) {
        const float* xk = p.xp + k0 + c + 32 * u;
        const __m512 xa = _mm512_loadu_ps(xk), xb = _mm512_loadu_ps(xk + 16);
        const size_t off = static_cast<size_t>(k0 + c + 32 * u) * BITS / 8;
        for (int r = 0; r < R; ++r) {
          __m512 qa, qb;
          unpack32<BITS>(wr[r] + off, qa, qb);
          acc[r][2 * u] = _mm512_fmadd_ps(qa, xa, acc[r][2 * u]);
          acc[r][2 * u + 1] = _mm512_fmadd_ps(qb, xb, acc[r][2 * u + 1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sv = _mm512_set1_ps(sr[r][g]);
      for (int u = 0; u < 2 * U; ++u) {
        tot[r][u] = _mm512_fmadd_ps(acc[r][u], sv, tot[r][u]);
      }
      bias_part[r] += br[r][g] * p.xsum[g];
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 t = tot[r][0];
    for (int u = 1; u < 2 * U; ++u) {
      t = _mm512_add_ps(t, tot[r][u]);
    }
    p.y[n + r] = _mm512_reduce_add_ps(t) + bias_part[r];
  }
}

template <int BITS>
MLXINFER_AVX512 void qmv_rows_avx512(const QmvProblem& p, int n0, int n1) {
  const int G = p.K / p.group_size;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w);
  const bool wide = p.group_size >= 64; // two 32-chunks per step fit in a group
  if (p.M == 1) { // decode: output rows R at a time
    int n = n0;
    for (; n + QMV_R <= n1; n += QMV_R) {
      wide ? qmv_rows1_avx512<BITS, QMV_R, 2>(p, w, row_bytes, n)
           : qmv_rows1_avx512<BITS, QMV_R, 1>(p, w, row_bytes, n);
    }
    for (; n < n1; ++n) {
      qmv_rows1_avx512<BITS, 1, 1>(p, w, row_bytes, n);
    }
    return;
  }
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    const float* s = p.scales + static_cast<size_t>(n) * G;
    const float* b = p.biases + static_cast<size_t>(n) * G;
    int m = 0;
    for (; m + 4 <= p.M; m += 4) {
      qmv_row_avx512<BITS, 4, 1>(p, wr, s, b, m, n);
    }
    switch (p.M - m) {
      case 3:
        qmv_row_avx512<BITS, 3, 1>(p, wr, s, b, m, n);
        break;
      case 2:
        wide ? qmv_row_avx512<BITS, 2, 2>(p, wr, s, b, m, n)
             : qmv_row_avx512<BITS, 2, 1>(p, wr, s, b, m, n);
        break;
      case 1:
        wide ? qmv_row_avx512<BITS, 1, 2>(p, wr, s, b, m, n)
             : qmv_row_avx512<BITS, 1, 1>(p, wr, s, b, m, n);
        break;
      default:
        break;
    }
  }
}

// The matvec's vector paths: 16 (AVX2) or 32 (AVX-512) weights per unit, widened to two f32
// vectors: float32 loaded, bfloat16 shifted into place (the even k: the low halves of each
// 32-bit lane, shifted up; the odd k: the high halves, masked; x de-interleaved to match by
// matvec_prepare), float16 through F16C's vcvtph2ps. A unit is widened once for up to four
// x rows; the last K % unit weights are summed in scalar code (x in order there).
#define MLXINFER_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

template <WeightType WT>
MLXINFER_AVX2_F16C inline void widen16(const void* w, size_t k, __m256& a, __m256& b) {
  if constexpr (WT == kF32) {
    const float* f = static_cast<const float*>(w) + k;
    a = _mm256_loadu_ps(f);
    b = _mm256_loadu_ps(f + 8);
  } else if constexpr (WT == kBF16) {
    const __m256i v =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + k));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(w) + k;
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)));
  }
}

template <WeightType WT, int M, int U>
MLXINFER_AVX2_F16C void matvec_row_avx2(const MatvecProblem& p, int m0, int n) {
  const size_t row = static_cast<size_t>(n) * p.K;
  __m256 acc[M][2 * U];
  const float* xrow[M];
  for (int m = 0; m < M; ++m) {
    for (int u = 0; u < 2 * U; ++u) {
      acc[m][u] = _mm256_setzero_ps();
    }
    xrow[m] = p.x + static_cast<size_t>(m0 + m) * p.K;
  }
  int k = 0;
  for (; k + 16 * U <= p.K; k += 16 * U) {
    for (int u = 0; u < U; ++u) {
      __m256 a, b;
      widen16<WT>(p.w, row + k + 16 * u, a, b);
      for (int m = 0; m < M; ++m) {
        const float* xk = xrow[m] + k + 16 * u;
        acc[m][2 * u] = _mm256_fmadd_ps(a, _mm256_loadu_ps(xk), acc[m][2 * u]);
        acc[m][2 * u + 1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xk + 8), acc[m][2 * u + 1]);
      }
    }
  }
  for (; k + 16 <= p.K; k += 16) {
    __m256 a, b;
    widen16<WT>(p.w, row + k, a, b);
    for (int m = 0; m < M; ++m) {
      acc[m][0] = _mm256_fmadd_ps(a, _mm256_loadu_ps(xrow[m] + k), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xrow[m] + k + 8), acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m256 s = acc[m][0];
    for (int u = 1; u < 2 * U; ++u) {
      s = _mm256_add_ps(s, acc[m][u]);
    }
    float r = hsum256(s);
    for (int kk = k; kk < p.K; ++kk) {
      r += xrow[m][kk] * weight_at<WT>(p.w, row + kk);
    }
    p.y[static_cast<size_t>(m0 + m) * p.N + n] = r;
  }
}

// One x row against R output rows (as matvec_one_avx512), 32 weights per step.
template <WeightType WT, int R>
MLXINFER_AVX2_F16C void matvec_one_avx2(const MatvecProblem& p, int n) {
  constexpr size_t bytes = WT == kF32 ? 4 : 2;
  __m256 acc[R][2];
  size_t row[R];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    row[r] = static_cast<size_t>(n + r) * p.K;
  }
  const char* w = static_cast<const char*>(p.w);
  const size_t ahead = static_cast<size_t>(R) * p.K * bytes;
  const float* x = p.x;
  int k = 0;
  for (; k + 32 <= p.K; k += 32) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    const __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
    for (int r = 0; r < R; ++r) {
      const char* next = w + (row[r] + k) * bytes + ahead;
      _mm_prefetch(next, _MM_HINT_T0);
      if constexpr (bytes == 4) {
        _mm_prefetch(next + 64, _MM_HINT_T0);
      }
      __m256 a, b;
      widen16<WT>(p.w, row[r] + k, a, b);
      acc[r][0] = _mm256_fmadd_ps(a, x0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, x1, acc[r][1]);
      widen16<WT>(p.w, row[r] + k + 16, a, b);
      acc[r][0] = _mm256_fmadd_ps(a, x2, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, x3, acc[r][1]);
    }
  }
  for (; k + 16 <= p.K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int r = 0; r < R; ++r) {
      __m256 a, b;
      widen16<WT>(p.w, row[r] + k, a, b);
      acc[r][0] = _mm256_fmadd_ps(a, x0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, x1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
    for (int kk = k; kk < p.K; ++kk) {
      s += x[kk] * weight_at<WT>(p.w, row[r] + kk);
    }
    p.y[n + r] = s;
  }
}

template <WeightType WT>
MLXINFER_AVX2_F16C void matvec_rows_avx2(const MatvecProblem& p, int n0, int n1) {
  if (p.M == 1) {
    int n = n0;
    for (; n + 4 <= n1; n += 4) {
      matvec_one_avx2<WT, 4>(p, n);
    }
    for (; n < n1; ++n) {
      matvec_one_avx2<WT, 1>(p, n);
    }
    return;
  }
  for (int n = n0; n < n1; ++n) {
    // The row's weights stay in L1 across the chunks of x rows.
    int m = 0;
    for (; m + 4 <= p.M; m += 4) {
      matvec_row_avx2<WT, 4, 1>(p, m, n);
    }
    switch (p.M - m) {
      case 3:
        matvec_row_avx2<WT, 3, 1>(p, m, n);
        break;
      case 2:
        matvec_row_avx2<WT, 2, 2>(p, m, n);
        break;
      case 1:
        matvec_row_avx2<WT, 1, 4>(p, m, n);
        break;
      default:
        break;
    }
  }
}

#define MLXINFER_AVX512_F16C __attribute__((target("avx512f,avx2,fma,f16c")))

template <WeightType WT>
MLXINFER_AVX512_F16C inline void widen32(const void* w, size_t k, __m512& a, __m512& b) {
  if constexpr (WT == kF32) {
    const float* f = static_cast<const float*>(w) + k;
    a = _mm512_loadu_ps(f);
    b = _mm512_loadu_ps(f + 16);
  } else if constexpr (WT == kBF16) {
    const __m512i v = _mm512_loadu_si512(static_cast<const uint16_t*>(w) + k);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(w) + k;
    a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
    b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16)));
  }
}

template <WeightType WT, int M, int U>
MLXINFER_AVX512_F16C void matvec_row_avx512(const MatvecProblem& p, int m0, int n) {
  const size_t row = static_cast<size_t>(n) * p.K;
  __m512 acc[M][2 * U];
  const float* xrow[M];
  for (int m = 0; m < M; ++m) {
    for (int u = 0; u < 2 * U; ++u) {
      acc[m][u] = _mm512_setzero_ps();
    }
    xrow[m] = p.x + static_cast<size_t>(m0 + m) * p.K;
  }
  int k = 0;
  for (; k + 32 * U <= p.K; k += 32 * U) {
    for (int u = 0; u < U; ++u) {
      __m512 a, b;
      widen32<WT>(p.w, row + k + 32 * u, a, b);
      for (int m = 0; m < M; ++m) {
        const float* xk = xrow[m] + k + 32 * u;
        acc[m][2 * u] = _mm512_fmadd_ps(a, _mm512_loadu_ps(xk), acc[m][2 * u]);
        acc[m][2 * u + 1] = _mm512_fmadd_ps(b, _mm512_loadu_ps(xk + 16), acc[m][2 * u + 1]);
      }
    }
  }
  for (; k + 32 <= p.K; k += 32) {
    __m512 a, b;
    widen32<WT>(p.w, row + k, a, b);
    for (int m = 0; m < M; ++m) {
      acc[m][0] = _mm512_fmadd_ps(a, _mm512_loadu_ps(xrow[m] + k), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(b, _mm512_loadu_ps(xrow[m] + k + 16), acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m512 s = acc[m][0];
    for (int u = 1; u < 2 * U; ++u) {
      s = _mm512_add_ps(s, acc[m][u]);
    }
    float r = _mm512_reduce_add_ps(s);
    for (int kk = k; kk < p.K; ++kk) {
      r += xrow[m][kk] * weight_at<WT>(p.w, row + kk);
    }
    p.y[static_cast<size_t>(m0 + m) * p.N + n] = r;
  }
}

// One x row (decode) against R output rows at once: a unit of x is loaded once for the R
// rows, and the next R rows are prefetched a unit at a time (R streams: the hardware
// prefetcher alone left a DRAM-bound LM head ~20% slower than one row at a time).
template <WeightType WT, int R>
MLXINFER_AVX512_F16C void matvec_one_avx512(const MatvecProblem& p, int n) {
  constexpr size_t bytes = WT == kF32 ? 4 : 2;
  __m512 acc[R][2];
  size_t row[R];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    row[r] = static_cast<size_t>(n + r) * p.K;
  }
  const char* w = static_cast<const char*>(p.w);
  const size_t ahead = static_cast<size_t>(R) * p.K * bytes;
  const float* x = p.x;
  int k = 0;
  for (; k + 32 <= p.K; k += 32) {
    const __m512 xa = _mm512_loadu_ps(x + k);
    const __m512 xb = _mm512_loadu_ps(x + k + 16);
    for (int r = 0; r < R; ++r) {
      const char* next = w + (row[r] + k) * bytes + ahead;
      _mm_prefetch(next, _MM_HINT_T0);
      if constexpr (bytes == 4) {
        _mm_prefetch(next + 64, _MM_HINT_T0);
      }
      __m512 a, b;
      widen32<WT>(p.w, row[r] + k, a, b);
      acc[r][0] = _mm512_fmadd_ps(a, xa, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(b, xb, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
    for (int kk = k; kk < p.K; ++kk) {
      s += x[kk] * weight_at<WT>(p.w, row[r] + kk);
    }
    p.y[n + r] = s;
  }
}

template <WeightType WT>
MLXINFER_AVX512_F16C void matvec_rows_avx512(const MatvecProblem& p, int n0, int n1) {
  if (p.M == 1) {
    int n = n0;
    for (; n + 4 <= n1; n += 4) {
      matvec_one_avx512<WT, 4>(p, n);
    }
    for (; n < n1; ++n) {
      matvec_one_avx512<WT, 1>(p, n);
    }
    return;
  }
  for (int n = n0; n < n1; ++n) {
    int m = 0;
    for (; m + 4 <= p.M; m += 4) {
      matvec_row_avx512<WT, 4, 1>(p, m, n);
    }
    switch (p.M - m) {
      case 3:
        matvec_row_avx512<WT, 3, 1>(p, m, n);
        break;
      case 2:
        matvec_row_avx512<WT, 2, 2>(p, m, n);
        break;
      case 1:
        matvec_row_avx512<WT, 1, 4>(p, m, n);
        break;
      default:
        break;
    }
  }
}

#endif // MLXINFER_X86

} // namespace

Isa best_isa() {
  return g_best;
}

Isa current_isa() {
  return static_cast<Isa>(std::min<int>(g_best, g_max.load(std::memory_order_relaxed)));
}

void set_max_isa(Isa isa) {
  g_max.store(isa);
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case kAvx512:
      return "avx512";
    case kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

void qmv_prepare(const QmvProblem& p, float* xp, float* xsum) {
  const int G = p.K / p.group_size;
  for (int m = 0; m < p.M; ++m) {
    const float* x = p.x + static_cast<size_t>(m) * p.K;
    float* dst = xp + static_cast<size_t>(m) * p.K;
    if (p.bits == 4 && p.isa != kScalar) {
      // Per chunk (16 codes for AVX2, 32 for AVX-512): the even k first, then the odd k
      // (low nibbles, then high nibbles).
      const int chunk = p.isa == kAvx512 ? 32 : 16;
      for (int c = 0; c < p.K; c += chunk) {
        for (int i = 0; i < chunk / 2; ++i) {
          dst[c + i] = x[c + 2 * i];
          dst[c + chunk / 2 + i] = x[c + 2 * i + 1];
        }
      }
    } else {
      std::memcpy(dst, x, sizeof(float) * p.K);
    }
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
      for (int k = g * p.group_size; k < (g + 1) * p.group_size; ++k) {
        acc += x[k];
      }
      xsum[static_cast<size_t>(m) * G + g] = acc;
    }
  }
}

void qmv_rows(const QmvProblem& p, int n0, int n1) {
#if defined(MLXINFER_X86)
  if (p.isa == kAvx512) {
    if (p.bits == 4) {
      return qmv_rows_avx512<4>(p, n0, n1);
    }
    if (p.bits == 8) {
      return qmv_rows_avx512<8>(p, n0, n1);
    }
  }
  if (p.isa == kAvx2) {
    if (p.bits == 4) {
      return qmv_rows_avx2<4>(p, n0, n1);
    }
    if (p.bits == 8) {
      return qmv_rows_avx2<8>(p, n0, n1);
    }
  }
#endif
  qmv_rows_scalar(p, n0, n1);
}

Isa matvec_path(Isa isa) {
  return g_f16c ? isa : kScalar; // the vector paths are compiled with F16C, whatever the type
}

void matvec_prepare(const MatvecProblem& p, float* x) {
  if (p.wtype != kBF16 || p.isa == kScalar) {
    return;
  }
  const int chunk = p.isa == kAvx512 ? 32 : 16;
  const int whole = p.K - p.K % chunk; // the tail stays in order (summed in scalar code)
  float tmp[32];
  for (int m = 0; m < p.M; ++m) {
    float* row = x + static_cast<size_t>(m) * p.K;
    for (int c = 0; c < whole; c += chunk) {
      for (int i = 0; i < chunk / 2; ++i) {
        tmp[i] = row[c + 2 * i];
        tmp[chunk / 2 + i] = row[c + 2 * i + 1];
      }
      std::memcpy(row + c, tmp, sizeof(float) * chunk);
    }
  }
}

void matvec_rows(const MatvecProblem& p, int n0, int n1) {
#if defined(MLXINFER_X86)
  if (p.isa == kAvx512) {
    switch (p.wtype) {
      case kF32:
        return matvec_rows_avx512<kF32>(p, n0, n1);
      case kBF16:
        return matvec_rows_avx512<kBF16>(p, n0, n1);
      case kF16:
        return matvec_rows_avx512<kF16>(p, n0, n1);
    }
  }
  if (p.isa == kAvx2) {
    switch (p.wtype) {
      case kF32:
        return matvec_rows_avx2<kF32>(p, n0, n1);
      case kBF16:
        return matvec_rows_avx2<kBF16>(p, n0, n1);
      case kF16:
        return matvec_rows_avx2<kF16>(p, n0, n1);
    }
  }
#endif
  switch (p.wtype) {
    case kBF16:
      return matvec_rows_scalar<kBF16>(p, n0, n1);
    case kF16:
      return matvec_rows_scalar<kF16>(p, n0, n1);
    default:
      return matvec_rows_scalar<kF32>(p, n0, n1);
  }
}

} // namespace mlxinfer
