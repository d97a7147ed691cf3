// Weight-only int4, int5 and int8 matrix products on x86 CPUs with AVX2 + FMA + F16C: one kernel
// for a decode step's few rows and a prefill's hundreds, with one arithmetic.
//
// Formats (models/weights.py): int4 and int5 cut every weight row into groups of 32 values; a
// group stores a float16 step d and a float16 offset m, and each value as a code u standing for
// d * u + m: 4 bits (u in 0..15) for int4, 5 bits (0..31) for int5. Byte j of a group's 16 code
// bytes holds the low 4 bits of value j in its low nibble and those of value j + 16 in its high
// nibble. int5 adds 4 bytes per group (``hbits``): bit j of that little-endian 32-bit word is
// bit 4 of value j, the layout of GGML's Q5_0 and Q5_1, whose blocks are these values exactly.
// int8 stores each row as K int8 values q with one float32 scale s (symmetric, s * q).
//
// Activations are quantized per block of 32 columns to int8 with one float32 step
// dx = max|x| / 127 (xq = round-half-even(x / dx)), once per call; a row whose length is not a
// multiple of 32 (int8 only) ends in a shorter block with its own step. Then
//
//   int4, int5:  y[r, n] = sum_g (d[n,g] * dx[r,g]) * (u[n,g] . xq[r,g])  +  sum_g m[n,g] * xs[r,g]
//   int8:        y[r, n] = s[n] * sum_g dx[r,g] * (q[n,g] . xq[r,g])
//
// with xs = dx * sum(xq) per block. Each group's dot is an exact integer (vpmaddubsw: unsigned
// bytes times signed bytes into int16 pairs, at most 2*127*127; vpmaddwd into int32); the float
// sums run in one order per output element that depends only on K (tile below). That is what
// makes a token's result the same whether it is a prefill row, a decode row, or one of many
// streams in a batch (docs/design.md, invariant 3): the number of rows decides how many
// activation rows share each unpacked weight group, never the order of a sum. The product is
// x_eff . W_eff with x_eff = xq * dx, which ops/linear.py evaluates in PyTorch as the reference.
// Why integer dots: one vpmaddubsw does 32 multiply-adds where a float32 fma does 8, and the
// weights are read as stored (no widened copy), so prefill is faster than a float32 GEMM on
// widened weights and decode reads 0.625 (int4), 0.75 (int5) or ~1 (int8) bytes a weight.
// Where the CPU has AVX-512 VNNI, int4 and int5 run row_dot_512 (below) per output element:
// the same integer dots four groups at a time, summed in its own fixed order.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2_util.h"
#include "cpu_features.h"

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kPrefetch = 2048;  // bytes ahead in the code stream

using longattn::hsum;

// 32 activations -> int8 with one step (max|x| / 127): q = round-half-even(x / step), as
// PyTorch's torch.round(x / step) (division, not a multiply by 1 / step, for the same bits).
// Writes q[32], *step and *sum = step * sum(q).
inline void quantize_block(const float* x, int8_t* q, float* step, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float s = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4))) / 127.0f;
  *step = s;
  if (!(s > 0.f)) {  // an all-zero block
    std::memset(q, 0, kGroup);
    *sum = 0.f;
    return;
  }
  const __m256 vs = _mm256_set1_ps(s);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i)  // |x / step| <= 127: no clamp needed, cvtps rounds half-even
    qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(v[i], vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  *sum = s * static_cast<float>(_mm_cvtsi128_si32(t4));
  // int32 -> int8: the packs interleave 128-bit lanes; one permute restores x's order
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// int5's fifth bits of group j (4 bytes at hb + 4 j) as 32 bytes, 0x10 where bit k of the word
// is set, value k's byte in u's order: bits 0..15 in the low lane, 16..31 in the high lane.
inline __m256i fifth_bits(const uint8_t* hb, int64_t j) {
  uint32_t qh;
  std::memcpy(&qh, hb + 4 * j, 4);
  const __m256i spread = _mm256_shuffle_epi8(  // byte k <- byte k / 8 of the word
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// A block shorter than 32 (the end of an int8 row whose length is not a multiple of 32): the
// same rounding as quantize_block, one value at a time.
inline void quantize_tail(const float* x, int64_t n, int8_t* q, float* step, float* sum) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax / 127.0f;
  *step = s;
  if (!(s > 0.f)) {
    std::memset(q, 0, n);
    *sum = 0.f;
    return;
  }
  int32_t t = 0;
  for (int64_t i = 0; i < n; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] / s));  // round-half-even, as cvtps
    t += q[i];
  }
  *sum = s * static_cast<float>(t);
}

