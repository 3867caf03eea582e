// Quantized linear: y [M, N] = x [M, K] @ dequant(W)^T (+ bias), W held quantized (kernels/quant_linear.py).
//
// Legend: M rows of x, N output features, K input features, RB rows per scale row, BK columns per scale
// column (fp8 blocks: 128 x 128; int8 per channel: 1 x K; int4 groups: 1 x group).
// Weight forms (``kind``):
//   0 fp8   q [N, K] float8_e4m3fn bytes, scale [ceil(N / RB), ceil(K / BK)] (DeepSeek's weight_scale_inv)
//   1 int8  q [N, K] int8, symmetric
//   2 int4  q [N, Kp] bytes of compressed-tensors' int32 words: value k is nibble k % 2 of byte k / 2, stored
//           as q + 8; zero [N, ceil(K / BK)] int8 (asymmetric) or none
// dequant(W)[n, k] = (q - zero) * scale[n / RB, k / BK], computed in float32 exactly as the torch twin computes
// it (one multiply; the integer and fp8 values and their differences are exact in float32). Each thread takes
// a range of NB-row blocks of W; for every chunk of x's rows (about 256 KB) a block is dequantized into a
// float32 buffer that stays in L1/L2, and every row of the chunk is dotted with it: the weight bytes stream
// from memory once per chunk (once per decode step), a quarter (int8, fp8) or an eighth (int4) of float32's.
// Sums in float32 (lane-wise over k, then across lanes), the bias added, one rounding to x's dtype.
#pragma once

#include "common.h"
#include "moe_gemm.h"  // with_rows
#include "quant_dot_a8.h"
#include "quant_dot_bf16.h"

namespace adapt_cpu {

constexpr int QNB = 4;  // rows of W per block
// blocks a decode pass fetches ahead: a thread's blocks are contiguous rows, but 4 rows read side by side defeat
// the hardware's stream prefetch (1 thread, bf16 rows, a dense model's 100M int4 weights from DRAM: none 11.4 ms,
// 1 block ahead 7.2, 2: 6.4, 4: 6.5)
constexpr int64_t QPF = 2;
#if ADAPT_VW == 16
constexpr int QMR = 4;  // rows of x per register block: QMR * QNB accumulators + QNB weight vectors + 1
#else
constexpr int QMR = 2;
#endif

inline float fp8_e4m3_f32(uint8_t b) {
  // sign to bit 31, exponent and mantissa to bits 20-26: a float32 2^120 too small (subnormals included),
  // rescaled exactly by the multiply. (NaN, 0x7F / 0xFF, is not a weight value and reads as +-480.)
  uint32_t bits = (static_cast<uint32_t>(b & 0x80) << 24) | (static_cast<uint32_t>(b & 0x7F) << 20);
  float f;
  std::memcpy(&f, &bits, 4);
  return f * 0x1p120f;
}

#ifdef ADAPT_VW
#if ADAPT_VW == 16
inline vi vbytes_u32(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi vbytes_i32(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf vfp8(const uint8_t* p) {
  const vi u = vbytes_u32(p);
  const vi bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24),
                                  _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7F)), 20));
  return vmul(_mm512_castsi512_ps(bits), vset1(0x1p120f));
}
inline vf vint8(const uint8_t* p) { return _mm512_cvtepi32_ps(vbytes_i32(p)); }
inline vf vint4(const uint8_t* p) {  // 16 values from 8 bytes (two words), minus the offset 8
  uint32_t w0, w1;
  std::memcpy(&w0, p, 4);
  std::memcpy(&w1, p + 4, 4);
  const vi w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(w0))),
                                  _mm256_set1_epi32(static_cast<int>(w1)), 1);
  const vi sh = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const vi v = _mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32(0xF));
  return vsub(_mm512_cvtepi32_ps(v), vset1(8.f));
}
#else
inline vf vfp8(const uint8_t* p) {
  const vi u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const vi bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24),
                                  _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F)), 20));
  return vmul(_mm256_castsi256_ps(bits), vset1(0x1p120f));
}
inline vf vint8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf vint4(const uint8_t* p) {  // 8 values from 4 bytes (one word), minus the offset 8
  uint32_t w;
  std::memcpy(&w, p, 4);
  const vi sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const vi v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh), _mm256_set1_epi32(0xF));
  return vsub(_mm256_cvtepi32_ps(v), vset1(8.f));
}
#endif
#endif

