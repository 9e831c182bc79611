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

MLXINFER_INLINE float silu_times(float g, float u) {
  const float e = exp_neg(-std::fabs(g));
  return g * u * (g < 0 ? e : 1.0f) / (1.0f + e);
}

MLXINFER_INLINE void swiglu_impl(const float* g, const float* u, float* y, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vf16 gv = load16(g + i);
    const vf16 e = exp_neg16(gv < 0 ? gv : -gv); // exp(-|g|)
    const vf16 one = vf16{} + 1.0f;
    store16(y + i, gv * load16(u + i) * (gv < 0 ? e : one) / (one + e));
  }
  for (; i < n; ++i) {
    y[i] = silu_times(g[i], u[i]);
  }
}

#if defined(MLXINFER_X86)
MLXINFER_AVX512 void swiglu_avx512(const float* g, const float* u, float* y, size_t n) {
  swiglu_impl(g, u, y, n);
}
MLXINFER_AVX2 void swiglu_avx2(const float* g, const float* u, float* y, size_t n) {
  swiglu_impl(g, u, y, n);
}
#endif

void swiglu_span(const float* g, const float* u, float* y, size_t n) {
#if defined(MLXINFER_X86)
  if (current_isa() == kAvx512) {
    return swiglu_avx512(g, u, y, n);
  }
  if (current_isa() >= kAvx2) {
    return swiglu_avx2(g, u, y, n);
  }
  for (size_t i = 0; i < n; ++i) { // below AVX2: one lane at a time
    y[i] = silu_times(g[i], u[i]);
  }
#else
  swiglu_impl(g, u, y, n); // NEON on arm64 (its base ISA), the compiler's lanes elsewhere
#endif
}

} // namespace

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (gate.shape() != up.shape() || gate.dtype() != mx::float32 || up.dtype() != mx::float32) {
    throw std::invalid_argument("[mlxinfer swiglu] gate, up: expected float32 arrays of one shape, "
                                "found " + shape_str(gate.shape()) + " and " +
                                shape_str(up.shape()));
  }
  if (stream.device == mx::Device::gpu) {
    return mx::multiply(mx::multiply(gate, mx::sigmoid(gate, stream), stream), up, stream);
  }
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(stream), {gate, up});
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
                    out = mx::array::unsafe_weak_copy(out)]() mutable {
    std::vector<char> gcopy, ucopy;
    const auto* gp = reinterpret_cast<const float*>(contiguous_bytes(g, gcopy));
    const auto* up = reinterpret_cast<const float*>(contiguous_bytes(u, ucopy));
    float* y = out.data<float>();
    const size_t n = out.size();
    constexpr size_t kChunk = 1 << 15; // elements a task: a decode step's few rows are one
    auto& pool = ThreadPool::instance();
    const int tasks = static_cast<int>((n + kChunk - 1) / kChunk);
    if (pool.size() <= 1 || tasks <= 1) {
      return swiglu_span(gp, up, y, n);
    }
    pool.run(tasks, [&](int t) {
      const size_t lo = static_cast<size_t>(t) * kChunk;
      swiglu_span(gp + lo, up + lo, y + lo, std::min(kChunk, n - lo));
    });
  });
}

} // namespace mlxinfer