// Activations [M, K] quantized per block (module comment): xq [M, K], and per row Gt = ceil(K /
// 32) block steps dx and dx * sum(xq) in xs.
struct QuantizedRows {
  int64_t M, K, G, T, Gt;  // rows, row length, whole blocks, values in the short block, all blocks
  std::vector<int8_t> xq;
  std::vector<float> dx, xs;

  QuantizedRows(const float* x, int64_t M_, int64_t K_)
      : M(M_), K(K_), G(K_ / kGroup), T(K_ % kGroup), Gt(G + (T > 0)), xq(M_ * K_), dx(M_ * Gt), xs(M_ * Gt) {
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t g = 0; g < G; ++g)
        quantize_block(x + r * K + g * kGroup, xq.data() + r * K + g * kGroup, dx.data() + r * Gt + g,
                       xs.data() + r * Gt + g);
      if (T > 0)
        quantize_tail(x + r * K + G * kGroup, T, xq.data() + r * K + G * kGroup, dx.data() + r * Gt + G,
                      xs.data() + r * Gt + G);
    }
  }
  const int8_t* q(int64_t r) const { return xq.data() + r * K; }
  const float* step(int64_t r) const { return dx.data() + r * Gt; }
  const float* sum(int64_t r) const { return xs.data() + r * Gt; }
};

// Group j's 32 codes as bytes in x's order (values 0..15 of the group in the low lane, 16..31 in
// the high lane): the group's 16 bytes go in both lanes (a load, no shuffle), the high lane
// shifted right by 4 bits per 64-bit word, then masked. kFive adds int5's fifth bits.
template <bool kFive>
inline __m256i group_codes(const uint8_t* codes, const uint8_t* hb, int64_t j) {
  const __m256i b =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * (kGroup / 2))));
  __m256i u = _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
  if constexpr (kFive) u = _mm256_or_si256(u, fifth_bits(hb, j));
  return u;
}

inline __m256i load_bytes(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 32 unsigned bytes u times 32 signed bytes x: eight int32 partial dots, as float32 (exact).
inline __m256 dot_bytes(__m256i u, __m256i x) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}

// The AVX2 form of group_dots' integer dot, for row_dot_512's last groups.
template <bool kFive>
inline __m256 group_dots(const uint8_t* codes, const uint8_t* hb, const int8_t* xq, int64_t j) {
  return dot_bytes(group_codes<kFive>(codes, hb, j), load_bytes(xq + j * kGroup));
}

// sum_g m[g] * xs[g] over G groups in one fixed order: eight lanes by eight groups, their sum,
// then the last G % 8 groups one by one. The offsets' share of an int4 or int5 output.
inline float group_offsets(const uint16_t* m, const float* xs, int64_t G) {
  __m256 am = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    am = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g))),
                         _mm256_loadu_ps(xs + g), am);
  float off = longattn::hsum(am);
  for (; g < G; ++g) off = std::fma(_cvtsh_ss(m[g]), xs[g], off);
  return off;
}

