// Dequantize: MLX's affine codes (2, 3, 4, 5, 6 or 8 bits, groups of 32/64/128) written out
// as floats, s * q + b, for the CPU backend's prefill (backends/cpu/quantized.py): a
// quantized layer's many-row product is its weight dequantized and the BLAS matmul. MLX's
// compiled elementwise form of this runs on one thread: it took 0.165 s of a 0.49 s
// 128-token prefill of Gemma-3-270M's import (mostly 5-bit layers, 1.8 ns a weight) on this
// project's 2-vCPU EPYC VM. Here rows go to the pool, and each 8-code unit (`bits` bytes of
// MLX's one little-endian bit stream per row) is read as one 64-bit integer, its codes shifted
// out with constant shifts the compiler vectorises (per ISA, chosen at run time).
#include "primitives.h"

#include <cstring>

#include "mlx/backend/cpu/encoder.h"

#include "kernels.h"
#include "simd.h"
#include "threadpool.h"
#include "util.h"

namespace mlxinfer {

namespace {

// One row: K codes from `src` (the row's bit stream), its G groups' scales and biases (f32).
template <int BITS>
inline __attribute__((always_inline)) void dequantize_row_impl(
    const uint8_t* __restrict src,
    const float* __restrict scales,
    const float* __restrict biases,
    float* __restrict out,
    int K,
    int group_size) {
  constexpr uint64_t mask = (uint64_t{1} << BITS) - 1;
  const int units = group_size / 8; // 8-code units per group, BITS bytes each
  const int last = K / 8 - 1; // the row's last unit: read as its BITS bytes only
  for (int g = 0; g < K / group_size; ++g) {
    const float s = scales[g], b = biases[g];
    const uint8_t* gsrc = src + static_cast<size_t>(g) * units * BITS;
    float* gout = out + static_cast<size_t>(g) * group_size;
    for (int u = 0; u < units; ++u) {
      // Little-endian: code j at bits j * BITS. Eight bytes read (one load) where the row goes
      // on past them; the bits past the unit are masked off below.
      uint64_t v = 0;
      if (BITS == 8 || g * units + u < last) {
        std::memcpy(&v, gsrc + u * BITS, 8);
      } else {
        std::memcpy(&v, gsrc + u * BITS, BITS);
      }
      for (int j = 0; j < 8; ++j) {
        gout[u * 8 + j] = static_cast<float>((v >> (j * BITS)) & mask) * s + b;
      }
    }
  }
}

using RowFn = void (*)(const uint8_t*, const float*, const float*, float*, int, int);

template <int BITS>
void dequantize_row_scalar(
    const uint8_t* src, const float* s, const float* b, float* out, int K, int gs) {
  dequantize_row_impl<BITS>(src, s, b, out, K, gs);
}

#if defined(MLXINFER_X86)
template <int BITS>
MLXINFER_AVX2 void dequantize_row_avx2(
    const uint8_t* src, const float* s, const float* b, float* out, int K, int gs) {
  dequantize_row_impl<BITS>(src, s, b, out, K, gs);
}
template <int BITS>
MLXINFER_AVX512BW void dequantize_row_avx512(
    const uint8_t* src, const float* s, const float* b, float* out, int K, int gs) {
  dequantize_row_impl<BITS>(src, s, b, out, K, gs);
}
#endif

template <int BITS>
RowFn row_fn_for(Isa isa) {
#if defined(MLXINFER_X86)
  if (isa == kAvx512) {
    return dequantize_row_avx512<BITS>;
  }
  if (isa == kAvx2) {
    return dequantize_row_avx2<BITS>;
  }
#endif
  (void)isa;
  return dequantize_row_scalar<BITS>;
}

RowFn row_fn(int bits, Isa isa) {
  switch (bits) {
    case 2:
      return row_fn_for<2>(isa);
    case 3:
      return row_fn_for<3>(isa);
    case 4:
      return row_fn_for<4>(isa);
    case 5:
      return row_fn_for<5>(isa);
    case 6:
      return row_fn_for<6>(isa);
    default:
      return row_fn_for<8>(isa);
  }
}

class Dequantize : public mx::UnaryPrimitive {
 public:
  Dequantize(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(
        "[mlxinfer dequantize] has no GPU kernel (the op hands GPU streams to mx.dequantize)");
  }
  const char* name() const override {
    return "MlxinferDequantize";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Dequantize&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), static_cast<int>(inputs[0].shape(1) * 32 / bits_)}};
  }

 private:
  int group_size_;
  int bits_;
};

void Dequantize::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = encoder_for(stream(), inputs, out);
  encoder.dispatch([w = mx::array::unsafe_weak_copy(inputs[0]),
                    sc = mx::array::unsafe_weak_copy(inputs[1]),
                    bi = mx::array::unsafe_weak_copy(inputs[2]),
                    out = mx::array::unsafe_weak_copy(out),
                    gs = group_size_,
                    bits = bits_]() mutable {
    const int N = w.shape(0);
    const int K = static_cast<int>(static_cast<int64_t>(w.shape(1)) * 32 / bits);
    const int G = K / gs;
    if (N == 0 || K == 0) {
      return;
    }
    std::vector<uint32_t> wcopy;
    const auto* words = reinterpret_cast<const uint8_t*>(contiguous_words(w, wcopy));
    const size_t row_bytes = static_cast<size_t>(w.shape(1)) * 4;
    // f32 contiguous scales and biases in place; others widened whole (G per row: 1/8 to
    // 1/32 of the output's bytes).
    std::vector<float> sf, bf;
    const float *s = nullptr, *b = nullptr;
    if (sc.dtype() == mx::float32 && sc.flags().row_contiguous && bi.dtype() == mx::float32 &&
        bi.flags().row_contiguous) {
      s = sc.data<float>();
      b = bi.data<float>();
    } else {
      sf.resize(sc.size());
      bf.resize(bi.size());
      to_f32(sc, sf.data());
      to_f32(bi, bf.data());
      s = sf.data();
      b = bf.data();
    }
    const bool direct = out.dtype() == mx::float32;
    std::vector<float> yf(direct ? 0 : out.size());
    float* y = direct ? out.data<float>() : yf.data();
    const RowFn fn = row_fn(bits, current_isa());
    parallel_rows(N, 8, static_cast<size_t>(N) * K * 4, [&](int n0, int n1) {
      for (int n = n0; n < n1; ++n) {
        fn(words + n * row_bytes,
           s + static_cast<size_t>(n) * G,
           b + static_cast<size_t>(n) * G,
           y + static_cast<size_t>(n) * K,
           K,
           gs);
      }
    });
    if (!direct) {
      write_out(yf.data(), out);
    }
  });
}

} // namespace

mx::array dequantize(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  const int64_t K = check_affine("[mlxinfer dequantize] ", w, scales, biases, group_size, bits);
  if (stream.device == mx::Device::gpu) {
    return mx::dequantize(
        w, scales, biases, group_size, bits, "affine", std::nullopt, std::nullopt, stream);
  }
  return mx::array(
      {w.shape(0), static_cast<int>(K)},
      scales.dtype(),
      std::make_shared<Dequantize>(stream, group_size, bits),
      {w, scales, biases});
}

} // namespace mlxinfer
