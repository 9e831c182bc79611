// Decode attention over pool pages for float32 keys and values, in 16-float vectors (GCC /
// Clang vector extensions: the same source is AVX-512 in an AVX-512 function, two AVX2
// registers in an AVX2 one, four NEON registers on arm64), for head dims that are multiples
// of 16. attention_math.h's paged_head_impl is the path for every other case; this one does
// the same arithmetic with the work laid out for registers:
// - scores: four keys against one query at a time, each a chain of D / 16 fused
//   multiply-adds in one vector, summed across its lanes once;
// - values: each query's output held in up to four vectors (64 floats) while the visible
//   keys' values stream past, instead of a load and a store of y per key.
// Measured (tools/bench_batch_step.py; docs/performance.md): the auto-vectorised loops kept
// their accumulators on the stack and rebuilt q from scalars.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "attention_math.h"

namespace mlxinfer {

typedef float vf16 __attribute__((vector_size(64)));

MLXINFER_INLINE vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

MLXINFER_INLINE void store16(float* p, vf16 v) {
  std::memcpy(p, &v, sizeof(v));
}

MLXINFER_INLINE float sum16(vf16 v) {
  typedef float vf8 __attribute__((vector_size(32)));
  typedef float vf4 __attribute__((vector_size(16)));
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// y (NC vectors of query j's output, from column 16 * c0) += the visible keys' p * values.
template <int NC>
MLXINFER_INLINE void paged_values16(const float* V, const uint32_t* table, const bool* seen,
                                    const float* s, int n, int block, int Dv, int c0, float inv,
                                    float* y) {
  vf16 acc[NC];
  for (int u = 0; u < NC; ++u) {
    acc[u] = vf16{};
  }
  for (int i = 0; i < n; ++i) {
    const float* vb = V + static_cast<size_t>(table[i]) * block * Dv + 16 * c0;
    const float* si = s + static_cast<size_t>(i) * block;
    const bool* sb = seen + static_cast<size_t>(i) * block;
    for (int t = 0; t < block; ++t) {
      if (!sb[t]) {
        continue; // a hidden slot's values are never read
      }
      const vf16 p = vf16{} + si[t];
      const float* vr = vb + static_cast<size_t>(t) * Dv;
      for (int u = 0; u < NC; ++u) {
        acc[u] += p * load16(vr + 16 * u);
      }
    }
  }
  for (int u = 0; u < NC; ++u) {
    store16(y + 16 * (c0 + u), acc[u] * inv);
  }
}

// paged_head_impl for float32 keys and values, D and Dv multiples of 16 (q already scaled).
MLXINFER_INLINE void paged_head_f32x16(const float* q, const float* K, const float* V,
                                       const uint32_t* table, const bool* seen, int reps, int n,
                                       int block, int D, int Dv, float* scores, float* y) {
  const int T = n * block, cd = D / 16, cv = Dv / 16;
  for (int i = 0; i < n; ++i) {
    const float* kb = K + static_cast<size_t>(table[i]) * block * D;
    for (int j = 0; j < reps; ++j) {
      const float* qj = q + static_cast<size_t>(j) * D;
      float* si = scores + static_cast<size_t>(j) * T + static_cast<size_t>(i) * block;
      int t = 0;
      for (; t + 4 <= block; t += 4) {
        const float* k0 = kb + static_cast<size_t>(t) * D;
        vf16 a0{}, a1{}, a2{}, a3{};
        for (int c = 0; c < cd; ++c) {
          const vf16 qv = load16(qj + 16 * c);
          a0 += qv * load16(k0 + 16 * c);
          a1 += qv * load16(k0 + D + 16 * c);
          a2 += qv * load16(k0 + 2 * D + 16 * c);
          a3 += qv * load16(k0 + 3 * D + 16 * c);
        }
        si[t] = sum16(a0);
        si[t + 1] = sum16(a1);
        si[t + 2] = sum16(a2);
        si[t + 3] = sum16(a3);
      }
      for (; t < block; ++t) {
        const float* kr = kb + static_cast<size_t>(t) * D;
        vf16 a{};
        for (int c = 0; c < cd; ++c) {
          a += load16(qj + 16 * c) * load16(kr + 16 * c);
        }
        si[t] = sum16(a);
      }
    }
  }
  for (int j = 0; j < reps; ++j) {
    float* s = scores + static_cast<size_t>(j) * T;
    float top = -INFINITY;
    for (int at = 0; at < T; ++at) {
      top = seen[at] ? std::max(top, s[at]) : top;
    }
    float total = 0;
    for (int at = 0; at < T; ++at) {
      const float e = exp_neg(s[at] - top);
      s[at] = seen[at] ? e : 0.0f;
      total += s[at];
    }
    const float inv = total > 0 ? 1.0f / total : 0.0f;
    float* yj = y + static_cast<size_t>(j) * Dv;
    int c = 0;
    for (; c + 4 <= cv; c += 4) {
      paged_values16<4>(V, table, seen, s, n, block, Dv, c, inv, yj);
    }
    switch (cv - c) {
      case 3:
        paged_values16<3>(V, table, seen, s, n, block, Dv, c, inv, yj);
        break;
      case 2:
        paged_values16<2>(V, table, seen, s, n, block, Dv, c, inv, yj);
        break;
      case 1:
        paged_values16<1>(V, table, seen, s, n, block, Dv, c, inv, yj);
        break;
      default:
        break;
    }
  }
}

// paged_head_f32x16 on the best vector path this CPU has (paged.cpp). False where it does not
// apply: head dims not multiples of 16, or an x86 CPU below AVX2 (attention_math.h's loops run
// there as well). Also one query head over a plain cache's T tokens: one block of T.
bool attention_f32x16(const float* q, const float* K, const float* V, const uint32_t* table,
                      const bool* seen, int reps, int n, int block, int D, int Dv, float* scores,
                      float* y);

} // namespace mlxinfer
