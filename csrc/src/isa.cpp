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
    return __builtin_cpu_supports("avx512f") ? kAvx512 : kAvx2;
  }
#endif
  return kScalar;
}

const Isa g_best = detect_isa();
std::atomic<int> g_max{kAvx512};

bool detect_f16c() {
#if defined(MLXINFER_X86)
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

const bool g_f16c = detect_f16c();

} // namespace

Isa best_isa() {
  return g_best;
}

Isa current_isa() {
  return static_cast<Isa>(std::min<int>(g_best, g_max.load(std::memory_order_relaxed)));
}

void set_max_isa(Isa isa) {
  g_max.store(isa);
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case kAvx512:
      return "avx512";
    case kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

bool has_f16c() {
  return g_f16c;
}

} // namespace mlxinfer
