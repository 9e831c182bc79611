// The kernels. Each output row n streams its packed weights once and multiplies them
// with rows of x held in cache; the codes (2, 3, 4, 5, 6 or 8 bits) are widened to f32 in
// registers (never written out dequantized). 4- and 8-bit codes are whole nibbles and bytes;
// 2/3/5/6-bit ones are read per 8-code unit (`bits` bytes) by byte shuffles (StreamTables).
// MLX's float modes reuse those layouts: mxfp4/nvfp4's E2M1 codes the 4-bit one (a table of
// the doubled values), mxfp8's E4M3 codes the 8-bit one (widened through float16, F16C).
//
// Per group g of a row: sum_k x_k (s_g q_k + b_g) = s_g * sum_k x_k q_k + b_g * sum_k x_k,
// so the inner loop is one FMA per weight and the bias term costs one FMA per group.
#include "kernels.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace mlxinfer {

float e4m3_to_f32(uint8_t b) {
  const int m7 = b & 0x7F, e = m7 >> 3, f = m7 & 7;
  const float v = m7 == 0x7F ? std::numeric_limits<float>::quiet_NaN()
      : e == 0               ? std::ldexp(static_cast<float>(f), -9)
                             : std::ldexp(static_cast<float>(8 + f), e - 10);
  return (b & 0x80) != 0 ? -v : v;
}

// The x86 loops (set_qmv_rows_path): 1 several rows over blocks of output rows (AVX-512) and
// one row of 8-bit codes dequantized (AVX2), 0 the loops before.
std::atomic<int> g_qmv_rows_path{1};

void set_qmv_rows_path(int path) {
  g_qmv_rows_path.store(path);
}

// Output rows per pass of the AVX-512 one-row (decode) loops (set_qmv_decode_rows): 0 by the
// row's length (qmv_decode_rows), or 1 or 2 forced.
std::atomic<int> g_qmv_decode_rows{0};

void set_qmv_decode_rows(int rows) {
  g_qmv_decode_rows.store(rows == 1 || rows == 2 ? rows : 0);
}

namespace {

// Every E4M3 byte's value (the scalar path's mxfp8 codes).
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) {
      t[i] = e4m3_to_f32(static_cast<uint8_t>(i));
    }
    return t;
  }();
  return table;
}

// ----------------------------------------------------------------------------
// Portable path
// ----------------------------------------------------------------------------

// E2M1 (mxfp4's codes): sign, 2 exponent bits, 1 mantissa bit.
constexpr float kE2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void qmv_rows_scalar(const QmvProblem& p, int n0, int n1) {
  const int G = p.K / p.group_size;
  const uint32_t mask = (1u << p.bits) - 1u;
  const int words_per_row = p.K * p.bits / 32; // K * bits is a multiple of 32 (nvfp4: K of 16s)
  // The code's value: E2M1 (mxfp4, nvfp4), E4M3 (mxfp8) or the integer (affine).
  const float* lut = p.mode == kMxfp4 || p.mode == kNvfp4 ? kE2m1
      : p.mode == kMxfp8                                  ? e4m3_table().data()
                                                          : nullptr;
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = p.w + static_cast<size_t>(n) * words_per_row;
    const float* s = p.scales + static_cast<size_t>(n) * G;
    const float* b = qmv_biases_row(p, n);
    for (int m = 0; m < p.M; ++m) {
      const float* x = p.x + static_cast<size_t>(m) * p.K;
      const float* xs = p.xsum + static_cast<size_t>(m) * G;
      float total = 0.0f;
      for (int g = 0; g < G; ++g) {
        float acc = 0.0f;
        const int k0 = g * p.group_size;
        for (int k = k0; k < k0 + p.group_size; ++k) {
          // Code k at bit k * bits of the row's stream; a 3/5/6-bit one may straddle words.
          const int bit = k * p.bits, word = bit >> 5, shift = bit & 31;
          uint32_t v = wr[word] >> shift;
          if (shift + p.bits > 32) {
            v |= wr[word + 1] << (32 - shift);
          }
          acc += x[k] * (lut != nullptr ? lut[v & mask] : static_cast<float>(v & mask));
        }
        total += s[g] * acc + b[g] * xs[g];
      }
      p.y[static_cast<size_t>(m) * p.N + n] = total;
    }
  }
}

// The bit-stream widths' unpacking, for 8-code units (`BITS` bytes each): lane i of a unit
// takes the two bytes from i * qmv_width(BITS) / 8 (a byte shuffle of a 16-byte load), masked to its
// code in place (bits i * BITS % 8 and up): it is code << s, and qmv_prepare scales x by 2^-s
// to match (exact: a power of two), so no per-lane shift runs in the loop.
template <int BITS>
struct StreamTables {
  alignas(64) int8_t ctrl16[64]; // 16 lanes: two units, the 16 loaded bytes in each 128 bits
  alignas(64) uint32_t mask16[16]; // lane i's code bits (the pattern repeats every 8 lanes)
  alignas(64) float inv16[16]; // 2^-s of lane i
  alignas(32) int8_t ctrl8[32]; // 8 lanes: one unit
};

template <int BITS>
constexpr StreamTables<BITS> make_stream_tables() {
  StreamTables<BITS> t{};
  for (int i = 0; i < 16; ++i) {
    const int o = i * qmv_width(BITS) / 8, sh = i * BITS % 8;
    const int8_t c[4] = {static_cast<int8_t>(o), static_cast<int8_t>(o + 1), -128, -128};
    for (int j = 0; j < 4; ++j) {
      t.ctrl16[4 * i + j] = c[j];
      if (i < 8) {
        t.ctrl8[4 * i + j] = c[j];
      }
    }
    t.mask16[i] = ((1u << BITS) - 1u) << sh;
    t.inv16[i] = 1.0f / static_cast<float>(1 << sh);
  }
  return t;
}

template <int BITS>
constexpr StreamTables<BITS> kStream = make_stream_tables<BITS>();

#if defined(MLXINFER_X86)

// The quantized AVX2 paths take F16C too (mxfp8's codes; every AVX2 CPU has it, and
// qmv_rows_path runs mxfp8 on the scalar path where one does not).
#define MLXINFER_QAVX2 MLXINFER_AVX2_F16C