inline float qvalue(int kind, const uint8_t* q, int64_t k) {
  if (kind == 0) return fp8_e4m3_f32(q[k]);
  if (kind == 1) return static_cast<float>(static_cast<int8_t>(q[k]));
  return static_cast<float>(static_cast<int>((q[k >> 1] >> ((k & 1) * 4)) & 0xF) - 8);
}

// out [K] = dequant of one row of W (q: the row's bytes, s: its scale row, z: its zero row or null)
inline void dequant_row(int kind, const uint8_t* q, const float* s, const int8_t* z, int64_t K, int64_t BK,
                        float* out) {
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += BK) {
    const int64_t k1 = std::min(K, k0 + BK);
    const float sc = s[g], zf = z ? static_cast<float>(z[g]) : 0.f;
    int64_t k = k0;
#ifdef ADAPT_VW
    const vf vs = vset1(sc), vz = vset1(zf);
    if (kind == 0) {
      for (; k + VW <= k1; k += VW) vstoreu(out + k, vmul(vfp8(q + k), vs));
    } else if (kind == 1) {
      for (; k + VW <= k1; k += VW) vstoreu(out + k, vmul(vint8(q + k), vs));
    } else if (k % 8 == 0) {
      for (; k + VW <= k1; k += VW) vstoreu(out + k, vmul(vsub(vint4(q + k / 2), vz), vs));
    }
#endif
    for (; k < k1; ++k) out[k] = (qvalue(kind, q, k) - zf) * sc;
  }
}

// sums [MR][QNB] of rows x[r] (stride ldx) against the QNB dequantized rows w [QNB, K]
template <int MR>
inline void qdot(const float* x, int64_t ldx, const float* w, int64_t K, float (&out)[QMR][QNB]) {
  int64_t k = 0;
#ifdef ADAPT_VW
  vf acc[MR][QNB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < QNB; ++j) acc[r][j] = vzero();
  for (; k + VW <= K; k += VW) {
    vf wv[QNB];
    for (int j = 0; j < QNB; ++j) wv[j] = vloadu(w + j * K + k);
    for (int r = 0; r < MR; ++r) {
      const vf xv = vloadu(x + r * ldx + k);
      for (int j = 0; j < QNB; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < QNB; ++j) out[r][j] = vsum(acc[r][j]);
#else
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < QNB; ++j) out[r][j] = 0.f;
#endif
  for (; k < K; ++k)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < QNB; ++j) out[r][j] += x[r * ldx + k] * w[j * K + k];
}

