// Drawing a token from logits on the CPU: temperature, top-k, top-p and min-p as
// mlxinfer.generation.sampling.filtered_logprobs applies them (transformers' warpers, in that
// order), then one uniform number per row mapped through the kept tokens' cumulative
// probabilities. MLX's own form sorts the whole vocabulary for top-p and top-k and draws a
// Gumbel number per token (a 262,144-token vocabulary: ~48 ms a token with top-p on a 2-vCPU
// EPYC); here top-k is a selection, top-p a selection and sort of the few most likely tokens
// its mass needs, and the draw one pass.
#include "sample.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "mlx/backend/cpu/encoder.h"

#include "attention_math.h"
#include "attention_simd.h"
#include "simd.h"
#include "util.h"

namespace mlxinfer {

namespace {

// exp(d) for d = x - top <= 0, 0 below float's range (and for -inf: a masked token).
inline float weight_of(float d) {
  return d < -87.3f ? 0.0f : exp_neg(d);
}

// w[i] = exp(x[i] - top) where x[i] >= keep_from, else 0 (and 0 below float's range), 16
// lanes a vector.
MLXINFER_INLINE void weights_impl(const float* x, int n, float top, float keep_from, float* w) {
  int i = 0;
  const vf16 zero = vf16{};
  for (; i + 16 <= n; i += 16) {
    const vf16 v = load16(x + i);
    const vf16 d = v - top;
    const vf16 e = exp_neg16(d < -87.3f ? zero - 87.3f : d);
    store16(w + i, (v >= keep_from) & (d >= -87.3f) ? e : zero);
  }
  for (; i < n; ++i) {
    w[i] = x[i] >= keep_from ? weight_of(x[i] - top) : 0.0f;
  }
}

#if defined(MLXINFER_X86)
MLXINFER_AVX512 void weights_avx512(const float* x, int n, float top, float keep_from, float* w) {
  weights_impl(x, n, top, keep_from, w);
}
MLXINFER_AVX2 void weights_avx2(const float* x, int n, float top, float keep_from, float* w) {
  weights_impl(x, n, top, keep_from, w);
}
#endif

constexpr int kBlock = 256; // a dense row's weights summed per block, for the draw

// The weights of weights_impl at the level in use, their sum per block of kBlock and in all.
double weights(const std::vector<float>& x, float top, float keep_from, std::vector<float>& w,
               std::vector<double>& blocks) {
  const int n = static_cast<int>(x.size());
  w.resize(n);
#if defined(MLXINFER_X86)
  if (current_isa() == kAvx512) {
    weights_avx512(x.data(), n, top, keep_from, w.data());
  } else if (current_isa() >= kAvx2) {
    weights_avx2(x.data(), n, top, keep_from, w.data());
  } else {
    for (int i = 0; i < n; ++i) { // below AVX2: one lane at a time
      w[i] = x[i] >= keep_from ? weight_of(x[i] - top) : 0.0f;
    }
  }
#else
  weights_impl(x.data(), n, top, keep_from, w.data()); // NEON on arm64, the compiler's elsewhere
#endif
  blocks.assign((n + kBlock - 1) / kBlock, 0.0);
  double total = 0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    double sum = 0;
    for (int i = static_cast<int>(b) * kBlock, end = std::min(n, i + kBlock); i < end; ++i) {
      sum += w[i];
    }
    blocks[b] = sum;
    total += sum;
  }
  return total;
}

// The kept tokens of one row and their weights exp(x - top) (not normalised): every token
// (dense: zero weights dropped) or a list.
struct Kept {
  bool dense = true;
  std::vector<int> index; // the list's tokens
  std::vector<float> weight; // per token (dense) or per listed token
  std::vector<double> blocks; // dense: the weights' sums per kBlock tokens
  double total = 0;
};

// The list of tokens with x >= from, and their weights.
void keep_from(const std::vector<float>& x, float top, float from, Kept& k) {
  k.dense = false;
  for (int i = 0, V = static_cast<int>(x.size()); i < V; ++i) {
    if (x[i] >= from) {
      const float w = weight_of(x[i] - top);
      if (w > 0) {
        k.index.push_back(i);
        k.weight.push_back(w);
        k.total += w;
      }
    }
  }
}

Kept filter_row(const float* logits, int V, const SampleSettings& st, mx::Dtype dtype,
                std::vector<float>& x) {
  x.assign(logits, logits + V);
  if (st.temperature != 1.0f) {
    for (auto& v : x) {
      v = v / st.temperature;
    }
    round_to(dtype, x.data(), x.size()); // divided in the logits' dtype, as the reference
  }
  float top = -INFINITY;
  for (float v : x) {
    top = v > top ? v : top;
  }
  Kept k;
  if (!std::isfinite(top)) { // nothing finite: the first token (the reference's NaN row)
    k.dense = false;
    k.index = {0};
    k.weight = {1.0f};
    k.total = 1.0;
    return k;
  }
  constexpr int kBuckets = 256, kPerUnit = 8; // top - x in [0, 32) by 1/8, then one more
  auto bucket = [&](int i) {
    const float d = top - x[i];
    return d < static_cast<float>(kBuckets / kPerUnit) ? static_cast<int>(d * kPerUnit) : kBuckets;
  };
  float floor = -INFINITY; // top-k: tokens below the k-th largest value are dropped
  if (st.top_k > 0 && st.top_k < V) { // the k-th largest among the buckets that hold it
    std::vector<int> count(kBuckets + 1, 0);
    for (int i = 0; i < V; ++i) {
      count[bucket(i)] += 1;
    }
    int last = 0;
    for (int seen = 0; last < kBuckets; ++last) {
      seen += count[last];
      if (seen >= st.top_k) {
        break;
      }
    }
    std::vector<float> near;
    for (int i = 0; i < V; ++i) {
      if (bucket(i) <= last) {
        near.push_back(x[i]);
      }
    }
    std::nth_element(near.begin(), near.begin() + (st.top_k - 1), near.end(),
                     std::greater<float>());
    floor = near[st.top_k - 1];
  }
  const float min_floor = st.min_p > 0 ? top + std::log(st.min_p) : -INFINITY;
  if (st.top_p >= 1.0f) {
    const float from = std::max(floor, min_floor);
    if (from > -INFINITY) {
      keep_from(x, top, from, k); // top-k or min-p: a few tokens, listed
    } else {
      k.total = weights(x, top, from, k.weight, k.blocks);
    }
    return k;
  }
  // top-p over the tokens top-k kept: p = their softmax; a token stays while the mass before
  // it (descending; ties by index) is < top_p. Only the most likely tokens up to that mass are
  // sorted: a histogram of the weights by top - x (steps of 1/8) finds the value above which
  // the tokens hold top_p of the mass; those are sorted, and the rule applied to them.
  Kept all;
  if (floor > -INFINITY) {
    keep_from(x, top, floor, all);
  } else {
    all.total = weights(x, top, floor, all.weight, all.blocks);
  }
  const double z = all.total;
  const size_t n_all = all.dense ? all.weight.size() : all.index.size();
  auto token = [&](size_t j) { return all.dense ? static_cast<int>(j) : all.index[j]; };
  std::vector<double> hist(kBuckets + 1, 0.0);
  for (size_t j = 0; j < n_all; ++j) {
    if (all.weight[j] > 0) {
      hist[bucket(token(j))] += all.weight[j];
    }
  }
  double acc = 0;
  int last = 0;
  for (; last < kBuckets; ++last) {
    acc += hist[last];
    if (acc >= st.top_p * z) {
      break;
    }
  }
  auto before = [&](int a, int b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  for (;; ++last) {
    std::vector<int> pool; // the tokens of the buckets up to `last`, in order
    std::vector<float> w;
    for (size_t j = 0; j < n_all; ++j) {
      if (all.weight[j] > 0 && bucket(token(j)) <= last) {
        pool.push_back(token(j));
      }
    }
    std::sort(pool.begin(), pool.end(), before);
    double mass = 0;
    size_t stay = 0;
    for (; stay < pool.size(); ++stay) {
      if (mass / z >= st.top_p) {
        break;
      }
      mass += weight_of(x[pool[stay]] - top);
    }
    // The rule ended inside, or the mass reached top_p with the last of them: the rest drop.
    if (stay < pool.size() || mass / z >= st.top_p || last >= kBuckets) {
      k.dense = false;
      for (size_t j = 0; j < stay; ++j) {
        const int i = pool[j];
        if (x[i] >= min_floor) {
          const float wi = weight_of(x[i] - top);
          k.index.push_back(i);
          k.weight.push_back(wi);
          k.total += wi;
        }
      }
      return k;
    }
  }
}

// The kept token at which the cumulative weight passes u * total (u in [0, 1)).
int draw(const Kept& k, float u) {
  double target = static_cast<double>(u) * k.total;
  size_t from = 0, to = k.dense ? k.weight.size() : k.index.size();
  if (k.dense) { // the block first, then the token in it
    size_t b = 0;
    for (; b + 1 < k.blocks.size() && target >= k.blocks[b]; ++b) {
      target -= k.blocks[b];
    }
    from = b * kBlock;
    to = std::min(to, from + kBlock);
  }
  double acc = 0;
  int last = -1;
  for (size_t j = from; j < to; ++j) {
    if (k.weight[j] <= 0) {
      continue;
    }
    last = static_cast<int>(j);
    acc += k.weight[j];
    if (acc > target) {
      break;
    }
  }
  if (last < 0) { // rounding past the block's last weight: the row's last kept token
    for (size_t j = to; j-- > 0;) {
      if (k.weight[j] > 0) {
        last = static_cast<int>(j);
        break;
      }
    }
  }
  if (last < 0) {
    return 0;
  }
  return k.dense ? last : k.index[last];
}

} // namespace

mx::array sample(const mx::array& logits, const mx::array& u, const SampleSettings& st,
                 bool probs, mx::StreamOrDevice s) {
  const char* op = "sample";
  auto stream = mx::to_stream(s);
  if (stream.device == mx::Device::gpu) {
    fail(op, "stream: a CPU kernel (MLX's own ops sample on a GPU); found a GPU stream");
  }
  if (logits.ndim() != 2 || !is_float(logits.dtype()) || logits.shape(1) < 1) {
    fail(op, "logits: expected a (B, V) float array, found " + shape_str(logits.shape()));
  }
  if (u.dtype() != mx::float32 || u.size() != static_cast<size_t>(logits.shape(0))) {
    fail(op, "u: expected " + std::to_string(logits.shape(0)) +
                 " float32 uniform numbers, found " + shape_str(u.shape()));
  }
  if (!(st.temperature > 0) || !std::isfinite(st.temperature)) {
    fail(op, "temperature: expected a finite value > 0, found " +
                 std::to_string(st.temperature));
  }
  if (st.top_k < 0 || !(st.top_p > 0 && st.top_p <= 1) || !(st.min_p >= 0 && st.min_p < 1)) {
    fail(op, "top_k/top_p/min_p: expected >= 0, (0, 1] and [0, 1), found " +
                 std::to_string(st.top_k) + ", " + std::to_string(st.top_p) + ", " +
                 std::to_string(st.min_p));
  }
  const mx::Shape shape = probs ? logits.shape() : mx::Shape{logits.shape(0)};
  return mx::array(shape, probs ? mx::float32 : mx::uint32,
                   std::make_shared<Sample>(stream, st, probs), {logits, u});
}

void Sample::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer sample] has no GPU kernel");
}

void Sample::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = encoder_for(stream(), inputs, out);
  encoder.dispatch([logits = mx::array::unsafe_weak_copy(inputs[0]),
                    u = mx::array::unsafe_weak_copy(inputs[1]),
                    out = mx::array::unsafe_weak_copy(out), st = st_, probs = probs_]() mutable {
    const int B = logits.shape(0), V = logits.shape(1);
    std::vector<float> all(logits.size()), us(u.size()), x;
    to_f32(logits, all.data());
    to_f32(u, us.data());
    for (int b = 0; b < B; ++b) {
      const Kept k = filter_row(all.data() + static_cast<size_t>(b) * V, V, st, logits.dtype(), x);
      if (!probs) {
        out.data<uint32_t>()[b] = static_cast<uint32_t>(draw(k, us[b]));
        continue;
      }
      float* p = out.data<float>() + static_cast<size_t>(b) * V;
      std::fill(p, p + V, 0.0f);
      const size_t n = k.dense ? k.weight.size() : k.index.size();
      for (size_t j = 0; j < n; ++j) {
        p[k.dense ? j : k.index[j]] = static_cast<float>(k.weight[j] / k.total);
      }
    }
  });
}

} // namespace mlxinfer
