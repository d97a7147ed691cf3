// SCSA's flat sparse decode call for one cache row (q8_0 packing) in one native pass, for x86
// CPUs with AVX2 + FMA (and AVX-512 VNNI, where present, for the opened rows). The same
// computation as the PyTorch path of longattn.sparse (kernel.cluster_scores, kernel.needed,
// SCSALayer._output); see that package for the maths.
//
//   q          [H, D]            float32  the row's decode queries (H = Hkv * G)
//   k, v       [Hkv, N, D]       float32  the row's whole cache (rows contiguous, any head stride),
//              or bfloat16, or [Hkv, N, W] int8 q8 rows (W = D + 4 * ceil(D / 32), cache/kv_format.py):
//                                         each exact row read is widened first, as decode_attention
//                                         widens it, so the bits are the float32 call's on the
//                                         widened cache
//                                         (or, for one row, q [1, H, 1, D] and k, v [1, Hkv, N, D]:
//                                         out is then [1, H, 1, D])
//   s0, s1                                slots [0, s0) and [s1, N) are read exactly
//   extra      [Hkv, X]          int64    more slots read exactly per KV head (the clusters'
//                                         outliers, inside [s0, s1), ascending; X may be 0)
//   extra_k, extra_v [Hkv, X, D]  float32  optional: those rows' keys and values, copied out of the
//                                         cache in slot order (ClusterIndex.extra_k/extra_v); None:
//                                         read from the cache by slot. Same values either way, but
//                                         in the cache the outliers are scattered rows, each a page
//                                         walk away, which the hardware prefetcher cannot follow
//                                         (software hints stall on the same walks).
//   summ       [Hkv, C, 1+r, D]  float32  centroid, then sqrt(lambda) * eigenvector rows
//   resid      [Hkv, C, D]       float32  residual diagonal variance
//   log_counts [C]; radius [Hkv, C]; vmean [Hkv, C, D]; counts [C] int64 (members per cluster)
//   M                                     live clusters (C >= M is the index's capacity)
//   kt         [Hkv, Cs, T, D/2, 8, 2] int8  packed member keys relative to the cluster's
//                                    centroid summ[h, c, 0], members first in each cluster, in
//                                    tiles of 8 rows (T = ceil(cs / 8)), pair-interleaved: tile t
//                                    holds dims (2p, 2p+1) of its 8 rows at [p][row][0:2]
//   vi         [Hkv, Cs, cs, D]  int8     packed member values, row-major
//   ks, vs     [Hkv, Cs, cs, nb] float32  one scale per block of D / nb values
//   taus       [Hkv]             float32  stop-rule threshold per KV head
//   probe_dims, probe_keys                the key-level net (SCSAConfig.probe_dims; 0 = off): per
//                                         query head, every member row scored q.c + q8dot(q_S, k - c)
//                                         over its probe_dims largest |q_i|; the clusters of its
//                                         probe_keys best rows open as well
//   sink_logits [H]              float32  optional learned per-head sink logits (gpt-oss): one more
//                                         exact term e^sink with a zero value row, in the exact part
//                                         and so in the stop rule's exact mass
//   -> (out [H, D] float32, opened [Hkv, M] bool, opened member rows over all heads: int64 scalar)
//
// Per KV head (phase A, heads in parallel): every cluster's tail logit a + log m and capped
// second-cumulant log-mass estimate for each of the G query heads; exact scores of the sink,
// outlier and unsealed rows; per query head the stop rule over the estimates sorted best first;
// the union of the G prefixes is opened, and with the probe the clusters of each query head's best
// rows by a masked-query score over every packed row; unopened clusters contribute m exp(a) at
// their value mean.
// Phase B reads the opened clusters: one run of about equal rows per thread (cut into items at
// KV head boundaries), each item scoring its packed keys with integer block dots against the
// query quantized once (12-bit query x q8_0 key blocks, exact in int32; 8-row tiles, all query
// heads per key load) plus the cluster's centre term q.c (phase A's float dot), then one softmax
// part and the values (each int8 row widened once for all heads). Parts merge exactly at the end.
// Phase B has AVX2 and AVX-512 (BW + VNNI) forms with bit-identical results, the wider one chosen
// at run time where the CPU has it (cpu_features.h); so do phase A's values loops (the exact
// rows' and the tails') where head_dim is a multiple of 64.
//
// Why it exists: the PyTorch path spends most of a layer call in small ops (sort, gathers,
// padding masks, several matmuls), which on caches of a few tens of thousands of tokens cost
// more than the reads the selection saves.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>

#include "avx2_util.h"
#include "cpu_features.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using longattn::axpy;
using longattn::dot;
using longattn::dot8;
using longattn::exp_shift_sum;
using longattn::max_of;
using longattn::merge_parts;
using longattn::scale_max;
using longattn::weighted_rows;
using longattn::with_heads;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// queries are quantized to 12-bit blocks (packing.QUERY_MAX): int16 lanes hold them as they hold
// the widened int8 keys, and a block dot stays below 2**24 (exact in float32 as in PyTorch)
constexpr float kQueryMax = 2047.0f;

struct Ranked {
  float est;
  int64_t id;
  float w;  // exp(est - max)
};

// Best first: higher estimate, ties by lower cluster id (torch.sort's stable descending order).
inline bool better(const Ranked& a, const Ranked& b) { return a.est > b.est || (a.est == b.est && a.id < b.id); }

// The stop rule without sorting: with the clusters in best-first order, cluster i opens when
// the mass from i to the end, suffix(i) = float(sum_{j >= i} w_j), is still >= thr; suffix is
// non-increasing, so the opened set is a prefix. Moves that prefix's clusters (in no particular
// order) to the front of r and returns its length. Quickselect on the boundary: each round
// partitions the undecided range [lo, hi) around a pivot, whose best-first position is then
// known, and its suffix decides which side the boundary lies on; expected O(M) against the
// full sort's O(M log M), which is a large part of the call's fixed cost. The sums are in
// double as in the sorted form; only their order differs.
int64_t stop_prefix(Ranked* r, int64_t M, float thr) {
  int64_t lo = 0, hi = M;  // [0, lo) opened, [hi, M) not opened
  double after = 0.0;      // sum of w over [hi, M)
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    std::swap(r[mid], r[hi - 1]);  // pivot at hi - 1 (the middle one: no bad case on sorted input)
    const Ranked pivot = r[hi - 1];
    int64_t p = lo;
    for (int64_t i = lo; i < hi - 1; ++i)
      if (better(r[i], pivot)) std::swap(r[i], r[p++]);
    std::swap(r[p], r[hi - 1]);  // [lo, p) better than the pivot, (p, hi) worse
    double less = after;
    for (int64_t i = p + 1; i < hi; ++i) less += static_cast<double>(r[i].w);
    if (static_cast<float>(less + static_cast<double>(pivot.w)) >= thr) {  // the pivot opens
      if (static_cast<float>(less) < thr) return p + 1;  // and nothing after it
      lo = p + 1;
    } else {  // neither the pivot nor anything after it opens
      after = less + static_cast<double>(pivot.w);
      hi = p;
    }
  }
  return lo;
}