// E4M3 bytes, sign-extended to 16 bits, as the float16 of value * 2^-8: the sign to bit 15,
// exponent and mantissa to bits 7-13 (float16's exponent field is E4M3's with bias 15 for 7,
// subnormals included). 0x7F/0xFF become a NaN: their bits 7-13 (0x3F80) are the only ones that
// carry into bit 14 when 0x80 is added, and bit 14 with their exponent bits 10-13 makes float16's
// all-ones exponent (3 operations; a compare and select took 4, and 11% more time on AVX-512).
MLXINFER_QAVX2 inline __m256i e4m3_as_f16(__m256i v) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16(-16512)); // 0xBF80
  const __m256i carry = _mm256_add_epi16(h, _mm256_set1_epi16(0x80));
  return _mm256_or_si256(h, _mm256_and_si256(carry, _mm256_set1_epi16(0x4000)));
}

// One 16-weight chunk as two vectors of 8 f32 codes, matched with xp[0:8], xp[8:16].
// 4-bit: 8 bytes hold 16 codes; low nibbles are the even k, high nibbles the odd k
// (xp is x de-interleaved to match). 8-bit: two runs of 8 bytes, k in order (xp == x).
// 2/3/5/6-bit: two units (StreamTables), k in order, each code << its bit offset (xp scaled).
template <int BITS>
MLXINFER_QAVX2 inline void unpack16(const uint8_t* src, __m256& a, __m256& b) {
  if constexpr (qmv_stream_bits(BITS)) {
    const __m256i ctrl = _mm256_load_si256(reinterpret_cast<const __m256i*>(kStream<BITS>.ctrl8));
    const __m256i mask =
        _mm256_load_si256(reinterpret_cast<const __m256i*>(kStream<BITS>.mask16));
    const __m256i u0 =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m256i u1 = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + BITS)));
    a = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_shuffle_epi8(u0, ctrl), mask));
    b = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_shuffle_epi8(u1, ctrl), mask));
  } else if constexpr (qmv_e2m1(BITS)) { // nibbles as 4-bit; 2 * E2M1 value by a byte lookup
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(v, nib));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), nib));
    a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  } else if constexpr (BITS == kFp8) { // 16 E4M3 codes in order, as float16 (value * 2^-8)
    const __m256i h = e4m3_as_f16(
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
    a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  } else if constexpr (BITS == 4) {
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
MLXINFER_QAVX2 void qmv_row_avx2(
    const QmvProblem& p,
    const uint8_t* wr,
    const float* s,
    const float* b,
    int m0,
    int n) {
  const int G = p.K / p.group_size;
  const int gs = p.group_size;
  constexpr int bytes16 = 16 * qmv_width(BITS) / 8; // bytes per 16 codes
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
    const uint8_t* wg = wr + static_cast<size_t>(k0) * qmv_width(BITS) / 8;
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
// Several rows of x against one output row on AVX2, as qmv_row_dq_avx512: each 16-weight chunk
// dequantized once (s q + b, one FMA per 8) for up to 8 rows. From 5 rows this beat
// qmv_row_avx2's per-group scaling (which redoes the unpacking per pass of 4 rows), measured
// with the AVX2 path on this project's AVX-512 Xeon VM, the 576->1536 layer on one thread:
// 6 rows 1.3x, 8 rows 1.2x, 4 rows 0.8x (so 4 and fewer keep it). 8 rows hold 16 totals in
// AVX2's 16 registers with spills, and still beat 6 + 2.
template <int BITS, int M>
MLXINFER_QAVX2 void qmv_row_dq_avx2(
    const QmvProblem& p,
    const uint8_t* wr,
    const float* s,
    const float* b,
    int m0,
    int n) {
  const int gs = p.group_size;
  constexpr int bytes16 = 16 * qmv_width(BITS) / 8;
  // The bit-stream widths' codes come out << their bit offsets: the scale takes the 2^-s
  // (so the dequantized weight is exact) and x is read unscaled.
  constexpr bool stream = qmv_stream_bits(BITS);
  const float* xbase = stream ? p.x : p.xp;
  __m256 tot[M][2];
  const float* xrow[M];
  for (int m = 0; m < M; ++m) {
    tot[m][0] = tot[m][1] = _mm256_setzero_ps();
    xrow[m] = xbase + static_cast<size_t>(m0 + m) * p.K;
  }
  const int gshift = __builtin_ctz(static_cast<unsigned>(gs));
  for (int k = 0; k < p.K; k += 16) {
    const int g = k >> gshift;
    __m256 sv = _mm256_set1_ps(s[g]);
    const __m256 bv = _mm256_set1_ps(b[g]);
    if constexpr (stream) {
      sv = _mm256_mul_ps(sv, _mm256_load_ps(kStream<BITS>.inv16));
    }
    __m256 qa, qb;
    unpack16<BITS>(wr + (k / 16) * bytes16, qa, qb);
    qa = _mm256_fmadd_ps(qa, sv, bv);
    qb = _mm256_fmadd_ps(qb, sv, bv);
    for (int m = 0; m < M; ++m) {
      const float* xk = xrow[m] + k;
      tot[m][0] = _mm256_fmadd_ps(qa, _mm256_loadu_ps(xk), tot[m][0]);
      tot[m][1] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(xk + 8), tot[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    p.y[static_cast<size_t>(m0 + m) * p.N + n] = hsum256(_mm256_add_ps(tot[m][0], tot[m][1]));
  }
}

template <int BITS, int R>
MLXINFER_QAVX2 void qmv_rows1_avx2(const QmvProblem& p, const uint8_t* w, size_t row_bytes, int n) {
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
    br[r] = qmv_biases_row(p, n + r);
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
      const size_t off = static_cast<size_t>(k0 + c) * qmv_width(BITS) / 8;
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

// One row of x (decode) at the bit-stream widths, in blocks of 64 codes read 4 per 32-bit
// lane: lane l holds codes 4l..4l+3 (4 * BITS <= 24 bits from byte 4l * qmv_width(BITS) / 8), so one
// masked load (exactly the block's 2 * BITS words), one dword permutation and one byte shuffle
// place a block, and each of its four vectors (code j of every lane) is one AND and one convert:
// the codes stay where they lie (code << s, s <= 19, exact in f32) and qmv_prepare puts x in
// the matching order, scaled by 2^-s. Against unpack32's shuffle per 16 codes this does two
// shuffles per 64. K % 64 (32 codes, group size 32 only) is read as unpack32 reads it.
template <int BITS>
struct BlockTables {
  alignas(64) int32_t idx[16]; // 128-bit lane L takes words d_L .. d_L + 3
  alignas(64) int8_t ctrl[64]; // lane l: the 4 bytes from 4l * qmv_width(BITS) / 8, within its 128 bits
  alignas(64) uint32_t mask[4][16]; // vector j: lane l's code 4l + j, in place
  int shift[4][16]; // where code 4l + j lies in lane l (x is scaled by 2^-shift)
};

template <int BITS>
constexpr BlockTables<BITS> make_block_tables() {
  BlockTables<BITS> t{};
  for (int lane128 = 0; lane128 < 4; ++lane128) {
    const int d = 2 * BITS * lane128 / 4; // the word holding code 16 * lane128's first bit
    for (int i = 0; i < 4; ++i) {
      t.idx[4 * lane128 + i] = d + i;
    }
    for (int i = 0; i < 4; ++i) {
      const int l = 4 * lane128 + i, o = 4 * l * qmv_width(BITS) / 8, r = 4 * l * BITS % 8;
      if (o - 4 * d + 3 >= 16 || r + 4 * BITS > 24) {
        throw "block layout does not fit"; // a compile-time error in a constexpr evaluation
      }
      for (int b = 0; b < 4; ++b) {
        t.ctrl[4 * l + b] = static_cast<int8_t>(o - 4 * d + b);
      }
      for (int j = 0; j < 4; ++j) {
        t.shift[j][l] = r + j * BITS;
        t.mask[j][l] = ((1u << BITS) - 1u) << (r + j * BITS);
      }
    }
  }
  return t;
}

template <int BITS>
constexpr BlockTables<BITS> kBlock = make_block_tables<BITS>();

// The block (64 codes: qmv_rows1_blocked_avx512; 32: its AVX2 copy, lanes 0-7 of the tables)
// in which qmv_prepare lays out p's x, or 0 where x is read in order.
inline int qmv_blocked(const QmvProblem& p) {
  if (p.M != 1 || !qmv_stream_bits(p.bits)) {
    return 0;
  }
  return p.isa == kAvx512 ? 64 : p.isa == kAvx2 ? 32 : 0;
}

// 32 codes from src against x's four vectors of 8, into two accumulators (block64 on AVX2:
// lanes 0-7 of the same tables): each 128 bits loaded from its first word (T.idx), which
// reads at most 12 bytes past the block, within the 16 qmv_rows allows past a row.
template <int BITS>
MLXINFER_QAVX2 inline void block32(const uint8_t* src, const __m256* xv, __m256& a0, __m256& a1) {
  const auto& T = kBlock<BITS>;
  constexpr int hi = 4 * (2 * BITS / 4); // the second 128 bits' first byte (T.idx[4] words)
  const __m256i v = _mm256_shuffle_epi8(
      _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + hi)), 1),
      _mm256_load_si256(reinterpret_cast<const __m256i*>(T.ctrl)));
  __m256 q[4];
  for (int j = 0; j < 4; ++j) {
    q[j] = _mm256_cvtepi32_ps(
        _mm256_and_si256(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(T.mask[j]))));
  }
  a0 = _mm256_fmadd_ps(q[0], xv[0], a0);
  a1 = _mm256_fmadd_ps(q[1], xv[1], a1);
  a0 = _mm256_fmadd_ps(q[2], xv[2], a0);
  a1 = _mm256_fmadd_ps(q[3], xv[3], a1);
}

// One row of x against R output rows at the bit-stream widths on AVX2: blocks of 32 codes
// (one group holds whole blocks), scaled once per group.
template <int BITS, int R>
MLXINFER_QAVX2 void qmv_rows1_blocked_avx2(const QmvProblem& p, const uint8_t* w,
                                          size_t row_bytes, int n) {
  const int G = p.K / p.group_size;
  const int per_group = p.group_size / 32;
  __m256 tot[R], a0[R], a1[R];
  const uint8_t* wr[R];
  const float* sr[R];
  const float* br[R];
  for (int r = 0; r < R; ++r) {
    tot[r] = a0[r] = a1[r] = _mm256_setzero_ps();
    wr[r] = w + (n + r) * row_bytes;
    sr[r] = p.scales + static_cast<size_t>(n + r) * G;
    br[r] = qmv_biases_row(p, n + r);
  }
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < per_group; ++i) {
      const int blk = g * per_group + i;
      __m256 xv[4];
      for (int j = 0; j < 4; ++j) {
        xv[j] = _mm256_loadu_ps(p.xp + 32 * blk + 8 * j);
      }
      for (int r = 0; r < R; ++r) {
        block32<BITS>(wr[r] + static_cast<size_t>(blk) * 4 * BITS, xv, a0[r], a1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      tot[r] = _mm256_fmadd_ps(_mm256_add_ps(a0[r], a1[r]), _mm256_set1_ps(sr[r][g]), tot[r]);
      a0[r] = a1[r] = _mm256_setzero_ps();
    }
  }
  for (int r = 0; r < R; ++r) {
    float bias_part = 0.0f;
    for (int g = 0; g < G; ++g) {
      bias_part += br[r][g] * p.xsum[g];
    }
    p.y[n + r] = hsum256(tot[r]) + bias_part;
  }
}

template <int BITS>
MLXINFER_QAVX2 void qmv_rows_avx2(const QmvProblem& p, int n0, int n1) {
  const int G = p.K / p.group_size;
  constexpr int U2 = BITS == kNv4 ? 1 : 2; // 16-code chunks per step within a group (nvfp4: 16)
  const size_t row_bytes = static_cast<size_t>(p.K) * qmv_width(BITS) / 8;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w);
  if constexpr (qmv_stream_bits(BITS)) {
    if (p.M == 1) { // decode at the bit-stream widths: blocks of 32 codes (qmv_blocked)
      int n = n0;
      for (; n + 2 <= n1; n += 2) {
        qmv_rows1_blocked_avx2<BITS, 2>(p, w, row_bytes, n);
      }
      if (n < n1) {
        qmv_rows1_blocked_avx2<BITS, 1>(p, w, row_bytes, n);
      }
      return;
    }
  }
  if constexpr (BITS == 8) {
    if (p.M == 1 && g_qmv_rows_path == 1) { // one row of 8-bit codes, as qmv_rows_avx512:
      // each chunk dequantized (49152 x 576 g32, one thread, this path on the AMD EPYC VM:
      // 2.5 against 3.9 ms; g64 2.0 against 3.0)
      for (int n = n0; n < n1; ++n) {
        qmv_row_dq_avx2<BITS, 1>(p, w + n * row_bytes, p.scales + static_cast<size_t>(n) * G,
                                 qmv_biases_row(p, n), 0, n);
      }
      return;
    }
  }
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
    const float* b = qmv_biases_row(p, n);
    // The row's weights stay in L1 across the passes of x rows.
    int m = 0;
    for (; m + 8 <= p.M; m += 8) {
      qmv_row_dq_avx2<BITS, 8>(p, wr, s, b, m, n);
    }
    switch (p.M - m) {
      case 7:
        qmv_row_dq_avx2<BITS, 7>(p, wr, s, b, m, n);
        break;
      case 6:
        qmv_row_dq_avx2<BITS, 6>(p, wr, s, b, m, n);
        break;
      case 5:
        qmv_row_dq_avx2<BITS, 5>(p, wr, s, b, m, n);
        break;
      case 4:
        qmv_row_avx2<BITS, 4, 1>(p, wr, s, b, m, n);
        break;
      case 3:
        qmv_row_avx2<BITS, 3, 1>(p, wr, s, b, m, n);
        break;
      case 2:
        qmv_row_avx2<BITS, 2, U2>(p, wr, s, b, m, n);
        break;
      case 1:
        qmv_row_avx2<BITS, 1, U2>(p, wr, s, b, m, n);
        break;
      default:
        break;
    }
  }
}


