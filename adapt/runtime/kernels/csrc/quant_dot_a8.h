// Quantized decode with int8 activations (W8A8 / W4A8; AVX512-VNNI + AVX512-BW; QNB rows of W, MR <= QMR rows of
// x, as qdot_packed in quant_gemm.h; kernels/quant_linear.py legend).
//
// Each row of x is quantized dynamically and symmetrically, as the twin does it (quant_linear.py's
// quantize_rows): scale = max |x| / 127 in float32, q = round-half-even(x / scale) clamped to [-127, 127], q = 0
// where the row is all zeros. The products are then integers, summed exactly by vpdpbusd (64 a instruction: u8
// times s8 in groups of four, into 16 int32 lanes):
//   int4 (kind 2): the packed nibbles are the u8 operand as they are (v + 8), x the s8 one, permuted once per
//     row so that a byte of W meets its two columns: per 128 columns, the even columns, then the odd ones (byte b
//     holds columns 2b and 2b + 1). sum (v - z) x = sum (v + 8) x - (8 + z) sum x: the second term from each row's
//     sum of q over its 128-column blocks. Each group's integer lanes are scaled by the group's weight scale into
//     float32 lanes; groups of a multiple of 128 columns, or one per row; K % 128 == 0.
//   int8 (kind 1, per channel): x + 128 is the u8 operand, W the s8 one; sum (x + 128) w - 128 sum w, with sum w
//     by one more vpdpbusd against ones. K % 64 == 0, K <= 65536 (the int32 sums).
// The result is scale_x * (the float32 sum): it differs from the twin (x dequantized to float32, W dequantized to
// float32, F.linear in float32) only in the order and grouping of the float32 sums. Bias added, one rounding.
#pragma once

#include "common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(ADAPT_VW) && ADAPT_VW == 16
#define ADAPT_QA8 1

namespace adapt_cpu {

constexpr int64_t QA8_K4 = 128, QA8_K8 = 64;  // columns per packed load: int4, int8

// whether the int8-activation decode takes this weight (header comment)
inline bool qa8_takes(int64_t kind, int64_t K, int64_t BK) {
  if (kind == 2) return K % QA8_K4 == 0 && (BK % QA8_K4 == 0 || BK >= K);
  return kind == 1 && K % QA8_K8 == 0 && K <= 65536 && BK >= K;
}

// x's rows quantized to int8 (header comment): q [R, K] (int4: permuted per 128 columns; int8: q + 128 as u8),
// s [R] the rows' scales, blk [R, K / 128] the sums of q per 128 columns (int4)
struct A8Rows {
  std::vector<uint8_t> q;
  std::vector<float> s;
  std::vector<int32_t> blk;
};

// one row's scale and values, as quantize_rows computes them
template <typename X>
inline float a8_quantize(const X* x, int64_t K, int8_t* q) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(f32(x[k])));
  const float s = amax / 127.f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = s > 0.f ? std::nearbyint(f32(x[k]) / s) : 0.f;
    q[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
  return s;
}

template <typename X>
inline void a8_rows(const X* x, int64_t R, int64_t K, int64_t kind, A8Rows& a) {
  a.q.resize(R * K), a.s.resize(R), a.blk.resize(kind == 2 ? R * (K / QA8_K4) : 0);
  std::vector<int8_t> row(K);
  for (int64_t r = 0; r < R; ++r) {
    a.s[r] = a8_quantize(x + r * K, K, row.data());
    uint8_t* dst = a.q.data() + r * K;
    if (kind == 2) {
      for (int64_t k0 = 0; k0 < K; k0 += QA8_K4) {
        int32_t sum = 0;
        for (int64_t b = 0; b < 64; ++b) {
          dst[k0 + b] = static_cast<uint8_t>(row[k0 + 2 * b]);
          dst[k0 + 64 + b] = static_cast<uint8_t>(row[k0 + 2 * b + 1]);
          sum += row[k0 + 2 * b] + row[k0 + 2 * b + 1];
        }
        a.blk[r * (K / QA8_K4) + k0 / QA8_K4] = sum;
      }
    } else {
      for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<uint8_t>(row[k] + 128);
    }
  }
}

inline __m512i qa8_load(const uint8_t* p) { return _mm512_loadu_si512(p); }

