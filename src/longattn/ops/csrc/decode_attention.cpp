// One decode query per stream attending over a fixed K/V buffer plus its own new key, in one
// pass over the buffer, for x86 CPUs with AVX2 + FMA.
//
//   q      [B, H, 1, D]    float32   the step's queries (H = Hkv * G query heads)
//   k, v   [B, Hkv, S, D]  float32   the layer's buffer (slots in any order; rows contiguous,
//                                    batch/head strides free, so a growing cache's view reads
//                                    in place), or bfloat16 (widened exactly as each row is
//                                    read: the bits of the float32 kernel on the widened cache),
//          [B, Hkv, S, W]  or int8 q8 rows (W = D + 4 * ceil(D / 32): codes, then a float32
//                                    scale per 32; each row read is widened to code * scale,
//                                    so the bits are the float32 kernel's on the widened cache)
//   k_pos  [B, S]          int64     absolute position per slot, -1 = empty
//   q_pos  [B, 1]          int64     the query's position, -1 = padding (output zeros)
//   k_new, v_new [B, Hkv, 1, D]      the step's own key and value (not in the buffer yet), or
//                [B, Hkv, 0, D]      none: the buffer already holds it (the eager cache)
//   window, sinks                    slot j is read when 0 <= pos_j <= pos_q and
//                                    (window <= 0 or pos_q - pos_j < window or pos_j < sinks)
//   sink_logits  [H] or none float32 learned per-head sink logits (gpt-oss): one more term
//                                    e^sink in each head's denominator, with a zero value row
//   block_table  [B, NB] or none int64, block_size: a paged cache read in place. k and v are
//                then the pool [1, Hkv, R, D] shared by every stream, and slot s of stream b
//                is row block_table[b, s / block_size] * block_size + s % block_size of it;
//                k_pos [B, S] gives the slots' positions as before (S <= NB * block_size)
//   softcap                          > 0: every score s = q.k * scale becomes softcap * tanh(s / softcap)
//                                    (Gemma 2's soft-capping), 0: none
//   -> [B, H, 1, D] = softmax over (allowed slots + own key [+ sink]) of the scores, times V.
//
// Why it exists: the compiled step's matmul form reads each buffer through two batched
// matmuls with a separate mask/softmax kernel between them, and with G query heads per KV head
// as the matmul's M (a handful of rows) the BLAS call reads far below memory bandwidth. This
// reads every allowed K and V row once, all G heads per row, decides the
// mask from positions inline and skips masked slots entirely. Work is split into
// (stream, KV head, slot chunk) items across threads (flash-decoding's split over the
// sequence, so one KV head still uses every core); each item keeps its own running max,
// normaliser and numerator, merged exactly at the end with the own key.
//
// Chunks are aligned to absolute positions (positions [128c, 128c + 128)) wherever a row's
// slots hold increasing positions (a growing cache, a paged view, a ring that has not wrapped),
// else to slots. A query's bits then depend only on which positions it reads, not on where
// its view starts: a decode row and the same position computed as one row of a prefill chunk
// (whose view still holds blocks a window later frees) sum the same slots in the same groups.
//
// Where the CPU has AVX-512 (longattn::use_avx512_dense_attention: not on AMD Zen 4, where the
// wide loops are slower, see cpu_features.h) and D % 16 == 0, the score and numerator
// loops take a wide form with the same bits (below). The AVX2 loops re-load every key and value
// row once per query head, so on a host with few cores the loops, not memory, bound a call; the
// wide loops cut those loads.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include "avx2_util.h"
#include "cpu_features.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Slots per work item (above).
constexpr int64_t kSlotChunk = 128;

