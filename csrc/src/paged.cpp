// Decode attention over the batching engine's pool pages (fused.h: paged_attention).
#include "fused.h"

#include <atomic>
#include <limits>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"

#include "attention_math.h"
#include "attention_simd.h"
#include "simd.h"
#include "threadpool.h"
#include "util.h"

namespace mlxinfer {

namespace {

// attention_simd.h's float32 path, compiled per instruction set and chosen at run time.
#if defined(MLXINFER_X86)
MLXINFER_AVX512 void paged_f32_avx512(const float* q, const float* K, const float* V,
                                      const uint32_t* table, const bool* seen, int reps, int n,
                                      int block, int D, int Dv, float* scores, float* y,
                                      float* stats) {
  paged_head_f32x16<true>(q, K, V, table, seen, reps, n, block, D, Dv, scores, y, stats);
}

MLXINFER_AVX2 void paged_f32_avx2(const float* q, const float* K, const float* V,
                                  const uint32_t* table, const bool* seen, int reps, int n,
                                  int block, int D, int Dv, float* scores, float* y,
                                  float* stats) {
  paged_head_f32x16<false>(q, K, V, table, seen, reps, n, block, D, Dv, scores, y, stats);
}
#endif

// paged_head16 over quantized keys and values (QuantRows), per instruction set.
template <int BITS, bool WIDE, int WIDEN>
MLXINFER_INLINE void paged_quantized_head(const float* q, const QuantSide& K, const QuantSide& V,
                                          const uint32_t* table, const bool* seen, int reps, int n,
                                          int block, float* scores, float* y, float* stats) {
  paged_head16<WIDE>(q, QuantRows<BITS, WIDEN>{K}, QuantRows<BITS, WIDEN>{V}, table, seen, reps,
                     n, block, K.width, V.width, scores, y, stats);
}

#if defined(MLXINFER_X86)
template <int BITS>
MLXINFER_AVX512 void paged_quantized_avx512(const float* q, const QuantSide& K, const QuantSide& V,
                                            const uint32_t* table, const bool* seen, int reps,
                                            int n, int block, float* scores, float* y,
                                            float* stats) {
  paged_quantized_head<BITS, true, kWidenAvx512>(q, K, V, table, seen, reps, n, block, scores, y,
                                                 stats);
}

template <int BITS>
MLXINFER_AVX2 void paged_quantized_avx2(const float* q, const QuantSide& K, const QuantSide& V,
                                        const uint32_t* table, const bool* seen, int reps, int n,
                                        int block, float* scores, float* y, float* stats) {
  paged_quantized_head<BITS, false, kWidenAvx2>(q, K, V, table, seen, reps, n, block, scores, y,
                                                stats);
}
#endif

// The best path this CPU has; below AVX2 (x86) the same loops in the baseline's vectors.
template <int BITS>
void paged_quantized(const float* q, const QuantSide& K, const QuantSide& V, const uint32_t* table,
                     const bool* seen, int reps, int n, int block, float* scores, float* y,
                     float* stats = nullptr) {
#if defined(MLXINFER_X86)
  if (current_isa() >= kAvx512) {
    return paged_quantized_avx512<BITS>(q, K, V, table, seen, reps, n, block, scores, y, stats);
  }
  if (current_isa() >= kAvx2) {
    return paged_quantized_avx2<BITS>(q, K, V, table, seen, reps, n, block, scores, y, stats);
  }
#endif
  paged_quantized_head<BITS, false, kWidenPlain>(q, K, V, table, seen, reps, n, block, scores, y,
                                                 stats);
}

} // namespace

// attention_simd.h's declaration: false where the float32 path does not apply.
bool attention_f32x16(const float* q, const float* K, const float* V, const uint32_t* table,
                      const bool* seen, int reps, int n, int block, int D, int Dv, float* scores,
                      float* y, float* stats) {
  if (D % 16 != 0 || Dv % 16 != 0) {
    return false;
  }
#if defined(MLXINFER_X86)
  if (current_isa() >= kAvx512) {
    paged_f32_avx512(q, K, V, table, seen, reps, n, block, D, Dv, scores, y, stats);
    return true;
  }
  if (current_isa() >= kAvx2) {
    paged_f32_avx2(q, K, V, table, seen, reps, n, block, D, Dv, scores, y, stats);
    return true;
  }
  return false;
#elif defined(__aarch64__)
  if (current_isa() < kNeon) {
    return false;
  }
  paged_head_f32x16<false>(q, K, V, table, seen, reps, n, block, D, Dv, scores, y, stats);
  return true;
#else
  return false;
#endif
}

void check_pool(const char* op, const mx::array& keys, const mx::array& values) {
  if (keys.ndim() != 4 || values.ndim() != 4 || keys.shape(0) != values.shape(0) ||
      keys.shape(1) != values.shape(1) || keys.shape(2) != values.shape(2) ||
      keys.dtype() != values.dtype()) {
    fail(op, "keys/values: expected (n_blocks, n_kv, block, head_dim) pools of one dtype, found " +
                 shape_str(keys.shape()) + " and " + shape_str(values.shape()));
  }
  check_float(keys, "keys");
}

void check_pages(const char* op, const mx::array& blocks, const mx::array& visible, int B,
                 int n_kv, int block) {
  if (blocks.ndim() != 3 || blocks.shape(0) != B || blocks.shape(1) != n_kv ||
      blocks.dtype() != mx::uint32) {
    fail(op, "blocks: expected a (" + std::to_string(B) + ", " + std::to_string(n_kv) +
                 ", n) uint32 array, found " + shape_str(blocks.shape()));
  }
  const int n = blocks.shape(2);
  if (visible.shape() != mx::Shape{B, 1, n, 1, block} || visible.dtype() != mx::bool_) {
    fail(op, "visible: expected a (" + std::to_string(B) + ", 1, " + std::to_string(n) + ", 1, " +
                 std::to_string(block) + ") bool array, found " + shape_str(visible.shape()));
  }
}

mx::array paged_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                          const mx::array& blocks, const mx::array& visible, float scale,
                          bool reference, mx::StreamOrDevice s) {
  const char* op = "paged_attention";
  check_pool(op, keys, values);
  const int n_kv = keys.shape(1), block = keys.shape(2), D = keys.shape(3), Dv = values.shape(3);
  if (q.ndim() != 4 || q.shape(2) != 1 || q.shape(3) != D || q.shape(1) % n_kv != 0) {
    fail(op, "q: expected (B, n_q, 1, " + std::to_string(D) + ") with n_q a multiple of " +
                 std::to_string(n_kv) + ", found " + shape_str(q.shape()));
  }
  check_float(q, "q");
  const int B = q.shape(0);
  check_pages(op, blocks, visible, B, n_kv, block);
  const int n = blocks.shape(2);
  auto stream = mx::to_stream(s);
  if (reference || stream.device == mx::Device::gpu) {
    const int nb = keys.shape(0);
    auto gathered = [&](const mx::array& pool, int d) {
      auto flat = mx::reshape(pool, {nb * n_kv, block, d}, stream);
      auto rows = mx::take(flat, mx::reshape(blocks, {B * n_kv * n}, stream), 0, stream);
      return mx::reshape(rows, {B, n_kv, n * block, d}, stream);
    };
    auto mask = mx::reshape(visible, {B, 1, 1, n * block}, stream);
    auto o = mx::fast::scaled_dot_product_attention(q, gathered(keys, D), gathered(values, Dv),
                                                    scale, "", mask, {}, false, stream);
    return mx::astype(o, q.dtype(), stream);
  }
  return mx::array({B, q.shape(1), 1, Dv}, q.dtype(), std::make_shared<PagedAttention>(stream, scale),
                   {q, keys, values, blocks, visible});
}

