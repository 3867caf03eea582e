// Fused CPU kernels of the adapt runtime (built at first use by adapt/runtime/kernels/cpu_ext.py).
//
// Legend: T rows (tokens), H hidden size, B sequences, Hq / Hkv query / kv heads, G = Hq / Hkv,
// D / Dv key / value head dims, BS tokens per cache block, MAXB block-table width, I intermediate size.
//
// Each kernel does in one pass what the torch form of the same kernel does in several ops (and as many
// passes over memory); the torch form stays the fallback and the twins stay the oracle. Element types:
// float32 and bfloat16 (int8 too for the KV cache). Built with -ffp-contract=off, so that a * b + c rounds
// as torch's separate multiply and add do; the one FMA is the attention's dot product (explicit).
// bfloat16 arithmetic rounds to bfloat16 after every op the torch form rounds after, so that
// silu_and_mul and rope are bitwise equal to it (tested); reductions (RMSNorm's mean, attention) sum in
// float32 in their own order.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

inline float f32(float x) { return x; }
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
#endif

#ifdef ADAPT_VW
template <typename T> inline vf vrnd(vf v);
template <> inline vf vrnd<float>(vf v) { return v; }
template <> inline vf vrnd<bf16>(vf v) { return bf16_as_f32(bf16_bitsv(v)); }
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

// ---------------------------------------------------------------------------------------------------
// Decode attention over the paged cache: one task per (sequence, kv head), its G query heads together.
// a cache row as float32: the row itself when it already is (and unscaled), else converted into buf
template <typename C> inline const float* row_view(const C* src, float* buf, int64_t n, float s) {
  row_f32(src, buf, n, s);
  return buf;
}
template <> inline const float* row_view<float>(const float* src, float* buf, int64_t n, float s) {
  if (s == 1.f) return src;
  row_f32(src, buf, n, s);
  return buf;
}

// One task per sequence and range of kv heads (all of them when there are enough sequences to keep every
// thread busy, so that a task reads each cache block's rows in address order), the G query heads of a
// kv head together: scores, softmax, then the weighted sum of the value rows, all in float32.
template <typename Q, typename C>
void decode_impl(const Q* q, std::array<int64_t, 2> qst, const C* kc, const C* vc, const torch::Tensor& tables,
                 const torch::Tensor& lens, const float* ksc, const float* vsc, Q* out, int64_t B, int64_t Hq,
                 int64_t Hkv, int64_t D, int64_t Dv, int64_t BS, std::array<int64_t, 3> kst,
                 std::array<int64_t, 3> vst, float scale, int64_t window) {
  const int64_t G = Hq / Hkv, MAXB = tables.size(1);
  const bool t32 = tables.scalar_type() == at::kInt;
  const int32_t* tab32 = t32 ? tables.data_ptr<int32_t>() : nullptr;
  const int64_t* tab64 = t32 ? nullptr : tables.data_ptr<int64_t>();
  std::vector<int64_t> len(B);
  for (int64_t b = 0; b < B; ++b) len[b] = idx(lens, b);
  const int64_t per = B >= 2 * at::get_num_threads() ? Hkv : 1;  // kv heads per task
  const int64_t groups = (Hkv + per - 1) / per;
  at::parallel_for(0, B * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(per * G * D), row(std::max(D, Dv)), acc(per * G * Dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / groups, h0 = (task % groups) * per, h1 = std::min(Hkv, h0 + per), nh = h1 - h0;
      const int64_t first = window > 0 ? std::max<int64_t>(0, len[b] - window) : 0;
      const int64_t n = len[b] - first;
      Q* o = out + (b * Hq + h0 * G) * Dv;
      if (n <= 0) {  // no key: zeros by contract
        for (int64_t i = 0; i < nh * G * Dv; ++i) o[i] = from_f32<Q>(0.f);
        continue;
      }
      for (int64_t r = 0; r < nh * G; ++r)
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = f32(q[b * qst[0] + (h0 * G + r) * qst[1] + d]);
      scores.resize(nh * G * n);
      // every key j of the window and kv head of the task: its cache row as float32
      auto walk = [&](const C* cache, const std::array<int64_t, 3>& st, const float* sc, int64_t width, auto&& fn) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t pos = first + j, e = b * MAXB + pos / BS;
          const int64_t blk = t32 ? tab32[e] : tab64[e], off = pos % BS;
          for (int64_t h = h0; h < h1; ++h) {
            const float s = sc ? sc[(blk * BS + off) * Hkv + h] : 1.f;
            fn(j, h - h0, row_view(cache + blk * st[0] + off * st[1] + h * st[2], row.data(), width, s));
          }
        }
      };
      walk(kc, kst, ksc, D, [&](int64_t j, int64_t hh, const float* k) {
        for (int64_t r = hh * G; r < (hh + 1) * G; ++r) scores[r * n + j] = dot(qf.data() + r * D, k, D) * scale;
      });
      for (int64_t r = 0; r < nh * G; ++r) {
        float* sg = scores.data() + r * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) m = std::max(m, sg[j]);
        int64_t j0 = 0;
#ifdef ADAPT_VW
        for (; j0 + VW <= n; j0 += VW)
          vstoreu(sg + j0, vexp(vsub(vloadu(sg + j0), vset1(m))));
#endif
        for (int64_t j = j0; j < n; ++j) sg[j] = exp_f32(sg[j] - m);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) sum += sg[j];
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
      }
      std::fill(acc.begin(), acc.begin() + nh * G * Dv, 0.f);
      walk(vc, vst, vsc, Dv, [&](int64_t j, int64_t hh, const float* v) {
        for (int64_t r = hh * G; r < (hh + 1) * G; ++r) axpy(scores[r * n + j], v, acc.data() + r * Dv, Dv);
      });
      for (int64_t i = 0; i < nh * G * Dv; ++i) o[i] = from_f32<Q>(acc[i]);
    }
  });
}

