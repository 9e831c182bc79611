// Matrix x vector kernels on plain pointers (no MLX types): the primitives in
// primitives.cpp prepare the inputs and call these over ranges of output rows.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlxinfer {

// Instruction-set levels of the kernels, checked once at run time: scalar < avx2 < avx512
// on x86-64, scalar < neon on arm64 (NEON is in the AArch64 base ISA).
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kNeon = 3 };
// The best level this CPU has, and the level in use (the best unless capped).
Isa best_isa();
Isa current_isa();
// Tests and benchmarks cap the level to check each path against the others; `avx_vnni` false
// also keeps the AVX2 paths off AVX-VNNI (the "avx2" cap: a client core before Alder Lake).
// `vbmi` false keeps the paths that need AVX-512 VBMI off (the "avx512vnni" cap: Cascade Lake);
// `vnni512` false keeps the 512-bit tiles off AVX-512 VNNI too (the "avx512bw" cap: Skylake-SP).
void set_max_isa(Isa isa, bool avx_vnni = true, bool vbmi = true, bool vnni512 = true);
bool vbmi_allowed();
// Whether the CPU has AVX-512 F and BW (the tiles' 512-bit path; tiles.cpp).
bool avx512_bw_cpu();
// Whether it has VNNI too and the cap allows it (that path's vpdpwssd).
bool avx512_vnni_cpu();
// Whether the AVX2 paths run AVX-VNNI's 256-bit vpdpwssd (Intel's client cores since Alder Lake):
// the CPU has it, the level is AVX2 and the cap allows it.
bool avx_vnni_available();
const char* isa_name(Isa isa);
// Whether the CPU has F16C (the float kernels' vector paths are compiled with it).
bool has_f16c();

// y[m, n] = sum_k x[m, k] * (scales[n, g(k)] * q[n, k] + biases[n, g(k)])
// for m in [0, M), n in [n0, n1): MLX's affine quantization (mx.quantize), bits 2, 3, 4, 5, 6
// or 8, groups of group_size (32, 64, 128) along k. w is MLX's packing: each row's codes as one
// little-endian bit stream (code k at bit k * bits), read as little-endian uint32 words; 3-, 5-
// and 6-bit codes straddle words, and every 8 codes fill `bits` whole bytes.
// The formats: MLX's affine (codes q, scale and bias per group) and its float modes, none with
// a bias, their uint8 scales passed decoded to f32 by the caller (mx.quantize's table):
// - mxfp4: 4-bit E2M1 codes packed as 4-bit ones, value lut[q] in {0, ±0.5, ±1, ±1.5, ±2, ±3,
//   ±4, ±6}; an E8M0 scale (2^(e - 127)) per 32;
// - nvfp4: the same E2M1 codes with an E4M3 scale per 16 (quantized_matmul has no global scale);
// - mxfp8: 8-bit E4M3 codes (bias 7, subnormals, 0x7F/0xFF NaN, max 448), one per byte in
//   order as 8-bit ones; an E8M0 scale per 32.
enum QmvMode : int { kAffine = 0, kMxfp4 = 1, kNvfp4 = 2, kMxfp8 = 3 };
// The vector paths' template codes for the float modes (qmv_width gives the layout's bits).
constexpr int kFp4 = 0x14; // mxfp4
constexpr int kNv4 = 0x24; // nvfp4: two groups of 16 in each 32-code chunk (AVX-512, NEON)
constexpr int kFp8 = 0x18; // mxfp8
constexpr int qmv_width(int code) {
  return code & 15;
}
constexpr bool qmv_e2m1(int code) {
  return code == kFp4 || code == kNv4;
}
// A mode's template code (affine: its bits).
constexpr int qmv_code(int mode, int bits) {
  return mode == kMxfp4 ? kFp4 : mode == kNvfp4 ? kNv4 : mode == kMxfp8 ? kFp8 : bits;
}
// E4M3 (mxfp8's codes, nvfp4's scales) as f32: sign, 4 exponent bits (bias 7), 3 mantissa bits;
// exponent 0 is subnormal (f * 2^-9), 0x7F and 0xFF are NaN (as MLX decodes them).
float e4m3_to_f32(uint8_t b);
struct QmvProblem {
  Isa isa = kScalar; // the path; qmv_prepare lays out xp for it
  int M = 0, N = 0, K = 0, group_size = 0, bits = 0;
  int mode = kAffine;
  // biases: (N, K / group_size), or (shared_biases) one row of zeros every row reads (the
  // float modes).
  bool shared_biases = false;
  const float* x = nullptr; // (M, K) row-major
  const float* xp = nullptr; // (M, K) x as the vector paths read it (qmv_uses_xp)
  const float* xsum = nullptr; // (M, K / group_size) sums of x over each group
  const uint32_t* w = nullptr; // (N, K * bits / 32)
  const float* scales = nullptr; // (N, K / group_size), converted to f32
  const float* biases = nullptr; // (N, K / group_size), converted to f32
  float* y = nullptr; // (M, N) row-major
};

