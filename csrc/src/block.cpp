#include "block.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

#include "mlx/backend/cpu/encoder.h"

#include "attention_math.h"
#include "kernels.h"
#include "primitives.h"
#include "util.h"

namespace mlxinfer {

namespace {

// One row's RMSNorm as RMSNorm::eval_cpu computes it: f32 statistics, the normalised row
// rounded to `dtype`, then times w.
void norm_row(float* row, int K, const float* w, float eps, mx::Dtype dtype) {
  float ss = 0;
  for (int i = 0; i < K; ++i) {
    ss += row[i] * row[i];
  }
  const float scale = 1.0f / std::sqrt(ss / K + eps);
  for (int i = 0; i < K; ++i) {
    row[i] *= scale;
  }
  round_to(dtype, row, K);
  for (int i = 0; i < K; ++i) {
    row[i] *= w[i];
  }
}

aligned_vector<float> f32_of(const mx::array& a) {
  aligned_vector<float> v(a.size()); // not zeroed: to_f32 writes every value
  to_f32(a, v.data());
  return v;
}

// a's values as float32: its own data where it is float32 and row-contiguous (no copy), else
// converted into `buf`.
const float* f32_data(const mx::array& a, aligned_vector<float>& buf) {
  if (a.dtype() == mx::float32 && a.flags().row_contiguous) {
    return a.data<float>();
  }
  buf.resize(a.size());
  to_f32(a, buf.data());
  return buf.data();
}

void check_gpu(const char* op, mx::Stream stream) {
  if (stream.device == mx::Device::gpu) {
    fail(op, "stream: the fused decode blocks run on the CPU only (the CPU backend builds "
             "them); found a GPU stream");
  }
}

void check_x(const char* op, const mx::array& x, const char* name) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || x.shape(-1) == 0) {
    fail(op, std::string(name) + ": expected a float32 array of shape (..., K), found " +
                 shape_str(x.shape()));
  }
}

void check_norm(const char* op, const mx::array& w, int K, const char* name) {
  if (w.ndim() != 1 || w.shape(0) != K || !is_float(w.dtype())) {
    fail(op, std::string(name) + ": expected a float array of shape (" + std::to_string(K) +
                 ",), found " + shape_str(w.shape()));
  }
}

// The layer's output rows; its K must be `K`.
int check_layer(const char* op, const QuantLayer& l, int K, const std::string& name) {
  const int b = l.bits, gs = l.group_size;
  if (is_tiled(l.w)) {
    const int64_t k = check_tiled(std::string("[mlxinfer ") + op + "] " + name + " ", l.w, l.scales, l.biases, gs, b);
    if (k != K) {
      fail(op, name + " w: expected a tiled layer of " + std::to_string(K) + " inputs, found " +
                   std::to_string(k));
    }
    return l.w.shape(0);
  }
  if (b != 2 && b != 3 && b != 4 && b != 5 && b != 6 && b != 8) {
    fail(op, name + " bits: expected 2, 3, 4, 5, 6 or 8, found " + std::to_string(b));
  }
  if (gs != 32 && gs != 64 && gs != 128) {
    fail(op, name + " group_size: expected 32, 64 or 128, found " + std::to_string(gs));
  }
  if (l.w.dtype() != mx::uint32 || l.w.ndim() != 2 ||
      static_cast<int64_t>(l.w.shape(1)) * 32 != static_cast<int64_t>(K) * b) {
    fail(op, name + " w: expected (N, " + std::to_string(K * b / 32) + ") uint32 codes for " +
                 std::to_string(K) + " inputs, found " + shape_str(l.w.shape()));
  }
  const mx::Shape sshape = {l.w.shape(0), K / gs};
  if (K % gs != 0 || l.scales.shape() != sshape || l.biases.shape() != sshape ||
      !is_float(l.scales.dtype()) || !is_float(l.biases.dtype())) {
    fail(op, name + " scales/biases: expected float arrays of shape " + shape_str(sshape) +
                 ", found " + shape_str(l.scales.shape()) + " and " +
                 shape_str(l.biases.shape()));
  }
  return l.w.shape(0);
}

void push_layer(std::vector<mx::array>& inputs, std::vector<QuantFormat>& formats,
                const QuantLayer& l) {
  inputs.insert(inputs.end(), {l.w, l.scales, l.biases});
  formats.push_back({l.group_size, l.bits});
}

// y (M, N) = x (M, K) through the layer whose arrays start at inputs[i].
void product(const float* x, int M, const std::vector<mx::array>& inputs, size_t i,
             const QuantFormat& f, float* y) {
  quantized_matvec_f32(x, M, inputs[i], inputs[i + 1], inputs[i + 2], f.group_size, f.bits,
                       kAffine, y);
}

// Runs the work of `outputs`' primitive (a Runnable) on the encoder with weak copies of the
// inputs and outputs, the primitive held until it has run.
void dispatch_run(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto prim = outputs[0].primitive_ptr();
  auto& encoder = mx::cpu::get_command_encoder(prim->stream());
  std::vector<mx::array> in, out;
  in.reserve(inputs.size());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  for (auto& a : outputs) {
    encoder.set_output_array(a);
    out.push_back(mx::array::unsafe_weak_copy(a));
  }
  const auto* work = dynamic_cast<const Runnable*>(prim.get());
  encoder.dispatch([prim = std::move(prim), work, in = std::move(in), out = std::move(out)]() mutable {
    work->run(in, out);
  });
}