// A softmax part: running max m, normaliser l = sum exp(s - m), numerator acc = sum exp(s - m) v.
struct Part {
  float* p;  // [2 + D]: m, l, acc
  void clear(int64_t D) {
    p[0] = kNegInf;
    p[1] = 0.0f;
    std::fill(p + 2, p + 2 + D, 0.0f);
  }
};

// A query row's block quantization as packing.quantize_query does it: per block scale
// amax / 2047, values round-half-even(x / scale) clamped to +-2047, as int16 for vpmaddwd.
void quantize_row(const float* x, int64_t D, int64_t qb, int16_t* ints, float* scales) {
  for (int64_t b = 0; b < D / qb; ++b) {
    float amax = 0.0f;
    for (int64_t i = 0; i < qb; ++i) amax = std::max(amax, std::fabs(x[b * qb + i]));
    const float s = amax / kQueryMax;
    const float safe = s > 0.0f ? s : 1.0f;
    for (int64_t i = 0; i < qb; ++i) {
      const float r = std::nearbyint(x[b * qb + i] / safe);
      ints[b * qb + i] = static_cast<int16_t>(std::max(-kQueryMax, std::min(kQueryMax, r)));
    }
    scales[b] = s;
  }
}

// Shared by both forms of the tile functions below.
// The key scales of block b for a tile's n <= 8 rows, padding rows 0. A full tile with one or
// two blocks a row (head_dim 64 at the default 32-value blocks: two) loads its scales and
// shuffles them into place; other full tiles gather them (eight scalar stores and a vector
// load of them would stall on store forwarding). The shuffle keeps the gather's loads out of
// the critical path of every tile. Same values any way.
inline __m256 tile_key_scales(const float* kscale, int64_t n, int64_t nb, int64_t b) {
  if (n == 8 && nb == 1) return _mm256_loadu_ps(kscale);
  if (n == 8 && nb == 2) {
    // lo = rows 0-3, hi = rows 4-7, as (block 0, block 1) pairs; lane b of every pair gives
    // rows (0 1 4 5 | 2 3 6 7), put in order by swapping the middle two 64-bit lanes
    const __m256 lo = _mm256_loadu_ps(kscale), hi = _mm256_loadu_ps(kscale + 8);
    const __m256 s = b == 0 ? _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0))
                            : _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), _MM_SHUFFLE(3, 1, 2, 0)));
  }
  if (n == 8)
    return _mm256_i32gather_ps(kscale + b, _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                              _mm256_set1_epi32(static_cast<int32_t>(nb))), 4);
  alignas(32) float col[8];
  for (int64_t r = 0; r < 8; ++r) col[r] = r < n ? kscale[r * nb + b] : 0.0f;
  return _mm256_load_ps(col);
}

// acc + (float(dots) * ks) * qs: one q8 block's term of eight rows' scores (dots the exact
// integer block dots, ks the rows' key scales, qs the query's block scale), in the order every
// path (PyTorch, float64, both native forms) takes it.
inline __m256 add_block_term(__m256 acc, __m256i dots, __m256 ksv, float qs) {
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dots), ksv), _mm256_set1_ps(qs)));
}

// s[g * stride + r] = lane r of acc[g] for the tile's n real rows (a full tile: one vector
// store per head; a short one must not write past its rows, the next head's start).
template <int GN>
inline void store_tile_scores(const __m256* acc, int64_t n, float* s, int64_t stride) {
  if (n == 8) {
    for (int g = 0; g < GN; ++g) _mm256_storeu_ps(s + g * stride, acc[g]);
    return;
  }
  alignas(32) float out8[8];
  for (int g = 0; g < GN; ++g) {
    _mm256_store_ps(out8, acc[g]);
    for (int64_t r = 0; r < n; ++r) s[g * stride + r] = out8[r];
  }
}

// w[(b * GN + g) * 32 + r] = p[g * stride + r] * vscale[r, b]: the per-head, per-block weights
// of n <= 32 value rows. Rows run contiguously per head so the products vectorise (with the
// heads innermost they are scalar multiplies); the products, and so the bits, are the same in
// any layout.
template <int GN>
inline void tile_value_weights(const float* p, int64_t stride, const float* vscale, int64_t n, int64_t nb,
                               float* w) {
  float sc[32];
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t r = 0; r < n; ++r) sc[r] = vscale[r * nb + b];
    for (int g = 0; g < GN; ++g) {
      const float* pg = p + g * stride;
      float* wg = w + (b * GN + g) * 32;
      for (int64_t r = 0; r < n; ++r) wg[r] = pg[r] * sc[r];
    }
  }
}

// Raw scores (no softmax scale) of GN quantized queries with one tile of n <= 8 key rows:
// s[g * stride + r] = sum_b (iq_g,b . ik_r,b) * ks_r,b * qs_g,b, in that order (as the PyTorch
// path: block dot times key scale times query scale, summed over blocks). The tile is stored
// pair-interleaved (packing.Q8Store.kt: [D/2][8 rows][2] int8), so one 16-byte load widened to
// int16 holds dimensions (2p, 2p+1) of all eight rows, and one vpmaddwd against the query's
// broadcast pair adds both products for eight rows at once: no horizontal sums, and each key
// load serves every query head. Integer block dots are exact, so the floats equal a row-major
// evaluation's.
template <int GN>
void q8_tile_scores(const int8_t* tile, const float* kscale, int64_t n, const int16_t* q16, const float* qs,
                    int64_t D, int64_t qb, float* s, int64_t stride) {
  const int64_t nb = D / qb;
  __m256 acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i ai[GN];
    for (int g = 0; g < GN; ++g) ai[g] = _mm256_setzero_si256();
    for (int64_t p = b * qb / 2; p < (b + 1) * qb / 2; ++p) {
      const __m256i kv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + p * 16)));
      for (int g = 0; g < GN; ++g) {
        int32_t pair;
        std::memcpy(&pair, q16 + g * D + 2 * p, sizeof(pair));
        ai[g] = _mm256_add_epi32(ai[g], _mm256_madd_epi16(kv, _mm256_set1_epi32(pair)));
      }
    }
    const __m256 ksv = tile_key_scales(kscale, n, nb, b);
    for (int g = 0; g < GN; ++g)
      acc[g] = add_block_term(acc[g], ai[g], ksv, qs[g * nb + b]);
  }
  store_tile_scores<GN>(acc, n, s, stride);
}

