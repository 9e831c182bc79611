// Matrix x vector kernels on plain pointers (no MLX types): the primitives in
// primitives.cpp prepare the inputs and call these over ranges of output rows.
#pragma once

#include <cstdint>

namespace mlxinfer {

// Instruction-set levels of the kernels, checked once at run time: scalar < avx2 < avx512
// on x86-64, scalar < neon on arm64 (NEON is in the AArch64 base ISA).
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kNeon = 3 };
// The best level this CPU has, and the level in use (the best unless capped).
Isa best_isa();
Isa current_isa();
// Tests and benchmarks cap the level to check each path against the others.
void set_max_isa(Isa isa);
const char* isa_name(Isa isa);
// Whether the CPU has F16C (the float kernels' vector paths are compiled with it).
bool has_f16c();

// y[m, n] = sum_k x[m, k] * (scales[n, g(k)] * q[n, k] + biases[n, g(k)])
// for m in [0, M), n in [n0, n1): MLX's affine quantization (mx.quantize), w packed
// LSB-first, 32 / bits values per uint32 word, groups of group_size along k.
struct QmvProblem {
  Isa isa = kScalar; // the path; qmv_prepare lays out xp for it
  int M = 0, N = 0, K = 0, group_size = 0, bits = 0;
  const float* x = nullptr; // (M, K) row-major
  const float* xp = nullptr; // (M, K) x in the order the vector 4-bit unpack yields
  const float* xsum = nullptr; // (M, K / group_size) sums of x over each group
  const uint32_t* w = nullptr; // (N, K * bits / 32)
  const float* scales = nullptr; // (N, K / group_size), converted to f32
  const float* biases = nullptr; // (N, K / group_size), converted to f32
  float* y = nullptr; // (M, N) row-major
};

// Fills xp and xsum from x (xp only matters for bits == 4 off the scalar path; elsewhere xp
// may be x itself).
void qmv_prepare(const QmvProblem& p, float* xp, float* xsum);
void qmv_rows(const QmvProblem& p, int n0, int n1);

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
// returns false for a problem it has no path for (bits other than 4 / 8).
bool qmv_rows_neon(const QmvProblem& p, int n0, int n1);
void matvec_rows_neon(const MatvecProblem& p, int n0, int n1);
#endif

} // namespace mlxinfer