// A one-output primitive's dispatch_run, its output allocated.
void dispatch(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  std::vector<mx::array> outputs{out};
  dispatch_run(inputs, outputs);
}

} // namespace

// ----------------------------------------------------------------------------
// norm_products
// ----------------------------------------------------------------------------

mx::array norm_products(const mx::array& x, const mx::array& norm, float eps,
                        const std::vector<QuantLayer>& layers,
                        const std::optional<mx::array>& q_norm,
                        const std::optional<mx::array>& k_norm, const HeadNorms& heads,
                        mx::StreamOrDevice s) {
  const char* op = "norm_products";
  auto stream = mx::to_stream(s);
  check_gpu(op, stream);
  check_x(op, x, "x");
  const int K = x.shape(-1);
  check_norm(op, norm, K, "norm");
  if (layers.empty()) {
    fail(op, "layers: expected at least one, found none");
  }
  std::vector<mx::array> inputs = {x, norm};
  std::vector<QuantFormat> formats;
  int N = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    N += check_layer(op, layers[i], K, "layers[" + std::to_string(i) + "]");
    push_layer(inputs, formats, layers[i]);
  }
  if (q_norm.has_value() != k_norm.has_value() || q_norm.has_value() != (heads.head_dim > 0)) {
    fail(op, "q_norm/k_norm: expected both with head_dim > 0 or neither, found " +
                 std::string(q_norm ? "q_norm " : "") + std::string(k_norm ? "k_norm " : "") +
                 "head_dim " + std::to_string(heads.head_dim));
  }
  if (q_norm) {
    check_norm(op, *q_norm, heads.head_dim, "q_norm");
    check_norm(op, *k_norm, heads.head_dim, "k_norm");
    if ((heads.n_q + heads.n_kv) * heads.head_dim > N || heads.n_q < 1 || heads.n_kv < 1) {
      fail(op, "heads: expected (n_q + n_kv) * head_dim <= " + std::to_string(N) + ", found (" +
                   std::to_string(heads.n_q) + " + " + std::to_string(heads.n_kv) + ") * " +
                   std::to_string(heads.head_dim));
    }
    inputs.insert(inputs.end(), {*q_norm, *k_norm});
  }
  auto shape = x.shape();
  shape.back() = N;
  return mx::array(shape, mx::float32,
                   std::make_shared<NormProducts>(stream, eps, std::move(formats), heads),
                   std::move(inputs));
}

std::vector<mx::Shape> NormProducts::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  int N = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    N += inputs[2 + 3 * i].shape(0);
  }
  shape.back() = N;
  return {shape};
}

void NormProducts::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer norm_products] has no GPU kernel");
}

void NormProducts::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  dispatch(inputs, out);
}

void NormProducts::run(std::vector<mx::array>& in, std::vector<mx::array>& outs) const {
  const float eps = eps_;
  const auto& layers = layers_;
  const auto& heads = heads_;
  auto& out = outs[0];
  const int K = in[0].shape(-1), M = static_cast<int>(in[0].size() / K);
  const int total = out.shape(-1);
  aligned_vector<float> h(in[0].size());
  to_f32(in[0], h.data());
  aligned_vector<float> wbuf;
  const float* w = f32_data(in[1], wbuf);
  for (int r = 0; r < M; ++r) {
    norm_row(h.data() + static_cast<size_t>(r) * K, K, w, eps, in[0].dtype());
  }
  float* y = out.data<float>();
  aligned_vector<float> part; // not zeroed: each product writes every output
  int col = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const int N = in[2 + 3 * i].shape(0);
    if (M == 1) {
      product(h.data(), 1, in, 2 + 3 * i, layers[i], y + col);
    } else {
      part.resize(static_cast<size_t>(M) * N);
      product(h.data(), M, in, 2 + 3 * i, layers[i], part.data());
      for (int r = 0; r < M; ++r) {
        std::copy_n(part.data() + static_cast<size_t>(r) * N, N,
                    y + static_cast<size_t>(r) * total + col);
      }
    }
    col += N;
  }
  if (heads.head_dim > 0) {
    const size_t at = 2 + 3 * layers.size();
    const auto qn = f32_of(in[at]), kn = f32_of(in[at + 1]);
    const int D = heads.head_dim;
    for (int r = 0; r < M; ++r) {
      float* row = y + static_cast<size_t>(r) * total;
      for (int j = 0; j < heads.n_q + heads.n_kv; ++j) {
        norm_row(row + static_cast<size_t>(j) * D, D,
                 (j < heads.n_q ? qn : kn).data(), heads.eps, mx::float32);
      }
    }
  }
}

// ----------------------------------------------------------------------------
// attention_output
// ----------------------------------------------------------------------------

