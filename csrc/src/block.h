// A decode step's pre-norm block in four primitives, fused into one (fuse), instead of ~15 (SmolLM2-135M: 471 a
// token, ~3 us each of MLX's scheduling): the steps between two residual adds done in one
// eval, on the kernels' threads, in the order and float arithmetic of the separate kernels
// (RMSNorm, the quantized products, RoPE, attention, the gated activation), so the output is
// theirs bit for bit.
//
// - norm_products: RMSNorm of x's rows, then the products of quantized layers that read it,
//   side by side in one output (q | k | v, or gate | up); optionally each head's q and k
//   normalised (Gemma-3's, Qwen3's q_norm / k_norm).
// - cache_write (fused.cpp) takes a token's k or v from that row (AttentionShape::start).
// - attention_output: x + [post_norm](o_proj(attention(rope(q)))) for one token over the
//   cache buffers cache_write filled; q the first n_q * D values of the q | k | v row.
// - mlp_output: h + [post_norm](down(act(gate) * up)) with gate | up = norm_products of h.
//
// Affine quantized layers (2-8 bits, group 32/64/128) with float32 scales' or any float
// scales, float32 activations: the CPU backend's decode plan calls them for such blocks only
// (backends/cpu/blocks.py); MLX's own graph runs everything else. No GPU path: a GPU stream
// is refused (the backend never builds them there).
#pragma once

#include <vector>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include "fused.h"

