#include "fused.h"

#include <atomic>
#include <cmath>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"

#include "kernels.h"
#include "threadpool.h"
#include "util.h"

namespace mlxinfer {

namespace {

std::atomic<int64_t> buffer_copies{0};

// Rounds each value to `dtype` and back (what storing it in an array of that dtype does).
void round_to(mx::Dtype dtype, float* x, size_t n) {
  if (dtype == mx::float16) {
    for (size_t i = 0; i < n; ++i) {
      x[i] = static_cast<float>(static_cast<mx::float16_t>(x[i]));
    }
  } else if (dtype == mx::bfloat16) {
    for (size_t i = 0; i < n; ++i) {
      x[i] = static_cast<float>(static_cast<mx::bfloat16_t>(x[i]));
    }
  }
}

// `a`'s elements, row-major, into dst (same dtype): a strided view is gathered.
void copy_elements(const mx::array& a, char* dst) {
  const size_t item = a.itemsize();
  const char* src = a.data<char>();
  if (a.flags().row_contiguous) {
    std::memcpy(dst, src, a.nbytes());
    return;
  }
  const int nd = a.ndim();
  std::vector<int> idx(nd, 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) {
      off += static_cast<int64_t>(idx[d]) * a.strides()[d];
    }
    std::memcpy(dst + i * item, src + off * item, item);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) {
        break;
      }
      idx[d] = 0;
    }
  }
}

// `a`'s bytes, row-major: its own where contiguous, else gathered into `copy`.
const char* contiguous_bytes(const mx::array& a, std::vector<char>& copy) {
  if (a.flags().row_contiguous) {
    return a.data<char>();
  }
  copy.resize(a.nbytes());
  copy_elements(a, copy.data());
  return copy.data();
}

// RoPE on `heads` rows of `d` features: the first `dims` rotated by the (dims/2) table.
void rotate(float* x, int heads, int d, int dims, bool traditional, const float* c,
            const float* s) {
  const int half = dims / 2;
  for (int h = 0; h < heads; ++h) {
    float* r = x + static_cast<size_t>(h) * d;
    for (int i = 0; i < half; ++i) {
      const int ia = traditional ? 2 * i : i;
      const int ib = traditional ? 2 * i + 1 : i + half;
      const float a = r[ia], b = r[ib];
      r[ia] = a * c[i] - b * s[i];
      r[ib] = b * c[i] + a * s[i];
    }
  }
}

#define MLXINFER_INLINE inline __attribute__((always_inline))

template <typename C>
MLXINFER_INLINE float dot(const float* q, const C* k, int d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int l = 0; l < 8; ++l) {
      acc[l] += q[i + l] * static_cast<float>(k[i + l]);
    }
  }
  float total = 0;
  for (; i < d; ++i) {
    total += q[i] * static_cast<float>(k[i]);
  }
  for (int l = 0; l < 8; ++l) {
    total += acc[l];
  }
  return total;
}

// Four keys' dot products with q at once: four independent accumulator chains, q's loads
// shared (one key at a time is bound by the latency of its one chain).
template <typename C>
MLXINFER_INLINE void dot4(const float* q, const C* k, size_t stride, int d, float* out) {
  float acc[4][8] = {};
  int i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int r = 0; r < 4; ++r) {
      for (int l = 0; l < 8; ++l) {
        acc[r][l] += q[i + l] * static_cast<float>(k[r * stride + i + l]);
      }
    }
  }
  for (int r = 0; r < 4; ++r) {
    float total = 0;
    for (int j = i; j < d; ++j) {
      total += q[j] * static_cast<float>(k[r * stride + j]);
    }
    for (int l = 0; l < 8; ++l) {
      total += acc[r][l];
    }
    out[r] = total;
  }
}