// One 32-weight chunk as two vectors of 16 f32 codes, matched with xp[0:16], xp[16:32]
// (4-bit: xp de-interleaved per 32; 8-bit: in order; 2/3/5/6-bit: in order, two units per
// vector from one 16-byte load, each code << its bit offset, xp scaled).
template <int BITS>
MLXINFER_AVX512BW inline void unpack32(const uint8_t* src, __m512& a, __m512& b) {
  if constexpr (qmv_stream_bits(BITS)) {
    const __m512i ctrl = _mm512_load_si512(kStream<BITS>.ctrl16);
    const __m512i mask = _mm512_load_si512(kStream<BITS>.mask16);
    const __m512i v0 =
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m512i v1 = _mm512_broadcast_i32x4(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * BITS)));
    a = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_shuffle_epi8(v0, ctrl), mask));
    b = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_shuffle_epi8(v1, ctrl), mask));
  } else if constexpr (qmv_e2m1(BITS)) { // nibbles as 4-bit; 2 * E2M1 value by a lane lookup
    const __m512 lut = _mm512_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 12.0f, -0.0f,
                                      -1.0f, -2.0f, -3.0f, -4.0f, -6.0f, -8.0f, -12.0f);
    const __m512i v =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    a = _mm512_permutexvar_ps(v, lut); // the index's low 4 bits: the low nibble
    b = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
  } else if constexpr (BITS == kFp8) { // 32 E4M3 codes in order, as float16 (value * 2^-8)
    const __m512i v =
        _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    __m512i h = _mm512_and_si512(_mm512_slli_epi16(v, 7), _mm512_set1_epi16(-16512)); // 0xBF80
    // NaN for 0x7F/0xFF as e4m3_as_f16: h | ((h + 0x80) & 0x4000), the OR-AND one ternary op
    h = _mm512_ternarylogic_epi32(h, _mm512_add_epi16(h, _mm512_set1_epi16(0x80)),
                                  _mm512_set1_epi16(0x4000), 0xF8);
    a = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  } else if constexpr (BITS == 4) {
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

// The scale of the 32-code chunk from k (group g = k / gs). nvfp4's groups of 16 split a chunk:
// lanes 0-7 of both vectors unpack32 gives are codes 0-15 (the nibble order), 8-15 codes 16-31.
// gs is a power of two: k >> its log2. A division by a group size known only at run time stayed
// an idiv per chunk in the several-row loops (perf on the Xeon VM); the shift made 8 rows of
// 4-bit g32 products 3-4 % faster there (1536 x 576: 33.8 -> 34.9 G weight-rows/s, one thread).
template <int BITS>
MLXINFER_AVX512BW inline __m512 chunk_scale(const float* s, int k, int gs) {
  if constexpr (BITS == kNv4) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[k / 16]), _mm512_set1_ps(s[k / 16 + 1]));
  } else {
    return _mm512_set1_ps(s[k >> __builtin_ctz(static_cast<unsigned>(gs))]);
  }
}