std::vector<mx::Shape> PagedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), 1, inputs[2].shape(3)}};
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer paged_attention] has no GPU kernel (the op hands GPU "
                           "streams to MLX's own ops)");
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = encoder_for(stream(), inputs, out);
  encoder.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]),
                    keys = mx::array::unsafe_weak_copy(inputs[1]),
                    values = mx::array::unsafe_weak_copy(inputs[2]),
                    blocks = mx::array::unsafe_weak_copy(inputs[3]),
                    visible = mx::array::unsafe_weak_copy(inputs[4]),
                    out = mx::array::unsafe_weak_copy(out), scale = scale_]() mutable {
    const int B = q.shape(0), n_q = q.shape(1), Dv = values.shape(3);
    std::vector<float> qf(q.size());
    to_f32(q, qf.data()); // (B, n_q, D): the group's queries are consecutive
    round_to(q.dtype(), qf.data(), qf.size());
    for (auto& x : qf) {
      x *= scale; // as the reference: the queries scaled in their own dtype
    }
    round_to(q.dtype(), qf.data(), qf.size());
    std::vector<float> y(static_cast<size_t>(B) * n_q * Dv);
    paged_attend(qf, B, n_q, keys, values, blocks, visible, y);
    write_out(y.data(), out);
  });
}