template <typename Q>
void decode_q(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& tables,
              const torch::Tensor& lens, const float* ks, const float* vs, torch::Tensor& out, float scale,
              int64_t window) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), BS = k.size(1), Hkv = k.size(2), Dv = v.size(3);
  std::array<int64_t, 3> kst{k.stride(0), k.stride(1), k.stride(2)}, vst{v.stride(0), v.stride(1), v.stride(2)};
  std::array<int64_t, 2> qst{q.stride(0), q.stride(1)};
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  switch (k.scalar_type()) {
    case at::kFloat:
      decode_impl<Q, float>(qp, qst, k.data_ptr<float>(), v.data_ptr<float>(), tables, lens, ks, vs, op, B, Hq, Hkv,
                        D, Dv, BS, kst, vst, scale, window);
      break;
    case at::kBFloat16:
      decode_impl<Q, bf16>(qp, qst, k.data_ptr<bf16>(), v.data_ptr<bf16>(), tables, lens, ks, vs, op, B, Hq, Hkv,
                        D, Dv, BS, kst, vst, scale, window);
      break;
    case at::kChar:
      decode_impl<Q, int8_t>(qp, qst, k.data_ptr<int8_t>(), v.data_ptr<int8_t>(), tables, lens, ks, vs, op, B, Hq, Hkv,
                        D, Dv, BS, kst, vst, scale, window);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: cache dtype must be float32, bfloat16 or int8");
  }
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, double scale, c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode: q must be [B, Hq, D] with unit last stride");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_decode: cache rows must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "paged_decode: head shapes");
  TORCH_CHECK(tables.dim() == 2 && tables.is_contiguous() && lens.is_contiguous() &&
                  (tables.scalar_type() == at::kInt || tables.scalar_type() == at::kLong) &&
                  (lens.scalar_type() == at::kInt || lens.scalar_type() == at::kLong),
              "paged_decode: block tables / seq_lens must be contiguous int32 or int64");
  const float* ks = nullptr;
  const float* vs = nullptr;
  if (k_scale.has_value()) {
    TORCH_CHECK(k_scale->is_contiguous() && k_scale->scalar_type() == at::kFloat &&
                    k_scale->numel() == k_cache.size(0) * k_cache.size(1) * k_cache.size(2),
                "paged_decode: k_scale must be contiguous float32 [NB, BS, Hkv]");
    ks = k_scale->data_ptr<float>();
  }
  if (v_scale.has_value()) {
    TORCH_CHECK(v_scale->is_contiguous() && v_scale->scalar_type() == at::kFloat &&
                    v_scale->numel() == v_cache.size(0) * v_cache.size(1) * v_cache.size(2),
                "paged_decode: v_scale must be contiguous float32 [NB, BS, Hkv]");
    vs = v_scale->data_ptr<float>();
  }
  // every block a sequence reads (its window's) must be in the table and in the cache (rows are read in place)
  TORCH_CHECK(lens.numel() == q.size(0) && tables.size(0) == q.size(0), "paged_decode: one table row per sequence");
  const int64_t BS = k_cache.size(1), NB = std::min(k_cache.size(0), v_cache.size(0));
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t n = idx(lens, b);
    TORCH_CHECK(n >= 0 && n <= tables.size(1) * BS, "paged_decode: seq_len ", n, " exceeds its block table");
    for (int64_t j = window > 0 ? std::max<int64_t>(0, n - window) / BS : 0; j < (n + BS - 1) / BS; ++j) {
      const int64_t blk = idx(tables, b * tables.size(1) + j);
      TORCH_CHECK(blk >= 0 && blk < NB, "paged_decode: block ", blk, " outside the cache");
    }
  }
  auto out = torch::empty({q.size(0), q.size(1), v_cache.size(3)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    decode_q<float>(q, k_cache, v_cache, tables, lens, ks, vs, out, static_cast<float>(scale), window);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_decode: q must be float32 or bfloat16");
    decode_q<bf16>(q, k_cache, v_cache, tables, lens, ks, vs, out, static_cast<float>(scale), window);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm (transformers' LlamaRMSNorm): h = float(x); h *= 1 / sqrt(mean(h^2) + eps); out = w * T(h).
// With a residual: x = T(x + residual) first, and that sum is returned too.
template <typename T>
void norm_rows(const T* x, const T* res, const T* w, T* out, T* new_res, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, grain(H), [&](int64_t r0, int64_t r1) {
    std::vector<float> h(H);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      if (res) {
        const T* rr = res + r * H;
        T* nr = new_res + r * H;
        int64_t i = 0;
#ifdef ADAPT_VW
        for (; i + VW <= H; i += VW) {
          const vf v = vrnd<T>(vadd(vload(rr + i), vload(xr + i)));
          vstore(nr + i, v);
          vstoreu(h.data() + i, v);
        }
#endif
        for (; i < H; ++i) {
          nr[i] = from_f32<T>(f32(rr[i]) + f32(xr[i]));
          h[i] = f32(nr[i]);
        }
      } else {
        int64_t i = 0;
#ifdef ADAPT_VW
        for (; i + VW <= H; i += VW) vstoreu(h.data() + i, vload(xr + i));
#endif
        for (; i < H; ++i) h[i] = f32(xr[i]);
      }
      float part[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= H; i += 16)  // 16 independent partial sums: vectorizes without reassociation
        for (int l = 0; l < 16; ++l) part[l] += h[i + l] * h[i + l];
      float ss = 0.f;
      for (int l = 0; l < 16; ++l) ss += part[l];
      for (; i < H; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = out + r * H;
      int64_t k = 0;
#ifdef ADAPT_VW
      const vf vinv = vset1(inv);
      for (; k + VW <= H; k += VW)
        vstore(o + k, vmul(vload(w + k), vrnd<T>(vmul(vloadu(h.data() + k), vinv))));
#endif
      for (; k < H; ++k) o[k] = from_f32<T>(f32(w[k]) * rnd<T>(h[k] * inv));
    }
  });
}

template <typename F>
void float_or_bf16(const torch::Tensor& x, const char* what, F&& f) {
  if (x.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, what, ": dtype must be float32 or bfloat16");
    f(bf16{});
  }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.scalar_type() == x.scalar_type() &&
                  w.numel() == x.size(-1), "rms_norm: contiguous x [..., H] and weight [H] of x's dtype");
  auto out = torch::empty_like(x);
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  float_or_bf16(x, "rms_norm", [&](auto t) {
    using T = decltype(t);
    norm_rows<T>(x.data_ptr<T>(), nullptr, w.data_ptr<T>(), out.data_ptr<T>(), nullptr, rows, H, (float)eps);
  });
  return out;
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && w.is_contiguous() && x.sizes() == residual.sizes() &&
                  residual.scalar_type() == x.scalar_type() && w.scalar_type() == x.scalar_type() &&
                  w.numel() == x.size(-1), "add_rms_norm: contiguous x, residual [..., H] and weight [H], one dtype");
  auto out = torch::empty_like(x), new_res = torch::empty_like(x);
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  float_or_bf16(x, "add_rms_norm", [&](auto t) {
    using T = decltype(t);
    norm_rows<T>(x.data_ptr<T>(), residual.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(), new_res.data_ptr<T>(),
                 rows, H, (float)eps);
  });
  return {out, new_res};
}

