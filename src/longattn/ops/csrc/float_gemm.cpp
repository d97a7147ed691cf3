// Float32 and bfloat16 weight matrix products on x86 CPUs with AVX2 + FMA, with one arithmetic for
// every number of rows.
//
//   y[r, n] = x[r, :] . w[n, :]      x float32 [M, K], w float32 or bfloat16 [N, K], y float32 [M, N]
//
// Every output element is summed in one order that depends only on K: eight float32 lanes, lane
// l accumulating x[k] * w[k] (one fused multiply-add) for k = l, l + 8, l + 16, ... in increasing
// k, the lanes added by longattn::hsum, then the K % 8 last products added one by one with fma.
// Tiles share each loaded weight vector among several rows (and each activation vector among
// several weight rows) but never split or reorder a sum, so a row's result is the same bits
// whether it is one of a prefill's hundreds of rows, a decode step's one row, or one of many
// streams batched together (docs/design.md, invariant 3). A library GEMM picks its blocking of K
// by the matrix shapes, which is why the float formats need this kernel to keep that promise.
// A bfloat16 weight widens to float32 exactly in registers (avx2_util.h load8), so bfloat16
// weights give the bits float32 weights holding the same values give, reading half the bytes.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "avx2_util.h"

namespace {

using longattn::hsum;
using longattn::load8;
using longattn::to_float;

// R activation rows times C weight rows: R * C accumulators (one per output element), which at
// R * C >= 8 keeps the fma units busy despite each accumulator's latency chain.
template <int R, int C, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load8(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t t = k; t < K; ++t) s = std::fma(x[r * ldx + t], to_float(w[c * K + t]), s);
      y[r * ldy + c] = s;
    }
}

// Rows r0 .. r0 + R of x against weight rows n0 .. n1: C at a time, the last few one at a time.
template <int R, int C, typename W>
inline void rows_against(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy,
                         int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + C <= n1; n += C) tile<R, C>(x, ldx, w + n * K, K, y + n, ldy);
  for (; n < n1; ++n) tile<R, 1>(x, ldx, w + n * K, K, y + n, ldy);
}

// Activation rows per cache block: about this many bytes of x stay in L2 while a thread's
// weight rows stream past them.
constexpr int64_t kRowBlockBytes = 192 * 1024;

template <typename W>
void gemm(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  // weight rows per thread task: about 32 KiB of weights
  const int64_t grain = std::max<int64_t>(8, (32 * 1024) / std::max<int64_t>(K * int64_t(sizeof(W)), 1));
  const int64_t block = std::max<int64_t>(4, kRowBlockBytes / std::max<int64_t>(K * 4, 1) / 4 * 4);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t m1 = std::min(M, m0 + block);
      // a weight block of 64 rows stays in L1/L2 while every row tile of the x block meets it
      for (int64_t nb = n0; nb < n1; nb += 64) {
        const int64_t ne = std::min(n1, nb + 64);
        int64_t r = m0;
        for (; r + 4 <= m1; r += 4) rows_against<4, 3>(x + r * K, K, w, K, y + r * N, N, nb, ne);
        switch (m1 - r) {
          case 3: rows_against<3, 2>(x + r * K, K, w, K, y + r * N, N, nb, ne); break;
          case 2: rows_against<2, 4>(x + r * K, K, w, K, y + r * N, N, nb, ne); break;
          case 1: rows_against<1, 8>(x + r * K, K, w, K, y + r * N, N, nb, ne); break;
          default: break;
        }
      }
    }
  });
}

at::Tensor float_gemm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "float_gemm: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "float_gemm: x must be float32");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "float_gemm: w must be float32 or bfloat16");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), N = wc.size(0), K = xc.size(1);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  if (w.scalar_type() == at::kFloat)
    gemm(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
  else
    gemm(xc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()),
         y.data_ptr<float>(), M, N, K);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("float_gemm(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(longattn_cpu, CPU, m) {
  m.impl("float_gemm", &float_gemm);
}
