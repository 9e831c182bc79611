// MLX primitives around the kernels: lazy in the graph, usable inside mx.compile.
// On a GPU stream the ops hand the work to MLX's own quantized_matmul / matmul at
// graph-construction time, so eval_gpu is never reached.
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include <optional>
#include <string>
#include <tuple>

namespace mlxinfer {

namespace mx = mlx::core;

// x (..., K) @ dequantize(w_q, scales, biases).T -> (..., N), MLX's packing: mode "affine"
// (biases given) or "mxfp4" (uint8 E8M0 scales, no biases).
mx::array quantized_matvec(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    const std::string& mode = "affine",
    mx::StreamOrDevice s = {});

// x (..., K) @ dequantize(w, scales, biases).T for many rows with x rounded to int16 per block
// of 32 and AVX-512 VNNI's products (prefill_i16.cpp); affine, w's rows a multiple of 32.
mx::array quantized_matmul_i16(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// softmax(q k^T * scale) v for prompts: q (B, n_q, L, D), k (B, n_kv, T, D), v (B, n_kv, T,
// Dv), float32, D and Dv multiples of 16; causal: query i sees the first T - L + i + 1 keys;
// or a bool mask (B or 1, 1, L, T) of the keys each query sees (prefill_attention.cpp).
mx::array prefill_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                            float scale, bool causal,
                            const std::optional<mx::array>& mask = std::nullopt,
                            mx::StreamOrDevice s = {});

// Whether quantized_matmul_i16 runs here (AVX-512 F, BW, VNNI and VBMI at the kernels' ISA level).
bool vnni_available();
// Up to how many rows of x (0: none; at most 4) the quantized products of affine codes
// (quantized_matvec_f32: the quantized_matvec op and the fused blocks' products) take the int16
// product's few-row path where vnni_available(): x rounded to int16 per block of 32 inputs, as
// quantized_matmul_i16. Process-wide, like the kernels' threads; set by the ``int16_decode`` plan.
void set_int16_decode_rows(int rows);
int int16_decode_rows();
// That path for one product: false where it does not apply (the caller runs the float kernel).
bool int16_decode(const float* x, int M, const mx::array& w, const mx::array& sc,
                  const mx::array& bi, int gs, int bits, int mode, float* y);

// Tiled layers (tiles.cpp): a 4-, 5-, 6- or 8-bit affine layer's codes laid out at load for AVX-512
// VNNI's int16 products, a uint8 array (N, K * bits / 8) (MLX's packing is uint32), N a multiple
// of 32, its scales and biases float32 in the tiles' order. quantized_matvec and the fused
// blocks take one in place of MLX's arrays and run it with x rounded to int16 per block of 32.
bool is_tiled(const mx::array& w);
// Whether tiled layers run here: AVX-512's path (tiles_wide_available()), else AVX2's (the
// same outputs, 256-bit vpmaddwd or vpdpwssd), at the kernels' ISA level.
bool tiles_available();
// Whether they run the 512-bit path (AVX-512 F and BW: vpdpwssd with VNNI, else vpmaddwd and
// vpaddd; no VBMI needed), else AVX2's.
bool tiles_wide_available();
// Whether that path sums with VNNI's vpdpwssd (Cascade Lake and later; not Skylake-SP).
bool tiles_wide_vnni();
// Int8 activations (opt-in; MLXINFER_INT8_ACTIVATIONS=1 sets it at load): x rounded to int8 per
// block of 32 and summed with vpdpbusd in every int16 product — the tiled layers' on AVX-512
// VNNI, the 4-bit tiled layers' on AVX2 (vpmaddubsw, or AVX-VNNI's vpdpbusd), quantized_matmul_i16's
// (its few-row path too); elsewhere int16 as before. tiles_int8_available(): a tiled path has it.
void set_int8_activations(bool on);
bool int8_activations();
bool tiles_int8_available();
// MLX's affine arrays (evaluated here) laid out as a tiled layer; scales and biases float16
// with `half` (the caller checks that every value is one), else float32.
std::tuple<mx::array, mx::array, mx::array> tile_layer(const mx::array& w,
                                                       const mx::array& scales,
                                                       const mx::array& biases, int group_size,
                                                       int bits, bool half,
                                                       bool drop_symmetric);
// K, or std::invalid_argument naming the array that is not a tiled layer's (`op`: the prefix).
int64_t check_tiled(const std::string& op, const mx::array& w, const mx::array& scales,
                    const mx::array& biases, int group_size, int bits);
// y (M, N) = x (M, K) through a tiled layer (quantized_matvec_f32 calls it for one).
void tiled_matvec_f32(const float* x, int M, const mx::array& w, const mx::array& sc,
                      const mx::array& bi, int gs, int bits, float* y);

// x (..., K) @ w.T -> (..., N), w (N, K) float32.
mx::array matvec(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {});

// dequantize(w, scales, biases) as mx.dequantize for affine 2/3/4/5/6/8 bits, groups of
// 32/64/128: s * q + b in f32, rows over the pool (dequantize.cpp); output in scales' dtype.
mx::array dequantize(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// y (M, N) = x (M, K) @ dequantize(w, sc, bi).T on f32 rows, on the kernels' threads: the
// quantized product of QuantizedMatvec and the fused decode blocks (block.cpp). mode: QmvMode
// (the float modes' bi is never read).
void quantized_matvec_f32(const float* x, int M, const mx::array& w, const mx::array& sc,
                          const mx::array& bi, int gs, int bits, int mode, float* y);

// Threads the kernels run on (the caller included); n <= 0: the CPUs we may use.
void set_num_threads(int n);
int num_threads();

class QuantizedMatvec : public mx::UnaryPrimitive {
 public:
  QuantizedMatvec(mx::Stream stream, int group_size, int bits, int mode)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), mode_(mode) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "MlxinferQuantizedMatvec";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  int mode_; // QmvMode
};

class Matvec : public mx::UnaryPrimitive {
 public:
  explicit Matvec(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "MlxinferMatvec";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

} // namespace mlxinfer
