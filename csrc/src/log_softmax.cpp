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

// The first index of a row's NaNs where `nan`, else of its value `top` (the largest): 16
// values a step tested together (vectorised), then the step that holds it one by one.
MLXINFER_INLINE uint32_t first_index(const float* x, int V, bool nan, float top) {
  constexpr int W = 16;
  int i = 0;
  for (; i + W <= V; i += W) {
    bool any = false;
    for (int j = 0; j < W; ++j) {
      any |= nan ? x[i + j] != x[i + j] : x[i + j] == top;
    }
    if (any) {
      break;
    }
  }
  for (; i < V; ++i) {
    if (nan ? x[i] != x[i] : x[i] == top) {
      return static_cast<uint32_t>(i);
    }
  }
  return 0;
}

// Max and sum over 16 lanes (vectorised without reassociating a single running value). The max
// leaves NaNs out (std::max keeps its first operand); with `index`, the row's mx.argmax (as
// numpy's: the first NaN where there is one, else the first of the largest values) from the same
// pass over the row, before y (which may be x) is written.
template <bool ARGMAX>
MLXINFER_INLINE void log_softmax_row_impl(const float* x, float* y, int V, uint32_t* index) {
  constexpr int W = 16;
  float top_lanes[W], sum_lanes[W];
  bool nan_lanes[W];
  for (int j = 0; j < W; ++j) {
    top_lanes[j] = -INFINITY;
    sum_lanes[j] = 0.0f;
    nan_lanes[j] = false;
  }
  int i = 0;
  for (; i + W <= V; i += W) {
    for (int j = 0; j < W; ++j) {
      top_lanes[j] = std::max(top_lanes[j], x[i + j]);
    }
    if constexpr (ARGMAX) {
      for (int j = 0; j < W; ++j) {
        nan_lanes[j] |= x[i + j] != x[i + j];
      }
    }
  }
  float top = -INFINITY;
  bool nan = false;
  for (int j = 0; j < W; ++j) {
    top = std::max(top, top_lanes[j]);
    nan |= nan_lanes[j];
  }
  for (int k = i; k < V; ++k) {
    top = std::max(top, x[k]);
    nan |= x[k] != x[k];
  }
  if constexpr (ARGMAX) {
    *index = first_index(x, V, nan, top);
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
MLXINFER_AVX512 void log_softmax_row_avx512(const float* x, float* y, int V, uint32_t* index) {
  index != nullptr ? log_softmax_row_impl<true>(x, y, V, index)
                   : log_softmax_row_impl<false>(x, y, V, index);
}
MLXINFER_AVX2 void log_softmax_row_avx2(const float* x, float* y, int V, uint32_t* index) {
  index != nullptr ? log_softmax_row_impl<true>(x, y, V, index)
                   : log_softmax_row_impl<false>(x, y, V, index);
}
#endif

// y = x - logsumexp(x) for one row (y may be x); with `index`, the row's argmax.
void log_softmax_row(const float* x, float* y, int V, uint32_t* index) {
#if defined(MLXINFER_X86)
  if (current_isa() == kAvx512) {
    return log_softmax_row_avx512(x, y, V, index);
  }
  if (current_isa() >= kAvx2) {
    return log_softmax_row_avx2(x, y, V, index);
  }
#endif
  index != nullptr ? log_softmax_row_impl<true>(x, y, V, index)
                   : log_softmax_row_impl<false>(x, y, V, index);
}

// The rows of x (float32 row-contiguous ones read in place, others converted into y first)
// normalised into y, each row's argmax into `index` when given; on the kernels' threads.
void log_softmax_rows(const mx::array& x, float* y, uint32_t* index) {
  const int V = x.shape(-1);
  const int rows = static_cast<int>(x.size() / V);
  const bool direct = x.dtype() == mx::float32 && x.flags().row_contiguous;
  if (!direct) {
    to_f32(x, y);
  }
  const float* src = direct ? x.data<float>() : y;
  auto task = [&](int r) {
    const size_t at = static_cast<size_t>(r) * V;
    log_softmax_row(src + at, y + at, V, index != nullptr ? index + r : nullptr);
  };
  auto& pool = ThreadPool::instance();
  if (pool.size() <= 1 || rows == 1) {
    for (int r = 0; r < rows; ++r) {
      task(r);
    }
  } else {
    pool.run(rows, task);
  }
}

void check_logits(const char* op, const mx::array& x) {
  if (x.ndim() < 1 || x.shape(-1) < 1 || !is_float(x.dtype())) {
    throw std::invalid_argument(std::string("[mlxinfer ") + op +
                                "] x: expected a float array with a last axis, found shape " +
                                shape_str(x.shape()));
  }
}

} // namespace

mx::array log_softmax(const mx::array& x, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  check_logits("log_softmax", x);
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
    log_softmax_rows(x, out.data<float>(), nullptr);
  });
}

std::vector<mx::array> log_softmax_argmax(const mx::array& x, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  check_logits("log_softmax_argmax", x);
  if (stream.device == mx::Device::gpu) {
    auto xf = mx::astype(x, mx::float32, stream);
    return {mx::subtract(xf, mx::logsumexp(xf, -1, true, stream), stream),
            mx::argmax(x, -1, false, stream)};
  }
  mx::Shape rows(x.shape().begin(), x.shape().end() - 1);
  return mx::array::make_arrays({x.shape(), rows}, {mx::float32, mx::uint32},
                                std::make_shared<LogSoftmaxArgmax>(stream), {x});
}

void LogSoftmaxArgmax::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxinfer log_softmax_argmax] has no GPU kernel (the op hands GPU "
                           "streams to MLX's own ops)");
}

void LogSoftmaxArgmax::eval_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                    y = mx::array::unsafe_weak_copy(outputs[0]),
                    index = mx::array::unsafe_weak_copy(outputs[1])]() mutable {
    log_softmax_rows(x, y.data<float>(), index.data<uint32_t>());
  });
}

} // namespace mlxinfer
