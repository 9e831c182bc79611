// Log-softmax of a few rows of logits (the batching engine's log-probs: B rows of the
// vocabulary, fused.h: log_softmax): x - (max + log sum exp(x - max)) per row, in f32, in one
// pass over exp instead of MLX's logsumexp (whose std::exp does not vectorise: 8 rows of a
// 49,152-token vocabulary took 10 ms on the Intel Xeon VM). exp is attention_math.h's
// exp_neg (relative error ~1.5e-7), compiled for AVX-512 or AVX2+FMA where the CPU has them.
#include "fused.h"

#include "mlx/backend/cpu/encoder.h"

#include "attention_math.h"
#include "simd.h"
#include "threadpool.h"
#include "util.h"

namespace mlxinfer {

namespace {

// Max and sum over 16 lanes (vectorised without reassociating a single running value).
MLXINFER_INLINE void log_softmax_row_impl(const float* x, float* y, int V) {
  constexpr int W = 16;
  float top_lanes[W], sum_lanes[W];
  for (int j = 0; j < W; ++j) {
    top_lanes[j] = -INFINITY;
    sum_lanes[j] = 0.0f;
  }
  int i = 0;
  for (; i + W <= V; i += W) {
    for (int j = 0; j < W; ++j) {
      top_lanes[j] = std::max(top_lanes[j], x[i + j]);
    }
  }
  float top = -INFINITY;
  for (int j = 0; j < W; ++j) {
    top = std::max(top, top_lanes[j]);
  }
  for (int k = i; k < V; ++k) {
    top = std::max(top, x[k]);
  }
  for (i = 0; i + W <= V; i += W) {
    for (int j = 0; j < W; ++j) {
      sum_lanes[j] += exp_neg(x[i + j] - top);
    }
  }
  float total = 0.0f;
  for (int j = 0; j < W; ++j) {
    total += sum_lanes[j];
  }
  for (int k = i; k < V; ++k) {
    total += exp_neg(x[k] - top);
  }
  const float lse = top + std::log(total);
  for (i = 0; i < V; ++i) {
    y[i] = x[i] - lse;
  }
}

#if defined(MLXINFER_X86)
MLXINFER_AVX512 void log_softmax_row_avx512(const float* x, float* y, int V) {
  log_softmax_row_impl(x, y, V);
}
MLXINFER_AVX2 void log_softmax_row_avx2(const float* x, float* y, int V) {
  log_softmax_row_impl(x, y, V);
}
#endif

// y = x - logsumexp(x) for one row (y may be x).
void log_softmax_row(const float* x, float* y, int V) {
#if defined(MLXINFER_X86)
  if (current_isa() == kAvx512) {
    return log_softmax_row_avx512(x, y, V);
  }
  if (current_isa() >= kAvx2) {
    return log_softmax_row_avx2(x, y, V);
  }
#endif
  log_softmax_row_impl(x, y, V);
}

} // namespace

mx::array log_softmax(const mx::array& x, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (x.ndim() < 1 || x.shape(-1) < 1 || !is_float(x.dtype())) {
    throw std::invalid_argument(
        "[mlxinfer log_softmax] x: expected a float array with a last axis, found shape " +
        shape_str(x.shape()));
  }
  if (stream.device == mx::Device::gpu) {
    auto xf = mx::astype(x, mx::float32, stream);
    return mx::subtract(xf, mx::logsumexp(xf, -1, true, stream), stream);
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<LogSoftmax>(stream), {x});
}

void LogSoftmax::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer log_softmax] has no GPU kernel (the op hands GPU streams "
                           "to MLX's own ops)");
}

void LogSoftmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = encoder_for(stream(), inputs, out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                    out = mx::array::unsafe_weak_copy(out)]() mutable {
    const int V = x.shape(-1);
    const int rows = static_cast<int>(x.size() / V);
    float* y = out.data<float>();
    // float32 rows in place are read as they are; others are converted into out first and
    // normalised there.
    const bool direct = x.dtype() == mx::float32 && x.flags().row_contiguous;
    if (!direct) {
      to_f32(x, y);
    }
    const float* src = direct ? x.data<float>() : y;
    auto task = [&](int r) {
      const size_t at = static_cast<size_t>(r) * V;
      log_softmax_row(src + at, y + at, V);
    };
    auto& pool = ThreadPool::instance();
    if (pool.size() <= 1 || rows == 1) {
      for (int r = 0; r < rows; ++r) {
        task(r);
      }
    } else {
      pool.run(rows, task);
    }
  });
}

} // namespace mlxinfer
