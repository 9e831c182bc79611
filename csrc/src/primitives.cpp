#include "primitives.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"

#include "kernels.h"
#include "threadpool.h"
#include "util.h"

namespace mlxinfer {


void set_num_threads(int n) {
  ThreadPool::instance().resize(n);
}

int num_threads() {
  return ThreadPool::instance().size();
}

// ----------------------------------------------------------------------------
// Quantized
// ----------------------------------------------------------------------------

mx::array quantized_matvec(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    const std::string& mode,
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  // MLX's float modes: (mode, bits, group size, what the uint8 scales are).
  struct FloatMode {
    const char* name;
    int mode, bits, group_size;
    const char* scales;
  };
  static constexpr FloatMode kFloatModes[] = {
      {"mxfp4", kMxfp4, 4, 32, "E8M0"}, {"nvfp4", kNvfp4, 4, 16, "E4M3"},
      {"mxfp8", kMxfp8, 8, 32, "E8M0"}};
  const FloatMode* fm = nullptr;
  for (const auto& m : kFloatModes) {
    fm = mode == m.name ? &m : fm;
  }
  if (mode != "affine" && fm == nullptr) {
    throw std::invalid_argument(
        "[mlxinfer quantized_matvec] mode: expected 'affine', 'mxfp4', 'nvfp4' or 'mxfp8', "
        "found '" + mode + "'");
  }
  const bool flt = fm != nullptr;
  if (flt ? bits != fm->bits
          : bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    throw std::invalid_argument(
        std::string("[mlxinfer quantized_matvec] bits: expected ") +
        (flt ? std::to_string(fm->bits) + " for " + mode : "2, 3, 4, 5, 6 or 8") + ", found " +
        std::to_string(bits));
  }
  if (flt ? group_size != fm->group_size
          : group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument(
        std::string("[mlxinfer quantized_matvec] group_size: expected ") +
        (flt ? std::to_string(fm->group_size) + " for " + mode : "32, 64 or 128") + ", found " +
        std::to_string(group_size));
  }
  if (flt == biases.has_value()) {
    throw std::invalid_argument(
        std::string("[mlxinfer quantized_matvec] biases: ") +
        (flt ? mode + " has none, found an array" : "expected an array for affine, found None"));
  }
  if (!flt && is_tiled(w)) { // a tiled layer's arrays (tiles.cpp): the CPU's only
    const int64_t K = check_tiled("[mlxinfer quantized_matvec] ", w, scales, *biases, group_size,
                                  bits);
    if (x.ndim() < 1 || x.shape(-1) != K || !is_float(x.dtype())) {
      throw std::invalid_argument(
          "[mlxinfer quantized_matvec] x: expected a float array of shape (..., " +
          std::to_string(K) + "), found " + shape_str(x.shape()));
    }
    if (stream.device == mx::Device::gpu) {
      throw std::invalid_argument("[mlxinfer quantized_matvec] w: a tiled layer runs on the CPU "
                                  "only, found a GPU stream");
    }
    auto out_shape = x.shape();
    out_shape.back() = w.shape(0);
    return mx::array(out_shape, mx::promote_types(x.dtype(), scales.dtype()),
                     std::make_shared<QuantizedMatvec>(stream, group_size, bits, kAffine),
                     {x, w, scales, *biases});
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2 ||
      static_cast<int64_t>(w.shape(1)) * 32 % bits != 0) {
    throw std::invalid_argument(
        "[mlxinfer quantized_matvec] w: expected a 2-D uint32 array of K * bits / 32 words a "
        "row, found shape " +
        shape_str(w.shape()));
  }
  const int N = w.shape(0);
  const int64_t K = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  if (K % group_size != 0) {
    throw std::invalid_argument(
        "[mlxinfer quantized_matvec] w: K = " + std::to_string(K) +
        " is not a multiple of group_size " + std::to_string(group_size));
  }
  const mx::Shape sshape = {N, static_cast<int>(K / group_size)};
  if (flt) {
    if (scales.shape() != sshape || scales.dtype() != mx::uint8) {
      throw std::invalid_argument(
          std::string("[mlxinfer quantized_matvec] scales: expected a uint8 (") + fm->scales +
          ") array of shape " + shape_str(sshape) + ", found " + shape_str(scales.shape()));
    }
  } else if (scales.shape() != sshape || biases->shape() != sshape ||
             !is_float(scales.dtype()) || !is_float(biases->dtype())) {
    throw std::invalid_argument(
        "[mlxinfer quantized_matvec] scales/biases: expected float arrays of shape " +
        shape_str(sshape) + ", found " + shape_str(scales.shape()) + " and " +
        shape_str(biases->shape()));
  }
  if (x.ndim() < 1 || x.shape(-1) != K || !is_float(x.dtype())) {
    throw std::invalid_argument(
        "[mlxinfer quantized_matvec] x: expected a float array of shape (..., " +
        std::to_string(K) + "), found " + shape_str(x.shape()));
  }
  if (stream.device == mx::Device::gpu) {
    return mx::quantized_matmul(x, w, scales, biases, true, group_size, bits, mode, stream);
  }
  auto out_shape = x.shape();
  out_shape.back() = N;
  // MLX's own: x's dtype for the float modes (uint8 scales promote to it), else with the
  // scales'.
  auto out_dtype = mx::promote_types(x.dtype(), scales.dtype());
  std::vector<mx::array> inputs = {x, w, scales};
  if (biases) {
    inputs.push_back(*biases);
  }
  return mx::array(
      out_shape,
      out_dtype,
      std::make_shared<QuantizedMatvec>(stream, group_size, bits, flt ? fm->mode : kAffine),
      std::move(inputs));
}

namespace {

// E8M0 scales (mxfp4, mxfp8) as f32: the exponent field itself (2^(e - 127)); e = 0 is
// 2^-127, a subnormal, and 255 is E8M0's NaN, as MLX decodes them.
void decode_e8m0(const uint8_t* __restrict e, float* __restrict out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t v = e[i];
    const uint32_t bits = v == 0 ? 0x00400000u : v == 255 ? 0x7FC00000u : v << 23;
    std::memcpy(out + i, &bits, sizeof bits);
  }
}

// E4M3 scales (nvfp4) as f32, by a table of the 256 values (e4m3_to_f32).
void decode_e4m3(const uint8_t* __restrict e, float* __restrict out, size_t n) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) {
      t[i] = e4m3_to_f32(static_cast<uint8_t>(i));
    }
    return t;
  }();
  for (size_t i = 0; i < n; ++i) {
    out[i] = table[e[i]];
  }
}

} // namespace

