// RMSNorm, add + RMSNorm, SiLU-and-mul, rotate-half RoPE.
#pragma once

#include "common.h"

namespace adapt_cpu {

// ---------------------------------------------------------------------------------------------------
// One normalized row: o = w * T(h * inv) with inv = 1 / sqrt(mean(h^2) + eps), h the row in float32.
template <typename T>
inline void norm_row(const float* h, const T* w, T* o, int64_t H, float eps) {
  float part[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= H; i += 16)  // 16 independent partial sums: vectorizes without reassociation
    for (int l = 0; l < 16; ++l) part[l] += h[i + l] * h[i + l];
  float ss = 0.f;
  for (int l = 0; l < 16; ++l) ss += part[l];
  for (; i < H; ++i) ss += h[i] * h[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  int64_t k = 0;
#ifdef ADAPT_VW
  const vf vinv = vset1(inv);
  for (; k + VW <= H; k += VW) vstore(o + k, vmul(vload(w + k), vrnd<T>(vmul(vloadu(h + k), vinv))));
#endif
  for (; k < H; ++k) o[k] = from_f32<T>(f32(w[k]) * rnd<T>(h[k] * inv));
}

// a row of T as float32 into h [n]
template <typename T>
inline void row_to_f32(const T* x, float* h, int64_t n) {
  int64_t i = 0;
#ifdef ADAPT_VW
  for (; i + VW <= n; i += VW) vstoreu(h + i, vload(x + i));
#endif
  for (; i < n; ++i) h[i] = f32(x[i]);
}

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
        row_to_f32(xr, h.data(), H);
      }
      norm_row(h.data(), w, out + r * H, H, eps);
    }
  });
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
// o [I] = silu(gate) * up of one row gu [2I] = cat(gate, up): silu rounds to T, then the product does
template <typename T>
inline void silu_mul_row(const T* gu, int64_t I, T* o) {
  const T* u = gu + I;
  int64_t i = 0;
#ifdef ADAPT_VW
  const vf one = vset1(1.f), zero = vzero();
  for (; i + VW <= I; i += VW) {
    const vf a = vload(gu + i);
    const vf s = vrnd<T>(vdiv(a, vadd(one, vexp(vsub(zero, a)))));
    vstore(o + i, vmul(s, vload(u + i)));
  }
#endif
  for (; i < I; ++i) {
    const float a = f32(gu[i]);
    o[i] = from_f32<T>(rnd<T>(a / (1.f + exp_f32(-a))) * f32(u[i]));
  }
}

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
        T* o = op + r * I;
        if (cnt && r % C >= cnt[r / C]) {  // a padding row
          std::memset(static_cast<void*>(o), 0, I * sizeof(T));
          continue;
        }
        silu_mul_row(xp + r * 2 * I, I, o);
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------
// One rotate_half RoPE row of x [2 half] by cos / sin [2 half]:
// o = T(T(x * cos) + T(rotate_half(x) * sin)), as torch's three ops round.
template <typename T>
inline void rope_row(const T* xr, const T* c, const T* s, T* o, int64_t half) {
  int64_t i = 0;
#ifdef ADAPT_VW
  for (; i + VW <= half; i += VW) {
    const vf x1 = vload(xr + i), x2 = vload(xr + i + half);
    const vf nx2 = vsub(vzero(), x2);
    vstore(o + i, vadd(vrnd<T>(vmul(x1, vload(c + i))), vrnd<T>(vmul(nx2, vload(s + i)))));
    vstore(o + i + half, vadd(vrnd<T>(vmul(x2, vload(c + i + half))), vrnd<T>(vmul(x1, vload(s + i + half)))));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = f32(xr[i]), x2 = f32(xr[i + half]);
    o[i] = from_f32<T>(rnd<T>(x1 * f32(c[i])) + rnd<T>(-x2 * f32(s[i])));
    o[i + half] = from_f32<T>(rnd<T>(x2 * f32(c[i + half])) + rnd<T>(x1 * f32(s[i + half])));
  }
}

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
        rope_row(xr, c, s, o, half);
      }
    });
  });
  return out;
}


// ---------------------------------------------------------------------------------------------------
// The index of each row's maximum of x [B, V] float32, as torch.max(dim=-1).indices: the first maximal
// index, and the first NaN's where a row has one. One pass for the maximum (16 partial maxima, a NaN flag),
// a second that stops at its first occurrence.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax_rows: contiguous float32 x [B, V] with V > 0");
  const int64_t B = x.size(0), V = x.size(1);
  auto out = torch::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, grain(V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * V;
      float part[16];
      int nan[16];
      for (int l = 0; l < 16; ++l) part[l] = row[0], nan[l] = 0;
      int64_t i = 0;
      for (; i + 16 <= V; i += 16)
        for (int l = 0; l < 16; ++l) {
          const float v = row[i + l];
          part[l] = part[l] < v ? v : part[l];
          nan[l] |= v != v;
        }
      float m = part[0];
      int any = 0;
      for (int l = 0; l < 16; ++l) m = m < part[l] ? part[l] : m, any |= nan[l];
      for (; i < V; ++i) m = m < row[i] ? row[i] : m, any |= row[i] != row[i];
      int64_t j = 0;
      if (any) {
        while (row[j] == row[j]) ++j;
      } else {
        while (row[j] != m) ++j;
      }
      op[r] = j;
    }
  });
  return out;
}


}  // namespace adapt_cpu
