// Tiled layers (issue 47): a 4-, 5-, 6- or 8-bit affine layer's codes laid out once, at load, in the
// order AVX-512 VNNI's int16 product reads them, so a decode step's few rows (one, or the
// batching engine's) run as prefill_i16.cpp's tiles without laying a tile out per product.
//
// The layout (backends/cpu/compiled.py's `tile_layer` writes it; tests check it against the
// definition): outputs in tiles of 32, n = 32 t + 16 v + j (v the half, j 0..15); inputs in
// blocks of 32 and pairs, k = 32 b + 2 p + e (p 0..15, e 0..1). Each (t, b, p) holds the 64
// codes of its pair for the tile's 32 outputs:
//
//   4-bit: 32 bytes, byte 2 j + e = code(16 * 0 + j, k) | code(16 * 1 + j, k) << 4
//   5-, 6-bit: those 32 bytes of the codes' low 4 bits, then for each higher bit 4 + i two
//     32-bit masks (8 bytes): bit 2 j + e of the first = bit 4 + i of code(j, k), of the
//     second of code(16 + j, k); 40 or 48 bytes
//   8-bit: 64 bytes, byte 32 v + 2 j + e = code(16 v + j, k)
//
// in the order [t][b][p], a uint8 array of MLX's shape in bytes (N, K * bits / 8), so the
// codes take the same bytes as MLX's packing. Scales and biases [t][g][32] (arrays of shape
// (N, K / group_size)), float16 where the layer's are (exact), else float32. A symmetric
// layer's biases are dropped (an array of shape (0,)): where every bias is -2^(bits - 1) times
// its scale (GGUF's Q4_0, Q5_0 and Q8_0 imported exactly: w = d (q - 2^(bits - 1))) the
// products take it from the scale, exactly, and read 2 bytes a group less (Q8_0's 8-bit head:
// 8.5 bits a weight, not 9, as llama.cpp reads it). One pair widens to two vectors of 16 outputs x 2 inputs as int16
// (4-bit: vpmovzxbw, then the low and high nibbles; 8-bit: two vpmovzxbw), each one vpdpwssd
// against x's pair broadcast: 32 products an instruction and no float dequantizing, where the
// float kernel spends 16 fused multiply-adds and about 7 more operations on 32 weights of a row.
// Without VNNI (Skylake-SP: AVX-512 F and BW) vpmaddwd and vpaddd give the same sums.
//
// x is rounded to int16 per block of 32 as in every int16 product (i16.h); the arithmetic is
// prefill_i16.cpp's tile_rows', so the bound is its: |y - y_f32| <= sum_k |s_g q_k| x_scale_b / 2.
#include "primitives.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "i16.h"
#include "kernels.h"
#include "threadpool.h"
#include "util.h"

namespace mlxinfer {

namespace {

constexpr int kTileRows = 32; // outputs a tile
constexpr int kRows = 8; // x's rows a pass over a tile (two int32 and two f32 accumulators each)

#if defined(MLXINFER_X86)

using i16::kBlock;
using i16::Problem;

// Scales and biases [t][g][32], float32 or float16 (as the layer's: read 16 at a time).
template <typename S>
struct Tiles {
  const uint8_t* codes; // [t][b][p] pairs
  const S* scales;
  const S* biases; // nullptr: a symmetric layer's, -2^(bits - 1) times the scales

  // Tile t's [g][32] scales and biases (nullptr where dropped).
  const S* tile_scales(int t, int G) const { return scales + static_cast<size_t>(t) * G * 32; }
  const S* tile_biases(int t, int G) const {
    return biases ? biases + static_cast<size_t>(t) * G * 32 : nullptr;
  }
};

using i16::load16;
using i16::scale_block;
using i16::store_rows;

// Ahead of block b of tile t (the next tile's, `tile_bytes` on): its codes, and at a group's
// first block the group's scales and biases, so they stream from memory meanwhile. One row's
// pass (`l2`) asks for the codes in L2 only: it runs through a tile faster than L1 holds it and
// the next one (an 8-bit tile of 640 inputs is 20 KB), so the next tile's lines evicted the
// current one's (AMD EPYC VM, one generate stream, in-process rounds: Gemma-3 1.10-1.16x,
// SmolLM2 1.00-1.16x; many rows' passes reuse a tile and keep L1).
template <typename S>
MLXINFER_WIDE_TILES inline void prefetch_next(const uint8_t* wb, size_t tile_bytes,
                                              size_t block_bytes, const S* ts, const S* tb, int G,
                                              int b, int per_group, int shift, bool l2) {
  for (size_t o = 0; o < block_bytes; o += 64) {
    if (l2) {
      _mm_prefetch(reinterpret_cast<const char*>(wb + tile_bytes + o), _MM_HINT_T1);
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(wb + tile_bytes + o), _MM_HINT_T0);
    }
  }
  if ((b & (per_group - 1)) == 0) {
    const size_t at = static_cast<size_t>(G + (b >> shift)) * kTileRows;
    for (size_t o = 0; o < kTileRows * sizeof(S); o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ts + at) + o, _MM_HINT_T0);
      if (tb != nullptr) {
        _mm_prefetch(reinterpret_cast<const char*>(tb + at) + o, _MM_HINT_T0);
      }
    }
  }
}

// acc += the pairwise products of a and b: with VNNI one vpdpwssd, in place (GCC's intrinsic
// copies each accumulator through another register: two moves a product in tile_pass, 8 rows
// spilled; as an instruction it needs no VNNI target, so the file compiles for AVX-512 BW).
// Without VNNI (Skylake-SP) vpmaddwd and vpaddd: the same int32 sums (codes <= 255, |x| <=
// 32767: no pair overflows), so the same outputs bit for bit.
template <bool VNNI>
MLXINFER_WIDE_TILES inline void dpwssd(__m512i& acc, __m512i a, __m512i b) {
  if constexpr (VNNI) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  } else {
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
  }
}