bool QuantizedMatvec::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatvec&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && mode_ == o.mode_;
}

std::vector<mx::Shape> QuantizedMatvec::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

void QuantizedMatvec::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer quantized_matvec] has no GPU kernel (the op hands GPU "
                           "streams to mx.quantized_matmul)");
}

void quantized_matvec_f32(const float* x, int M, const mx::array& w, const mx::array& sc,
                          const mx::array& bi, int gs, int bits, int mode, float* y) {
  if (is_tiled(w)) {
    return tiled_matvec_f32(x, M, w, sc, bi, gs, bits, y);
  }
  if (int16_decode_rows() > 0 && int16_decode(x, M, w, sc, bi, gs, bits, mode, y)) {
    return;
  }
  QmvProblem p;
  p.mode = mode;
  p.N = w.shape(0);
  p.K = static_cast<int>(static_cast<int64_t>(w.shape(1)) * 32 / bits);
  p.isa = qmv_isa(current_isa(), mode, p.K);
  p.M = M;
  p.group_size = gs;
  p.bits = bits;
  const int G = p.K / gs;
  if (p.M == 0 || p.N == 0) {
    return;
  }
  // The vector paths read x de-interleaved (4-bit) or scaled (2/3/5/6-bit): a copy, with the
  // group sums (small: M * K).
  const bool reorder = qmv_uses_xp(bits, p.isa, mode);
  aligned_vector<float> xp(reorder ? static_cast<size_t>(p.M) * p.K : 0);
  std::vector<float> xsum(static_cast<size_t>(p.M) * G);
  p.x = x;
  p.xp = reorder ? xp.data() : x;
  qmv_prepare(p, const_cast<float*>(p.xp), xsum.data());
  p.xsum = xsum.data();
  std::vector<uint32_t> wcopy;
  p.w = contiguous_words(w, wcopy);
  p.y = y;
  // f32 contiguous scales and biases are used in place; others are converted.
  std::vector<float> sf, bf;
  const bool scales_f32 = sc.dtype() == mx::float32 && sc.flags().row_contiguous &&
      bi.dtype() == mx::float32 && bi.flags().row_contiguous;
  std::vector<uint8_t> codes; // the float modes: the uint8 scales, contiguous
  const uint8_t* scale_codes = nullptr;
  if (mode != kAffine) { // scales decoded per block of rows as they run; zero biases
    scale_codes = sc.data<uint8_t>();
    if (!sc.flags().row_contiguous) {
      codes.resize(sc.size());
      std::vector<float> wide(sc.size());
      strided_to_f32<uint8_t>(sc, wide.data());
      for (size_t i = 0; i < wide.size(); ++i) {
        codes[i] = static_cast<uint8_t>(wide[i]);
      }
      scale_codes = codes.data();
    }
    bf.assign(G, 0.0f);
    p.biases = bf.data();
    p.shared_biases = true;
  } else if (scales_f32) {
    p.scales = sc.data<float>();
    p.biases = bi.data<float>();
  } else {
    sf.resize(sc.size());
    bf.resize(bi.size());
    to_f32(sc, sf.data());
    to_f32(bi, bf.data());
    p.scales = sf.data();
    p.biases = bf.data();
  }
  const size_t bytes = static_cast<size_t>(p.N) * p.K * bits / 8;
  parallel_rows(p.N, 8, bytes, [&](int n0, int n1) {
    if (scale_codes == nullptr) {
      return qmv_rows(p, n0, n1);
    }
    // The float modes: each block of 64 rows' scales decoded into a buffer that stays in
    // cache, the rows run as a problem of their own (decoding them all first took 10 µs of
    // 70 for SmolLM2's 576 -> 1536 on one thread, and a pass over 3.5 MB for its head).
    constexpr int kRows = 64;
    const size_t row_words = static_cast<size_t>(p.K) * p.bits / 32;
    std::vector<float> local(static_cast<size_t>(kRows) * G);
    for (int a = n0; a < n1; a += kRows) {
      const int b = std::min(n1, a + kRows);
      (mode == kNvfp4 ? decode_e4m3 : decode_e8m0)(
          scale_codes + static_cast<size_t>(a) * G, local.data(), static_cast<size_t>(b - a) * G);
      QmvProblem q = p;
      q.w = p.w + static_cast<size_t>(a) * row_words;
      q.scales = local.data();
      q.y = p.y + a;
      qmv_rows(q, 0, b - a);
    }
  });
}

