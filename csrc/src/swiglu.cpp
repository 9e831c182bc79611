// SwiGLU of a few rows (a decode step's gated MLPs: silu(gate) * up), in f32, 16 lanes a
// vector: gate * up * sigmoid(gate), the sigmoid from exp(-|gate|) (attention_simd.h's
// exp_neg16, relative error ~1.5e-7), so it never overflows. One primitive instead of MLX's
// compiled sigmoid kernel (whose exp does not vectorise here) or the fast exponential's three
// kernels (backends/cpu/ops.py: swiglu): 8 rows of SmolLM2's 1,536 hidden units took ~80 us a
// layer through those on the Intel Xeon VM.
#include "fused.h"

#include "mlx/backend/cpu/encoder.h"

#include "attention_simd.h"
#include "simd.h"
#include "threadpool.h"
#include "util.h"

namespace mlxinfer {

namespace {

// GELU's tanh approximation as g sigmoid(t): t = 2 sqrt(2 / pi) (g + 0.044715 g^3).
constexpr float kGeluA = 1.5957691216057308f, kGeluB = 0.044715f;

// g u sigmoid(t) (silu: t = g), from exp(-|t|), so it never overflows.
MLXINFER_INLINE float gated_times(float g, float u, float t) {
  const float e = exp_neg(-std::fabs(t));
  return g * u * (t < 0 ? e : 1.0f) / (1.0f + e);
}

template <int ACT>
MLXINFER_INLINE float act_arg(float g) {
  return ACT == 0 ? g : kGeluA * (g + kGeluB * g * g * g);
}

template <int ACT>
MLXINFER_INLINE void swiglu_impl(const float* g, const float* u, float* y, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vf16 gv = load16(g + i);
    const vf16 tv = ACT == 0 ? gv : kGeluA * (gv + kGeluB * gv * gv * gv);
    const vf16 e = exp_neg16(tv < 0 ? tv : -tv); // exp(-|t|)
    const vf16 one = vf16{} + 1.0f;
    store16(y + i, gv * load16(u + i) * (tv < 0 ? e : one) / (one + e));
  }
  for (; i < n; ++i) {
    y[i] = gated_times(g[i], u[i], act_arg<ACT>(g[i]));
  }
}

#if defined(MLXINFER_X86)
template <int ACT>
MLXINFER_AVX512 void swiglu_avx512(const float* g, const float* u, float* y, size_t n) {
  swiglu_impl<ACT>(g, u, y, n);
}
template <int ACT>
MLXINFER_AVX2 void swiglu_avx2(const float* g, const float* u, float* y, size_t n) {
  swiglu_impl<ACT>(g, u, y, n);
}
#endif

template <int ACT>
void swiglu_span(const float* g, const float* u, float* y, size_t n) {
#if defined(MLXINFER_X86)
  if (current_isa() == kAvx512) {
    return swiglu_avx512<ACT>(g, u, y, n);
  }
  if (current_isa() >= kAvx2) {
    return swiglu_avx2<ACT>(g, u, y, n);
  }
  for (size_t i = 0; i < n; ++i) { // below AVX2: one lane at a time
    y[i] = gated_times(g[i], u[i], act_arg<ACT>(g[i]));
  }
#else
  swiglu_impl<ACT>(g, u, y, n); // NEON on arm64 (its base ISA), the compiler's lanes elsewhere
#endif
}

mx::array gated_op(const mx::array& gate, const mx::array& up, int act, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  const char* name = act == 0 ? "[mlxinfer swiglu]" : "[mlxinfer gelu_tanh_glu]";
  if (gate.shape() != up.shape() || gate.dtype() != mx::float32 || up.dtype() != mx::float32) {
    throw std::invalid_argument(std::string(name) + " gate, up: expected float32 arrays of one "
                                "shape, found " + shape_str(gate.shape()) + " and " +
                                shape_str(up.shape()));
  }
  if (stream.device == mx::Device::gpu) {
    mx::array t = gate;
    if (act != 0) { // kGeluA (g + kGeluB g^3)
      auto cube = mx::multiply(mx::multiply(gate, gate, stream), gate, stream);
      t = mx::multiply(
          mx::add(gate, mx::multiply(mx::array(kGeluB), cube, stream), stream),
          mx::array(kGeluA),
          stream);
    }
    return mx::multiply(mx::multiply(gate, mx::sigmoid(t, stream), stream), up, stream);
  }
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(stream, act), {gate, up});
}

} // namespace

void gated_span(int act, const float* g, const float* u, float* y, size_t n) {
  (act == 0 ? swiglu_span<0> : swiglu_span<1>)(g, u, y, n);
}

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated_op(gate, up, 0, s);
}

mx::array gelu_tanh_glu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated_op(gate, up, 1, s);
}

void SwiGLU::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer swiglu] has no GPU kernel (the op hands GPU streams to "
                           "MLX's own ops)");
}

void SwiGLU::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = encoder_for(stream(), inputs, out);
  encoder.dispatch([g = mx::array::unsafe_weak_copy(inputs[0]),
                    u = mx::array::unsafe_weak_copy(inputs[1]),
                    out = mx::array::unsafe_weak_copy(out),
                    span = act_ == 0 ? swiglu_span<0> : swiglu_span<1>]() mutable {
    std::vector<char> gcopy, ucopy;
    const auto* gp = reinterpret_cast<const float*>(contiguous_bytes(g, gcopy));
    const auto* up = reinterpret_cast<const float*>(contiguous_bytes(u, ucopy));
    float* y = out.data<float>();
    const size_t n = out.size();
    constexpr size_t kChunk = 1 << 15; // elements a task: a decode step's few rows are one
    auto& pool = ThreadPool::instance();
    const int tasks = static_cast<int>((n + kChunk - 1) / kChunk);
    if (pool.size() <= 1 || tasks <= 1) {
      return span(gp, up, y, n);
    }
    pool.run(tasks, [&](int t) {
      const size_t lo = static_cast<size_t>(t) * kChunk;
      span(gp + lo, up + lo, y + lo, std::min(kChunk, n - lo));
    });
  });
}

} // namespace mlxinfer