// o_g[0:D] += sum_r p[g * stride + r] * vscale[r, b(d)] * vi[r, d] for GN heads over n <= 32
// value rows (row-major int8 [n, D], one scale per block of qb values): the tile is summed
// apart, then added (see tiled_weighted_rows). Each int8 row slice is widened once for all
// heads; w [nb, GN, 32] is scratch for the per-head, per-block weights p * scale.
template <int GN>
void q8_tile_values(const int8_t* vrows, const float* vscale, int64_t n, const float* p, int64_t stride,
                    int64_t D, int64_t qb, float* w, float* const* o) {
  tile_value_weights<GN>(p, stride, vscale, n, D / qb, w);
  for (int64_t d0 = 0; d0 < D; d0 += 8) {  // qb is a multiple of 8: one block per slice
    const float* wb = w + (d0 / qb) * 32 * GN;
    __m256 acc[GN];
    for (int g = 0; g < GN; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t r = 0; r < n; ++r) {
      const __m256 vv = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vrows + r * D + d0))));
      for (int g = 0; g < GN; ++g) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(wb[g * 32 + r]), vv, acc[g]);
    }
    for (int g = 0; g < GN; ++g)
      _mm256_storeu_ps(o[g] + d0, _mm256_add_ps(_mm256_loadu_ps(o[g] + d0), acc[g]));
  }
}

// The probe's tile scorer (probe_clusters): q8_tile_scores' integer dots and float steps, head
// g reading only its own units (pairs of dimensions here, runs of four in the AVX-512 form),
// units[us[b] : us[b + 1]] of block b with us = ustart + g * (nb + 1), where its masked query is
// non-zero. The skipped products are exact zeros, and a block with none of its units would add
// (0 * ks) * qs = +0 to a sum that is never -0, so the scores are bit-identical to the full
// scorer's. The key loads repeat per head (from L1): one head's masked query touches only part
// of the runs, but the heads of a KV head together touch nearly all of them, so per-head lists
// save dots where a shared list would not. (The tile still comes from memory whole: from
// DRAM the pass is bound by that read, see probe_clusters.) Writes s[g * 8 + r].
template <int GN>
void probe_tile_scores(const int8_t* tile, const float* kscale, int64_t n, const int16_t* q16, const float* qs,
                       int64_t D, int64_t qb, const int64_t* units, const int64_t* ustart, float* s) {
  const int64_t nb = D / qb;
  __m256 acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 ksv = tile_key_scales(kscale, n, nb, b);
    for (int g = 0; g < GN; ++g) {
      const int64_t* us = ustart + g * (nb + 1);
      if (us[b] == us[b + 1]) continue;
      __m256i ai = _mm256_setzero_si256();
      for (int64_t u = us[b]; u < us[b + 1]; ++u) {
        const int64_t p = units[u];
        const __m256i kv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + p * 16)));
        int32_t pair;
        std::memcpy(&pair, q16 + g * D + 2 * p, sizeof(pair));
        ai = _mm256_add_epi32(ai, _mm256_madd_epi16(kv, _mm256_set1_epi32(pair)));
      }
      acc[g] = add_block_term(acc[g], ai, ksv, qs[g * nb + b]);
    }
  }
  store_tile_scores<GN>(acc, n, s, 8);
}

// ---- AVX-512 (BW + VNNI) forms of the opened-cluster phase, chosen at run time ----------------
// Same integer dots, same float operations in the same order per output element, so the
// outputs are bit-identical to the AVX2 forms above (tests compare the two with torch.equal);
// what changes is the instruction count: one vpdpwssd per query head handles two dimension
// pairs of eight rows (the AVX2 form needs a vpmaddwd and a vpaddd for one pair), and the
// values take 16-wide FMAs with the head weight broadcast from memory. This phase is bound by
// instruction throughput, not memory, so fewer instructions are what pays.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

// The exact block dots of eight rows from a vpdpwssd accumulator whose lanes 0-7 hold pair 2j's
// products and lanes 8-15 pair 2j+1's (see vnni_queries).
inline __m256i fold_pairs(__m512i ai) {
  return _mm256_add_epi32(_mm512_castsi512_si256(ai), _mm512_extracti64x4_epi64(ai, 1));
}

// Query pairs laid out for vpdpwssd against a 32-byte run of a tile (dims 4j..4j+3 of 8 rows:
// int32 lanes 0-7 hold pair 2j, lanes 8-15 pair 2j+1): qx[(g * D/4 + j) * 16 + lane].
template <int GN>
void vnni_queries(const int16_t* q16, int64_t D, int32_t* qx) {
  for (int g = 0; g < GN; ++g)
    for (int64_t j = 0; j < D / 4; ++j) {
      int32_t p0, p1;
      std::memcpy(&p0, q16 + g * D + 4 * j, sizeof(p0));
      std::memcpy(&p1, q16 + g * D + 4 * j + 2, sizeof(p1));
      int32_t* o = qx + (g * (D / 4) + j) * 16;
      for (int l = 0; l < 8; ++l) {
        o[l] = p0;
        o[8 + l] = p1;
      }
    }
}

// q8_tile_scores (same contract) with vpdpwssd: each 32-byte load of the tile, widened to
// int16, carries pairs 2j and 2j+1 of the eight rows; the two halves of the int32 accumulator
// are added at the end of each q8 block, giving the same exact block dots.
template <int GN>
void q8_tile_scores_512(const int8_t* tile, const float* kscale, int64_t n, const int32_t* qx, const float* qs,
                        int64_t D, int64_t qb, float* s, int64_t stride) {
  const int64_t nb = D / qb, D4 = D / 4;
  __m256 acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ai[GN];
    for (int g = 0; g < GN; ++g) ai[g] = _mm512_setzero_si512();
    for (int64_t j = b * qb / 4; j < (b + 1) * qb / 4; ++j) {
      const __m512i kv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + j * 32)));
      for (int g = 0; g < GN; ++g)
        ai[g] = _mm512_dpwssd_epi32(ai[g], kv, _mm512_loadu_si512(qx + (g * D4 + j) * 16));
    }
    const __m256 ksv = tile_key_scales(kscale, n, nb, b);
    for (int g = 0; g < GN; ++g) acc[g] = add_block_term(acc[g], fold_pairs(ai[g]), ksv, qs[g * nb + b]);
  }
  store_tile_scores<GN>(acc, n, s, stride);
}

// q8_tile_values (same contract, qb a multiple of 16) in 16-wide slices.
template <int GN>
void q8_tile_values_512(const int8_t* vrows, const float* vscale, int64_t n, const float* p, int64_t stride,
                        int64_t D, int64_t qb, float* w, float* const* o) {
  tile_value_weights<GN>(p, stride, vscale, n, D / qb, w);
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    const float* wb = w + (d0 / qb) * 32 * GN;
    __m512 acc[GN];
    for (int g = 0; g < GN; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t r = 0; r < n; ++r) {
      const __m512 vv = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vrows + r * D + d0))));
      for (int g = 0; g < GN; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(wb[g * 32 + r]), vv, acc[g]);
    }
    for (int g = 0; g < GN; ++g)
      _mm512_storeu_ps(o[g] + d0, _mm512_add_ps(_mm512_loadu_ps(o[g] + d0), acc[g]));
  }
}

