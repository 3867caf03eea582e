// Paged decode attention, the paged KV-cache write, and GQA's q / k norm + rope + cache write in one call.
#pragma once

#include "common.h"
#include "elementwise.h"

namespace adapt_cpu {

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
// GQA's step between the qkv projection and attention, in one call: of qkv [T, (H + 2 Hkv) D] (rows
// contiguous), q = rope(rms_norm(q_raw, qw)) [T, H, D] and k = rope(rms_norm(k_raw, kw)) [T, Hkv, D]
// (each norm only when its weight is given; rotate_half rope over the whole head by cos / sin [T, D]),
// then k and v written to slots [T] of k_cache / v_cache [NB, BS, Hkv, D] when the caches are given
// (negative slots skipped). Each step is the row function of rms_norm, rope_rotate_half and write_kv, in
// their order, so the results equal those three calls bitwise.
std::vector<torch::Tensor> qk_norm_rope(torch::Tensor qkv, int64_t H, int64_t Hkv, c10::optional<torch::Tensor> qw,
                                        c10::optional<torch::Tensor> kw, double eps, torch::Tensor cos,
                                        torch::Tensor sin, c10::optional<torch::Tensor> k_cache,
                                        c10::optional<torch::Tensor> v_cache, c10::optional<torch::Tensor> slots) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && H > 0 && Hkv > 0 && qkv.size(1) % (H + 2 * Hkv) == 0,
              "qk_norm_rope: qkv [T, (H + 2 Hkv) D] with unit last stride");
  const int64_t T_ = qkv.size(0), D = qkv.size(1) / (H + 2 * Hkv), half = D / 2, W = qkv.stride(0);
  TORCH_CHECK(D % 2 == 0, "qk_norm_rope: even head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type() && cos.dim() == 2 && cos.size(0) == T_ &&
                  cos.size(1) == D && sin.sizes() == cos.sizes(), "qk_norm_rope: cos / sin [T, D] of qkv's dtype");
  for (const auto* w : {&qw, &kw})
    TORCH_CHECK(!w->has_value() || ((*w)->is_contiguous() && (*w)->scalar_type() == qkv.scalar_type() &&
                                    (*w)->numel() == D), "qk_norm_rope: norm weights [D] of qkv's dtype");
  const bool write = k_cache.has_value();
  TORCH_CHECK(write == v_cache.has_value() && write == slots.has_value(),
              "qk_norm_rope: k_cache, v_cache and slots come together");
  if (write)
    TORCH_CHECK(k_cache->dim() == 4 && v_cache->dim() == 4 && k_cache->stride(3) == 1 && v_cache->stride(3) == 1 &&
                    k_cache->scalar_type() == qkv.scalar_type() && v_cache->scalar_type() == qkv.scalar_type() &&
                    k_cache->size(2) == Hkv && v_cache->size(2) == Hkv && k_cache->size(3) == D &&
                    v_cache->size(3) == D && slots->scalar_type() == at::kLong && slots->is_contiguous() &&
                    slots->numel() == T_,
                "qk_norm_rope: caches [NB, BS, Hkv, D] of qkv's dtype and int64 slots [T]");
  auto q = torch::empty({T_, H, D}, qkv.options()), k = torch::empty({T_, Hkv, D}, qkv.options());
  if (write) {
    const int64_t cap = k_cache->size(0) * k_cache->size(1);
    const int64_t* sp = slots->data_ptr<int64_t>();
    for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(sp[t] < cap, "qk_norm_rope: slot ", sp[t], " outside the cache");
  }
  float_or_bf16(qkv, "qk_norm_rope", [&](auto t) {
    using T = decltype(t);
    const T* xp = qkv.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    const T* qwp = qw.has_value() ? qw->data_ptr<T>() : nullptr;
    const T* kwp = kw.has_value() ? kw->data_ptr<T>() : nullptr;
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    const int64_t R = H + Hkv;  // q and k heads of a token
    at::parallel_for(0, T_ * R, grain(4 * D), [&](int64_t r0, int64_t r1) {
      std::vector<float> h(D);
      std::vector<T> normed(D);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t tok = r / R, hd = r % R;
        const bool is_q = hd < H;
        const T* w = is_q ? qwp : kwp;
        const T* src = xp + tok * W + hd * D;
        T* o = is_q ? qp + (tok * H + hd) * D : kp + (tok * Hkv + hd - H) * D;
        if (w) {
          row_to_f32(src, h.data(), D);
          norm_row(h.data(), w, normed.data(), D, static_cast<float>(eps));
          src = normed.data();
        }
        rope_row(src, cp + tok * D, sp + tok * D, o, half);
      }
    });
    if (write) {
      const int64_t BS = k_cache->size(1);
      std::array<int64_t, 3> ks{k_cache->stride(0), k_cache->stride(1), k_cache->stride(2)};
      std::array<int64_t, 3> vs{v_cache->stride(0), v_cache->stride(1), v_cache->stride(2)};
      const int64_t* sl = slots->data_ptr<int64_t>();
      write_rows<T>(kp, Hkv * D, D, k_cache->data_ptr<T>(), ks, BS, Hkv, D, sl, T_);
      write_rows<T>(xp + R * D, W, D, v_cache->data_ptr<T>(), vs, BS, Hkv, D, sl, T_);
    }
  });
  return {q, k};
}


}  // namespace adapt_cpu