void QuantizedMatvec::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = encoder_for(stream(), inputs, out);
  // The float modes have no biases: their scales stand in for them here (never read).
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                    w = mx::array::unsafe_weak_copy(inputs[1]),
                    sc = mx::array::unsafe_weak_copy(inputs[2]),
                    bi = mx::array::unsafe_weak_copy(inputs[inputs.size() > 3 ? 3 : 2]),
                    out = mx::array::unsafe_weak_copy(out),
                    gs = group_size_,
                    bits = bits_,
                    mode = mode_]() mutable {
    const int64_t K = static_cast<int64_t>(w.shape(1)) * (is_tiled(w) ? 8 : 32) / bits;
    const int M = K == 0 ? 0 : static_cast<int>(x.size() / K);
    if (M == 0 || w.shape(0) == 0) {
      return;
    }
    aligned_vector<float> xf(x.size()); // x as f32 rows
    to_f32(x, xf.data());
    std::vector<float> yf;
    const bool direct = out.dtype() == mx::float32;
    if (!direct) {
      yf.resize(out.size());
    }
    quantized_matvec_f32(xf.data(), M, w, sc, bi, gs, bits, mode,
                         direct ? out.data<float>() : yf.data());
    if (!direct) {
      write_out(yf.data(), out);
    }
  });
}

