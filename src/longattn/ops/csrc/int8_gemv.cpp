// Weight-only int8 matrix-vector product for decode steps on x86 CPUs with AVX2 + FMA.
//
//   y[m, n] = s[n] * sum_k x[m, k] * q[n, k]      x float32 [M, K], q int8 [N, K], s float32 [N]
//
// Why it exists: PyTorch's aten::_weight_int8pack_mm streams int8 weights well below the CPU's
// read bandwidth (with bf16 activations), and a decode step is almost entirely these products.
// Each int8 weight is widened to float32 exactly and multiplied into float32 accumulators, so
// activations are never rounded (the aten kernel rounds them to bf16) and the result is an
// ordinary float32 dot product times the row scale. Rows are split across threads with
// at::parallel_for (one contiguous block per thread).
//
// Two forms (`isa`, see cpu_features.h) with one order of operations, so they give the same
// bits. The AVX2 form takes one weight row per pass: for one activation row the sweep is bound
// by memory, and rows sharing activation loads gain nothing there. A batched step (the server's M
// streams) is bound by arithmetic instead, where the AVX2 form's two loads per fma hold it to
// half the fma rate; the AVX-512 form works on tiles of 4 weight rows x 3 activation rows whose
// widened weights and activations each feed several fmas (16 rows, SmolLM2's shapes, 2 threads:
// 58 -> 30 ms per step's products on a Xeon with AVX-512). Automatic takes the AVX2 form for one
// row and the AVX-512 form for several. Every (row, activation) pair is summed in the same
// order whatever the batch, tile or form, so a row's result is the same alone or in any batch.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "avx2_util.h"
#include "cpu_features.h"

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
    for (; k < K; ++k) acc = std::fma(xr[k], static_cast<float>(w[k]), acc);
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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace avx512 {

inline __m512 widen16(const int8_t* p) {  // 16 int8 -> 16 float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// R widened weight rows (wide + r * K; the int8 rows at w + r * K) against C activation rows
// (x + c * K) into y[c * ldy + r], in row_dot_with's order: the two 16-lane accumulators of a
// pair are its four 8-lane ones (a0|a1, a2|a3), the 8-value tail goes into a0 as there, and the
// sums are added in the same order, so each result has row_dot_with's bits.
template <int R, int C>
inline void tile(const float* x, int64_t K, const float* wide, const int8_t* w, const float* s, float* y,
                 int64_t ldy) {
  __m512 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    for (int h = 0; h < 2; ++h) {
      __m512 wv[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = _mm512_loadu_ps(wide + r * K + k + 16 * h);
        asm("" : "+v"(wv[r]));  // keep it in a register: GCC would reload it as each fma's operand
      }
      for (int c = 0; c < C; ++c) {
        const __m512 xv = _mm512_loadu_ps(x + c * K + k + 16 * h);
        for (int r = 0; r < R; ++r) acc[r][c][h] = _mm512_fmadd_ps(wv[r], xv, acc[r][c][h]);
      }
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float* xr = x + c * K;
      __m256 a0 = _mm512_castps512_ps256(acc[r][c][0]), a1 = _mm512_extractf32x8_ps(acc[r][c][0], 1);
      __m256 a2 = _mm512_castps512_ps256(acc[r][c][1]), a3 = _mm512_extractf32x8_ps(acc[r][c][1], 1);
      int64_t t = k;
      for (; t + 8 <= K; t += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wide + r * K + t), _mm256_loadu_ps(xr + t), a0);
      float v = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      for (; t < K; ++t) v = std::fma(xr[t], static_cast<float>(w[r * K + t]), v);
      y[c * ldy + r] = v * s[r];
    }
}

constexpr int kRows = 4, kCols = 3;  // 24 accumulators + 4 weights + 1 activation of 32 registers

template <int R>
inline void tiles(const float* x, int64_t M, int64_t K, const float* wide, const int8_t* w, const float* s, float* y,
                  int64_t ldy) {
  int64_t m = 0;
  for (; m + kCols <= M; m += kCols) tile<R, kCols>(x + m * K, K, wide, w, s, y + m * ldy, ldy);
  if (M - m == 2) tile<R, 2>(x + m * K, K, wide, w, s, y + m * ldy, ldy);
  if (M - m == 1) tile<R, 1>(x + m * K, K, wide, w, s, y + m * ldy, ldy);
}

// Weight rows n0..n1 of the product, kRows at a time: widened once into wide [kRows, K] (in L1),
// then read by every tile of activation rows.
void rows(const float* x, int64_t M, int64_t K, const int8_t* q, const float* s, float* y, int64_t N, int64_t n0,
          int64_t n1) {
  std::vector<float> wide(kRows * K);
  for (int64_t n = n0; n < n1; n += kRows) {
    const int64_t R = std::min<int64_t>(kRows, n1 - n);
    const int8_t* w = q + n * K;
    int64_t i = 0;  // R * K int8 values, contiguous, widened exactly
    for (; i + 16 <= R * K; i += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(w + i + kPrefetch), _MM_HINT_T0);
      _mm512_storeu_ps(wide.data() + i, widen16(w + i));
    }
    for (; i < R * K; ++i) wide[i] = static_cast<float>(w[i]);
    switch (R) {
      case 4: tiles<4>(x, M, K, wide.data(), w, s + n, y + n, N); break;
      case 3: tiles<3>(x, M, K, wide.data(), w, s + n, y + n, N); break;
      case 2: tiles<2>(x, M, K, wide.data(), w, s + n, y + n, N); break;
      default: tiles<1>(x, M, K, wide.data(), w, s + n, y + n, N);
    }
  }
}

}  // namespace avx512
#pragma GCC pop_options

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && s.dim() == 1, "int8_gemv: x [M, K], q [N, K], s [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat,
              "int8_gemv: x float32, q int8, s float32");
  TORCH_CHECK(x.size(1) == q.size(1) && s.size(0) == q.size(0), "int8_gemv: shapes do not match");
  // Both forms give the same bits, so automatic takes each where it is faster: one activation
  // row (memory-bound) the AVX2 rows, several (arithmetic-bound) the AVX-512 tiles.
  const bool wide512 = longattn::use_avx512(isa) && (isa >= 0 || x.size(0) > 1);
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
    if (wide512) {
      avx512::rows(xp, M, K, qp, sp, yp, N, n0, n1);
      return;
    }
    std::vector<float> wide(M > 1 ? K : 0);
    for (int64_t n = n0; n < n1; ++n) row_dot(xp, M, K, qp + n * K, sp[n], yp + n, N, wide.data());
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor s, int isa=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(longattn_cpu, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
}
