// The kernels' NEON paths (AArch64). NEON (Advanced SIMD) is part of the AArch64 base ISA, so
// there is no run-time check and no target attribute: isa.cpp picks kNeon on every arm64 CPU.
// They mirror the AVX2 paths of quantized.cpp and matvec.cpp with 128-bit vectors (4 f32):
//
// - quantized: 32 codes per step, one 16-byte load for 4-bit (the low nibbles are the even k,
//   the high nibbles the odd k; qmv_prepare de-interleaves x per 32 to match, as for AVX-512),
//   two for 8-bit (k in order); the codes are widened u8 -> u16 -> u32 -> f32 in registers and
//   the bias term costs one multiply-add per group (quantized.cpp's header); 2/3/5/6-bit: a
//   16-byte load and two table lookups per 8 codes (StreamTables below, as on x86); mxfp4 and
//   nvfp4's E2M1 codes by a byte table of the doubled values, mxfp8's E4M3 ones through float16;
// - float: 16 weights per step, f32 loaded, bf16 widened in order by a shift (vshll: x is not
//   reordered), f16 by the base ISA's own conversion (fcvtl); the last K % 16 weights in scalar.
//
// The blockings (2 output rows per pass for one x row of the quantized product, 4 for the float
// one, 4 x rows per pass otherwise) are the AVX2 paths' and were not measured on an arm64 CPU:
// this file was cross-compiled and checked under qemu (csrc/README.md, "NEON").
#if defined(__aarch64__)

#include <arm_neon.h>

#include <cstring>

#include "kernels.h"