// Rows m0..m0+R of x against tile t's 32 outputs.
// `next`: whether tile t + 1 follows in this thread's span (the first pass asks for its lines).
template <int BITS, int R, typename S, bool VNNI>
MLXINFER_WIDE_TILES void tile_pass(const Problem& p, const Tiles<S>& tl, int t, int m0, bool next) {
  constexpr size_t kPair = 8 * BITS; // bytes a pair: 64 codes
  const int blocks = p.K / kBlock, G = p.K / p.gs, per_group = p.gs / kBlock;
  const int shift = per_group == 1 ? 0 : per_group == 2 ? 1 : 2; // blocks to groups, no idiv
  const size_t tile_bytes = static_cast<size_t>(blocks) * 16 * kPair;
  const uint8_t* tile = tl.codes + static_cast<size_t>(t) * tile_bytes;
  const S* ts = tl.tile_scales(t, G);
  const S* tb = tl.tile_biases(t, G);
  const __m512i low = _mm512_set1_epi16(15);
  __m512 C[R][2];
  for (int r = 0; r < R; ++r) {
    C[r][0] = C[r][1] = _mm512_setzero_ps();
  }
  for (int b = 0; b < blocks; ++b) {
    __m512i A[R][2];
    for (int r = 0; r < R; ++r) {
      A[r][0] = A[r][1] = _mm512_setzero_si512();
    }
    const uint8_t* wb = tile + static_cast<size_t>(b) * 16 * kPair;
    if (m0 == 0 && next) { // the next tile's block: its codes stream from memory meanwhile
      prefetch_next(wb, tile_bytes, 16 * kPair, ts, tb, G, b, per_group, shift, R == 1);
    }
    const int16_t* xb = p.xq + static_cast<size_t>(m0) * p.K + b * kBlock;
    for (int pair = 0; pair < 16; ++pair) {
      __m512i w0, w1;
      if constexpr (BITS != 8) {
        const __m512i z = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + pair * kPair)));
        w0 = _mm512_and_si512(z, low);
        w1 = _mm512_srli_epi16(z, 4);
        for (int i = 0; i < BITS - 4; ++i) { // 5- and 6-bit: bit 4 + i of each code, a mask
          uint32_t m0, m1;
          std::memcpy(&m0, wb + pair * kPair + 32 + 8 * i, 4);
          std::memcpy(&m1, wb + pair * kPair + 36 + 8 * i, 4);
          const __m512i add = _mm512_set1_epi16(static_cast<int16_t>(16 << i));
          w0 = _mm512_mask_add_epi16(w0, _cvtu32_mask32(m0), w0, add);
          w1 = _mm512_mask_add_epi16(w1, _cvtu32_mask32(m1), w1, add);
        }
      } else {
        w0 = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + pair * kPair)));
        w1 = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + pair * kPair + 32)));
      }
      for (int r = 0; r < R; ++r) {
        int32_t two;
        std::memcpy(&two, xb + static_cast<size_t>(r) * p.K + 2 * pair, 4);
        const __m512i xv = _mm512_set1_epi32(two);
        dpwssd<VNNI>(A[r][0], xv, w0);
        dpwssd<VNNI>(A[r][1], xv, w1);
      }
    }
    scale_block<R>(p, ts, tb, m0, b, b >> shift, (b & (per_group - 1)) == per_group - 1, A, C);
  }
  store_rows<R>(p, m0, static_cast<size_t>(t) * kTileRows, C);
}

template <int BITS, typename S, bool VNNI, size_t... R>
constexpr auto pass_table(std::index_sequence<R...>) {
  return std::array<void (*)(const Problem&, const Tiles<S>&, int, int, bool), sizeof...(R)>{
      tile_pass<BITS, static_cast<int>(R) + 1, S, VNNI>...};
}

template <int BITS, typename S, bool VNNI>
MLXINFER_WIDE_TILES void tiles_span(const Problem& p, const Tiles<S>& tl, int n0, int n1) {
  static constexpr auto kPass = pass_table<BITS, S, VNNI>(std::make_index_sequence<kRows>{});
  const int t1 = n1 / kTileRows;
  for (int t = n0 / kTileRows; t < t1; ++t) {
    const bool next = t + 1 < t1;
    for (int m = 0; m < p.M; m += kRows) {
      kPass[std::min(kRows, p.M - m) - 1](p, tl, t, m, next);
    }
  }
}

// Int8 activations (opt-in: set_int8_activations, MLXINFER_INT8_ACTIVATIONS=1; AVX-512 VNNI):
// x rounded to int8 per block of 32 (amax / 127, as llama.cpp's Q8 activations) and each 4
// inputs of an output one byte lane of `vpdpbusd` (the codes unsigned, x signed: 64 products an
// instruction, twice vpdpwssd's 32) on the same tiled layout. Two pairs' low nibbles (64 bytes),
// one vpermw putting pair 2 q's word j beside pair 2 q + 1's, hold inputs 4 q .. 4 q + 3 of
// output j in lane j (the low nibbles outputs 0-15, the high ones 16-31); 5-, 6-bit: each plane's
// two masks spread to those bytes (pdep) and added where set; 8-bit: vpermt2w over the two pairs'
// 128 bytes, each half 16 outputs. The scaling is tile_pass's, but the groups' sums of x are of
// the rounded x (prepare_row_i8), so the bound is |y - y_f32| <= sum_k |s_g q_k + b_g| x_scale_b
// / 2 with x's scale amax / 127 (int16's: 1/65534 of a block's largest |x|, this 1/254).
MLXINFER_I8 inline void dpbusd(__m512i& acc, __m512i w, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
}

