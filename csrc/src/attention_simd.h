// Decode attention over pool pages for float32 keys and values, in 16-float vectors (GCC /
// Clang vector extensions: the same source is AVX-512 in an AVX-512 function, two AVX2
// registers in an AVX2 one, four NEON registers on arm64), for head dims that are multiples
// of 16. attention_math.h's paged_head_impl is the path for every other case; this one does
// the same arithmetic with the work laid out for registers, for up to four query heads of
// one KV head at a time (grouped-query attention), so each key and value vector is loaded
// once for the group:
// - scores: four keys a pass (two with AVX2's or NEON's registers), each a chain of D / 16
//   fused multiply-adds per head, the four keys' lane sums in one reduction tree;
// - softmax weights: max, exp and total over 16 scores a vector (exp_neg16);
// - values: each head's output held in registers while the visible keys' values stream past.
// Measured (tools/bench_paged_attention.py; docs/performance.md): the auto-vectorised loops
// kept their accumulators on the stack and rebuilt q from scalars; one head at a time read
// every key and value once per head, and the softmax's exp ran one score at a time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "attention_math.h"
#include "simd.h"

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

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
// The native vector outside AVX-512 (paged_scores16): NEON's 128 bits, AVX2's 256.
#if defined(__aarch64__)
typedef vf4 vpart;
#else
typedef vf8 vpart;
#endif

// v's two halves added: 8 lanes.
MLXINFER_INLINE vf8 fold16(vf16 v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}