#ifdef ADAPT_VW
// Decode (M <= QMR rows): sums [MR][QNB] of x's rows against QNB rows of W read straight from their packed
// bytes, each vector dequantized in registers ((q - zero) * scale, the twin's one multiply) and used at once:
// no float32 copy of W is written. Lanes and order as qdot over dequant_row's buffer (BK a multiple of VW, so
// every group but the last is whole vectors), so both paths give the same bits.
template <int MR, int KIND>
inline void qdot_packed(const float* x, int64_t ldx, const uint8_t* const (&q)[QNB], const float* const (&s)[QNB],
                        const int8_t* const (&z)[QNB], int nr, int64_t K, int64_t BK, float (&out)[QMR][QNB],
                        int64_t pf) {
  vf acc[MR][QNB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < QNB; ++j) acc[r][j] = vzero();
  int64_t k = 0;
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += BK) {
    const int64_t k1 = std::min(K, k0 + BK);
    vf vs[QNB], vz[QNB];
    for (int j = 0; j < QNB; ++j) {
      vs[j] = vset1(s[j][g]);
      vz[j] = vset1(z[j] ? static_cast<float>(z[j][g]) : 0.f);
    }
    for (; k + VW <= k1; k += VW) {
      if (k % (KIND == 2 ? 128 : 64) == 0)  // a line of each row, pf bytes ahead (the blocks after this one)
        for (int j = 0; j < QNB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(q[j] + (KIND == 2 ? k / 2 : k) + pf), _MM_HINT_T0);
      vf wv[QNB];
      for (int j = 0; j < QNB; ++j) {
        if constexpr (KIND == 0) wv[j] = vmul(vfp8(q[j] + k), vs[j]);
        else if constexpr (KIND == 1) wv[j] = vmul(vint8(q[j] + k), vs[j]);
        else wv[j] = vmul(vsub(vint4(q[j] + k / 2), vz[j]), vs[j]);
      }
      for (int r = 0; r < MR; ++r) {
        const vf xv = vloadu(x + r * ldx + k);
        for (int j = 0; j < QNB; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < QNB; ++j) out[r][j] = vsum(acc[r][j]);
  for (; k < K; ++k) {  // the last group's columns past the last whole vector
    const int64_t g = k / BK;
    for (int j = 0; j < nr; ++j) {
      const float w = (qvalue(KIND, q[j], k) - (z[j] ? static_cast<float>(z[j][g]) : 0.f)) * s[j][g];
      for (int r = 0; r < MR; ++r) out[r][j] += x[r * ldx + k] * w;
    }
  }
}
#endif

#ifdef ADAPT_VW
// One quantized matrix of every expert (E = 1 for a linear): q [E, N, ldq] bytes, s [E, ceil(N / RB), G] float32,
// z [E, N, G] int8 or null
struct QMat {
  const uint8_t* q;
  const float* s;
  const int8_t* z;
  int64_t N, ldq, RB, G;
};

// m <= QMR rows of the decode's input from row r0, against expert e's matrix
struct QRows {
  int64_t e, r0, m;
};

// Decode: every chunk's rows against its matrix's blocks of QNB rows, the (chunk, block) pairs over the threads
// in one pass; dot(c, q, s, z, nr, pf, sums) sums one block for the chunk's rows, then the bias is added and each
// output rounded once into Y [rows, N]
template <typename T, typename Dot>
inline void decode_blocks(const QMat& w, const std::vector<QRows>& chunks, T* Y, const float* bp, Dot&& dot) {
  const int64_t N = w.N, blocks = (N + QNB - 1) / QNB, srows = (N + w.RB - 1) / w.RB;
  at::parallel_for(0, static_cast<int64_t>(chunks.size()) * blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const QRows& c = chunks[i / blocks];
      const int64_t b = i % blocks, n0 = b * QNB;
      const int nr = static_cast<int>(std::min<int64_t>(QNB, N - n0));
      const uint8_t* qe = w.q + c.e * N * w.ldq;
      const float* se = w.s + c.e * srows * w.G;
      const int8_t* ze = w.z ? w.z + c.e * N * w.G : nullptr;
      const uint8_t* qr[QNB];
      const float* sr[QNB];
      const int8_t* zr[QNB];
      for (int j = 0; j < QNB; ++j) {
        const int64_t n = n0 + std::min(j, nr - 1);  // rows past N repeat the last one, never stored
        qr[j] = qe + n * w.ldq;
        sr[j] = se + (n / w.RB) * w.G;
        zr[j] = ze ? ze + n * w.G : nullptr;
      }
      // the next blocks' bytes are fetched while this one is summed (a thread's blocks of one matrix are
      // contiguous rows)
      const int64_t pf = (b + QPF < blocks && i + QPF < i1 ? QPF : 0) * QNB * w.ldq;
      float sums[QMR][QNB];
      dot(c, qr, sr, zr, nr, pf, sums);
      for (int64_t r = 0; r < c.m; ++r)
        for (int64_t j = 0; j < nr; ++j) Y[(c.r0 + r) * N + n0 + j] = from_f32<T>(sums[r][j] + (bp ? bp[n0 + j] : 0.f));
    }
  });
}
#endif

// How the decode (at most QMR rows a matrix) reads x for a weight [N, K] of ``kind``: 1 the bf16 dot of int4 (x
// permuted, quant_dot_bf16.h), 2 its int8 dot (x in float32), 3 the float32 dot (x in float32, W dequantized in
// registers), 4 / 5 the int8-activation dots of int4 / int8 (a8: x quantized per row, quant_dot_a8.h), 0 none
// (the buffered path; with a8, on x quantized and dequantized to float32)
inline int decode_path(int64_t kind, int64_t K, int64_t BK, bool bf16_x, bool a8) {
  if (a8) {
#ifdef ADAPT_QA8
    if (qa8_takes(kind, K, BK)) return kind == 2 ? 4 : 5;
#endif
    return 0;
  }
#ifdef ADAPT_QDP
  if (bf16_x && qdp_takes(kind, K, BK)) return kind == 2 ? 1 : 2;
#endif
#ifdef ADAPT_VW
  if (BK % VW == 0 || BK >= K) return 3;
#endif
  (void)kind, (void)K, (void)BK, (void)bf16_x;
  return 0;
}

