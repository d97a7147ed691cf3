// Which instruction-set form longattn's kernels take: an argument of every kernel that has two.
//
// The extension is built for AVX2 + FMA (every x86 CPU the kernels support); some kernels also
// hold AVX-512 (F/BW/VL/DQ/VNNI) forms compiled in `#pragma GCC target` regions, which may run
// only where the CPU reports those features. SCSA's and the dense decode attention's forms give
// the same bits as their AVX2 twins; the int4 and int5 GEMMs' sums land in other lanes
// (last-bit differences, within the bound their tests derive). One process takes one form. Each such kernel takes `isa`: -1 automatic
// (the choice below), 0 the AVX2 forms, 1 the AVX-512 forms (an error where the CPU lacks them).
// Nothing is process-wide, so one caller forcing a form never changes another's.
#pragma once
#include <c10/util/Exception.h>
#include <cstdint>

namespace longattn {

inline bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

inline bool cpu_avx512() {
  static const bool has = cpu_has_avx512();
  return has;
}

inline void check_isa(int64_t isa) {
  TORCH_CHECK(isa >= -1 && isa <= 1, "isa is -1 (automatic), 0 (AVX2) or 1 (AVX-512), got ", isa);
  TORCH_CHECK(isa != 1 || cpu_avx512(), "this CPU lacks AVX-512 F/BW/VL/DQ/VNNI");
}

// SCSA's opened-row phase and the quantized GEMMs: automatic takes the AVX-512 forms where
// the CPU has them, since they pay on Intel and AMD (Zen 4) AVX-512 hosts.
inline bool use_avx512(int64_t isa) {
  check_isa(isa);
  return isa < 0 ? cpu_avx512() : isa == 1;
}

// The dense fused decode attention: its AVX-512 loops hold two key rows per 512-bit register
// (an insert per pair) and pay only where 512-bit operations run at full width. Zen 4 splits
// them into two 256-bit halves, where the extra inserts make them slower than the AVX2 loops,
// so automatic keeps the AVX2 loops on AMD CPUs.
inline bool use_avx512_dense_attention(int64_t isa) {
  check_isa(isa);
  if (isa >= 0) return isa == 1;
  static const bool wide = cpu_avx512() && !__builtin_cpu_is("amd");
  return wide;
}

}  // namespace longattn
