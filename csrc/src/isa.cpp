// The instruction-set level the kernels run at: detected once, capped by set_max_isa.
#include "kernels.h"

#include <algorithm>
#include <atomic>

#include "simd.h"

namespace mlxinfer {

namespace {

Isa detect_isa() {
#if defined(MLXINFER_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    // AVX-512 with BW (byte shuffles, used by the 2/3/5/6-bit unpacking): every AVX-512 CPU
    // since Skylake-SP and Zen 4; without it (Xeon Phi) the AVX2 paths run.
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? kAvx512
                                                                                    : kAvx2;
  }
#endif
#if defined(__aarch64__)
  return kNeon; // Advanced SIMD is part of the AArch64 base ISA
#endif
  return kScalar;
}

const Isa g_best = detect_isa();
std::atomic<int> g_max{kNeon}; // the highest value: no cap

bool detect_f16c() {
#if defined(MLXINFER_X86)
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

const bool g_f16c = detect_f16c();

bool detect_avx_vnni() {
#if defined(MLXINFER_X86)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni");
#else
  return false;
#endif
}

const bool g_avx_vnni = detect_avx_vnni();
std::atomic<bool> g_avx_vnni_on{true}; // set_max_isa: off at the "avx2" cap, on above it

bool detect_avx512_vnni() {
#if defined(MLXINFER_X86)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

const bool g_avx512_vnni = detect_avx512_vnni();
std::atomic<bool> g_vbmi_on{true}; // set_max_isa: off at the "avx512vnni" cap (Cascade Lake's)
std::atomic<bool> g_vnni512_on{true}; // set_max_isa: off at the "avx512bw" cap (Skylake-SP's)

bool detect_avx512_bw() {
#if defined(MLXINFER_X86)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

const bool g_avx512_bw = detect_avx512_bw();

} // namespace

Isa best_isa() {
  return g_best;
}

Isa current_isa() {
  const int cap = g_max.load(std::memory_order_relaxed);
#if defined(__aarch64__)
  return cap >= kNeon ? g_best : kScalar; // the levels here: scalar < neon
#else
  return static_cast<Isa>(std::min<int>(g_best, cap));
#endif
}

void set_max_isa(Isa isa, bool avx_vnni, bool vbmi, bool vnni512) {
  g_max.store(isa);
  g_avx_vnni_on.store(avx_vnni);
  g_vbmi_on.store(vbmi);
  g_vnni512_on.store(vnni512);
}

bool vbmi_allowed() {
  return g_vbmi_on.load(std::memory_order_relaxed);
}

bool avx512_bw_cpu() {
  return g_avx512_bw;
}

bool avx512_vnni_cpu() {
  return g_avx512_vnni && g_vnni512_on.load(std::memory_order_relaxed);
}

bool avx_vnni_available() {
  return g_avx_vnni && g_avx_vnni_on.load(std::memory_order_relaxed) && current_isa() == kAvx2;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case kAvx512:
      return "avx512";
    case kAvx2:
      return "avx2";
    case kNeon:
      return "neon";
    default:
      return "scalar";
  }
}

bool has_f16c() {
  return g_f16c;
}

} // namespace mlxinfer
