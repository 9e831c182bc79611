// The int16 dot product's peak on this core, and the tiles' 8-row inner loop against it
// (docs/performance.md, "The engine's 8 rows at the int16 products' rate").
//
//   gcc -O2 -march=cooperlake tools/vnni_peak_probe.c -o /tmp/vnni_peak_probe && /tmp/vnni_peak_probe
//
// 1. `vpdpwssd` on 512- and 256-bit registers, 12 independent accumulators (no chain waits on
//    its latency): instructions a second on one core, and 32 or 16 int16 products each; and
//    512-bit `vpdpbusd` (the opt-in int8 activations': 64 products each).
// 2. A dependent chain of `vpaddd` (one cycle each), the fastest of 7: the clock, to put 1 and
//    3 in cycles.
// 3. tiles.cpp's tile_pass<4, 8> inner loop (one pair of inputs: the 4-bit codes widened with
//    vpmovzxbw, their nibbles split, 8 rows' x pairs broadcast, 16 vpdpwssd), its codes and x in
//    L1 and no epilogue: as written (`full`), without widening the codes (`no unpack`), and
//    without the broadcasts (`no broadcast`). Time a pair against its 16 vpdpwssd at the rate
//    of 1 (a ratio within one run; the clock of 2 is fragile on a shared VM: a run that reads
//    it at half speed is preempted, run it again).
//
// A probe, not a kernel: nothing here is built into mlxinfer; the sums are printed only so the
// compiler keeps them.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define DP(A, X, W) asm("vpdpwssd %2, %1, %0" : "+v"(A) : "v"(X), "v"(W))
#define DPY(A) asm volatile("vpdpwssd %1, %2, %0" : "+v"(A) : "v"(v0), "v"(v1))

// A 512-bit dot product instruction's rate: INSN ("vpdpwssd", or the int8 path's "vpdpbusd")
// on 12 independent accumulators.
#define PEAK512(NAME, INSN)                                                                    \
  static double NAME(long n, int* keep) {                                                    \
    __m512i a0 = _mm512_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, \
            a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;                                  \
    const __m512i w0 = _mm512_set1_epi16(3), w1 = _mm512_set1_epi16(5);                      \
    const double t = now();                                                                  \
    for (long k = 0; k < n; ++k) {                                                           \
      asm volatile(INSN " %12, %13, %0\n\t" INSN " %12, %13, %1\n\t"                      \
                   INSN " %12, %13, %2\n\t" INSN " %12, %13, %3\n\t"                      \
                   INSN " %12, %13, %4\n\t" INSN " %12, %13, %5\n\t"                      \
                   INSN " %12, %13, %6\n\t" INSN " %12, %13, %7\n\t"                      \
                   INSN " %12, %13, %8\n\t" INSN " %12, %13, %9\n\t"                      \
                   INSN " %12, %13, %10\n\t" INSN " %12, %13, %11"                          \
                   : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),  \
                     "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11)                     \
                   : "v"(w0), "v"(w1));                                                     \
    }                                                                                        \
    const double dt = now() - t;                                                             \
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));        \
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));   \
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11))); \
    *keep += _mm512_reduce_add_epi32(s);                                                     \
    return 12.0 * n / dt;                                                                    \
  }

PEAK512(peak_zmm, "vpdpwssd")
PEAK512(peak_bytes, "vpdpbusd")

static double peak_ymm(long n, int* keep) {
  __m256i b0 = _mm256_set1_epi32(1), b1 = b0, b2 = b0, b3 = b0, b4 = b0, b5 = b0, b6 = b0,
          b7 = b0, b8 = b0, b9 = b0, b10 = b0, b11 = b0;
  const __m256i v0 = _mm256_set1_epi16(3), v1 = _mm256_set1_epi16(5);
  const double t = now();
  for (long k = 0; k < n; ++k) {
    DPY(b0); DPY(b1); DPY(b2); DPY(b3); DPY(b4); DPY(b5);
    DPY(b6); DPY(b7); DPY(b8); DPY(b9); DPY(b10); DPY(b11);
  }
  const double dt = now() - t;
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(b0, b1), _mm256_add_epi32(b2, b3));
  s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_add_epi32(b4, b5), _mm256_add_epi32(b6, b7)));
  s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_add_epi32(b8, b9), _mm256_add_epi32(b10, b11)));
  *keep += _mm256_extract_epi32(s, 0);
  return 12.0 * n / dt;
}

static double clock_hz(long n) {
  __m512i c = _mm512_set1_epi32(1);
  const __m512i one = _mm512_set1_epi32(1);
  const double t = now();
  for (long k = 0; k < n; ++k) {
    asm volatile("vpaddd %1, %0, %0" : "+v"(c) : "v"(one));
  }
  return n / (now() - t);
}

