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

// -1 not decided yet (then: whatever the CPU has), 0 the AVX2 forms, 1 the AVX-512 forms.
inline std::atomic<int> avx512_mode{-1};

inline bool use_avx512() {
  int w = avx512_mode.load(std::memory_order_relaxed);
  if (w < 0) {
    w = cpu_has_avx512() ? 1 : 0;
    avx512_mode.store(w);
  }
  return w == 1;
}

}  // namespace longattn
