// Writes a step's new keys and values into a paged KV pool, in place.
//
//   pool[h, slots[m], :] = round(x[m, h, :])     pool float32 or bfloat16 [Hkv, R, D], or int8
//                                                q8 rows [Hkv, R, D + 4 * ceil(D / 32)],
//                                                x float32 [M, Hkv, D], slots int64 [M] (-1: skip)
//
// The compiled paged step (engine/paged_step.py) stores each layer's keys before its attention
// reads the pool, inside one graph: declared as mutating its pool arguments, the write stays one
// call on the pool's own memory instead of a functional copy of the whole pool. Rounding to
// bfloat16 is round-to-nearest-even, the bits ``tensor.to(torch.bfloat16)`` gives, so a row
// stored here reads back as the eager paged cache's store of it does; q8 rows are
// cache/kv_format.py's ``encode``: per block of 32, scale = amax / 127, code = round-to-nearest-even
// of x / scale (a division, as the reference divides), 0 where the block is all zeros.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "avx2_util.h"

namespace {

// One q8 row (cache/kv_format.py) of D values: codes, then a float32 scale per 32.
void q8_store(const float* x, int64_t D, int8_t* row) {
  for (int64_t b0 = 0; b0 < D; b0 += 32) {
    const int64_t e = std::min<int64_t>(D, b0 + 32);
    float amax = 0.0f;
    for (int64_t d = b0; d < e; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float s = amax / 127.0f;
    std::memcpy(row + D + 4 * (b0 / 32), &s, sizeof s);
    for (int64_t d = b0; d < e; ++d)
      row[d] = s > 0.0f ? static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[d] / s)))) : 0;
  }
}

void store_one(at::Tensor& pool, const at::Tensor& slots, const at::Tensor& x) {
  TORCH_CHECK(pool.dim() == 3 && pool.is_contiguous(), "paged_store: the pool must be a contiguous [Hkv, R, D]");
  TORCH_CHECK(pool.scalar_type() == at::kFloat || pool.scalar_type() == at::kBFloat16 ||
              pool.scalar_type() == at::kChar, "paged_store: the pool must be float32, bfloat16 or int8 q8 rows");
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "paged_store: rows must be float32 [M, Hkv, D]");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.size(0) == x.size(0),
              "paged_store: slots must be int64 [M]");
  const bool q8 = pool.scalar_type() == at::kChar;
  const int64_t H = pool.size(0), R = pool.size(1), D = x.size(2), M = x.size(0);
  const int64_t W = q8 ? longattn::q8_width(D) : D;  // elements of a stored row
  TORCH_CHECK(x.size(1) == H && pool.size(2) == W, "paged_store: rows and pool disagree on heads or head size");
  const at::Tensor xc = x.contiguous(), sc = slots.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(sp[m] < R, "paged_store: slot ", sp[m], " is outside the pool of ", R, " rows");
  const bool bf16 = pool.scalar_type() == at::kBFloat16;
  void* base = pool.data_ptr();
  at::parallel_for(0, H * M, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t h = i / M, m = i % M;
      if (sp[m] < 0) continue;
      const float* src = xp + (m * H + h) * D;
      const int64_t row = h * R + sp[m];
      if (q8) {
        q8_store(src, D, static_cast<int8_t*>(base) + row * W);
      } else if (bf16) {
        c10::BFloat16* dst = static_cast<c10::BFloat16*>(base) + row * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(src[d]);
      } else {
        std::copy(src, src + D, static_cast<float*>(base) + row * D);
      }
    }
  });
}

void paged_store(at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots, const at::Tensor& k,
                 const at::Tensor& v) {
  store_one(k_pool, slots, k);
  store_one(v_pool, slots, v);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("paged_store(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(longattn_cpu, CPU, m) {
  m.impl("paged_store", &paged_store);
}
