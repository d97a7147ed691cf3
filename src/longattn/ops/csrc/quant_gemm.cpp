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
// Where the CPU has AVX-512 VNNI, every format runs the AVX-512 forms (group_tile_512,
// int8_tile_512): the same tiles and integer dots, 64 bytes per vpdpbusd, summed in their own
// fixed order.
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
// hide the fma latency, few enough to stay in AVX2's sixteen registers (kWide: AVX-512's 32,
// where 16 chains fit beside the unpacked codes).
template <int R, bool kWide>
constexpr int tile_cols() {
  if constexpr (kWide) return R > 4 ? 2 : 4;
  return R > 4 ? 1 : R >= 3 ? 2 : 4;
}

// Calls tile(NR, R, r0, n0) (both std::integral_constant) over every tile of weight rows and
// activation rows: tiles of kRows activation rows (4 or 8) while they last, then one of each
// smaller size the remainder needs; weight rows in panels of 32 (whose codes stay in L1 while
// the block's row tiles pass) and split across threads (weight_grain). Which tile an output
// falls in never changes its value (group_tile, int8_tile and their AVX-512 forms). More rows
// per tile share each unpacked weight group among more rows, which pays where unpacking costs
// (int5's fifth bits); fewer rows and more weight rows share each activation load, which pays
// for int4 and int8 (measured in benchmarks/prefill_gemm.py). kWide: the AVX-512 forms' tile
// sizes (tile_cols), where row tiles of 4 or 8 and panels of 32 to 1,024 weight rows measured
// within a few percent of each other: the forms are bound by vpdpbusd and its conversions.
template <int kRows, bool kWide = false, class Tile>
void for_tiles(int64_t M, int64_t N, int64_t K, int64_t row_bytes, const Tile& tile) {
  static_assert(kRows == 4 || kRows == 8, "tiles of 4 or 8 activation rows");
  const int64_t grain = weight_grain(row_bytes);
  const int64_t block = std::max<int64_t>(kRows, kRowBlockBytes / std::max<int64_t>(K, 1) / kRows * kRows);
  auto rows = [&](auto R, int64_t r, int64_t n0, int64_t n1) {
    constexpr int NR = tile_cols<decltype(R)::value, kWide>();
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

// The AVX-512 VNNI forms (CPUs with AVX-512 F/BW/VL/DQ and VNNI; cpu_features.h). The tiles,
// the threads and each output's integer dots are as in the AVX2 forms; what changes is how many
// groups one instruction covers: vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and
// adds each four products into an int32 lane (exact), where AVX2 needs vpmaddubsw + vpmaddwd for
// 32. Per output element the order is again fixed for every tile shape: a 16-lane float
// accumulator takes four groups (int4, int5) or two (int8) per step in group order (a last,
// shorter step masked), then its two halves are added and summed. Its sums differ from the AVX2
// form's in the last bits (both within the bound tests/core/test_weights.py derives); a machine
// runs one form for every call, so a row's bits never depend on its batch.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

// The activation rows in the AVX-512 forms' layouts, built once per call from QuantizedRows, for
// Gp groups per row: G rounded up to the groups one step takes (`per`: 4 for int4 and int5, 2
// for int8), the padding zero, so the last step reads whole vectors and adds nothing for them:
// - halves (int4, int5) [M, Gp * 32]: per four groups, their four low halves (values 0..15 of
//   each, 16 bytes apiece) then their four high halves, so each 128-bit lane meets one group's
//   low or high nibbles;
// - biased (int8) [M, Gp * 32]: xq + 128 as unsigned bytes (vpdpbusd's unsigned operand; the
//   signed weights' 128 * sum is taken off per group, below);
// - steps [M, Gp * lanes]: each block step repeated over the int32 lanes its group's dots land
//   in (4 for int4 and int5, 8 for int8).
struct WideRows {
  int64_t G, per, Gp, lanes;
  std::vector<int8_t> halves;
  std::vector<uint8_t> biased;
  std::vector<float> steps;

  WideRows(const QuantizedRows& a, bool groups)
      : G(a.G), per(groups ? 4 : 2), Gp((a.G + per - 1) / per * per), lanes(groups ? 4 : 8),
        steps(a.M * Gp * lanes, 0.f) {
    if (groups) halves.assign(a.M * Gp * kGroup, 0);
    else biased.assign(a.M * Gp * kGroup, 0);
    for (int64_t r = 0; r < a.M; ++r) {
      const int8_t* xq = a.q(r);
      if (groups) {
        int8_t* h = halves.data() + r * Gp * kGroup;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t j = g / 4 * 4, i = g % 4;
          std::memcpy(h + j * kGroup + 16 * i, xq + g * kGroup, 16);
          std::memcpy(h + j * kGroup + 64 + 16 * i, xq + g * kGroup + 16, 16);
        }
      } else {
        for (int64_t k = 0; k < G * kGroup; ++k) biased[r * Gp * kGroup + k] = static_cast<uint8_t>(xq[k] + 128);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t l = 0; l < lanes; ++l) steps[(r * Gp + g) * lanes + l] = a.step(r)[g];
    }
  }
  const int8_t* half(int64_t r) const { return halves.data() + r * Gp * kGroup; }
  const uint8_t* bias(int64_t r) const { return biased.data() + r * Gp * kGroup; }
  const float* step(int64_t r) const { return steps.data() + r * Gp * lanes; }
};

// The sum of a 16-lane accumulator: its halves added, then summed as the AVX2 form sums its own.
inline float finish(__m512 acc) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)));
}

