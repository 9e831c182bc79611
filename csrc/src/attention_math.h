// The loops behind the attention primitives (fused.cpp: the KV cache write and decode
// attention; paged.cpp: decode attention over the batching engine's pool pages), shared as
// inline functions: float conversion helpers, RoPE on rows, dot products four keys at a
// time, a vectorisable exp, and one query group's softmax-weighted values. The AVX2+FMA
// copies are the same loops compiled for that target and chosen at run time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "mlx/mlx.h"

#include "kernels.h"
#include "util.h"

namespace mlxinfer {

namespace mx = mlx::core;

[[noreturn]] inline void fail(const char* op, const std::string& m) {
  throw std::invalid_argument(std::string("[mlxinfer ") + op + "] " + m);
}

inline void check_float(const mx::array& a, const char* name) {
  if (!is_float(a.dtype())) {
    throw std::invalid_argument(std::string("[mlxinfer decode_attention] ") + name +
                                ": expected a float16/bfloat16/float32 array");
  }
}


// Rounds each value to `dtype` and back (what storing it in an array of that dtype does).
inline void round_to(mx::Dtype dtype, float* x, size_t n) {
  if (dtype == mx::float16) {
    for (size_t i = 0; i < n; ++i) {
      x[i] = static_cast<float>(static_cast<mx::float16_t>(x[i]));
    }
  } else if (dtype == mx::bfloat16) {
    for (size_t i = 0; i < n; ++i) {
      x[i] = static_cast<float>(static_cast<mx::bfloat16_t>(x[i]));
    }
  }
}

// `a`'s elements, row-major, into dst (same dtype): a strided view is gathered.
inline void copy_elements(const mx::array& a, char* dst) {
  const size_t item = a.itemsize();
  const char* src = a.data<char>();
  if (a.flags().row_contiguous) {
    std::memcpy(dst, src, a.nbytes());
    return;
  }
  // Runs along the last axis, one memcpy each where that axis is contiguous.
  const int nd = a.ndim();
  const int64_t run = a.shape(nd - 1), step = a.strides()[nd - 1];
  std::vector<int> idx(nd, 0);
  for (size_t i = 0; i < a.size(); i += run) {
    int64_t off = 0;
    for (int d = 0; d + 1 < nd; ++d) {
      off += static_cast<int64_t>(idx[d]) * a.strides()[d];
    }
    if (step == 1) {
      std::memcpy(dst + i * item, src + off * item, run * item);
    } else {
      for (int64_t j = 0; j < run; ++j) {
        std::memcpy(dst + (i + j) * item, src + (off + j * step) * item, item);
      }
    }
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) {
        break;
      }
      idx[d] = 0;
    }
  }
}

// `a`'s bytes, row-major: its own where contiguous, else gathered into `copy`.
inline const char* contiguous_bytes(const mx::array& a, std::vector<char>& copy) {
  if (a.flags().row_contiguous) {
    return a.data<char>();
  }
  copy.resize(a.nbytes());
  copy_elements(a, copy.data());
  return copy.data();
}

// RoPE on `heads` rows of `d` features: the first `dims` rotated by the (dims/2) table.
inline void rotate(float* x, int heads, int d, int dims, bool traditional, const float* c,
            const float* s) {
  const int half = dims / 2;
  for (int h = 0; h < heads; ++h) {
    float* r = x + static_cast<size_t>(h) * d;
    for (int i = 0; i < half; ++i) {
      const int ia = traditional ? 2 * i : i;
      const int ib = traditional ? 2 * i + 1 : i + half;
      const float a = r[ia], b = r[ib];
      r[ia] = a * c[i] - b * s[i];
      r[ib] = b * c[i] + a * s[i];
    }
  }
}

#define MLXINFER_INLINE inline __attribute__((always_inline))