// exp(x) for x <= 0 (a softmax's shifted logits): 2^n e^r with n = round(x / ln 2), a
// degree-6 polynomial for e^r (relative error ~1.5e-7, as ops.exp); vectorisable, unlike
// std::exp. Below -87.3 it is 0.
MLXINFER_INLINE float exp_neg(float x) {
  x = std::max(x, -87.3f);
  const float n = std::nearbyint(x * 1.4426950408889634f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 0.0013836845755577087f;
  p = p * r + 0.008374815806746483f;
  p = p * r + 0.04166822507977486f;
  p = p * r + 0.16666419804096222f;
  p = p * r + 0.49999991059303284f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One query head over T cached tokens: y (Dv) = softmax(q . K[t]) V (q already scaled).
template <typename C>
MLXINFER_INLINE void attend_head_impl(const float* q, const C* K, const C* V, int T, int D,
                                      int Dv, bool round_probs, float* scores, float* y) {
  int t = 0;
  for (; t + 4 <= T; t += 4) {
    dot4(q, K + static_cast<size_t>(t) * D, D, D, scores + t);
  }
  for (; t < T; ++t) {
    scores[t] = dot(q, K + static_cast<size_t>(t) * D, D);
  }
  float top = -INFINITY;
  for (t = 0; t < T; ++t) {
    top = std::max(top, scores[t]);
  }
  float total = 0;
  for (t = 0; t < T; ++t) {
    scores[t] = exp_neg(scores[t] - top);
    total += scores[t];
  }
  const float inv = 1.0f / total;
  for (t = 0; t < T; ++t) {
    float p = scores[t] * inv;
    scores[t] = round_probs ? static_cast<float>(static_cast<C>(p)) : p;
  }
  std::fill(y, y + Dv, 0.0f);
  t = 0;
  for (; t + 4 <= T; t += 4) { // four keys' values per pass over y
    const C* v0 = V + static_cast<size_t>(t) * Dv;
    const float p0 = scores[t], p1 = scores[t + 1], p2 = scores[t + 2], p3 = scores[t + 3];
    for (int i = 0; i < Dv; ++i) {
      y[i] += p0 * static_cast<float>(v0[i]) + p1 * static_cast<float>(v0[Dv + i]) +
          p2 * static_cast<float>(v0[2 * Dv + i]) + p3 * static_cast<float>(v0[3 * Dv + i]);
    }
  }
  for (; t < T; ++t) {
    const C* vr = V + static_cast<size_t>(t) * Dv;
    for (int i = 0; i < Dv; ++i) {
      y[i] += scores[t] * static_cast<float>(vr[i]);
    }
  }
}

// The loops above compiled for AVX2+FMA (auto-vectorised: the module's baseline is plain
// x86-64), chosen at run time as the products' kernels are.
#if defined(__x86_64__)
template <typename C>
__attribute__((target("avx2,fma"))) void attend_head_avx2(const float* q, const C* K, const C* V,
                                                          int T, int D, int Dv, bool round_probs,
                                                          float* scores, float* y) {
  attend_head_impl<C>(q, K, V, T, D, Dv, round_probs, scores, y);
}
#endif

template <typename C>
void attend_head(const float* q, const C* K, const C* V, int T, int D, int Dv, bool round_probs,
                 float* scores, float* y) {
#if defined(__x86_64__)
  if (current_isa() >= kAvx2) {
    return attend_head_avx2<C>(q, K, V, T, D, Dv, round_probs, scores, y);
  }
#endif
  attend_head_impl<C>(q, K, V, T, D, Dv, round_probs, scores, y);
}

template <typename C>
void write_rows(const AttentionShape& a, const float* rows, mx::array& buffer) {
  const int D = buffer.shape(3), cap = buffer.shape(2);
  C* B = buffer.data<C>();
  for (int h = 0; h < a.n_kv; ++h) {
    C* r = B + (static_cast<size_t>(h) * cap + a.offset) * D;
    for (int i = 0; i < D; ++i) {
      r[i] = static_cast<C>(rows[static_cast<size_t>(h) * D + i]);
    }
  }
}

template <typename C>
void attend_cpu(const AttentionShape& a, std::vector<float>& q, const C* K, const C* V, int cap,
                int D, int Dv, bool round_probs, std::vector<float>& y) {
  const int T = a.offset + 1, reps = a.n_q / a.n_kv;
  auto head = [&](int j, std::vector<float>& scores) {
    const int h = j / reps;
    attend_head<C>(q.data() + static_cast<size_t>(j) * D, K + static_cast<size_t>(h) * cap * D,
                   V + static_cast<size_t>(h) * cap * Dv, T, D, Dv, round_probs, scores.data(),
                   y.data() + static_cast<size_t>(j) * Dv);
  };
  auto& pool = ThreadPool::instance();
  const int64_t work = static_cast<int64_t>(T) * a.n_q * (D + Dv);
  if (pool.size() <= 1 || work < (1 << 17)) {
    std::vector<float> scores(T);
    for (int j = 0; j < a.n_q; ++j) {
      head(j, scores);
    }
    return;
  }
  pool.run(a.n_q, [&](int j) {
    std::vector<float> scores(T);
    head(j, scores);
  });
}

void check_float(const mx::array& a, const char* name) {
  if (!is_float(a.dtype())) {
    throw std::invalid_argument(std::string("[mlxinfer decode_attention] ") + name +
                                ": expected a float16/bfloat16/float32 array");
  }
}

} // namespace

int64_t attention_buffer_copies() {
  return buffer_copies.load();
}

// ----------------------------------------------------------------------------
// RMSNorm
// ----------------------------------------------------------------------------

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (x.ndim() < 1 || !is_float(x.dtype())) {
    throw std::invalid_argument("[mlxinfer rms_norm] x: expected a float array, found shape " +
                                shape_str(x.shape()));
  }
  if (w.ndim() != 1 || w.shape(0) != x.shape(-1) || !is_float(w.dtype())) {
    throw std::invalid_argument("[mlxinfer rms_norm] w: expected a float array of shape (" +
                                std::to_string(x.shape(-1)) + ",), found " +
                                shape_str(w.shape()));
  }
  if (stream.device == mx::Device::gpu) {
    return mx::fast::rms_norm(x, w, eps, stream);
  }
  return mx::array(x.shape(), mx::promote_types(x.dtype(), w.dtype()),
                   std::make_shared<RMSNorm>(stream, eps), {x, w});
}

void RMSNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer rms_norm] has no GPU kernel (the op hands GPU streams "
                           "to mx.fast.rms_norm)");
}

void RMSNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                    w = mx::array::unsafe_weak_copy(inputs[1]),
                    out = mx::array::unsafe_weak_copy(out), eps = eps_]() mutable {
    const int K = x.shape(-1);
    const size_t rows = K == 0 ? 0 : x.size() / K;
    std::vector<float> xf(x.size()), wf(K);
    to_f32(x, xf.data());
    to_f32(w, wf.data());
    for (size_t r = 0; r < rows; ++r) {
      float* row = xf.data() + r * K;
      float ss = 0;
      for (int i = 0; i < K; ++i) {
        ss += row[i] * row[i];
      }
      const float scale = 1.0f / std::sqrt(ss / K + eps);
      for (int i = 0; i < K; ++i) {
        row[i] *= scale;
      }
    }
    round_to(x.dtype(), xf.data(), xf.size()); // normalised in x's dtype, then times w
    for (size_t r = 0; r < rows; ++r) {
      float* row = xf.data() + r * K;
      for (int i = 0; i < K; ++i) {
        row[i] *= wf[i];
      }
    }
    write_out(xf.data(), out);
  });
}

// ----------------------------------------------------------------------------
// Decode attention: the cache write, and the attention
// ----------------------------------------------------------------------------