template <int BITS, int M, int U>
MLXINFER_AVX512BW void qmv_row_avx512(
    const QmvProblem& p,
    const uint8_t* wr,
    const float* s,
    const float* b,
    int m0,
    int n) {
  // nvfp4: a step per 32-code chunk, its two groups scaled by chunk_scale (and no biases).
  constexpr bool halves = BITS == kNv4;
  const int Gs = p.K / p.group_size; // the scales' and x sums' row stride
  const int gs = halves ? 32 : p.group_size;
  const int G = p.K / gs;
  constexpr int bytes32 = 32 * qmv_width(BITS) / 8;
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
    const uint8_t* wg = wr + static_cast<size_t>(k0) * qmv_width(BITS) / 8;
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
    const __m512 sv = chunk_scale<BITS>(s, k0, gs);
    for (int m = 0; m < M; ++m) {
      for (int u = 0; u < 2 * U; ++u) {
        tot[m][u] = _mm512_fmadd_ps(acc[m][u], sv, tot[m][u]);
      }
      if constexpr (!halves) {
        bias_part[m] += b[g] * p.xsum[static_cast<size_t>(m0 + m) * Gs + g];
      }
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

// Several rows of x against one output row (batched decode, verification, short prompts):
// each 32-weight chunk is widened and dequantized (s q + b, one FMA per 16) once, in
// registers, and multiplied with M rows of x, so the rows share the unpacking and the
// per-group scale and bias instead of repeating them per row; up to 8 rows a pass.
template <int BITS, int M>
MLXINFER_AVX512BW void qmv_row_dq_avx512(
    const QmvProblem& p,
    const uint8_t* wr,
    const float* s,
    const float* b,
    int m0,
    int n) {
  const int gs = p.group_size;
  constexpr int bytes32 = 32 * qmv_width(BITS) / 8;
  constexpr bool stream = qmv_stream_bits(BITS); // as qmv_row_dq_avx2
  const float* xbase = stream ? p.x : p.xp;
  __m512 tot[M][2];
  const float* xrow[M];
  for (int m = 0; m < M; ++m) {
    tot[m][0] = tot[m][1] = _mm512_setzero_ps();
    xrow[m] = xbase + static_cast<size_t>(m0 + m) * p.K;
  }
  // One loop over the row's 32-weight chunks (a loop per group would have the totals
  // stored to the stack at each group's end: a store per total per group).
  for (int k = 0; k < p.K; k += 32) {
    const int g = k >> __builtin_ctz(static_cast<unsigned>(gs));
    __m512 sv = chunk_scale<BITS>(s, k, gs);
    const __m512 bv = _mm512_set1_ps(b[g]); // nvfp4: zeros (one row of K / 16)
    if constexpr (stream) {
      sv = _mm512_mul_ps(sv, _mm512_load_ps(kStream<BITS>.inv16));
    }
    __m512 qa, qb;
    unpack32<BITS>(wr + (k / 32) * bytes32, qa, qb);
    qa = _mm512_fmadd_ps(qa, sv, bv);
    qb = _mm512_fmadd_ps(qb, sv, bv);
    for (int m = 0; m < M; ++m) {
      const float* xk = xrow[m] + k;
      tot[m][0] = _mm512_fmadd_ps(qa, _mm512_loadu_ps(xk), tot[m][0]);
      tot[m][1] = _mm512_fmadd_ps(qb, _mm512_loadu_ps(xk + 16), tot[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    p.y[static_cast<size_t>(m0 + m) * p.N + n] =
        _mm512_reduce_add_ps(_mm512_add_ps(tot[m][0], tot[m][1]));
  }
}

// The lane sums of M <= 8 vectors, as 8 floats (out[m] for m < M): three shuffle-and-add
// steps for all of them (8 -> 4 vectors, 4 -> 2, then within 128-bit lanes), instead of one
// 16-lane reduction each (the rows' totals then never leave the registers).
template <int M>
MLXINFER_AVX512BW inline void reduce_rows(const __m512 (&t)[M], float* out) {
  __m512 v[8];
  for (int i = 0; i < 8; ++i) {
    v[i] = i < M ? t[i] : _mm512_setzero_ps();
  }
  __m512 a[4]; // a[i]: v[2i]'s 8 partial sums in lanes 0-7, v[2i+1]'s in 8-15
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  // b[j]: 128-bit lane L holds row 4j + L's 4 partial sums
  const __m512 b0 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x88),
                                  _mm512_shuffle_f32x4(a[0], a[1], 0xDD));
  const __m512 b1 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x88),
                                  _mm512_shuffle_f32x4(a[2], a[3], 0xDD));
  // per 128-bit lane L: element 0 row L's total, element 1 row 4 + L's
  __m512 c = _mm512_add_ps(_mm512_unpacklo_ps(b0, b1), _mm512_unpackhi_ps(b0, b1));
  c = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4E));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, c)));
}

