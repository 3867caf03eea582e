// Quantized MoE decode: the routed experts of a few tokens on experts held quantized, in one call
// (kernels/quant_linear.py's quant_moe; runtime/quant/experts.py).
//
// Legend: T tokens, H hidden size, I expert intermediate size, K top-k, E local experts, R slots served here.
// gate|up q1 [E, 2I, *] (gate rows, then up rows) and down q2 [E, H, *], each with its scales and zero points
// stacked over the experts, one matrix each as quant_linear takes it (quant_gemm.h). The slots are grouped by
// expert (group_slots), each expert's rows taken QMR at a time (QRows), and the (chunk, block of W) pairs of a
// projection shared by the threads in one pass (decode_blocks): the routed experts' weight bytes stream from
// memory once a projection, with no torch op between (the per-expert form ran ~15 torch ops and two quantized
// linears per routed expert). Rounding as that form: gate|up rounded to x's dtype, T(silu(gate)) * up rounded,
// down rounded, the weighted combine summed in float32 in k order and rounded once; bitwise equal to it where
// no expert has more than QMR rows (beyond, the per-expert linear takes its buffered path, another sum order).
#pragma once

#include "common.h"
#include "elementwise.h"
#include "moe.h"
#include "moe_gemm.h"
#include "quant_gemm.h"

namespace adapt_cpu {

#ifdef ADAPT_VW
// one projection of every expert: q [E, N, *] bytes, s [E, ceil(N / RB), ceil(K / BK)], z [E, N, ceil(K / BK)]
inline QMat qmoe_matrix(const torch::Tensor& q, const torch::Tensor& s, const c10::optional<torch::Tensor>& z,
                        int64_t kind, int64_t K, int64_t RB, int64_t BK, const char* what) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.element_size() == 1 &&
                  (kind == 2 ? q.size(2) * 2 >= K : q.size(2) == K) && RB > 0 && BK > 0,
              "quant_moe: ", what, " q must be contiguous bytes [E, N, K] (int4: [E, N, >= K / 2])");
  const int64_t E = q.size(0), N = q.size(1), G = (K + BK - 1) / BK;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 3 && s.size(0) == E &&
                  s.size(1) == (N + RB - 1) / RB && s.size(2) == G,
              "quant_moe: ", what, " scale must be contiguous float32 [E, ceil(N / RB), ceil(K / BK)]");
  const int8_t* zp = nullptr;
  if (z.has_value() && z->defined()) {
    TORCH_CHECK(kind == 2 && z->scalar_type() == at::kChar && z->is_contiguous() && z->dim() == 3 &&
                    z->size(0) == E && z->size(1) == N && z->size(2) == G,
                "quant_moe: ", what, " zero points are int8 [E, N, ceil(K / BK)], int4 only");
    zp = z->data_ptr<int8_t>();
  }
  return QMat{static_cast<const uint8_t*>(q.data_ptr()), s.data_ptr<float>(), zp, N, q.size(2), RB, G};
}
#endif

// whether quant_moe runs these experts here (gate|up [2I, H] in groups of bk1, down [H, I] in groups of bk2)
// (act 1: the experts' inputs quantized to int8 per row, quant_dot_a8.h)
inline bool quant_moe_takes(int64_t kind, int64_t H, int64_t I, int64_t bk1, int64_t bk2, bool bf16_x, int64_t act) {
  return decode_path(kind, H, bk1, bf16_x, act == 1) > 0 && decode_path(kind, I, bk2, bf16_x, act == 1) > 0;
}

// out [T, H] (x's dtype) = sum over the local k of w[t, k] * down(silu(gate x[t]) * up x[t]) of expert
// ids[t, k] - offset; x float32 or bfloat16
torch::Tensor quant_moe(torch::Tensor x, torch::Tensor ids, torch::Tensor w, torch::Tensor q1, torch::Tensor s1,
                        c10::optional<torch::Tensor> z1, torch::Tensor q2, torch::Tensor s2,
                        c10::optional<torch::Tensor> z2, int64_t kind, int64_t rb1, int64_t bk1, int64_t rb2,
                        int64_t bk2, int64_t offset, int64_t act) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && ids.dim() == 2 && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous() && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.sizes() == ids.sizes() && ids.size(0) == x.size(0) && kind >= 0 && kind <= 2,
              "quant_moe: contiguous x [T, H], int64 ids [T, K] and float32 weights [T, K], kind 0..2");
  const int64_t T = x.size(0), H = x.size(1), K = ids.size(1);
  auto out = torch::empty({T, H}, x.options());
#ifdef ADAPT_VW
  const QMat w1 = qmoe_matrix(q1, s1, z1, kind, H, rb1, bk1, "gate|up");
  const int64_t E = q1.size(0), I = w1.N / 2;
  TORCH_CHECK(w1.N % 2 == 0 && q2.dim() == 3 && q2.size(0) == E && q2.size(1) == H,
              "quant_moe: gate|up [E, 2I, H] and down [E, H, I] for x [T, H]");
  const QMat w2 = qmoe_matrix(q2, s2, z2, kind, I, rb2, bk2, "down");
  const bool bf = x.scalar_type() == at::kBFloat16;
  const int p1 = decode_path(kind, H, bk1, bf, act == 1), p2 = decode_path(kind, I, bk2, bf, act == 1);
  TORCH_CHECK(p1 > 0 && p2 > 0, "quant_moe: no decode kernel takes these weights here (quant_moe_takes)");
  const SlotGroups g = group_slots(ids.data_ptr<int64_t>(), T * K, E, offset);
  const int64_t R = g.start[E];
  std::vector<QRows> chunks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r0 = g.start[e]; r0 < g.start[e + 1]; r0 += QMR) chunks.push_back({e, r0, std::min<int64_t>(QMR, g.start[e + 1] - r0)});
  float_or_bf16(x, "quant_moe", [&](auto tag) {
    using X = decltype(tag);
    const X* xp = x.data_ptr<X>();
    std::vector<X> xg(R * H), gu(R * 2 * I), mid(R * I), ys(R * H);
    for (int64_t r = 0; r < R; ++r) std::memcpy(xg.data() + r * H, xp + (g.slot[r] / K) * H, H * sizeof(X));
    DecodeRows d1, d2;
    decode_rows(xg.data(), R, H, p1, d1);
    decode_project(w1, chunks, d1, kind, bk1, gu.data(), nullptr);
    for (int64_t r = 0; r < R; ++r) silu_mul_row(gu.data() + r * 2 * I, I, mid.data() + r * I);  // as silu_and_mul
    decode_rows(mid.data(), R, I, p2, d2);
    decode_project(w2, chunks, d2, kind, bk2, ys.data(), nullptr);
    combine_rows(static_cast<const X*>(ys.data()), g.pos.data(), w.data_ptr<float>(), T, K, H, out.data_ptr<X>());
  });
#else
  (void)q1, (void)s1, (void)z1, (void)q2, (void)s2, (void)z2, (void)rb1, (void)bk1, (void)rb2, (void)bk2, (void)offset, (void)act;
  TORCH_CHECK(false, "quant_moe: needs a vector layer, not in this build");
#endif
  return out;
}

}  // namespace adapt_cpu
