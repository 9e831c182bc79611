// A standalone check of the kernels on plain pointers (kernels.h), without MLX: every
// instruction-set path this CPU has (scalar, AVX2, AVX-512 on x86-64; scalar, NEON on arm64)
// against this file's own double-precision reference, on odd shapes:
//   quantized: bits 2, 3, 4, 5, 6 and 8 (MLX's bit stream: 3/5/6-bit codes straddle words),
//              group sizes 32/64/128, 1..16 rows of x, N odd, rows as short as one group;
//              mxfp4 (E2M1 codes, power-of-two scales per 32, no bias), nvfp4 (E2M1 codes,
//              E4M3 scales per 16, K off a multiple of 32 too) and mxfp8 (E4M3 codes,
//              power-of-two scales per 32) likewise; every E4M3 code widened bit for bit;
//   float:     f32, bf16 and f16 weights, K not a multiple of the vector width, 1..16 rows;
//   widening:  every finite bf16 and f16 value through the float kernel, bit for bit.
// A case passes when max |y - ref| <= 1e-4 * max |ref| on each path, and no path writes
// outside the rows it was given. One line per case; exit status 1 on any failure.
//
// Build (tools/check_kernels_cross.py does this natively and for aarch64 under qemu):
//   g++ -std=c++20 -O2 -Icsrc/src csrc/tests/check_kernels.cpp csrc/src/{isa,quantized,
//       matvec,neon}.cpp -o check_kernels
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels.h"

using namespace mlxinfer;

namespace {

constexpr double kTol = 1e-4;
const float kSentinel = -12345.0f;

std::mt19937 rng(20261203);

float normal() {
  static std::normal_distribution<float> d(0.0f, 1.0f);
  return d(rng);
}

// The levels this build and CPU have, lowest first.
std::vector<Isa> levels() {
  std::vector<Isa> out{kScalar};
#if defined(__aarch64__)
  out.push_back(kNeon);
#else
  for (Isa isa : {kAvx2, kAvx512}) {
    if (isa <= best_isa()) {
      out.push_back(isa);
    }
  }
#endif
  return out;
}

// The level in use after capping at `isa`, which must be `isa` itself.
bool cap_at(Isa isa) {
  set_max_isa(isa);
  if (current_isa() != isa) {
    std::printf("FAIL set_max_isa(%s): current_isa() is %s\n", isa_name(isa),
                isa_name(current_isa()));
    return false;
  }
  return true;
}

struct Outcome {
  double worst = 0.0; // max over the cases of max|y - ref| / max|ref|
  int cases = 0, failures = 0;
};

// Relative error of y against ref (M x N), or +inf where y is not finite.
double rel_error(const std::vector<float>& y, const std::vector<double>& ref) {
  double dmax = 0.0, rmax = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(y[i])) {
      return INFINITY;
    }
    dmax = std::max(dmax, std::fabs(y[i] - ref[i]));
    rmax = std::max(rmax, std::fabs(ref[i]));
  }
  return rmax > 0.0 ? dmax / rmax : dmax;
}

// Runs rows [0, split) and checks that rows [split, N) are untouched, then runs the rest.
template <class Run>
bool run_split(Run run, std::vector<float>& y, int M, int N) {
  std::fill(y.begin(), y.end(), kSentinel);
  const int split = N / 2 | 1; // odd, so the second range starts on an odd row
  const int first = std::min(split, N);
  run(0, first);
  for (int m = 0; m < M; ++m) {
    for (int n = first; n < N; ++n) {
      if (y[static_cast<size_t>(m) * N + n] != kSentinel) {
        return false;
      }
    }
  }
  run(first, N);
  return true;
}

// Records one path's result in `line` and `out`; true if it passes.
bool judge(Isa isa, double err, bool in_range, std::string& line, Outcome& out) {
  char buf[96];
  const bool ok = in_range && err <= kTol;
  std::snprintf(buf, sizeof buf, " %s %.2e%s", isa_name(isa), err,
                in_range ? (ok ? "" : " FAIL") : " FAIL(wrote outside its rows)");
  line += buf;
  out.worst = std::max(out.worst, err);
  return ok;
}

// ---------------------------------------------------------------------------
// Quantized: y[m, n] = sum_k x[m, k] * (s[n, g] * q[n, k] + b[n, g])
// ---------------------------------------------------------------------------