MLXINFER_INLINE float sum16(vf16 v) {
  const vf8 a = fold16(v);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

typedef int32_t vi16 __attribute__((vector_size(64)));

// exp_neg (attention_math.h) on 16 lanes: the same clamp, rounding to nearest and polynomial
// (a lane may differ from the scalar function in its last bit where x / ln 2 is a tie).
MLXINFER_INLINE vf16 exp_neg16(vf16 x) {
  const vf16 lo = vf16{} - 87.3f;
  x = x < lo ? lo : x;
  const vf16 magic = vf16{} + 12582912.0f; // 1.5 * 2^23: adding it rounds to an integer
  const vf16 n = (x * 1.4426950408889634f + magic) - magic;
  const vf16 p = exp_reduced(x, n);
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  vf16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// 16 visibility flags (bools) as a lane mask: -1 where seen.
MLXINFER_INLINE vi16 seen16(const bool* seen) {
  typedef uint8_t vu8 __attribute__((vector_size(16)));
  vu8 b;
  std::memcpy(&b, seen, sizeof(b));
  return __builtin_convertvector(b, vi16) != 0;
}

// Scores to probabilities times their total's inverse left to the caller: s[at] becomes
// exp(s[at] - max over the visible) where seen, else 0; returns 1 / the total (0 if none).
MLXINFER_INLINE float softmax_weights16(float* s, const bool* seen, int T, float* top_out = nullptr) {
  const vf16 ninf = vf16{} - INFINITY;
  vf16 top16 = ninf;
  int at = 0;
  for (; at + 16 <= T; at += 16) {
    const vf16 v = load16(s + at);
    const vf16 m = seen16(seen + at) ? v : ninf;
    top16 = m > top16 ? m : top16;
  }
  float top = -INFINITY;
  for (int u = 0; u < 16; ++u) {
    top = std::max(top, top16[u]);
  }
  for (int t = at; t < T; ++t) {
    top = seen[t] ? std::max(top, s[t]) : top;
  }
  if (top_out != nullptr) {
    *top_out = top;
  }
  vf16 total16{};
  for (at = 0; at + 16 <= T; at += 16) {
    const vf16 e = exp_neg16(load16(s + at) - top);
    const vf16 w = seen16(seen + at) ? e : vf16{};
    store16(s + at, w);
    total16 += w;
  }
  float total = sum16(total16);
  for (int t = at; t < T; ++t) {
    const float e = exp_neg(s[t] - top);
    s[t] = seen[t] ? e : 0.0f;
    total += s[t];
  }
  return total > 0 ? 1.0f / total : 0.0f;
}

// The cache lines of n floats from p asked for ahead of their use. The pool's blocks lie
// anywhere in it, so the hardware's stream prefetchers start afresh at each one (a 16-token
// block of 64-float rows is one 4 KB page). In the batching engine's 8-row step the keys and
// values come from memory (48 MB of float32 a step for SmolLM2-135M at 128 tokens each), and
// this kernel took a quarter of the step's samples (perf, Xeon VM); asking for the next
// block's lines while this one is read: 35.9-36.5 -> 34.0-36.5 ms a step (three alternated
// processes, tools/bench_batch_step.py). The prefetches then stall themselves: the core's
// outstanding misses are the bound, not the order of the reads.
MLXINFER_INLINE void prefetch_rows(const float* p, int n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t at = 0; at < sizeof(float) * static_cast<size_t>(n); at += 64) {
    __builtin_prefetch(c + at, 0, 3);
  }
}

// The sums of four vectors' lanes, as four floats: one reduction tree for the four.
MLXINFER_INLINE void sum16x4(vf16 a0, vf16 a1, vf16 a2, vf16 a3, float* out) {
  const vf8 h0 = fold16(a0), h1 = fold16(a1), h2 = fold16(a2), h3 = fold16(a3);
  // [a0's four | a1's four], [a2's | a3's]
  const vf8 p01 = __builtin_shufflevector(h0, h1, 0, 1, 2, 3, 8, 9, 10, 11) +
      __builtin_shufflevector(h0, h1, 4, 5, 6, 7, 12, 13, 14, 15);
  const vf8 p23 = __builtin_shufflevector(h2, h3, 0, 1, 2, 3, 8, 9, 10, 11) +
      __builtin_shufflevector(h2, h3, 4, 5, 6, 7, 12, 13, 14, 15);
  // [a0 a0 a2 a2 a1 a1 a3 a3] pairs
  const vf8 q = __builtin_shufflevector(p01, p23, 0, 1, 8, 9, 4, 5, 12, 13) +
      __builtin_shufflevector(p01, p23, 2, 3, 10, 11, 6, 7, 14, 15);
  const vf4 r = __builtin_shufflevector(q, q, 0, 4, 2, 6) + __builtin_shufflevector(q, q, 1, 5, 3, 7);
  std::memcpy(out, &r, sizeof(r));
}

// A 16-float vector as H native vectors V of 16 / H floats: AVX-512's one (vf16), AVX2's two
// (vf8), NEON's four (vf4). GCC keeps a 64-byte vf16 outside AVX-512 in memory, moving it in
// 8-byte pieces (the kernel's accumulators then lived on the stack), so the hot loops below
// hold native vectors: lane for lane the same arithmetic, so the same results on every path.
template <typename V>
constexpr int kParts = 64 / sizeof(V);

template <typename V>
MLXINFER_INLINE V load_v(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// fold16 of the vf16 whose parts are a[0 .. H-1] (lanes i + i + 8), then sum16's tree.
template <typename V>
MLXINFER_INLINE float sum_parts(const V (&a)[kParts<V>]) {
  if constexpr (kParts<V> == 1) {
    return sum16(a[0]);
  } else {
    vf8 f;
    if constexpr (kParts<V> == 2) {
      f = a[0] + a[1];
    } else {
      f = __builtin_shufflevector(a[0] + a[2], a[1] + a[3], 0, 1, 2, 3, 4, 5, 6, 7);
    }
    const vf4 b = __builtin_shufflevector(f, f, 0, 1, 2, 3) + __builtin_shufflevector(f, f, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
  }
}

// Where a block's rows lie and how a row's W-float parts are read (W = 16 / kParts<V>): the
// loops below are written once over a policy. F32Rows: float32 rows, loaded as they are;
// QuantRows: MLX's affine codes (mx.quantize: 4 or 8 bits, low bits first), each part
// dequantized as it is loaded (code * scale + bias, its group's), so the arithmetic after the
// load is the float32 path's.
struct F32Rows {
  using Row = const float*;
  const float* base;
  int width; // floats a row

  MLXINFER_INLINE Row at(uint32_t blk, int block, int t) const {
    return base + (static_cast<size_t>(blk) * block + t) * width;
  }
  template <typename V>
  MLXINFER_INLINE V load(Row r, int col) const {
    return load_v<V>(r + col);
  }
  // Ask for n floats' worth of rows from (blk, t) at column col (prefetch_rows).
  MLXINFER_INLINE void prefetch(uint32_t blk, int block, int t, int col, int n) const {
    prefetch_rows(at(blk, block, t) + col, n);
  }
};

typedef uint8_t vu8x16 __attribute__((vector_size(16)));
typedef uint8_t vu8x8 __attribute__((vector_size(8)));
typedef uint8_t vu8x4 __attribute__((vector_size(4)));
typedef uint8_t vu8x2 __attribute__((vector_size(2)));

template <typename B>
MLXINFER_INLINE B load_bytes(const uint8_t* p) {
  B b;
  std::memcpy(&b, p, sizeof(b));
  return b;
}

typedef int32_t vi8 __attribute__((vector_size(32)));
typedef int32_t vi4 __attribute__((vector_size(16)));
typedef int32_t vi2 __attribute__((vector_size(8)));

// Bytes widened to 32-bit lanes. GCC 12 spells a byte vector's __builtin_convertvector out
// byte by byte (movzbl, vpinsrd: a third of the quantized attention's time), so the x86 paths
// take vpmovzxbd, each in its own instruction set (WIDEN: 2 AVX-512, 1 AVX2, 0 the
// vector extensions, as on arm64 and x86 below AVX2).
enum Widen { kWidenPlain = 0, kWidenAvx2 = 1, kWidenAvx512 = 2 };

#if defined(MLXINFER_X86)
MLXINFER_AVX512 inline vi16 widen16_avx512(const uint8_t* p) {
  // The zero-masked form: the plain one's _mm512_undefined_epi32 warns under GCC 12.
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vi16>(_mm512_maskz_cvtepu8_epi32(0xFFFF, b));
}

MLXINFER_AVX2 inline vi8 widen8_avx2(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vi8>(_mm256_cvtepu8_epi32(b));
}
#endif

template <typename I, typename B, int WIDEN>
MLXINFER_INLINE I widen(const uint8_t* p) {
#if defined(MLXINFER_X86)
  if constexpr (WIDEN == kWidenAvx512 && sizeof(I) == 64) {
    return widen16_avx512(p);
  } else if constexpr (WIDEN >= kWidenAvx2 && sizeof(I) == 32) {
    return widen8_avx2(p);
  }
#endif
  return __builtin_convertvector(load_bytes<B>(p), I);
}

// W codes from column col of a row of BITS-bit codes, as floats (W = V's lanes: 16, 8 or 4).
// 4 bits: two codes a byte, the low nibble first: W / 2 bytes widened to 32-bit lanes, their
// low and high nibbles interleaved by one permute (a byte vector's per-lane shift has no
// instruction either).
template <typename V, int BITS, int WIDEN>
MLXINFER_INLINE V codes_to_float(const uint8_t* c, int col) {
  constexpr int W = sizeof(V) / sizeof(float);
  static_assert(BITS == 8 || BITS == 4);
  if constexpr (W == 16) {
    if constexpr (BITS == 8) {
      return __builtin_convertvector(widen<vi16, vu8x16, WIDEN>(c + col), V);
    } else {
      const vi8 x = widen<vi8, vu8x8, WIDEN>(c + col / 2);
      const vi8 lo = x & 15, hi = x >> 4;
      const vi16 v =
          __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
      return __builtin_convertvector(v, V);
    }
  } else if constexpr (W == 8) {
    if constexpr (BITS == 8) {
      return __builtin_convertvector(widen<vi8, vu8x8, WIDEN>(c + col), V);
    } else {
      const vi4 x = widen<vi4, vu8x4, WIDEN>(c + col / 2);
      const vi4 lo = x & 15, hi = x >> 4;
      return __builtin_convertvector(__builtin_shufflevector(lo, hi, 0, 4, 1, 5, 2, 6, 3, 7), V);
    }
  } else {
    static_assert(W == 4);
    if constexpr (BITS == 8) {
      return __builtin_convertvector(widen<vi4, vu8x4, WIDEN>(c + col), V);
    } else {
      const vi2 x = widen<vi2, vu8x2, WIDEN>(c + col / 2);
      const vi2 lo = x & 15, hi = x >> 4;
      return __builtin_convertvector(__builtin_shufflevector(lo, hi, 0, 2, 1, 3), V);
    }
  }
}

// One side (keys or values) of a quantized pool: codes, a scale and a bias a group of a row.
struct QuantSide {
  const uint8_t* codes;
  const float* scales;
  const float* biases;
  int width; // values a row
  int group_shift; // log2 of the group size, 16 or more: a part lies in one group
  int groups; // width >> group_shift
};

template <int BITS, int WIDEN>
struct QuantRows {
  struct Row {
    const uint8_t* codes;
    const float* scales;
    const float* biases;
  };
  QuantSide side;

  MLXINFER_INLINE Row at(uint32_t blk, int block, int t) const {
    const size_t r = static_cast<size_t>(blk) * block + t;
    return {side.codes + r * side.width * BITS / 8, side.scales + r * side.groups,
            side.biases + r * side.groups};
  }
  template <typename V>
  MLXINFER_INLINE V load(const Row& r, int col) const {
    const int g = col >> side.group_shift;
    return codes_to_float<V, BITS, WIDEN>(r.codes, col) * r.scales[g] + r.biases[g];
  }
  MLXINFER_INLINE void prefetch(uint32_t blk, int block, int t, int col, int n) const {
    const Row r = at(blk, block, t);
    const char* c = reinterpret_cast<const char*>(r.codes) + col * BITS / 8;
    for (int at = 0; at < n * BITS / 8; at += 64) {
      __builtin_prefetch(c + at, 0, 3);
    }
    __builtin_prefetch(r.scales, 0, 3);
    __builtin_prefetch(r.biases, 0, 3);
  }
};

// R query heads' scores against the keys of n blocks (q already scaled): KEYS keys a pass,
// each key's vectors loaded once for the R heads. The R x KEYS totals stay in registers: four
// heads by four keys with AVX-512's 32 (16 of them), two by two with AVX2's 16 or NEON's 32
// 128-bit ones (V: a 16-float vector's part): four by four there spilled to the stack (with
// the vf16 parts' moves, Gemma-3-270M's 512-token prompt on the Xeon VM capped at AVX2 spent
// 47 % of its samples in this attention). Each score is the same chain and lane sum. Keys
// no row sees (a last block's padding, a plain cache's room past its tokens) are skipped: the
// softmax never reads their scores.
template <int R, int KEYS, typename V, typename Rows>
MLXINFER_INLINE void paged_scores16(const float* q, const Rows& K, const uint32_t* table,
                                    const bool* seen, int n, int block, int D, int T,
                                    float* scores) {
  static_assert(KEYS == 2 || KEYS == 4);
  constexpr int H = kParts<V>, W = 16 / H;
  const int cd = D / 16;
  for (int i = 0; i < n; ++i) {
    const uint32_t blk = table[i];
    // The next block's keys, KEYS rows a pass (prefetch_rows): the blocks lie anywhere in the pool.
    const bool ahead = i + 1 < n;
    int t = 0;
    for (; t + KEYS <= block; t += KEYS) {
      if (ahead) {
        K.prefetch(table[i + 1], block, t, 0, KEYS * D);
      }
      bool any = false;
      for (int u = 0; u < KEYS; ++u) {
        any |= seen[static_cast<size_t>(i) * block + t + u];
      }
      if (!any) {
        continue;
      }
      typename Rows::Row k[KEYS];
      for (int u = 0; u < KEYS; ++u) {
        k[u] = K.at(blk, block, t + u);
      }
      V a[R][KEYS][H];
      for (int j = 0; j < R; ++j) {
        for (int u = 0; u < KEYS; ++u) {
          for (int h = 0; h < H; ++h) {
            a[j][u][h] = V{};
          }
        }
      }
      for (int c = 0; c < cd; ++c) {
        V x[KEYS][H];
        for (int u = 0; u < KEYS; ++u) {
          for (int h = 0; h < H; ++h) {
            x[u][h] = K.template load<V>(k[u], 16 * c + W * h);
          }
        }
        for (int j = 0; j < R; ++j) {
          for (int h = 0; h < H; ++h) {
            const V qv = load_v<V>(q + static_cast<size_t>(j) * D + 16 * c + W * h);
            for (int u = 0; u < KEYS; ++u) {
              a[j][u][h] += qv * x[u][h];
            }
          }
        }
      }
      for (int j = 0; j < R; ++j) {
        float* out = scores + static_cast<size_t>(j) * T + static_cast<size_t>(i) * block + t;
        if constexpr (KEYS == 4 && H == 1) {
          sum16x4(a[j][0][0], a[j][1][0], a[j][2][0], a[j][3][0], out);
        } else {
          for (int u = 0; u < KEYS; ++u) {
            out[u] = sum_parts<V>(a[j][u]);
          }
        }
      }
    }
    for (; t < block; ++t) {
      if (!seen[static_cast<size_t>(i) * block + t]) {
        continue;
      }
      const typename Rows::Row kr = K.at(blk, block, t);
      for (int j = 0; j < R; ++j) {
        V a[H] = {};
        for (int c = 0; c < cd; ++c) {
          for (int h = 0; h < H; ++h) {
            a[h] += load_v<V>(q + static_cast<size_t>(j) * D + 16 * c + W * h) *
                K.template load<V>(kr, 16 * c + W * h);
          }
        }
        scores[static_cast<size_t>(j) * T + static_cast<size_t>(i) * block + t] = sum_parts<V>(a);
      }
    }
  }
}

// y (NC vectors from column 16 * c0, for each of R heads) = the visible keys' weights times
// their values, times inv[j]: each value vector loaded once for the R heads (in parts V).
template <int R, int NC, typename V, typename Rows>
MLXINFER_INLINE void paged_values16(const Rows& Vs, const uint32_t* table, const bool* seen,
                                    const float* s, int n, int block, int T, int Dv, int c0,
                                    const float* inv, float* y) {
  constexpr int H = kParts<V>, W = 16 / H;
  V acc[R][NC][H];
  for (int j = 0; j < R; ++j) {
    for (int u = 0; u < NC; ++u) {
      for (int h = 0; h < H; ++h) {
        acc[j][u][h] = V{};
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    const uint32_t blk = table[i];
    const bool ahead = i + 1 < n;
    const size_t at0 = static_cast<size_t>(i) * block;
    for (int t = 0; t < block; ++t) {
      if (ahead) { // the next block's row t: the columns this pass reads
        Vs.prefetch(table[i + 1], block, t, 16 * c0, 16 * NC);
      }
      if (!seen[at0 + t]) {
        continue; // a hidden slot's values are never read
      }
      const typename Rows::Row vr = Vs.at(blk, block, t);
      V v[NC][H];
      for (int u = 0; u < NC; ++u) {
        for (int h = 0; h < H; ++h) {
          v[u][h] = Vs.template load<V>(vr, 16 * (c0 + u) + W * h);
        }
      }
      for (int j = 0; j < R; ++j) {
        const V p = V{} + s[static_cast<size_t>(j) * T + at0 + t];
        for (int u = 0; u < NC; ++u) {
          for (int h = 0; h < H; ++h) {
            acc[j][u][h] += p * v[u][h];
          }
        }
      }
    }
  }
  for (int j = 0; j < R; ++j) {
    for (int u = 0; u < NC; ++u) {
      for (int h = 0; h < H; ++h) {
        const V out = acc[j][u][h] * inv[j];
        std::memcpy(y + static_cast<size_t>(j) * Dv + 16 * (c0 + u) + W * h, &out, sizeof(out));
      }
    }
  }
}

template <int R, int NC, typename V, typename Rows>
MLXINFER_INLINE void paged_values_cols(const Rows& Vs, const uint32_t* table, const bool* seen,
                                       const float* s, int n, int block, int T, int Dv,
                                       const float* inv, float* y) {
  const int cv = Dv / 16;
  int c = 0;
  for (; c + NC <= cv; c += NC) {
    paged_values16<R, NC, V, Rows>(Vs, table, seen, s, n, block, T, Dv, c, inv, y);
  }
  switch (cv - c) {
    case 3:
      paged_values16<R, 3, V, Rows>(Vs, table, seen, s, n, block, T, Dv, c, inv, y);
      break;
    case 2:
      paged_values16<R, 2, V, Rows>(Vs, table, seen, s, n, block, T, Dv, c, inv, y);
      break;
    case 1:
      paged_values16<R, 1, V, Rows>(Vs, table, seen, s, n, block, T, Dv, c, inv, y);
      break;
    default:
      break;
  }
}

// R query heads sharing one KV head: scores, softmax weights, values. `stats` (or null): each
// head's largest visible score and its weights' total, (top, total) pairs, so that parts of the
// keys attended apart can be joined (attention_parts).
template <int R, bool WIDE, typename KRows, typename VRows>
MLXINFER_INLINE void paged_group16(const float* q, const KRows& K, const VRows& V,
                                   const uint32_t* table, const bool* seen, int n, int block,
                                   int D, int Dv, float* scores, float* y, float* stats) {
  const int T = n * block;
  if constexpr (WIDE) {
    paged_scores16<R, 4, vf16>(q, K, table, seen, n, block, D, T, scores);
  } else { // two heads by two keys, in native parts (paged_scores16)
    for (int j = 0; j + 2 <= R; j += 2) {
      paged_scores16<2, 2, vpart>(q + static_cast<size_t>(j) * D, K, table, seen, n, block, D, T,
                                  scores + static_cast<size_t>(j) * T);
    }
    if constexpr (R % 2 == 1) {
      paged_scores16<1, 2, vpart>(q + static_cast<size_t>(R - 1) * D, K, table, seen, n, block, D,
                                  T, scores + static_cast<size_t>(R - 1) * T);
    }
  }
  float inv[R];
  for (int j = 0; j < R; ++j) {
    inv[j] = softmax_weights16(scores + static_cast<size_t>(j) * T, seen, T,
                               stats != nullptr ? stats + 2 * j : nullptr);
    if (stats != nullptr) {
      stats[2 * j + 1] = inv[j] > 0 ? 1.0f / inv[j] : 0.0f;
    }
  }
  // Value vectors a pass, each loaded once for the R heads, the R x NC totals in registers:
  // with AVX-512's 32 (WIDE) four (64 columns); else two for up to two heads, one for more.
  if constexpr (WIDE) {
    paged_values_cols<R, 4, vf16>(V, table, seen, scores, n, block, T, Dv, inv, y);
  } else if constexpr (R <= 2) {
    paged_values_cols<R, 2, vpart>(V, table, seen, scores, n, block, T, Dv, inv, y);
  } else {
    paged_values_cols<R, 1, vpart>(V, table, seen, scores, n, block, T, Dv, inv, y);
  }
}

// paged_head_impl for keys and values read through the row policies, D and Dv multiples of
// 16 (q already scaled): the reps query heads of one KV head, up to four at a time. WIDE: 32
// vector registers of 16 floats (AVX-512).
template <bool WIDE, typename KRows, typename VRows>
MLXINFER_INLINE void paged_head16(const float* q, const KRows& K, const VRows& V,
                                  const uint32_t* table, const bool* seen, int reps, int n,
                                  int block, int D, int Dv, float* scores, float* y,
                                  float* stats = nullptr) {
  const size_t T = static_cast<size_t>(n) * block;
  for (int j = 0; j < reps; j += 4) {
    const float* qj = q + static_cast<size_t>(j) * D;
    float* sj = scores + static_cast<size_t>(j) * T;
    float* yj = y + static_cast<size_t>(j) * Dv;
    float* st = stats != nullptr ? stats + 2 * j : nullptr;
    switch (std::min(4, reps - j)) {
      case 4:
        paged_group16<4, WIDE>(qj, K, V, table, seen, n, block, D, Dv, sj, yj, st);
        break;
      case 3:
        paged_group16<3, WIDE>(qj, K, V, table, seen, n, block, D, Dv, sj, yj, st);
        break;
      case 2:
        paged_group16<2, WIDE>(qj, K, V, table, seen, n, block, D, Dv, sj, yj, st);
        break;
      default:
        paged_group16<1, WIDE>(qj, K, V, table, seen, n, block, D, Dv, sj, yj, st);
        break;
    }
  }
}

// paged_head16 over float32 keys and values.
template <bool WIDE>
MLXINFER_INLINE void paged_head_f32x16(const float* q, const float* K, const float* V,
                                       const uint32_t* table, const bool* seen, int reps, int n,
                                       int block, int D, int Dv, float* scores, float* y,
                                       float* stats = nullptr) {
  paged_head16<WIDE>(q, F32Rows{K, D}, F32Rows{V, Dv}, table, seen, reps, n, block, D, Dv, scores,
                     y, stats);
}

// paged_head_f32x16 on the best vector path this CPU has (paged.cpp). False where it does not
// apply: head dims not multiples of 16, or an x86 CPU below AVX2 (attention_math.h's loops run
// there as well). Also one query head over a plain cache's T tokens: one block of T. `stats`
// (or null): each query head's (top score, weights' total), as paged_group16's.
bool attention_f32x16(const float* q, const float* K, const float* V, const uint32_t* table,
                      const bool* seen, int reps, int n, int block, int D, int Dv, float* scores,
                      float* y, float* stats = nullptr);

// Joins `parts` attentions of the same `reps` query heads over disjoint parts of their keys,
// each normalised over its own part (y: parts x reps x Dv; stats: parts x reps x (top, total)),
// into the attention over all of them (out: reps x Dv): each part weighted by its total scaled
// to the largest top. A part that saw nothing (total 0) weighs nothing; none: zeros.
inline void join_attention_parts(const float* y, const float* stats, int parts, int reps, int Dv,
                                 float* out) {
  for (int j = 0; j < reps; ++j) {
    float top = -INFINITY;
    for (int c = 0; c < parts; ++c) {
      const float* st = stats + (static_cast<size_t>(c) * reps + j) * 2;
      top = st[1] > 0 ? std::max(top, st[0]) : top;
    }
    float* o = out + static_cast<size_t>(j) * Dv;
    std::fill(o, o + Dv, 0.0f);
    float total = 0;
    for (int c = 0; c < parts; ++c) {
      const float* st = stats + (static_cast<size_t>(c) * reps + j) * 2;
      if (st[1] <= 0) {
        continue;
      }
      const float w = st[1] * std::exp(st[0] - top);
      total += w;
      const float* yc = y + (static_cast<size_t>(c) * reps + j) * Dv;
      for (int d = 0; d < Dv; ++d) {
        o[d] += w * yc[d];
      }
    }
    const float inv = total > 0 ? 1.0f / total : 0.0f;
    for (int d = 0; d < Dv; ++d) {
      o[d] *= inv;
    }
  }
}

} // namespace mlxinfer