// Groups g .. g + t - 1 (t <= 4) of one weight row as vpdpbusd's unsigned operands: lo holds
// values 0..15 of each group (one 128-bit lane per group), hi values 16..31. The groups' 64 code
// bytes are masked into their low and high nibbles; int5's fifth bits of the four groups are two
// 64-bit masks (one byte shuffle of their four words), each added to its half in one masked
// byte add. Lanes of groups past t are zero (masked loads).
template <bool kFive>
inline void unpack_four(const uint8_t* codes, const uint8_t* hb, int64_t g, int64_t t, __m512i& lo, __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i c = t == 4 ? _mm512_loadu_si512(codes + g * (kGroup / 2))
                           : _mm512_maskz_loadu_epi8((1ULL << (16 * t)) - 1, codes + g * (kGroup / 2));
  lo = _mm512_and_si512(c, low4), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
  if constexpr (kFive) {
    // the four words' low 16 bits (values 0..15 of each group), then their high 16 bits
    const __m128i halves = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    __m128i w = t == 4 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(hb + 4 * g))
                       : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1 << (4 * t)) - 1), hb + 4 * g);
    w = _mm_shuffle_epi8(w, halves);
    lo = _mm512_mask_add_epi8(lo, static_cast<__mmask64>(_mm_cvtsi128_si64(w)), lo, bit4);
    hi = _mm512_mask_add_epi8(hi, static_cast<__mmask64>(_mm_extract_epi64(w, 1)), hi, bit4);
  }
}