namespace {

// The tasks of a paged attention, one a (row, KV head) i: its n blocks from the table (an entry
// out of the pool reads block 0, masked: the op's contract), a scores buffer for its reps query
// heads, its queries' offset in (B, n_q, D) and its outputs' in (B, n_q, Dv); on the kernels'
// threads where the work is large enough.
template <typename Head>
void each_head(int B, int n_q, int n_kv, int n, int block, int D, int Dv, const uint32_t* table,
               size_t kv_slots, const Head& head) {
  const int reps = n_q / n_kv;
  auto task = [&](int i) {
    const int b = i / n_kv, h = i % n_kv;
    std::vector<uint32_t> rows(table + static_cast<size_t>(i) * n,
                               table + static_cast<size_t>(i + 1) * n);
    for (auto& r : rows) {
      r = r < kv_slots ? r : 0;
    }
    std::vector<float> scores(static_cast<size_t>(reps) * n * block);
    const size_t first = static_cast<size_t>(b) * n_q + h * reps; // the group's first query head
    head(b, rows.data(), scores.data(), first * D, first * Dv);
  };
  auto& pool = ThreadPool::instance();
  const int64_t work = static_cast<int64_t>(B) * n_q * n * block * (D + Dv);
  if (pool.size() <= 1 || work < (1 << 17)) {
    for (int i = 0; i < B * n_kv; ++i) {
      task(i);
    }
  } else {
    pool.run(B * n_kv, task);
  }
}

// Fewer (row, KV head) pairs than twice the threads (one row of SmolLM2's 3 KV heads: 3 tasks
// on 2 threads; of Gemma-3's one: 1, so one thread): each pair's blocks attended in parts on
// the threads, each part normalised over its own keys, then joined (join_attention_parts), so
// the threads share the keys' bytes; the float32 and quantized pools' vector paths (the callers'
// `part`). False where it does not apply.
// One row, the same bytes of keys and values over and over (Xeon VM, 2 threads): 3 KV heads
// read 22.0-22.7 GB/s and 1 KV head 13.6-14.0, where 2 or 4 heads read 25.5-29.6; in parts
// 35.5-46.9.
// `part(b, h, rows, seen, n_c, block, scores, y, stats)`: row b's KV head h over n_c blocks of
// `block` keys, each query head normalised over them, its (top, total) in stats; false where it
// cannot. Fewer blocks than parts (a plain cache read as one block a head: --kv-bits) are cut
// into sub-blocks, block k·j + i the i-th of block j's k.
template <typename Part>
bool attend_in_parts(int B, int n_q, int n_kv, int n, int block, int D, int Dv,
                     const uint32_t* table, const bool* seen, size_t kv_slots,
                     std::vector<float>& y, const Part& part) {
  auto& pool = ThreadPool::instance();
  const int threads = pool.size(), pairs = B * n_kv, reps = n_q / n_kv;
  const int64_t work = static_cast<int64_t>(B) * n_q * n * block * (D + Dv);
  if (threads <= 1 || work < (1 << 17) || pairs >= 2 * threads || D % 16 != 0 ||
      Dv % 16 != 0) {
    return false;
  }
  const int wanted = (2 * threads + pairs - 1) / pairs;
  int k = 1; // sub-blocks a block: the least from what is wanted that divides it (a cache's
             // capacity can be any length: 2,067 = 3 x 689), else none
  if (n < wanted) {
    for (int c = (wanted + n - 1) / n; c <= 4 * wanted && k == 1; ++c) {
      k = block % c == 0 ? c : 1;
    }
  }
  const int nb = n * k, sb = block / k, parts = k > 1 ? nb : std::min(n, wanted);
  if (parts <= 1) {
    return false;
  }
  std::vector<float> ys(static_cast<size_t>(pairs) * parts * reps * Dv);
  std::vector<float> stats(static_cast<size_t>(pairs) * parts * reps * 2);
  std::atomic<bool> ok{true};
  pool.run(pairs * parts, [&](int t) {
    const int i = t / parts, c = t % parts, b = i / n_kv, h = i % n_kv;
    const int c0 = static_cast<int>(static_cast<int64_t>(nb) * c / parts);
    const int c1 = static_cast<int>(static_cast<int64_t>(nb) * (c + 1) / parts);
    std::vector<uint32_t> rows(c1 - c0);
    for (int u = c0; u < c1; ++u) {
      const uint32_t r = table[static_cast<size_t>(i) * n + u / k];
      rows[u - c0] = (r < kv_slots ? r : 0) * k + u % k;
    }
    std::vector<float> scores(static_cast<size_t>(reps) * (c1 - c0) * sb);
    const size_t at = static_cast<size_t>(t) * reps;
    if (!part(b, h, rows.data(), seen + (static_cast<size_t>(b) * nb + c0) * sb, c1 - c0, sb,
              scores.data(), ys.data() + at * Dv, stats.data() + at * 2)) {
      ok = false;
    }
  });
  if (!ok) {
    return false; // no vector path on this CPU: each_head's loops
  }
  for (int i = 0; i < pairs; ++i) {
    const int b = i / n_kv, h = i % n_kv;
    const size_t at = static_cast<size_t>(i) * parts * reps;
    join_attention_parts(ys.data() + at * Dv, stats.data() + at * 2, parts, reps, Dv,
                         y.data() + (static_cast<size_t>(b) * n_q + h * reps) * Dv);
  }
  return true;
}

} // namespace

