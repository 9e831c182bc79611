#include "fused.h"

#include <atomic>
#include <cmath>
#include <type_traits>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"

#include "attention_math.h"
#include "attention_simd.h"
#include "threadpool.h"
#include "util.h"

namespace mlxinfer {

namespace {

std::atomic<int64_t> buffer_copies{0};

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
  // float32 with head dims in 16s: the batching engine's vector path, over one block of T keys
  // all visible (attention_simd.h), the query heads of a KV head together (up to four a pass:
  // each key and value read once for them, where one head at a time read them `reps` times).
  const bool vectors = std::is_same_v<C, float> && D % 16 == 0 && Dv % 16 == 0;
  std::vector<char> all_seen(vectors ? T : 0, 1);
  auto& pool = ThreadPool::instance();
  const int64_t work = static_cast<int64_t>(T) * a.n_q * (D + Dv);
  const int threads = pool.size() <= 1 || work < (1 << 17) ? 1 : pool.size();
  if constexpr (std::is_same_v<C, float>) {
    // Fewer KV heads than twice the threads (SmolLM2's 3, Gemma-3's 1 on 2): each KV head's
    // keys attended in parts on the threads and joined (paged.cpp's attend_in_parts), so each
    // key is read once and the threads share them; splitting the query heads read them twice.
    const int parts = threads > 1 && a.n_kv < 2 * threads && vectors
                          ? std::min((2 * threads + a.n_kv - 1) / a.n_kv, T / 16)
                          : 1;
    if (parts > 1) {
      std::vector<float> ys(static_cast<size_t>(a.n_kv) * parts * reps * Dv);
      std::vector<float> stats(static_cast<size_t>(a.n_kv) * parts * reps * 2);
      std::atomic<bool> ok{true};
      pool.run(a.n_kv * parts, [&](int t) {
        const int h = t / parts, c = t % parts;
        const int t0 = static_cast<int>(static_cast<int64_t>(T) * c / parts);
        const int t1 = static_cast<int>(static_cast<int64_t>(T) * (c + 1) / parts);
        std::vector<float> scores(static_cast<size_t>(reps) * (t1 - t0));
        const uint32_t first = 0;
        const size_t at = static_cast<size_t>(t) * reps;
        if (!attention_f32x16(q.data() + static_cast<size_t>(h) * reps * D,
                              K + (static_cast<size_t>(h) * cap + t0) * D,
                              V + (static_cast<size_t>(h) * cap + t0) * Dv, &first,
                              reinterpret_cast<const bool*>(all_seen.data()), reps, 1, t1 - t0,
                              D, Dv, scores.data(), ys.data() + at * Dv, stats.data() + at * 2)) {
          ok = false;
        }
      });
      if (ok) {
        for (int h = 0; h < a.n_kv; ++h) {
          const size_t at = static_cast<size_t>(h) * parts * reps;
          join_attention_parts(ys.data() + at * Dv, stats.data() + at * 2, parts, reps, Dv,
                               y.data() + static_cast<size_t>(h) * reps * Dv);
        }
        return;
      }
    }
  }
  // Tasks: each KV head's query heads in `split` parts, enough parts for the threads.
  const int split = std::min(reps, std::max(1, (threads + a.n_kv - 1) / a.n_kv));
  const int per = (reps + split - 1) / split;
  auto task = [&](int t) {
    const int h = t / split, j0 = h * reps + (t % split) * per;
    const int j1 = std::min(h * reps + reps, j0 + per);
    if (j0 >= j1) {
      return;
    }
    std::vector<float> scores(static_cast<size_t>(j1 - j0) * T);
    if constexpr (std::is_same_v<C, float>) {
      const uint32_t first = 0;
      if (vectors &&
          attention_f32x16(q.data() + static_cast<size_t>(j0) * D,
                           K + static_cast<size_t>(h) * cap * D,
                           V + static_cast<size_t>(h) * cap * Dv, &first,
                           reinterpret_cast<const bool*>(all_seen.data()), j1 - j0, 1, T, D, Dv,
                           scores.data(), y.data() + static_cast<size_t>(j0) * Dv)) {
        return;
      }
    }
    for (int j = j0; j < j1; ++j) {
      attend_head<C>(q.data() + static_cast<size_t>(j) * D, K + static_cast<size_t>(h) * cap * D,
                     V + static_cast<size_t>(h) * cap * Dv, T, D, Dv, round_probs, scores.data(),
                     y.data() + static_cast<size_t>(j) * Dv);
    }
  };
  const int tasks = a.n_kv * split;
  if (threads == 1) {
    for (int t = 0; t < tasks; ++t) {
      task(t);
    }
    return;
  }
  pool.run(tasks, task);
}


} // namespace

int64_t attention_buffer_copies() {
  return buffer_copies.load();
}

void note_buffer_copy() {
  buffer_copies.fetch_add(1);
}