// Weight rows n0 .. n0 + NR - 1 of an int4 or int5 matrix against activation rows r0 .. r0 + R
// - 1, into y[r * ldy + n]. Per output element the order is fixed and the same for every tile
// shape: group g's integer dot (eight int32 lanes, exact), as float32, times the step product
// d[g] * dx[g], goes into one eight-lane accumulator in group order; its lanes are summed
// (hsum) and the offsets (group_offsets) added. The tile shape only decides which outputs share
// each unpacked weight group and each loaded activation group, and how many independent
// accumulator chains hide the fma latency (NR * R of them).
template <bool kFive, int NR, int R>
inline void group_tile(const QuantizedRows& a, int64_t r0, const uint8_t* const* codes, const uint8_t* const* hb,
                       const uint16_t* const* d, const uint16_t* const* m, float* y, int64_t ldy) {
  const int64_t G = a.G;
  const int8_t* xq[R];
  const float* dx[R];
  __m256 acc[NR][R];
  alignas(32) float sc[NR][R][8];  // d[g] * dx[g] for eight groups
  for (int r = 0; r < R; ++r) xq[r] = a.q(r0 + r), dx[r] = a.step(r0 + r);
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  auto add_group = [&](int64_t j, const float* scale, int64_t stride_i, int64_t stride_r) {
    for (int i = 0; i < NR; ++i) {
      const __m256i u = group_codes<kFive>(codes[i], hb[i], j);
      for (int r = 0; r < R; ++r)
        acc[i][r] = _mm256_fmadd_ps(dot_bytes(u, load_bytes(xq[r] + j * kGroup)),
                                    _mm256_broadcast_ss(scale + i * stride_i + r * stride_r), acc[i][r]);
    }
  };
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    for (int i = 0; i < NR; ++i) {  // eight groups are 128 bytes of codes: two cache lines
      _mm_prefetch(reinterpret_cast<const char*>(codes[i] + g * (kGroup / 2) + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(codes[i] + g * (kGroup / 2) + kPrefetch + 64), _MM_HINT_T0);
      if constexpr (kFive) _mm_prefetch(reinterpret_cast<const char*>(hb[i] + g * 4 + kPrefetch / 4), _MM_HINT_T0);
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d[i] + g)));
      for (int r = 0; r < R; ++r) _mm256_store_ps(sc[i][r], _mm256_mul_ps(dv, _mm256_loadu_ps(dx[r] + g)));
    }
    for (int k = 0; k < 8; ++k) add_group(g + k, &sc[0][0][k], R * 8, 8);
  }
  for (; g < G; ++g) {  // the last G % 8 groups: the same products, one group at a time
    float sg[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) sg[i][r] = _cvtsh_ss(d[i][g]) * dx[r][g];
    add_group(g, &sg[0][0], R, 1);
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r)
      y[(r0 + r) * ldy + i] = longattn::hsum(acc[i][r]) + group_offsets(m[i], a.sum(r0 + r), G);
}

// Weight rows n0 .. n0 + NR - 1 (K int8 values each, scales s) against activation rows r0 ..
// r0 + R - 1, into y[r * ldy + i]. Per output element, for every tile shape: group g's dot
// times dx[g] goes into one eight-lane accumulator in group order, the lanes are summed, a
// short last block's dot is added with one fma, and the sum is scaled by s.
// vpmaddubsw multiplies unsigned by signed bytes, so |q| meets xq with q's sign moved onto it.
template <int NR, int R>
inline void int8_tile(const QuantizedRows& a, int64_t r0, const int8_t* const* w, const float* s, float* y,
                      int64_t ldy) {
  const int64_t G = a.G;
  const int8_t* xq[R];
  const float* dx[R];
  __m256 acc[NR][R];
  for (int r = 0; r < R; ++r) xq[r] = a.q(r0 + r), dx[r] = a.step(r0 + r);
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if ((g & 1) == 0)
      for (int i = 0; i < NR; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w[i] + g * kGroup + 2 * kPrefetch), _MM_HINT_T0);
    for (int i = 0; i < NR; ++i) {
      const __m256i wv = load_bytes(w[i] + g * kGroup);
      const __m256i aw = _mm256_abs_epi8(wv);
      for (int r = 0; r < R; ++r)
        acc[i][r] = _mm256_fmadd_ps(dot_bytes(aw, _mm256_sign_epi8(load_bytes(xq[r] + g * kGroup), wv)),
                                    _mm256_broadcast_ss(dx[r] + g), acc[i][r]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) {
      float v = longattn::hsum(acc[i][r]);
      if (a.T > 0) {
        int32_t t = 0;
        for (int64_t k = G * kGroup; k < a.K; ++k) t += static_cast<int32_t>(w[i][k]) * xq[r][k];
        v = std::fma(static_cast<float>(t), dx[r][G], v);
      }
      y[(r0 + r) * ldy + i] = v * s[i];
    }
}