void paged_attend(const std::vector<float>& qf, int B, int n_q, const mx::array& keys,
                  const mx::array& values, const mx::array& blocks, const mx::array& visible,
                  std::vector<float>& y) {
  const int n_kv = keys.shape(1), block = keys.shape(2), D = keys.shape(3), Dv = values.shape(3);
  const int n = blocks.shape(2), reps = n_q / n_kv;
  std::vector<char> kcopy, vcopy, tcopy, mcopy;
  const char* kp = contiguous_bytes(keys, kcopy);
  const char* vp = contiguous_bytes(values, vcopy);
  const auto* table = reinterpret_cast<const uint32_t*>(contiguous_bytes(blocks, tcopy));
  const auto* seen = reinterpret_cast<const bool*>(contiguous_bytes(visible, mcopy));
  const bool round_probs = keys.dtype() != mx::float32;
  const size_t kv_slots = static_cast<size_t>(keys.shape(0)) * n_kv;
  if (keys.dtype() == mx::float32 &&
      attend_in_parts(B, n_q, n_kv, n, block, D, Dv, table, seen, kv_slots, y,
                      [&](int b, int h, const uint32_t* rows, const bool* sb, int n_c, int blk,
                          float* scores, float* yp, float* stats) {
                        const size_t first = static_cast<size_t>(b) * n_q + h * reps;
                        return attention_f32x16(qf.data() + first * D,
                                                reinterpret_cast<const float*>(kp),
                                                reinterpret_cast<const float*>(vp), rows, sb, reps,
                                                n_c, blk, D, Dv, scores, yp, stats);
                      })) {
    return;
  }
  each_head(B, n_q, n_kv, n, block, D, Dv, table, kv_slots,
            [&](int b, const uint32_t* rows, float* scores, size_t q_at, size_t y_at) {
    const float* qh = qf.data() + q_at;
    float* yh = y.data() + y_at;
    const bool* sb = seen + static_cast<size_t>(b) * n * block;
    switch (keys.dtype()) {
      case mx::float32:
        if (attention_f32x16(qh, reinterpret_cast<const float*>(kp), reinterpret_cast<const float*>(vp),
                      rows, sb, reps, n, block, D, Dv, scores, yh)) {
          return;
        }
        return paged_head(qh, reinterpret_cast<const float*>(kp), reinterpret_cast<const float*>(vp),
                          rows, sb, reps, n, block, D, Dv, round_probs, scores, yh);
      case mx::float16:
        return paged_head(qh, reinterpret_cast<const mx::float16_t*>(kp),
                          reinterpret_cast<const mx::float16_t*>(vp), rows, sb, reps, n,
                          block, D, Dv, round_probs, scores, yh);
      case mx::bfloat16:
        return paged_head(qh, reinterpret_cast<const mx::bfloat16_t*>(kp),
                          reinterpret_cast<const mx::bfloat16_t*>(vp), rows, sb, reps, n,
                          block, D, Dv, round_probs, scores, yh);
      default:
        return;
    }
  });
}