mx::array attention_output(const mx::array& x, const mx::array& qkv, const mx::array& keys,
                           const mx::array& values, const mx::array& cos, const mx::array& sin,
                           const QuantLayer& o, const AttentionShape& a,
                           const std::optional<mx::array>& post_norm, float post_eps,
                           mx::StreamOrDevice s) {
  const char* op = "attention_output";
  auto stream = mx::to_stream(s);
  check_gpu(op, stream);
  check_x(op, x, "x");
  check_x(op, qkv, "qkv");
  const int H = x.shape(-1);
  if (x.size() != static_cast<size_t>(H) || qkv.size() != static_cast<size_t>(qkv.shape(-1))) {
    fail(op, "x/qkv: expected one token's row each, found " + shape_str(x.shape()) + " and " +
                 shape_str(qkv.shape()));
  }
  if (a.n_kv < 1 || a.n_q < 1 || a.n_q % a.n_kv != 0) {
    fail(op, "heads: expected n_q a multiple of n_kv >= 1, found n_q=" + std::to_string(a.n_q) +
                 ", n_kv=" + std::to_string(a.n_kv));
  }
  for (const auto* b : {&keys, &values}) {
    if (b->ndim() != 4 || b->shape(0) != 1 || b->shape(1) != a.n_kv || !is_float(b->dtype()) ||
        a.offset < 0 || a.offset >= b->shape(2) || b->shape(2) != keys.shape(2) ||
        b->dtype() != keys.dtype()) {
      fail(op, "keys/values: expected (1, " + std::to_string(a.n_kv) +
                   ", capacity > offset " + std::to_string(a.offset) +
                   ", head_dim) float buffers of one capacity and dtype, found " +
                   shape_str(keys.shape()) + " and " + shape_str(values.shape()));
    }
  }
  const int D = keys.shape(3), Dv = values.shape(3);
  if (qkv.shape(-1) < a.n_q * D) {
    fail(op, "qkv: expected at least n_q * head_dim = " + std::to_string(a.n_q * D) +
                 " values, found " + shape_str(qkv.shape()));
  }
  if (a.dims < 0 || a.dims % 2 != 0 || a.dims > D || cos.size() < static_cast<size_t>(a.dims / 2) ||
      sin.size() != cos.size() || !is_float(cos.dtype()) || !is_float(sin.dtype())) {
    fail(op, "rope: expected an even dims <= " + std::to_string(D) +
                 " and dims/2 float cos and sin, found dims=" + std::to_string(a.dims));
  }
  if (check_layer(op, o, a.n_q * Dv, "o") != H) {
    fail(op, "o w: expected " + std::to_string(H) + " output rows, found " +
                 shape_str(o.w.shape()));
  }
  std::vector<mx::array> inputs = {x, qkv, keys, values, cos, sin, o.w, o.scales, o.biases};
  if (post_norm) {
    check_norm(op, *post_norm, H, "post_norm");
    inputs.push_back(*post_norm);
  }
  return mx::array(
      x.shape(), mx::float32,
      std::make_shared<AttentionOutput>(stream, a, QuantFormat{o.group_size, o.bits},
                                        post_norm.has_value(), post_eps),
      std::move(inputs));
}

void AttentionOutput::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer attention_output] has no GPU kernel");
}

void AttentionOutput::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  dispatch(inputs, out);
}

void AttentionOutput::run(std::vector<mx::array>& in, std::vector<mx::array>& outs) const {
  const auto& a = a_;
  const auto& of = o_;
  const bool post = post_;
  const float post_eps = post_eps_;
  auto& out = outs[0];
  const auto &x = in[0], &qkv = in[1], &keys = in[2], &values = in[3];
  const int H = x.shape(-1), D = keys.shape(3), Dv = values.shape(3);
  // decode_attention's steps: q rotated and scaled in its dtype (float32 here).
  const auto row = f32_of(qkv);
  std::vector<float> qr(row.begin(), row.begin() + static_cast<size_t>(a.n_q) * D);
  if (a.dims > 0) {
    const auto c = f32_of(in[4]), s = f32_of(in[5]);
    rotate(qr.data(), a.n_q, D, a.dims, a.traditional, c.data(), s.data());
  }
  for (auto& v : qr) {
    v *= a.scale;
  }
  std::vector<float> y(static_cast<size_t>(a.n_q) * Dv);
  attend_decode(a, qr, keys, values, y);
  aligned_vector<float> ya(y.begin(), y.end());
  std::vector<float> o(H);
  product(ya.data(), 1, in, 6, of, o.data());
  if (post) {
    const auto w = f32_of(in[9]);
    norm_row(o.data(), H, w.data(), post_eps, mx::float32);
  }
  const auto xf = f32_of(x);
  float* dst = out.data<float>();
  for (int i = 0; i < H; ++i) {
    dst[i] = xf[i] + o[i];
  }
}

// ----------------------------------------------------------------------------
// pool_write, paged_attention_output: the batching engine's rows
// ----------------------------------------------------------------------------

