// What the kernels' vector paths share: the x86 intrinsics, the per-function target
// attributes (the module's baseline is plain x86-64; these paths are chosen at run time).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#define MLXINFER_X86 1
#define MLXINFER_AVX2 __attribute__((target("avx2,fma")))
#define MLXINFER_AVX512 __attribute__((target("avx512f,avx2,fma")))
// The quantized kernel's AVX-512 paths: byte shuffles across 512 bits (isa.cpp requires BW).
#define MLXINFER_AVX512BW __attribute__((target("avx512f,avx512bw,avx2,fma")))
#define MLXINFER_AVX2_F16C __attribute__((target("avx2,fma,f16c")))
#define MLXINFER_AVX512_F16C __attribute__((target("avx512f,avx2,fma,f16c")))

namespace mlxinfer {

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

// sum_i a[i] * b[i] over n floats, 16 lanes at a time (the tail masked).
MLXINFER_AVX512BW inline float dot_f32_avx512(const float* a, const float* b, int n) {
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

} // namespace mlxinfer
#endif
