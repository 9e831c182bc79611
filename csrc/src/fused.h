// Fused decode primitives: the small ops around the products of one decode step, each
// as one MLX primitive instead of the tens of MLX's CPU backend schedules one by one
// (~10 us each on the machines measured; a SmolLM2-135M decode step had ~1,460 of them).
//
// - rms_norm: RMSNorm of a few rows (x * rsqrt(mean(x^2) + eps), rounded to x's dtype,
//   times the weight), one primitive instead of three.
// - cache_write: one new token's key (RoPE'd from the forward pass's cos/sin table) or value
//   written into a standard KV cache's buffer at `offset`, in place where MLX lets the
//   buffer be donated (as slice_update does; one output per primitive, so the donation
//   check is MLX's own), else into a copy.
// - decode_attention: that token's attention: RoPE on its query, softmax(q k^T * scale) v
//   over the offset + 1 cached tokens, query heads sharing their kv head, out in q's layout
//   (..., n_q * Dv), ready for the output projection.
//
// - paged_attention (paged.cpp): the batching engine's decode step over its pool's blocks.
// - log_softmax (log_softmax.cpp): a few rows of logits normalised to log-probs, in f32.
// - swiglu (swiglu.cpp): silu(gate) * up of a decode step's gated MLPs, in f32.
//
// On a GPU stream the ops build MLX's own graph (mx.fast.rms_norm; RoPE by the table,
// slice_update, mx.fast.scaled_dot_product_attention), so eval_gpu is never reached.
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mlxinfer {

namespace mx = mlx::core;

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s = {});

struct AttentionShape {
  int n_q; // query heads (decode_attention)
  int n_kv; // key/value heads
  int offset; // cached tokens before this one (its position in the buffers)
  float scale; // multiplies q k^T (decode_attention)
  int dims; // features RoPE rotates (<= head dim; 0: none)
  bool traditional; // RoPE pairs (2i, 2i+1) instead of (i, i + dims/2)
  int start = 0; // cache_write: where the token's values begin in x (a fused q|k|v row)
  bool operator==(const AttentionShape&) const = default;
};

// buffer (1, n_kv, cap, D) with one token's x (n_kv * D values from x's element a.start, rotated by the (dims/2)
// cos/sin table where dims > 0) written at `offset` < cap. `reference`: MLX's own ops.
mx::array cache_write(const mx::array& buffer, const mx::array& x, const mx::array& cos,
                      const mx::array& sin, const AttentionShape& a, bool reference = false,
                      mx::StreamOrDevice s = {});

// softmax(rope(q) k^T * scale) v over the offset + 1 first tokens of keys (1, n_kv, cap, D)
// and values (1, n_kv, cap, Dv), the n_q / n_kv query heads of a group sharing their kv
// head: (..., n_q * D) -> (..., n_q * Dv) in q's dtype. `reference`: MLX's own ops.
mx::array decode_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                           const mx::array& cos, const mx::array& sin, const AttentionShape& a,
                           bool reference = false, mx::StreamOrDevice s = {});

// One decode token per row over a paged KV pool (the batching engine): q (B, n_q, 1, D);
// keys (n_blocks, n_kv, block, D), values (n_blocks, n_kv, block, Dv); blocks (B, n_kv, n)
// uint32, each row's blocks in order as block * n_kv + head; visible (B, 1, n, 1, block) bool,
// which of those keys the row sees. softmax(q k^T * scale) v over the visible keys, query heads
// sharing their kv head: (B, n_q, 1, Dv) in q's dtype. `reference`: MLX's own ops.
mx::array paged_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                          const mx::array& blocks, const mx::array& visible, float scale,
                          bool reference = false, mx::StreamOrDevice s = {});

// DecodeAttention's loop: query rows qr (n_q * D, f32, rotated and scaled) over the
// offset + 1 first tokens of keys and values (float buffers as decode_attention takes them),
// into y (n_q * Dv).
void attend_decode(const AttentionShape& a, std::vector<float>& qr, const mx::array& keys,
                   const mx::array& values, std::vector<float>& y);

// paged_attention over a quantized pool (paged.cpp): keys and values each [packed uint32
// (n_blocks, n_kv, block, width * bits / 32), float32 scales and biases (..., width /
// group_size)] as mx.quantize makes them (4 or 8 bits, group_size a power of two >= 16), each part
// dequantized as it is read; float32 q (B, n_q, 1, D) -> (B, n_q, 1, Dv) float32. GPU streams:
// MLX's ops over the gathered, dequantized blocks.
mx::array paged_attention_quantized(const mx::array& q, const std::vector<mx::array>& keys,
                                    const std::vector<mx::array>& values, const mx::array& blocks,
                                    const mx::array& visible, float scale, int group_size,
                                    int bits, mx::StreamOrDevice s = {});

// paged_attention's argument checks (paged.cpp), shared with block.cpp's engine step: two
// (n_blocks, n_kv, block, head_dim) float pools of one dtype; B rows' block tables (B, n_kv, n)
// uint32 and visibility (B, 1, n, 1, block) bool. One-line errors naming `op`.
void check_pool(const char* op, const mx::array& keys, const mx::array& values);
void check_pages(const char* op, const mx::array& blocks, const mx::array& visible, int B,
                 int n_kv, int block);