namespace {

// The rows of a (B, 1, N) float32 array; N its last axis.
int rows_of(const mx::array& a) {
  return a.shape(-1) == 0 ? 0 : static_cast<int>(a.size() / a.shape(-1));
}

void check_rows_rope(const char* op, const mx::array& cos, const mx::array& sin, int B, int dims,
                     int D) {
  if (dims < 0 || dims % 2 != 0 || dims > D || !is_float(cos.dtype()) ||
      !is_float(sin.dtype()) ||
      (dims > 0 && (cos.size() != static_cast<size_t>(B) * (dims / 2) ||
                    sin.size() != cos.size()))) {
    fail(op, "rope: expected an even dims <= " + std::to_string(D) + " and (B=" +
                 std::to_string(B) + ", dims/2) float cos and sin, found dims=" +
                 std::to_string(dims) + ", " + shape_str(cos.shape()) + " and " +
                 shape_str(sin.shape()));
  }
}

template <typename C>
void write_pool_row(mx::array& out, size_t row, const float* v, int D) {
  C* dst = out.data<C>() + row * D;
  for (int i = 0; i < D; ++i) {
    dst[i] = static_cast<C>(v[i]);
  }
}

// The widths (D, Dv) of one layer's keys and values: one float pool a side, or with kv.bits set
// a quantized pool's [codes, scales, biases] a side; one-line errors naming `op`.
std::pair<int, int> pool_sides(const char* op, const std::vector<mx::array>& keys,
                               const std::vector<mx::array>& values, QuantFormat kv) {
  if (kv.bits == 0) {
    if (keys.size() != 1 || values.size() != 1) {
      fail(op, "keys/values: expected one float pool each, found " + std::to_string(keys.size()) +
                   " and " + std::to_string(values.size()) + " arrays");
    }
    check_pool(op, keys[0], values[0]);
    return {keys[0].shape(3), values[0].shape(3)};
  }
  check_quantized_format(op, kv.group_size, kv.bits);
  const int D = check_quantized_side(op, "keys", keys, kv.group_size, kv.bits);
  const int Dv = check_quantized_side(op, "values", values, kv.group_size, kv.bits);
  if (D % kv.group_size != 0 || Dv % kv.group_size != 0 ||
      values[0].shape(0) != keys[0].shape(0) || values[0].shape(1) != keys[0].shape(1) ||
      values[0].shape(2) != keys[0].shape(2)) {
    fail(op, "keys/values: expected one (n_blocks, n_kv, block) of whole groups, found " +
                 shape_str(keys[0].shape()) + " and " + shape_str(values[0].shape()));
  }
  return {D, Dv};
}

} // namespace

std::vector<mx::array> pool_write(const std::vector<mx::array>& keys,
                                  const std::vector<mx::array>& values, const mx::array& qkv,
                                  const mx::array& rows, const mx::array& cos,
                                  const mx::array& sin, int k_start, int v_start, int dims,
                                  bool traditional, QuantFormat kv, mx::StreamOrDevice s) {
  const char* op = "pool_write";
  auto stream = mx::to_stream(s);
  check_gpu(op, stream);
  const auto [D, Dv] = pool_sides(op, keys, values, kv);
  check_x(op, qkv, "qkv");
  const int n_kv = keys[0].shape(1), B = rows_of(qkv), N = qkv.shape(-1);
  for (const auto& [side, start, width] : {std::tuple{"k", k_start, D}, {"v", v_start, Dv}}) {
    if (start < 0 || start + n_kv * width > N) {
      fail(op, std::string(side) + "_start: expected " + std::to_string(n_kv) + " x " +
                   std::to_string(width) + " values a row of qkv from it, found " +
                   std::to_string(start) + " and " + shape_str(qkv.shape()));
    }
  }
  if (rows.dtype() != mx::uint32 || rows.size() != static_cast<size_t>(B) * n_kv) {
    fail(op, "rows: expected " + std::to_string(B * n_kv) + " uint32 flat rows, found " +
                 shape_str(rows.shape()));
  }
  check_rows_rope(op, cos, sin, B, dims, D);
  std::vector<mx::array> inputs = keys;
  inputs.insert(inputs.end(), values.begin(), values.end());
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (const auto& a : inputs) {
    shapes.push_back(a.shape());
    dtypes.push_back(a.dtype());
  }
  inputs.insert(inputs.end(), {qkv, rows, cos, sin});
  return mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<PoolWrite>(stream, PoolRope{k_start, dims, traditional}, v_start, kv),
      inputs);
}

namespace {

// Output j takes the buffer of input donors[j] (an array it updates) where nothing else holds
// that, else a fresh one (the work fills it from the input first, and counts the copy:
// attention_buffer_copies); an output without a donor is allocated. MLX gives each output of a primitive its own
// list of the inputs, so where there are several no input is donatable by MLX's count (an
// earlier attempt copied the cache every step): the other outputs' lists are dropped first, as
// MLX's detach() does right after this evaluation.
void take_buffers(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                  const std::vector<int>& donors) {
  const bool traced = std::any_of(outputs.begin(), outputs.end(),
                                  [](const mx::array& o) { return o.is_tracer(); });
  if (!traced) {
    for (auto& o : outputs) {
      if (&o.inputs() != &inputs) {
        o.inputs().clear();
      }
    }
  }
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (donors[j] >= 0) {
      take_buffer(inputs[donors[j]], outputs[j], /*count=*/false);
    } else {
      outputs[j].set_data(mx::allocator::malloc(outputs[j].nbytes()));
    }
  }
}