namespace mlxinfer {

namespace {

// ----------------------------------------------------------------------------
// Quantized (affine 2/3/4/5/6/8-bit, MLX packing)
// ----------------------------------------------------------------------------

// 16 byte codes as four vectors of 4 f32, in order.
inline void widen_u8(uint8x16_t v, float32x4_t* q) {
  const uint16x8_t lo = vmovl_u8(vget_low_u8(v));
  const uint16x8_t hi = vmovl_high_u8(v);
  q[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
  q[1] = vcvtq_f32_u32(vmovl_high_u16(lo));
  q[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
  q[3] = vcvtq_f32_u32(vmovl_high_u16(hi));
}

// The bit-stream widths (2/3/5/6): per 8-code unit (BITS bytes), lane i takes the two bytes
// from i * qmv_width(BITS) / 8 (a table lookup of a 16-byte load), masked to its code in place: code << s,
// s = i * BITS % 8, matched by xp = x * 2^-s (qmv_prepare), as the x86 paths do.
template <int BITS>
struct StreamTables {
  uint8_t ctrl[2][16]; // lanes 0-3, lanes 4-7 of a unit (0xFF: out of the table, zero)
  uint32_t mask[2][4];
};

template <int BITS>
constexpr StreamTables<BITS> make_stream_tables() {
  StreamTables<BITS> t{};
  for (int i = 0; i < 8; ++i) {
    const int o = i * qmv_width(BITS) / 8, sh = i * BITS % 8;
    uint8_t* c = t.ctrl[i / 4] + 4 * (i % 4);
    c[0] = static_cast<uint8_t>(o);
    c[1] = static_cast<uint8_t>(o + 1);
    c[2] = c[3] = 0xFF;
    t.mask[i / 4][i % 4] = ((1u << BITS) - 1u) << sh;
  }
  return t;
}

template <int BITS>
constexpr StreamTables<BITS> kStream = make_stream_tables<BITS>();

// 16 signed byte codes as four vectors of 4 f32, in order.
inline void widen_s8(int8x16_t v, float32x4_t* q) {
  const int16x8_t lo = vmovl_s8(vget_low_s8(v));
  const int16x8_t hi = vmovl_high_s8(v);
  q[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
  q[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
  q[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
  q[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}

// mxfp4's E2M1 codes, doubled (integers): the vector paths widen 2 * value, x is halved.
constexpr int8_t kE2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 8 E4M3 codes (mxfp8), sign-extended to 16 bits, as two vectors of 4 f32 of value * 2^-8:
// the float16 whose sign is bit 15 and exponent and mantissa bits 7-13 (float16's exponent
// field is E4M3's with bias 15 for 7, subnormals included), 0x7F/0xFF made a NaN (their bits
// 7-13 alone carry into bit 14 when 0x80 is added: quantized.cpp's e4m3_as_f16); x is scaled
// by 2^8 to match (qmv_prepare), as on x86.
inline void widen_e4m3(int16x8_t v, float32x4_t* q) {
  uint16x8_t h = vandq_u16(vreinterpretq_u16_s16(vshlq_n_s16(v, 7)), vdupq_n_u16(0xBF80));
  h = vorrq_u16(h, vandq_u16(vaddq_u16(h, vdupq_n_u16(0x80)), vdupq_n_u16(0x4000)));
  q[0] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h)));
  q[1] = vcvt_high_f32_f16(vreinterpretq_f16_u16(h));
}

// One 32-weight chunk as eight vectors of 4 f32 codes, q[j] matched with xp[4j : 4j + 4].
template <int BITS>
inline void unpack32(const uint8_t* src, float32x4_t* q) {
  if constexpr (BITS == kFp8) { // k in order, as 8-bit
    for (int h = 0; h < 2; ++h) {
      const int8x16_t v = vld1q_s8(reinterpret_cast<const int8_t*>(src) + 16 * h);
      widen_e4m3(vmovl_s8(vget_low_s8(v)), q + 4 * h);
      widen_e4m3(vmovl_high_s8(v), q + 4 * h + 2);
    }
  } else if constexpr (qmv_e2m1(BITS)) { // the 4-bit nibble order, each code looked up
    const int8x16_t lut = vld1q_s8(kE2m1x2);
    const uint8x16_t v = vld1q_u8(src);
    widen_s8(vqtbl1q_s8(lut, vandq_u8(v, vdupq_n_u8(0xF))), q);
    widen_s8(vqtbl1q_s8(lut, vshrq_n_u8(v, 4)), q + 4);
  } else if constexpr (qmv_stream_bits(BITS)) { // four units, k in order; 16 bytes read per unit
    const uint8x16_t c0 = vld1q_u8(kStream<BITS>.ctrl[0]), c1 = vld1q_u8(kStream<BITS>.ctrl[1]);
    const uint32x4_t m0 = vld1q_u32(kStream<BITS>.mask[0]), m1 = vld1q_u32(kStream<BITS>.mask[1]);
    for (int u = 0; u < 4; ++u) {
      const uint8x16_t v = vld1q_u8(src + u * BITS);
      q[2 * u] = vcvtq_f32_u32(vandq_u32(vreinterpretq_u32_u8(vqtbl1q_u8(v, c0)), m0));
      q[2 * u + 1] = vcvtq_f32_u32(vandq_u32(vreinterpretq_u32_u8(vqtbl1q_u8(v, c1)), m1));
    }
  } else if constexpr (BITS == 4) {
    const uint8x16_t v = vld1q_u8(src);
    widen_u8(vandq_u8(v, vdupq_n_u8(0xF)), q); // codes 0, 2, .., 30
    widen_u8(vshrq_n_u8(v, 4), q + 4); // codes 1, 3, .., 31
  } else {
    widen_u8(vld1q_u8(src), q);
    widen_u8(vld1q_u8(src + 16), q + 4);
  }
}

inline float32x4_t sum4(const float32x4_t* a) {
  return vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3]));
}

// M rows of x (from m0) against output row n, whose weights, scales and biases are wr, s, b.
template <int BITS, int M>
void qmv_row_neon(
    const QmvProblem& p,
    const uint8_t* wr,
    const float* s,
    const float* b,
    int m0,
    int n) {
  // nvfp4: a step per 32-code chunk whose two groups of 16 are acc[0] + acc[1] (codes 0-15:
  // q[0], q[1] and q[4], q[5] of the nibble order) and acc[2] + acc[3]; no biases.
  constexpr bool halves = BITS == kNv4;
  const int Gs = p.K / p.group_size; // the x sums' row stride
  const int gs = halves ? 32 : p.group_size;
  const int G = p.K / gs;
  constexpr int bytes32 = 32 * qmv_width(BITS) / 8;
  float32x4_t tot[M];
  float bias_part[M];
  const float* xrow[M];
  for (int m = 0; m < M; ++m) {
    tot[m] = vdupq_n_f32(0.0f);
    bias_part[m] = 0.0f;
    xrow[m] = p.xp + static_cast<size_t>(m0 + m) * p.K;
  }
  for (int g = 0; g < G; ++g) {
    float32x4_t acc[M][4];
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < 4; ++j) {
        acc[m][j] = vdupq_n_f32(0.0f);
      }
    }
    const int k0 = g * gs;
    const uint8_t* wg = wr + static_cast<size_t>(k0) * qmv_width(BITS) / 8;
    for (int c = 0; c < gs; c += 32) {
      float32x4_t q[8];
      unpack32<BITS>(wg + (c / 32) * bytes32, q);
      for (int m = 0; m < M; ++m) {
        const float* xk = xrow[m] + k0 + c;
        for (int j = 0; j < 8; ++j) {
          acc[m][j & 3] = vfmaq_f32(acc[m][j & 3], q[j], vld1q_f32(xk + 4 * j));
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      if constexpr (halves) {
        tot[m] = vfmaq_n_f32(tot[m], vaddq_f32(acc[m][0], acc[m][1]), s[2 * g]);
        tot[m] = vfmaq_n_f32(tot[m], vaddq_f32(acc[m][2], acc[m][3]), s[2 * g + 1]);
      } else {
        tot[m] = vfmaq_n_f32(tot[m], sum4(acc[m]), s[g]);
        bias_part[m] += b[g] * p.xsum[static_cast<size_t>(m0 + m) * Gs + g];
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    p.y[static_cast<size_t>(m0 + m) * p.N + n] = vaddvq_f32(tot[m]) + bias_part[m];
  }
}

// One row of x (decode) against R output rows from n: x's vectors of a chunk are loaded once
// for the R rows.
template <int BITS, int R>
void qmv_rows1_neon(const QmvProblem& p, const uint8_t* w, size_t row_bytes, int n) {
  constexpr bool halves = BITS == kNv4; // as qmv_row_neon
  const int Gs = p.K / p.group_size; // the scales' row stride
  const int gs = halves ? 32 : p.group_size;
  const int G = p.K / gs;
  float32x4_t tot[R];
  float bias_part[R];
  const uint8_t* wr[R];
  const float* sr[R];
  const float* br[R];
  for (int r = 0; r < R; ++r) {
    tot[r] = vdupq_n_f32(0.0f);
    bias_part[r] = 0.0f;
    wr[r] = w + static_cast<size_t>(n + r) * row_bytes;
    sr[r] = p.scales + static_cast<size_t>(n + r) * Gs;
    br[r] = qmv_biases_row(p, n + r);
  }
  for (int g = 0; g < G; ++g) {
    float32x4_t acc[R][4];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) {
        acc[r][j] = vdupq_n_f32(0.0f);
      }
    }
    const int k0 = g * gs;
    for (int c = 0; c < gs; c += 32) {
      float32x4_t xv[8];
      for (int j = 0; j < 8; ++j) {
        xv[j] = vld1q_f32(p.xp + k0 + c + 4 * j);
      }
      const size_t off = static_cast<size_t>(k0 + c) * qmv_width(BITS) / 8;
      for (int r = 0; r < R; ++r) {
        float32x4_t q[8];
        unpack32<BITS>(wr[r] + off, q);
        for (int j = 0; j < 8; ++j) {
          acc[r][j & 3] = vfmaq_f32(acc[r][j & 3], q[j], xv[j]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (halves) {
        tot[r] = vfmaq_n_f32(tot[r], vaddq_f32(acc[r][0], acc[r][1]), sr[r][2 * g]);
        tot[r] = vfmaq_n_f32(tot[r], vaddq_f32(acc[r][2], acc[r][3]), sr[r][2 * g + 1]);
      } else {
        tot[r] = vfmaq_n_f32(tot[r], sum4(acc[r]), sr[r][g]);
        bias_part[r] += br[r][g] * p.xsum[g];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    p.y[n + r] = vaddvq_f32(tot[r]) + bias_part[r];
  }
}

template <int BITS>
void qmv_rows_bits(const QmvProblem& p, int n0, int n1) {
  const int G = p.K / p.group_size;
  const size_t row_bytes = static_cast<size_t>(p.K) * qmv_width(BITS) / 8;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w);
  if (p.M == 1) { // decode: two output rows per pass
    int n = n0;
    for (; n + 2 <= n1; n += 2) {
      qmv_rows1_neon<BITS, 2>(p, w, row_bytes, n);
    }
    if (n < n1) {
      qmv_rows1_neon<BITS, 1>(p, w, row_bytes, n);
    }
    return;
  }
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + static_cast<size_t>(n) * row_bytes;
    const float* s = p.scales + static_cast<size_t>(n) * G;
    const float* b = qmv_biases_row(p, n);
    // The row's weights stay in L1 across the blocks of x rows.
    int m = 0;
    for (; m + 4 <= p.M; m += 4) {
      qmv_row_neon<BITS, 4>(p, wr, s, b, m, n);
    }
    switch (p.M - m) {
      case 3:
        qmv_row_neon<BITS, 3>(p, wr, s, b, m, n);
        break;
      case 2:
        qmv_row_neon<BITS, 2>(p, wr, s, b, m, n);
        break;
      case 1:
        qmv_row_neon<BITS, 1>(p, wr, s, b, m, n);
        break;
      default:
        break;
    }
  }
}

// ----------------------------------------------------------------------------
// Float weights (f32, bf16, f16) x f32 rows
// ----------------------------------------------------------------------------

template <WeightType WT>
inline float weight_at(const void* w, size_t i) {
  if constexpr (WT == kF32) {
    return static_cast<const float*>(w)[i];
  } else if constexpr (WT == kBF16) {
    const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(w)[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  } else {
    return static_cast<float>(static_cast<const __fp16*>(w)[i]);
  }
}

// Weights k .. k + 16 of w as four vectors of 4 f32, in order.
template <WeightType WT>
inline void widen16(const void* w, size_t k, float32x4_t* q) {
  if constexpr (WT == kF32) {
    const float* f = static_cast<const float*>(w) + k;
    for (int j = 0; j < 4; ++j) {
      q[j] = vld1q_f32(f + 4 * j);
    }
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(w) + k;
    for (int j = 0; j < 2; ++j) {
      const uint16x8_t v = vld1q_u16(h + 8 * j);
      if constexpr (WT == kBF16) {
        q[2 * j] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16));
        q[2 * j + 1] = vreinterpretq_f32_u32(vshll_high_n_u16(v, 16));
      } else {
        const float16x8_t hv = vreinterpretq_f16_u16(v);
        q[2 * j] = vcvt_f32_f16(vget_low_f16(hv));
        q[2 * j + 1] = vcvt_high_f32_f16(hv);
      }
    }
  }
}

// M rows of x (from m0) against output row n.
template <WeightType WT, int M>
void matvec_row_neon(const MatvecProblem& p, int m0, int n) {
  const size_t row = static_cast<size_t>(n) * p.K;
  float32x4_t acc[M][4];
  const float* xrow[M];
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < 4; ++j) {
      acc[m][j] = vdupq_n_f32(0.0f);
    }
    xrow[m] = p.x + static_cast<size_t>(m0 + m) * p.K;
  }
  int k = 0;
  for (; k + 16 <= p.K; k += 16) {
    float32x4_t q[4];
    widen16<WT>(p.w, row + k, q);
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < 4; ++j) {
        acc[m][j] = vfmaq_f32(acc[m][j], q[j], vld1q_f32(xrow[m] + k + 4 * j));
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    float r = vaddvq_f32(sum4(acc[m]));
    for (int kk = k; kk < p.K; ++kk) {
      r += xrow[m][kk] * weight_at<WT>(p.w, row + kk);
    }
    p.y[static_cast<size_t>(m0 + m) * p.N + n] = r;
  }
}

// One x row (decode) against R output rows from n: x's four vectors of a step are loaded once
// for the R rows.
template <WeightType WT, int R>
void matvec_one_neon(const MatvecProblem& p, int n) {
  float32x4_t acc[R][4];
  size_t row[R];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      acc[r][j] = vdupq_n_f32(0.0f);
    }
    row[r] = static_cast<size_t>(n + r) * p.K;
  }
  const float* x = p.x;
  int k = 0;
  for (; k + 16 <= p.K; k += 16) {
    float32x4_t xv[4];
    for (int j = 0; j < 4; ++j) {
      xv[j] = vld1q_f32(x + k + 4 * j);
    }
    for (int r = 0; r < R; ++r) {
      float32x4_t q[4];
      widen16<WT>(p.w, row[r] + k, q);
      for (int j = 0; j < 4; ++j) {
        acc[r][j] = vfmaq_f32(acc[r][j], q[j], xv[j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = vaddvq_f32(sum4(acc[r]));
    for (int kk = k; kk < p.K; ++kk) {
      s += x[kk] * weight_at<WT>(p.w, row[r] + kk);
    }
    p.y[n + r] = s;
  }
}

template <WeightType WT>
void matvec_rows_type(const MatvecProblem& p, int n0, int n1) {
  if (p.M == 1) {
    int n = n0;
    for (; n + 4 <= n1; n += 4) {
      matvec_one_neon<WT, 4>(p, n);
    }
    for (; n < n1; ++n) {
      matvec_one_neon<WT, 1>(p, n);
    }
    return;
  }
  for (int n = n0; n < n1; ++n) {
    int m = 0;
    for (; m + 4 <= p.M; m += 4) {
      matvec_row_neon<WT, 4>(p, m, n);
    }
    switch (p.M - m) {
      case 3:
        matvec_row_neon<WT, 3>(p, m, n);
        break;
      case 2:
        matvec_row_neon<WT, 2>(p, m, n);
        break;
      case 1:
        matvec_row_neon<WT, 1>(p, m, n);
        break;
      default:
        break;
    }
  }
}

} // namespace

bool qmv_rows_neon(const QmvProblem& p, int n0, int n1) {
  if (p.mode != kNvfp4 && p.group_size % 32 != 0) { // nvfp4: two groups of 16 a chunk
    return false;
  }
  switch (qmv_code(p.mode, p.bits)) {
    case kFp4:
      qmv_rows_bits<kFp4>(p, n0, n1);
      return true;
    case kNv4:
      qmv_rows_bits<kNv4>(p, n0, n1);
      return true;
    case kFp8:
      qmv_rows_bits<kFp8>(p, n0, n1);
      return true;
    case 2:
      qmv_rows_bits<2>(p, n0, n1);
      return true;
    case 3:
      qmv_rows_bits<3>(p, n0, n1);
      return true;
    case 4:
      qmv_rows_bits<4>(p, n0, n1);
      return true;
    case 5:
      qmv_rows_bits<5>(p, n0, n1);
      return true;
    case 6:
      qmv_rows_bits<6>(p, n0, n1);
      return true;
    case 8:
      qmv_rows_bits<8>(p, n0, n1);
      return true;
    default:
      return false;
  }
}

void matvec_rows_neon(const MatvecProblem& p, int n0, int n1) {
  switch (p.wtype) {
    case kBF16:
      return matvec_rows_type<kBF16>(p, n0, n1);
    case kF16:
      return matvec_rows_type<kF16>(p, n0, n1);
    default:
      return matvec_rows_type<kF32>(p, n0, n1);
  }
}

} // namespace mlxinfer

#endif // __aarch64__