// One (n_blocks, n_kv, block, width) side of a quantized pool: packed uint32 codes, float32
// scales and biases per group. Its width; one-line errors naming `op` and the side.
int check_quantized_side(const char* op, const char* side, const std::vector<mx::array>& parts,
                         int group_size, int bits) {
  if (parts.size() != 3) {
    fail(op, std::string(side) + ": expected [packed, scales, biases], found " +
                 std::to_string(parts.size()) + " arrays");
  }
  const auto& w = parts[0];
  if (w.ndim() != 4 || w.dtype() != mx::uint32) {
    fail(op, std::string(side) + ": expected (n_blocks, n_kv, block, words) uint32 codes, found " +
                 shape_str(w.shape()));
  }
  const int width = w.shape(3) * 32 / bits;
  const mx::Shape groups{w.shape(0), w.shape(1), w.shape(2), width / group_size};
  for (int i = 1; i < 3; ++i) {
    if (parts[i].shape() != groups || parts[i].dtype() != mx::float32) {
      fail(op, std::string(side) + ": expected float32 " + (i == 1 ? "scales " : "biases ") +
                   shape_str(groups) + ", found " + shape_str(parts[i].shape()));
    }
  }
  return width;
}

void check_quantized_format(const char* op, int group_size, int bits) {
  if (bits != 4 && bits != 8) {
    fail(op, "bits: expected 4 or 8, found " + std::to_string(bits));
  }
  if (group_size < 16 || (group_size & (group_size - 1)) != 0) {
    fail(op, "group_size: expected a power of two of 16 or more, found " +
                 std::to_string(group_size));
  }
}

