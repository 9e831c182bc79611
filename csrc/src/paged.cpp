// Decode attention over the batching engine's pool pages (fused.h: paged_attention).
#include "fused.h"

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
                                      int block, int D, int Dv, float* scores, float* y) {
  paged_head_f32x16<true>(q, K, V, table, seen, reps, n, block, D, Dv, scores, y);
}

MLXINFER_AVX2 void paged_f32_avx2(const float* q, const float* K, const float* V,
                                  const uint32_t* table, const bool* seen, int reps, int n,
                                  int block, int D, int Dv, float* scores, float* y) {
  paged_head_f32x16<false>(q, K, V, table, seen, reps, n, block, D, Dv, scores, y);
}
#endif

} // namespace

// attention_simd.h's declaration: false where the float32 path does not apply.
bool attention_f32x16(const float* q, const float* K, const float* V, const uint32_t* table,
                      const bool* seen, int reps, int n, int block, int D, int Dv, float* scores,
                      float* y) {
  if (D % 16 != 0 || Dv % 16 != 0) {
    return false;
  }
#if defined(MLXINFER_X86)
  if (current_isa() >= kAvx512) {
    paged_f32_avx512(q, K, V, table, seen, reps, n, block, D, Dv, scores, y);
    return true;
  }
  if (current_isa() >= kAvx2) {
    paged_f32_avx2(q, K, V, table, seen, reps, n, block, D, Dv, scores, y);
    return true;
  }
  return false;
#elif defined(__aarch64__)
  if (current_isa() < kNeon) {
    return false;
  }
  paged_head_f32x16<false>(q, K, V, table, seen, reps, n, block, D, Dv, scores, y);
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
  auto task = [&](int i) { // one (row, kv head)
    const int b = i / n_kv, h = i % n_kv;
    std::vector<uint32_t> rows(table + static_cast<size_t>(i) * n, table + static_cast<size_t>(i + 1) * n);
    for (auto& r : rows) {
      r = r < kv_slots ? r : 0; // out of the pool: a masked padding block (the op's contract)
    }
    std::vector<float> scores(static_cast<size_t>(reps) * n * block);
    const float* qh = qf.data() + (static_cast<size_t>(b) * n_q + h * reps) * D;
    float* yh = y.data() + (static_cast<size_t>(b) * n_q + h * reps) * Dv;
    const bool* sb = seen + static_cast<size_t>(b) * n * block;
    switch (keys.dtype()) {
      case mx::float32:
        if (attention_f32x16(qh, reinterpret_cast<const float*>(kp), reinterpret_cast<const float*>(vp),
                      rows.data(), sb, reps, n, block, D, Dv, scores.data(), yh)) {
          return;
        }
        return paged_head(qh, reinterpret_cast<const float*>(kp), reinterpret_cast<const float*>(vp),
                          rows.data(), sb, reps, n, block, D, Dv, round_probs, scores.data(), yh);
      case mx::float16:
        return paged_head(qh, reinterpret_cast<const mx::float16_t*>(kp),
                          reinterpret_cast<const mx::float16_t*>(vp), rows.data(), sb, reps, n,
                          block, D, Dv, round_probs, scores.data(), yh);
      case mx::bfloat16:
        return paged_head(qh, reinterpret_cast<const mx::bfloat16_t*>(kp),
                          reinterpret_cast<const mx::bfloat16_t*>(vp), rows.data(), sb, reps, n,
                          block, D, Dv, round_probs, scores.data(), yh);
      default:
        return;
    }
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

} // namespace mlxinfer