namespace {

[[noreturn]] void fail(const char* op, const std::string& m) {
  throw std::invalid_argument(std::string("[mlxinfer ") + op + "] " + m);
}

void check_rope(const char* op, const mx::array& cos, const mx::array& sin, int dims, int D) {
  check_float(cos, "cos");
  check_float(sin, "sin");
  if (dims < 0 || dims % 2 != 0 || dims > D || cos.size() < static_cast<size_t>(dims / 2) ||
      sin.size() != cos.size()) {
    fail(op, "rope: expected an even dims <= " + std::to_string(D) +
                 " and dims/2 cos and sin, found dims=" + std::to_string(dims) + ", " +
                 std::to_string(cos.size()) + " and " + std::to_string(sin.size()));
  }
}

void check_buffer(const char* op, const mx::array& buffer, int n_kv, int offset, const char* name) {
  if (buffer.ndim() != 4 || buffer.shape(0) != 1 || buffer.shape(1) != n_kv) {
    fail(op, std::string(name) + ": expected a (1, " + std::to_string(n_kv) +
                 ", capacity, head_dim) buffer, found " + shape_str(buffer.shape()));
  }
  check_float(buffer, name);
  if (offset < 0 || offset >= buffer.shape(2)) {
    fail(op, "offset: expected 0 <= offset < capacity " + std::to_string(buffer.shape(2)) +
                 ", found " + std::to_string(offset));
  }
}

// x (1, heads, 1, D) -> its first dims features rotated by the table, in x's dtype.
mx::array rope_reference(const mx::array& x, const mx::array& c, const mx::array& s,
                         const AttentionShape& a, mx::Stream st) {
  const int D = x.shape(3), half = a.dims / 2, h = x.shape(1);
  if (a.dims == 0) {
    return x;
  }
  auto xf = mx::astype(x, mx::float32, st);
  auto cf = mx::reshape(mx::slice(mx::flatten(mx::astype(c, mx::float32, st), st), {0}, {half}, st),
                        {half}, st);
  auto sf = mx::reshape(mx::slice(mx::flatten(mx::astype(s, mx::float32, st), st), {0}, {half}, st),
                        {half}, st);
  auto rot_pair = [&](const mx::array& p0, const mx::array& p1) {
    return std::vector<mx::array>{
        mx::subtract(mx::multiply(p0, cf, st), mx::multiply(p1, sf, st), st),
        mx::add(mx::multiply(p1, cf, st), mx::multiply(p0, sf, st), st)};
  };
  mx::array rot = xf;
  if (!a.traditional) {
    auto r = rot_pair(mx::slice(xf, {0, 0, 0, 0}, {1, h, 1, half}, st),
                      mx::slice(xf, {0, 0, 0, half}, {1, h, 1, a.dims}, st));
    rot = mx::concatenate(r, -1, st);
  } else {
    auto pairs = mx::reshape(mx::slice(xf, {0, 0, 0, 0}, {1, h, 1, a.dims}, st),
                             {1, h, 1, half, 2}, st);
    auto r = rot_pair(mx::squeeze(mx::slice(pairs, {0, 0, 0, 0, 0}, {1, h, 1, half, 1}, st), -1, st),
                      mx::squeeze(mx::slice(pairs, {0, 0, 0, 0, 1}, {1, h, 1, half, 2}, st), -1, st));
    rot = mx::reshape(mx::stack(r, -1, st), {1, h, 1, a.dims}, st);
  }
  if (a.dims < D) {
    rot = mx::concatenate({rot, mx::slice(xf, {0, 0, 0, a.dims}, {1, h, 1, D}, st)}, -1, st);
  }
  return mx::astype(rot, x.dtype(), st);
}

// One token's rows (any shape holding heads x D values) as (1, heads, 1, D).
mx::array as_heads(const mx::array& x, int heads, int D, mx::Stream st) {
  return mx::reshape(x, {1, heads, 1, D}, st);
}

// Rows of n_heads x d floats, rotated by the table where dims > 0.
std::vector<float> rotated_rows(const mx::array& x, const mx::array& cos, const mx::array& sin,
                                int heads, int d, int dims, bool traditional) {
  std::vector<float> rows(static_cast<size_t>(heads) * d);
  to_f32(x, rows.data());
  if (dims > 0) {
    std::vector<float> c(cos.size()), s(sin.size());
    to_f32(cos, c.data());
    to_f32(sin, s.data());
    rotate(rows.data(), heads, d, dims, traditional, c.data(), s.data());
  }
  return rows;
}

} // namespace

mx::array cache_write(const mx::array& buffer, const mx::array& x, const mx::array& cos,
                      const mx::array& sin, const AttentionShape& a, bool reference,
                      mx::StreamOrDevice s) {
  const char* op = "cache_write";
  check_buffer(op, buffer, a.n_kv, a.offset, "buffer");
  const int D = buffer.shape(3);
  check_rope(op, cos, sin, a.dims, D);
  check_float(x, "x");
  if (x.size() != static_cast<size_t>(a.n_kv) * D) {
    fail(op, "x: expected one token's " + std::to_string(a.n_kv) + " x " + std::to_string(D) +
                 " values, found shape " + shape_str(x.shape()));
  }
  auto stream = mx::to_stream(s);
  if (reference || stream.device == mx::Device::gpu) {
    auto rows = rope_reference(as_heads(x, a.n_kv, D, stream), cos, sin, a, stream);
    return mx::slice_update(buffer, mx::astype(rows, buffer.dtype(), stream),
                            mx::Shape{0, 0, a.offset, 0}, mx::Shape{1, a.n_kv, a.offset + 1, D},
                            stream);
  }
  return mx::array(buffer.shape(), buffer.dtype(), std::make_shared<CacheWrite>(stream, a),
                   {buffer, x, cos, sin});
}