// E4M3 from its definition (OCP MX spec: bias 7, exponent 0 subnormal, S.1111.111 NaN).
double e4m3_ref(int b) {
  const int e = (b >> 3) & 15, f = b & 7;
  if ((b & 0x7F) == 0x7F) {
    return NAN;
  }
  const double v = e == 0 ? std::ldexp(f / 8.0, -6) : std::ldexp(1.0 + f / 8.0, e - 7);
  return (b & 0x80) != 0 ? -v : v;
}

const char* mode_name(int mode) {
  return mode == kMxfp4 ? "mxfp4" : mode == kNvfp4 ? "nvfp4" : "mxfp8";
}

void check_quantized(int bits, int gs, int K, int N, int M, Outcome& out, int mode = kAffine) {
  const int G = K / gs, levels_q = (1 << bits) - 1;
  const bool fp4 = mode == kMxfp4 || mode == kNvfp4, fp8 = mode == kMxfp8, flt = fp4 || fp8;
  static const double e2m1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  // Exactly N * K * bits / 32 words: a read past the buffer's end is the sanitizer's to see.
  std::vector<uint32_t> w(static_cast<size_t>(N) * K * bits / 32, 0u);
  std::vector<float> s(static_cast<size_t>(N) * G), b(s.size());
  std::vector<double> deq(static_cast<size_t>(N) * K); // s * q + b
  // Affine quantization of normal weights as mx.quantize does it: per group,
  // b = min, s = (max - min) / (2^bits - 1), q = round((w - b) / s), packed as one
  // little-endian bit stream (code k of row n at bit (n * K + k) * bits), in 32-bit words.
  std::vector<float> wg(gs);
  for (int n = 0; n < N; ++n) {
    for (int g = 0; g < G; ++g) {
      float lo = INFINITY, hi = -INFINITY;
      for (int i = 0; i < gs; ++i) {
        wg[i] = 0.05f * normal();
        lo = std::min(lo, wg[i]);
        hi = std::max(hi, wg[i]);
      }
      // mxfp4, mxfp8: an E8M0 scale 2^(e - 127) (decoded, as the primitive passes it); nvfp4:
      // an E4M3 one (0.0078 .. 15, either sign); no bias.
      const int e4m3 = 0x10 + static_cast<int>(rng() % 0x50) + static_cast<int>(rng() % 2) * 0x80;
      const float scale = mode == kNvfp4 ? static_cast<float>(e4m3_ref(e4m3))
          : flt                          ? std::ldexp(1.0f, -6 - static_cast<int>(rng() % 4))
                                         : (hi - lo) / levels_q;
      const float bias = flt ? 0.0f : lo;
      s[static_cast<size_t>(n) * G + g] = scale;
      b[static_cast<size_t>(n) * G + g] = bias;
      for (int i = 0; i < gs; ++i) {
        const int k = g * gs + i;
        int q = static_cast<int>(std::lround((wg[i] - bias) / scale));
        q = fp4 ? static_cast<int>(rng() % 16) : std::min(std::max(q, 0), levels_q);
        while (fp8 && ((q = static_cast<int>(rng() % 256)) & 0x7F) == 0x7F) { // finite codes
        }
        const size_t bit = (static_cast<size_t>(n) * K + k) * bits;
        const int shift = static_cast<int>(bit % 32);
        w[bit / 32] |= static_cast<uint32_t>(q) << shift;
        if (shift + bits > 32) { // straddles into the next word
          w[bit / 32 + 1] |= static_cast<uint32_t>(q) >> (32 - shift);
        }
        deq[static_cast<size_t>(n) * K + k] =
            static_cast<double>(scale) * (fp4 ? e2m1[q] : fp8 ? e4m3_ref(q) : q) + bias;
      }
    }
  }
  std::vector<float> x(static_cast<size_t>(M) * K);
  for (float& v : x) {
    v = normal();
  }
  std::vector<double> ref(static_cast<size_t>(M) * N);
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      double acc = 0.0;
      for (int k = 0; k < K; ++k) {
        acc += static_cast<double>(x[static_cast<size_t>(m) * K + k]) *
            deq[static_cast<size_t>(n) * K + k];
      }
      ref[static_cast<size_t>(m) * N + n] = acc;
    }
  }
  char head[96];
  if (flt) {
    std::snprintf(head, sizeof head, "qmv %s gs=%d K=%d N=%d M=%d:", mode_name(mode), gs, K, N, M);
  } else {
    std::snprintf(head, sizeof head, "qmv bits=%d gs=%d K=%d N=%d M=%d:", bits, gs, K, N, M);
  }
  std::string line = head;
  bool ok = true;
  std::vector<float> xp(x.size()), xsum(static_cast<size_t>(M) * G), y(ref.size());
  for (Isa isa : levels()) {
    ok = cap_at(isa) && ok;
    QmvProblem p;
    p.isa = qmv_isa(current_isa(), mode, K);
    p.M = M, p.N = N, p.K = K, p.group_size = gs, p.bits = bits;
    p.mode = mode;
    p.x = x.data();
    qmv_prepare(p, xp.data(), xsum.data());
    p.xp = xp.data(), p.xsum = xsum.data();
    p.shared_biases = flt; // one row of zeros
    std::vector<float> zeros(G, 0.0f);
    p.w = w.data(), p.scales = s.data(), p.biases = flt ? zeros.data() : b.data(), p.y = y.data();
    const bool in_range = run_split([&](int n0, int n1) { qmv_rows(p, n0, n1); }, y, M, N);
    ok = judge(p.isa, rel_error(y, ref), in_range, line, out) && ok;
    if (p.isa == kAvx512 || p.isa == kAvx2) { // the earlier loops too (set_qmv_rows_path)
      set_qmv_rows_path(0);
      const bool in = run_split([&](int n0, int n1) { qmv_rows(p, n0, n1); }, y, M, N);
      set_qmv_rows_path(1);
      line += " (earlier loops)";
      ok = judge(p.isa, rel_error(y, ref), in, line, out) && ok;
    }
  }
  std::printf("%s %s\n", line.c_str(), ok ? "ok" : "FAILED");
  out.cases += 1;
  out.failures += ok ? 0 : 1;
}