// Activation rows per cache block: about this many bytes of quantized rows stay in cache while
// a thread's weight rows stream past them.
constexpr int64_t kRowBlockBytes = 192 * 1024;

// Weight rows per thread task: about 32 KiB of weights (row_bytes each).
inline int64_t weight_grain(int64_t row_bytes) {
  return std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(row_bytes, 1));
}

// Weight rows per tile for a tile of R activation rows: NR * R accumulator chains, enough to
// hide the fma latency, few enough to stay in AVX2's sixteen registers.
template <int R>
constexpr int tile_cols() { return R > 4 ? 1 : R >= 3 ? 2 : 4; }

// Calls tile(NR, R, r0, n0) (both std::integral_constant) over every tile of weight rows and
// activation rows: tiles of kRows activation rows (4 or 8) while they last, then one of each
// smaller size the remainder needs; weight rows in panels of 32 (whose codes stay in L1 while
// the block's row tiles pass) and split across threads (weight_grain). Which tile an output
// falls in never changes its value (group_tile, int8_tile). More rows per tile share each
// unpacked weight group among more rows, which pays where unpacking costs (int5's fifth bits);
// fewer rows and more weight rows share each activation load, which pays for int4 and int8
// (measured in benchmarks/prefill_gemm.py).
template <int kRows, class Tile>
void for_tiles(int64_t M, int64_t N, int64_t K, int64_t row_bytes, const Tile& tile) {
  static_assert(kRows == 4 || kRows == 8, "tiles of 4 or 8 activation rows");
  const int64_t grain = weight_grain(row_bytes);
  const int64_t block = std::max<int64_t>(kRows, kRowBlockBytes / std::max<int64_t>(K, 1) / kRows * kRows);
  auto rows = [&](auto R, int64_t r, int64_t n0, int64_t n1) {
    constexpr int NR = tile_cols<decltype(R)::value>();
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) tile(std::integral_constant<int, NR>{}, R, r, n);
    for (; n < n1; ++n) tile(std::integral_constant<int, 1>{}, R, r, n);
  };
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t m1 = std::min(M, m0 + block);
      for (int64_t p0 = n0; p0 < n1; p0 += 32) {
        const int64_t p1 = std::min(n1, p0 + 32);
        int64_t r = m0;
        for (; r + kRows <= m1; r += kRows) rows(std::integral_constant<int, kRows>{}, r, p0, p1);
        if constexpr (kRows > 4) {
          if (r + 4 <= m1) rows(std::integral_constant<int, 4>{}, r, p0, p1), r += 4;
        }
        switch (m1 - r) {
          case 3: rows(std::integral_constant<int, 3>{}, r, p0, p1); break;
          case 2: rows(std::integral_constant<int, 2>{}, r, p0, p1); break;
          case 1: rows(std::integral_constant<int, 1>{}, r, p0, p1); break;
          default: break;
        }
      }
    }
  });
}