void CacheWrite::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer cache_write] has no GPU kernel (the op hands GPU streams "
                           "to MLX's own ops)");
}

void CacheWrite::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  // In place where MLX lets us take the buffer over (as slice_update does), else a copy.
  const auto& in = inputs[0];
  const bool copy = !(in.is_donatable() && in.flags().row_contiguous);
  if (copy) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    buffer_copies.fetch_add(1);
  } else {
    out.copy_shared_buffer(in);
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  encoder.dispatch([buffer = mx::array::unsafe_weak_copy(inputs[0]),
                    x = mx::array::unsafe_weak_copy(inputs[1]),
                    cos = mx::array::unsafe_weak_copy(inputs[2]),
                    sin = mx::array::unsafe_weak_copy(inputs[3]),
                    out = mx::array::unsafe_weak_copy(out), copy, a = a_]() mutable {
    if (copy) {
      copy_elements(buffer, out.data<char>());
    }
    const int D = out.shape(3);
    auto rows = rotated_rows(x, cos, sin, a.n_kv, D, a.dims, a.traditional);
    round_to(x.dtype(), rows.data(), rows.size()); // rotated in x's dtype, as the reference
    switch (out.dtype()) {
      case mx::float32:
        return write_rows<float>(a, rows.data(), out);
      case mx::float16:
        return write_rows<mx::float16_t>(a, rows.data(), out);
      case mx::bfloat16:
        return write_rows<mx::bfloat16_t>(a, rows.data(), out);
      default:
        return; // the op accepts float buffers only
    }
  });
}

mx::array decode_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                           const mx::array& cos, const mx::array& sin, const AttentionShape& a,
                           bool reference, mx::StreamOrDevice s) {
  const char* op = "decode_attention";
  if (a.n_kv < 1 || a.n_q < 1 || a.n_q % a.n_kv != 0) {
    fail(op, "heads: expected n_q a multiple of n_kv >= 1, found n_q=" + std::to_string(a.n_q) +
                 ", n_kv=" + std::to_string(a.n_kv));
  }
  check_buffer(op, keys, a.n_kv, a.offset, "keys");
  check_buffer(op, values, a.n_kv, a.offset, "values");
  if (values.shape(2) != keys.shape(2) || keys.dtype() != values.dtype()) {
    fail(op, "keys/values: expected one capacity and dtype, found " + shape_str(keys.shape()) +
                 " and " + shape_str(values.shape()));
  }
  const int D = keys.shape(3), Dv = values.shape(3);
  check_rope(op, cos, sin, a.dims, D);
  check_float(q, "q");
  if (q.ndim() < 1 || q.size() != static_cast<size_t>(a.n_q) * D) {
    fail(op, "q: expected one token's " + std::to_string(a.n_q) + " x " + std::to_string(D) +
                 " values, found shape " + shape_str(q.shape()));
  }
  auto stream = mx::to_stream(s);
  auto out_shape = q.shape();
  out_shape.back() = a.n_q * Dv;
  if (reference || stream.device == mx::Device::gpu) {
    const int T = a.offset + 1;
    auto qr = rope_reference(as_heads(q, a.n_q, D, stream), cos, sin, a, stream);
    auto kk = mx::slice(keys, {0, 0, 0, 0}, {1, a.n_kv, T, D}, stream);
    auto vv = mx::slice(values, {0, 0, 0, 0}, {1, a.n_kv, T, Dv}, stream);
    auto o = mx::fast::scaled_dot_product_attention(qr, kk, vv, a.scale, "", {}, {}, false, stream);
    return mx::reshape(mx::astype(o, q.dtype(), stream), out_shape, stream);
  }
  return mx::array(out_shape, q.dtype(), std::make_shared<DecodeAttention>(stream, a),
                   {q, keys, values, cos, sin});
}