// x [M, K] quantized per row and dequantized, in float32 (the a8 twin's input; quant_dot_a8.h's a8_quantize)
template <typename X>
inline void a8_fake_rows(const X* x, int64_t M, int64_t K, float* out) {
  std::vector<int8_t> q(K);
  for (int64_t r = 0; r < M; ++r) {
    const float s = a8_quantize(x + r * K, K, q.data());
    for (int64_t k = 0; k < K; ++k) out[r * K + k] = static_cast<float>(q[k]) * s;
  }
}

#ifdef ADAPT_VW
// the decode's input rows [R, K] as decode_path's dot reads them: permuted bf16 (path 1) or float32
struct DecodeRows {
  int path;
  int64_t K;
  std::vector<bf16> xp;
  std::vector<float> xf;
  const float* f = nullptr;  // float32 rows: xf, or x itself
#ifdef ADAPT_QA8
  A8Rows a8;  // paths 4, 5
#endif
};

template <typename X>
inline void decode_rows(const X* x, int64_t R, int64_t K, int path, DecodeRows& d) {
  d.path = path, d.K = K;
  if (path >= 4) {
#ifdef ADAPT_QA8
    a8_rows(x, R, K, path == 4 ? 2 : 1, d.a8);
#endif
  } else if (path == 1) {
#ifdef ADAPT_QDP
    if constexpr (std::is_same_v<X, bf16>) {
      d.xp.resize(R * K);
      for (int64_t r = 0; r < R; ++r) qdp_permute_x(x + r * K, K, d.xp.data() + r * K);
    }
#endif
  } else if constexpr (std::is_same_v<X, float>) {
    d.f = x;
  } else {
    d.xf.resize(R * K);
    for (int64_t r = 0; r < R; ++r) row_f32(x + r * K, d.xf.data() + r * K, K, 1.f);  // exact
    d.f = d.xf.data();
  }
}

// sums [MR][QNB] of rows r0 .. r0 + MR - 1 of d against one block of W (q, s, z as qdot_packed)
template <int MR>
inline void decode_dot(const DecodeRows& d, int64_t kind, int64_t r0, const uint8_t* const (&q)[QNB],
                       const float* const (&s)[QNB], const int8_t* const (&z)[QNB], int nr, int64_t BK,
                       float (&sums)[QMR][QNB], int64_t pf) {
  const int64_t K = d.K;
#ifdef ADAPT_QDP
  if (d.path == 1) return qdp_int4<MR, QNB, QMR>(d.xp.data() + r0 * K, K, q, s, z, BK, sums, pf);
  if (d.path == 2) return qdp_int8<MR, QNB, QMR>(d.f + r0 * K, K, q, s, sums, pf);
#endif
#ifdef ADAPT_QA8
  if (d.path >= 4) {
    if constexpr (MR > 2) {  // two rows of x at a time: more would spill the integer and float accumulators
      float part[QMR][QNB];
      decode_dot<2>(d, kind, r0, q, s, z, nr, BK, sums, pf);
      decode_dot<MR - 2>(d, kind, r0 + 2, q, s, z, nr, BK, part, pf);
      for (int r = 0; r < MR - 2; ++r)
        for (int j = 0; j < QNB; ++j) sums[2 + r][j] = part[r][j];
      return;
    } else {
      if (d.path == 4) return qa8_int4<MR, QNB, QMR>(d.a8, r0, K, q, s, z, BK, sums, pf);
      return qa8_int8<MR, QNB, QMR>(d.a8, r0, K, q, s, sums, pf);
    }
  }
#endif
  const float* x = d.f + r0 * K;
  if (kind == 0) qdot_packed<MR, 0>(x, K, q, s, z, nr, K, BK, sums, pf);
  else if (kind == 1) qdot_packed<MR, 1>(x, K, q, s, z, nr, K, BK, sums, pf);
  else qdot_packed<MR, 2>(x, K, q, s, z, nr, K, BK, sums, pf);
}