// group_tile's AVX-512 VNNI form (one activation row): four groups per 512-bit vector, one 128-bit lane per group.
// The group's low nibbles (values 0..15) and high nibbles (16..31) are masked in place and each
// meets its half of the activations in one vpdpbusd (unsigned codes times signed int8 into
// int32 lanes of four exact products), so a group needs neither the shift-and-broadcast nor the
// vpmaddubsw + vpmaddwd pair of the AVX2 form: about a third of its instructions per weight,
// which matters because instructions, not memory, bound the AVX2 form on short rows. int5's
// fifth bits of four groups are two 64-bit masks (one byte shuffle of their four words), each
// added to its half in one masked byte add.
// xs2: the activation row rearranged by group_gemm, per four groups 64 bytes of their low
// halves then 64 of their high halves. The integer dot of each group is the same as group_tile's,
// but it lands in four float lanes instead of eight, so sums differ from the AVX2 form's in the
// last bits (both are within the bound tests/core/test_weights.py derives).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
template <bool kFive>
float row_dot_512(const int8_t* xs2, const int8_t* xq, const uint8_t* codes, const uint8_t* hb, const uint16_t* d,
                  const uint16_t* m, const float* dx, const float* xs, int64_t G) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  // the four words' low 16 bits (values 0..15 of each group), then their high 16 bits
  const __m128i halves = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  // lanes 4i..4i+3 take scale i (first four groups of eight) or 4 + i (last four)
  const __m512i pick_lo = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i pick_hi = _mm512_add_epi32(pick_lo, _mm512_set1_epi32(4));
  __m512 acc = _mm512_setzero_ps();
  __m256 am = _mm256_setzero_ps();
  auto four = [&](int64_t j, __m512 sc) {  // groups j .. j + 3, sc: their scales in 128-bit lanes
    const __m512i c = _mm512_loadu_si512(codes + j * (kGroup / 2));
    __m512i lo = _mm512_and_si512(c, low4), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
    if constexpr (kFive) {
      const __m128i w = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hb + 4 * j)), halves);
      lo = _mm512_mask_add_epi8(lo, static_cast<__mmask64>(_mm_cvtsi128_si64(w)), lo, bit4);
      hi = _mm512_mask_add_epi8(hi, static_cast<__mmask64>(_mm_extract_epi64(w, 1)), hi, bit4);
    }
    __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xs2 + j * kGroup));
    dots = _mm512_dpbusd_epi32(dots, hi, _mm512_loadu_si512(xs2 + j * kGroup + 64));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), sc, acc);
  };
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + g * (kGroup / 2) + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(codes + g * (kGroup / 2) + kPrefetch + 64), _MM_HINT_T0);
    if constexpr (kFive) _mm_prefetch(reinterpret_cast<const char*>(hb + g * 4 + kPrefetch / 4), _MM_HINT_T0);
    const __m512 sc = _mm512_castps256_ps512(_mm256_mul_ps(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g))), _mm256_loadu_ps(dx + g)));
    am = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g))),
                         _mm256_loadu_ps(xs + g), am);
    four(g, _mm512_permutexvar_ps(pick_lo, sc));
    four(g + 4, _mm512_permutexvar_ps(pick_hi, sc));
  }
  float off = 0.f;
  if (g + 4 <= G) {
    alignas(16) float s4[4];
    for (int i = 0; i < 4; ++i) {
      s4[i] = _cvtsh_ss(d[g + i]) * dx[g + i];
      off += _cvtsh_ss(m[g + i]) * xs[g + i];
    }
    four(g, _mm512_permutexvar_ps(pick_lo, _mm512_castps128_ps512(_mm_load_ps(s4))));
    g += 4;
  }
  __m256 acc0 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  for (; g < G; ++g) {  // the last G % 4 groups as group_tile does them (xq: natural order)
    acc0 = _mm256_fmadd_ps(group_dots<kFive>(codes, hb, xq, g), _mm256_set1_ps(_cvtsh_ss(d[g]) * dx[g]), acc0);
    off += _cvtsh_ss(m[g]) * xs[g];
  }
  return hsum(_mm256_add_ps(acc0, am)) + off;
}
#pragma GCC pop_options

// xs2 for row_dot_512: per four whole groups of xq [K], their four low halves (16 values each)
// then their four high halves; the last G % 4 groups are read from xq itself.
void split_halves(const int8_t* xq, int64_t G, int8_t* xs2) {
  for (int64_t j = 0; j + 4 <= G; j += 4)
    for (int64_t i = 0; i < 4; ++i) {
      std::memcpy(xs2 + j * kGroup + 16 * i, xq + (j + i) * kGroup, 16);
      std::memcpy(xs2 + j * kGroup + 64 + 16 * i, xq + (j + i) * kGroup + 16, 16);
    }
}

// The packed weight of the ops, checked once: codes [N, K/2] uint8, hbits [N, K/8] uint8 (int5
// only; an undefined tensor for int4), d and m [N, K/32] float16 (K: the activations' length
// for the GEMMs, twice the codes' width for the dequantizers).
struct PackedGroups {
  at::Tensor cc, hc, dc, mc;  // contiguous copies (or the tensors themselves), kept alive
  int64_t N, K, G;
  const uint8_t* codes;
  const uint8_t* hb = nullptr;
  const uint16_t* d;
  const uint16_t* m;