namespace {

// Waits for `out`'s stream where `in` was written by an earlier asynchronous evaluation on it
// that may still run. MLX's CPU tasks hold the buffers of the
// arrays their primitive wrote beside its first output (its siblings: cpu::eval) until they
// run, so what a several-output primitive (pool_write, a fused block) wrote is not donatable
// while that evaluation runs: the batching engine queues step n + 1 before step n has run
// (batch/ahead.py), and each layer's pool was copied every step. Waiting costs little there:
// the submission waits for step n anyway (MLX keeps at most ten tasks, of ten calls each, in
// flight). An input's event still attached here is one MLX found unsignalled just before
// (eval_impl detaches signalled ones); this evaluation's own (the output's) is signalled only
// after its submission, so it is never waited for. (MLX exports no Event methods: the stream
// is waited for, as mx.synchronize does.)
void wait_for_writer(const mx::array& in, const mx::array& out) {
  const auto& e = in.event();
  const auto& mine = out.event();
  const auto stream = out.primitive().stream();
  if (!e.valid() || e.stream() != stream ||
      (mine.valid() && &mine.cast<char>() == &e.cast<char>())) {
    return;
  }
  mx::synchronize(stream);
}

} // namespace

bool take_buffer(const mx::array& in, mx::array& out, bool count) {
  if (!in.is_donatable() && in.flags().row_contiguous) {
    wait_for_writer(in, out);
  }
  if (in.is_donatable() && in.flags().row_contiguous) {
    out.copy_shared_buffer(in);
    return false;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (count) {
    note_buffer_copy();
  }
  return true;
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
  auto& encoder = encoder_for(stream(), inputs, out);
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
                                int heads, int d, int dims, bool traditional, int start = 0) {
  std::vector<float> rows(static_cast<size_t>(heads) * d);
  if (start == 0 && x.size() == rows.size()) {
    to_f32(x, rows.data());
  } else { // a token's part of a wider row (a fused q|k|v product)
    std::vector<float> all(x.size());
    to_f32(x, all.data());
    std::copy_n(all.begin() + start, rows.size(), rows.begin());
  }
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
  const size_t n = static_cast<size_t>(a.n_kv) * D;
  if (a.start < 0 || (a.start == 0 ? x.size() != n : x.size() < a.start + n)) {
    fail(op, "x: expected one token's " + std::to_string(a.n_kv) + " x " + std::to_string(D) +
                 " values from element " + std::to_string(a.start) + ", found shape " +
                 shape_str(x.shape()));
  }
  auto stream = mx::to_stream(s);
  if (reference || stream.device == mx::Device::gpu) {
    auto part = a.start == 0 ? x
                             : mx::slice(mx::flatten(x, stream), {a.start},
                                         {a.start + static_cast<int>(n)}, stream);
    auto rows = rope_reference(as_heads(part, a.n_kv, D, stream), cos, sin, a, stream);
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
  const bool copy = take_buffer(inputs[0], out);
  auto& encoder = encoder_for(stream(), inputs, out);
  encoder.dispatch([buffer = mx::array::unsafe_weak_copy(inputs[0]),
                    x = mx::array::unsafe_weak_copy(inputs[1]),
                    cos = mx::array::unsafe_weak_copy(inputs[2]),
                    sin = mx::array::unsafe_weak_copy(inputs[3]),
                    out = mx::array::unsafe_weak_copy(out), copy, a = a_]() mutable {
    if (copy) {
      copy_elements(buffer, out.data<char>());
    }
    const int D = out.shape(3);
    auto rows = rotated_rows(x, cos, sin, a.n_kv, D, a.dims, a.traditional, a.start);
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
  auto& encoder = encoder_for(stream(), inputs, out);
  encoder.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]),
                    keys = mx::array::unsafe_weak_copy(inputs[1]),
                    values = mx::array::unsafe_weak_copy(inputs[2]),
                    cos = mx::array::unsafe_weak_copy(inputs[3]),
                    sin = mx::array::unsafe_weak_copy(inputs[4]),
                    out = mx::array::unsafe_weak_copy(out), a = a_]() mutable {
    const int D = keys.shape(3), Dv = values.shape(3);
    auto qr = rotated_rows(q, cos, sin, a.n_q, D, a.dims, a.traditional);
    // The reference rotates and scales the queries in their own dtype.
    round_to(q.dtype(), qr.data(), qr.size());
    for (auto& x : qr) {
      x *= a.scale;
    }
    round_to(q.dtype(), qr.data(), qr.size());
    std::vector<float> y(static_cast<size_t>(a.n_q) * Dv);
    attend_decode(a, qr, keys, values, y);
    write_out(y.data(), out);
  });
}

void attend_decode(const AttentionShape& a, std::vector<float>& qr, const mx::array& keys,
                   const mx::array& values, std::vector<float>& y) {
  const int D = keys.shape(3), Dv = values.shape(3), cap = keys.shape(2);
  std::vector<char> kcopy, vcopy; // only for strided buffers
  const char* kp = contiguous_bytes(keys, kcopy);
  const char* vp = contiguous_bytes(values, vcopy);
  const bool round_probs = keys.dtype() != mx::float32;
  switch (keys.dtype()) {
    case mx::float32:
      return attend_cpu(a, qr, reinterpret_cast<const float*>(kp),
                        reinterpret_cast<const float*>(vp), cap, D, Dv, round_probs, y);
    case mx::float16:
      return attend_cpu(a, qr, reinterpret_cast<const mx::float16_t*>(kp),
                        reinterpret_cast<const mx::float16_t*>(vp), cap, D, Dv, round_probs, y);
    case mx::bfloat16:
      return attend_cpu(a, qr, reinterpret_cast<const mx::bfloat16_t*>(kp),
                        reinterpret_cast<const mx::bfloat16_t*>(vp), cap, D, Dv, round_probs, y);
    default:
      return; // the ops accept float buffers only
  }
}

} // namespace mlxinfer