// Rows m0..m0+M (M <= 8) of x against output rows [n0, n1), each 32-weight chunk dequantized
// once (as qmv_row_dq_avx512) for the M rows; one call per block of output rows, so x's row
// pointers and the group shift are set once, and the M totals are reduced together.
template <int BITS, int M>
MLXINFER_AVX512BW void qmv_rows_dq_avx512(const QmvProblem& p, int n0, int n1, int m0) {
  const int gs = p.group_size;
  const int G = p.K / gs;
  const int gshift = __builtin_ctz(static_cast<unsigned>(gs));
  constexpr int bytes32 = 32 * qmv_width(BITS) / 8;
  const size_t row_bytes = static_cast<size_t>(p.K) * qmv_width(BITS) / 8;
  constexpr bool stream = qmv_stream_bits(BITS); // as qmv_row_dq_avx2
  const float* xbase = (stream ? p.x : p.xp) + static_cast<size_t>(m0) * p.K;
  const size_t K = p.K;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(p.w) + n * row_bytes;
    const float* s = p.scales + static_cast<size_t>(n) * G;
    const float* b = qmv_biases_row(p, n);
    __m512 t0[M], t1[M];
    for (int m = 0; m < M; ++m) {
      t0[m] = t1[m] = _mm512_setzero_ps();
    }
    for (int k = 0; k < p.K; k += 32) {
      __m512 sv = chunk_scale<BITS>(s, k, gs);
      const __m512 bv = _mm512_set1_ps(b[k >> gshift]); // nvfp4: zeros (one row of K / 16)
      if constexpr (stream) {
        sv = _mm512_mul_ps(sv, _mm512_load_ps(kStream<BITS>.inv16));
      }
      __m512 qa, qb;
      unpack32<BITS>(wr + (k / 32) * bytes32, qa, qb);
      qa = _mm512_fmadd_ps(qa, sv, bv);
      qb = _mm512_fmadd_ps(qb, sv, bv);
      for (int m = 0; m < M; ++m) {
        const float* xk = xbase + m * K + k;
        t0[m] = _mm512_fmadd_ps(qa, _mm512_loadu_ps(xk), t0[m]);
        t1[m] = _mm512_fmadd_ps(qb, _mm512_loadu_ps(xk + 16), t1[m]);
      }
    }
    if constexpr (M == 1) {
      p.y[static_cast<size_t>(m0) * p.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(t0[0], t1[0]));
      continue;
    }
    for (int m = 0; m < M; ++m) {
      t0[m] = _mm512_add_ps(t0[m], t1[m]);
    }
    float out[8];
    reduce_rows<M>(t0, out);
    for (int m = 0; m < M; ++m) {
      p.y[static_cast<size_t>(m0 + m) * p.N + n] = out[m];
    }
  }
}