template <int BITS, int R, typename S>
MLXINFER_I8 void tile_pass_i8(const Problem& p, const Tiles<S>& tl, int t, int m0, bool next) {
  constexpr size_t kPair = 8 * BITS;
  const int blocks = p.K / kBlock, G = p.K / p.gs, per_group = p.gs / kBlock;
  const int shift = per_group == 1 ? 0 : per_group == 2 ? 1 : 2;
  const size_t tile_bytes = static_cast<size_t>(blocks) * 16 * kPair;
  const uint8_t* tile = tl.codes + static_cast<size_t>(t) * tile_bytes;
  const S* ts = tl.tile_scales(t, G);
  const S* tb = tl.tile_biases(t, G);
  alignas(64) static constexpr uint16_t kBeside[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                       21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                     53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                     27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  alignas(64) static constexpr uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i beside = _mm512_load_si512(kBeside), lo_idx = _mm512_load_si512(kLow),
                hi_idx = _mm512_load_si512(kHigh);
  const __m512i low = _mm512_set1_epi8(15);
  __m512 C[R][2];
  for (int r = 0; r < R; ++r) {
    C[r][0] = C[r][1] = _mm512_setzero_ps();
  }
  for (int b = 0; b < blocks; ++b) {
    __m512i A[R][2];
    for (int r = 0; r < R; ++r) {
      A[r][0] = A[r][1] = _mm512_setzero_si512();
    }
    const uint8_t* wb = tile + static_cast<size_t>(b) * 16 * kPair;
    if (m0 == 0 && next) { // as tile_pass
      prefetch_next(wb, tile_bytes, 16 * kPair, ts, tb, G, b, per_group, shift, R == 1);
    }
    const int8_t* xb = p.x8 + static_cast<size_t>(m0) * p.K + b * kBlock;
    for (int q = 0; q < 8; ++q) { // inputs 4 q .. 4 q + 3 of the block
      __m512i w0, w1;
      if constexpr (BITS == 4) {
        const __m512i z = _mm512_permutexvar_epi16(beside, _mm512_loadu_si512(wb + q * 2 * kPair));
        w0 = _mm512_and_si512(z, low);
        w1 = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
      } else if constexpr (BITS != 8) { // 5-, 6-bit: the low nibbles as 4-bit, then each plane
        const uint8_t* pa = wb + q * 2 * kPair;
        const uint8_t* pb = pa + kPair;
        const __m512i both = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pa))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb)), 1);
        const __m512i z = _mm512_permutexvar_epi16(beside, both);
        w0 = _mm512_and_si512(z, low);
        w1 = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
        for (int i = 0; i < BITS - 4; ++i) { // bit 2 j + e of a pair's mask: byte 4 j + e (pair
          uint32_t a0, a1, b0, b1; //           2 q) or 4 j + 2 + e (pair 2 q + 1) of the lanes
          std::memcpy(&a0, pa + 32 + 8 * i, 4);
          std::memcpy(&a1, pa + 36 + 8 * i, 4);
          std::memcpy(&b0, pb + 32 + 8 * i, 4);
          std::memcpy(&b1, pb + 36 + 8 * i, 4);
          const __mmask64 k0 = _pdep_u64(a0, 0x3333333333333333ull) | _pdep_u64(b0, 0xCCCCCCCCCCCCCCCCull);
          const __mmask64 k1 = _pdep_u64(a1, 0x3333333333333333ull) | _pdep_u64(b1, 0xCCCCCCCCCCCCCCCCull);
          const __m512i add = _mm512_set1_epi8(static_cast<char>(16 << i));
          w0 = _mm512_mask_add_epi8(w0, k0, w0, add);
          w1 = _mm512_mask_add_epi8(w1, k1, w1, add);
        }
      } else {
        const __m512i a = _mm512_loadu_si512(wb + q * 2 * kPair);
        const __m512i c = _mm512_loadu_si512(wb + q * 2 * kPair + kPair);
        w0 = _mm512_permutex2var_epi16(a, lo_idx, c);
        w1 = _mm512_permutex2var_epi16(a, hi_idx, c);
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xb + static_cast<size_t>(r) * p.K + 4 * q, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        dpbusd(A[r][0], w0, xv);
        dpbusd(A[r][1], w1, xv);
      }
    }
    scale_block<R>(p, ts, tb, m0, b, b >> shift, (b & (per_group - 1)) == per_group - 1, A, C);
  }
  store_rows<R>(p, m0, static_cast<size_t>(t) * kTileRows, C);
}

template <int BITS, typename S, size_t... R>
constexpr auto pass_table_i8(std::index_sequence<R...>) {
  return std::array<void (*)(const Problem&, const Tiles<S>&, int, int, bool), sizeof...(R)>{
      tile_pass_i8<BITS, static_cast<int>(R) + 1, S>...};
}

template <int BITS, typename S>
MLXINFER_I8 void tiles_span_i8(const Problem& p, const Tiles<S>& tl, int n0, int n1) {
  static constexpr auto kPass = pass_table_i8<BITS, S>(std::make_index_sequence<kRows>{});
  const int t1 = n1 / kTileRows;
  for (int t = n0 / kTileRows; t < t1; ++t) {
    const bool next = t + 1 < t1;
    for (int m = 0; m < p.M; m += kRows) {
      kPass[std::min(kRows, p.M - m) - 1](p, tl, t, m, next);
    }
  }
}

// The same products in 256-bit vectors, for CPUs without AVX-512 (AVX2: Intel's client cores,
// AMD's before Zen 4): kPassRows rows a pass, each pair's codes widened to four vectors of 8 outputs
// x 2 inputs, vpmaddwd against x's pair and vpaddd (the exact int32 sums of vpdpwssd: |x| <=
// 32767, codes <= 255), then tile_pass's scaling in its order, so the outputs are bit for bit
// the AVX-512 path's. Accumulator v holds outputs 8 v .. 8 v + 7. Where the CPU has AVX-VNNI
// (VNNI: Intel's client cores since Alder Lake) the two are one 256-bit vpdpwssd, the same sums.
#ifndef MLXINFER_AVX2_PASS_ROWS
#define MLXINFER_AVX2_PASS_ROWS 2
#endif
constexpr int kPassRows = MLXINFER_AVX2_PASS_ROWS;
// From how many rows a tile's codes are widened once (expand_tile_avx2), not once a pass: 5-
// and 6-bit codes take 12-20 instructions a pair to widen, so from 4 rows (5-bit products
// 1.3-1.6x faster at 8-128 rows, 6-bit 1.5-2x); 4-bit codes' 6 instructions cost less than
// storing and loading the words (never), 8-bit from 256 rows (1.1-1.2x at 512; the Xeon VM
// capped at AVX2, docs/performance.md).
template <int BITS>
constexpr int expand_rows() {
  return BITS == 5 || BITS == 6 ? 4 : BITS == 8 ? 256 : 1 << 30;
}