// ---------------------------------------------------------------------------
// Float weights: y[m, n] = sum_k x[m, k] * w[n, k]
// ---------------------------------------------------------------------------

// The reference widening, from the formats' definitions (not the kernels' tricks).
double bf16_value(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

double f16_value(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, frac = h & 0x3FF;
  const double mag = exp == 0 ? std::ldexp(frac, -24) : std::ldexp(1024 + frac, exp - 25);
  return sign ? -mag : mag; // exp == 31 (inf / nan) is never generated here
}

uint16_t to_bf16(float f) { // rounded to nearest even
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t to_f16(float f) { // normal range only (|f| well inside it here), truncated
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  if (exp <= 0) {
    return static_cast<uint16_t>(sign);
  }
  return static_cast<uint16_t>(sign | (exp << 10) | ((u >> 13) & 0x3FF));
}

const char* type_name(WeightType t) {
  return t == kF32 ? "f32" : t == kBF16 ? "bf16" : "f16";
}

// Runs the float kernel on each level for w (N x K, of type t, as raw words), against
// wd (the same weights in double); x is (M x K). Returns false on a failure.
bool run_matvec(WeightType t, const void* w, const std::vector<double>& wd,
                const std::vector<float>& x, int M, int N, int K, std::string& line,
                Outcome& out, bool exact) {
  std::vector<double> ref(static_cast<size_t>(M) * N);
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      double acc = 0.0;
      for (int k = 0; k < K; ++k) {
        acc += x[static_cast<size_t>(m) * K + k] * wd[static_cast<size_t>(n) * K + k];
      }
      ref[static_cast<size_t>(m) * N + n] = acc;
    }
  }
  bool ok = true;
  std::vector<float> xv(x.size()), y(ref.size());
  for (Isa isa : levels()) {
    ok = cap_at(isa) && ok;
    MatvecProblem p;
    p.isa = matvec_path(current_isa());
    p.wtype = t;
    p.M = M, p.N = N, p.K = K;
    xv = x;
    matvec_prepare(p, xv.data());
    p.x = xv.data(), p.w = w, p.y = y.data();
    const bool in_range = run_split([&](int n0, int n1) { matvec_rows(p, n0, n1); }, y, M, N);
    double err = rel_error(y, ref);
    if (exact) { // every output is one weight times 1: bit for bit
      for (size_t i = 0; i < y.size(); ++i) {
        if (static_cast<double>(y[i]) != ref[i]) {
          err = INFINITY;
        }
      }
    }
    ok = judge(p.isa, err, in_range, line, out) && ok;
  }
  return ok;
}

