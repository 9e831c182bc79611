// Helpers the primitives share: argument messages, float conversion of (strided) arrays,
// and splitting rows over the thread pool.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"

#include "threadpool.h"

namespace mlxinfer {

namespace mx = mlx::core;

// A std::vector allocator on 64-byte (cache line) boundaries: a kernel's x rows loaded 16
// floats at a time from a 16-byte aligned malloc block straddle two lines on every load (the
// 8-row quantized product ran ~28% slower so, measured with csrc/ kernels on this project's
// Xeon VM). Its elements are left uninitialised (default-initialised, not zeroed): the
// kernels' buffers are written whole before they are read, and zeroing them was a memset
// per product (8 rows x K floats, twice).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) {
    ::operator delete(p, std::align_val_t(64));
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    if constexpr (sizeof...(Args) == 0) {
      ::new (static_cast<void*>(p)) U; // default-initialised: no zeroing
    } else {
      ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
  }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
};
template <typename T>
using aligned_vector = std::vector<T, CacheLineAllocator<T>>;

// The stream's CPU command encoder with a primitive's inputs and output registered, ready for
// the primitive's dispatch.
inline mx::cpu::CommandEncoder& encoder_for(mx::Stream stream, const std::vector<mx::array>& inputs,
                                            mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  return encoder;
}

inline std::string shape_str(const mx::Shape& s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) {
    o << (i ? ", " : "") << s[i];
  }
  o << (s.size() == 1 ? ",)" : ")");
  return o.str();
}

// Element i (row-major over a's shape) of a strided array, as float.
template <typename T>
void strided_to_f32(const mx::array& a, float* dst) {
  const T* src = a.data<T>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = a.ndim();
  if (a.flags().row_contiguous) {
    for (size_t i = 0; i < a.size(); ++i) {
      dst[i] = static_cast<float>(src[i]);
    }
    return;
  }
  // Runs along the last axis (a transposed view's rows: contiguous where its stride is 1),
  // the other axes' offset recomputed once a run.
  const int64_t run = nd ? shape[nd - 1] : 1, step = nd ? strides[nd - 1] : 0;
  std::vector<int> idx(nd, 0);
  for (size_t i = 0; i < a.size(); i += run) {
    int64_t off = 0;
    for (int d = 0; d + 1 < nd; ++d) {
      off += static_cast<int64_t>(idx[d]) * strides[d];
    }
    const T* r = src + off;
    for (int64_t j = 0; j < run; ++j) {
      dst[i + j] = static_cast<float>(r[j * step]);
    }
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        break;
      }
      idx[d] = 0;
    }
  }
}

inline void to_f32(const mx::array& a, float* dst) {
  switch (a.dtype()) {
    case mx::float32:
      return strided_to_f32<float>(a, dst);
    case mx::float16:
      return strided_to_f32<mx::float16_t>(a, dst);
    case mx::bfloat16:
      return strided_to_f32<mx::bfloat16_t>(a, dst);
    default:
      throw std::runtime_error("[mlxinfer kernels] expected a float16/bfloat16/float32 array");
  }
}

// w's uint32 words, contiguous (a copy only when w is a strided view).
inline const uint32_t* contiguous_words(const mx::array& w, std::vector<uint32_t>& copy) {
  if (w.flags().row_contiguous) {
    return w.data<uint32_t>();
  }
  copy.resize(w.size());
  const uint32_t* src = w.data<uint32_t>();
  for (int64_t r = 0; r < w.shape(0); ++r) {
    for (int64_t c = 0; c < w.shape(1); ++c) {
      copy[r * w.shape(1) + c] = src[r * w.strides()[0] + c * w.strides()[1]];
    }
  }
  return copy.data();
}

inline void write_out(const float* y, mx::array& out) {
  switch (out.dtype()) {
    case mx::float32:
      std::memcpy(out.data<float>(), y, out.size() * sizeof(float));
      return;
    case mx::float16: {
      auto* o = out.data<mx::float16_t>();
      for (size_t i = 0; i < out.size(); ++i) {
        o[i] = static_cast<mx::float16_t>(y[i]);
      }
      return;
    }
    case mx::bfloat16: {
      auto* o = out.data<mx::bfloat16_t>();
      for (size_t i = 0; i < out.size(); ++i) {
        o[i] = static_cast<mx::bfloat16_t>(y[i]);
      }
      return;
    }
    default:
      throw std::runtime_error("[mlxinfer kernels] unsupported output dtype");
  }
}

// Splits [0, N) into tasks of whole blocks of `align` rows, about four per thread (so a
// thread that starts late or is preempted leaves its share to the others). `task_bytes`, where
// nonzero: fewer tasks where the weights are few, about that many bytes each, at least one a
// thread (each task's start costs its claim and its first lines from memory: tiles.cpp).
template <typename F>
void parallel_rows(int N, int align, size_t bytes, F&& f, size_t task_bytes = 0) {
  auto& pool = ThreadPool::instance();
  const int blocks = (N + align - 1) / align;
  // Below ~64 KiB of weights a fan-out costs more than it saves.
  const int nt = bytes < (64u << 10) ? 1 : pool.size();
  int tasks = std::min(blocks, 4 * nt);
  if (task_bytes != 0) {
    const int by_bytes = static_cast<int>(std::min<size_t>(bytes / task_bytes, tasks));
    tasks = std::min(tasks, std::max(nt, by_bytes));
  }
  if (nt <= 1 || tasks <= 1) {
    f(0, N);
    return;
  }
  pool.run(tasks, [&](int i) {
    int n0 = std::min(N, static_cast<int>(static_cast<int64_t>(blocks) * i / tasks) * align);
    int n1 = std::min(N, static_cast<int>(static_cast<int64_t>(blocks) * (i + 1) / tasks) * align);
    if (n0 < n1) {
      f(n0, n1);
    }
  });
}

inline bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// An affine layer's arrays as the kernels take them, or std::invalid_argument naming the one
// that is not (`op`: the message's prefix, "[mlxinfer <op>] "): bits 2, 3, 4, 5, 6 or 8, groups
// of 32, 64 or 128, w (N, K * bits / 32) uint32 words, scales and biases (N, K / group_size)
// float. Returns K.
inline int64_t check_affine(const std::string& op, const mx::array& w, const mx::array& scales,
                            const mx::array& biases, int group_size, int bits) {
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    throw std::invalid_argument(op + "bits: expected 2, 3, 4, 5, 6 or 8, found " +
                                std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument(op + "group_size: expected 32, 64 or 128, found " +
                                std::to_string(group_size));
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2 ||
      static_cast<int64_t>(w.shape(1)) * 32 % bits != 0) {
    throw std::invalid_argument(
        op + "w: expected a 2-D uint32 array of K * bits / 32 words a row, found shape " +
        shape_str(w.shape()));
  }
  const int64_t K = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  if (K % group_size != 0) {
    throw std::invalid_argument(op + "w: K = " + std::to_string(K) +
                                " is not a multiple of group_size " + std::to_string(group_size));
  }
  const mx::Shape sshape = {w.shape(0), static_cast<int>(K / group_size)};
  if (scales.shape() != sshape || biases.shape() != sshape || !is_float(scales.dtype()) ||
      !is_float(biases.dtype())) {
    throw std::invalid_argument(op + "scales/biases: expected float arrays of shape " +
                                shape_str(sshape) + ", found " + shape_str(scales.shape()) +
                                " and " + shape_str(biases.shape()));
  }
  return K;
}


} // namespace mlxinfer
