// Python face of the kernels: module _mlxinfer_kernels.
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/version.h"

#include "block.h"
#include "fused.h"
#include "kernels.h"
#include "primitives.h"
#include "sample.h"
#include "threadpool.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace {

// A quantized layer from Python: (w, scales, biases, group_size, bits).
using Layer = std::tuple<mx::array, mx::array, mx::array, int, int>;
// A pool's side: one float array, or a quantized pool's [codes, scales, biases].
using Side = std::variant<mx::array, std::vector<mx::array>>;

std::vector<mx::array> side_of(const Side& s) {
  if (const auto* a = std::get_if<mx::array>(&s)) {
    return {*a};
  }
  return std::get<std::vector<mx::array>>(s);
}

mlxinfer::QuantLayer layer_of(const Layer& t) {
  return {std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t)};
}

std::vector<mlxinfer::QuantLayer> layers_of(const std::vector<Layer>& ts) {
  std::vector<mlxinfer::QuantLayer> out;
  for (const auto& t : ts) {
    out.push_back(layer_of(t));
  }
  return out;
}

} // namespace

#define MLXINFER_STR2(x) #x
#define MLXINFER_STR(x) MLXINFER_STR2(x)
// The MLX version of the headers compiled against; a test build overrides it (with
// -DMLXINFER_BUILT_FOR='"0.0.0"') to check that the import refuses a mismatch.
#ifndef MLXINFER_BUILT_FOR
#define MLXINFER_BUILT_FOR                                      \
  MLXINFER_STR(MLX_VERSION_MAJOR)                               \
  "." MLXINFER_STR(MLX_VERSION_MINOR) "." MLXINFER_STR(MLX_VERSION_PATCH)
#endif