// sums [MR][NB] of quantized rows r0 .. of a against NB rows of int4 W (q, s, z as qdot_packed)
template <int MR, int NB, int MRMAX>
inline void qa8_int4(const A8Rows& a, int64_t r0, int64_t K, const uint8_t* const (&q)[NB],
                     const float* const (&s)[NB], const int8_t* const (&z)[NB], int64_t BK, float (&out)[MRMAX][NB],
                     int64_t pf) {
  constexpr int AC = MR == 1 ? 2 : 1;  // independent integer chains per (row of x, row of W)
  const int64_t bk = std::min(BK, K), nblk = K / QA8_K4;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 facc[MR][NB];
  float corr[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) facc[r][j] = _mm512_setzero_ps(), corr[r][j] = 0.f;
  for (int64_t g0 = 0; g0 < K; g0 += bk) {
    const int64_t g = g0 / BK, g1 = std::min(K, g0 + bk);
    __m512i acc[MR][NB][AC];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NB; ++j)
        for (int c = 0; c < AC; ++c) acc[r][j][c] = _mm512_setzero_si512();
    for (int64_t k0 = g0; k0 < g1; k0 += QA8_K4) {
      __m512i xl[MR], xh[MR];
      for (int r = 0; r < MR; ++r) {
        const uint8_t* xr = a.q.data() + (r0 + r) * K + k0;
        xl[r] = qa8_load(xr), xh[r] = qa8_load(xr + 64);
      }
      for (int j = 0; j < NB; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(q[j] + k0 / 2 + pf), _MM_HINT_T0);
        const __m512i w = qa8_load(q[j] + k0 / 2);
        const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
        for (int r = 0; r < MR; ++r) {
          acc[r][j][0] = _mm512_dpbusd_epi32(acc[r][j][0], lo, xl[r]);
          acc[r][j][AC - 1] = _mm512_dpbusd_epi32(acc[r][j][AC - 1], hi, xh[r]);
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      int32_t xs = 0;
      for (int64_t b = g0 / QA8_K4; b < g1 / QA8_K4; ++b) xs += a.blk[(r0 + r) * nblk + b];
      for (int j = 0; j < NB; ++j) {
        __m512i t = acc[r][j][0];
        if constexpr (AC == 2) t = _mm512_add_epi32(t, acc[r][j][1]);
        const float sc = s[j][g];
        facc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(sc), facc[r][j]);
        corr[r][j] += sc * static_cast<float>((8 + (z[j] ? z[j][g] : 0)) * xs);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    if constexpr (NB == 4) {
      float sum[4];
      vsum4(facc[r], sum);
      for (int j = 0; j < NB; ++j) out[r][j] = a.s[r0 + r] * (sum[j] - corr[r][j]);
    } else {
      for (int j = 0; j < NB; ++j) out[r][j] = a.s[r0 + r] * (_mm512_reduce_add_ps(facc[r][j]) - corr[r][j]);
    }
}

// int8 W (per channel) against quantized rows (stored as q + 128)
template <int MR, int NB, int MRMAX>
inline void qa8_int8(const A8Rows& a, int64_t r0, int64_t K, const uint8_t* const (&q)[NB],
                     const float* const (&s)[NB], float (&out)[MRMAX][NB], int64_t pf) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[MR][NB], ws[NB];
  for (int j = 0; j < NB; ++j) {
    ws[j] = _mm512_setzero_si512();
    for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_setzero_si512();
  }
  for (int64_t k = 0; k < K; k += QA8_K8) {
    __m512i xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = qa8_load(a.q.data() + (r0 + r) * K + k);
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(q[j] + k + pf), _MM_HINT_T0);
      const __m512i w = qa8_load(q[j] + k);
      ws[j] = _mm512_dpbusd_epi32(ws[j], ones, w);
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv[r], w);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t wsum = _mm512_reduce_add_epi32(ws[j]);
    for (int r = 0; r < MR; ++r) {
      const int64_t dot = static_cast<int64_t>(_mm512_reduce_add_epi32(acc[r][j])) - 128 * wsum;
      out[r][j] = a.s[r0 + r] * (s[j][0] * static_cast<float>(dot));
    }
  }
}

}  // namespace adapt_cpu
#endif
