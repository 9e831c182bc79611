// A prompt's attention (many queries, one sequence) for float32 heads whose dims are multiples
// of 16: each query position runs the decode path's vector attention (attention_simd.h:
// a KV head's query heads together, four keys a pass, the softmax's exp 16 lanes a vector) over
// the keys it sees, causal (query i of L sees the first T - L + i + 1 of T keys) or all of them.
// The CPU backend's prompt attention through MLX's ops (ops.attention: a product for the scores,
// a mask, the exponentials, a product with the values, a division, per block of queries) took
// 11.9 ms a layer for Gemma-3-270M's 511-token prompt on the AMD EPYC VM, most of it the passes
// over the scores; here the scores of one query stay in cache and nothing else is written.
#include "primitives.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"

#include "attention_math.h"
#include "attention_simd.h"
#include "threadpool.h"
#include "util.h"

namespace mlxinfer {

namespace {

class PrefillAttention : public mx::UnaryPrimitive {
 public:
  PrefillAttention(mx::Stream stream, float scale, bool causal)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxinfer prefill_attention] has no GPU kernel");
  }
  const char* name() const override {
    return "MlxinferPrefillAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PrefillAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape(-1);
    return {shape};
  }

 private:
  float scale_;
  bool causal_;
};

// Rows of a (B, heads, T, D) array whose last axis is contiguous: row b's head h's row t.
struct Rows {
  const float* data;
  int64_t batch, head, row;
  const float* at(int b, int h, int t) const {
    return data + b * batch + h * head + t * row;
  }
};

// a's rows as the kernel reads them: each head's rows one after the other with its last axis
// contiguous (a cache's view of its buffer is), else copied so into `copy` (the keys of a
// forward without a cache are a transposed (1, L, heads, D) view). Strides are known only
// once the inputs are evaluated, so this is decided here, not when the graph is built.
Rows rows_of(const mx::array& a, std::vector<float>& copy) {
  const auto& st = a.strides();
  const int B = a.shape(0), H = a.shape(1), T = a.shape(2), D = a.shape(3);
  if (st[3] == 1 && st[2] == D) {
    return {a.data<float>(), static_cast<int64_t>(st[0]), static_cast<int64_t>(st[1]),
            static_cast<int64_t>(D)};
  }
  copy.resize(static_cast<size_t>(B) * H * T * D);
  const float* src = a.data<float>();
  size_t i = 0;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int t = 0; t < T; ++t) {
        for (int d = 0; d < D; ++d) {
          copy[i++] = src[b * st[0] + h * st[1] + t * st[2] + d * st[3]];
        }
      }
    }
  }
  return {copy.data(), static_cast<int64_t>(H) * T * D, static_cast<int64_t>(T) * D,
          static_cast<int64_t>(D)};
}

// The mask's (B or 1, L, T) visibility flags, contiguous (a broadcast view is expanded).
std::vector<char> flags_of(const mx::array& m) {
  std::vector<char> out(m.size());
  const auto& st = m.strides();
  const bool* src = m.data<bool>();
  const int nd = m.ndim();
  std::vector<int> idx(nd, 0);
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) {
      off += static_cast<int64_t>(idx[d]) * st[d];
    }
    out[i] = src[off] ? 1 : 0;
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < m.shape(d)) {
        break;
      }
      idx[d] = 0;
    }
  }
  return out;
}

void PrefillAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = encoder_for(stream(), inputs, out);
  const bool masked = inputs.size() > 3;
  encoder.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]),
                    k = mx::array::unsafe_weak_copy(inputs[1]),
                    v = mx::array::unsafe_weak_copy(inputs[2]),
                    m = mx::array::unsafe_weak_copy(inputs[masked ? 3 : 0]),
                    out = mx::array::unsafe_weak_copy(out),
                    scale = scale_,
                    causal = causal_,
                    masked]() mutable {
    const int Bq = q.shape(0), n_q = q.shape(1), L = q.shape(2), D = q.shape(3);
    const int n_kv = k.shape(1), T = k.shape(2), Dv = v.shape(3);
    const int reps = n_q / n_kv;
    if (L == 0 || n_q == 0 || Bq == 0) {
      return;
    }
    std::vector<float> qc, kc, vc;
    const Rows Q = rows_of(q, qc), K = rows_of(k, kc), V = rows_of(v, vc);
    float* y = out.data<float>(); // (B, n_q, L, Dv), row-contiguous
    const std::vector<char> all_seen(std::max(T, 1), 1);
    // A mask (B or 1, 1, L, T): row b's query i sees the keys its flags name (all T scored).
    const std::vector<char> flags = masked ? flags_of(m) : std::vector<char>();
    const bool per_row = masked && m.shape(0) == Bq && Bq > 1;
    // Tasks: a row's KV head's query positions in chunks of 8, claimed as the threads free up
    // (the causal chunks' costs grow with their position).
    constexpr int kChunk = 8;
    const int chunks = (L + kChunk - 1) / kChunk;
    auto task = [&](int t) {
      const int b = t / (n_kv * chunks), h = (t / chunks) % n_kv;
      const int i0 = (t % chunks) * kChunk, i1 = std::min(L, i0 + kChunk);
      std::vector<float> qs(static_cast<size_t>(reps) * D), ys(static_cast<size_t>(reps) * Dv);
      std::vector<float> scores(static_cast<size_t>(reps) * T);
      const uint32_t first = 0;
      for (int i = i0; i < i1; ++i) {
        const int visible = causal && !masked ? T - L + i + 1 : T;
        const bool* seen = reinterpret_cast<const bool*>(
            masked ? flags.data() + (static_cast<size_t>(per_row ? b : 0) * L + i) * T
                   : all_seen.data());
        for (int j = 0; j < reps; ++j) {
          const float* src = Q.at(b, h * reps + j, i);
          for (int d = 0; d < D; ++d) {
            qs[static_cast<size_t>(j) * D + d] = src[d] * scale;
          }
        }
        if (visible <= 0) { // no key to see: zeros, as a softmax over nothing gives here
          std::fill(ys.begin(), ys.end(), 0.0f);
        } else if (!attention_f32x16(qs.data(), K.at(b, h, 0), V.at(b, h, 0), &first, seen, reps,
                                     1, visible, D, Dv, scores.data(), ys.data())) {
          // the scalar level (set_max_isa): attention_math.h's loops
          paged_head<float>(qs.data(), K.at(b, h, 0), V.at(b, h, 0), &first, seen, reps, 1,
                            visible, D, Dv, false, scores.data(), ys.data());
        }
        for (int j = 0; j < reps; ++j) {
          std::copy_n(ys.data() + static_cast<size_t>(j) * Dv, Dv,
                      y + ((static_cast<size_t>(b) * n_q + h * reps + j) * L + i) * Dv);
        }
      }
    };
    const int tasks = Bq * n_kv * chunks;
    auto& pool = ThreadPool::instance();
    const int64_t work = static_cast<int64_t>(L) * T * n_q * (D + Dv);
    if (pool.size() <= 1 || work < (1 << 18)) {
      for (int t = 0; t < tasks; ++t) {
        task(t);
      }
      return;
    }
    pool.run(tasks, task);
  });
}

} // namespace

mx::array prefill_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                            float scale, bool causal, const std::optional<mx::array>& mask,
                            mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  const char* op = "[mlxinfer prefill_attention] ";
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || k.shape(0) != q.shape(0) ||
      v.shape(0) != q.shape(0) || k.shape(1) != v.shape(1) || k.shape(2) != v.shape(2) ||
      q.shape(3) != k.shape(3) || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) {
    throw std::invalid_argument(std::string(op) +
                                "q, k, v: expected (B, n_q, L, D), (B, n_kv, T, D), (B, n_kv, T, "
                                "Dv) with n_q a multiple of n_kv, found " +
                                shape_str(q.shape()) + ", " + shape_str(k.shape()) + ", " +
                                shape_str(v.shape()));
  }
  if (mask && (mask->dtype() != mx::bool_ || mask->ndim() != 4 || mask->shape(1) != 1 ||
               (mask->shape(0) != 1 && mask->shape(0) != q.shape(0)) ||
               mask->shape(2) != q.shape(2) || mask->shape(3) != k.shape(2))) {
    throw std::invalid_argument(std::string(op) + "mask: expected a bool array (1 or " +
                                std::to_string(q.shape(0)) + ", 1, " +
                                std::to_string(q.shape(2)) + ", " + std::to_string(k.shape(2)) +
                                "), found " + shape_str(mask->shape()));
  }
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32 ||
      q.shape(3) % 16 != 0 || v.shape(3) % 16 != 0) {
    throw std::invalid_argument(std::string(op) +
                                "expected float32 q, k, v with head dims in multiples of 16, "
                                "found D " + std::to_string(q.shape(3)) + ", Dv " +
                                std::to_string(v.shape(3)));
  }
  if (stream.device == mx::Device::gpu) {
    throw std::invalid_argument(std::string(op) + "CPU only");
  }
  auto out_shape = q.shape();
  out_shape.back() = v.shape(3);
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) {
    inputs.push_back(*mask);
  }
  return mx::array(out_shape, mx::float32,
                   std::make_shared<PrefillAttention>(stream, scale, causal && !mask),
                   std::move(inputs));
}

} // namespace mlxinfer
