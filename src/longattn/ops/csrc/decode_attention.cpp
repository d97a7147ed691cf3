// One decode query per stream attending over a fixed K/V buffer plus its own new key, in one
// pass over the buffer, for x86 CPUs with AVX2 + FMA.
//
//   q      [B, H, 1, D]    float32   the step's queries (H = Hkv * G query heads)
//   k, v   [B, Hkv, S, D]  float32   the layer's buffer (slots in any order)
//   k_pos  [B, S]          int64     absolute position per slot, -1 = empty
//   q_pos  [B, 1]          int64     the query's position, -1 = padding (output zeros)
//   k_new, v_new [B, Hkv, 1, D]      the step's own key and value (not in the buffer yet)
//   window, sinks                    slot j is read when 0 <= pos_j <= pos_q and
//                                    (window <= 0 or pos_q - pos_j < window or pos_j < sinks)
//   -> [B, H, 1, D] = softmax over (allowed slots + own key) of q.k * scale, times V.
//
// Why it exists: the compiled step's matmul form reads each buffer through two batched
// matmuls with a separate mask/softmax kernel between them; with G query heads per KV head as
// the matmul's M (1-7 rows) the BLAS call ran at 3-6 GB/s here, 15-25% of a window step on
// Gemma 3 and Qwen. This reads every allowed K and V row once, all G heads per row, decides the
// mask from positions inline and skips masked slots entirely. Work is split into
// (stream, KV head, slot chunk) items across threads (flash-decoding's split over the
// sequence, so one KV head still uses every core); each item keeps its own running max,
// normaliser and numerator, merged exactly at the end with the own key.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include "avx2_util.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using longattn::hsum;

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), a1);
  }
  for (; d + 8 <= D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), a0);
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; d < D; ++d) s += a[d] * b[d];
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
inline void dot8(const float* q, const float* const* rows, int64_t D, float* s) {
  __m256 a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[r] + d), a[r]);
  }
  _mm256_storeu_ps(s, hsum8(a));
  for (; d < D; ++d)
    for (int r = 0; r < 8; ++r) s[r] += q[d] * rows[r][d];
}