  PackedGroups(const char* op, const at::Tensor& codes_, const at::Tensor* hbits_, const at::Tensor& d_,
               const at::Tensor& m_, int64_t K_) {
    TORCH_CHECK(codes_.dim() == 2 && d_.dim() == 2 && m_.dim() == 2, op, ": codes [N, K/2], d, m [N, K/32]");
    TORCH_CHECK(codes_.scalar_type() == at::kByte && d_.scalar_type() == at::kHalf && m_.scalar_type() == at::kHalf,
                op, ": codes uint8, d and m float16");
    TORCH_CHECK(K_ % kGroup == 0, op, ": K must be a multiple of 32, got ", K_);
    N = codes_.size(0), K = K_, G = K_ / kGroup;
    TORCH_CHECK(codes_.size(1) * 2 == K && d_.size(0) == N && d_.size(1) == G && m_.size(0) == N && m_.size(1) == G,
                op, ": shapes do not match");
    if (hbits_ != nullptr) {
      TORCH_CHECK(hbits_->dim() == 2 && hbits_->scalar_type() == at::kByte && hbits_->size(0) == N &&
                      hbits_->size(1) * 8 == K,
                  op, ": hbits [N, K/8] uint8");
      hc = hbits_->contiguous();
      hb = hc.data_ptr<uint8_t>();
    }
    cc = codes_.contiguous(), dc = d_.contiguous(), mc = m_.contiguous();
    codes = cc.data_ptr<uint8_t>();
    d = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
    m = reinterpret_cast<const uint16_t*>(mc.data_ptr<at::Half>());
  }
};

template <bool kFive>
at::Tensor group_gemm(const at::Tensor& x, const PackedGroups& w, int64_t isa) {
  const int64_t M = x.size(0), K = w.K, N = w.N, G = w.G;
  const auto xc = x.contiguous();
  auto y = at::empty({M, N}, xc.options());
  float* yp = y.data_ptr<float>();
  const QuantizedRows a(xc.data_ptr<float>(), M, K);
  const int64_t row_bytes = K / 2 + (kFive ? K / 8 : 0);
  if (longattn::use_avx512(isa)) {
    // the AVX-512 form reads the activations with each group's halves apart (split_halves)
    std::vector<int8_t> xs2(M * K);
    for (int64_t r = 0; r < M; ++r) split_halves(a.q(r), G, xs2.data() + r * K);
    at::parallel_for(0, N, weight_grain(row_bytes), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t r = 0; r < M; ++r)
          yp[r * N + n] = row_dot_512<kFive>(xs2.data() + r * K, a.q(r), w.codes + n * (K / 2),
                                             kFive ? w.hb + n * (K / 8) : nullptr, w.d + n * G, w.m + n * G,
                                             a.step(r), a.sum(r), G);
    });
    return y;
  }
  for_tiles<kFive ? 8 : 4>(M, N, K, row_bytes, [&](auto NR, auto R, int64_t r0, int64_t n) {
    constexpr int kNR = decltype(NR)::value;
    const uint8_t* codes[kNR];
    const uint8_t* hb[kNR];
    const uint16_t *d[kNR], *m[kNR];
    for (int i = 0; i < kNR; ++i) {
      codes[i] = w.codes + (n + i) * (K / 2), hb[i] = kFive ? w.hb + (n + i) * (K / 8) : nullptr;
      d[i] = w.d + (n + i) * G, m[i] = w.m + (n + i) * G;
    }
    group_tile<kFive, kNR, decltype(R)::value>(a, r0, codes, hb, d, m, yp + n, N);
  });
  return y;
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                     int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int4_gemm: x [M, K] float32");
  return group_gemm<false>(x, PackedGroups("int4_gemm", codes, nullptr, d, m, x.size(1)), isa);
}