template <typename S>
MLXINFER_I16_AVX2 inline __m256 load8(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(p);
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// scale_block (i16.h) in 256-bit vectors: accumulator v holds outputs 8 v .. 8 v + 7, scaled
// in the same order, so the outputs are the 512-bit path's bit for bit.
template <int R, typename S>
MLXINFER_I16_AVX2 inline void scale_block_avx2(const Problem& p, const S* ts, const S* tb, int m,
                                               int b, int g, bool last, const __m256i (&A)[R][4],
                                               __m256 (&C)[R][4]) {
  const int blocks = p.K / kBlock, G = p.K / p.gs;
  for (int r = 0; r < R; ++r) {
    const __m256 sx = _mm256_set1_ps(p.xscale[static_cast<size_t>(m + r) * blocks + b]);
    for (int v = 0; v < 4; ++v) {
      const __m256 s = load8(ts + g * kTileRows + 8 * v);
      C[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(A[r][v]), _mm256_mul_ps(s, sx), C[r][v]);
    }
  }
  if (last) { // the group's biases (or -2^(bits - 1) times its scales) times its sum of x
    __m256 bv[4];
    const __m256 sym = _mm256_set1_ps(-static_cast<float>(1 << (p.bits - 1)));
    for (int v = 0; v < 4; ++v) {
      bv[v] = tb != nullptr ? load8(tb + g * kTileRows + 8 * v)
                            : _mm256_mul_ps(load8(ts + g * kTileRows + 8 * v), sym);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_set1_ps(p.xsum[static_cast<size_t>(m + r) * G + g]);
      for (int v = 0; v < 4; ++v) {
        C[r][v] = _mm256_fmadd_ps(bv[v], xs, C[r][v]);
      }
    }
  }
}

template <int R>
MLXINFER_I16_AVX2 inline void store_rows_avx2(const Problem& p, int m, size_t n0,
                                              const __m256 (&C)[R][4]) {
  for (int r = 0; r < R; ++r) {
    float* yr = p.y + static_cast<size_t>(m + r) * p.N + n0;
    for (int v = 0; v < 4; ++v) {
      _mm256_storeu_ps(yr + 8 * v, C[r][v]);
    }
  }
}

// Bits 16 h .. 16 h + 15 of a 5- or 6-bit code's mask (`mask`: the 32 bits in every lane) as
// 16 words of `add` where set: word k's two bytes take the mask's byte 2 h + k / 8 (`route`),
// then bit k % 8 of each (`select`: both bytes of word k hold 1 << k % 8).
MLXINFER_I16_AVX2 inline __m256i mask_words(__m256i mask, __m256i route, __m256i select,
                                            __m256i add) {
  const __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(mask, route), select);
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, select), add);
}

// acc + the int32 sums of x's and w's int16 pairs: vpdpwssd in its VEX form (AVX-VNNI; as an
// instruction, since this file's AVX2 functions are not compiled for it), else vpmaddwd + vpaddd.
template <bool VNNI>
MLXINFER_I16_AVX2 inline __m256i dot_pairs(__m256i acc, __m256i x, __m256i w) {
  if constexpr (VNNI) {
    asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(x), "x"(w));
    return acc;
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
  }
}

// A pair's codes widened to words: w[v] holds outputs 8 v .. 8 v + 7 (x 2 inputs).
template <int BITS>
struct Unpack {
  __m256i low, select, route[2];

  MLXINFER_I16_AVX2 Unpack() {
    low = _mm256_set1_epi16(15);
    select = _mm256_setr_epi8(1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, -128, -128, 1, 1, 2,
                              2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, -128, -128);
    route[0] = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1,
                                1, 1, 1, 1, 1, 1, 1, 1, 1);
    route[1] = _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3,
                                3, 3, 3, 3, 3, 3, 3, 3, 3);
  }

  MLXINFER_I16_AVX2 inline void operator()(const uint8_t* pw, __m256i (&w)[4]) const {
    if constexpr (BITS != 8) {
      const __m256i z0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pw)));
      const __m256i z1 =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pw + 16)));
      w[0] = _mm256_and_si256(z0, low);
      w[1] = _mm256_and_si256(z1, low);
      w[2] = _mm256_srli_epi16(z0, 4);
      w[3] = _mm256_srli_epi16(z1, 4);
      for (int i = 0; i < BITS - 4; ++i) { // bit 4 + i: masks of outputs 0-15 and 16-31
        int32_t m0, m1;
        std::memcpy(&m0, pw + 32 + 8 * i, 4);
        std::memcpy(&m1, pw + 36 + 8 * i, 4);
        const __m256i b0 = _mm256_set1_epi32(m0), b1 = _mm256_set1_epi32(m1);
        const __m256i add = _mm256_set1_epi16(static_cast<int16_t>(16 << i));
        w[0] = _mm256_add_epi16(w[0], mask_words(b0, route[0], select, add));
        w[1] = _mm256_add_epi16(w[1], mask_words(b0, route[1], select, add));
        w[2] = _mm256_add_epi16(w[2], mask_words(b1, route[0], select, add));
        w[3] = _mm256_add_epi16(w[3], mask_words(b1, route[1], select, add));
      }
    } else {
      for (int v = 0; v < 4; ++v) {
        w[v] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pw + 16 * v)));
      }
    }
  }
};