// probe_tile_scores (same contract) in runs of four dimensions with vpdpwssd (queries as
// vnni_queries lays them out).
template <int GN>
void probe_tile_scores_512(const int8_t* tile, const float* kscale, int64_t n, const int32_t* qx, const float* qs,
                           int64_t D, int64_t qb, const int64_t* units, const int64_t* ustart, float* s) {
  const int64_t nb = D / qb, D4 = D / 4;
  __m256 acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 ksv = tile_key_scales(kscale, n, nb, b);
    for (int g = 0; g < GN; ++g) {
      const int64_t* us = ustart + g * (nb + 1);
      if (us[b] == us[b + 1]) continue;
      __m512i ai = _mm512_setzero_si512();
      for (int64_t u = us[b]; u < us[b + 1]; ++u) {
        const int64_t j = units[u];
        const __m512i kv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + j * 32)));
        ai = _mm512_dpwssd_epi32(ai, kv, _mm512_loadu_si512(qx + (g * D4 + j) * 16));
      }
      acc[g] = add_block_term(acc[g], fold_pairs(ai), ksv, qs[g * nb + b]);
    }
  }
  store_tile_scores<GN>(acc, n, s, 8);
}

// tiled_weighted_rows (same contract and bits) for GN <= 4 heads at once, D % 64 == 0: each
// value row of a 32-row tile is loaded once per 64 columns (four registers) for all GN heads,
// where tiled_weighted_rows re-reads the tile per head; per head and column the FMA chain over
// the tile starts at zero and is then added to o, as there. Passes of 64 columns for at most
// four heads rather than 32 columns for all of them: a 32-column pass reads half a row, which
// loses once the rows come from DRAM.
template <int GN>
void tiled_weighted_rows_512(const float* p, int64_t p_stride, const float* const* rows, int64_t n, int64_t D,
                             float* o, int64_t o_stride) {
  for (int64_t r0 = 0; r0 < n; r0 += 32) {
    const int64_t r1 = std::min<int64_t>(n, r0 + 32);
    for (int64_t d = 0; d < D; d += 64) {
      __m512 acc[GN][4];
      for (int g = 0; g < GN; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int64_t j = r0; j < r1; ++j) {
        __m512 v[4];
        for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_ps(rows[j] + d + 16 * c);
        for (int g = 0; g < GN; ++g) {
          const __m512 w = _mm512_set1_ps(p[g * p_stride + j]);
          for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
      }
      for (int g = 0; g < GN; ++g)
        for (int c = 0; c < 4; ++c) {
          float* og = o + g * o_stride + d + 16 * c;
          _mm512_storeu_ps(og, _mm512_add_ps(_mm512_loadu_ps(og), acc[g][c]));
        }
    }
  }
}

#pragma GCC pop_options

// The opened clusters ids[j0:j1] of one KV head, scored for GN query heads with the tile
// function Tile (q8_tile_scores on int16 queries, or q8_tile_scores_512 on vnni_queries):
// scores[g * R + off + r] for the r-th member of the run. The AVX-512 tile cannot be inlined
// into this AVX2-target loop; a call per 8 rows costs no more than a loop inlined in the
// AVX-512 region would.
template <int GN, typename Q, void (*Tile)(const int8_t*, const float*, int64_t, const Q*, const float*, int64_t,
                                           int64_t, float*, int64_t)>
void item_scores(const int64_t* ids, int64_t j0, int64_t j1, const int64_t* cnt, const int8_t* kt, const float* ks,
                 int64_t tile_bytes, int64_t nb, int64_t cs, const Q* q, const float* qs, int64_t D, int64_t qb,
                 float* scores, int64_t R) {
  int64_t off = 0;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t c = ids[j], n = cnt[c];
    for (int64_t r = 0; r < n; r += 8)
      Tile(kt + c * tile_bytes + r * D, ks + (c * cs + r) * nb, std::min<int64_t>(8, n - r), q, qs, D, qb,
           scores + off + r, R);
    off += n;
  }
}

// The values of the same run, weighted by p[g * R + ...], added into o[g] (Tile:
// q8_tile_values or q8_tile_values_512).
template <int GN, void (*Tile)(const int8_t*, const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*,
                               float* const*)>
void item_values(const int64_t* ids, int64_t j0, int64_t j1, const int64_t* cnt, const int8_t* vi, const float* vs,
                 int64_t nb, int64_t cs, const float* p, int64_t R, int64_t D, int64_t qb, float* w, float* const* o) {
  int64_t off = 0;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t c = ids[j], n = cnt[c];
    for (int64_t r0 = 0; r0 < n; r0 += 32)
      Tile(vi + (c * cs + r0) * D, vs + (c * cs + r0) * nb, std::min<int64_t>(32, n - r0), p + off + r0, R, D, qb,
           w, o);
    off += n;
  }
}

// For each of G heads, o_g += sum_j p_g[j] * rows[j] (p_g = p + g * p_stride, o_g = o + g *
// o_stride) in tiles of 32 rows, each summed apart first (tmp [D]): a sum over thousands of rows
// in one float accumulator would err ~n ulp, tiles keep it ~(32 + n / 32). Every head reads a
// tile while it is in L1; per head the arithmetic and its order are those of G = 1.
void tiled_weighted_rows(const float* p, int64_t p_stride, int64_t G, const float* const* rows, int64_t n,
                         int64_t D, float* o, int64_t o_stride, float* tmp) {
  for (int64_t r0 = 0; r0 < n; r0 += 32)
    for (int64_t g = 0; g < G; ++g) {
      std::fill(tmp, tmp + D, 0.0f);
      weighted_rows(p + g * p_stride + r0, rows + r0, std::min<int64_t>(32, n - r0), D, tmp);
      axpy(1.0f, tmp, o + g * o_stride, D);
    }
}

// tiled_weighted_rows for G heads (p and o per head p_stride / o_stride apart), in its AVX-512
// form where `wide` and D % 64 == 0 (heads in passes of four): the same bits either way.
void heads_weighted_rows(bool wide, const float* p, int64_t p_stride, int64_t G, const float* const* rows,
                         int64_t n, int64_t D, float* o, int64_t o_stride, float* tmp) {
  if (!wide || D % 64 != 0) return tiled_weighted_rows(p, p_stride, G, rows, n, D, o, o_stride, tmp);
  for (int64_t g0 = 0; g0 < G; g0 += 4)
    with_heads<4>(std::min<int64_t>(4, G - g0), [&](auto gn) {
      tiled_weighted_rows_512<decltype(gn)::value>(p + g0 * p_stride, p_stride, rows, n, D, o + g0 * o_stride,
                                                   o_stride);
    });
}