std::vector<mx::Shape> DecodeAttention::output_shapes(const std::vector<mx::array>& inputs) {
  auto out_shape = inputs[0].shape();
  out_shape.back() = a_.n_q * inputs[2].shape(3);
  return {out_shape};
}

void DecodeAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer decode_attention] has no GPU kernel (the op hands GPU "
                           "streams to MLX's own ops)");
}

void DecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  encoder.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]),
                    keys = mx::array::unsafe_weak_copy(inputs[1]),
                    values = mx::array::unsafe_weak_copy(inputs[2]),
                    cos = mx::array::unsafe_weak_copy(inputs[3]),
                    sin = mx::array::unsafe_weak_copy(inputs[4]),
                    out = mx::array::unsafe_weak_copy(out), a = a_]() mutable {
    const int D = keys.shape(3), Dv = values.shape(3), cap = keys.shape(2);
    auto qr = rotated_rows(q, cos, sin, a.n_q, D, a.dims, a.traditional);
    // The reference rotates and scales the queries in their own dtype.
    round_to(q.dtype(), qr.data(), qr.size());
    for (auto& x : qr) {
      x *= a.scale;
    }
    round_to(q.dtype(), qr.data(), qr.size());
    std::vector<float> y(static_cast<size_t>(a.n_q) * Dv);
    std::vector<char> kcopy, vcopy; // only for strided buffers
    const char* kp = contiguous_bytes(keys, kcopy);
    const char* vp = contiguous_bytes(values, vcopy);
    const bool round_probs = keys.dtype() != mx::float32;
    switch (keys.dtype()) {
      case mx::float32:
        attend_cpu(a, qr, reinterpret_cast<const float*>(kp), reinterpret_cast<const float*>(vp),
                   cap, D, Dv, round_probs, y);
        break;
      case mx::float16:
        attend_cpu(a, qr, reinterpret_cast<const mx::float16_t*>(kp),
                   reinterpret_cast<const mx::float16_t*>(vp), cap, D, Dv, round_probs, y);
        break;
      case mx::bfloat16:
        attend_cpu(a, qr, reinterpret_cast<const mx::bfloat16_t*>(kp),
                   reinterpret_cast<const mx::bfloat16_t*>(vp), cap, D, Dv, round_probs, y);
        break;
      default:
        break; // the op accepts float buffers only
    }
    write_out(y.data(), out);
  });
}

// ----------------------------------------------------------------------------
// Paged decode attention (the batching engine's pool)
// ----------------------------------------------------------------------------