void quantize_row(const float* v, int D, int group_size, int bits, uint32_t* codes,
                  float* scales, float* biases) {
  // mlx/backend/cpu/quantized.cpp's quantize, for float32 and 4 or 8 bits.
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const float eps = 1e-7f;
  const int per_word = 32 / bits;
  for (int g = 0; g < D / group_size; ++g) {
    const float* w = v + static_cast<size_t>(g) * group_size;
    float w_min = std::numeric_limits<float>::infinity(), w_max = -w_min;
    for (int j = 0; j < group_size; ++j) {
      w_max = std::max(w_max, w[j]);
      w_min = std::min(w_min, w[j]);
    }
    const bool mask = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = mask ? scale : -scale;
    const float edge = mask ? w_min : w_max;
    const float q0 = std::rint(edge / scale);
    float bias = 0;
    if (q0 != 0) {
      scale = edge / q0;
      bias = edge;
    }
    for (int j = 0; j < group_size / per_word; ++j) {
      uint32_t word = 0;
      for (int k = 0; k < per_word; ++k) {
        float e = std::rint((w[j * per_word + k] - bias) / scale);
        e = std::min(std::max(e, 0.0f), n_bins);
        word |= static_cast<uint32_t>(e) << (k * bits);
      }
      codes[static_cast<size_t>(g) * group_size / per_word + j] = word;
    }
    scales[g] = scale;
    biases[g] = bias;
  }
}

mx::array paged_attention_quantized(const mx::array& q, const std::vector<mx::array>& keys,
                                    const std::vector<mx::array>& values, const mx::array& blocks,
                                    const mx::array& visible, float scale, int group_size,
                                    int bits, mx::StreamOrDevice s) {
  const char* op = "paged_attention_quantized";
  check_quantized_format(op, group_size, bits);
  const int D = check_quantized_side(op, "keys", keys, group_size, bits);
  const int Dv = check_quantized_side(op, "values", values, group_size, bits);
  if (D % group_size != 0 || Dv % group_size != 0) {
    fail(op, "keys/values: widths " + std::to_string(D) + " and " + std::to_string(Dv) +
                 " must be whole groups of " + std::to_string(group_size));
  }
  for (int i = 0; i < 3; ++i) {
    if (values[i].shape(0) != keys[i].shape(0) || values[i].shape(1) != keys[i].shape(1) ||
        values[i].shape(2) != keys[i].shape(2)) {
      fail(op, "values: expected the keys' (n_blocks, n_kv, block), found " +
                   shape_str(values[i].shape()));
    }
  }
  const int n_kv = keys[0].shape(1), block = keys[0].shape(2);
  if (q.ndim() != 4 || q.shape(2) != 1 || q.shape(3) != D || q.shape(1) % n_kv != 0 ||
      q.dtype() != mx::float32) {
    fail(op, "q: expected float32 (B, n_q, 1, " + std::to_string(D) +
                 ") with n_q a multiple of " + std::to_string(n_kv) + ", found " +
                 shape_str(q.shape()));
  }
  const int B = q.shape(0);
  check_pages(op, blocks, visible, B, n_kv, block);
  auto stream = mx::to_stream(s);
  if (stream.device == mx::Device::gpu) { // MLX's own ops: the blocks gathered, dequantized
    const int nb = keys[0].shape(0), n = blocks.shape(2);
    auto gathered = [&](const std::vector<mx::array>& side) {
      auto index = mx::reshape(blocks, {B * n_kv * n}, stream);
      std::vector<mx::array> rows;
      for (const auto& a : side) {
        auto flat = mx::reshape(a, {nb * n_kv, block, a.shape(3)}, stream);
        rows.push_back(mx::reshape(mx::take(flat, index, 0, stream),
                                   {B, n_kv, n * block, a.shape(3)}, stream));
      }
      return mx::dequantize(rows[0], rows[1], rows[2], group_size, bits, "affine",
                            std::nullopt, std::nullopt, stream);
    };
    auto mask = mx::reshape(visible, {B, 1, 1, n * block}, stream);
    return mx::fast::scaled_dot_product_attention(q, gathered(keys), gathered(values), scale, "",
                                                  mask, {}, false, stream);
  }
  std::vector<mx::array> inputs{q};
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  inputs.push_back(blocks);
  inputs.push_back(visible);
  return mx::array({B, q.shape(1), 1, Dv}, mx::float32,
                   std::make_shared<PagedQuantizedAttention>(stream, scale, group_size, bits),
                   std::move(inputs));
}