// o[0:D] += sum_j p[j] * rows[j][0:D] over n rows, 64 columns (eight registers) at a time.
inline void weighted_rows(const float* p, const float* const* rows, int64_t n, int64_t D, float* o) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(o + d + 8 * i);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(p[j]);
      const float* r = rows[j] + d;
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + d + 8 * i, a[i]);
  }
  for (; d + 8 <= D; d += 8) {
    __m256 a = _mm256_loadu_ps(o + d);
    for (int64_t j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(rows[j] + d), a);
    _mm256_storeu_ps(o + d, a);
  }
  for (; d < D; ++d)
    for (int64_t j = 0; j < n; ++j) o[d] += p[j] * rows[j][d];
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

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& k_pos, const at::Tensor& q_pos, const at::Tensor& k_new,
                            const at::Tensor& v_new, int64_t window, int64_t sinks, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k_new.dim() == 4 && v_new.dim() == 4,
              "decode_attention: q [B, H, 1, D], k/v [B, Hkv, S, D], k_new/v_new [B, Hkv, 1, D]");
  for (const auto* t : {&q, &k, &v, &k_new, &v_new})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "decode_attention: float32 tensors only");
  TORCH_CHECK(k_pos.scalar_type() == at::kLong && q_pos.scalar_type() == at::kLong,
              "decode_attention: positions are int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(q.size(2) == 1, "decode_attention: one query per stream");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "decode_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D, "decode_attention: k/v shapes");
  TORCH_CHECK(k_new.sizes() == v_new.sizes() && k_new.size(0) == B && k_new.size(1) == Hkv &&
              k_new.size(2) == 1 && k_new.size(3) == D, "decode_attention: k_new/v_new shapes");
  TORCH_CHECK(k_pos.dim() == 2 && k_pos.size(0) == B && k_pos.size(1) == S, "decode_attention: k_pos [B, S]");
  TORCH_CHECK(q_pos.numel() == B, "decode_attention: q_pos [B, 1]");
  const int64_t G = H / Hkv;
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const auto knc = k_new.contiguous(), vnc = v_new.contiguous();
  const auto kpc = k_pos.contiguous(), qpc = q_pos.contiguous();
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* kposp = kpc.data_ptr<int64_t>();
  const int64_t* qposp = qpc.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);

  // Split the slots so every thread has work even with one stream and one KV head; chunks of
  // at least 64 slots keep the per-item fixed cost (partials, merge) small.
  const int64_t heads = B * Hkv;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((S + 63) / 64, (2 * threads + heads - 1) / heads));
  const int64_t chunk = (S + chunks - 1) / chunks;
  // partial[item][g] = (max, normaliser, numerator[D])
  std::vector<float> part(heads * chunks * G * (D + 2));

  at::parallel_for(0, heads * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qs(G * D), scores;
    std::vector<const float*> krow, vrow;
    std::vector<int64_t> idx;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t bh = item / chunks, c = item % chunks, b = bh / Hkv, h = bh % Hkv;
      const int64_t s0 = c * chunk, s1 = std::min(S, s0 + chunk);
      const int64_t pq = qposp[b];
      float* out = part.data() + item * G * (D + 2);
      idx.clear();
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t pk = kposp[b * S + s];
        if (pk >= 0 && pk <= pq && (window <= 0 || pq - pk < window || pk < sinks)) idx.push_back(s);
      }
      const int64_t n = static_cast<int64_t>(idx.size());
      for (int64_t g = 0; g < G; ++g) {
        float* o = out + g * (D + 2);
        o[0] = kNegInf;
        o[1] = 0.0f;
        std::fill(o + 2, o + 2 + D, 0.0f);
      }
      if (n == 0) continue;
      const float* qh = qp + (b * H + h * G) * D;
      for (int64_t j = 0; j < G * D; ++j) qs[j] = qh[j] * sc;
      scores.resize(G * n);
      krow.resize(n);
      vrow.resize(n);
      const float* kh = kp + (b * Hkv + h) * S * D;
      const float* vh = vp + (b * Hkv + h) * S * D;
      for (int64_t j = 0; j < n; ++j) {
        krow[j] = kh + idx[j] * D;
        vrow[j] = vh + idx[j] * D;
      }
      // scores: eight rows at a time, every query head per block (the rows stay in L1)
      int64_t j = 0;
      float s8[8];
      for (; j + 8 <= n; j += 8)
        for (int64_t g = 0; g < G; ++g) {
          dot8(qs.data() + g * D, krow.data() + j, D, s8);
          for (int r = 0; r < 8; ++r) scores[g * n + j + r] = s8[r];
        }
      for (; j < n; ++j)
        for (int64_t g = 0; g < G; ++g) scores[g * n + j] = dot(qs.data() + g * D, krow[j], D);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float m = *std::max_element(sg, sg + n);
        out[g * (D + 2)] = m;
        out[g * (D + 2) + 1] = exp_shift_sum(sg, n, m);
      }
      // numerators: tiles of 32 rows (<= 32 KiB at D = 256) reused by every head from cache
      for (int64_t r0 = 0; r0 < n; r0 += 32) {
        const int64_t nr = std::min<int64_t>(32, n - r0);
        for (int64_t g = 0; g < G; ++g)
          weighted_rows(scores.data() + g * n + r0, vrow.data() + r0, nr, D, out + g * (D + 2) + 2);
      }
    }
  });

  auto y = at::empty({B, H, 1, D}, qc.options());
  float* yp = y.data_ptr<float>();
  const float* knp = knc.data_ptr<float>();
  const float* vnp = vnc.data_ptr<float>();
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / Hkv, h = bh % Hkv;
    const float* kn = knp + bh * D;
    const float* vn = vnp + bh * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qp + (b * H + h * G + g) * D;
      float* o = yp + (b * H + h * G + g) * D;
      const float sn = qposp[b] >= 0 ? dot(qg, kn, D) * sc : kNegInf;
      float m = sn;
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part[((bh * chunks + c) * G + g) * (D + 2)]);
      std::fill(o, o + D, 0.0f);
      if (m == kNegInf) continue;  // nothing to read: zeros, as the reference
      float den = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* pc = part.data() + ((bh * chunks + c) * G + g) * (D + 2);
        if (pc[0] == kNegInf) continue;
        const float w = std::exp(pc[0] - m);
        den += w * pc[1];
        axpy(w, pc + 2, o, D);
      }
      if (sn != kNegInf) {
        const float w = std::exp(sn - m);
        den += w;
        axpy(w, vn, o, D);
      }
      const float inv = 1.0f / den;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor k_pos, Tensor q_pos, Tensor k_new, "
        "Tensor v_new, int window, int sinks, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(longattn_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