// One row's values written at `row` of a float pool.
void write_float_row(mx::array& out, size_t row, const float* v, int D) {
  switch (out.dtype()) {
    case mx::float32:
      return write_pool_row<float>(out, row, v, D);
    case mx::float16:
      return write_pool_row<mx::float16_t>(out, row, v, D);
    case mx::bfloat16:
      return write_pool_row<mx::bfloat16_t>(out, row, v, D);
    default:
      return; // the op accepts float pools only
  }
}

} // namespace

void PoolWrite::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  std::vector<int> donors(outputs.size());
  std::iota(donors.begin(), donors.end(), 0);
  take_buffers(inputs, outputs, donors);
  dispatch_run(inputs, outputs);
}

void PoolWrite::run(std::vector<mx::array>& in, std::vector<mx::array>& outs) const {
  const auto& r = r_;
  const int v_start = v_start_;
  const auto& kv = kv_;
  const size_t n = outs.size();
  for (size_t i = 0; i < n; ++i) {
    if (outs[i].data<char>() != in[i].data<char>()) { // not updated in place: a copy first
      copy_elements(in[i], outs[i].data<char>());
      note_buffer_copy();
    }
  }
  const auto &qkv = in[n], &rows = in[n + 1], &cos = in[n + 2], &sin = in[n + 3];
  const size_t parts = outs.size() / 2; // a side's arrays: 1 float pool, or 3
  const int n_kv = outs[0].shape(1), N = qkv.shape(-1), B = rows_of(qkv);
  const size_t n_rows = static_cast<size_t>(outs[0].shape(0)) * n_kv * outs[0].shape(2);
  aligned_vector<float> xbuf;
  const float* x = f32_data(qkv, xbuf);
  std::vector<uint32_t> where(rows.size());
  std::vector<char> rcopy;
  std::memcpy(where.data(), contiguous_bytes(rows, rcopy), rows.nbytes());
  aligned_vector<float> c, sn;
  if (r.dims > 0) {
    c = f32_of(cos);
    sn = f32_of(sin);
  }
  const int half = r.dims / 2;
  for (size_t side = 0; side < 2; ++side) {
    mx::array* out = outs.data() + side * parts;
    const int D = kv.bits == 0 ? out[0].shape(3) : out[0].shape(3) * 32 / kv.bits;
    const int start = side == 0 ? r.start : v_start;
    const int groups = kv.bits == 0 ? 0 : D / kv.group_size;
    std::vector<float> v(D), scales(groups), biases(groups);
    std::vector<uint32_t> codes(kv.bits == 0 ? 0 : static_cast<size_t>(D) * kv.bits / 32);
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < n_kv; ++h) {
        const size_t row = where[static_cast<size_t>(b) * n_kv + h];
        if (row >= n_rows) {
          continue; // outside the pool: nothing written (the engine never asks it)
        }
        std::copy_n(x + static_cast<size_t>(b) * N + start + h * D, D, v.data());
        if (side == 0 && r.dims > 0) {
          rotate(v.data(), 1, D, r.dims, r.traditional, c.data() + b * half,
                 sn.data() + b * half);
        }
        if (kv.bits == 0) {
          write_float_row(out[0], row, v.data(), D);
          continue;
        }
        // quantized as mx.quantize does, into the codes, scales and biases
        quantize_row(v.data(), D, kv.group_size, kv.bits, codes.data(), scales.data(),
                     biases.data());
        std::copy_n(codes.data(), codes.size(), out[0].data<uint32_t>() + row * codes.size());
        std::copy_n(scales.data(), groups, out[1].data<float>() + row * groups);
        std::copy_n(biases.data(), groups, out[2].data<float>() + row * groups);
      }
    }
  }
}

void PoolWrite::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxinfer pool_write] has no GPU kernel");
}

mx::array paged_attention_output(const mx::array& x, const mx::array& qkv,
                                 const std::vector<mx::array>& keys,
                                 const std::vector<mx::array>& values, const mx::array& blocks,
                                 const mx::array& visible, const mx::array& cos,
                                 const mx::array& sin, const QuantLayer& o, int n_q, float scale,
                                 int dims, bool traditional,
                                 const std::optional<mx::array>& post_norm, float post_eps,
                                 QuantFormat kv, mx::StreamOrDevice s) {
  const char* op = "paged_attention_output";
  auto stream = mx::to_stream(s);
  check_gpu(op, stream);
  check_x(op, x, "x");
  check_x(op, qkv, "qkv");
  const int B = rows_of(x), H = x.shape(-1);
  if (rows_of(qkv) != B) {
    fail(op, "qkv: expected " + std::to_string(B) + " rows as x, found " +
                 shape_str(qkv.shape()));
  }
  const auto [D, Dv] = pool_sides(op, keys, values, kv);
  const int n_kv = keys[0].shape(1), block = keys[0].shape(2);
  if (n_q < 1 || n_q % n_kv != 0 || qkv.shape(-1) < n_q * D) {
    fail(op, "n_q: expected a multiple of n_kv " + std::to_string(n_kv) +
                 " whose heads qkv holds, found " + std::to_string(n_q) + " and " +
                 shape_str(qkv.shape()));
  }
  check_pages(op, blocks, visible, B, n_kv, block);
  check_rows_rope(op, cos, sin, B, dims, D);
  if (check_layer(op, o, n_q * Dv, "o") != H) {
    fail(op, "o w: expected " + std::to_string(H) + " output rows, found " +
                 shape_str(o.w.shape()));
  }
  std::vector<mx::array> inputs = {x,   qkv, keys[0], values[0], blocks, visible,
                                   cos, sin, o.w,     o.scales,  o.biases};
  if (post_norm) {
    check_norm(op, *post_norm, H, "post_norm");
    inputs.push_back(*post_norm);
  }
  if (kv.bits != 0) { // the scales and biases last
    inputs.insert(inputs.end(), {keys[1], keys[2], values[1], values[2]});
  }
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<PagedAttentionOutput>(
                       stream, n_q, scale, PoolRope{0, dims, traditional},
                       QuantFormat{o.group_size, o.bits}, post_norm.has_value(), post_eps, kv),
                   std::move(inputs));
}