namespace {

// Row b, kv head h: its visible keys' scores for the group's `reps` queries, then the
// softmax-weighted values. scores: reps * n * block floats.
template <typename C>
MLXINFER_INLINE void paged_head_impl(const float* q, const C* K, const C* V, const uint32_t* table,
                const bool* seen, int reps, int n, int block, int D, int Dv, bool round_probs,
                float* scores, float* y) {
  const int T = n * block;
  for (int j = 0; j < reps; ++j) {
    float* s = scores + static_cast<size_t>(j) * T;
    float top = -INFINITY;
    for (int i = 0; i < n; ++i) {
      const C* kb = K + static_cast<size_t>(table[i]) * block * D;
      for (int t = 0; t < block; ++t) {
        const int at = i * block + t;
        if (!seen[at]) {
          s[at] = -INFINITY;
          continue;
        }
        s[at] = dot(q + static_cast<size_t>(j) * D, kb + static_cast<size_t>(t) * D, D);
        top = std::max(top, s[at]);
      }
    }
    float total = 0;
    for (int at = 0; at < T; ++at) {
      s[at] = seen[at] ? exp_neg(s[at] - top) : 0.0f;
      total += s[at];
    }
    float* yj = y + static_cast<size_t>(j) * Dv;
    std::fill(yj, yj + Dv, 0.0f);
    const float inv = total > 0 ? 1.0f / total : 0.0f;
    for (int i = 0; i < n; ++i) {
      const C* vb = V + static_cast<size_t>(table[i]) * block * Dv;
      for (int t = 0; t < block; ++t) {
        const int at = i * block + t;
        if (!seen[at]) {
          continue;
        }
        float p = s[at];
        if (round_probs) {
          p = static_cast<float>(static_cast<C>(p));
        }
        const C* vr = vb + static_cast<size_t>(t) * Dv;
        for (int d = 0; d < Dv; ++d) {
          yj[d] += p * static_cast<float>(vr[d]);
        }
      }
    }
    for (int d = 0; d < Dv; ++d) {
      yj[d] *= inv;
    }
  }
}

#if defined(__x86_64__)
template <typename C>
__attribute__((target("avx2,fma"))) void paged_head_avx2(
    const float* q, const C* K, const C* V, const uint32_t* table, const bool* seen, int reps,
    int n, int block, int D, int Dv, bool round_probs, float* scores, float* y) {
  paged_head_impl<C>(q, K, V, table, seen, reps, n, block, D, Dv, round_probs, scores, y);
}
#endif

template <typename C>
void paged_head(const float* q, const C* K, const C* V, const uint32_t* table, const bool* seen,
                int reps, int n, int block, int D, int Dv, bool round_probs, float* scores,
                float* y) {
#if defined(__x86_64__)
  if (current_isa() >= kAvx2) {
    return paged_head_avx2<C>(q, K, V, table, seen, reps, n, block, D, Dv, round_probs, scores, y);
  }
#endif
  paged_head_impl<C>(q, K, V, table, seen, reps, n, block, D, Dv, round_probs, scores, y);
}

} // namespace

mx::array paged_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                          const mx::array& blocks, const mx::array& visible, float scale,
                          bool reference, mx::StreamOrDevice s) {
  const char* op = "paged_attention";
  if (keys.ndim() != 4 || values.ndim() != 4 || keys.shape(0) != values.shape(0) ||
      keys.shape(1) != values.shape(1) || keys.shape(2) != values.shape(2) ||
      keys.dtype() != values.dtype()) {
    fail(op, "keys/values: expected (n_blocks, n_kv, block, head_dim) pools of one dtype, found " +
                 shape_str(keys.shape()) + " and " + shape_str(values.shape()));
  }
  check_float(keys, "keys");
  const int n_kv = keys.shape(1), block = keys.shape(2), D = keys.shape(3), Dv = values.shape(3);
  if (q.ndim() != 4 || q.shape(2) != 1 || q.shape(3) != D || q.shape(1) % n_kv != 0) {
    fail(op, "q: expected (B, n_q, 1, " + std::to_string(D) + ") with n_q a multiple of " +
                 std::to_string(n_kv) + ", found " + shape_str(q.shape()));
  }
  check_float(q, "q");
  const int B = q.shape(0);
  if (blocks.ndim() != 3 || blocks.shape(0) != B || blocks.shape(1) != n_kv ||
      blocks.dtype() != mx::uint32) {
    fail(op, "blocks: expected a (" + std::to_string(B) + ", " + std::to_string(n_kv) +
                 ", n) uint32 array, found " + shape_str(blocks.shape()));
  }
  const int n = blocks.shape(2);
  if (visible.shape() != mx::Shape{B, 1, n, 1, block} || visible.dtype() != mx::bool_) {
    fail(op, "visible: expected a (" + std::to_string(B) + ", 1, " + std::to_string(n) + ", 1, " +
                 std::to_string(block) + ") bool array, found " + shape_str(visible.shape()));
  }
  auto stream = mx::to_stream(s);
  if (reference || stream.device == mx::Device::gpu) {
    const int nb = keys.shape(0);
    auto gathered = [&](const mx::array& pool, int d) {
      auto flat = mx::reshape(pool, {nb * n_kv, block, d}, stream);
      auto rows = mx::take(flat, mx::reshape(blocks, {B * n_kv * n}, stream), 0, stream);
      return mx::reshape(rows, {B, n_kv, n * block, d}, stream);
    };
    auto mask = mx::reshape(visible, {B, 1, 1, n * block}, stream);
    auto o = mx::fast::scaled_dot_product_attention(q, gathered(keys, D), gathered(values, Dv),
                                                    scale, "", mask, {}, false, stream);
    return mx::astype(o, q.dtype(), stream);
  }
  return mx::array({B, q.shape(1), 1, Dv}, q.dtype(), std::make_shared<PagedAttention>(stream, scale),
                   {q, keys, values, blocks, visible});
}