// ---------------------------------------------------------------------------------------------------
// silu(gate) * up of x [..., 2I] = cat(gate, up): silu rounds to T, then the product does.
// With counts [E] and C (the padded MoE layout, rows e * C + j), only rows j < counts[e] are computed and
// the padding rows are zeros.
torch::Tensor silu_and_mul(torch::Tensor x, c10::optional<torch::Tensor> counts, int64_t C) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "silu_and_mul: contiguous x [..., 2I]");
  const int64_t I = x.size(-1) / 2, rows = I ? x.numel() / (2 * I) : 0;
  const int64_t* cnt = nullptr;
  if (counts.has_value()) {
    TORCH_CHECK(counts->scalar_type() == at::kLong && counts->is_contiguous() && C > 0 && counts->numel() * C == rows,
                "silu_and_mul: int64 counts [E] with E * C rows");
    cnt = counts->data_ptr<int64_t>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, x.options());
  float_or_bf16(x, "silu_and_mul", [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    // exp and a division per element: worth a second thread from ~8K elements
    at::parallel_for(0, rows, std::max<int64_t>(1, (8 << 10) / std::max<int64_t>(1, I)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* g = xp + r * 2 * I;
        const T* u = g + I;
        T* o = op + r * I;
        if (cnt && r % C >= cnt[r / C]) {  // a padding row
          std::memset(static_cast<void*>(o), 0, I * sizeof(T));
          continue;
        }
        int64_t i = 0;
#ifdef ADAPT_VW
        const vf one = vset1(1.f), zero = vzero();
        for (; i + VW <= I; i += VW) {
          const vf a = vload(g + i);
          const vf s = vrnd<T>(vdiv(a, vadd(one, vexp(vsub(zero, a)))));
          vstore(o + i, vmul(s, vload(u + i)));
        }
#endif
        for (; i < I; ++i) {
          const float a = f32(g[i]);
          o[i] = from_f32<T>(rnd<T>(a / (1.f + exp_f32(-a))) * f32(u[i]));
        }
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------
// rotate_half RoPE of x [T, H, D] (any row strides, unit last stride) by cos / sin [T, D]:
// out = T(T(x * cos) + T(rotate_half(x) * sin)), as torch's three ops round; out is contiguous.
torch::Tensor rope_rotate_half(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rope: x [T, H, D] with unit last stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(), "rope: cos / sin [T, D] of x's dtype");
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  auto out = torch::empty({T_, H, D}, x.options());
  float_or_bf16(x, "rope", [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, T_ * H, grain(D), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t tok = r / H, hd = r % H;
        const T* xr = xp + tok * s0 + hd * s1;
        const T* c = cp + tok * D;
        const T* s = sp + tok * D;
        T* o = op + r * D;
        int64_t i = 0;
#ifdef ADAPT_VW
        for (; i + VW <= half; i += VW) {
          const vf x1 = vload(xr + i), x2 = vload(xr + i + half);
          const vf nx2 = vsub(vzero(), x2);
          vstore(o + i, vadd(vrnd<T>(vmul(x1, vload(c + i))),
                                       vrnd<T>(vmul(nx2, vload(s + i)))));
          vstore(o + i + half, vadd(vrnd<T>(vmul(x2, vload(c + i + half))),
                                              vrnd<T>(vmul(x1, vload(s + i + half)))));
        }
#endif
        for (; i < half; ++i) {
          const float x1 = f32(xr[i]), x2 = f32(xr[i + half]);
          o[i] = from_f32<T>(rnd<T>(x1 * f32(c[i])) + rnd<T>(-x2 * f32(s[i])));
          o[i + half] = from_f32<T>(rnd<T>(x2 * f32(c[i + half])) + rnd<T>(x1 * f32(s[i + half])));
        }
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------
// The paged cache write of one step: row t of k [T, Hkv, D] and v [T, Hkv, Dv] (any token stride, unit
// head-row stride) to slot slots[t] = block * BS + offset of k_cache / v_cache [NB, BS, Hkv, D]; negative
// slots are skipped. Same-dtype float caches only (int8 quantizes in torch).
template <typename T>
void write_rows(const T* x, int64_t xs0, int64_t xs1, T* cache, std::array<int64_t, 3> cs, int64_t BS, int64_t H,
                int64_t D, const int64_t* slots, int64_t n) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    T* dst = cache + (slot / BS) * cs[0] + (slot % BS) * cs[1];
    for (int64_t h = 0; h < H; ++h) std::memcpy(dst + h * cs[2], x + t * xs0 + h * xs1, D * sizeof(T));
  }
}

void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1 && k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == v_cache.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3) && v.size(2) == v_cache.size(3) &&
                  slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "write_kv: k, v [T, Hkv, D] and caches [NB, BS, Hkv, D] of one dtype, int64 slots [T]");
  const int64_t n = slots.numel(), BS = k_cache.size(1), cap = k_cache.size(0) * BS;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(sp[t] < cap, "write_kv: slot ", sp[t], " outside the cache");
  std::array<int64_t, 3> ks{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  std::array<int64_t, 3> vs{v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  float_or_bf16(k, "write_kv", [&](auto t) {
    using T = decltype(t);
    write_rows<T>(k.data_ptr<T>(), k.stride(0), k.stride(1), k_cache.data_ptr<T>(), ks, BS, k.size(1), k.size(2), sp, n);
    write_rows<T>(v.data_ptr<T>(), v.stride(0), v.stride(1), v_cache.data_ptr<T>(), vs, BS, v.size(1), v.size(2), sp, n);
  });
}

// ---------------------------------------------------------------------------------------------------
// MoE: the padded layout of the routed tokens and the weighted combine.
// Slots s = t * K + k sorted by expert (``order`` [S], ``counts`` [E] per expert, every slot served);
// expert e's rows are e * C .. e * C + counts[e] - 1 of the padded [E * C, H] input, the rest zeros.
// Returns (xp [E * C, H], pos [S]: the padded row of slot s).
std::vector<torch::Tensor> moe_pad_gather(torch::Tensor x, torch::Tensor order, torch::Tensor counts, int64_t K,
                                          int64_t C) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && order.scalar_type() == at::kLong && order.is_contiguous() &&
                  counts.scalar_type() == at::kLong && counts.is_contiguous(),
              "moe_pad_gather: contiguous x [T, H], int64 order [S] and counts [E]");
  const int64_t E = counts.numel(), S = order.numel(), H = x.size(1), T = x.size(0);
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t* cnt = counts.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(cnt[e] >= 0 && cnt[e] <= C, "moe_pad_gather: an expert has more rows than C");
    total += cnt[e];
  }
  TORCH_CHECK(total == S && S == T * K, "moe_pad_gather: counts must cover every slot");
  auto xp = torch::empty({E * C, H}, x.options());
  auto pos = torch::empty({S}, order.options());
  int64_t* pp = pos.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + cnt[e];
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < cnt[e]; ++j) {
      const int64_t slot = ord[start[e] + j];
      TORCH_CHECK(slot >= 0 && slot < S, "moe_pad_gather: slot out of range");
      pp[slot] = e * C + j;
    }
  const int64_t bytes = H * x.element_size();
  const char* xs = static_cast<const char*>(x.data_ptr());
  char* xd = static_cast<char*>(xp.data_ptr());
  at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      for (int64_t j = 0; j < cnt[e]; ++j)
        std::memcpy(xd + (e * C + j) * bytes, xs + (ord[start[e] + j] / K) * bytes, bytes);
      std::memset(xd + (e * C + cnt[e]) * bytes, 0, (C - cnt[e]) * bytes);
    }
  });
  return {xp, pos};
}

