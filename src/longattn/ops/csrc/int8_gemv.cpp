// Weight-only int8 matrix-vector product for decode steps on x86 CPUs with AVX2 + FMA.
//
//   y[m, n] = s[n] * sum_k x[m, k] * q[n, k]      x float32 [M, K], q int8 [N, K], s float32 [N]
//
// Why it exists: PyTorch's aten::_weight_int8pack_mm streams int8 weights well below the CPU's
// read bandwidth (with bf16 activations), and a decode step is almost entirely these products.
// Each int8 weight is widened to float32 in registers and multiplied into float32 accumulators,
// so activations are never rounded (the aten kernel rounds them to bf16) and the result is an
// ordinary float32 dot product times the row scale. Rows are split across threads with
// at::parallel_for (one contiguous block per thread). One weight row per pass beats four rows
// sharing each activation load, and int16 activations (vpmaddwd) gain nothing: for one
// activation row the sweep is bound by memory.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <vector>

#include "avx2_util.h"

namespace {

// Software prefetch this many bytes ahead in the weight stream (a thread's rows are contiguous,
// so this runs into the following rows): the hardware prefetcher alone lets the stream fall
// behind. The distance matters little between 2 and 8 KiB.
constexpr int64_t kPrefetch = 4096;

using longattn::hsum;

inline __m256 widen8(const int8_t* p) {  // 8 int8 -> 8 float32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// One weight row against every activation row. The order of operations on each activation row
// (four accumulators over 32-value strides, then their sum, then the tail) does not depend on M
// or on the other rows, so a row's result is the same alone or in any batch.
template <typename Widen>
inline void row_dot_with(const float* x, int64_t M, int64_t K, const int8_t* w, Widen widen, float scale,
                         float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      if (m == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k + kPrefetch), _MM_HINT_T0);
      a0 = _mm256_fmadd_ps(widen(k), _mm256_loadu_ps(xr + k), a0);
      a1 = _mm256_fmadd_ps(widen(k + 8), _mm256_loadu_ps(xr + k + 8), a1);
      a2 = _mm256_fmadd_ps(widen(k + 16), _mm256_loadu_ps(xr + k + 16), a2);
      a3 = _mm256_fmadd_ps(widen(k + 24), _mm256_loadu_ps(xr + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8)
      a0 = _mm256_fmadd_ps(widen(k), _mm256_loadu_ps(xr + k), a0);
    float acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; ++k) acc += xr[k] * static_cast<float>(w[k]);
    y[m * ldy] = acc * scale;
  }
}

// With several activation rows (a batched decode step) the row is widened to float32 once into
// wide[K] and every activation row reads the widened values: widening per row made the
// conversions, not the memory, the bound (16 rows: ~0.4 ms per 576x1536 product). The values
// are the same exact conversions, so the results are bit-identical to widening in registers.
inline void row_dot(const float* x, int64_t M, int64_t K, const int8_t* w, float scale, float* y, int64_t ldy,
                    float* wide) {
  if (M < 2) {
    row_dot_with(x, M, K, w, [w](int64_t k) { return widen8(w + k); }, scale, y, ldy);
    return;
  }
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) _mm256_storeu_ps(wide + k, widen8(w + k));
  row_dot_with(x, M, K, w, [wide](int64_t k) { return _mm256_loadu_ps(wide + k); }, scale, y, ldy);
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && s.dim() == 1, "int8_gemv: x [M, K], q [N, K], s [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat,
              "int8_gemv: x float32, q int8, s float32");
  TORCH_CHECK(x.size(1) == q.size(1) && s.size(0) == q.size(0), "int8_gemv: shapes do not match");
  const auto xc = x.contiguous();
  const auto qc = q.contiguous();
  const auto sc = s.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = qc.size(0);
  auto y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // ~64 KiB of weights per task: small enough to split a 576x576 matrix over two threads.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> wide(M > 1 ? K : 0);
    for (int64_t n = n0; n < n1; ++n) row_dot(xp, M, K, qp + n * K, sp[n], yp + n, N, wide.data());
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor s) -> Tensor");
}

TORCH_LIBRARY_IMPL(longattn_cpu, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
}