std::vector<mx::Shape> PagedQuantizedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), 1, inputs[4].shape(3) * 32 / bits_}};
}

void PagedQuantizedAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxinfer paged_attention_quantized] has no GPU kernel (the op hands "
                           "GPU streams to MLX's own ops)");
}

void PagedQuantizedAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = encoder_for(stream(), inputs, out);
  std::vector<mx::array> in;
  for (const auto& a : inputs) {
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  encoder.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(out), scale = scale_,
                    group_size = group_size_, bits = bits_]() mutable {
    const auto& q = in[0];
    const int B = q.shape(0), n_q = q.shape(1), Dv = in[4].shape(3) * 32 / bits;
    std::vector<float> qf(q.size());
    to_f32(q, qf.data());
    for (auto& x : qf) {
      x *= scale;
    }
    std::vector<float> y(static_cast<size_t>(B) * n_q * Dv);
    paged_attend_quantized(qf, B, n_q, {in[1], in[2], in[3]}, {in[4], in[5], in[6]}, in[7], in[8],
                           group_size, bits, y);
    write_out(y.data(), out);
  });
}

void paged_attend_quantized(const std::vector<float>& qf, int B, int n_q,
                            const std::vector<mx::array>& keys,
                            const std::vector<mx::array>& values, const mx::array& blocks,
                            const mx::array& visible, int group_size, int bits,
                            std::vector<float>& y) {
  const int n_kv = keys[0].shape(1), block = keys[0].shape(2);
  const int n = blocks.shape(2), reps = n_q / n_kv;
  const int D = keys[0].shape(3) * 32 / bits, Dv = values[0].shape(3) * 32 / bits;
  std::vector<std::vector<char>> copies(8);
  auto bytes = [&](const mx::array& a, int i) { return contiguous_bytes(a, copies[i]); };
  const int shift = __builtin_ctz(static_cast<unsigned>(group_size));
  auto side = [&](const std::vector<mx::array>& parts, int at, int width) {
    return QuantSide{reinterpret_cast<const uint8_t*>(bytes(parts[0], at)),
                     reinterpret_cast<const float*>(bytes(parts[1], at + 1)),
                     reinterpret_cast<const float*>(bytes(parts[2], at + 2)), width, shift,
                     width / group_size};
  };
  const QuantSide K = side(keys, 0, D), V = side(values, 3, Dv);
  const auto* table = reinterpret_cast<const uint32_t*>(bytes(blocks, 6));
  const auto* seen = reinterpret_cast<const bool*>(bytes(visible, 7));
  const size_t kv_slots = static_cast<size_t>(keys[0].shape(0)) * n_kv;
  if (attend_in_parts(B, n_q, n_kv, n, block, D, Dv, table, seen, kv_slots, y,
                      [&](int b, int h, const uint32_t* rows, const bool* sb, int n_c, int blk,
                          float* scores, float* yp, float* stats) {
                        const float* q = qf.data() + (static_cast<size_t>(b) * n_q + h * reps) * D;
                        if (bits == 8) {
                          paged_quantized<8>(q, K, V, rows, sb, reps, n_c, blk, scores, yp, stats);
                        } else {
                          paged_quantized<4>(q, K, V, rows, sb, reps, n_c, blk, scores, yp, stats);
                        }
                        return true;
                      })) {
    return;
  }
  each_head(B, n_q, n_kv, n, block, D, Dv, table, kv_slots,
            [&](int b, const uint32_t* rows, float* scores, size_t q_at, size_t y_at) {
    const bool* sb = seen + static_cast<size_t>(b) * n * block;
    if (bits == 8) {
      paged_quantized<8>(qf.data() + q_at, K, V, rows, sb, reps, n, block, scores, y.data() + y_at);
    } else {
      paged_quantized<4>(qf.data() + q_at, K, V, rows, sb, reps, n, block, scores, y.data() + y_at);
    }
  });
}

} // namespace mlxinfer