// out[t] = sum_k w[t, k] * ys[pos[t * K + k]], summed in float32 in k order, rounded once to ys' dtype.
torch::Tensor moe_combine(torch::Tensor ys, torch::Tensor pos, torch::Tensor w) {
  TORCH_CHECK(ys.dim() == 2 && ys.is_contiguous() && pos.scalar_type() == at::kLong && pos.is_contiguous() &&
                  w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && pos.numel() == w.numel(),
              "moe_combine: contiguous ys [R, H], int64 pos [T * K], float32 weights [T, K]");
  const int64_t T = w.size(0), K = w.size(1), H = ys.size(1), R = ys.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * K; ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < R, "moe_combine: row out of range");
  auto out = torch::empty({T, H}, ys.options());
  const float* wp = w.data_ptr<float>();
  float_or_bf16(ys, "moe_combine", [&](auto tag) {
    using X = decltype(tag);
    const X* yp = ys.data_ptr<X>();
    X* op = out.data_ptr<X>();
    at::parallel_for(0, T, grain(H * K), [&](int64_t t0, int64_t t1) {
      std::vector<float> acc(H);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t k = 0; k < K; ++k) {
          const X* row = yp + pp[t * K + k] * H;
          const float wk = wp[t * K + k];
          int64_t i = 0;
#ifdef ADAPT_VW
          const vf vw = vset1(wk);
          for (; i + VW <= H; i += VW)
            vstoreu(acc.data() + i, vadd(vloadu(acc.data() + i),
                                                           vmul(vw, vload(row + i))));
#endif
          for (; i < H; ++i) acc[i] += wk * f32(row[i]);
        }
        X* o = op + t * H;
        int64_t i = 0;
#ifdef ADAPT_VW
        for (; i + VW <= H; i += VW) vstore(o + i, vloadu(acc.data() + i));
#endif
        for (; i < H; ++i) o[i] = from_f32<X>(acc[i]);
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if ADAPT_VW == 16
  m.attr("VECTOR") = "avx512";
#elif ADAPT_VW == 8
  m.attr("VECTOR") = "avx2";
#else
  m.attr("VECTOR") = "none";  // the scalar loops: exp-heavy kernels lose to torch's vectorized ones
#endif
  m.def("paged_decode", &paged_decode);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul, pybind11::arg("x"), pybind11::arg("counts") = pybind11::none(),
        pybind11::arg("C") = 0);
  m.def("rope_rotate_half", &rope_rotate_half);
  m.def("write_kv", &write_kv);
  m.def("moe_pad_gather", &moe_pad_gather);
  m.def("moe_combine", &moe_combine);
}