// ----------------------------------------------------------------------------
// Float weights (f32, bf16, f16; f32 accumulation)
// ----------------------------------------------------------------------------

mx::array matvec(const mx::array& x, const mx::array& w, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (w.ndim() != 2 || !is_float(w.dtype())) {
    std::ostringstream found;
    found << shape_str(w.shape()) << " " << w.dtype();
    throw std::invalid_argument(
        "[mlxinfer matvec] w: expected a 2-D float32, bfloat16 or float16 array, found " +
        found.str());
  }
  if (x.ndim() < 1 || x.shape(-1) != w.shape(1) || !is_float(x.dtype())) {
    throw std::invalid_argument(
        "[mlxinfer matvec] x: expected a float array of shape (..., " +
        std::to_string(w.shape(1)) + "), found " + shape_str(x.shape()));
  }
  if (stream.device == mx::Device::gpu) {
    return mx::matmul(x, mx::transpose(w, stream), stream);
  }
  auto out_shape = x.shape();
  out_shape.back() = w.shape(0);
  return mx::array(
      out_shape,
      mx::promote_types(x.dtype(), w.dtype()),
      std::make_shared<Matvec>(stream),
      {x, w});
}

std::vector<mx::Shape> Matvec::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

void Matvec::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[mlxinfer matvec] has no GPU kernel (the op hands GPU streams to mx.matmul)");
}

void Matvec::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = encoder_for(stream(), inputs, out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                    w = mx::array::unsafe_weak_copy(inputs[1]),
                    out = mx::array::unsafe_weak_copy(out)]() mutable {
    MatvecProblem p;
    p.N = w.shape(0);
    p.K = w.shape(1);
    p.M = p.K == 0 ? 0 : static_cast<int>(x.size() / p.K);
    if (p.M == 0 || p.N == 0) {
      return;
    }
    // Contiguous weights are read in place in their own type; a strided view is copied
    // (to f32: views are the rare case, e.g. a transposed weight).
    std::vector<float> wf;
    if (!w.flags().row_contiguous) {
      wf.resize(w.size());
      to_f32(w, wf.data());
      p.w = wf.data();
    } else if (w.dtype() == mx::float32) {
      p.w = w.data<float>();
    } else {
      p.wtype = w.dtype() == mx::bfloat16 ? kBF16 : kF16;
      p.w = w.data<uint16_t>();
    }
    p.isa = matvec_path(current_isa());
    aligned_vector<float> xf(static_cast<size_t>(p.M) * p.K);
    to_f32(x, xf.data());
    matvec_prepare(p, xf.data());
    p.x = xf.data();
    std::vector<float> yf;
    const bool direct = out.dtype() == mx::float32;
    if (!direct) {
      yf.resize(out.size());
    }
    p.y = direct ? out.data<float>() : yf.data();
    const size_t bytes = static_cast<size_t>(p.N) * p.K * (p.wtype == kF32 ? 4 : 2);
    parallel_rows(p.N, 8, bytes, [&](int n0, int n1) { matvec_rows(p, n0, n1); });
    if (!direct) {
      write_out(yf.data(), out);
    }
  });
}

} // namespace mlxinfer