// Whether the path reads x through xp rather than x itself: off the scalar path, 4-bit codes
// are widened low nibbles first (xp: x de-interleaved per 16 or 32 to match; mxfp4 and nvfp4
// also halved: the vector paths widen 2 * lut[q], an integer), mxfp8's E4M3 codes are widened
// through float16 as value * 2^-8 (xp = x * 2^8, exact), and 2/3/5/6-bit
// codes are widened with each one's bit offset within its byte, 0..7, left in (code << s, never
// shifted back: xp = x * 2^-s, exact). Elsewhere xp may be x itself.
inline bool qmv_uses_xp(int bits, Isa isa, int mode = kAffine) {
  return isa != kScalar && (bits != 8 || mode == kMxfp8);
}
// The widths whose codes are read as a bit stream by the vector paths: each 8 codes fill
// `bits` bytes; code i of such a unit starts at byte i * bits / 8, bit i * bits % 8, and spans
// at most two bytes. Those paths load 16 bytes at a unit's start, so they may read up to 16
// bytes past a row's last code (qmv_rows runs the rows near the buffer's end from a copy).
constexpr bool qmv_stream_bits(int bits) {
  return bits == 2 || bits == 3 || bits == 5 || bits == 6;
}
constexpr int kQmvOverread = 16;
// Row n's biases.
inline const float* qmv_biases_row(const QmvProblem& p, int n) {
  return p.biases + (p.shared_biases ? 0 : static_cast<size_t>(n) * (p.K / p.group_size));
}
// The level a problem runs at from `isa`: nvfp4 rows whose K is not a multiple of 32 (the
// AVX-512 and NEON paths step over two groups of 16 at a time) take AVX2's 16-code steps on
// AVX-512 and the scalar path on NEON. Set p.isa from it before qmv_prepare.
inline Isa qmv_isa(Isa isa, int mode, int K) {
  if (mode == kNvfp4 && K % 32 != 0) {
    return isa == kAvx512 ? kAvx2 : isa == kNeon ? kScalar : isa;
  }
  return isa;
}
// Fills xp and xsum from x.
void qmv_prepare(const QmvProblem& p, float* xp, float* xsum);
void qmv_rows(const QmvProblem& p, int n0, int n1);
// Which x86 loops run, for benchmarks and tests: 1 (the default) AVX-512's passes of up to 8 x
// rows over blocks of 16 output rows, and one row of affine 8-bit codes dequantized per chunk
// (AVX2); 0 the earlier loops (each output row's passes in turn, one call per output row and
// pass; on AVX2 one row of 8-bit codes scaled per group, two output rows a pass).
void set_qmv_rows_path(int path);
// Output rows per pass of the AVX-512 one-row loops: 1 or 2 forced, 0 by the row length (the
// default; benchmarks force it).
void set_qmv_decode_rows(int rows);

// y[m, n] = sum_k x[m, k] * w[n, k], w (N, K) row-major float32, bfloat16 or float16,
// accumulated in f32.
enum WeightType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
struct MatvecProblem {
  Isa isa = kScalar; // the path (matvec_path); matvec_prepare lays out x for it
  WeightType wtype = kF32;
  int M = 0, N = 0, K = 0;
  const float* x = nullptr; // (M, K), as matvec_prepare left it
  const void* w = nullptr; // (N, K) of wtype
  float* y = nullptr; // (M, N)
};
// The path that runs at this level: the vector paths need F16C (every AVX2 CPU has it).
Isa matvec_path(Isa isa);
// Reorders x (M, K) in place for the path: bfloat16 weights are widened even k / odd k
// per vector chunk, so x is de-interleaved to match (as for the 4-bit codes).
void matvec_prepare(const MatvecProblem& p, float* x);
void matvec_rows(const MatvecProblem& p, int n0, int n1);

#if defined(__aarch64__)
// The NEON paths (neon.cpp), called by qmv_rows / matvec_rows at kNeon. qmv_rows_neon
// returns false for a problem it has no path for (an affine group size off 32).
bool qmv_rows_neon(const QmvProblem& p, int n0, int n1);
void matvec_rows_neon(const MatvecProblem& p, int n0, int n1);
#endif

} // namespace mlxinfer