void check_float(WeightType t, int K, int N, int M, Outcome& out) {
  std::vector<float> wf(static_cast<size_t>(N) * K);
  std::vector<uint16_t> wh(t == kF32 ? 0 : wf.size());
  std::vector<double> wd(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) {
    wf[i] = normal();
    if (t == kF32) {
      wd[i] = wf[i];
    } else if (t == kBF16) {
      wh[i] = to_bf16(wf[i]);
      wd[i] = bf16_value(wh[i]);
    } else {
      wh[i] = to_f16(wf[i]);
      wd[i] = f16_value(wh[i]);
    }
  }
  std::vector<float> x(static_cast<size_t>(M) * K);
  for (float& v : x) {
    v = normal();
  }
  char head[96];
  std::snprintf(head, sizeof head, "matvec %s K=%d N=%d M=%d:", type_name(t), K, N, M);
  std::string line = head;
  const void* w = t == kF32 ? static_cast<const void*>(wf.data()) : wh.data();
  const bool ok = run_matvec(t, w, wd, x, M, N, K, line, out, false);
  std::printf("%s %s\n", line.c_str(), ok ? "ok" : "FAILED");
  out.cases += 1;
  out.failures += ok ? 0 : 1;
}

// Every finite value of a 16-bit type, one per output row at column n % K of an otherwise
// zero row, x all ones: each output is the widened value itself.
void check_widening(WeightType t, Outcome& out) {
  const int K = 19; // one vector step and a scalar tail: the value lands in either
  std::vector<uint16_t> values;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const bool finite = t == kBF16 ? ((h >> 7) & 0xFF) != 0xFF : ((h >> 10) & 0x1F) != 0x1F;
    if (finite) {
      values.push_back(static_cast<uint16_t>(h));
    }
  }
  const int N = static_cast<int>(values.size());
  std::vector<uint16_t> w(static_cast<size_t>(N) * K, 0);
  std::vector<double> wd(w.size(), 0.0);
  for (int n = 0; n < N; ++n) {
    const size_t i = static_cast<size_t>(n) * K + n % K;
    w[i] = values[n];
    wd[i] = t == kBF16 ? bf16_value(values[n]) : f16_value(values[n]);
  }
  std::vector<float> x(K, 1.0f);
  char head[96];
  std::snprintf(head, sizeof head, "widen %s: %d finite values, bit for bit:", type_name(t), N);
  std::string line = head;
  const bool ok = run_matvec(t, w.data(), wd, x, 1, N, K, line, out, true);
  std::printf("%s %s\n", line.c_str(), ok ? "ok" : "FAILED");
  out.cases += 1;
  out.failures += ok ? 0 : 1;
}

// Every E4M3 byte through the mxfp8 product, bit for bit: row n holds 32 codes n with scale 1,
// x = (1, 0, ..., 0), so y[n] is code n's value (NaN for 0x7F and 0xFF), on each path.
void check_e4m3_codes(Outcome& out) {
  constexpr int N = 256, K = 32;
  std::vector<uint32_t> w(static_cast<size_t>(N) * K / 4);
  for (int n = 0; n < N; ++n) {
    std::memset(w.data() + static_cast<size_t>(n) * K / 4, n, K);
  }
  std::vector<float> s(N, 1.0f), zeros(1, 0.0f), x(K, 0.0f), xp(K), xsum(1), y(N);
  x[0] = 1.0f;
  std::string line = "widen e4m3: 256 mxfp8 codes, bit for bit:";
  bool ok = true;
  for (Isa isa : levels()) {
    ok = cap_at(isa) && ok;
    QmvProblem p;
    p.isa = current_isa();
    p.M = 1, p.N = N, p.K = K, p.group_size = 32, p.bits = 8, p.mode = kMxfp8;
    p.x = x.data();
    qmv_prepare(p, xp.data(), xsum.data());
    p.xp = xp.data(), p.xsum = xsum.data(), p.shared_biases = true;
    p.w = w.data(), p.scales = s.data(), p.biases = zeros.data(), p.y = y.data();
    qmv_rows(p, 0, N);
    int bad = 0;
    for (int n = 0; n < N; ++n) {
      const double ref = e4m3_ref(n);
      const bool same = std::isnan(ref) ? std::isnan(y[n]) : y[n] == ref; // ±0 alike (a sum)
      bad += same ? 0 : 1;
    }
    line += std::string(" ") + isa_name(p.isa) + (bad == 0 ? " exact" : " MISMATCHED");
    ok = ok && bad == 0;
  }
  std::printf("%s %s\n", line.c_str(), ok ? "ok" : "FAILED");
  out.cases += 1;
  out.failures += ok ? 0 : 1;
}

} // namespace