// One row of x against R output rows at once (decode): x's two vectors per chunk are
// loaded once for the R rows, and the per-group work (scale, bias) of the R rows overlaps.
template <int BITS, int R, int U>
MLXINFER_AVX512BW void qmv_rows1_avx512(
    const QmvProblem& p,
    const uint8_t* w,
    size_t row_bytes,
    int n) {
  constexpr bool halves = BITS == kNv4; // as qmv_row_avx512
  const int Gs = p.K / p.group_size;
  const int gs = halves ? 32 : p.group_size;
  const int G = p.K / gs;
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
    sr[r] = p.scales + static_cast<size_t>(n + r) * Gs;
    br[r] = qmv_biases_row(p, n + r);
  }
  for (int g = 0; g < G; ++g) {
    __m512 acc[R][2 * U];
    for (int r = 0; r < R; ++r) {
      for (int u = 0; u < 2 * U; ++u) {
        acc[r][u] = _mm512_setzero_ps();
      }
    }
    const int k0 = g * gs;
    if (gs == 32 * U) { // one pass per group: its halves summed before the scale (one FMA)
      for (int u = 0; u < U; ++u) {
        const float* xk = p.xp + k0 + 32 * u;
        const __m512 xa = _mm512_loadu_ps(xk), xb = _mm512_loadu_ps(xk + 16);
        const size_t off = static_cast<size_t>(k0 + 32 * u) * qmv_width(BITS) / 8;
        for (int r = 0; r < R; ++r) {
          __m512 qa, qb;
          unpack32<BITS>(wr[r] + off, qa, qb);
          acc[r][u] = _mm512_fmadd_ps(qb, xb, _mm512_mul_ps(qa, xa));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 sv = chunk_scale<BITS>(sr[r], k0, gs);
        __m512 a = acc[r][0];
        for (int u = 1; u < U; ++u) {
          a = _mm512_add_ps(a, acc[r][u]);
        }
        tot[r][0] = _mm512_fmadd_ps(a, sv, tot[r][0]);
      }
      continue;
    }
    for (int c = 0; c < gs; c += 32 * U) {
      for (int u = 0; u < U; ++u) {
        const float* xk = p.xp + k0 + c + 32 * u;
        const __m512 xa = _mm512_loadu_ps(xk), xb = _mm512_loadu_ps(xk + 16);
        const size_t off = static_cast<size_t>(k0 + c + 32 * u) * qmv_width(BITS) / 8;
        for (int r = 0; r < R; ++r) {
          __m512 qa, qb;
          unpack32<BITS>(wr[r] + off, qa, qb);
          acc[r][2 * u] = _mm512_fmadd_ps(qa, xa, acc[r][2 * u]);
          acc[r][2 * u + 1] = _mm512_fmadd_ps(qb, xb, acc[r][2 * u + 1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sv = chunk_scale<BITS>(sr[r], k0, gs);
      for (int u = 0; u < 2 * U; ++u) {
        tot[r][u] = _mm512_fmadd_ps(acc[r][u], sv, tot[r][u]);
      }
    }
  }
  if constexpr (!halves) { // the biases' term after the products: sum_g b_g * xsum_g
    for (int r = 0; r < R; ++r) {
      bias_part[r] = dot_f32_avx512(br[r], p.xsum, G);
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

// 64 codes from src against x's four vectors, into two accumulators.
template <int BITS>
MLXINFER_AVX512BW inline void block64(const uint8_t* src, const __m512* xv, __m512& a0,
                                      __m512& a1) {
  const auto& T = kBlock<BITS>;
  __m512i v = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (2 * BITS)) - 1u), src);
  v = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(_mm512_load_si512(T.idx), v),
                          _mm512_load_si512(T.ctrl));
  const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_load_si512(T.mask[0])));
  const __m512 q1 = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_load_si512(T.mask[1])));
  const __m512 q2 = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_load_si512(T.mask[2])));
  const __m512 q3 = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_load_si512(T.mask[3])));
  a0 = _mm512_fmadd_ps(q0, xv[0], a0);
  a1 = _mm512_fmadd_ps(q1, xv[1], a1);
  a0 = _mm512_fmadd_ps(q2, xv[2], a0);
  a1 = _mm512_fmadd_ps(q3, xv[3], a1);
}