void PagedAttentionOutput::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer paged_attention_output] has no GPU kernel");
}

void PagedAttentionOutput::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  dispatch(inputs, out);
}

void PagedAttentionOutput::run(std::vector<mx::array>& in, std::vector<mx::array>& outs) const {
  const int n_q = n_q_;
  const float scale = scale_;
  const auto& r = r_;
  const auto& of = o_;
  const bool post = post_;
  const float post_eps = post_eps_;
  const auto& kv = kv_;
  auto& out = outs[0];
  const auto &x = in[0], &qkv = in[1], &keys = in[2], &values = in[3];
  const int B = rows_of(x), H = x.shape(-1), N = qkv.shape(-1);
  const int unpack = kv.bits == 0 ? 1 : 32 / kv.bits; // values a word
  const int D = keys.shape(3) * unpack, Dv = values.shape(3) * unpack;
  const int half = r.dims / 2;
  aligned_vector<float> rowbuf;
  const float* row = f32_data(qkv, rowbuf);
  std::vector<float> qf(static_cast<size_t>(B) * n_q * D);
  for (int b = 0; b < B; ++b) {
    std::copy_n(row + static_cast<size_t>(b) * N, n_q * D,
                qf.data() + static_cast<size_t>(b) * n_q * D);
  }
  if (r.dims > 0) {
    const auto c = f32_of(in[6]), s = f32_of(in[7]);
    for (int b = 0; b < B; ++b) {
      rotate(qf.data() + static_cast<size_t>(b) * n_q * D, n_q, D, r.dims,
             r.traditional, c.data() + b * half, s.data() + b * half);
    }
  }
  for (auto& v : qf) {
    v *= scale;
  }
  std::vector<float> y(static_cast<size_t>(B) * n_q * Dv);
  if (kv.bits == 0) {
    paged_attend(qf, B, n_q, keys, values, in[4], in[5], y);
  } else {
    const size_t at = in.size() - 4; // the scales and biases
    paged_attend_quantized(qf, B, n_q, {keys, in[at], in[at + 1]},
                           {values, in[at + 2], in[at + 3]}, in[4], in[5],
                           kv.group_size, kv.bits, y);
  }
  aligned_vector<float> ya(y.begin(), y.end());
  aligned_vector<float> o(static_cast<size_t>(B) * H); // not zeroed: the product writes it all
  product(ya.data(), B, in, 8, of, o.data());
  if (post) {
    const auto w = f32_of(in[11]);
    for (int b = 0; b < B; ++b) {
      norm_row(o.data() + static_cast<size_t>(b) * H, H, w.data(), post_eps,
               mx::float32);
    }
  }
  aligned_vector<float> xbuf;
  const float* xf = f32_data(x, xbuf);
  float* dst = out.data<float>();
  for (size_t i = 0; i < o.size(); ++i) {
    dst[i] = xf[i] + o[i];
  }
}

// ----------------------------------------------------------------------------
// mlp_output
// ----------------------------------------------------------------------------

mx::array mlp_output(const mx::array& h, const mx::array& norm, float eps,
                     const std::vector<QuantLayer>& gate_up, const QuantLayer& down, int act,
                     const std::optional<mx::array>& post_norm, float post_eps,
                     mx::StreamOrDevice s) {
  const char* op = "mlp_output";
  auto stream = mx::to_stream(s);
  check_gpu(op, stream);
  check_x(op, h, "h");
  const int K = h.shape(-1);
  check_norm(op, norm, K, "norm");
  if (gate_up.size() != 1 && gate_up.size() != 2) {
    fail(op, "gate_up: expected gate and up as one stacked layer or two, found " +
                 std::to_string(gate_up.size()));
  }
  if (act != 0 && act != 1) {
    fail(op, "act: expected 0 (silu) or 1 (GELU, tanh form), found " + std::to_string(act));
  }
  std::vector<mx::array> inputs = {h, norm};
  std::vector<QuantFormat> formats;
  int N = 0;
  for (size_t i = 0; i < gate_up.size(); ++i) {
    const int n = check_layer(op, gate_up[i], K, "gate_up[" + std::to_string(i) + "]");
    if (gate_up.size() == 2 && i == 1 && n != N) {
      fail(op, "gate_up: expected gate and up of one width, found " + std::to_string(N) +
                   " and " + std::to_string(n));
    }
    N += n;
    push_layer(inputs, formats, gate_up[i]);
  }
  if (N % 2 != 0) {
    fail(op, "gate_up: expected an even number of stacked rows, found " + std::to_string(N));
  }
  if (check_layer(op, down, N / 2, "down") != K) {
    fail(op, "down w: expected " + std::to_string(K) + " output rows, found " +
                 shape_str(down.w.shape()));
  }
  inputs.insert(inputs.end(), {down.w, down.scales, down.biases});
  if (post_norm) {
    check_norm(op, *post_norm, K, "post_norm");
    inputs.push_back(*post_norm);
  }
  return mx::array(h.shape(), mx::float32,
                   std::make_shared<MlpOutput>(stream, eps, std::move(formats),
                                               QuantFormat{down.group_size, down.bits}, act,
                                               post_norm.has_value(), post_eps),
                   std::move(inputs));
}

