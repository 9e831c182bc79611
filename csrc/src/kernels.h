// Matrix x vector kernels on plain pointers (no MLX types): the primitives in
// primitives.cpp prepare the inputs and call these over ranges of output rows.
#pragma once

#include <cstdint>

namespace mlxinfer {

// "avx2+fma" where the CPU has them (checked once at run time), else "scalar".
const char* kernel_isa();
bool simd_enabled();
// Tests force the portable path to check it against the vector one.
void set_force_scalar(bool on);
bool force_scalar();

// y[m, n] = sum_k x[m, k] * (scales[n, g(k)] * q[n, k] + biases[n, g(k)])
// for m in [0, M), n in [n0, n1): MLX's affine quantization (mx.quantize), w packed
// LSB-first, 32 / bits values per uint32 word, groups of group_size along k.
struct QmvProblem {
  int M = 0, N = 0, K = 0, group_size = 0, bits = 0;
  const float* x = nullptr; // (M, K) row-major
  const float* xp = nullptr; // (M, K) x in the order the vector 4-bit unpack yields
  const float* xsum = nullptr; // (M, K / group_size) sums of x over each group
  const uint32_t* w = nullptr; // (N, K * bits / 32)
  const float* scales = nullptr; // (N, K / group_size), converted to f32
  const float* biases = nullptr; // (N, K / group_size), converted to f32
  float* y = nullptr; // (M, N) row-major
};

// Fills xp and xsum from x (xp only matters for bits == 4).
void qmv_prepare(const QmvProblem& p, float* xp, float* xsum);
void qmv_rows(const QmvProblem& p, int n0, int n1);

// y[m, n] = sum_k x[m, k] * w[n, k], w (N, K) row-major f32.
struct MatvecProblem {
  int M = 0, N = 0, K = 0;
  const float* x = nullptr; // (M, K)
  const float* w = nullptr; // (N, K)
  float* y = nullptr; // (M, N)
};
void matvec_rows(const MatvecProblem& p, int n0, int n1);

} // namespace mlxinfer