// Y [rows, N] (+ bias) = d's rows against W, chunk by chunk (decode_blocks)
template <typename T>
inline void decode_project(const QMat& w, const std::vector<QRows>& chunks, const DecodeRows& d, int64_t kind,
                           int64_t BK, T* Y, const float* bp) {
  decode_blocks(w, chunks, Y, bp, [&](const QRows& c, auto& qr, auto& sr, auto& zr, int nr, int64_t pf, auto& sums) {
    with_rows<QMR>(c.m, [&](auto rows) { decode_dot<decltype(rows)::value>(d, kind, c.r0, qr, sr, zr, nr, BK, sums, pf); });
  });
}
#endif

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> zero,
                           int64_t kind, int64_t RB, int64_t BK, c10::optional<torch::Tensor> bias,
                           int64_t act) {
  TORCH_CHECK(act == 0 || (act == 1 && kind != 0), "quant_linear: act 0 (x as it is) or 1 (x quantized to int8 per "
              "row), the latter for int8 / int4 weights");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scale.dim() == 2 && kind >= 0 && kind <= 2 && RB > 0 && BK > 0,
              "quant_linear: x [M, K], q [N, Kq], scale [ceil(N / RB), ceil(K / BK)], kind 0..2");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = (K + BK - 1) / BK;
  TORCH_CHECK(q.is_contiguous() && q.element_size() == 1 && (kind == 2 ? q.size(1) * 2 >= K : q.size(1) == K),
              "quant_linear: q must be contiguous bytes [N, K] (int4: [N, >= K / 2])");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.size(0) == (N + RB - 1) / RB &&
                  scale.size(1) == G,
              "quant_linear: scale must be contiguous float32 [ceil(N / RB), ceil(K / BK)]");
  const int8_t* zp = nullptr;
  if (zero.has_value() && zero->defined()) {
    TORCH_CHECK(kind == 2 && zero->scalar_type() == at::kChar && zero->is_contiguous() && zero->size(0) == N &&
                    zero->size(1) == G,
                "quant_linear: zero points are int8 [N, ceil(K / BK)], int4 only");
    zp = zero->data_ptr<int8_t>();
  }
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear: a bias of N values");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* Q = static_cast<const uint8_t*>(q.data_ptr());
  const float* S = scale.data_ptr<float>();
  const int64_t ldq = q.size(1);
  const int64_t blocks = (N + QNB - 1) / QNB;
#ifdef ADAPT_VW
  const int path = M <= QMR ? decode_path(kind, K, BK, x.scalar_type() == at::kBFloat16, act == 1) : 0;
  if (path) {  // decode: W's packed bytes read once, dequantized in registers (or looked up: quant_dot_bf16.h)
    const auto xc = x.contiguous();
    const QMat wm{Q, S, zp, N, ldq, RB, G};
    float_bf16_or_half(x, "quant_linear", [&](auto tag) {
      using T = decltype(tag);
      DecodeRows d;
      decode_rows(xc.data_ptr<T>(), M, K, path, d);
      decode_project(wm, {QRows{0, 0, M}}, d, kind, BK, y.data_ptr<T>(), bp);
    });
    return y;
  }
#endif
  auto xf = x.to(at::kFloat).contiguous();
  if (act == 1) {  // x quantized to int8 per row, then dequantized: the twin's input
    auto xq = torch::empty_like(xf);
    a8_fake_rows(xf.data_ptr<float>(), M, K, xq.data_ptr<float>());
    xf = xq;
  }
  const float* X = xf.data_ptr<float>();
  // rows of x per pass over the weight: ~256 KB of them (L2), a multiple of QMR
  const int64_t MC = std::max<int64_t>(QMR, ((256 << 10) / (4 * std::max<int64_t>(K, 1))) / QMR * QMR);
  float_bf16_or_half(x, "quant_linear", [&](auto tag) {
    using T = decltype(tag);
    T* Y = y.data_ptr<T>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> wbuf(QNB * K);
      float* w = wbuf.data();
      for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = std::min(MC, M - m0);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n0 = b * QNB, nr = std::min<int64_t>(QNB, N - n0);
          for (int j = 0; j < QNB; ++j) {
            if (j < nr) {
              const int64_t n = n0 + j;
              dequant_row(static_cast<int>(kind), Q + n * ldq, S + (n / RB) * G, zp ? zp + n * G : nullptr, K, BK,
                          w + j * K);
            } else {
              std::fill(w + j * K, w + (j + 1) * K, 0.f);
            }
          }
          for (int64_t r0 = 0; r0 < mc; r0 += QMR) {
            const int64_t mr = std::min<int64_t>(QMR, mc - r0);
            float sums[QMR][QNB];
            const float* xr = X + (m0 + r0) * K;
            with_rows<QMR>(mr, [&](auto rows) { qdot<decltype(rows)::value>(xr, K, w, K, sums); });
            for (int64_t r = 0; r < mr; ++r) {
              T* yr = Y + (m0 + r0 + r) * N;
              for (int64_t j = 0; j < nr; ++j) yr[n0 + j] = from_f32<T>(sums[r][j] + (bp ? bp[n0 + j] : 0.f));
            }
          }
        }
      }
    });
  });
  return y;
}

}  // namespace adapt_cpu