template <typename C>
MLXINFER_INLINE float dot(const float* q, const C* k, int d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int l = 0; l < 8; ++l) {
      acc[l] += q[i + l] * static_cast<float>(k[i + l]);
    }
  }
  float total = 0;
  for (; i < d; ++i) {
    total += q[i] * static_cast<float>(k[i]);
  }
  for (int l = 0; l < 8; ++l) {
    total += acc[l];
  }
  return total;
}

// Four keys' dot products with q at once: four independent accumulator chains, q's loads
// shared (one key at a time is bound by the latency of its one chain).
template <typename C>
MLXINFER_INLINE void dot4(const float* q, const C* k, size_t stride, int d, float* out) {
  float acc[4][8] = {};
  int i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int r = 0; r < 4; ++r) {
      for (int l = 0; l < 8; ++l) {
        acc[r][l] += q[i + l] * static_cast<float>(k[r * stride + i + l]);
      }
    }
  }
  for (int r = 0; r < 4; ++r) {
    float total = 0;
    for (int j = i; j < d; ++j) {
      total += q[j] * static_cast<float>(k[r * stride + j]);
    }
    for (int l = 0; l < 8; ++l) {
      total += acc[r][l];
    }
    out[r] = total;
  }
}

// exp(x) for x <= 0 (a softmax's shifted logits): 2^n e^r with n = round(x / ln 2), a
// degree-6 polynomial for e^r (relative error ~1.5e-7, as ops.exp); vectorisable, unlike
// std::exp. Below -87.3 it is 0.
// e^r on |r| <= ln(2)/2 from x and n (T: float, or a vector of floats: attention_simd.h's
// exp_neg16 shares it).
template <typename T>
MLXINFER_INLINE T exp_reduced(T x, T n) {
  const T r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  T p = r * 0.0013836845755577087f + 0.008374815806746483f;
  p = p * r + 0.04166822507977486f;
  p = p * r + 0.16666419804096222f;
  p = p * r + 0.49999991059303284f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

MLXINFER_INLINE float exp_neg(float x) {
  x = std::max(x, -87.3f);
  const float n = std::nearbyint(x * 1.4426950408889634f);
  const float p = exp_reduced(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One query head over T cached tokens: y (Dv) = softmax(q . K[t]) V (q already scaled).
template <typename C>
MLXINFER_INLINE void attend_head_impl(const float* q, const C* K, const C* V, int T, int D,
                                      int Dv, bool round_probs, float* scores, float* y) {
  int t = 0;
  for (; t + 4 <= T; t += 4) {
    dot4(q, K + static_cast<size_t>(t) * D, D, D, scores + t);
  }
  for (; t < T; ++t) {
    scores[t] = dot(q, K + static_cast<size_t>(t) * D, D);
  }
  float top = -INFINITY;
  for (t = 0; t < T; ++t) {
    top = std::max(top, scores[t]);
  }
  float total = 0;
  for (t = 0; t < T; ++t) {
    scores[t] = exp_neg(scores[t] - top);
    total += scores[t];
  }
  const float inv = 1.0f / total;
  for (t = 0; t < T; ++t) {
    float p = scores[t] * inv;
    scores[t] = round_probs ? static_cast<float>(static_cast<C>(p)) : p;
  }
  std::fill(y, y + Dv, 0.0f);
  t = 0;
  for (; t + 4 <= T; t += 4) { // four keys' values per pass over y
    const C* v0 = V + static_cast<size_t>(t) * Dv;
    const float p0 = scores[t], p1 = scores[t + 1], p2 = scores[t + 2], p3 = scores[t + 3];
    for (int i = 0; i < Dv; ++i) {
      y[i] += p0 * static_cast<float>(v0[i]) + p1 * static_cast<float>(v0[Dv + i]) +
          p2 * static_cast<float>(v0[2 * Dv + i]) + p3 * static_cast<float>(v0[3 * Dv + i]);
    }
  }
  for (; t < T; ++t) {
    const C* vr = V + static_cast<size_t>(t) * Dv;
    for (int i = 0; i < Dv; ++i) {
      y[i] += scores[t] * static_cast<float>(vr[i]);
    }
  }
}

// The loops above compiled for AVX2+FMA (auto-vectorised: the module's baseline is plain
// x86-64), chosen at run time as the products' kernels are.
#if defined(__x86_64__)
template <typename C>
__attribute__((target("avx2,fma"))) void attend_head_avx2(const float* q, const C* K, const C* V,
                                                          int T, int D, int Dv, bool round_probs,
                                                          float* scores, float* y) {
  attend_head_impl<C>(q, K, V, T, D, Dv, round_probs, scores, y);
}
#endif

template <typename C>
void attend_head(const float* q, const C* K, const C* V, int T, int D, int Dv, bool round_probs,
                 float* scores, float* y) {
#if defined(__x86_64__)
  if (current_isa() >= kAvx2) {
    return attend_head_avx2<C>(q, K, V, T, D, Dv, round_probs, scores, y);
  }
#endif
  attend_head_impl<C>(q, K, V, T, D, Dv, round_probs, scores, y);
}

// Row b, kv head h: its visible keys' scores for the group's `reps` queries, then the
// softmax-weighted values. scores: reps * n * block floats.
template <typename C>
MLXINFER_INLINE void paged_head_impl(const float* q, const C* K, const C* V, const uint32_t* table,
                const bool* seen, int reps, int n, int block, int D, int Dv, bool round_probs,
                float* scores, float* y) {
  const int T = n * block;
  for (int j = 0; j < reps; ++j) {
    float* s = scores + static_cast<size_t>(j) * T;
    float top = -INFINITY;
    for (int i = 0; i < n; ++i) {
      const C* kb = K + static_cast<size_t>(table[i]) * block * D;
      for (int t = 0; t < block; ++t) {
        const int at = i * block + t;
        if (!seen[at]) {
          s[at] = -INFINITY;
          continue;
        }
        s[at] = dot(q + static_cast<size_t>(j) * D, kb + static_cast<size_t>(t) * D, D);
        top = std::max(top, s[at]);
      }
    }
    float total = 0;
    for (int at = 0; at < T; ++at) {
      s[at] = seen[at] ? exp_neg(s[at] - top) : 0.0f;
      total += s[at];
    }
    float* yj = y + static_cast<size_t>(j) * Dv;
    std::fill(yj, yj + Dv, 0.0f);
    const float inv = total > 0 ? 1.0f / total : 0.0f;
    for (int i = 0; i < n; ++i) {
      const C* vb = V + static_cast<size_t>(table[i]) * block * Dv;
      for (int t = 0; t < block; ++t) {
        const int at = i * block + t;
        if (!seen[at]) {
          continue;
        }
        float p = s[at];
        if (round_probs) {
          p = static_cast<float>(static_cast<C>(p));
        }
        const C* vr = vb + static_cast<size_t>(t) * Dv;
        for (int d = 0; d < Dv; ++d) {
          yj[d] += p * static_cast<float>(vr[d]);
        }
      }
    }
    for (int d = 0; d < Dv; ++d) {
      yj[d] *= inv;
    }
  }
}

#if defined(__x86_64__)
template <typename C>
__attribute__((target("avx2,fma"))) void paged_head_avx2(
    const float* q, const C* K, const C* V, const uint32_t* table, const bool* seen, int reps,
    int n, int block, int D, int Dv, bool round_probs, float* scores, float* y) {
  paged_head_impl<C>(q, K, V, table, seen, reps, n, block, D, Dv, round_probs, scores, y);
}
#endif

template <typename C>
void paged_head(const float* q, const C* K, const C* V, const uint32_t* table, const bool* seen,
                int reps, int n, int block, int D, int Dv, bool round_probs, float* scores,
                float* y) {
#if defined(__x86_64__)
  if (current_isa() >= kAvx2) {
    return paged_head_avx2<C>(q, K, V, table, seen, reps, n, block, D, Dv, round_probs, scores, y);
  }
#endif
  paged_head_impl<C>(q, K, V, table, seen, reps, n, block, D, Dv, round_probs, scores, y);
}

} // namespace mlxinfer