template <int BITS, int R>
MLXINFER_AVX512BW void qmv_rows1_blocked_avx512(const QmvProblem& p, const uint8_t* w,
                                                size_t row_bytes, int n) {
  const int G = p.K / p.group_size;
  const int gs = p.group_size;
  const int blocks = p.K / 64;
  constexpr int block_bytes = 8 * BITS;
  __m512 tot[R], a0[R], a1[R];
  const uint8_t* wr[R];
  const float* sr[R];
  const float* br[R];
  for (int r = 0; r < R; ++r) {
    tot[r] = a0[r] = a1[r] = _mm512_setzero_ps();
    wr[r] = w + (n + r) * row_bytes;
    sr[r] = p.scales + static_cast<size_t>(n + r) * G;
    br[r] = qmv_biases_row(p, n + r);
  }
  if (gs >= 64) { // whole blocks per group: scale once per group
    const int per_group = gs / 64;
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < per_group; ++i) {
        const int blk = g * per_group + i;
        __m512 xv[4];
        for (int j = 0; j < 4; ++j) {
          xv[j] = _mm512_loadu_ps(p.xp + 64 * blk + 16 * j);
        }
        for (int r = 0; r < R; ++r) {
          block64<BITS>(wr[r] + static_cast<size_t>(blk) * block_bytes, xv, a0[r], a1[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        tot[r] = _mm512_fmadd_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_set1_ps(sr[r][g]), tot[r]);
        a0[r] = a1[r] = _mm512_setzero_ps();
      }
    }
  } else { // group size 32: lanes 0-7 in group 2 * blk, lanes 8-15 in the next
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int blk = 0; blk < blocks; ++blk) {
      __m512 xv[4];
      for (int j = 0; j < 4; ++j) {
        xv[j] = _mm512_loadu_ps(p.xp + 64 * blk + 16 * j);
      }
      for (int r = 0; r < R; ++r) {
        block64<BITS>(wr[r] + static_cast<size_t>(blk) * block_bytes, xv, a0[r], a1[r]);
        const __m512 two = _mm512_castps128_ps512(_mm_castsi128_ps(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sr[r] + 2 * blk))));
        tot[r] = _mm512_fmadd_ps(_mm512_add_ps(a0[r], a1[r]),
                                 _mm512_permutexvar_ps(halves, two), tot[r]);
        a0[r] = a1[r] = _mm512_setzero_ps();
      }
    }
    if (p.K % 64 != 0) { // the last 32 codes, in order (qmv_prepare scaled them as unpack32)
      const int k0 = 64 * blocks;
      const __m512 xa = _mm512_loadu_ps(p.xp + k0), xb = _mm512_loadu_ps(p.xp + k0 + 16);
      for (int r = 0; r < R; ++r) {
        __m512 qa, qb;
        unpack32<BITS>(wr[r] + static_cast<size_t>(k0) * qmv_width(BITS) / 8, qa, qb);
        const __m512 acc = _mm512_fmadd_ps(qa, xa, _mm512_mul_ps(qb, xb));
        tot[r] = _mm512_fmadd_ps(acc, _mm512_set1_ps(sr[r][G - 1]), tot[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float bias_part = 0.0f;
    for (int g = 0; g < G; ++g) {
      bias_part += br[r][g] * p.xsum[g];
    }
    p.y[n + r] = _mm512_reduce_add_ps(tot[r]) + bias_part;
  }
}

// Output rows a pass of the one-row loops: two rows share each x load, which paid for rows of
// up to 640 codes; from 1,024 codes one row a pass was 1.15-1.5x faster (4-bit 576 x 1,536:
// 20.4 against 15.4 GB/s; 1,536 x 1,536 22.2 against 14.7; 5-bit 640 x 2,048 12.9 against 8.9:
// two threads, the AMD EPYC VM, docs/performance.md), and 8-bit codes (one row a pass in the
// per-group loop, not dequantized) run one row at every length.
inline int qmv_decode_rows(const QmvProblem& p, int bits) {
  const int forced = g_qmv_decode_rows.load(std::memory_order_relaxed);
  if (forced != 0) {
    return forced;
  }
  return bits == 8 || p.K >= 1024 ? 1 : 2;
}

template <int BITS>
MLXINFER_AVX512BW void qmv_rows_avx512(const QmvProblem& p, int n0, int n1) {
  const int G = p.K / p.group_size;
  const size_t row_bytes = static_cast<size_t>(p.K) * qmv_width(BITS) / 8;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w);
  const bool wide = p.group_size >= 64; // two 32-chunks per step fit in a group
  if constexpr (qmv_stream_bits(BITS)) {
    if (p.M == 1) { // decode at the bit-stream widths: blocks of 64 codes (qmv_blocked)
      int n = n0;
      if (qmv_decode_rows(p, BITS) == 2) {
        for (; n + 2 <= n1; n += 2) {
          qmv_rows1_blocked_avx512<BITS, 2>(p, w, row_bytes, n);
        }
      }
      for (; n < n1; ++n) {
        qmv_rows1_blocked_avx512<BITS, 1>(p, w, row_bytes, n);
      }
      return;
    }
  }
  // One row of affine 8-bit codes runs the per-group loop below one output row a pass: 1.09-1.19x
  // the loop that dequantizes each chunk (one FMA per 16 codes more), which it replaced (the
  // tied heads 49,152 x 576 1.18 against 1.29 ms, 262,144 x 640 7.05 against 7.70 ms; 256 x 640
  // 8.5 against 10.1 us; two threads, the AMD EPYC VM). With two output rows a pass the
  // per-group loop had been 1.4x slower than the dequantizing one from memory.
  if (p.M == 1) { // decode: output rows R at a time
    int n = n0;
    if (qmv_decode_rows(p, BITS) == 2) {
      for (; n + 2 <= n1; n += 2) {
        wide ? qmv_rows1_avx512<BITS, 2, 2>(p, w, row_bytes, n)
             : qmv_rows1_avx512<BITS, 2, 1>(p, w, row_bytes, n);
      }
    }
    for (; n < n1; ++n) {
      wide ? qmv_rows1_avx512<BITS, 1, 2>(p, w, row_bytes, n)
           : qmv_rows1_avx512<BITS, 1, 1>(p, w, row_bytes, n);
    }
    return;
  }
  if (g_qmv_rows_path == 1) {
    // Blocks of 16 output rows (their weights stay in L1 across the passes), each pass of x
    // rows over the block. A pass's x rows stay in L1 too: 8 rows of K <= 768 (18 KB at 576),
    // 4 of longer rows (24 KB at 1536; 8 such rows, 48 KB, went to L2: 576 x 1536 at 8 rows
    // took 1.5x the time). The passes' totals are reduced together (reduce_rows).
    constexpr int kBlockRows = 16;
    const int most = p.K <= 768 ? 8 : 4;
    for (int nb = n0; nb < n1; nb += kBlockRows) {
      const int ne = std::min(n1, nb + kBlockRows);
      int m = 0;
      // (passes of 4: 5 rows left take one pass of 5, not 4 and a one-row pass, 1.2x its time)
      for (; m + most <= p.M && !(most == 4 && p.M - m == 5); m += most) {
        most == 8 ? qmv_rows_dq_avx512<BITS, 8>(p, nb, ne, m)
                  : qmv_rows_dq_avx512<BITS, 4>(p, nb, ne, m);
      }
      switch (p.M - m) { // fewer than `most` left
        case 7:
          qmv_rows_dq_avx512<BITS, 7>(p, nb, ne, m);
          break;
        case 6:
          qmv_rows_dq_avx512<BITS, 6>(p, nb, ne, m);
          break;
        case 5:
          qmv_rows_dq_avx512<BITS, 5>(p, nb, ne, m);
          break;
        case 4:
          qmv_rows_dq_avx512<BITS, 4>(p, nb, ne, m);
          break;
        case 3:
          qmv_rows_dq_avx512<BITS, 3>(p, nb, ne, m);
          break;
        case 2:
          qmv_rows_dq_avx512<BITS, 2>(p, nb, ne, m);
          break;
        case 1:
          for (int n = nb; n < ne; ++n) {
            const uint8_t* wr = w + n * row_bytes;
            const float* s = p.scales + static_cast<size_t>(n) * G;
            const float* b = qmv_biases_row(p, n);
            wide ? qmv_row_avx512<BITS, 1, 2>(p, wr, s, b, m, n)
                 : qmv_row_avx512<BITS, 1, 1>(p, wr, s, b, m, n);
          }
          break;
        default:
          break;
      }
    }
    return;
  }
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    const float* s = p.scales + static_cast<size_t>(n) * G;
    const float* b = qmv_biases_row(p, n);
    // The row's weights stay in L1 across the passes of 8 x rows.
    int m = 0;
    for (; m + 8 <= p.M; m += 8) {
      qmv_row_dq_avx512<BITS, 8>(p, wr, s, b, m, n);
    }
    switch (p.M - m) {
      case 7:
        qmv_row_dq_avx512<BITS, 7>(p, wr, s, b, m, n);
        break;
      case 6:
        qmv_row_dq_avx512<BITS, 6>(p, wr, s, b, m, n);
        break;
      case 5:
        qmv_row_dq_avx512<BITS, 5>(p, wr, s, b, m, n);
        break;
      case 4:
        qmv_row_dq_avx512<BITS, 4>(p, wr, s, b, m, n);
        break;
      case 3:
        qmv_row_dq_avx512<BITS, 3>(p, wr, s, b, m, n);
        break;
      case 2:
        qmv_row_dq_avx512<BITS, 2>(p, wr, s, b, m, n);
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

#endif // MLXINFER_X86

} // namespace

void qmv_prepare(const QmvProblem& p, float* xp, float* xsum) {
  const int G = p.K / p.group_size;
  for (int m = 0; m < p.M; ++m) {
    const float* x = p.x + static_cast<size_t>(m) * p.K;
    float* dst = xp + static_cast<size_t>(m) * p.K;
    if (p.bits == 4 && p.isa != kScalar) {
      // Per chunk (16 codes for AVX2, 32 for AVX-512): the even k first, then the odd k
      // (low nibbles, then high nibbles).
#if defined(__aarch64__)
      const int chunk = 32; // NEON: one 16-byte load's low nibbles, then its high nibbles
#else
      const int chunk = p.isa == kAvx512 ? 32 : 16;
#endif
      // mxfp4, nvfp4: codes widened as 2 * value
      const float f = p.mode == kMxfp4 || p.mode == kNvfp4 ? 0.5f : 1.0f;
      for (int c = 0; c < p.K; c += chunk) {
        for (int i = 0; i < chunk / 2; ++i) {
          dst[c + i] = f * x[c + 2 * i];
          dst[c + chunk / 2 + i] = f * x[c + 2 * i + 1];
        }
      }
    } else if (qmv_stream_bits(p.bits) && p.isa != kScalar) {
      // The codes come out << (k * bits % 8), their bit offset in the byte: x * 2^-that.
      int k = 0;
#if defined(MLXINFER_X86)
      if (const int block = qmv_blocked(p)) { // code 4l + j of a block: vector j's lane l
        const int(*shift)[16] = nullptr;
        switch (p.bits) {
          case 2:
            shift = kBlock<2>.shift;
            break;
          case 3:
            shift = kBlock<3>.shift;
            break;
          case 5:
            shift = kBlock<5>.shift;
            break;
          default:
            shift = kBlock<6>.shift;
            break;
        }
        const int lanes = block / 4;
        for (; k + block <= p.K; k += block) {
          for (int j = 0; j < 4; ++j) {
            for (int l = 0; l < lanes; ++l) {
              dst[k + lanes * j + l] = std::ldexp(x[k + 4 * l + j], -shift[j][l]);
            }
          }
        }
      }
#endif
      for (; k < p.K; ++k) {
        dst[k] = std::ldexp(x[k], -(k * p.bits % 8));
      }
    } else if (p.mode == kMxfp8 && p.isa != kScalar) { // codes widened as value * 2^-8
      for (int k = 0; k < p.K; ++k) {
        dst[k] = 256.0f * x[k];
      }
    } else if (dst != x) { // x itself may serve as xp (the caller's choice)
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

namespace {

template <int BITS>
bool qmv_rows_x86(const QmvProblem& p, int n0, int n1) {
#if defined(MLXINFER_X86)
  if (p.isa == kAvx512) {
    qmv_rows_avx512<BITS>(p, n0, n1);
    return true;
  }
  if (p.isa == kAvx2) {
    qmv_rows_avx2<BITS>(p, n0, n1);
    return true;
  }
#endif
  (void)p, (void)n0, (void)n1;
  return false;
}

// The vector path for p's level and width, or the scalar one.
void qmv_rows_path(const QmvProblem& p, int n0, int n1) {
#if defined(__aarch64__)
  if (p.isa == kNeon && qmv_rows_neon(p, n0, n1)) {
    return;
  }
#endif
  bool done = false;
  switch (qmv_code(p.mode, p.bits)) {
    case kFp4:
      done = qmv_rows_x86<kFp4>(p, n0, n1);
      break;
    case kNv4:
      done = qmv_rows_x86<kNv4>(p, n0, n1);
      break;
    case kFp8: // widened by F16C (MLXINFER_QAVX2)
      done = has_f16c() && qmv_rows_x86<kFp8>(p, n0, n1);
      break;
    case 2:
      done = qmv_rows_x86<2>(p, n0, n1);
      break;
    case 3:
      done = qmv_rows_x86<3>(p, n0, n1);
      break;
    case 4:
      done = qmv_rows_x86<4>(p, n0, n1);
      break;
    case 5:
      done = qmv_rows_x86<5>(p, n0, n1);
      break;
    case 6:
      done = qmv_rows_x86<6>(p, n0, n1);
      break;
    case 8:
      done = qmv_rows_x86<8>(p, n0, n1);
      break;
    default:
      break;
  }
  if (!done) {
    qmv_rows_scalar(p, n0, n1);
  }
}

} // namespace

void qmv_rows(const QmvProblem& p, int n0, int n1) {
  if (p.isa == kScalar || !qmv_stream_bits(p.bits) || n0 >= n1) {
    return qmv_rows_path(p, n0, n1);
  }
  // The bit-stream widths' vector loads may read kQmvOverread bytes past a row's end: the
  // rows from `safe` on (those within that many bytes of the buffer's end) run from a copy
  // with room after it. The copy is at most a few rows (16 bytes' worth, or one).
  const size_t row_bytes = static_cast<size_t>(p.K) / 8 * p.bits;
  const int tail = static_cast<int>(std::min<size_t>(
      p.N, (kQmvOverread + row_bytes - 1) / row_bytes));
  const int safe = p.N - tail;
  if (n0 < std::min(n1, safe)) {
    qmv_rows_path(p, n0, std::min(n1, safe));
  }
  const int a = std::max(n0, safe);
  if (a < n1) {
    const int G = p.K / p.group_size;
    const size_t bytes = static_cast<size_t>(n1 - a) * row_bytes;
    std::vector<uint32_t> copy((bytes + kQmvOverread) / 4 + 1, 0u);
    std::memcpy(copy.data(), reinterpret_cast<const uint8_t*>(p.w) + a * row_bytes, bytes);
    QmvProblem q = p; // rows [a, n1) as rows [0, n1 - a) of the copy; y keeps its stride N
    q.w = copy.data();
    q.scales = p.scales + static_cast<size_t>(a) * G;
    q.biases = qmv_biases_row(p, a);
    q.y = p.y + a;
    qmv_rows_path(q, 0, n1 - a);
  }
}

} // namespace mlxinfer