NB_MODULE(_mlxinfer_kernels, m) {
  m.doc() = "mlxinfer's compiled CPU kernels for MLX (quantized and f32 matrix x vector)";

  // The primitives' layout and the array ABI are MLX-version specific: refuse to load
  // against another libmlx than the headers this was compiled with.
  const std::string runtime = mlx::core::version();
  const std::string built_for = MLXINFER_BUILT_FOR;
  // Exact, or a dev build of that version ("0.32.4.dev20260101+abc").
  if (runtime != built_for && runtime.rfind(built_for + ".", 0) != 0) {
    throw nb::import_error(
        ("_mlxinfer_kernels: built for MLX " + built_for + ", found MLX " + runtime +
         "; reinstall mlxinfer (pip install) or rebuild with tools/build_kernels.py")
            .c_str());
  }
  m.attr("mlx_version") = built_for;
  // The bindings' version: raised whenever a function's name or arguments change (the Python
  // side, mlxinfer.backends.kernels.API, refuses another: a module left from an older
  // checkout would otherwise fail mid-decode). 1: pool_write of both sides, fuse.
  m.attr("api") = 3;
  m.attr("best_isa") = mlxinfer::isa_name(mlxinfer::best_isa());
  // quantized_matvec's modes (a module built before mxfp4 lacks the attribute: affine only).
  m.attr("quantized_modes") = nb::make_tuple("affine", "mxfp4", "nvfp4", "mxfp8");

  m.def(
      "quantized_matvec",
      &mlxinfer::quantized_matvec,
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a.none(),
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "mode"_a = "affine",
      "stream"_a = nb::none(),
      "x (..., K) @ dequantize(w, scales, biases).T, as "
      "mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits, mode) "
      "(mode 'affine': bits 2, 3, 4, 5, 6 or 8, group_size 32/64/128; mode 'mxfp4': bits 4, "
      "group_size 32, uint8 E8M0 scales; 'nvfp4': bits 4, group_size 16, uint8 E4M3 scales; "
      "'mxfp8': bits 8, group_size 32, uint8 E8M0 scales; the float modes' biases None).");
  m.def(
      "quantized_matmul_i16",
      &mlxinfer::quantized_matmul_i16,
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "x (..., K) @ dequantize(w, scales, biases).T for many rows (a prefill's), affine 2, 3, 4, "
      "5, 6 or 8 bits, group_size 32/64/128, w's rows a multiple of 32: x rounded to int16 per "
      "block of 32 inputs and AVX-512 VNNI's int16 products (prefill_i16.cpp; error at most "
      "sum |s q| * (the block's max |x| / 32767) / 2 an output beyond float32's). Only where "
      "vnni_available().");
  m.def(
      "prefill_attention",
      &mlxinfer::prefill_attention,
      "q"_a,
      "k"_a,
      "v"_a,
      nb::kw_only(),
      "scale"_a,
      "causal"_a,
      "mask"_a = nb::none(),
      "stream"_a = nb::none(),
      "softmax(q k^T * scale) v for prompts' queries: q (B, n_q, L, D), k (B, n_kv, T, D), v "
      "(B, n_kv, T, Dv), float32, head dims multiples of 16; causal: query i sees the first T - L "
      "+ i + 1 keys (as mx.fast.scaled_dot_product_attention's 'causal'); or mask, a bool (B or "
      "1, 1, L, T) array of the keys each query sees (a batch's rows); each query position the "
      "decode path's vector attention over the keys it sees.");
  m.def("set_int16_decode_rows", &mlxinfer::set_int16_decode_rows, "rows"_a,
        "Up to how many rows of x (0: none, the default; at most 4) every quantized product of "
        "affine codes (quantized_matvec and the fused blocks' products) rounds x to int16 per "
        "block of 32 and runs the int16 product's few-row path, where vnni_available(); "
        "process-wide.");
  m.def("int16_decode_rows", &mlxinfer::int16_decode_rows,
        "What set_int16_decode_rows last set (0 at import).");
  m.def("tile_layer", &mlxinfer::tile_layer, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, "half"_a, "drop_symmetric"_a = true,
        "A 4-, 5-, 6- or 8-bit affine layer's (codes, scales, biases) laid out as a tiled layer "
        "(tiles.cpp): uint8 codes (N, K * bits / 8) in [tile][block][pair] order, scales and "
        "biases [tile][group][32] in float16 with `half` (exact only where every value is one), "
        "else float32; with `drop_symmetric`, biases of shape (0,) where every one is "
        "-2^(bits - 1) times its scale (GGUF's Q4_0, Q5_0, Q8_0): the products take them from "
        "the scales.");
  m.def("tiles_available", &mlxinfer::tiles_available,
        "Whether tiled layers run here (tiles.cpp: quantized_matvec and the fused blocks take a "
        "4-, 5-, 6- or 8-bit affine layer's codes as a tiled uint8 array): AVX-512 F and BW, or else "
        "AVX2 (the same outputs), at the kernels' ISA level.");
  m.def("avx_vnni_available", &mlxinfer::avx_vnni_available,
        "Whether the AVX2 tiles sum their int16 products with AVX-VNNI's 256-bit vpdpwssd (the "
        "same int32 sums as vpmaddwd and vpaddd): the CPU has it, the level is AVX2, and the cap "
        "is not 'avx2' (set_max_isa('avxvnni') or a CPU whose best level is AVX2).");
  m.def("tiles_wide_available", &mlxinfer::tiles_wide_available,
        "Whether tiled layers run their 512-bit path (AVX-512 F and BW; no VBMI needed: Cascade "
        "Lake and Skylake-SP too), else the AVX2 one; at the kernels' ISA level.");
  m.def("tiles_wide_vnni", &mlxinfer::tiles_wide_vnni,
        "Whether the 512-bit tiles sum with AVX-512 VNNI's vpdpwssd (else vpmaddwd and vpaddd, "
        "the same sums: Skylake-SP, or the 'avx512bw' cap).");
  m.def("set_int8_activations", &mlxinfer::set_int8_activations, "on"_a,
        "Int8 activations in the tiled products (opt-in, an accuracy trade: x rounded to int8 per "
        "block of 32, as llama.cpp's Q8_0 activations; MLXINFER_INT8_ACTIVATIONS=1 at load). "
        "Runs in the tiled products where tiles_int8_available() and in quantized_matmul_i16; "
        "elsewhere int16 as before.");
  m.def("int8_activations", &mlxinfer::int8_activations,
        "Whether set_int8_activations(True) is in effect.");
  m.def("tiles_int8_available", &mlxinfer::tiles_int8_available,
        "Whether int8 tiled products run here, at the kernels' ISA level: the 512-bit tiles "
        "with AVX-512 VNNI (every width), or the AVX2 tiles (4-bit layers).");
  m.def("vnni_available", &mlxinfer::vnni_available,
        "Whether quantized_matmul_i16 runs here: AVX-512 F, BW, VNNI and VBMI, at the kernels' ISA "
        "level (set_max_isa).");
  m.def(
      "dequantize",
      &mlxinfer::dequantize,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "mx.dequantize(w, scales, biases, group_size, bits) for MLX's affine codes (bits 2, 3, 4, "
      "5, 6 or 8, group_size 32/64/128): s * q + b in f32, rows on the kernels' threads; "
      "output in the scales' dtype.");
  m.def(
      "matvec",
      &mlxinfer::matvec,
      "x"_a,
      "w"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "x (..., K) @ w.T with w (N, K) float32, bfloat16 or float16 (f32 accumulation; "
      "output dtype promote_types(x, w)).");
  m.def(
      "rms_norm",
      &mlxinfer::rms_norm,
      "x"_a,
      "w"_a,
      "eps"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "RMSNorm of x's rows (float32 statistics, rounded to x's dtype, then times w), as "
      "mx.fast.rms_norm(x, w, eps).");
  m.def(
      "log_softmax",
      &mlxinfer::log_softmax,
      "x"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "x - logsumexp(x) over the last axis, in float32 (a vectorised exp, relative error "
      "~1.5e-7).");
  m.def(
      "log_softmax_argmax",
      &mlxinfer::log_softmax_argmax,
      "x"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "[log_softmax(x), argmax(x, -1)] in one pass over the rows on the kernels' threads: "
      "the argmax uint32 as mx.argmax gives it (the first NaN where a row has one, else the "
      "first of its largest values).");
  m.def(
      "swiglu",
      &mlxinfer::swiglu,
      "gate"_a,
      "up"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "silu(gate) * up for float32 gate and up of one shape (a vectorised exp, relative error "
      "~1.5e-7).");
  m.def(
      "gelu_tanh_glu",
      &mlxinfer::gelu_tanh_glu,
      "gate"_a,
      "up"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "gelu_approx(gate) * up (GELU's tanh form, as gate * sigmoid(2 sqrt(2/pi) (gate + "
      "0.044715 gate^3))) for float32 gate and up of one shape (a vectorised exp).");
  m.def(
      "cache_write",
      [](const mx::array& buffer, const mx::array& x, const mx::array& cos, const mx::array& sin,
         int offset, int dims, bool traditional, int start, bool reference,
         mx::StreamOrDevice s) {
        return mlxinfer::cache_write(buffer, x, cos, sin,
                                     {0, buffer.ndim() == 4 ? buffer.shape(1) : 0, offset, 0.0f,
                                      dims, traditional, start},
                                     reference, s);
      },
      "buffer"_a, "x"_a, "cos"_a, "sin"_a, nb::kw_only(), "offset"_a, "dims"_a = 0,
      "traditional"_a = false, "start"_a = 0, "reference"_a = false, "stream"_a = nb::none(),
      "A (1, n_kv, capacity, head_dim) cache buffer with one token's x (n_kv * head_dim values "
      "from x's element start: 0, or a token's k or v in a q | k | v row; its first dims "
      "features rotated by the (dims/2) cos/sin table) written at offset; in place where MLX "
      "may donate the buffer. reference: MLX's own ops.");
  m.def(
      "decode_attention",
      [](const mx::array& q, const mx::array& keys, const mx::array& values, const mx::array& cos,
         const mx::array& sin, int n_q, int offset, float scale, int dims, bool traditional,
         bool reference, mx::StreamOrDevice s) {
        return mlxinfer::decode_attention(
            q, keys, values, cos, sin,
            {n_q, keys.ndim() == 4 ? keys.shape(1) : 0, offset, scale, dims, traditional},
            reference, s);
      },
      "q"_a, "keys"_a, "values"_a, "cos"_a, "sin"_a, nb::kw_only(), "n_q"_a, "offset"_a,
      "scale"_a, "dims"_a, "traditional"_a = false, "reference"_a = false, "stream"_a = nb::none(),
      "One token's attention: softmax(rope(q) k^T scale) v over the offset + 1 first tokens of the "
      "(1, n_kv, capacity, head_dim) buffers; (..., n_q * D) -> (..., n_q * Dv). reference: "
      "MLX's own ops.");
  m.def(
      "paged_attention",
      [](const mx::array& q, const mx::array& keys, const mx::array& values,
         const mx::array& blocks, const mx::array& visible, float scale, bool reference,
         mx::StreamOrDevice s) {
        return mlxinfer::paged_attention(q, keys, values, blocks, visible, scale, reference, s);
      },
      "q"_a, "keys"_a, "values"_a, "blocks"_a, "visible"_a, nb::kw_only(), "scale"_a,
      "reference"_a = false, "stream"_a = nb::none(),
      "One decode token per row over a paged pool: q (B, n_q, 1, D); keys/values (n_blocks, n_kv, "
      "block, D); blocks (B, n_kv, n) uint32 (block * n_kv + head); visible (B, 1, n, 1, block) "
      "bool. -> (B, n_q, 1, Dv). reference: MLX's own ops.");
  m.def(
      "paged_attention_quantized",
      [](const mx::array& q, const std::vector<mx::array>& keys,
         const std::vector<mx::array>& values, const mx::array& blocks, const mx::array& visible,
         float scale, int group_size, int bits, mx::StreamOrDevice s) {
        return mlxinfer::paged_attention_quantized(q, keys, values, blocks, visible, scale,
                                                   group_size, bits, s);
      },
      "q"_a, "keys"_a, "values"_a, "blocks"_a, "visible"_a, nb::kw_only(), "scale"_a,
      "group_size"_a, "bits"_a, "stream"_a = nb::none(),
      "paged_attention over a quantized pool: keys/values each [packed uint32 (n_blocks, n_kv, "
      "block, width * bits / 32), float32 scales, biases (..., width / group_size)] as "
      "mx.quantize makes them (4 or 8 bits); float32 q (B, n_q, 1, D) -> (B, n_q, 1, Dv).");
  m.def(
      "norm_products",
      [](const mx::array& x, const mx::array& norm, float eps, const std::vector<Layer>& layers,
         const std::optional<mx::array>& q_norm, const std::optional<mx::array>& k_norm,
         int n_q, int n_kv, int head_dim, float head_eps, mx::StreamOrDevice s) {
        return mlxinfer::norm_products(x, norm, eps, layers_of(layers), q_norm, k_norm,
                                       {n_q, n_kv, q_norm ? head_dim : 0, head_eps}, s);
      },
      "x"_a, "norm"_a, "eps"_a, "layers"_a, nb::kw_only(), "q_norm"_a = nb::none(),
      "k_norm"_a = nb::none(), "n_q"_a = 0, "n_kv"_a = 0, "head_dim"_a = 0, "head_eps"_a = 0.0f,
      "stream"_a = nb::none(),
      "rms_norm(x, norm, eps) through each affine quantized layer (w, scales, biases, "
      "group_size, bits), the products side by side (..., sum of N); with q_norm and k_norm "
      "the first n_q and next n_kv heads of head_dim normalised (weights (head_dim,)). float32 "
      "x; CPU only.");
  m.def(
      "attention_output",
      [](const mx::array& x, const mx::array& qkv, const mx::array& keys, const mx::array& values,
         const mx::array& cos, const mx::array& sin, const Layer& o, int n_q, int offset,
         float scale, int dims, bool traditional, const std::optional<mx::array>& post_norm,
         float post_eps, mx::StreamOrDevice s) {
        return mlxinfer::attention_output(
            x, qkv, keys, values, cos, sin, layer_of(o),
            {n_q, keys.ndim() == 4 ? keys.shape(1) : 0, offset, scale, dims, traditional},
            post_norm, post_eps, s);
      },
      "x"_a, "qkv"_a, "keys"_a, "values"_a, "cos"_a, "sin"_a, "o"_a, nb::kw_only(), "n_q"_a,
      "offset"_a, "scale"_a, "dims"_a, "traditional"_a = false, "post_norm"_a = nb::none(),
      "post_eps"_a = 0.0f, "stream"_a = nb::none(),
      "x + [rms_norm(., post_norm)](o(decode_attention(qkv's first n_q heads, keys, values))) "
      "for one float32 token; o an affine quantized layer (w, scales, biases, group_size, "
      "bits). CPU only.");
  m.def(
      "mlp_output",
      [](const mx::array& h, const mx::array& norm, float eps, const std::vector<Layer>& gate_up,
         const Layer& down, int act, const std::optional<mx::array>& post_norm, float post_eps,
         mx::StreamOrDevice s) {
        return mlxinfer::mlp_output(h, norm, eps, layers_of(gate_up), layer_of(down), act,
                                    post_norm, post_eps, s);
      },
      "h"_a, "norm"_a, "eps"_a, "gate_up"_a, "down"_a, nb::kw_only(), "act"_a = 0,
      "post_norm"_a = nb::none(), "post_eps"_a = 0.0f, "stream"_a = nb::none(),
      "h + [rms_norm(., post_norm)](down(act(gate) * up)) with gate | up the products of "
      "rms_norm(h, norm, eps) (one stacked layer or two); act 0 silu, 1 GELU's tanh form. "
      "float32 h; CPU only.");
  m.def(
      "pool_write",
      [](const Side& keys, const Side& values, const mx::array& qkv, const mx::array& rows,
         const mx::array& cos, const mx::array& sin, int k_start, int v_start, int dims,
         bool traditional, int group_size, int bits, mx::StreamOrDevice s) {
        return mlxinfer::pool_write(side_of(keys), side_of(values), qkv, rows, cos, sin, k_start,
                                    v_start, dims, traditional, {group_size, bits}, s);
      },
      "keys"_a, "values"_a, "qkv"_a, "rows"_a, "cos"_a, "sin"_a, nb::kw_only(), "k_start"_a,
      "v_start"_a, "dims"_a = 0, "traditional"_a = false, "group_size"_a = 64, "bits"_a = 0,
      "stream"_a = nb::none(),
      "One layer's (n_blocks, n_kv, block, head_dim) keys and values with each row's k (the "
      "n_kv * head_dim values of qkv (B, 1, N) from element k_start, rotated by the row's (B, "
      "dims/2) cos/sin where dims > 0) and v (from v_start) written at the flat rows (B * n_kv "
      "uint32), as one call: [keys', values'] (a quantized pool's sides [codes, scales, biases] "
      "each: [k codes, k scales, k biases, v codes, v scales, v biases]); in place where nothing "
      "else holds the pools. A quantized pool (bits 4 or 8, group_size): each row quantized as "
      "mx.quantize does. CPU only.");
  m.def("fuse", &mlxinfer::fuse, "outputs"_a,
        "The arrays `outputs` with the graph of the block primitives (norm_products, "
        "pool_write, attention_output, paged_attention_output, mlp_output; at most 16 calls) "
        "that makes them as one primitive: one node of MLX's graph, the calls run in order in "
        "one evaluation with the same outputs bit for bit; the calls' other outputs "
        "temporaries, any other array an input. CPU only.");
  m.def(
      "paged_attention_output",
      [](const mx::array& x, const mx::array& qkv, const Side& keys, const Side& values,
         const mx::array& blocks, const mx::array& visible, const mx::array& cos,
         const mx::array& sin, const Layer& o, int n_q, float scale, int dims, bool traditional,
         const std::optional<mx::array>& post_norm, float post_eps, int kv_group_size,
         int kv_bits, mx::StreamOrDevice s) {
        return mlxinfer::paged_attention_output(x, qkv, side_of(keys), side_of(values), blocks,
                                                visible, cos, sin, layer_of(o), n_q, scale, dims,
                                                traditional, post_norm, post_eps,
                                                {kv_group_size, kv_bits}, s);
      },
      "x"_a, "qkv"_a, "keys"_a, "values"_a, "blocks"_a, "visible"_a, "cos"_a, "sin"_a, "o"_a,
      nb::kw_only(), "n_q"_a, "scale"_a, "dims"_a, "traditional"_a = false,
      "post_norm"_a = nb::none(), "post_eps"_a = 0.0f, "kv_group_size"_a = 64, "kv_bits"_a = 0,
      "stream"_a = nb::none(),
      "x + [rms_norm(., post_norm)](o(paged_attention(rope(q)))) for B float32 rows, each "
      "query (qkv's first n_q heads) rotated by its row's (B, dims/2) cos/sin. CPU only.");
  m.def(
      "sample",
      [](const mx::array& logits, const mx::array& u, float temperature, int top_k, float top_p,
         float min_p, bool probs, mx::StreamOrDevice s) {
        return mlxinfer::sample(logits, u, {temperature, top_k, top_p, min_p}, probs, s);
      },
      "logits"_a, "u"_a, nb::kw_only(), "temperature"_a = 1.0f, "top_k"_a = 0, "top_p"_a = 1.0f,
      "min_p"_a = 0.0f, "probs"_a = false, "stream"_a = nb::none(),
      "A token from each row of (B, V) logits: temperature, top-k, top-p and min-p as "
      "mlxinfer's filtered_logprobs applies them, then the row's uniform u (B,) float32 through "
      "the kept tokens' cumulative probabilities; (B,) uint32. probs: the (B, V) float32 "
      "distribution drawn from instead. CPU only.");
  m.def("attention_buffer_copies", &mlxinfer::attention_buffer_copies,
        "How many times cache_write copied a buffer it could not update in place.");
  m.def("set_num_threads", &mlxinfer::set_num_threads, "n"_a,
        "Threads per kernel call, the caller included; n <= 0: the CPUs this process may use.");
  m.def("num_threads", &mlxinfer::num_threads);
  m.def("available_cpus", &mlxinfer::available_cpus);
  m.def(
      "set_spin_us",
      [](int us) { mlxinfer::ThreadPool::instance().set_spin_us(us); },
      "us"_a,
      "How long idle pool threads spin before sleeping, in microseconds.");
  m.def(
      "set_qmv_decode_rows",
      [](int rows) { mlxinfer::set_qmv_decode_rows(rows); },
      "rows"_a,
      "Benchmarks: output rows per pass of the AVX-512 one-row (decode) loops, 1 or 2; 0 (the "
      "default) by the length of a row.");
  m.def(
      "set_qmv_rows_path",
      [](int path) { mlxinfer::set_qmv_rows_path(path); },
      "path"_a,
      "Benchmarks: the multi-row AVX-512 quantized loop (1: blocks of output rows, 0: one row "
      "a call).");
  m.def(
      "set_max_isa",
      [](const std::string& name) {
        if (name == "scalar") {
          mlxinfer::set_max_isa(mlxinfer::kScalar);
#if defined(__aarch64__)
        } else if (name == "neon" || name == "best") {
          mlxinfer::set_max_isa(mlxinfer::kNeon);
        } else {
          throw std::invalid_argument(
              "set_max_isa: expected 'scalar', 'neon' or 'best', found '" + name + "'");
        }
#else
        } else if (name == "avx2") {
          mlxinfer::set_max_isa(mlxinfer::kAvx2, false);
        } else if (name == "avxvnni") {
          mlxinfer::set_max_isa(mlxinfer::kAvx2, true);
        } else if (name == "avx512vnni") {
          mlxinfer::set_max_isa(mlxinfer::kAvx512, true, false);
        } else if (name == "avx512bw") {
          mlxinfer::set_max_isa(mlxinfer::kAvx512, false, false, false);
        } else if (name == "avx512" || name == "best") {
          mlxinfer::set_max_isa(mlxinfer::kAvx512);
        } else {
          throw std::invalid_argument("set_max_isa: expected 'scalar', 'avx2', 'avxvnni', "
                                      "'avx512bw', 'avx512vnni', 'avx512' or 'best', found '" +
                                      name + "'");
        }
#endif
      },
      "name"_a,
      "Cap the kernels' instruction set (to test each path against the others).");
  m.def("isa", [] { return mlxinfer::isa_name(mlxinfer::current_isa()); },
        "The instruction set the kernels use now.");
}