using longattn::dot;
using longattn::dot8;
using longattn::exp_shift_sum;
using longattn::max_of;
using longattn::merge_parts;
using longattn::weighted_rows;
using longattn::with_heads;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- AVX-512 forms of the two row loops, chosen at run time -------------------------------
// Same float operations in the same order per output element as dot8 + hsum8 and
// weighted_rows, so the outputs are bit-identical to the AVX2 loops (tests compare them with
// torch.equal). Scores: a 512-bit register holds eight dims of two key rows (rows 2p, 2p+1 in
// its halves) and meets each query head's eight dims broadcast to both halves, so every key
// load serves all heads of the pass; lane l of a half accumulates exactly what lane l of dot8's
// row accumulator does, and the halves are summed by the same hsum8. Numerators: each value row
// is loaded once per 32 columns for all heads of the pass; a column's FMA chain over the rows
// is the same as weighted_rows'. Heads go in passes of at most kWideHeads (register budget:
// 4 accumulators per head + 4 key pairs + the query in 32 registers).
constexpr int kWideHeads = 6;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// s[g * 8 + r] = qs[g] . rows[r] for GN heads (query rows D apart) and 8 key rows, D % 8 == 0.
template <int GN>
void scores8_wide(const float* qs, const float* const* rows, int64_t D, float* s) {
  __m512 acc[GN][4];
  for (int g = 0; g < GN; ++g)
    for (int p = 0; p < 4; ++p) acc[g][p] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m512 kp[4];
    for (int p = 0; p < 4; ++p)
      kp[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(rows[2 * p] + d)),
                                 _mm256_loadu_ps(rows[2 * p + 1] + d), 1);
    for (int g = 0; g < GN; ++g) {
      const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(qs + g * D + d));
      for (int p = 0; p < 4; ++p) acc[g][p] = _mm512_fmadd_ps(qv, kp[p], acc[g][p]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    __m256 a[8];
    for (int p = 0; p < 4; ++p) {
      a[2 * p] = _mm512_castps512_ps256(acc[g][p]);
      a[2 * p + 1] = _mm512_extractf32x8_ps(acc[g][p], 1);
    }
    _mm256_storeu_ps(s + g * 8, longattn::hsum8(a));
  }
}

// o[g][0:D] += sum_j p[g * stride + j] * rows[j][0:D] for GN heads (outputs ostride apart),
// n rows, D % 16 == 0: weighted_rows' per-column chains, 32 columns at a time.
template <int GN>
void weighted_rows_wide(const float* p, int64_t stride, const float* const* rows, int64_t n, int64_t D,
                        float* o, int64_t ostride) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m512 acc[GN][2];
    for (int g = 0; g < GN; ++g) {
      acc[g][0] = _mm512_loadu_ps(o + g * ostride + d);
      acc[g][1] = _mm512_loadu_ps(o + g * ostride + d + 16);
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m512 r0 = _mm512_loadu_ps(rows[j] + d), r1 = _mm512_loadu_ps(rows[j] + d + 16);
      for (int g = 0; g < GN; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * stride + j]);
        acc[g][0] = _mm512_fmadd_ps(w, r0, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(w, r1, acc[g][1]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      _mm512_storeu_ps(o + g * ostride + d, acc[g][0]);
      _mm512_storeu_ps(o + g * ostride + d + 16, acc[g][1]);
    }
  }
  for (; d < D; d += 16) {
    __m512 acc[GN];
    for (int g = 0; g < GN; ++g) acc[g] = _mm512_loadu_ps(o + g * ostride + d);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 r = _mm512_loadu_ps(rows[j] + d);
      for (int g = 0; g < GN; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * stride + j]), r, acc[g]);
    }
    for (int g = 0; g < GN; ++g) _mm512_storeu_ps(o + g * ostride + d, acc[g]);
  }
}

#pragma GCC pop_options