// Rows m .. m + R - 1 of tile t. `words`: the tile's codes already widened (expand_tile_avx2,
// a prompt's many rows), else nullptr: each pair's widened here.
template <int BITS, typename S, bool VNNI, int R>
MLXINFER_I16_AVX2 void tile_rows_avx2(const Problem& p, const Tiles<S>& tl, int t, int m, bool next,
                                      const int16_t* words) {
  constexpr size_t kPair = 8 * BITS;
  const int blocks = p.K / kBlock, G = p.K / p.gs, per_group = p.gs / kBlock;
  const size_t tile_bytes = static_cast<size_t>(blocks) * 16 * kPair;
  const uint8_t* tile = tl.codes + static_cast<size_t>(t) * tile_bytes;
  const S* ts = tl.tile_scales(t, G);
  const S* tb = tl.tile_biases(t, G);
  const Unpack<BITS> unpack;
  __m256 C[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) {
      C[r][v] = _mm256_setzero_ps();
    }
  }
  for (int b = 0; b < blocks; ++b) {
    __m256i A[R][4];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 4; ++v) {
        A[r][v] = _mm256_setzero_si256();
      }
    }
    const uint8_t* wb = tile + static_cast<size_t>(b) * 16 * kPair;
    if (m == 0 && next && words == nullptr) { // the next tile's block, as tile_pass
      for (size_t o = 0; o < 16 * kPair; o += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(wb + tile_bytes + o), _MM_HINT_T0);
      }
    }
    const int16_t* xb = p.xq + static_cast<size_t>(m) * p.K + b * kBlock;
    for (int pair = 0; pair < 16; ++pair) {
      __m256i w[4]; // outputs 0-7, 8-15, 16-23, 24-31
      if (words != nullptr) {
        const int16_t* pw = words + (static_cast<size_t>(b) * 16 + pair) * 64;
        for (int v = 0; v < 4; ++v) {
          w[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 16 * v));
        }
      } else {
        unpack(wb + pair * kPair, w);
      }
      for (int r = 0; r < R; ++r) {
        int32_t two;
        std::memcpy(&two, xb + static_cast<size_t>(r) * p.K + 2 * pair, 4);
        const __m256i xv = _mm256_set1_epi32(two);
        for (int v = 0; v < 4; ++v) {
          A[r][v] = dot_pairs<VNNI>(A[r][v], xv, w[v]);
        }
      }
    }
    scale_block_avx2<R>(p, ts, tb, m, b, b / per_group, b % per_group == per_group - 1, A, C);
  }
  store_rows_avx2<R>(p, m, static_cast<size_t>(t) * kTileRows, C);
}

// Int8 activations on AVX2 (4-bit layers; 5-, 6- and 8-bit stay int16 there): two pairs' 64
// bytes interleaved by words (vpunpcklwd/hwd, then the 128-bit lanes put in order) hold inputs
// 4 q .. 4 q + 3 of 8 outputs a 32-bit lane, the low nibbles outputs 0-15, the high ones 16-31.
// With AVX-VNNI one vpdpbusd a vector (32 products: its VEX form, as an instruction as dot_pairs'
// is); else vpmaddubsw (the codes unsigned, x
// signed: pairs of products summed in int16, |15 * 127 * 2| = 3,810) added in int16 over the
// block's 8 quads (at most 30,480: no wrap) and widened once a block by vpmaddwd with ones.
// The same int32 sums as the AVX-512 path, so the same outputs bit for bit.
MLXINFER_I16_AVX2 inline __m256i dot_quads(__m256i acc, __m256i w, __m256i x) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
  return acc;
}

template <typename S, bool VNNI, int R>
MLXINFER_I16_AVX2 void tile_rows_avx2_i8(const Problem& p, const Tiles<S>& tl, int t, int m, bool next) {
  constexpr size_t kPair = 32; // 4-bit
  const int blocks = p.K / kBlock, G = p.K / p.gs, per_group = p.gs / kBlock;
  const size_t tile_bytes = static_cast<size_t>(blocks) * 16 * kPair;
  const uint8_t* tile = tl.codes + static_cast<size_t>(t) * tile_bytes;
  const S* ts = tl.tile_scales(t, G);
  const S* tb = tl.tile_biases(t, G);
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 C[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) {
      C[r][v] = _mm256_setzero_ps();
    }
  }
  for (int b = 0; b < blocks; ++b) {
    __m256i A[R][4];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 4; ++v) {
        A[r][v] = _mm256_setzero_si256();
      }
    }
    const uint8_t* wb = tile + static_cast<size_t>(b) * 16 * kPair;
    if (m == 0 && next) {
      for (size_t o = 0; o < 16 * kPair; o += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(wb + tile_bytes + o), _MM_HINT_T0);
      }
    }
    const int8_t* xb = p.x8 + static_cast<size_t>(m) * p.K + b * kBlock;
    for (int q = 0; q < 8; ++q) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + q * 2 * kPair));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + q * 2 * kPair + kPair));
      const __m256i lo = _mm256_unpacklo_epi16(a, c), hi = _mm256_unpackhi_epi16(a, c);
      const __m256i w07 = _mm256_permute2x128_si256(lo, hi, 0x20); // outputs 0-7 (and 16-23)
      const __m256i w815 = _mm256_permute2x128_si256(lo, hi, 0x31); // outputs 8-15 (and 24-31)
      const __m256i w[4] = {_mm256_and_si256(w07, low), _mm256_and_si256(w815, low),
                            _mm256_and_si256(_mm256_srli_epi16(w07, 4), low),
                            _mm256_and_si256(_mm256_srli_epi16(w815, 4), low)};
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xb + static_cast<size_t>(r) * p.K + 4 * q, 4);
        const __m256i xv = _mm256_set1_epi32(four);
        for (int v = 0; v < 4; ++v) {
          if constexpr (VNNI) {
            A[r][v] = dot_quads(A[r][v], w[v], xv);
          } else { // int16 sums of the block (widened below)
            A[r][v] = _mm256_add_epi16(A[r][v], _mm256_maddubs_epi16(w[v], xv));
          }
        }
      }
    }
    if constexpr (!VNNI) {
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < 4; ++v) {
          A[r][v] = _mm256_madd_epi16(A[r][v], ones);
        }
      }
    }
    scale_block_avx2<R>(p, ts, tb, m, b, b / per_group, b % per_group == per_group - 1, A, C);
  }
  store_rows_avx2<R>(p, m, static_cast<size_t>(t) * kTileRows, C);
}

