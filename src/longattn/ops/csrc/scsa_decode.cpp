// SCSA's flat sparse decode call for one cache row (q8_0 packing) in one native pass, for x86
// CPUs with AVX2 + FMA. The same computation as the PyTorch path of longattn.sparse
// (kernel.cluster_scores, kernel.needed, SCSALayer._output); see that package for the maths.
//
//   q          [H, D]            float32  the row's decode queries (H = Hkv * G)
//   k, v       [Hkv, N, D]       float32  the row's whole cache (rows contiguous, any head stride)
//   s0, s1                                slots [0, s0) and [s1, N) are read exactly
//   summ       [Hkv, C, 1+r, D]  float32  centroid, then sqrt(lambda) * eigenvector rows
//   resid      [Hkv, C, D]       float32  residual diagonal variance
//   log_counts [C]; radius [Hkv, C]; vmean [Hkv, C, D]; counts [C] int64 (members per cluster)
//   M                                     live clusters (C >= M is the index's capacity)
//   ki, vi     [Hkv, Cs, cs, D]  int8     packed member rows, members first in each cluster
//   ks, vs     [Hkv, Cs, cs, nb] float32  one scale per block of D / nb values
//   taus       [Hkv]             float32  stop-rule threshold per KV head
//   -> (out [H, D] float32, opened [Hkv, M] bool, opened member rows over all heads: int64 scalar)
//
// Per KV head (phase A, heads in parallel): every cluster's tail logit a + log m and capped
// second-cumulant log-mass estimate for each of the G query heads; exact scores of the sink and
// unsealed rows; per query head the stop rule over the estimates sorted best first; the union of
// the G prefixes is opened; unopened clusters contribute m exp(a) at their value mean.
// Phase B reads the opened clusters: (KV head, cluster chunk) items across threads, each scoring
// its packed keys with integer block dots against the query quantized once (q8_0 x q8_0, exact
// in int32), then one softmax part and the dequantized values. Parts merge exactly at the end.
//
// Why it exists: the PyTorch path spends 1.5-3 ms of small ops per layer call (sort, gathers,
// padding masks, several matmuls), more than the reads it saves below ~32K tokens.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>

#include "avx2_util.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using longattn::axpy;
using longattn::dot;
using longattn::dot8;
using longattn::exp_shift_sum;
using longattn::hsum8;
using longattn::merge_parts;
using longattn::weighted_rows;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kQ8Max = 127.0f;

struct Ranked {
  float est;
  int64_t id;
};

// A softmax part: running max m, normaliser l = sum exp(s - m), numerator acc = sum exp(s - m) v.
struct Part {
  float* p;  // [2 + D]: m, l, acc
  void clear(int64_t D) {
    p[0] = kNegInf;
    p[1] = 0.0f;
    std::fill(p + 2, p + 2 + D, 0.0f);
  }
};

// q8_0 of one row as packing.quantize_q8 does it: per block scale amax / 127, values
// round-half-even(x / scale) clamped to +-127 (widened to int16 for vpmaddwd).
void quantize_row(const float* x, int64_t D, int64_t qb, int16_t* ints, float* scales) {
  for (int64_t b = 0; b < D / qb; ++b) {
    float amax = 0.0f;
    for (int64_t i = 0; i < qb; ++i) amax = std::max(amax, std::fabs(x[b * qb + i]));
    const float s = amax / kQ8Max;
    const float safe = s > 0.0f ? s : 1.0f;
    for (int64_t i = 0; i < qb; ++i) {
      const float r = std::nearbyint(x[b * qb + i] / safe);
      ints[b * qb + i] = static_cast<int16_t>(std::max(-kQ8Max, std::min(kQ8Max, r)));
    }
    scales[b] = s;
  }
}