int main() {
  Outcome out;
  std::printf("check_kernels: best ISA %s; paths:", isa_name(best_isa()));
  for (Isa isa : levels()) {
    std::printf(" %s", isa_name(isa));
  }
  std::printf("\n");
  for (int bits : {2, 3, 4, 5, 6, 8}) {
    for (int gs : {32, 64, 128}) {
      for (int M = 1; M <= 16; ++M) { // every row count: the 4-row blocks and each remainder
        check_quantized(bits, gs, 3 * gs, 37, M, out);
      }
      for (int N : {1, 2, 7}) { // single groups, fewer rows than a decode pass
        check_quantized(bits, gs, gs, N, 1, out);
        check_quantized(bits, gs, gs, N, 5, out);
      }
      check_quantized(bits, gs, 1536 / gs * gs, 13, 1, out); // a long row (SmolLM2's down)
      for (int M : {2, 4, 5, 6, 9, 13, 16}) { // long rows: AVX-512's passes of 4 (and one of 5)
        check_quantized(bits, gs, 1536 / gs * gs, 37, M, out);
      }
    }
  }
  // mxfp4 (E2M1 codes in the 4-bit layout, E8M0 scales per 32, no bias)
  for (int M = 1; M <= 16; ++M) {
    check_quantized(4, 32, 96, 37, M, out, kMxfp4);
  }
  for (int N : {1, 2, 7}) {
    check_quantized(4, 32, 32, N, 1, out, kMxfp4);
    check_quantized(4, 32, 32, N, 5, out, kMxfp4);
  }
  check_quantized(4, 32, 1536, 13, 1, out, kMxfp4);
  // nvfp4 (E2M1 codes, E4M3 scales per 16: two groups in each 32-code step) and mxfp8 (E4M3
  // codes in the 8-bit layout, E8M0 scales per 32)
  for (int mode : {kNvfp4, kMxfp8}) {
    const int gs = mode == kNvfp4 ? 16 : 32, bits = mode == kNvfp4 ? 4 : 8;
    for (int M = 1; M <= 16; ++M) {
      check_quantized(bits, gs, 96, 37, M, out, mode);
    }
    for (int N : {1, 2, 7}) {
      check_quantized(bits, gs, 32, N, 1, out, mode);
      check_quantized(bits, gs, 32, N, 5, out, mode);
    }
    check_quantized(bits, gs, 1536, 13, 1, out, mode);
  }
  for (int K : {16, 48, 80}) { // nvfp4 rows off a multiple of 32 (qmv_isa)
    check_quantized(4, 16, K, 7, 1, out, kNvfp4);
    check_quantized(4, 16, K, 7, 3, out, kNvfp4);
  }
  check_e4m3_codes(out);
  for (WeightType t : {kF32, kBF16, kF16}) {
    for (int M = 1; M <= 16; ++M) {
      check_float(t, 77, 37, M, out); // 4 vector steps of 16 and a tail of 13
    }
    for (int K : {1, 15, 16, 17, 32, 33, 576}) {
      for (int N : {1, 5, 9}) {
        check_float(t, K, N, 1, out);
        check_float(t, K, N, 3, out);
      }
    }
  }
  check_widening(kBF16, out);
  check_widening(kF16, out);
  set_max_isa(best_isa());
  std::printf("check_kernels: %d cases, %d failed, max relative error %.2e (bound %.0e), "
              "best ISA %s\n",
              out.cases, out.failures, out.worst, kTol, isa_name(best_isa()));
  return out.failures == 0 ? 0 : 1;
}