template <typename S, bool VNNI>
MLXINFER_I16_AVX2 void tiles_span_avx2_i8(const Problem& p, const Tiles<S>& tl, int n0, int n1) {
  const int t1 = n1 / kTileRows;
  for (int t = n0 / kTileRows; t < t1; ++t) {
    int m = 0;
    for (; m + kPassRows <= p.M; m += kPassRows) {
      tile_rows_avx2_i8<S, VNNI, kPassRows>(p, tl, t, m, t + 1 < t1);
    }
    for (; m < p.M; ++m) {
      tile_rows_avx2_i8<S, VNNI, 1>(p, tl, t, m, t + 1 < t1);
    }
  }
}

// Tile t's codes widened once, [block][pair][32 outputs x 2 inputs] as words (K x 64 bytes), for
// a product of many rows: each pass then loads them instead of widening a pair per pass.
template <int BITS, typename S>
MLXINFER_I16_AVX2 void expand_tile_avx2(const Problem& p, const Tiles<S>& tl, int t, int16_t* out) {
  constexpr size_t kPair = 8 * BITS;
  const int pairs = p.K / 2;
  const uint8_t* tile = tl.codes + static_cast<size_t>(t) * pairs * kPair;
  const Unpack<BITS> unpack;
  for (int i = 0; i < pairs; ++i) {
    __m256i w[4];
    unpack(tile + i * kPair, w);
    for (int v = 0; v < 4; ++v) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + static_cast<size_t>(i) * 64 + 16 * v), w[v]);
    }
  }
}

template <int BITS, typename S, bool VNNI>
MLXINFER_I16_AVX2 void tiles_span_avx2(const Problem& p, const Tiles<S>& tl, int n0, int n1) {
  const int t1 = n1 / kTileRows;
  aligned_vector<int16_t> words(p.M >= expand_rows<BITS>() ? static_cast<size_t>(p.K) * 32 : 0);
  for (int t = n0 / kTileRows; t < t1; ++t) {
    const int16_t* wx = nullptr;
    if (!words.empty()) {
      expand_tile_avx2<BITS, S>(p, tl, t, words.data());
      wx = words.data();
    }
    int m = 0;
    for (; m + kPassRows <= p.M; m += kPassRows) {
      tile_rows_avx2<BITS, S, VNNI, kPassRows>(p, tl, t, m, t + 1 < t1, wx);
    }
    for (; m < p.M; ++m) {
      tile_rows_avx2<BITS, S, VNNI, 1>(p, tl, t, m, t + 1 < t1, wx);
    }
  }
}

// The span function for a width: AVX-512's tile_pass (`wide`), else AVX2's rows, each with
// its width's vpdpwssd where the CPU has it (`vnni`: AVX-512 VNNI, or AVX-VNNI).
template <typename S>
using SpanFn = void (*)(const Problem&, const Tiles<S>&, int, int);

template <typename S, int BITS>
SpanFn<S> span_fn_bits(bool wide, bool vnni) {
  if (wide) {
    return vnni ? tiles_span<BITS, S, true> : tiles_span<BITS, S, false>;
  }
  return vnni ? tiles_span_avx2<BITS, S, true> : tiles_span_avx2<BITS, S, false>;
}

template <typename S>
SpanFn<S> span_fn_i8(bool wide, bool vnni, int bits) {
  if (!wide) { // AVX2: 4-bit only (int8_takes)
    return vnni ? tiles_span_avx2_i8<S, true> : tiles_span_avx2_i8<S, false>;
  }
  return bits == 4   ? tiles_span_i8<4, S>
      : bits == 5    ? tiles_span_i8<5, S>
      : bits == 6    ? tiles_span_i8<6, S>
                     : tiles_span_i8<8, S>;
}

template <typename S>
SpanFn<S> span_fn(bool wide, bool vnni, int bits) {
  return bits == 4   ? span_fn_bits<S, 4>(wide, vnni)
      : bits == 5    ? span_fn_bits<S, 5>(wide, vnni)
      : bits == 6    ? span_fn_bits<S, 6>(wide, vnni)
                     : span_fn_bits<S, 8>(wide, vnni);
}

#endif // MLXINFER_X86

// Code k of a row in MLX's little-endian bit stream (bits <= 8: within two bytes of the row).
int code_at(const uint8_t* row, size_t row_bytes, int k, int bits) {
  const size_t bit = static_cast<size_t>(k) * bits, at = bit / 8;
  const int two = row[at] | (at + 1 < row_bytes ? row[at + 1] << 8 : 0);
  return (two >> (bit % 8)) & ((1 << bits) - 1);
}

std::atomic<bool> g_int8_activations{false};

// Whether a tiled product of `bits` takes int8 activations on this path: AVX-512 with VNNI
// (every width), AVX2 (4-bit: the 5-/6-bit planes and 8-bit codes stay int16 there).
bool int8_takes(bool wide, bool vnni, int bits) {
  return wide ? vnni : bits == 4;
}

} // namespace

void set_int8_activations(bool on) {
  g_int8_activations.store(on);
}

bool int8_activations() {
  return g_int8_activations.load();
}

bool tiles_int8_available() {
  return tiles_wide_vnni() || (tiles_available() && !tiles_wide_available());
}