at::Tensor int5_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& hbits, const at::Tensor& d,
                     const at::Tensor& m, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int5_gemm: x [M, K] float32");
  return group_gemm<true>(x, PackedGroups("int5_gemm", codes, &hbits, d, m, x.size(1)), isa);
}

// x [M, K] float32, q [N, K] int8, s [N] float32 -> [M, N] float32 (module comment). isa is
// checked like the other kernels' and has one form, AVX2.
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && s.dim() == 1, "int8_gemm: x [M, K], q [N, K], s [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat,
              "int8_gemm: x float32, q int8, s float32");
  TORCH_CHECK(x.size(1) == q.size(1) && s.size(0) == q.size(0), "int8_gemm: shapes do not match");
  longattn::check_isa(isa);
  const auto xc = x.contiguous();
  const auto qc = q.contiguous();
  const auto sc = s.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = qc.size(0);
  auto y = at::empty({M, N}, xc.options());
  float* yp = y.data_ptr<float>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const QuantizedRows a(xc.data_ptr<float>(), M, K);
  for_tiles<4>(M, N, K, K, [&](auto NR, auto R, int64_t r0, int64_t n) {
    constexpr int kNR = decltype(NR)::value;
    const int8_t* rows[kNR];
    for (int i = 0; i < kNR; ++i) rows[i] = qp + (n + i) * K;
    int8_tile<kNR, decltype(R)::value>(a, r0, rows, sp + n, yp + n, N);
  });
  return y;
}

// Rows of the weight itself, for prefill-sized products (a float GEMM on float32
// activations): codes [N, K/2] (hbits [N, K/8] for int5), d, m [N, K/32] -> [N, K] float32,
// d * u + m per value in float32 (one fma, exact product: the correctly rounded value).
// One pass here instead of several PyTorch ops (unpack, concatenate, scale, shift), each a sweep
// over the whole matrix, so low-bit prefill is not held back by its dequantization.
template <bool kFive>
at::Tensor group_dequantize(const PackedGroups& p) {
  const int64_t N = p.N, K = p.K, G = p.G;
  auto w = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  float* wp = w.data_ptr<float>();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  at::parallel_for(0, N * G, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // group i = row i / G, group i % G
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.codes + i * (kGroup / 2)));
      __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      if constexpr (kFive) {  // groups are contiguous, so group i's bits are word i
        const __m256i f = fifth_bits(p.hb, i);
        lo = _mm_or_si128(lo, _mm256_castsi256_si128(f));
        hi = _mm_or_si128(hi, _mm256_extracti128_si256(f, 1));
      }
      const __m256 dv = _mm256_set1_ps(_cvtsh_ss(p.d[i])), mv = _mm256_set1_ps(_cvtsh_ss(p.m[i]));
      float* out = wp + i * kGroup;
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int j = 0; j < 4; ++j)
        _mm256_storeu_ps(out + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), dv, mv));
    }
  });
  return w;
}

at::Tensor int4_dequantize(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  const int64_t K = codes.dim() == 2 ? codes.size(1) * 2 : 0;
  return group_dequantize<false>(PackedGroups("int4_dequantize", codes, nullptr, d, m, K));
}

at::Tensor int5_dequantize(const at::Tensor& codes, const at::Tensor& hbits, const at::Tensor& d,
                           const at::Tensor& m) {
  const int64_t K = codes.dim() == 2 ? codes.size(1) * 2 : 0;
  return group_dequantize<true>(PackedGroups("int5_dequantize", codes, &hbits, d, m, K));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longattn_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor codes, Tensor d, Tensor m, int isa=-1) -> Tensor");
  m.def("int4_dequantize(Tensor codes, Tensor d, Tensor m) -> Tensor");
  m.def("int5_gemm(Tensor x, Tensor codes, Tensor hbits, Tensor d, Tensor m, int isa=-1) -> Tensor");
  m.def("int5_dequantize(Tensor codes, Tensor hbits, Tensor d, Tensor m) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor q, Tensor s, int isa=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(longattn_cpu, CPU, m) {
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int5_gemm", &int5_gemm);
  m.impl("int5_dequantize", &int5_dequantize);
  m.impl("int8_gemm", &int8_gemm);
}