std::vector<mx::Shape> PagedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), 1, inputs[2].shape(3)}};
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer paged_attention] has no GPU kernel (the op hands GPU "
                           "streams to MLX's own ops)");
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  encoder.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]),
                    keys = mx::array::unsafe_weak_copy(inputs[1]),
                    values = mx::array::unsafe_weak_copy(inputs[2]),
                    blocks = mx::array::unsafe_weak_copy(inputs[3]),
                    visible = mx::array::unsafe_weak_copy(inputs[4]),
                    out = mx::array::unsafe_weak_copy(out), scale = scale_]() mutable {
    const int B = q.shape(0), n_q = q.shape(1), D = q.shape(3);
    const int n_kv = keys.shape(1), block = keys.shape(2), Dv = values.shape(3);
    const int n = blocks.shape(2), reps = n_q / n_kv;
    std::vector<float> qf(q.size());
    to_f32(q, qf.data()); // (B, n_q, D): the group's queries are consecutive
    round_to(q.dtype(), qf.data(), qf.size());
    for (auto& x : qf) {
      x *= scale; // as the reference: the queries scaled in their own dtype
    }
    round_to(q.dtype(), qf.data(), qf.size());
    std::vector<char> kcopy, vcopy, tcopy, mcopy;
    const char* kp = contiguous_bytes(keys, kcopy);
    const char* vp = contiguous_bytes(values, vcopy);
    const auto* table = reinterpret_cast<const uint32_t*>(contiguous_bytes(blocks, tcopy));
    const auto* seen = reinterpret_cast<const bool*>(contiguous_bytes(visible, mcopy));
    std::vector<float> y(static_cast<size_t>(B) * n_q * Dv);
    const bool round_probs = keys.dtype() != mx::float32;
    const size_t kv_slots = static_cast<size_t>(keys.shape(0)) * n_kv;
    auto task = [&](int i) { // one (row, kv head)
      const int b = i / n_kv, h = i % n_kv;
      std::vector<uint32_t> rows(table + static_cast<size_t>(i) * n, table + static_cast<size_t>(i + 1) * n);
      for (auto& r : rows) {
        r = r < kv_slots ? r : 0; // out of the pool: a masked padding block (the op's contract)
      }
      std::vector<float> scores(static_cast<size_t>(reps) * n * block);
      const float* qh = qf.data() + (static_cast<size_t>(b) * n_q + h * reps) * D;
      float* yh = y.data() + (static_cast<size_t>(b) * n_q + h * reps) * Dv;
      const bool* sb = seen + static_cast<size_t>(b) * n * block;
      switch (keys.dtype()) {
        case mx::float32:
          return paged_head(qh, reinterpret_cast<const float*>(kp), reinterpret_cast<const float*>(vp),
                            rows.data(), sb, reps, n, block, D, Dv, round_probs, scores.data(), yh);
        case mx::float16:
          return paged_head(qh, reinterpret_cast<const mx::float16_t*>(kp),
                            reinterpret_cast<const mx::float16_t*>(vp), rows.data(), sb, reps, n,
                            block, D, Dv, round_probs, scores.data(), yh);
        case mx::bfloat16:
          return paged_head(qh, reinterpret_cast<const mx::bfloat16_t*>(kp),
                            reinterpret_cast<const mx::bfloat16_t*>(vp), rows.data(), sb, reps, n,
                            block, D, Dv, round_probs, scores.data(), yh);
        default:
          return;
      }
    };
    auto& pool = ThreadPool::instance();
    const int64_t work = static_cast<int64_t>(B) * n_q * n * block * (D + Dv);
    if (pool.size() <= 1 || work < (1 << 17)) {
      for (int i = 0; i < B * n_kv; ++i) {
        task(i);
      }
    } else {
      pool.run(B * n_kv, task);
    }
    write_out(y.data(), out);
  });
}

} // namespace mlxinfer