void MlpOutput::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer mlp_output] has no GPU kernel");
}

void MlpOutput::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  dispatch(inputs, out);
}

void MlpOutput::run(std::vector<mx::array>& in, std::vector<mx::array>& outs) const {
  const float eps = eps_;
  const auto& gate_up = gate_up_;
  const auto& down = down_;
  const int act = act_;
  const bool post = post_;
  const float post_eps = post_eps_;
  auto& out = outs[0];
  const int K = in[0].shape(-1), M = static_cast<int>(in[0].size() / K);
  aligned_vector<float> h(in[0].size());
  to_f32(in[0], h.data());
  aligned_vector<float> wbuf;
  const float* w = f32_data(in[1], wbuf);
  for (int r = 0; r < M; ++r) {
    norm_row(h.data() + static_cast<size_t>(r) * K, K, w, eps, in[0].dtype());
  }
  int N = 0;
  for (size_t i = 0; i < gate_up.size(); ++i) {
    N += in[2 + 3 * i].shape(0);
  }
  const int I = N / 2;
  // gate | up of each row; two layers: gate's rows, then up's (the buffers not zeroed: each
  // product writes every output)
  aligned_vector<float> gu(static_cast<size_t>(M) * N);
  if (gate_up.size() == 1) {
    product(h.data(), M, in, 2, gate_up[0], gu.data());
  } else {
    aligned_vector<float> g(static_cast<size_t>(M) * I), u(g.size());
    product(h.data(), M, in, 2, gate_up[0], g.data());
    product(h.data(), M, in, 5, gate_up[1], u.data());
    for (int r = 0; r < M; ++r) {
      std::copy_n(g.data() + static_cast<size_t>(r) * I, I,
                  gu.data() + static_cast<size_t>(r) * N);
      std::copy_n(u.data() + static_cast<size_t>(r) * I, I,
                  gu.data() + static_cast<size_t>(r) * N + I);
    }
  }
  aligned_vector<float> m(static_cast<size_t>(M) * I);
  for (int r = 0; r < M; ++r) {
    const float* row = gu.data() + static_cast<size_t>(r) * N;
    gated_span(act, row, row + I, m.data() + static_cast<size_t>(r) * I, I);
  }
  const size_t at = 2 + 3 * gate_up.size();
  aligned_vector<float> d(static_cast<size_t>(M) * K);
  product(m.data(), M, in, at, down, d.data());
  if (post) {
    const auto pw = f32_of(in[at + 3]);
    for (int r = 0; r < M; ++r) {
      norm_row(d.data() + static_cast<size_t>(r) * K, K, pw.data(), post_eps,
               mx::float32);
    }
  }
  aligned_vector<float> hbuf;
  const float* hf = f32_data(in[0], hbuf);
  float* dst = out.data<float>();
  for (size_t i = 0; i < d.size(); ++i) {
    dst[i] = hf[i] + d[i];
  }
}

// ----------------------------------------------------------------------------
// fuse: several of the primitives above as one node of MLX's graph
// ----------------------------------------------------------------------------

namespace {

// The work of `a`'s primitive where fuse may take it in: a block primitive's, not a fused node
// (its outputs, a cache's buffers among them, would become temporaries).
const Runnable* runnable(const mx::array& a) {
  if (!a.has_primitive() || dynamic_cast<const Fused*>(&a.primitive()) != nullptr) {
    return nullptr;
  }
  return dynamic_cast<const Runnable*>(&a.primitive());
}

constexpr size_t kMaxFusedCalls = 16;

} // namespace

