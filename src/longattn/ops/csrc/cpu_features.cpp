// What the CPU offers and what an `isa` argument resolves to (cpu_features.h), for Python.
#include <torch/library.h>

#include "cpu_features.h"

namespace {

int64_t cpu_avx512() { return longattn::cpu_avx512() ? 1 : 0; }

// Whether the dense fused decode attention takes its AVX-512 loops under `isa`.
int64_t avx512_dense_attention(int64_t isa) { return longattn::use_avx512_dense_attention(isa) ? 1 : 0; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("cpu_avx512() -> int", &cpu_avx512);  // no tensors: catch-all kernels
  m.def("avx512_dense_attention(int isa) -> int", &avx512_dense_attention);
}
