// Quantized decode with bfloat16 activations (AVX512-BF16 + AVX512-BW; QNB rows of W, MR <= QMR rows of x, as
// qdot_packed in quant_gemm.h; kernels/quant_linear.py legend). The float32 path is not changed by it.
//
// int4 (kind 2): W's packed bytes become bfloat16 words by a table lookup (vpermw) and are dotted with x in
//   float32 by vdpbf16ps, 32 products an instruction, instead of converting each weight to float32 and
//   multiplying it by its scale. vpermw reads the low 5 bits of each index word, so a word of packed bytes is
//   shifted by 0 / 4 / 8 / 12 and used as the index as it is, against a table holding its 16 entries twice (bit 4,
//   the next nibble's low bit, does not matter). Word i of a 64-byte load holds values 4i .. 4i + 3 of its 128
//   columns, so lookup c gives values 4i + c, and each row of x is permuted once per call to match:
//   xp[c * 32 + i] = x[4i + c]. The table of a row's group is bf16((v - 8 - zero) * scale), v = 0..15: the very
//   weights the twin dequantizes to in bfloat16 (the same float32 product, rounded to nearest even once), so the
//   result differs from the twin's F.linear only in the order of the float32 sums (vdpbf16ps also flushes
//   denormals, below 1.2e-38, to zero). Groups of a multiple of 128 columns, or one per row; K % 128 == 0.
// int8 (kind 1, per channel): float32 FMAs of x and the exact integers q, the row's scale times the sum once at
//   the end (no multiply per weight). The twin rounds each q * scale to bfloat16 first; the two differ by at most
//   that rounding (2^-9 of sum |x q scale|) plus the sums' order. (The same lookup scheme for int8, q split as
//   16 * hi + lo into two exact bf16 halves, was slower on a 4th-gen Xeon: vdpbf16ps zmm issues about one per two
//   cycles there, 16 products a cycle, no more than float32 FMA's 32, and the split doubles them.) K % 64 == 0.
// Sums in float32, the bias added, one rounding to bfloat16, as the other paths. Both read each row a line at a
// time and prefetch the blocks ahead (pf bytes).
#pragma once

#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(ADAPT_VW) && ADAPT_VW == 16
#define ADAPT_QDP 1

namespace adapt_cpu {

constexpr int64_t QDP_K4 = 128, QDP_K8 = 64;  // columns per packed load: int4, int8

// whether the bf16 decode takes this weight: int4 in groups of 128-column multiples (or one per row), int8 per
// channel, K a multiple of 128 (int4, x's permutation) or 64 (int8, the prefetch step and its accumulators)
inline bool qdp_takes(int64_t kind, int64_t K, int64_t BK) {
  if (kind == 2) return K % QDP_K4 == 0 && (BK % QDP_K4 == 0 || BK >= K);
  return kind == 1 && K % QDP_K8 == 0 && BK >= K;
}

// xp [K] = x [K] in the order int4's packed words' lookups read it (header comment)
inline void qdp_permute_x(const bf16* x, int64_t K, bf16* xp) {
  for (int64_t k0 = 0; k0 < K; k0 += QDP_K4)
    for (int64_t c = 0; c < 4; ++c)
      for (int64_t i = 0; i < 32; ++i) xp[k0 + c * 32 + i] = x[k0 + 4 * i + c];
}

// accumulators per (row of x, row of W), so that about 16 independent chains hide each accumulate's latency; with
// fewer rows of x each sum is split over more (added lane-wise at the end: part of the sums' order)
constexpr int qdp_chains(int MR) { return MR == 1 ? 4 : MR == 2 ? 2 : 1; }

template <int AC>
inline __m512 qdp_fold(const __m512 (&a)[AC]) {
  if constexpr (AC == 4) return _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
  else if constexpr (AC == 2) return _mm512_add_ps(a[0], a[1]);
  else return a[0];
}

inline __m512i qdp_twice(__m256bh t) {
  return _mm512_broadcast_i64x4(reinterpret_cast<__m256i&>(t));
}

// bf16((v - 8 - z) * s) for v = 0..15, twice
inline __m512i qdp_table4(float s, float z) {
  const __m512 v = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return qdp_twice(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(z)), _mm512_set1_ps(s))));
}