enum { kK = 576, kBlocks = kK / 32 };
static uint8_t codes[kBlocks * 16 * 32] __attribute__((aligned(64)));
static int16_t xq[8 * kK] __attribute__((aligned(64)));

// mode 0: as tile_pass; 1: the codes not widened; 2: x not broadcast. Pairs a second.
__attribute__((noinline)) static double inner_loop(long iters, int mode, int* keep) {
  __m512i A0 = _mm512_setzero_si512(), A1 = A0, A2 = A0, A3 = A0, A4 = A0, A5 = A0, A6 = A0,
          A7 = A0, A8 = A0, A9 = A0, A10 = A0, A11 = A0, A12 = A0, A13 = A0, A14 = A0, A15 = A0;
  const __m512i low = _mm512_set1_epi16(15), c0 = _mm512_set1_epi16(3),
                c1 = _mm512_set1_epi16(7), cx = _mm512_set1_epi32(0x00050003);
  const double t = now();
  for (long it = 0; it < iters; ++it) {
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* wb = codes + b * 16 * 32;
      const int16_t* xb = xq + b * 32;
      for (int p = 0; p < 16; ++p) {
        __m512i w0, w1;
        if (mode == 1) {
          w0 = c0;
          w1 = c1;
          asm volatile("" ::"v"(w0), "v"(w1));
        } else {
          const __m512i z =
              _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(wb + p * 32)));
          w0 = _mm512_and_si512(z, low);
          w1 = _mm512_srli_epi16(z, 4);
        }
#define ROW(r, AA, BB)                                 \
  {                                                    \
    __m512i xv = cx;                                   \
    if (mode != 2) {                                   \
      int32_t two;                                     \
      memcpy(&two, xb + (r) * kK + 2 * p, 4);          \
      xv = _mm512_set1_epi32(two);                     \
    }                                                  \
    DP(AA, xv, w0);                                    \
    DP(BB, xv, w1);                                    \
  }
        ROW(0, A0, A1) ROW(1, A2, A3) ROW(2, A4, A5) ROW(3, A6, A7)
        ROW(4, A8, A9) ROW(5, A10, A11) ROW(6, A12, A13) ROW(7, A14, A15)
      }
    }
  }
  const double dt = now() - t;
  __m512i s = _mm512_add_epi32(_mm512_add_epi32(A0, A1), _mm512_add_epi32(A2, A3));
  s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(A4, A5), _mm512_add_epi32(A6, A7)));
  s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(A8, A9), _mm512_add_epi32(A10, A11)));
  s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(A12, A13), _mm512_add_epi32(A14, A15)));
  *keep += _mm512_reduce_add_epi32(s);
  return iters * (double)kBlocks * 16 / dt;
}

int main(void) {
  for (int i = 0; i < (int)sizeof codes; ++i) {
    codes[i] = (uint8_t)(i * 7);
  }
  for (int i = 0; i < 8 * kK; ++i) {
    xq[i] = (int16_t)(i * 3);
  }
  int keep = 0;
  double hz = 0; // the fastest of several short chains: a preempted one reads a slower clock
  for (int i = 0; i < 7; ++i) {
    const double h = clock_hz(40000000);
    hz = h > hz ? h : hz;
  }
  const double z = peak_zmm(100000000, &keep), y = peak_ymm(100000000, &keep);
  const double u = peak_bytes(100000000, &keep);
  printf("clock (dependent vpaddd): %.2f GHz\n", hz / 1e9);
  printf("vpdpwssd zmm: %.2f G/s (%.2f a cycle, %.0f G int16 products/s)\n", z / 1e9, z / hz,
         32 * z / 1e9);
  printf("vpdpwssd ymm: %.2f G/s (%.2f a cycle, %.0f G int16 products/s)\n", y / 1e9, y / hz,
         16 * y / 1e9);
  printf("vpdpbusd zmm: %.2f G/s (%.2f a cycle, %.0f G int8 products/s)\n", u / 1e9, u / hz,
         64 * u / 1e9);
  const char* names[] = {"full", "no unpack", "no broadcast"};
  for (int mode = 0; mode < 3; ++mode) {
    const double pairs = inner_loop(200000, mode, &keep);
    printf("tile_pass<4, 8> inner loop, %s: %.2f ns a pair, %.2fx its 16 vpdpwssd at the rate above "
           "(%.1f cycles)\n",
           names[mode], 1e9 / pairs, z / (16 * pairs), hz / pairs);
  }
  return keep == 42;
}
