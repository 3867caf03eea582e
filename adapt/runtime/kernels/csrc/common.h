// Shared by the fused CPU kernels: element conversions, exp, the vector layer, small helpers.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace adapt_cpu {


using bf16 = c10::BFloat16;
using half = c10::Half;

inline float f32(float x) { return x; }
inline float f32(half x) { return static_cast<float>(x); }
inline float f32(bf16 x) {
  uint32_t b = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline float f32(int8_t x) { return static_cast<float>(x); }

// round to nearest even, as c10::BFloat16(float) (NaN stays NaN)
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x40u) : static_cast<uint16_t>(r);
}
template <typename T> inline T from_f32(float f);
template <> inline float from_f32<float>(float f) { return f; }
template <> inline bf16 from_f32<bf16>(float f) { return bf16(bf16_bits(f), bf16::from_bits()); }
template <> inline half from_f32<half>(float f) { return half(f); }  // IEEE round to nearest even
// the value a float rounds to in T, as a float (torch's per-op rounding of a bfloat16 result)
template <typename T> inline float rnd(float f) { return f32(from_f32<T>(f)); }

// exp(x) for float32, Cody-Waite range reduction and a degree-6 polynomial (Cephes expf, ~1 ulp); plain
// arithmetic so that loops of it vectorize. Inputs below -87.3 give ~1e-38, not 0 (callers do not rely on 0).
inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float fi = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - fi * 0.693359375f) - fi * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// ---------------------------------------------------------------------------------------------------
// The vector layer: VW float32 lanes (16 with AVX-512, 8 with AVX2 + FMA), loads of float32 / bfloat16,
// stores rounding to nearest even (as the scalar helpers), exp as exp_f32. Without either, the scalar
// loops run (and silu / rope stay with torch: see kernels/fused.py).
#if defined(__AVX512F__)
#define ADAPT_VW 16
constexpr int64_t VW = 16;
using vf = __m512;
using vi = __m512i;
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoreu(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
// the sums of four vectors at once (out[i] = the lanes of v[i] added; one transpose-add instead of four
// horizontal reductions; another order of the additions than vsum)
inline void vsum4(const __m512 (&v)[4], float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  // each 128-bit lane of abcd holds partial sums of v[0] .. v[3]: the four lanes added
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), hi);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(out, q);
}
inline vf vfloor(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf fi) {  // 2^fi for integral fi in the normal range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fi), _mm512_set1_epi32(127)), 23));
}
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const bf16* p) {
  const vi w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline vi bf16_bitsv(vf f) {  // as bf16_bits, per lane
  const vi u = _mm512_castps_si512(f);
  const vi lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const vi r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const vi nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 isnan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_blend_epi32(isnan, r, nan);
}
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vstore(bf16* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bitsv(v)));
}
inline vf bf16_as_f32(vi bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }
// float16: AVX-512F converts (round to nearest even, as c10::Half)
#define ADAPT_HALF 1
inline vf vload(const half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void vstore(half* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline vf half_round(vf v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define ADAPT_VW 8
constexpr int64_t VW = 8;
using vf = __m256;
using vi = __m256i;
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoreu(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}
inline vf vfloor(vf v) { return _mm256_floor_ps(v); }
inline vf vpow2i(vf fi) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fi), _mm256_set1_epi32(127)), 23));
}
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const bf16* p) {
  const vi w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline vi bf16_bitsv(vf f) {
  const vi u = _mm256_castps_si256(f);
  const vi lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const vi r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const vi nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  // both sides below 2^31: the signed compare is the unsigned one
  const vi isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(r, nan, isnan);
}
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void vstore(bf16* p, vf v) {
  const vi b = bf16_bitsv(v);  // 8 x u32, each <= 0xFFFF
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline vf bf16_as_f32(vi bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)); }
#if defined(__F16C__)
// float16 through F16C (every AVX2 CPU but a few early VIA ones): round to nearest even, as c10::Half
#define ADAPT_HALF 1
inline vf vload(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void vstore(half* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline vf half_round(vf v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif
#endif

#ifdef ADAPT_VW
template <typename T> inline vf vrnd(vf v);
template <> inline vf vrnd<float>(vf v) { return v; }
template <> inline vf vrnd<bf16>(vf v) { return bf16_as_f32(bf16_bitsv(v)); }
#ifdef ADAPT_HALF
template <> inline vf vrnd<half>(vf v) { return half_round(v); }
#endif
inline vf vexp(vf x) {  // exp_f32, per lane
  x = vmin(vmax(x, vset1(-87.3f)), vset1(88.7f));
  const vf fi = vfloor(vadd(vmul(x, vset1(1.44269504088896341f)), vset1(0.5f)));
  const vf r = vsub(vsub(x, vmul(fi, vset1(0.693359375f))), vmul(fi, vset1(-2.12194440e-4f)));
  vf p = vset1(1.9875691500e-4f);
  p = vadd(vmul(p, r), vset1(1.3981999507e-3f));
  p = vadd(vmul(p, r), vset1(8.3334519073e-3f));
  p = vadd(vmul(p, r), vset1(4.1665795894e-2f));
  p = vadd(vmul(p, r), vset1(1.6666665459e-1f));
  p = vadd(vmul(p, r), vset1(5.0000001201e-1f));
  p = vadd(vadd(vmul(vmul(p, r), r), r), vset1(1.0f));
  return vmul(p, vpow2i(fi));
}
#endif

// one cache row (n values) as float32, times its scale (int8 caches; 1 otherwise)
template <typename T> inline void row_f32(const T* src, float* dst, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32(src[i]) * s;
}
template <> inline void row_f32<bf16>(const bf16* src, float* dst, int64_t n, float s) {
  int64_t i = 0;
#ifdef ADAPT_VW
  const vf vs = vset1(s);
  for (; i + VW <= n; i += VW) vstoreu(dst + i, vmul(vload(src + i), vs));
#endif
  for (; i < n; ++i) dst[i] = f32(src[i]) * s;
}
#ifdef ADAPT_HALF
template <> inline void row_f32<half>(const half* src, float* dst, int64_t n, float s) {
  int64_t i = 0;
  const vf vs = vset1(s);
  for (; i + VW <= n; i += VW) vstoreu(dst + i, vmul(vload(src + i), vs));
  for (; i < n; ++i) dst[i] = f32(src[i]) * s;
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float r = 0.f;
#ifdef ADAPT_VW
  vf acc = vzero();
  for (; i + VW <= n; i += VW) acc = vfma(vloadu(a + i), vloadu(b + i), acc);
  r = vsum(acc);
#endif
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef ADAPT_VW
  const vf vp = vset1(p);
  for (; i + VW <= n; i += VW) vstoreu(y + i, vfma(vp, vloadu(x + i), vloadu(y + i)));
#endif
  for (; i < n; ++i) y[i] += p * x[i];
}

int64_t idx(const torch::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kInt ? t.data_ptr<int32_t>()[i] : t.data_ptr<int64_t>()[i];
}

// rows per parallel chunk so that a chunk holds at least ~32K elements (smaller work runs on one thread)
int64_t grain(int64_t cols) { return std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, cols)); }

template <typename F>
void float_or_bf16(const torch::Tensor& x, const char* what, F&& f) {
  if (x.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, what, ": dtype must be float32 or bfloat16");
    f(bf16{});
  }
}

// float32, bfloat16 or (where the vector layer converts it) float16: the panel GEMMs' element types
template <typename F>
void float_bf16_or_half(const torch::Tensor& x, const char* what, F&& f) {
#ifdef ADAPT_HALF
  if (x.scalar_type() == at::kHalf) return f(half{});
#endif
  float_or_bf16(x, what, f);
}


}  // namespace adapt_cpu