// Raw scores (no softmax scale) of G quantized queries with n <= 8 int8 key rows of one cluster:
// s[g * stride + r] = sum_b (iq_g,b . ik_r,b) * ks_r,b * qs_g,b, in that order (as the PyTorch
// path: block dot times key scale times query scale, summed over blocks). Integer block dots
// are exact; the eight rows' dots of one block come out as one vector (lane r = row r).
void q8_scores8(const int8_t* krows, const float* kscale, int64_t n, const int16_t* q16, const float* qs,
                int64_t G, int64_t D, int64_t qb, float* s, int64_t stride) {
  const int64_t nb = D / qb;
  alignas(32) int16_t k16[8 * 512];
  __m256 ksv[64];  // per block: the eight rows' key scales (D <= 512, qb >= 8)
  for (int64_t r = 0; r < 8; ++r) {
    int16_t* dst = k16 + r * D;
    if (r >= n) {
      std::fill(dst, dst + D, int16_t(0));
      continue;
    }
    const int8_t* src = krows + r * D;
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
  }
  for (int64_t b = 0; b < nb; ++b) {
    alignas(32) float col[8];
    for (int64_t r = 0; r < 8; ++r) col[r] = r < n ? kscale[r * nb + b] : 0.0f;
    ksv[b] = _mm256_load_ps(col);
  }
  alignas(32) float out8[8];
  for (int64_t g = 0; g < G; ++g) {
    const int16_t* qg = q16 + g * D;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 dots;
      if (qb % 16 == 0) {
        __m256 a[8];
        for (int64_t r = 0; r < 8; ++r) {
          __m256i ai = _mm256_setzero_si256();
          for (int64_t d = b * qb; d < (b + 1) * qb; d += 16)
            ai = _mm256_add_epi32(ai, _mm256_madd_epi16(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k16 + r * D + d)),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + d))));
          a[r] = _mm256_cvtepi32_ps(ai);
        }
        dots = hsum8(a);
      } else {  // blocks of 8 values (head_dim not a multiple of 16): plain integer loops
        alignas(32) float d8[8];
        for (int64_t r = 0; r < 8; ++r) {
          int32_t ai = 0;
          for (int64_t d = b * qb; d < (b + 1) * qb; ++d) ai += int32_t(k16[r * D + d]) * int32_t(qg[d]);
          d8[r] = static_cast<float>(ai);
        }
        dots = _mm256_load_ps(d8);
      }
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dots, ksv[b]), _mm256_set1_ps(qs[g * nb + b])));
    }
    _mm256_store_ps(out8, acc);
    for (int64_t r = 0; r < n; ++r) s[g * stride + r] = out8[r];
  }
}

// n <= 32 value rows dequantized into tile [n, D] (ints * block scale, as packing.Q8Store.values;
// one rounding per element, so the same floats).
void dequant_rows(const int8_t* vrows, const float* vscale, int64_t n, int64_t D, int64_t qb, float* tile) {
  const int64_t nb = D / qb;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 sc = _mm256_set1_ps(vscale[r * nb + b]);
      const int8_t* src = vrows + r * D + b * qb;
      float* dst = tile + r * D + b * qb;
      for (int64_t i = 0; i < qb; i += 8) {  // qb is a multiple of 8
        const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8)), sc));
      }
    }
}