// group_tile's AVX-512 form: weight rows n0 .. n0 + NR - 1 against activation rows r0 .. r0 +
// R - 1. Four groups per step (unpack_four), each half meeting its activations in one
// vpdpbusd; the int32 dots, as float32, times d[g] * dx[g] (lane-wise: the steps WideRows
// repeats per lane), go into the output's accumulator. A last step of fewer than four groups
// loads only theirs (masked), so the missing lanes add zero; the offsets' share is
// group_offsets, as in the AVX2 form.
template <bool kFive, int NR, int R>
inline void group_tile_512(const QuantizedRows& a, const WideRows& wa, int64_t r0, const uint8_t* const* codes,
                           const uint8_t* const* hb, const uint16_t* const* d, const uint16_t* const* m, float* y,
                           int64_t ldy) {
  const int64_t G = a.G;
  const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int8_t* xh[R];
  const float* st[R];
  __m512 acc[NR][R];
  for (int r = 0; r < R; ++r) xh[r] = wa.half(r0 + r), st[r] = wa.step(r0 + r);
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  auto four = [&](int64_t g, auto partial) {  // groups g .. g + 3 (the last ones only: partial)
    const int64_t t = decltype(partial)::value ? G - g : 4;
    __m512i lo[NR], hi[NR];
    __m512 dv[NR];
    if constexpr (!decltype(partial)::value) {
      for (int i = 0; i < NR; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(codes[i] + g * (kGroup / 2) + kPrefetch), _MM_HINT_T0);
      if constexpr (kFive)  // 16 groups' fifth bits are one cache line
        if ((g & 15) == 0)
          for (int i = 0; i < NR; ++i)
            _mm_prefetch(reinterpret_cast<const char*>(hb[i] + g * 4 + kPrefetch / 4), _MM_HINT_T0);
    }
    for (int i = 0; i < NR; ++i) {
      unpack_four<kFive>(codes[i], hb[i], g, t, lo[i], hi[i]);
      const __m128i dh = decltype(partial)::value
                             ? _mm_maskz_loadu_epi16(static_cast<__mmask8>((1 << t) - 1), d[i] + g)
                             : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(d[i] + g));
      dv[i] = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(dh)));
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) {
        __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], _mm512_loadu_si512(xh[r] + g * kGroup));
        dots = _mm512_dpbusd_epi32(dots, hi[i], _mm512_loadu_si512(xh[r] + g * kGroup + 64));
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(dv[i], _mm512_loadu_ps(st[r] + g * 4)),
                                    acc[i][r]);
      }
  };
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) four(g, std::false_type{});
  if (g < G) four(g, std::true_type{});
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r)
      y[(r0 + r) * ldy + i] = finish(acc[i][r]) + group_offsets(m[i], a.sum(r0 + r), G);
}

// group_tile_512 for one weight row and one activation row (a decode step's products), in
// fewer instructions: eight groups per iteration, whose eight scales d[g] * dx[g] are one
// 256-bit product spread over the lanes of each four, and the offsets' eight-lane sum in the
// same loop. Every sum is the one group_tile_512 forms, in its order: the same bits.
template <bool kFive>
float row_dot_512(const QuantizedRows& a, const WideRows& wa, int64_t r, const uint8_t* codes, const uint8_t* hb,
                  const uint16_t* d, const uint16_t* m) {
  const int64_t G = a.G;
  const int8_t* xh = wa.half(r);
  const float *dx = a.step(r), *xs = a.sum(r);
  const __m512i pick_lo = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i pick_hi = _mm512_add_epi32(pick_lo, _mm512_set1_epi32(4));
  __m512 acc = _mm512_setzero_ps();
  __m256 am = _mm256_setzero_ps();
  auto four = [&](int64_t j, int64_t t, __m512 sc) {  // groups j .. j + t - 1, scales sc
    __m512i lo, hi;
    unpack_four<kFive>(codes, hb, j, t, lo, hi);
    __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xh + j * kGroup));
    dots = _mm512_dpbusd_epi32(dots, hi, _mm512_loadu_si512(xh + j * kGroup + 64));
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
    four(g, 4, _mm512_permutexvar_ps(pick_lo, sc));
    four(g + 4, 4, _mm512_permutexvar_ps(pick_hi, sc));
  }
  float off = hsum(am);  // group_offsets' order: its eight-lane sum, then the last groups one by one
  for (int64_t j = g; j < G; ++j) off = std::fma(_cvtsh_ss(m[j]), xs[j], off);
  for (; g < G; g += 4) {  // the last G % 8 groups: a whole four, then fewer (masked) or none
    const int64_t t = std::min<int64_t>(4, G - g);
    const __mmask8 k = static_cast<__mmask8>((1 << t) - 1);
    four(g, t, _mm512_permutexvar_ps(pick_lo, _mm512_castps128_ps512(_mm_mul_ps(
                                                  _mm_cvtph_ps(_mm_maskz_loadu_epi16(k, d + g)),
                                                  _mm_maskz_loadu_ps(k, dx + g)))));
  }
  return finish(acc) + off;
}