inline __m512bh qdp_look(__m512i idx, __m512i table) {
  const __m512i t = _mm512_permutexvar_epi16(idx, table);
  return reinterpret_cast<const __m512bh&>(t);
}

inline __m512bh qdp_x(const bf16* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return reinterpret_cast<const __m512bh&>(v);
}

// sums [MR][QNB] of the permuted rows xp (stride K) against QNB rows of int4 W (q, s, z as qdot_packed); pf: the
// bytes ahead of each row to prefetch
template <int MR, int NB, int MRMAX>
inline void qdp_int4(const bf16* xp, int64_t K, const uint8_t* const (&q)[NB], const float* const (&s)[NB],
                     const int8_t* const (&z)[NB], int64_t BK, float (&out)[MRMAX][NB], int64_t pf) {
  constexpr int AC = qdp_chains(MR);
  __m512 acc[MR][NB][AC];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j)
      for (int a = 0; a < AC; ++a) acc[r][j][a] = _mm512_setzero_ps();
  __m512i table[NB];
  int64_t group = -1;
  for (int64_t k0 = 0; k0 < K; k0 += QDP_K4) {
    const int64_t g = k0 / BK;
    if (g != group) {
      for (int j = 0; j < NB; ++j) table[j] = qdp_table4(s[j][g], z[j] ? static_cast<float>(z[j][g]) : 0.f);
      group = g;
    }
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(q[j] + k0 / 2 + pf), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(q[j] + k0 / 2);
      const __m512bh t[4] = {qdp_look(w, table[j]), qdp_look(_mm512_srli_epi16(w, 4), table[j]),
                             qdp_look(_mm512_srli_epi16(w, 8), table[j]), qdp_look(_mm512_srli_epi16(w, 12), table[j])};
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 4; ++c)
          acc[r][j][c % AC] = _mm512_dpbf16_ps(acc[r][j][c % AC], qdp_x(xp + r * K + k0 + 32 * c), t[c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    if constexpr (NB == 4) {
      const __m512 f[4] = {qdp_fold<AC>(acc[r][0]), qdp_fold<AC>(acc[r][1]), qdp_fold<AC>(acc[r][2]),
                           qdp_fold<AC>(acc[r][3])};
      vsum4(f, out[r]);
    } else {
      for (int j = 0; j < NB; ++j) out[r][j] = _mm512_reduce_add_ps(qdp_fold<AC>(acc[r][j]));
    }
}

// int8 W (per channel), bf16 rows of x held in float32 (exactly): float32 FMAs of x and the exact integers (no
// multiply per weight), the row's scale times the sum once at the end
template <int MR, int NB, int MRMAX>
inline void qdp_int8(const float* x, int64_t K, const uint8_t* const (&q)[NB], const float* const (&s)[NB],
                     float (&out)[MRMAX][NB], int64_t pf) {
  constexpr int AC = qdp_chains(MR);
  __m512 acc[MR][NB][AC];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j)
      for (int a = 0; a < AC; ++a) acc[r][j][a] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += 16 * AC) {
    if (k0 % 64 == 0)
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(q[j] + k0 + pf), _MM_HINT_T0);
    for (int a = 0; a < AC; ++a) {
      const int64_t k = k0 + 16 * a;
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j)
        wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[j] + k))));
      for (int r = 0; r < MR; ++r) {
        const __m512 xv = _mm512_loadu_ps(x + r * K + k);
        for (int j = 0; j < NB; ++j) acc[r][j][a] = _mm512_fmadd_ps(xv, wv[j], acc[r][j][a]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) out[r][j] = _mm512_reduce_add_ps(qdp_fold<AC>(acc[r][j])) * s[j][0];
}

}  // namespace adapt_cpu
#endif