// o += sum_j p[j] * rows[j] in tiles of 32 rows, each summed apart first (tmp [D]): a sum over
// thousands of rows in one float accumulator would err ~n ulp, tiles keep it ~(32 + n / 32).
void tiled_weighted_rows(const float* p, const float* const* rows, int64_t n, int64_t D, float* o, float* tmp) {
  for (int64_t r0 = 0; r0 < n; r0 += 32) {
    std::fill(tmp, tmp + D, 0.0f);
    weighted_rows(p + r0, rows + r0, std::min<int64_t>(32, n - r0), D, tmp);
    axpy(1.0f, tmp, o, D);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> scsa_decode(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t s0, int64_t s1,
    const at::Tensor& summ, const at::Tensor& resid, const at::Tensor& log_counts, const at::Tensor& radius,
    const at::Tensor& vmean, const at::Tensor& counts, int64_t M, const at::Tensor& ki, const at::Tensor& ks,
    const at::Tensor& vi, const at::Tensor& vs, const at::Tensor& taus, double scale) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 3 && v.dim() == 3, "scsa_decode: q [H, D], k/v [Hkv, N, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "scsa_decode: q, k, v must be float32");
  const int64_t H = q.size(0), D = q.size(1), Hkv = k.size(0), N = k.size(1);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "scsa_decode: query heads must be a multiple of KV heads");
  TORCH_CHECK(D % 8 == 0 && D <= 512, "scsa_decode: head_dim must be a multiple of 8 and <= 512");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == D && k.stride(2) == 1 && k.stride(1) == D &&
              v.stride(2) == 1 && v.stride(1) == D, "scsa_decode: k/v [Hkv, N, D] with contiguous rows");
  TORCH_CHECK(0 <= s0 && s0 <= s1 && s1 <= N, "scsa_decode: need 0 <= s0 <= s1 <= N");
  TORCH_CHECK(summ.dim() == 4 && summ.size(0) == Hkv && summ.size(3) == D && summ.size(1) >= M && M >= 0,
              "scsa_decode: summ [Hkv, C >= M, 1 + r, D]");
  const int64_t C = summ.size(1), R1 = summ.size(2);
  TORCH_CHECK(resid.sizes() == at::IntArrayRef({Hkv, C, D}) && vmean.sizes() == resid.sizes() &&
              radius.sizes() == at::IntArrayRef({Hkv, C}) && log_counts.numel() >= M && counts.numel() >= M,
              "scsa_decode: resid/vmean [Hkv, C, D], radius [Hkv, C], log_counts/counts [>= M]");
  TORCH_CHECK(ki.dim() == 4 && ki.size(0) == Hkv && ki.size(1) >= M && ki.size(3) == D &&
              vi.sizes() == ki.sizes() && ki.scalar_type() == at::kChar && vi.scalar_type() == at::kChar,
              "scsa_decode: ki/vi int8 [Hkv, Cs >= M, cs, D]");
  const int64_t Cs = ki.size(1), cs = ki.size(2);
  TORCH_CHECK(ks.dim() == 4 && ks.size(0) == Hkv && ks.size(1) == Cs && ks.size(2) == cs &&
              ks.size(3) > 0 && D % ks.size(3) == 0 && vs.sizes() == ks.sizes(),
              "scsa_decode: ks/vs [Hkv, Cs, cs, nb] with D % nb == 0");
  const int64_t nb = ks.size(3), qb = D / nb;
  TORCH_CHECK(qb % 8 == 0, "scsa_decode: q8 blocks must hold a multiple of 8 values");
  TORCH_CHECK(taus.numel() == Hkv, "scsa_decode: taus [Hkv]");
  for (const auto* t : {&summ, &resid, &radius, &vmean, &ks, &vs, &log_counts, &taus})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "scsa_decode: float32 contiguous index tensors");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() && ki.is_contiguous() && vi.is_contiguous(),
              "scsa_decode: counts int64, ki/vi contiguous");
  const auto qc = q.contiguous();

  const int64_t G = H / Hkv, E = s0 + (N - s1), PW = D + 2;
  const float beta = static_cast<float>(scale);
  const float half_b2 = static_cast<float>(0.5 * scale * scale);  // as PyTorch rounds the scalar
  const float* qp = qc.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t k_hs = k.stride(0), v_hs = v.stride(0);
  const float *summp = summ.data_ptr<float>(), *residp = resid.data_ptr<float>();
  const float *lcp = log_counts.data_ptr<float>(), *radp = radius.data_ptr<float>();
  const float *vmp = vmean.data_ptr<float>(), *tausp = taus.data_ptr<float>();
  const int64_t* cntp = counts.data_ptr<int64_t>();
  const int8_t *kip = ki.data_ptr<int8_t>(), *vip = vi.data_ptr<int8_t>();
  const float *ksp = ks.data_ptr<float>(), *vsp = vs.data_ptr<float>();

  auto opened = at::zeros({Hkv, M}, q.options().dtype(at::kBool));
  bool* openp = opened.data_ptr<bool>();
  // Per KV head: the quantized queries (phase B reads them) and two parts per query head,
  // [0] exact rows and [1] unopened clusters' tails.
  std::vector<int16_t> q16(Hkv * G * D);
  std::vector<float> qsc(Hkv * G * nb);
  std::vector<float> head_parts(Hkv * G * 2 * PW);

  at::parallel_for(0, Hkv, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> q2(G * D), qn(G), est(G * M), tail(G * M), sx(G * E), lex(G);
    std::vector<Ranked> order(M);
    std::vector<float> suffix(M);
    std::vector<const float*> rows(E), vrows(E), vm_rows(M), srow(8 * R1), rrow(8);
    std::vector<float> tmp(D), w(M);
    for (int64_t h = h0; h < h1; ++h) {
      const float* qh = qp + h * G * D;
      for (int64_t g = 0; g < G; ++g) {
        quantize_row(qh + g * D, D, qb, q16.data() + (h * G + g) * D, qsc.data() + (h * G + g) * nb);
        float n2 = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          q2[g * D + d] = qh[g * D + d] * qh[g * D + d];
          n2 += q2[g * D + d];
        }
        qn[g] = std::sqrt(n2);
      }
      // priorities: a + log m and L = a + log m + min(beta^2/2 q'Sigma q, beta |q| r), eight
      // clusters at a time (dot8: eight independent chains, one horizontal sum per eight dots;
      // one dot at a time spent ~30 ns per 64-float dot on its latency chain and reduction)
      for (int64_t c0 = 0; c0 < M; c0 += 8) {
        const int64_t nc = std::min<int64_t>(8, M - c0);
        for (int64_t j = 0; j < 8; ++j) {
          const int64_t c = c0 + std::min(j, nc - 1);  // pad with the last real cluster
          for (int64_t r = 0; r < R1; ++r) srow[r * 8 + j] = summp + ((h * C + c) * R1 + r) * D;
          rrow[j] = residp + (h * C + c) * D;
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          float z0[8], zr[8], quad[8], low[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          for (int64_t r = 1; r < R1; ++r) {
            dot8(qg, srow.data() + r * 8, D, zr);
            for (int64_t j = 0; j < 8; ++j) low[j] += zr[j] * zr[j];
          }
          dot8(q2.data() + g * D, rrow.data(), D, quad);
          dot8(qg, srow.data(), D, z0);
          for (int64_t j = 0; j < nc; ++j) {
            const int64_t c = c0 + j;
            const float t = z0[j] * beta + lcp[c];
            tail[g * M + c] = t;
            est[g * M + c] = t + std::min(half_b2 * (quad[j] + low[j]), (beta * qn[g]) * radp[h * C + c]);
          }
        }
      }
      // exact rows: sinks then the unsealed suffix
      const float* kh = kp + h * k_hs;
      const float* vh = vp + h * v_hs;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t slot = e < s0 ? e : s1 + (e - s0);
        rows[e] = kh + slot * D;
        vrows[e] = vh + slot * D;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = sx.data() + g * E;
        int64_t e = 0;
        for (; e + 8 <= E; e += 8) dot8(qh + g * D, rows.data() + e, D, sg + e);
        for (; e < E; ++e) sg[e] = dot(qh + g * D, rows[e], D);
        for (e = 0; e < E; ++e) sg[e] *= beta;
        Part ex{head_parts.data() + ((h * G + g) * 2) * PW};
        ex.clear(D);
        if (E == 0) {
          lex[g] = kNegInf;
          continue;
        }
        const float m = *std::max_element(sg, sg + E);
        const float l = exp_shift_sum(sg, E, m);
        lex[g] = m + std::log(l);
        ex.p[0] = m;
        ex.p[1] = l;
        tiled_weighted_rows(sg, vrows.data(), E, D, ex.p + 2, tmp.data());
      }
      // stop rule per query head (kernel.stop_counts: float32 terms, suffix sums accumulated
      // in double as torch's cumsum does), union of the prefixes
      bool* op = openp + h * M;
      const float tau = tausp[h];
      for (int64_t g = 0; g < G && M > 0; ++g) {
        // (estimate, cluster) pairs sorted best first, ties by cluster id: torch.sort's stable
        // descending order (direct keys sort ~2x faster than indices compared through est)
        const float* eg = est.data() + g * M;
        for (int64_t c = 0; c < M; ++c) order[c] = {eg[c], c};
        std::sort(order.begin(), order.end(), [](const Ranked& a, const Ranked& b) {
          return a.est > b.est || (a.est == b.est && a.id < b.id);
        });
        const float mx = std::max(order[0].est, lex[g]);
        double acc = 0.0;
        for (int64_t i = M - 1; i >= 0; --i) {
          acc += static_cast<double>(std::exp(order[i].est - mx));
          suffix[i] = static_cast<float>(acc);
        }
        const float total = std::exp(lex[g] - mx) + suffix[0];
        const float thr = tau * total;
        for (int64_t i = 0; i < M && suffix[i] >= thr; ++i) op[order[i].id] = true;
      }
      // tails of the unopened clusters, at their value means
      for (int64_t g = 0; g < G; ++g) {
        Part tp{head_parts.data() + ((h * G + g) * 2 + 1) * PW};
        tp.clear(D);
        const float* tg = tail.data() + g * M;
        float m = kNegInf;
        for (int64_t c = 0; c < M; ++c)
          if (!op[c]) m = std::max(m, tg[c]);
        if (m == kNegInf) continue;
        float l = 0.0f;
        int64_t nt = 0;
        for (int64_t c = 0; c < M; ++c) {
          if (op[c]) continue;
          w[nt] = std::exp(tg[c] - m);
          l += w[nt];
          vm_rows[nt++] = vmp + (h * C + c) * D;
        }
        tiled_weighted_rows(w.data(), vm_rows.data(), nt, D, tp.p + 2, tmp.data());
        tp.p[0] = m;
        tp.p[1] = l;
      }
    }
  });

  // Phase B: opened clusters, ascending per head, cut into chunks so every thread has work.
  std::vector<std::vector<int64_t>> lists(Hkv);
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t c = 0; c < M; ++c)
      if (openp[h * M + c]) lists[h].push_back(c);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per_head = std::max<int64_t>(1, (2 * threads + Hkv - 1) / Hkv);
  struct Item { int64_t h, c0, c1; };  // clusters lists[h][c0:c1]
  std::vector<Item> items;
  for (int64_t h = 0; h < Hkv; ++h) {
    const int64_t n = static_cast<int64_t>(lists[h].size());
    const int64_t parts = std::min(n, per_head);
    for (int64_t i = 0; i < parts; ++i) items.push_back({h, n * i / parts, n * (i + 1) / parts});
  }
  const int64_t I = static_cast<int64_t>(items.size());
  std::vector<float> item_parts(I * G * PW);

  at::parallel_for(0, I, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, tile(32 * D), tmp(D);
    std::vector<const float*> tptr(32);
    for (int64_t t = 0; t < 32; ++t) tptr[t] = tile.data() + t * D;
    for (int64_t it = i0; it < i1; ++it) {
      const Item& item = items[it];
      const int64_t h = item.h;
      const auto& ids = lists[h];
      int64_t R = 0;
      for (int64_t j = item.c0; j < item.c1; ++j) R += cntp[ids[j]];
      scores.resize(G * R);
      const int16_t* qh16 = q16.data() + h * G * D;
      const float* qhs = qsc.data() + h * G * nb;
      int64_t off = 0;
      for (int64_t j = item.c0; j < item.c1; ++j) {
        const int64_t c = ids[j], n = cntp[c];
        const int8_t* kr = kip + ((h * Cs + c) * cs) * D;
        const float* kscale = ksp + ((h * Cs + c) * cs) * nb;
        for (int64_t r = 0; r < n; r += 8)
          q8_scores8(kr + r * D, kscale + r * nb, std::min<int64_t>(8, n - r), qh16, qhs, G, D, qb,
                     scores.data() + off + r, R);
        off += n;
      }
      for (int64_t x = 0; x < G * R; ++x) scores[x] *= beta;
      for (int64_t g = 0; g < G; ++g) {
        Part pt{item_parts.data() + (it * G + g) * PW};
        pt.clear(D);
        float* sg = scores.data() + g * R;
        const float m = *std::max_element(sg, sg + R);
        pt.p[0] = m;
        pt.p[1] = exp_shift_sum(sg, R, m);
      }
      off = 0;
      for (int64_t j = item.c0; j < item.c1; ++j) {
        const int64_t c = ids[j], n = cntp[c];
        for (int64_t r0 = 0; r0 < n; r0 += 32) {
          const int64_t nr = std::min<int64_t>(32, n - r0);
          dequant_rows(vip + ((h * Cs + c) * cs + r0) * D, vsp + ((h * Cs + c) * cs + r0) * nb, nr, D, qb,
                       tile.data());
          for (int64_t g = 0; g < G; ++g)  // one tile: summed apart, then added (see tiled_weighted_rows)
            tiled_weighted_rows(scores.data() + g * R + off + r0, tptr.data(), nr, D,
                                item_parts.data() + (it * G + g) * PW + 2, tmp.data());
        }
        off += n;
      }
    }
  });

  auto out = at::empty({H, D}, qc.options());
  float* outp = out.data_ptr<float>();
  std::vector<const float*> parts;
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t g = 0; g < G; ++g) {
      parts.assign({head_parts.data() + ((h * G + g) * 2) * PW, head_parts.data() + ((h * G + g) * 2 + 1) * PW});
      for (int64_t it = 0; it < I; ++it)
        if (items[it].h == h) parts.push_back(item_parts.data() + (it * G + g) * PW);
      merge_parts(parts, D, outp + (h * G + g) * D);
    }
  int64_t opened_rows = 0;
  for (const Item& item : items)
    for (int64_t j = item.c0; j < item.c1; ++j) opened_rows += cntp[lists[item.h][j]];
  return {out, opened, at::scalar_tensor(opened_rows, at::kLong)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("scsa_decode(Tensor q, Tensor k, Tensor v, int s0, int s1, Tensor summ, Tensor resid, "
        "Tensor log_counts, Tensor radius, Tensor vmean, Tensor counts, int M, Tensor ki, Tensor ks, "
        "Tensor vi, Tensor vs, Tensor taus, float scale) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(longattn_cpu, CPU, m) {
  m.impl("scsa_decode", &scsa_decode);
}
