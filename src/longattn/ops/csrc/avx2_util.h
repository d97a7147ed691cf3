// Small AVX2 helpers shared by longattn's kernels.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace longattn {

// Sum of the eight lanes of v.
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Cache rows are float32 or bfloat16 (its bits as uint16_t). A bfloat16 value widens to float32
// exactly, so a loop over bfloat16 rows gives the bits the float32 loop gives on the widened rows.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// q8 rows (cache/kv_format.py): D int8 codes, then one float32 scale per block of 32 codes
// (the last block may be shorter); a value is code * scale, the float32 product its PyTorch
// reference computes.
inline int64_t q8_width(int64_t D) { return D + 4 * ((D + 31) / 32); }
inline void q8_widen(const int8_t* row, int64_t D, float* out) {
  for (int64_t b0 = 0; b0 < D; b0 += 32) {
    float s;
    std::memcpy(&s, row + D + 4 * (b0 / 32), sizeof s);
    const int64_t e = std::min<int64_t>(D, b0 + 32);
    const __m256 vs = _mm256_set1_ps(s);
    int64_t d = b0;
    for (; d + 8 <= e; d += 8) {
      const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d)));
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtepi32_ps(w), vs));
    }
    for (; d < e; ++d) out[d] = static_cast<float>(row[d]) * s;
  }
}

// a . b over D values (b float32 or bfloat16).
template <typename T>
inline float dot(const float* a, const T* b, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), load8(b + d + 8), a1);
  }
  for (; d + 8 <= D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), a0);
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; d < D; ++d) s += a[d] * to_float(b[d]);
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t D) {  // y += a * x
  const __m256 va = _mm256_set1_ps(a);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(y + d, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
  for (; d < D; ++d) y[d] += a * x[d];
}

// Eight sums at once: lane r of the result = sum of the 8 lanes of a[r].
inline __m256 hsum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[r] = q . rows[r] for 8 key rows: eight independent accumulator chains (one per row) keep
// both FMA pipes busy, and each query load serves eight rows.
template <typename T>
inline void dot8(const float* q, const T* const* rows, int64_t D, float* s) {
  __m256 a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qv, load8(rows[r] + d), a[r]);
  }
  _mm256_storeu_ps(s, hsum8(a));
  for (; d < D; ++d)
    for (int r = 0; r < 8; ++r) s[r] += q[d] * to_float(rows[r][d]);
}

// o[0:D] += sum_j p[j] * rows[j][0:D] over n rows, 64 columns (eight registers) at a time.
template <typename T>
inline void weighted_rows(const float* p, const T* const* rows, int64_t n, int64_t D, float* o) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(o + d + 8 * i);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(p[j]);
      const T* r = rows[j] + d;
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(w, load8(r + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + d + 8 * i, a[i]);
  }
  for (; d + 8 <= D; d += 8) {
    __m256 a = _mm256_loadu_ps(o + d);
    for (int64_t j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(rows[j] + d), a);
    _mm256_storeu_ps(o + d, a);
  }
  for (; d < D; ++d)
    for (int64_t j = 0; j < n; ++j) o[d] += p[j] * to_float(rows[j][d]);
}

// exp for x <= 0 (scores minus their max): Cody-Waite range reduction to 2^n * e^r with
// |r| <= ln2/2 and a degree-6 polynomial for e^r (relative error ~2 ulp); x below -87 -> 0.
inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// The largest of x[0:n] (-inf for n = 0). Vectorised: std::max_element is a scalar
// compare-and-branch loop.
inline float max_of(const float* x, int64_t n) {
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// In place: x[i] *= a; returns the largest result (-inf for n = 0). Vectorised as max_of, since
// SCSA's opened-row phase runs it over every opened row.
inline float scale_max(float* x, int64_t n, float a) {
  const __m256 va = _mm256_set1_ps(a);
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + i), va);
    _mm256_storeu_ps(x + i, y);
    mx = _mm256_max_ps(mx, y);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) {
    x[i] *= a;
    m = std::max(m, x[i]);
  }
  return m;
}

// In place: x[i] = exp(x[i] - m); returns the sum.
inline float exp_shift_sum(float* x, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float s = hsum(acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  return s;
}

// Softmax parts, each [m, l, acc[D]] (running max, normaliser, numerator), merged exactly into
// out[0:D] (skipping empty ones): sum_i e^(m_i - m) acc_i / sum_i e^(m_i - m) l_i.
inline void merge_parts(const std::vector<const float*>& parts, int64_t D, float* out) {
  float m = -std::numeric_limits<float>::infinity();
  for (const float* p : parts) m = std::max(m, p[0]);
  std::fill(out, out + D, 0.0f);
  if (m == -std::numeric_limits<float>::infinity()) return;
  float den = 0.0f;
  for (const float* p : parts) {
    if (p[0] == -std::numeric_limits<float>::infinity()) continue;
    const float w = std::exp(p[0] - m);
    den += w * p[1];
    axpy(w, p + 2, out, D);
  }
  const float inv = 1.0f / den;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

// Calls f(std::integral_constant<int, GN>) with GN = min(gn, Max) (gn >= 1): kernels that keep
// accumulator registers per query head need the head count as a compile-time constant.
template <int Max = 8, typename F>
void with_heads(int64_t gn, F&& f) {
  if constexpr (Max > 1) {
    if (gn < Max) return with_heads<Max - 1>(gn, std::forward<F>(f));
  }
  f(std::integral_constant<int, Max>{});
}

}  // namespace longattn
