// Which instruction-set form longattn's kernels take, decided once per process.
//
// The extension is built for AVX2 + FMA (every x86 CPU the kernels support); some kernels also
// hold AVX-512 (F/BW/VL/DQ/VNNI) forms compiled in `#pragma GCC target` regions, which may run
// only where the CPU reports those features. SCSA's and the dense decode attention's forms give
// the same bits as their AVX2 twins; the int4 GEMV's sums land in other lanes (last-bit
// differences, within the bound its tests derive). The `avx512` op (cpu_features.cpp) forces
// either form for tests and benchmarks.
#pragma once
#include <atomic>
#include <cstdint>

namespace longattn {

inline bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

// -1 automatic (each kernel's choice below), 0 the AVX2 forms, 1 the AVX-512 forms (forced).
inline std::atomic<int> avx512_mode{-1};

inline bool cpu_avx512() {
  static const bool has = cpu_has_avx512();
  return has;
}

// SCSA's opened-row phase and the int4 GEMV: the AVX-512 forms where the CPU has them, since
// they pay on Intel and AMD (Zen 4) AVX-512 hosts alike.
inline bool use_avx512() {
  const int w = avx512_mode.load(std::memory_order_relaxed);
  return w < 0 ? cpu_avx512() : w == 1;
}

// The dense fused decode attention: its AVX-512 loops hold two key rows per 512-bit register
// (an insert per pair) and pay only where 512-bit operations run at full width. Zen 4 splits
// them into two 256-bit halves, where the extra inserts make them slower than the AVX2 loops,
// so automatic mode keeps the AVX2 loops on AMD CPUs. Forcing a form (the `avx512` op) applies
// here too.
inline bool use_avx512_dense_attention() {
  const int w = avx512_mode.load(std::memory_order_relaxed);
  if (w >= 0) return w == 1;
  static const bool wide = cpu_avx512() && !__builtin_cpu_is("amd");
  return wide;
}

}  // namespace longattn