// PagedAttention's loop: queries qf (B, n_q, D) f32, rotated and scaled, over the pool pages
// as paged_attention takes them, into y (B, n_q, Dv).
void paged_attend(const std::vector<float>& qf, int B, int n_q, const mx::array& keys,
                  const mx::array& values, const mx::array& blocks, const mx::array& visible,
                  std::vector<float>& y);

// paged_attend over a quantized pool's sides ([codes, scales, biases] each, float32 scales).
void paged_attend_quantized(const std::vector<float>& qf, int B, int n_q,
                            const std::vector<mx::array>& keys,
                            const std::vector<mx::array>& values, const mx::array& blocks,
                            const mx::array& visible, int group_size, int bits,
                            std::vector<float>& y);

// One row of D floats quantized as mx.quantize (affine) does, bit for bit: codes packed low
// bits first into D * bits / 32 words, a float32 scale and bias a group.
void quantize_row(const float* v, int D, int group_size, int bits, uint32_t* codes,
                  float* scales, float* biases);

// paged_attention_quantized's checks of one side; its width.
int check_quantized_side(const char* op, const char* side, const std::vector<mx::array>& parts,
                         int group_size, int bits);
void check_quantized_format(const char* op, int group_size, int bits);

// How many times cache_write (or block.cpp's pool_write) copied a buffer it could not update
// in place.
int64_t attention_buffer_copies();
// An in-place writer's output: `in`'s buffer taken over where MLX may donate it (nothing else
// holds it: the check slice_update uses), else a fresh one (counted unless `count` is false: the
// writer then counts the copy it makes, note_buffer_copy); true when the caller must copy `in`
// into it first.
bool take_buffer(const mx::array& in, mx::array& out, bool count = true);
void note_buffer_copy();

mx::array log_softmax(const mx::array& x, mx::StreamOrDevice s = {});
// log_softmax(x) and each row's argmax (uint32, as mx.argmax and numpy's: the first NaN where a
// row has one, else the first of its largest values) in one pass over the rows on the kernels'
// threads: a greedy batch's token and log-probs (MLX's argmax runs its rows on one thread).
std::vector<mx::array> log_softmax_argmax(const mx::array& x, mx::StreamOrDevice s = {});

class LogSoftmaxArgmax : public mx::Primitive {
 public:
  explicit LogSoftmaxArgmax(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxinferLogSoftmaxArgmax";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& shape = inputs[0].shape();
    return {shape, mx::Shape(shape.begin(), shape.end() - 1)};
  }
};

class LogSoftmax : public mx::UnaryPrimitive {
 public:
  explicit LogSoftmax(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxinferLogSoftmax";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

// silu(gate) * up for float32 gate and up of one shape.
mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});
// gelu_tanh(gate) * up (GELU's tanh approximation, Gemma's and GPT-2's), the same way:
// 0.5 g (1 + tanh(z)) = g sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3).
mx::array gelu_tanh_glu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

// act(g) * u over n float32 values on the calling thread (the SwiGLU primitive's loop, for
// the fused blocks). act: 0 silu, 1 GELU's tanh approximation.
void gated_span(int act, const float* g, const float* u, float* y, size_t n);

// act: 0 silu, 1 GELU's tanh approximation.
class SwiGLU : public mx::UnaryPrimitive {
 public:
  explicit SwiGLU(mx::Stream stream, int act = 0) : mx::UnaryPrimitive(stream), act_(act) {}
  int act() const {
    return act_;
  }
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxinferSwiGLU";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return act_ == static_cast<const SwiGLU&>(other).act_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int act_;
};

class RMSNorm : public mx::UnaryPrimitive {
 public:
  RMSNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxinferRMSNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

class CacheWrite : public mx::UnaryPrimitive {
 public:
  CacheWrite(mx::Stream stream, AttentionShape a) : mx::UnaryPrimitive(stream), a_(a) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxinferCacheWrite";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return a_ == static_cast<const CacheWrite&>(other).a_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  AttentionShape a_;
};

class DecodeAttention : public mx::UnaryPrimitive {
 public:
  DecodeAttention(mx::Stream stream, AttentionShape a) : mx::UnaryPrimitive(stream), a_(a) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxinferDecodeAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return a_ == static_cast<const DecodeAttention&>(other).a_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  AttentionShape a_;
};

class PagedQuantizedAttention : public mx::UnaryPrimitive {
 public:
  PagedQuantizedAttention(mx::Stream stream, float scale, int group_size, int bits)
      : mx::UnaryPrimitive(stream), scale_(scale), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxinferPagedQuantizedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PagedQuantizedAttention&>(other);
    return scale_ == o.scale_ && group_size_ == o.group_size_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  int group_size_;
  int bits_;
};

class PagedAttention : public mx::UnaryPrimitive {
 public:
  PagedAttention(mx::Stream stream, float scale) : mx::UnaryPrimitive(stream), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxinferPagedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const PagedAttention&>(other).scale_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
};

} // namespace mlxinfer