// int8_tile's AVX-512 form: two groups per step. vpdpbusd takes the activations biased to
// unsigned (xq + 128) against the signed weights, starting each lane from -128 times the sum of
// its four weights (one more vpdpbusd per weight row, shared by the tile's rows), so every int32
// lane is exactly the AVX2 form's four-product dot. An odd last group is loaded alone (masked);
// a short last block is added as in the AVX2 form.
template <int NR, int R>
inline void int8_tile_512(const QuantizedRows& a, const WideRows& wa, int64_t r0, const int8_t* const* w,
                          const float* s, float* y, int64_t ldy) {
  const int64_t G = a.G;
  const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* xb[R];
  const float* st[R];
  __m512 acc[NR][R];
  for (int r = 0; r < R; ++r) xb[r] = wa.bias(r0 + r), st[r] = wa.step(r0 + r);
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  auto two = [&](int64_t g, auto partial) {  // groups g and g + 1 (g alone: partial)
    __m512i wv[NR], base[NR];
    for (int i = 0; i < NR; ++i) {
      if constexpr (decltype(partial)::value) {
        wv[i] = _mm512_maskz_loadu_epi8(0xFFFFFFFFULL, w[i] + g * kGroup);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(w[i] + g * kGroup + 2 * kPrefetch), _MM_HINT_T0);
        wv[i] = _mm512_loadu_si512(w[i] + g * kGroup);
      }
      base[i] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, wv[i]));
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) {
        const __m512i dots = _mm512_dpbusd_epi32(base[i], _mm512_loadu_si512(xb[r] + g * kGroup), wv[i]);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_loadu_ps(st[r] + g * 8), acc[i][r]);
      }
  };
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) two(g, std::false_type{});
  if (g < G) two(g, std::true_type{});
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) {
      float v = finish(acc[i][r]);
      if (a.T > 0) {
        const int8_t* xq = a.q(r0 + r);
        int32_t t = 0;
        for (int64_t k = G * kGroup; k < a.K; ++k) t += static_cast<int32_t>(w[i][k]) * xq[k];
        v = std::fma(static_cast<float>(t), a.step(r0 + r)[G], v);
      }
      y[(r0 + r) * ldy + i] = v * s[i];
    }
}
#pragma GCC pop_options

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
  const auto pointers = [&](auto NR, int64_t n, const uint8_t** codes, const uint8_t** hb, const uint16_t** d,
                            const uint16_t** m) {
    for (int i = 0; i < decltype(NR)::value; ++i) {
      codes[i] = w.codes + (n + i) * (K / 2), hb[i] = kFive ? w.hb + (n + i) * (K / 8) : nullptr;
      d[i] = w.d + (n + i) * G, m[i] = w.m + (n + i) * G;
    }
  };
  if (longattn::use_avx512(isa)) {
    const WideRows wa(a, true);
    for_tiles<8, true>(M, N, K, row_bytes, [&](auto NR, auto R, int64_t r0, int64_t n) {
      constexpr int kNR = decltype(NR)::value;
      const uint8_t *codes[kNR], *hb[kNR];
      const uint16_t *d[kNR], *m[kNR];
      pointers(NR, n, codes, hb, d, m);
      if constexpr (decltype(R)::value == 1) {
        for (int i = 0; i < kNR; ++i) yp[r0 * N + n + i] = row_dot_512<kFive>(a, wa, r0, codes[i], hb[i], d[i], m[i]);
      } else {
        group_tile_512<kFive, kNR, decltype(R)::value>(a, wa, r0, codes, hb, d, m, yp + n, N);
      }
    });
    return y;
  }
  for_tiles<kFive ? 8 : 4>(M, N, K, row_bytes, [&](auto NR, auto R, int64_t r0, int64_t n) {
    constexpr int kNR = decltype(NR)::value;
    const uint8_t *codes[kNR], *hb[kNR];
    const uint16_t *d[kNR], *m[kNR];
    pointers(NR, n, codes, hb, d, m);
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

// x [M, K] float32, q [N, K] int8, s [N] float32 -> [M, N] float32 (module comment).
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
  if (longattn::use_avx512(isa)) {
    const WideRows wa(a, false);
    for_tiles<4, true>(M, N, K, K, [&](auto NR, auto R, int64_t r0, int64_t n) {
      constexpr int kNR = decltype(NR)::value;
      const int8_t* rows[kNR];
      for (int i = 0; i < kNR; ++i) rows[i] = qp + (n + i) * K;
      int8_tile_512<kNR, decltype(R)::value>(a, wa, r0, rows, sp + n, yp + n, N);
    });
    return y;
  }
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