// Passes of at most kWideHeads heads, as even as possible (7 -> 3 + 4, not 6 + 1): pass i
// covers heads [first(i), first(i + 1)).
struct HeadPasses {
  int64_t G, n;
  explicit HeadPasses(int64_t g) : G(g), n((g + kWideHeads - 1) / kWideHeads) {}
  int64_t first(int64_t i) const { return i * G / n; }
};

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& k_pos, const at::Tensor& q_pos, const at::Tensor& k_new,
                            const at::Tensor& v_new, int64_t window, int64_t sinks, double scale,
                            const std::optional<at::Tensor>& sink_logits,
                            const std::optional<at::Tensor>& block_table, int64_t block_size, int64_t isa,
                            double softcap, const std::optional<at::Tensor>& window_sinks) {
  // window and sinks as data: a compiled step reads them from its inputs, so one build serves
  // every window and sinks (int64 [2], overriding the two integer arguments)
  if (window_sinks.has_value()) {
    const at::Tensor ws = window_sinks->contiguous();
    TORCH_CHECK(ws.scalar_type() == at::kLong && ws.numel() == 2, "decode_attention: window_sinks is int64 [2]");
    window = ws.data_ptr<int64_t>()[0];
    sinks = ws.data_ptr<int64_t>()[1];
  }
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k_new.dim() == 4 && v_new.dim() == 4,
              "decode_attention: q [B, H, 1, D], k/v [B, Hkv, S, D], k_new/v_new [B, Hkv, 1, D]");
  for (const auto* t : {&q, &k_new, &v_new})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "decode_attention: float32 queries and new keys only");
  TORCH_CHECK((k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kChar) &&
              v.scalar_type() == k.scalar_type(),
              "decode_attention: the cache is float32, bfloat16 or int8 q8 rows (k and v alike)");
  const bool bf16 = k.scalar_type() == at::kBFloat16, q8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(k_pos.scalar_type() == at::kLong && q_pos.scalar_type() == at::kLong,
              "decode_attention: positions are int64");
  const bool paged = block_table.has_value();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1);
  const int64_t W = q8 ? longattn::q8_width(D) : D;  // elements of a stored row
  const int64_t S = paged ? k_pos.size(1) : k.size(2);
  TORCH_CHECK(q.size(2) == 1, "decode_attention: one query per stream");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "decode_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == (paged ? 1 : B) && k.size(3) == W,
              "decode_attention: k/v shapes ([1, Hkv, R, D] pools with a block table; rows of D + 4 * ceil(D / 32) "
              "for int8)");
  at::Tensor table;
  if (paged) {
    table = block_table->contiguous();
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(0) == B && block_size > 0 &&
                table.size(1) * block_size >= S, "decode_attention: block_table int64 [B, NB] covering S slots");
    const int64_t* t = table.data_ptr<int64_t>();
    const int64_t blocks = k.size(2) / block_size;
    for (int64_t i = 0; i < table.numel(); ++i)
      TORCH_CHECK(0 <= t[i] && t[i] < blocks, "decode_attention: block_table entry outside the pool");
  }
  const int64_t* btp = paged ? table.data_ptr<int64_t>() : nullptr;
  const int64_t nbt = paged ? table.size(1) : 0;
  // the row of slot s of stream b within its (stream, head) base: the slot itself, or paged
  const auto row_of = [btp, nbt, block_size](int64_t b, int64_t s) {
    return btp == nullptr ? s : btp[b * nbt + s / block_size] * block_size + s % block_size;
  };
  TORCH_CHECK(k_new.sizes() == v_new.sizes() && k_new.size(0) == B && k_new.size(1) == Hkv &&
              k_new.size(2) <= 1 && k_new.size(3) == D, "decode_attention: k_new/v_new shapes");
  const bool has_new = k_new.size(2) == 1;
  TORCH_CHECK(k_pos.dim() == 2 && k_pos.size(0) == B && k_pos.size(1) == S, "decode_attention: k_pos [B, S]");
  TORCH_CHECK(q_pos.numel() == B, "decode_attention: q_pos [B, 1]");
  const bool has_sink = sink_logits.has_value();
  at::Tensor sink_c;
  if (has_sink) {
    TORCH_CHECK(sink_logits->scalar_type() == at::kFloat && sink_logits->numel() == H,
                "decode_attention: sink_logits is float32 [H]");
    sink_c = sink_logits->contiguous();
  }
  const int64_t G = H / Hkv;
  // rows must be contiguous; whole-tensor contiguity is not needed (no copy of a cache view)
  const auto rows_ok = [W](const at::Tensor& t) { return t.stride(3) == 1 && t.stride(2) == W; };
  const auto qc = q.contiguous();
  const auto kc = rows_ok(k) ? k : k.contiguous(), vc = rows_ok(v) ? v : v.contiguous();
  const int64_t ksb = kc.stride(0), ksh = kc.stride(1), vsb = vc.stride(0), vsh = vc.stride(1);
  const auto knc = k_new.contiguous(), vnc = v_new.contiguous();
  const auto kpc = k_pos.contiguous(), qpc = q_pos.contiguous();
  const float* qp = qc.data_ptr<float>();
  const void* kp = kc.data_ptr();
  const void* vp = vc.data_ptr();
  const int64_t* kposp = kpc.data_ptr<int64_t>();
  const int64_t* qposp = qpc.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  TORCH_CHECK(softcap >= 0.0, "decode_attention: softcap must be >= 0 (0: none)");
  const float cap = static_cast<float>(softcap);
  // soft-capping, per score: the same scalar tanh wherever the score sits, so capped rows keep
  // the kernel's independence of batch and chunking
  const auto capped = [cap](float s) { return cap > 0.0f ? cap * std::tanh(s / cap) : s; };

  // Split the slots into chunks of at most 128 slots, so threads share even one stream's one KV
  // head, and a query's result depends on nothing but the positions it reads: not on the
  // batch, the thread count, how far a batch pads its block tables (slots past a stream's own
  // are empty chunks, which the merge skips) or where its view starts. Parts merge in order.
  const int64_t heads = B * Hkv;
  // bounds[b * (chunks + 1) + c]: the first slot of row b's chunk c. Where the row's positions
  // increase, a chunk is the slots of one position range [128k, 128k + 128) that holds any
  // (ranges with none are left out: a window far past its sinks spans no empty chunks), else
  // every kSlotChunk slots. Slots holding no position (-1) join the chunk they sit in.
  std::vector<std::vector<int64_t>> starts(B);
  int64_t chunks = 1;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t>& st = starts[b];
    int64_t prev = -1, cur = -1;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t pk = kposp[b * S + s];
      if (pk < 0) continue;
      if (pk <= prev) {  // not increasing (a wrapped ring): slot-aligned chunks
        st.clear();
        break;
      }
      prev = pk;
      if (pk / kSlotChunk != cur) {
        cur = pk / kSlotChunk;
        st.push_back(st.empty() ? 0 : s);
      }
    }
    if (st.empty())
      for (int64_t s = 0; s < S; s += kSlotChunk) st.push_back(s);
    chunks = std::max<int64_t>(chunks, static_cast<int64_t>(st.size()));
  }
  std::vector<int64_t> bounds(B * (chunks + 1), S);
  for (int64_t b = 0; b < B; ++b) std::copy(starts[b].begin(), starts[b].end(), bounds.begin() + b * (chunks + 1));
  // partial[(b * Hkv + h) * chunks + c][g] = (max, normaliser, numerator[D])
  std::vector<float> part(heads * chunks * G * (D + 2));
  // the AVX-512 loops (same bits) where the CPU has them and rows are whole 512-bit vectors
  // (float32 rows only, q8 rows widened included: a bfloat16 cache reads through the AVX2 loops,
  // widening each row)
  const bool wide = !bf16 && longattn::use_avx512_dense_attention(isa) && D % 16 == 0;

  // Rows with the same paged view (a prefill chunk's queries, run as rows of one stream) go in
  // groups of up to kGroupRows per work item: rows that read the same slots of a chunk take their
  // scores and numerators in one pass over those K and V rows, as extra query heads. Each
  // (row, head) still runs the loops it runs alone, so grouping changes no bit.
  constexpr int64_t kGroupRows = 32;
  std::vector<int64_t> groups{0};  // first row of each group, then B
  for (int64_t b = 1; b < B; ++b) {
    const bool same = paged && b - groups.back() < kGroupRows &&
                      std::equal(kposp + (b - 1) * S, kposp + b * S, kposp + b * S) &&
                      std::equal(btp + (b - 1) * nbt, btp + b * nbt, btp + b * nbt);
    if (!same) groups.push_back(b);
  }
  groups.push_back(B);
  const int64_t ngroups = static_cast<int64_t>(groups.size()) - 1;

  // the item loop over stored rows of T (float, uint16_t holding bfloat16, or int8_t q8 rows,
  // which are widened into a per-item float32 tile first and read as float32 rows R)
  const auto items = [&](auto type_tag) {
    using T = decltype(type_tag);
    constexpr bool kQ8 = std::is_same_v<T, int8_t>;
    using R = std::conditional_t<kQ8, float, T>;
    at::parallel_for(0, ngroups * Hkv * chunks, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> qs, scores, loc, kwide, vwide;
      std::vector<const R*> krow, vrow;
      std::vector<std::vector<int64_t>> idx(kGroupRows);
      std::vector<int64_t> subset;
      std::vector<char> done;
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t gi = item / (Hkv * chunks), h = item / chunks % Hkv, c = item % chunks;
        const int64_t b0 = groups[gi], nrows = groups[gi + 1] - b0;
        const int64_t s0 = bounds[b0 * (chunks + 1) + c], s1 = bounds[b0 * (chunks + 1) + c + 1];
        const auto out_of = [&](int64_t b) { return part.data() + ((b * Hkv + h) * chunks + c) * G * (D + 2); };
        for (int64_t r = 0; r < nrows; ++r) {
          const int64_t pq = qposp[b0 + r];
          idx[r].clear();
          for (int64_t s = s0; s < s1; ++s) {
            const int64_t pk = kposp[b0 * S + s];
            if (pk >= 0 && pk <= pq && (window <= 0 || pq - pk < window || pk < sinks)) idx[r].push_back(s);
          }
          float* out = out_of(b0 + r);
          for (int64_t g = 0; g < G; ++g) {
            float* o = out + g * (D + 2);
            o[0] = kNegInf;
            o[1] = 0.0f;
            std::fill(o + 2, o + 2 + D, 0.0f);
          }
        }
        done.assign(nrows, 0);
        for (int64_t r = 0; r < nrows; ++r) {
          if (done[r] || idx[r].empty()) continue;
          subset.clear();  // the rows reading exactly row r's slots
          for (int64_t r2 = r; r2 < nrows; ++r2)
            if (!done[r2] && idx[r2] == idx[r]) {
              subset.push_back(r2);
              done[r2] = 1;
            }
          const std::vector<int64_t>& ix = idx[r];
          const int64_t n = static_cast<int64_t>(ix.size()), VG = static_cast<int64_t>(subset.size()) * G;
          qs.resize(VG * D);
          for (size_t si = 0; si < subset.size(); ++si) {
            const float* qh = qp + ((b0 + subset[si]) * H + h * G) * D;
            for (int64_t j = 0; j < G * D; ++j) qs[si * G * D + j] = qh[j] * sc;
          }
          scores.resize(VG * n);
          krow.resize(n);
          vrow.resize(n);
          const T* kh = static_cast<const T*>(kp) + (paged ? 0 : b0 * ksb) + h * ksh;  // a pool: one base
          const T* vh = static_cast<const T*>(vp) + (paged ? 0 : b0 * vsb) + h * vsh;
          if constexpr (kQ8) {
            kwide.resize(n * D);
            vwide.resize(n * D);
          }
          for (int64_t j = 0; j < n; ++j) {
            const int64_t rr = row_of(b0, ix[j]);
            if constexpr (kQ8) {
              longattn::q8_widen(kh + rr * W, D, kwide.data() + j * D);
              longattn::q8_widen(vh + rr * W, D, vwide.data() + j * D);
              krow[j] = kwide.data() + j * D;
              vrow[j] = vwide.data() + j * D;
            } else {
              krow[j] = kh + rr * W;
              vrow[j] = vh + rr * W;
            }
          }
          const HeadPasses passes(VG);
          // scores: eight rows at a time, every query head per block (the rows stay in L1)
          int64_t j = 0;
          float s8[8 * kWideHeads];
          bool wide_rows = false;  // the AVX-512 loops read float32 rows only
          if constexpr (std::is_same_v<R, float>) wide_rows = wide;
          if (wide_rows) {
            if constexpr (std::is_same_v<R, float>)
            for (; j + 8 <= n; j += 8)
              for (int64_t i = 0; i < passes.n; ++i) {
                const int64_t g0 = passes.first(i), gn = passes.first(i + 1) - g0;
                with_heads<kWideHeads>(gn, [&](auto hh) {
                  scores8_wide<decltype(hh)::value>(qs.data() + g0 * D, krow.data() + j, D, s8);
                });
                for (int64_t g = 0; g < gn; ++g)
                  for (int k8 = 0; k8 < 8; ++k8) scores[(g0 + g) * n + j + k8] = s8[g * 8 + k8];
              }
          } else {
            for (; j + 8 <= n; j += 8)
              for (int64_t g = 0; g < VG; ++g) {
                dot8(qs.data() + g * D, krow.data() + j, D, s8);
                for (int k8 = 0; k8 < 8; ++k8) scores[g * n + j + k8] = s8[k8];
              }
          }
          for (; j < n; ++j)
            for (int64_t g = 0; g < VG; ++g) scores[g * n + j] = dot(qs.data() + g * D, krow[j], D);
          if (cap > 0.0f)
            for (float& sv : scores) sv = capped(sv);
          loc.assign(VG * (D + 2), 0.0f);
          for (int64_t g = 0; g < VG; ++g) {
            float* sg = scores.data() + g * n;
            const float m = max_of(sg, n);
            loc[g * (D + 2)] = m;
            loc[g * (D + 2) + 1] = exp_shift_sum(sg, n, m);
          }
          // numerators: tiles of 32 rows (<= 32 KiB at D = 256) reused by every head from cache
          for (int64_t r0 = 0; r0 < n; r0 += 32) {
            const int64_t nr = std::min<int64_t>(32, n - r0);
            if (wide_rows) {
              if constexpr (std::is_same_v<R, float>)
              for (int64_t i = 0; i < passes.n; ++i) {
                const int64_t g0 = passes.first(i), gn = passes.first(i + 1) - g0;
                with_heads<kWideHeads>(gn, [&](auto hh) {
                  weighted_rows_wide<decltype(hh)::value>(scores.data() + g0 * n + r0, n, vrow.data() + r0, nr, D,
                                                          loc.data() + g0 * (D + 2) + 2, D + 2);
                });
              }
            } else {
              for (int64_t g = 0; g < VG; ++g)
                weighted_rows(scores.data() + g * n + r0, vrow.data() + r0, nr, D, loc.data() + g * (D + 2) + 2);
            }
          }
          for (size_t si = 0; si < subset.size(); ++si)
            std::copy(loc.begin() + si * G * (D + 2), loc.begin() + (si + 1) * G * (D + 2), out_of(b0 + subset[si]));
        }
      }
    });
  };
  if (bf16)
    items(uint16_t{});
  else if (q8)
    items(int8_t{});
  else
    items(0.0f);

  auto y = at::empty({B, H, 1, D}, qc.options());
  float* yp = y.data_ptr<float>();
  const float* knp = knc.data_ptr<float>();
  const float* vnp = vnc.data_ptr<float>();
  // per query head: the slot chunks' parts plus the own key as a part of one row (m = its
  // score, l = 1, acc = its value) and a learned sink as a part of a zero row (m = its logit,
  // l = 1, acc = 0), merged exactly (longattn::merge_parts)
  std::vector<float> own(D + 2), sink_part(D + 2, 0.0f);
  sink_part[1] = 1.0f;
  std::vector<const float*> parts(chunks + (has_sink ? 2 : 1));
  const float* sinkp = has_sink ? sink_c.data_ptr<float>() : nullptr;
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / Hkv, h = bh % Hkv;
    const float* kn = knp + bh * D;
    const float* vn = vnp + bh * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qp + (b * H + h * G + g) * D;
      own[0] = has_new && qposp[b] >= 0 ? capped(dot(qg, kn, D) * sc) : kNegInf;
      own[1] = 1.0f;
      if (own[0] != kNegInf) std::copy(vn, vn + D, own.begin() + 2);
      for (int64_t c = 0; c < chunks; ++c) parts[c] = part.data() + ((bh * chunks + c) * G + g) * (D + 2);
      parts[chunks] = own.data();
      if (has_sink) {
        sink_part[0] = sinkp[h * G + g];
        parts[chunks + 1] = sink_part.data();
      }
      merge_parts(parts, D, yp + (b * H + h * G + g) * D);  // nothing to read: zeros, as the reference
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor k_pos, Tensor q_pos, Tensor k_new, "
        "Tensor v_new, int window, int sinks, float scale, Tensor? sink_logits=None, Tensor? block_table=None, "
        "int block_size=0, int isa=-1, float softcap=0.0, Tensor? window_sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(longattn_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