std::tuple<mx::array, mx::array, mx::array> tile_layer(const mx::array& w,
                                                       const mx::array& scales,
                                                       const mx::array& biases, int group_size,
                                                       int bits, bool half, bool drop_symmetric) {
  const std::string op = "[mlxinfer tile_layer] ";
  const int64_t K = check_affine(op, w, scales, biases, group_size, bits);
  if (bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    throw std::invalid_argument(op + "bits: a tiled layer has 4, 5, 6 or 8, found " +
                                std::to_string(bits));
  }
  if (w.shape(0) % kTileRows != 0) {
    throw std::invalid_argument(op + "w: expected a multiple of 32 rows, found shape " +
                                shape_str(w.shape()));
  }
  mx::eval({w, scales, biases});
  const int N = w.shape(0), blocks = static_cast<int>(K / 32), G = static_cast<int>(K / group_size);
  const size_t row_bytes = static_cast<size_t>(K) * bits / 8;
  std::vector<uint32_t> wcopy;
  const auto* src = reinterpret_cast<const uint8_t*>(contiguous_words(w, wcopy));
  auto* codes = new uint8_t[static_cast<size_t>(N) * row_bytes];
  std::vector<float> sf(scales.size()), bf(biases.size());
  to_f32(scales, sf.data());
  to_f32(biases, bf.data());
  // every bias -2^(bits - 1) times its scale, bit for bit (a power of two: no rounding; the
  // bits compared, so a zero's sign is the product's too)
  const float sym = -static_cast<float>(1 << (bits - 1));
  bool symmetric = drop_symmetric;
  for (size_t i = 0; symmetric && i < sf.size(); ++i) {
    const float b = sf[i] * sym;
    symmetric = std::memcmp(&b, &bf[i], sizeof b) == 0;
  }
  const size_t sb_bytes = static_cast<size_t>(N) * G * (half ? 2 : 4);
  auto* ts = new uint8_t[sb_bytes];
  auto* tb = new uint8_t[symmetric ? 1 : sb_bytes];
  parallel_rows(N, kTileRows, static_cast<size_t>(N) * row_bytes, [&](int n0, int n1) {
    for (int t = n0 / kTileRows; t < n1 / kTileRows; ++t) {
      const uint8_t* rows = src + static_cast<size_t>(t) * kTileRows * row_bytes;
      uint8_t* out = codes + static_cast<size_t>(t) * kTileRows * row_bytes;
      for (int b = 0; b < blocks; ++b) {
        for (int p = 0; p < 16; ++p) {
          if (bits == 4) { // byte 16 b + p of a row: inputs 2 p (low nibble) and 2 p + 1
            for (int j = 0; j < 16; ++j) {
              const uint8_t lo = rows[j * row_bytes + 16 * b + p];
              const uint8_t hi = rows[(16 + j) * row_bytes + 16 * b + p];
              out[2 * j] = static_cast<uint8_t>((lo & 15) | (hi << 4));
              out[2 * j + 1] = static_cast<uint8_t>((lo >> 4) | (hi & 0xF0));
            }
            out += 32;
          } else if (bits != 8) { // the low nibbles as 4-bit, then bit 4 + i of every code
            const int k = 32 * b + 2 * p;
            uint32_t planes[2][2] = {};
            for (int j = 0; j < 16; ++j) {
              for (int e = 0; e < 2; ++e) {
                const int c0 = code_at(rows + j * row_bytes, row_bytes, k + e, bits);
                const int c1 = code_at(rows + (16 + j) * row_bytes, row_bytes, k + e, bits);
                out[2 * j + e] = static_cast<uint8_t>((c0 & 15) | (c1 & 15) << 4);
                for (int i = 0; i < bits - 4; ++i) {
                  planes[i][0] |= static_cast<uint32_t>((c0 >> (4 + i)) & 1) << (2 * j + e);
                  planes[i][1] |= static_cast<uint32_t>((c1 >> (4 + i)) & 1) << (2 * j + e);
                }
              }
            }
            for (int i = 0; i < bits - 4; ++i) {
              std::memcpy(out + 32 + 8 * i, &planes[i][0], 4);
              std::memcpy(out + 36 + 8 * i, &planes[i][1], 4);
            }
            out += 8 * bits;
          } else {
            for (int v = 0; v < 2; ++v) {
              for (int j = 0; j < 16; ++j) {
                const uint8_t* r = rows + (16 * v + j) * row_bytes + 32 * b + 2 * p;
                out[32 * v + 2 * j] = r[0];
                out[32 * v + 2 * j + 1] = r[1];
              }
            }
            out += 64;
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int j = 0; j < kTileRows; ++j) {
          const size_t from = static_cast<size_t>(t * kTileRows + j) * G + g;
          const size_t to = (static_cast<size_t>(t) * G + g) * kTileRows + j;
          if (half) {
            reinterpret_cast<mx::float16_t*>(ts)[to] = static_cast<mx::float16_t>(sf[from]);
          } else {
            reinterpret_cast<float*>(ts)[to] = sf[from];
          }
          if (symmetric) {
            continue;
          }
          if (half) {
            reinterpret_cast<mx::float16_t*>(tb)[to] = static_cast<mx::float16_t>(bf[from]);
          } else {
            reinterpret_cast<float*>(tb)[to] = bf[from];
          }
        }
      }
    }
  });
  const auto free = [](void* p) { delete[] static_cast<uint8_t*>(p); };
  const mx::Shape sshape = {N, G};
  const mx::Dtype sdtype = half ? mx::float16 : mx::float32;
  return {mx::array(codes, {N, static_cast<int>(row_bytes)}, mx::uint8, free),
          mx::array(ts, sshape, sdtype, free),
          mx::array(tb, symmetric ? mx::Shape{0} : sshape, sdtype, free)};
}

bool tiles_available() {
#if defined(MLXINFER_X86)
  return current_isa() == kAvx2 || current_isa() == kAvx512;
#else
  return false;
#endif
}

bool tiles_wide_available() {
  return avx512_bw_cpu() && current_isa() == kAvx512;
}

bool tiles_wide_vnni() {
  return tiles_wide_available() && avx512_vnni_cpu();
}

bool is_tiled(const mx::array& w) {
  return w.dtype() == mx::uint8;
}

int64_t check_tiled(const std::string& op, const mx::array& w, const mx::array& scales,
                    const mx::array& biases, int group_size, int bits) {
  if (bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    throw std::invalid_argument(op + "bits: a tiled layer has 4, 5, 6 or 8, found " +
                                std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument(op + "group_size: expected 32, 64 or 128, found " +
                                std::to_string(group_size));
  }
  if (w.ndim() != 2 || w.shape(0) % kTileRows != 0 ||
      static_cast<int64_t>(w.shape(1)) * 8 % (static_cast<int64_t>(bits) * group_size) != 0) {
    throw std::invalid_argument(op + "w: expected a tiled uint8 array (N, K * bits / 8) with N a "
                                "multiple of 32 and K of group_size, found shape " +
                                shape_str(w.shape()));
  }
  const int64_t K = static_cast<int64_t>(w.shape(1)) * 8 / bits;
  const mx::Shape sshape = {w.shape(0), static_cast<int>(K / group_size)};
  const bool dropped = biases.shape() == mx::Shape{0}; // a symmetric layer's (tile_layer)
  if (scales.shape() != sshape || (biases.shape() != sshape && !dropped) ||
      scales.dtype() != biases.dtype() ||
      (scales.dtype() != mx::float32 && scales.dtype() != mx::float16)) {
    throw std::invalid_argument(op + "scales/biases: a tiled layer's are both float32 or both "
                                "float16, of shape " +
                                shape_str(sshape) + " (biases (0,) where dropped), found " +
                                shape_str(scales.shape()) + " and " + shape_str(biases.shape()));
  }
  return K;
}

void tiled_matvec_f32(const float* x, int M, const mx::array& w, const mx::array& sc,
                      const mx::array& bi, int gs, int bits, float* y) {
#if defined(MLXINFER_X86)
  const bool wide = tiles_wide_available(); // else the AVX2 path: the same outputs
  const bool vnni = wide ? avx512_vnni_cpu() : avx_vnni_available();
  if (!tiles_available()) {
    throw std::runtime_error("[mlxinfer tiled product] needs AVX2 at the kernels' ISA level "
                             "(a tiled layer is made only where it is)");
  }
  const bool dropped = bi.size() == 0; // a symmetric layer's biases (tile_layer)
  if (!w.flags().row_contiguous || !sc.flags().row_contiguous ||
      (!dropped && !bi.flags().row_contiguous)) {
    throw std::runtime_error("[mlxinfer tiled product] the tiles must be row-contiguous");
  }
  Problem p;
  p.N = w.shape(0);
  p.K = static_cast<int>(static_cast<int64_t>(w.shape(1)) * 8 / bits);
  p.M = M;
  p.gs = gs;
  p.bits = bits;
  p.x = x;
  p.y = y;
  if (p.M == 0 || p.N == 0) {
    return;
  }
  const int blocks = p.K / kBlock, G = p.K / gs;
  // int8 activations where asked and the path has them (int8_takes)
  const bool i8 = int8_activations() && int8_takes(wide, vnni, bits);
  aligned_vector<int16_t> xq(i8 ? 0 : static_cast<size_t>(M) * p.K);
  aligned_vector<int8_t> x8(i8 ? static_cast<size_t>(M) * p.K : 0);
  // not zeroed: prepare_row writes every row's block scales and group sums
  aligned_vector<float> xscale(static_cast<size_t>(M) * blocks), xsum(static_cast<size_t>(M) * G);
  for (int m = 0; m < M; ++m) {
    float* xs = xscale.data() + static_cast<size_t>(m) * blocks;
    float* sums = xsum.data() + static_cast<size_t>(m) * G;
    if (i8) {
      (wide ? i16::prepare_row_i8 : i16::prepare_row_i8_avx2)(
          p, m, x8.data() + static_cast<size_t>(m) * p.K, xs, sums);
    } else {
      (wide ? i16::prepare_row : i16::prepare_row_avx2)(
          p, m, xq.data() + static_cast<size_t>(m) * p.K, xs, sums);
    }
  }
  p.xq = xq.data();
  p.x8 = x8.data();
  p.xscale = xscale.data();
  p.xsum = xsum.data();
  const size_t bytes = static_cast<size_t>(p.N) * p.K * bits / 8;
  // A decode step's few rows (one pass over each tile): tasks of about 1 MB of codes, at least
  // one a thread, not four a thread: a small product's eight tasks of 2-3 tiles each began
  // with a claim on the shared counter and lines not prefetched (AMD EPYC VM, SmolLM2's shapes
  // alternated in one process, 1 and 8 rows: 576 x 1536 1.27-1.29x and 1.11x, 960 x 576 and
  // 576 x 576 1.04-1.09x, 3072 x 576 and the head level; docs/performance.md). A prompt's
  // rows keep four a thread: their tasks are long, and balance matters more.
  const size_t task_bytes = M <= kRows ? size_t{1} << 20 : 0;
  if (sc.dtype() == mx::float32) {
    const Tiles<float> tl{w.data<uint8_t>(), sc.data<float>(),
                          dropped ? nullptr : bi.data<float>()};
    const auto fn = i8 ? span_fn_i8<float>(wide, vnni, bits) : span_fn<float>(wide, vnni, bits);
    parallel_rows(p.N, kTileRows, bytes, [&](int n0, int n1) { fn(p, tl, n0, n1); }, task_bytes);
  } else {
    const Tiles<mx::float16_t> tl{w.data<uint8_t>(), sc.data<mx::float16_t>(),
                                  dropped ? nullptr : bi.data<mx::float16_t>()};
    const auto fn = i8 ? span_fn_i8<mx::float16_t>(wide, vnni, bits)
                       : span_fn<mx::float16_t>(wide, vnni, bits);
    parallel_rows(p.N, kTileRows, bytes, [&](int n0, int n1) { fn(p, tl, n0, n1); }, task_bytes);
  }
#else
  (void)x, (void)M, (void)w, (void)sc, (void)bi, (void)gs, (void)bits, (void)y;
  throw std::runtime_error("[mlxinfer tiled product] needs AVX2 (x86-64)");
#endif
}

} // namespace mlxinfer
