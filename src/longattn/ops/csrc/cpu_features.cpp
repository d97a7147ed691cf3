// The `avx512` op: which form (AVX2 or AVX-512) the kernels with both take; see cpu_features.h.
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "cpu_features.h"

namespace {

// want: -1 automatic (each kernel's own choice, cpu_features.h), 0 AVX2, 1 AVX-512 (an error
// where the CPU lacks it); returns whether SCSA's and the int4 GEMV's AVX-512 forms are now in use.
int64_t avx512(int64_t want) {
  TORCH_CHECK(want >= -1 && want <= 1, "avx512: want is -1 (auto), 0 (AVX2) or 1 (AVX-512)");
  TORCH_CHECK(want != 1 || longattn::cpu_has_avx512(), "avx512: this CPU lacks AVX-512 F/BW/VL/DQ/VNNI");
  longattn::avx512_mode.store(static_cast<int>(want));
  return longattn::use_avx512() ? 1 : 0;
}

// Whether the dense fused decode attention takes its AVX-512 loops in the current mode.
int64_t avx512_dense_attention() { return longattn::use_avx512_dense_attention() ? 1 : 0; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("avx512(int want) -> int", &avx512);  // no tensors: catch-all kernels
  m.def("avx512_dense_attention() -> int", &avx512_dense_attention);
}