std::vector<mx::array> fuse(const std::vector<mx::array>& outputs) {
  const char* op = "fuse";
  if (outputs.empty()) {
    fail(op, "outputs: expected at least one array, found none");
  }
  // The calls that make the outputs, each before those that read it: a walk back through
  // arrays made by the primitives above, stopping at any other array (an input).
  // (A block's graph is small: linear searches, no hash tables; this runs every layer.)
  std::vector<mx::array> order; // one output of each call
  std::vector<const mx::Primitive*> seen;
  auto was_seen = [&](const mx::array& a) {
    return std::find(seen.begin(), seen.end(), &a.primitive()) != seen.end();
  };
  std::vector<std::pair<mx::array, bool>> stack;
  for (const auto& a : outputs) {
    if (runnable(a) == nullptr) {
      fail(op, "outputs: expected arrays made by the block primitives, found one made by " +
                   std::string(a.has_primitive() ? a.primitive().name() : "no primitive"));
    }
    stack.emplace_back(a, false);
  }
  while (!stack.empty()) {
    auto [a, expanded] = stack.back();
    stack.pop_back();
    if (expanded) {
      order.push_back(a);
      continue;
    }
    if (runnable(a) == nullptr || was_seen(a)) {
      continue;
    }
    seen.push_back(&a.primitive());
    if (seen.size() > kMaxFusedCalls) {
      fail(op, "outputs: expected the graph of at most " + std::to_string(kMaxFusedCalls) +
                   " calls, found more");
    }
    stack.emplace_back(a, true);
    for (const auto& in : a.inputs()) {
      if (runnable(in) != nullptr && !was_seen(in)) {
        stack.emplace_back(in, false);
      }
    }
  }
  std::vector<std::pair<std::uintptr_t, FusedSource>> made; // an array a call makes: where
  std::vector<std::uintptr_t> input_ids;                     // the inputs' ids, in order
  std::vector<mx::array> inputs;
  std::vector<FusedCall> calls;
  std::vector<mx::Shape> temp_shapes;
  std::vector<mx::Dtype> temp_dtypes;
  for (const auto& a : order) {
    FusedCall call{a.primitive_ptr(), {}, {}};
    for (const auto& in : a.inputs()) {
      const auto id = in.id();
      auto m = std::find_if(made.begin(), made.end(), [&](const auto& e) { return e.first == id; });
      if (m != made.end()) {
        call.in.push_back(m->second);
        continue;
      }
      const auto at = std::find(input_ids.begin(), input_ids.end(), id) - input_ids.begin();
      if (at == static_cast<std::ptrdiff_t>(inputs.size())) {
        inputs.push_back(in);
        input_ids.push_back(id);
      }
      call.in.push_back({FusedSource::kInput, static_cast<int>(at)});
    }
    for (const auto& o : a.outputs()) {
      const auto id = o.id();
      auto w = std::find_if(outputs.begin(), outputs.end(),
                            [&](const mx::array& x) { return x.id() == id; });
      FusedSource to{FusedSource::kOutput, static_cast<int>(w - outputs.begin())};
      if (w == outputs.end()) {
        to = {FusedSource::kTemp, static_cast<int>(temp_shapes.size())};
        temp_shapes.push_back(o.shape());
        temp_dtypes.push_back(o.dtype());
      }
      made.emplace_back(id, to);
      call.out.push_back(to);
    }
    calls.push_back(std::move(call));
  }
  // An output that updates an input in place takes its buffer; no other call may read that
  // input (it would read it written).
  std::vector<int> reads(inputs.size()); // an input's place: how many calls' arguments it is
  for (const auto& call : calls) {
    for (const auto& src : call.in) {
      if (src.kind == FusedSource::kInput) {
        reads[src.index] += 1;
      }
    }
  }
  std::vector<int> donors(outputs.size(), -1);
  for (const auto& call : calls) {
    const auto* work = dynamic_cast<const Runnable*>(call.primitive.get());
    for (size_t i = 0; i < call.out.size(); ++i) {
      const int from = work->updates(static_cast<int>(i));
      if (from < 0 || call.in[from].kind != FusedSource::kInput) {
        continue; // nothing updated, or a temporary: filled from it in a fresh buffer
      }
      if (reads[call.in[from].index] != 1) {
        fail(op, "outputs: expected each array a call updates read by that call only, found "
                 "one read by another");
      }
      if (call.out[i].kind == FusedSource::kOutput) {
        donors[call.out[i].index] = call.in[from].index;
      }
    }
  }
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (const auto& a : outputs) {
    shapes.push_back(a.shape());
    dtypes.push_back(a.dtype());
  }
  auto stream = outputs[0].primitive().stream();
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<Fused>(stream, std::move(calls),
                                                        std::move(temp_shapes),
                                                        std::move(temp_dtypes), donors),
                                inputs);
}

void Fused::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  take_buffers(inputs, outputs, donors_);
  dispatch_run(inputs, outputs);
}

void Fused::run(std::vector<mx::array>& in, std::vector<mx::array>& out) const {
  std::vector<mx::array> temps;
  for (size_t t = 0; t < temp_shapes_.size(); ++t) {
    temps.emplace_back(temp_shapes_[t], temp_dtypes_[t], nullptr, std::vector<mx::array>{});
    temps.back().set_data(mx::allocator::malloc(temps.back().nbytes()));
  }
  auto pick = [&](const FusedSource& src) -> mx::array& {
    switch (src.kind) {
      case FusedSource::kInput:
        return in[src.index];
      case FusedSource::kTemp:
        return temps[src.index];
      default:
        return out[src.index];
    }
  };
  for (const auto& call : calls_) {
    std::vector<mx::array> call_in, call_out;
    for (const auto& src : call.in) {
      call_in.push_back(pick(src));
    }
    for (const auto& src : call.out) {
      call_out.push_back(pick(src));
    }
    dynamic_cast<const Runnable&>(*call.primitive).run(call_in, call_out);
  }
}

void Fused::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxinfer fuse] has no GPU kernel");
}

} // namespace mlxinfer