namespace mlxinfer {

namespace mx = mlx::core;

struct QuantFormat {
  int group_size;
  int bits;
  bool operator==(const QuantFormat&) const = default;
};

// One quantized layer's arrays (affine: codes, scales, biases) and format.
struct QuantLayer {
  mx::array w, scales, biases;
  int group_size, bits;
};

// Per-head RMSNorm of the q and k parts of a q | k | v row (weights (D,)).
struct HeadNorms {
  int n_q = 0, n_kv = 0, head_dim = 0;
  float eps = 0;
  bool operator==(const HeadNorms&) const = default;
};

mx::array norm_products(const mx::array& x, const mx::array& norm, float eps,
                        const std::vector<QuantLayer>& layers,
                        const std::optional<mx::array>& q_norm,
                        const std::optional<mx::array>& k_norm, const HeadNorms& heads,
                        mx::StreamOrDevice s = {});

mx::array attention_output(const mx::array& x, const mx::array& qkv, const mx::array& keys,
                           const mx::array& values, const mx::array& cos, const mx::array& sin,
                           const QuantLayer& o, const AttentionShape& a,
                           const std::optional<mx::array>& post_norm, float post_eps,
                           mx::StreamOrDevice s = {});

// The batching engine's step (one token a row over its paged pool), and one row's over a plain
// cache's buffers read as one block per KV head:
// - pool_write: one layer's keys and values (n_blocks, n_kv, block, D) with each row's k and v
//   (the n_kv * D values of its q | k | v row from k_start, rotated by the row's own cos/sin
//   where dims > 0, and from v_start) written at the flat rows `rows` (B * n_kv uint32: (block
//   * n_kv + head) * block + within), in place where nothing else holds the pools; the
//   updated keys' arrays, then the values';
// - paged_attention_output: x + [post_norm](o(paged_attention(rope(q)))) for B rows, each
//   query rotated at its own position (cos/sin (B, ..., dims/2)).
// A quantized pool (kv_bits) holds each side as mx.quantize's [codes, scales, biases]: with
// `kv.bits` set (4 or 8) each row is quantized as mx.quantize does (bit for bit) into the three,
// and paged_attention_output reads them.
std::vector<mx::array> pool_write(const std::vector<mx::array>& keys,
                                  const std::vector<mx::array>& values, const mx::array& qkv,
                                  const mx::array& rows, const mx::array& cos,
                                  const mx::array& sin, int k_start, int v_start, int dims,
                                  bool traditional, QuantFormat kv = {64, 0},
                                  mx::StreamOrDevice s = {});

mx::array paged_attention_output(const mx::array& x, const mx::array& qkv,
                                 const std::vector<mx::array>& keys,
                                 const std::vector<mx::array>& values, const mx::array& blocks,
                                 const mx::array& visible, const mx::array& cos,
                                 const mx::array& sin, const QuantLayer& o, int n_q, float scale,
                                 int dims, bool traditional,
                                 const std::optional<mx::array>& post_norm, float post_eps,
                                 QuantFormat kv = {64, 0}, mx::StreamOrDevice s = {});

// act: 0 silu, 1 GELU's tanh approximation.
mx::array mlp_output(const mx::array& h, const mx::array& norm, float eps,
                     const std::vector<QuantLayer>& gate_up, const QuantLayer& down, int act,
                     const std::optional<mx::array>& post_norm, float post_eps,
                     mx::StreamOrDevice s = {});

// The arrays `outputs` with the graph of the primitives above that makes them (up to 16 calls:
// a block's four) as one primitive, Fused: one node of MLX's graph, its calls run in order in
// one evaluation, the same work and arithmetic (the same outputs bit for bit). MLX's scheduling
// costs each node ~4-15 us on the CPU (a decode step of SmolLM2's 30 blocks had 120). The
// calls' other outputs become temporaries of the evaluation; arrays made otherwise are its
// inputs. A pool_write's outputs update their inputs in place where nothing else holds them.
std::vector<mx::array> fuse(const std::vector<mx::array>& outputs);

// The work of one of the primitives below, run where it is called: each output allocated, or
// (updates()) sharing the buffer of the input it updates or to be filled from it first.
class Runnable {
 public:
  virtual ~Runnable() = default;
  virtual void run(std::vector<mx::array>& in, std::vector<mx::array>& out) const = 0;
  // The input whose buffer output i updates, or -1.
  virtual int updates(int /*output*/) const {
    return -1;
  }
};

class NormProducts : public mx::UnaryPrimitive, public Runnable {
 public:
  NormProducts(mx::Stream stream, float eps, std::vector<QuantFormat> layers, HeadNorms heads)
      : mx::UnaryPrimitive(stream), eps_(eps), layers_(std::move(layers)), heads_(heads) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void run(std::vector<mx::array>& in, std::vector<mx::array>& out) const override;
  const char* name() const override {
    return "MlxinferNormProducts";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const NormProducts&>(other);
    return eps_ == o.eps_ && layers_ == o.layers_ && heads_ == o.heads_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float eps_;
  std::vector<QuantFormat> layers_;
  HeadNorms heads_;
};

class AttentionOutput : public mx::UnaryPrimitive, public Runnable {
 public:
  AttentionOutput(mx::Stream stream, AttentionShape a, QuantFormat o, bool post, float post_eps)
      : mx::UnaryPrimitive(stream), a_(a), o_(o), post_(post), post_eps_(post_eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void run(std::vector<mx::array>& in, std::vector<mx::array>& out) const override;
  const char* name() const override {
    return "MlxinferAttentionOutput";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttentionOutput&>(other);
    return a_ == o.a_ && o_ == o.o_ && post_ == o.post_ && post_eps_ == o.post_eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  AttentionShape a_;
  QuantFormat o_;
  bool post_;
  float post_eps_;
};

struct PoolRope {
  int start, dims;
  bool traditional;
  bool operator==(const PoolRope&) const = default;
};

class PoolWrite : public mx::Primitive, public Runnable {
 public:
  PoolWrite(mx::Stream stream, PoolRope r, int v_start, QuantFormat kv)
      : mx::Primitive(stream), r_(r), v_start_(v_start), kv_(kv) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void run(std::vector<mx::array>& in, std::vector<mx::array>& out) const override;
  int updates(int output) const override {
    return output; // the pools, in order
  }
  const char* name() const override {
    return "MlxinferPoolWrite";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PoolWrite&>(other);
    return r_ == o.r_ && v_start_ == o.v_start_ && kv_ == o.kv_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    for (size_t i = 0; i + 4 < inputs.size(); ++i) {
      shapes.push_back(inputs[i].shape());
    }
    return shapes;
  }

 private:
  PoolRope r_;
  int v_start_;
  QuantFormat kv_;
};

class PagedAttentionOutput : public mx::UnaryPrimitive, public Runnable {
 public:
  PagedAttentionOutput(mx::Stream stream, int n_q, float scale, PoolRope r, QuantFormat o,
                       bool post, float post_eps, QuantFormat kv)
      : mx::UnaryPrimitive(stream), n_q_(n_q), scale_(scale), r_(r), o_(o), post_(post),
        post_eps_(post_eps), kv_(kv) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void run(std::vector<mx::array>& in, std::vector<mx::array>& out) const override;
  const char* name() const override {
    return "MlxinferPagedAttentionOutput";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PagedAttentionOutput&>(other);
    return n_q_ == o.n_q_ && scale_ == o.scale_ && r_ == o.r_ && o_ == o.o_ &&
        post_ == o.post_ && post_eps_ == o.post_eps_ && kv_ == o.kv_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int n_q_;
  float scale_;
  PoolRope r_;
  QuantFormat o_;
  bool post_;
  float post_eps_;
  QuantFormat kv_; // bits 0: float keys and values
};

class MlpOutput : public mx::UnaryPrimitive, public Runnable {
 public:
  MlpOutput(mx::Stream stream, float eps, std::vector<QuantFormat> gate_up, QuantFormat down,
            int act, bool post, float post_eps)
      : mx::UnaryPrimitive(stream), eps_(eps), gate_up_(std::move(gate_up)), down_(down),
        act_(act), post_(post), post_eps_(post_eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void run(std::vector<mx::array>& in, std::vector<mx::array>& out) const override;
  const char* name() const override {
    return "MlxinferMlpOutput";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MlpOutput&>(other);
    return eps_ == o.eps_ && gate_up_ == o.gate_up_ && down_ == o.down_ && act_ == o.act_ &&
        post_ == o.post_ && post_eps_ == o.post_eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
  std::vector<QuantFormat> gate_up_;
  QuantFormat down_;
  int act_;
  bool post_;
  float post_eps_;
};

// Where an input of a fused call comes from: the Fused primitive's inputs, a temporary of its
// evaluation (an earlier call's output no one else reads), or its outputs.
struct FusedSource {
  enum Kind { kInput, kTemp, kOutput } kind;
  int index;
};

struct FusedCall {
  std::shared_ptr<mx::Primitive> primitive; // a Runnable
  std::vector<FusedSource> in, out;
};

class Fused : public mx::Primitive, public Runnable {
 public:
  Fused(mx::Stream stream, std::vector<FusedCall> calls, std::vector<mx::Shape> temp_shapes,
        std::vector<mx::Dtype> temp_dtypes, std::vector<int> donors)
      : mx::Primitive(stream), calls_(std::move(calls)), temp_shapes_(std::move(temp_shapes)),
        temp_dtypes_(std::move(temp_dtypes)), donors_(std::move(donors)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void run(std::vector<mx::array>& in, std::vector<mx::array>& out) const override;
  const char* name() const override {
    return "MlxinferFused";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return this == &other;
  }

 private:
  std::vector<FusedCall> calls_;
  std::vector<mx::Shape> temp_shapes_;
  std::vector<mx::Dtype> temp_dtypes_;
  std::vector<int> donors_; // per output: the input whose buffer it updates, or -1
};

} // namespace mlxinfer