// The probe of one KV head (SCSAConfig.probe_dims): marks op[c] for the clusters holding each
// query head's `keys` best member rows, every row of the M clusters scored q.c + q8dot(q_S, k - c)
// with q_S the query kept on its `dims` largest |q_i| (ties: the lower dimension) and quantized
// as the opened rows' query is; qc [G, M] holds q.c per cluster (phase A's centre dots). Rows
// rank by score, ties to the lower row c * cs + i, as the PyTorch path's stable sort does.
// One pass over the key tiles: each head's dots read only the dimension units where its query
// is non-zero (probe_tile_scores), and each tile's scores go straight to the heads' best lists.
// The rows are met in ascending order, so once a head's list is full a row can only enter with a
// strictly higher score than the list's last; one vector compare per head and tile finds the
// (rare) rows that do, so no G x rows score table is stored and ranked afterwards. From DRAM,
// as in a model step, the pass is bound by reading every key tile, so the number of probed
// dimensions matters little there.
void probe_clusters(const float* qh, int64_t G, int64_t D, int64_t qb, int64_t dims, int64_t keys, int64_t M,
                    const int64_t* cnt, int64_t cs, const int8_t* kt, const float* ks, int64_t tile_bytes,
                    const float* qc, bool wide, bool* op) {
  const int64_t nb = D / qb;
  std::vector<int16_t> q16(G * D);
  std::vector<float> qs(G * nb), qm(D);
  std::vector<int64_t> order(D);
  for (int64_t g = 0; g < G; ++g) {
    const float* q = qh + g * D;
    for (int64_t d = 0; d < D; ++d) order[d] = d;
    std::stable_sort(order.begin(), order.end(),
                     [q](int64_t a, int64_t b) { return std::fabs(q[a]) > std::fabs(q[b]); });
    std::fill(qm.begin(), qm.end(), 0.0f);
    for (int64_t i = 0; i < std::min(dims, D); ++i) qm[order[i]] = q[order[i]];
    quantize_row(qm.data(), D, qb, q16.data() + g * D, qs.data() + g * nb);
  }
  struct Row { float s; int64_t at; };  // at = c * cs + i
  auto before = [](const Row& a, const Row& b) { return a.s > b.s || (a.s == b.s && a.at < b.at); };
  std::vector<std::vector<Row>> best(G);
  // per head, the scorer's units (pairs, or runs of four in the AVX-512 form) where its masked,
  // quantized query is non-zero, block by block: units[ustart[g * (nb + 1) + b] ...]
  const int64_t width = wide ? 4 : 2;
  std::vector<int64_t> units, ustart(G * (nb + 1));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      ustart[g * (nb + 1) + b] = static_cast<int64_t>(units.size());
      for (int64_t u = b * qb / width; u < (b + 1) * qb / width; ++u)
        if (std::any_of(q16.begin() + g * D + u * width, q16.begin() + g * D + (u + 1) * width,
                        [](int16_t x) { return x != 0; }))
          units.push_back(u);
    }
    ustart[g * (nb + 1) + nb] = static_cast<int64_t>(units.size());
  }
  std::vector<int32_t> qx;
  if (wide) qx.resize(G * (D / 4) * 16);
  alignas(32) float sl[8 * 8] = {};  // one tile's scores, [GN][8] (lanes past a short tile: masked off)
  for (int64_t g0 = 0; g0 < G; g0 += 8)
    with_heads(std::min<int64_t>(8, G - g0), [&](auto gn) {
      constexpr int GN = decltype(gn)::value;
      if (wide) vnni_queries<GN>(q16.data() + g0 * D, D, qx.data() + g0 * (D / 4) * 16);
      for (int64_t c = 0; c < M; ++c)
        for (int64_t r0 = 0; r0 < cnt[c]; r0 += 8) {
          const int64_t n = std::min<int64_t>(8, cnt[c] - r0);
          const int8_t* tile = kt + c * tile_bytes + r0 * D;
          const float* kscale = ks + (c * cs + r0) * nb;
          if (wide)
            probe_tile_scores_512<GN>(tile, kscale, n, qx.data() + g0 * (D / 4) * 16, qs.data() + g0 * nb, D, qb,
                                      units.data(), ustart.data() + g0 * (nb + 1), sl);
          else
            probe_tile_scores<GN>(tile, kscale, n, q16.data() + g0 * D, qs.data() + g0 * nb, D, qb, units.data(),
                                  ustart.data() + g0 * (nb + 1), sl);
          for (int g = 0; g < GN; ++g) {
            std::vector<Row>& bg = best[g0 + g];
            const float z = qc[(g0 + g) * M + c];
            const __m256 row_s = _mm256_add_ps(_mm256_load_ps(sl + g * 8), _mm256_set1_ps(z));
            int live = (1 << n) - 1;
            if (static_cast<int64_t>(bg.size()) == keys)
              live &= _mm256_movemask_ps(_mm256_cmp_ps(row_s, _mm256_set1_ps(bg.back().s), _CMP_GT_OQ));
            for (int64_t r = 0; live; ++r, live >>= 1) {
              if (!(live & 1)) continue;
              const Row row{sl[g * 8 + r] + z, c * cs + r0 + r};
              if (static_cast<int64_t>(bg.size()) == keys && !before(row, bg.back())) continue;
              bg.insert(std::upper_bound(bg.begin(), bg.end(), row, before), row);
              if (static_cast<int64_t>(bg.size()) > keys) bg.pop_back();
            }
          }
        }
    });
  for (const auto& bg : best)
    for (const Row& row : bg) op[row.at / cs] = true;
}

