// The float kernels: y = x w^T for w float32, bfloat16 or float16, accumulated in f32; each
// output row streams its weights once against the rows of x.
#include "kernels.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

#include "simd.h"

namespace mlxinfer {

namespace {

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


#if defined(MLXINFER_X86)

// The matvec's vector paths: 16 (AVX2) or 32 (AVX-512) weights per unit, widened to two f32
// vectors: float32 loaded, bfloat16 shifted into place (the even k: the low halves of each
// 32-bit lane, shifted up; the odd k: the high halves, masked; x de-interleaved to match by
// matvec_prepare), float16 through F16C's vcvtph2ps. A unit is widened once for up to four
// x rows; the last K % unit weights are summed in scalar code (x in order there).

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

Isa matvec_path(Isa isa) {
#if defined(__aarch64__)
  return isa; // NEON widens f16 in its base ISA
#endif
  return has_f16c() ? isa : kScalar; // the vector paths are compiled with F16C, whatever the type
}

void matvec_prepare(const MatvecProblem& p, float* x) {
  if (p.wtype != kBF16 || p.isa == kScalar) {
    return;
  }
#if defined(__aarch64__)
  return; // NEON widens bf16 in order (vshll)
#endif
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
#if defined(__aarch64__)
  if (p.isa == kNeon) {
    return matvec_rows_neon(p, n0, n1);
  }
#endif
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