// Grows a per-thread scratch buffer to at least n elements (never shrinks; contents are not
// kept meaningful between calls, every user writes before it reads). Kept rather than fresh
// std::vectors per KV head and call because in a model step, whose heap Python and the
// compiled graph keep busy, their malloc and zero fill are a visible part of the step.
template <typename T>
inline void fit(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// One row as the header describes, or a single-row decode call's tensors as the model holds
// them, q [1, H, 1, D] and k, v [1, Hkv, N, D] (out then [1, H, 1, D]): taking those views here
// rather than in Python keeps them out of the decode loop's Python (SCSALayer._hot_call).
std::tuple<at::Tensor, at::Tensor, at::Tensor> scsa_decode(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, int64_t s0, int64_t s1,
    const at::Tensor& extra, const at::Tensor& summ, const at::Tensor& resid, const at::Tensor& log_counts,
    const at::Tensor& radius, const at::Tensor& vmean, const at::Tensor& counts, int64_t M, const at::Tensor& kt,
    const at::Tensor& ks, const at::Tensor& vi, const at::Tensor& vs, const at::Tensor& taus, double scale,
    int64_t probe_dims, int64_t probe_keys, const std::optional<at::Tensor>& extra_k,
    const std::optional<at::Tensor>& extra_v, const std::optional<at::Tensor>& sink_logits, int64_t isa) {
  const bool four = q_in.dim() == 4;
  TORCH_CHECK(!four || (q_in.size(0) == 1 && q_in.size(2) == 1 && k_in.dim() == 4 && v_in.dim() == 4 &&
                        k_in.size(0) == 1 && v_in.size(0) == 1),
              "scsa_decode: a 4-D call is one row: q [1, H, 1, D], k/v [1, Hkv, N, D]");
  const at::Tensor q = four ? q_in.select(0, 0).select(1, 0) : q_in;
  const at::Tensor k = four ? k_in.select(0, 0) : k_in;
  const at::Tensor v = four ? v_in.select(0, 0) : v_in;
  TORCH_CHECK(q.dim() == 2 && k.dim() == 3 && v.dim() == 3, "scsa_decode: q [H, D], k/v [Hkv, N, D]");
  const auto kt_ = k.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && v.scalar_type() == kt_ &&
              (kt_ == at::kFloat || kt_ == at::kBFloat16 || kt_ == at::kChar),
              "scsa_decode: float32 queries; k and v float32, bfloat16 or int8 q8 rows alike");
  const bool bf16 = kt_ == at::kBFloat16, q8 = kt_ == at::kChar;
  const int64_t H = q.size(0), D = q.size(1), Hkv = k.size(0), N = k.size(1);
  const int64_t W = q8 ? longattn::q8_width(D) : D;  // elements of a stored row
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "scsa_decode: query heads must be a multiple of KV heads");
  TORCH_CHECK(D % 8 == 0 && D <= 512, "scsa_decode: head_dim must be a multiple of 8 and <= 512");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == W && k.stride(2) == 1 && k.stride(1) == W &&
              v.stride(2) == 1 && v.stride(1) == W, "scsa_decode: k/v [Hkv, N, W] with contiguous rows");
  TORCH_CHECK(0 <= s0 && s0 <= s1 && s1 <= N, "scsa_decode: need 0 <= s0 <= s1 <= N");
  TORCH_CHECK(extra.dim() == 2 && extra.size(0) == Hkv && extra.scalar_type() == at::kLong && extra.is_contiguous(),
              "scsa_decode: extra int64 [Hkv, X] contiguous");
  const int64_t X = extra.size(1);
  const int64_t* xp = extra.data_ptr<int64_t>();
  for (int64_t i = 0; i < Hkv * X; ++i)
    TORCH_CHECK(s0 <= xp[i] && xp[i] < s1, "scsa_decode: extra slots must lie in [s0, s1)");
  TORCH_CHECK(extra_k.has_value() == extra_v.has_value(), "scsa_decode: extra_k and extra_v go together");
  const float *xkp = nullptr, *xvp = nullptr;
  if (extra_k.has_value()) {
    for (const auto* t : {&*extra_k, &*extra_v})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == at::IntArrayRef({Hkv, X, D}),
                  "scsa_decode: extra_k/extra_v float32 [Hkv, X, D] contiguous");
    xkp = extra_k->data_ptr<float>();
    xvp = extra_v->data_ptr<float>();
  }
  TORCH_CHECK(summ.dim() == 4 && summ.size(0) == Hkv && summ.size(3) == D && summ.size(1) >= M && M >= 0,
              "scsa_decode: summ [Hkv, C >= M, 1 + r, D]");
  const int64_t C = summ.size(1), R1 = summ.size(2);
  TORCH_CHECK(resid.sizes() == at::IntArrayRef({Hkv, C, D}) && vmean.sizes() == resid.sizes() &&
              radius.sizes() == at::IntArrayRef({Hkv, C}) && log_counts.numel() >= M && counts.numel() >= M,
              "scsa_decode: resid/vmean [Hkv, C, D], radius [Hkv, C], log_counts/counts [>= M]");
  TORCH_CHECK(vi.dim() == 4 && vi.size(0) == Hkv && vi.size(1) >= M && vi.size(3) == D &&
              kt.scalar_type() == at::kChar && vi.scalar_type() == at::kChar,
              "scsa_decode: vi int8 [Hkv, Cs >= M, cs, D]");
  const int64_t Cs = vi.size(1), cs = vi.size(2), tiles = (cs + 7) / 8;
  TORCH_CHECK(kt.sizes() == at::IntArrayRef({Hkv, Cs, tiles, D / 2, 8, 2}),
              "scsa_decode: kt int8 [Hkv, Cs, ceil(cs / 8), D / 2, 8, 2]");
  TORCH_CHECK(ks.dim() == 4 && ks.size(0) == Hkv && ks.size(1) == Cs && ks.size(2) == cs &&
              ks.size(3) > 0 && D % ks.size(3) == 0 && vs.sizes() == ks.sizes(),
              "scsa_decode: ks/vs [Hkv, Cs, cs, nb] with D % nb == 0");
  const int64_t nb = ks.size(3), qb = D / nb;
  TORCH_CHECK(qb % 8 == 0, "scsa_decode: q8 blocks must hold a multiple of 8 values");
  TORCH_CHECK(taus.numel() == Hkv, "scsa_decode: taus [Hkv]");
  TORCH_CHECK(probe_dims >= 0 && probe_keys >= 1, "scsa_decode: probe_dims >= 0 and probe_keys >= 1");
  for (const auto* t : {&summ, &resid, &radius, &vmean, &ks, &vs, &log_counts, &taus})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "scsa_decode: float32 contiguous index tensors");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() && kt.is_contiguous() && vi.is_contiguous(),
              "scsa_decode: counts int64, kt/vi contiguous");
  const auto qc = q.contiguous();
  at::Tensor sink_c;
  if (sink_logits.has_value()) {
    TORCH_CHECK(sink_logits->scalar_type() == at::kFloat && sink_logits->numel() == H,
                "scsa_decode: sink_logits float32 [H]");
    sink_c = sink_logits->contiguous();
  }
  const float* sinkp = sink_logits.has_value() ? sink_c.data_ptr<float>() : nullptr;

  const int64_t G = H / Hkv, E = s0 + X + (N - s1), PW = D + 2;
  const float beta = static_cast<float>(scale);
  const float half_b2 = static_cast<float>(0.5 * scale * scale);  // as PyTorch rounds the scalar
  const float* qp = qc.data_ptr<float>();
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_hs = k.stride(0) * k.element_size(), v_hs = v.stride(0) * v.element_size();
  const int64_t row_bytes = W * k.element_size();
  const bool stored = bf16 || q8;  // rows that widen into scratch before they are read
  const float *summp = summ.data_ptr<float>(), *residp = resid.data_ptr<float>();
  const float *lcp = log_counts.data_ptr<float>(), *radp = radius.data_ptr<float>();
  const float *vmp = vmean.data_ptr<float>(), *tausp = taus.data_ptr<float>();
  const int64_t* cntp = counts.data_ptr<int64_t>();
  const int8_t *ktp = kt.data_ptr<int8_t>(), *vip = vi.data_ptr<int8_t>();
  const float *ksp = ks.data_ptr<float>(), *vsp = vs.data_ptr<float>();

  auto opened = at::zeros({Hkv, M}, q.options().dtype(at::kBool));
  bool* openp = opened.data_ptr<bool>();
  // Per KV head: the quantized queries (phase B reads them) and two parts per query head,
  // [0] exact rows and [1] unopened clusters' tails.
  std::vector<int16_t> q16(Hkv * G * D);
  std::vector<float> qsc(Hkv * G * nb);
  std::vector<float> head_parts(Hkv * G * 2 * PW);
  // q.c of every cluster's centroid per query head (raw, unscaled): the packed keys are
  // relative to it, so phase B adds it to each opened member's residual score
  std::vector<float> qcent(Hkv * G * M);

  const bool wide = longattn::use_avx512(isa);  // cpu_features.h
  const int64_t tile_bytes = tiles * 8 * D;
  at::parallel_for(0, Hkv, 1, [&](int64_t h0, int64_t h1) {
    // per-thread scratch kept between calls (see fit)
    thread_local std::vector<float> q2, qn, est, tail, sx, lex, tmp, w, wk, wv;
    thread_local std::vector<Ranked> order;
    thread_local std::vector<const float*> rows, vrows, vm_rows, srow, rrow;
    fit(q2, G * D); fit(qn, G); fit(est, G * M); fit(tail, G * M); fit(sx, G * E); fit(lex, G); fit(tmp, D);
    fit(w, G * M); fit(order, M); fit(rows, E); fit(vrows, E); fit(vm_rows, M); fit(srow, 8 * R1); fit(rrow, 8);
    if (stored) {
      fit(wk, E * D);
      fit(wv, E * D);
    }
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
      // clusters at a time (dot8: eight independent chains, one horizontal sum per eight dots,
      // where one dot at a time waits on its latency chain and reduction)
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
            qcent[(h * G + g) * M + c] = z0[j];
            const float t = z0[j] * beta + lcp[c];
            tail[g * M + c] = t;
            est[g * M + c] = t + std::min(half_b2 * (quad[j] + low[j]), (beta * qn[g]) * radp[h * C + c]);
          }
        }
      }
      // exact rows: sinks, the outliers, then the unsealed suffix
      const char* kh = kp + h * k_hs;
      const char* vh = vp + h * v_hs;
      for (int64_t e = 0; e < E; ++e) {
        if (xkp != nullptr && e >= s0 && e < s0 + X) {  // the index's copy of this outlier row
          rows[e] = xkp + (h * X + e - s0) * D;
          vrows[e] = xvp + (h * X + e - s0) * D;
          continue;
        }
        const int64_t slot = e < s0 ? e : e < s0 + X ? xp[h * X + e - s0] : s1 + (e - s0 - X);
        const char *kr = kh + slot * row_bytes, *vr = vh + slot * row_bytes;
        if (!stored) {
          rows[e] = reinterpret_cast<const float*>(kr);
          vrows[e] = reinterpret_cast<const float*>(vr);
          continue;
        }
        float *ko = wk.data() + e * D, *vo = wv.data() + e * D;
        if (q8) {
          longattn::q8_widen(reinterpret_cast<const int8_t*>(kr), D, ko);
          longattn::q8_widen(reinterpret_cast<const int8_t*>(vr), D, vo);
        } else {
          const auto *kb = reinterpret_cast<const uint16_t*>(kr), *vb = reinterpret_cast<const uint16_t*>(vr);
          for (int64_t d = 0; d < D; ++d) {
            ko[d] = longattn::to_float(kb[d]);
            vo[d] = longattn::to_float(vb[d]);
          }
        }
        rows[e] = ko;
        vrows[e] = vo;
      }
      // Every query head reads each block of rows while it is in L1 (8 key rows, then 32 value
      // rows, for all G heads): with the clusters' outliers E reaches thousands of scattered
      // rows, and one pass per head over all of them would go to memory G times. Per head the
      // arithmetic and its order are those of one pass per head.
      int64_t e8 = 0;
      for (; e8 + 8 <= E; e8 += 8)
        for (int64_t g = 0; g < G; ++g) dot8(qh + g * D, rows.data() + e8, D, sx.data() + g * E + e8);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = sx.data() + g * E;
        for (int64_t e = e8; e < E; ++e) sg[e] = dot(qh + g * D, rows[e], D);
        for (int64_t e = 0; e < E; ++e) sg[e] *= beta;
        Part ex{head_parts.data() + ((h * G + g) * 2) * PW};
        ex.clear(D);
        const float sink = sinkp != nullptr ? sinkp[h * G + g] : kNegInf;  // a zero value row
        if (E == 0) {
          lex[g] = sink;
          if (sinkp != nullptr) {
            ex.p[0] = sink;
            ex.p[1] = 1.0f;
          }
          continue;
        }
        const float m = std::max(max_of(sg, E), sink);
        float l = exp_shift_sum(sg, E, m);
        if (sinkp != nullptr) l += std::exp(sink - m);
        lex[g] = m + std::log(l);
        ex.p[0] = m;
        ex.p[1] = l;
      }
      heads_weighted_rows(wide, sx.data(), E, G, vrows.data(), E, D, head_parts.data() + (h * G * 2) * PW + 2,
                          2 * PW, tmp.data());
      // stop rule per query head (kernel.stop_counts: float32 terms, sums in double as torch's
      // cumsum accumulates them), union of the prefixes
      bool* op = openp + h * M;
      const float tau = tausp[h];
      for (int64_t g = 0; g < G && M > 0; ++g) {
        const float* eg = est.data() + g * M;
        const float mx = std::max(max_of(eg, M), lex[g]);
        double all = 0.0;
        for (int64_t c = 0; c < M; ++c) {
          order[c] = {eg[c], c, std::exp(eg[c] - mx)};
          all += static_cast<double>(order[c].w);
        }
        const float total = std::exp(lex[g] - mx) + static_cast<float>(all);
        const int64_t k = stop_prefix(order.data(), M, tau * total);
        for (int64_t i = 0; i < k; ++i) op[order[i].id] = true;
      }
      if (probe_dims > 0 && M > 0)  // the key-level net: opens more, before the tails are taken
        probe_clusters(qh, G, D, qb, probe_dims, probe_keys, M, cntp, cs, ktp + h * Cs * tile_bytes,
                       ksp + h * Cs * cs * nb, tile_bytes, qcent.data() + h * G * M, wide, op);
      // tails of the unopened clusters, at their value means: the same clusters for every query
      // head (op is the union of their prefixes), each head's weights a row of w [G, nt]
      int64_t nt = 0;
      for (int64_t c = 0; c < M; ++c)
        if (!op[c]) vm_rows[nt++] = vmp + (h * C + c) * D;
      for (int64_t g = 0; g < G; ++g) {
        Part tp{head_parts.data() + ((h * G + g) * 2 + 1) * PW};
        tp.clear(D);
        const float* tg = tail.data() + g * M;
        float* wg = w.data() + g * nt;
        float m = kNegInf;
        for (int64_t c = 0; c < M; ++c)
          if (!op[c]) m = std::max(m, tg[c]);
        if (m == kNegInf) {  // no tail mass: a zero row adds +0 to the cleared numerator
          std::fill(wg, wg + nt, 0.0f);
          continue;
        }
        float l = 0.0f;
        for (int64_t c = 0, i = 0; c < M; ++c) {
          if (op[c]) continue;
          wg[i] = std::exp(tg[c] - m);
          l += wg[i++];
        }
        tp.p[0] = m;
        tp.p[1] = l;
      }
      if (nt > 0)
        heads_weighted_rows(wide, w.data(), nt, G, vm_rows.data(), nt, D,
                            head_parts.data() + (h * G * 2 + 1) * PW + 2, 2 * PW, tmp.data());
    }
  });

  // Phase B: opened clusters, ascending per head, cut into one run of about equal rows per
  // thread (a run may cover the end of one head and the start of the next: an item per head
  // piece). The KV heads of a layer open very different amounts, so an equal split per head
  // would leave threads waiting on the one with the most rows.
  std::vector<std::vector<int64_t>> lists(Hkv);
  int64_t total = 0;
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t c = 0; c < M; ++c)
      if (openp[h * M + c]) {
        lists[h].push_back(c);
        total += cntp[c];
      }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  struct Item { int64_t h, c0, c1, t; };  // clusters lists[h][c0:c1], read by thread t
  std::vector<Item> items;
  int64_t before = 0;
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t j = 0; j < static_cast<int64_t>(lists[h].size()); ++j) {
      const int64_t n = cntp[lists[h][j]];
      // the thread whose share of the rows holds this cluster's middle row (non-decreasing)
      const int64_t t = std::min(threads - 1, (2 * before + n) * threads / (2 * total));
      if (items.empty() || items.back().h != h || items.back().t != t)
        items.push_back({h, j, j + 1, t});
      else
        items.back().c1 = j + 1;
      before += n;
    }
  std::vector<int64_t> first(threads + 1, static_cast<int64_t>(items.size()));  // thread t: [first[t], first[t+1])
  for (int64_t i = static_cast<int64_t>(items.size()) - 1; i >= 0; --i)
    for (int64_t t = 0; t <= items[i].t; ++t) first[t] = i;
  const int64_t I = static_cast<int64_t>(items.size());
  std::vector<float> item_parts(I * G * PW);

  // its values form needs whole 16-value slices in one block
  const bool wide_values = wide && qb % 16 == 0;
  std::vector<int32_t> qx;
  if (wide) {  // the queries laid out for vpdpwssd, per KV head, once per call
    qx.resize(Hkv * G * (D / 4) * 16);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g0 = 0; g0 < G; g0 += 8)
        with_heads(std::min<int64_t>(8, G - g0), [&](auto gn) {
          vnni_queries<decltype(gn)::value>(q16.data() + (h * G + g0) * D, D, qx.data() + (h * G + g0) * (D / 4) * 16);
        });
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    // the scores of a run (G x rows, hundreds of KB at 32K) outlive the call, one buffer per
    // thread, grown as needed, so the call's only large allocation is not paid on every call
    static thread_local std::vector<float> scores;
    thread_local std::vector<float> w;  // see fit
    fit(w, D / qb * 32 * 8);
    for (int64_t it = first[t0]; it < first[t1]; ++it) {
      const Item& item = items[it];
      const int64_t h = item.h;
      const int64_t* ids = lists[h].data();
      int64_t R = 0;
      for (int64_t j = item.c0; j < item.c1; ++j) R += cntp[ids[j]];
      if (scores.size() < static_cast<size_t>(G * R)) scores.resize(G * R);
      const int8_t* kth = ktp + h * Cs * tile_bytes;
      const float *ksh = ksp + h * Cs * cs * nb, *vsh = vsp + h * Cs * cs * nb;
      const int8_t* vih = vip + h * Cs * cs * D;
      for (int64_t g0 = 0; g0 < G; g0 += 8)  // heads in register-sized chunks
        with_heads(std::min<int64_t>(8, G - g0), [&](auto gn) {
          constexpr int GN = decltype(gn)::value;
          const float* qhs = qsc.data() + (h * G + g0) * nb;
          if (wide)
            item_scores<GN, int32_t, q8_tile_scores_512<GN>>(ids, item.c0, item.c1, cntp, kth, ksh, tile_bytes, nb,
                                                             cs, qx.data() + (h * G + g0) * (D / 4) * 16, qhs, D,
                                                             qb, scores.data() + g0 * R, R);
          else
            item_scores<GN, int16_t, q8_tile_scores<GN>>(ids, item.c0, item.c1, cntp, kth, ksh, tile_bytes, nb, cs,
                                                         q16.data() + (h * G + g0) * D, qhs, D, qb,
                                                         scores.data() + g0 * R, R);
        });
      for (int64_t g = 0; g < G; ++g) {  // the centre terms: raw score = q.c + residual dot
        const float* qcg = qcent.data() + (h * G + g) * M;
        float* sg = scores.data() + g * R;
        for (int64_t j = item.c0, off = 0; j < item.c1; off += cntp[ids[j]], ++j) {
          const float z = qcg[ids[j]];
          for (int64_t r = 0; r < cntp[ids[j]]; ++r) sg[off + r] += z;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        Part pt{item_parts.data() + (it * G + g) * PW};
        pt.clear(D);
        float* sg = scores.data() + g * R;
        const float m = scale_max(sg, R, beta);
        pt.p[0] = m;
        pt.p[1] = exp_shift_sum(sg, R, m);
      }
      for (int64_t g0 = 0; g0 < G; g0 += 8)
        with_heads(std::min<int64_t>(8, G - g0), [&](auto gn) {
          constexpr int GN = decltype(gn)::value;
          float* outs[GN];
          for (int g = 0; g < GN; ++g) outs[g] = item_parts.data() + (it * G + g0 + g) * PW + 2;
          if (wide_values)
            item_values<GN, q8_tile_values_512<GN>>(ids, item.c0, item.c1, cntp, vih, vsh, nb, cs,
                                                    scores.data() + g0 * R, R, D, qb, w.data(), outs);
          else
            item_values<GN, q8_tile_values<GN>>(ids, item.c0, item.c1, cntp, vih, vsh, nb, cs,
                                                scores.data() + g0 * R, R, D, qb, w.data(), outs);
        });
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
  return {four ? out.view({1, H, 1, D}) : out, opened, at::scalar_tensor(opened_rows, at::kLong)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("scsa_decode(Tensor q, Tensor k, Tensor v, int s0, int s1, Tensor extra, Tensor summ, "
        "Tensor resid, Tensor log_counts, Tensor radius, Tensor vmean, Tensor counts, int M, Tensor kt, Tensor ks, "
        "Tensor vi, Tensor vs, Tensor taus, float scale, int probe_dims=0, int probe_keys=1, "
        "Tensor? extra_k=None, Tensor? extra_v=None, Tensor? sink_logits=None, int isa=-1) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(longattn_cpu, CPU, m) {
  m.impl("scsa_decode", &scsa_decode);
}
