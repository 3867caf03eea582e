// MoE: the padded layout of the routed tokens and the weighted combine.
#pragma once

#include "common.h"

#include <atomic>
#include <limits>
#include <tuple>

namespace adapt_cpu {

// The slots s = t * K + k of ids [S] grouped by local expert (global id - offset in 0 .. E - 1), in slot order
// within one (a counting sort): rows start[e] .. start[e + 1] - 1 are expert e's, slot[r] is row r's slot, and
// pos[s] is slot s's row (-1: an expert another rank holds).
struct SlotGroups {
  std::vector<int64_t> start, slot, pos;
};

inline SlotGroups group_slots(const int64_t* ip, int64_t S, int64_t E, int64_t offset) {
  SlotGroups g{std::vector<int64_t>(E + 1, 0), {}, std::vector<int64_t>(S, -1)};
  for (int64_t s = 0; s < S; ++s) {
    const int64_t e = ip[s] - offset;
    if (e >= 0 && e < E) ++g.start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) g.start[e + 1] += g.start[e];
  g.slot.resize(g.start[E]);
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t e = ip[s] - offset;
    if (e >= 0 && e < E) {
      g.pos[s] = fill[e];
      g.slot[fill[e]++] = s;
    }
  }
  return g;
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

// The K largest of each row of x [T, E] float32, descending: (values [T, K], int64 ids [T, K], undecided
// rows [U] int64). One pass per row keeps the K best in order; torch.topk's CPU loop (nth_element, then a
// sort, per row) took 150 us for [512, 32], K 4. A row is undecided when it has a NaN or a tie that decides
// which ids are chosen or in what order (equal values among the chosen, or the K-th equal to the best not
// chosen): torch.topk orders those by its own algorithm, row by row, so the caller redoes those rows with it
// and the ids stay torch's. (Bfloat16 logits tie often: 512 rows of the bench's router had some such row in
// every call, and the whole call fell back to torch.topk.) Other rows are torch's result (same values, same
// ids, same order).
// One row of topk_rows: the K largest of row [E] into v [K] (descending) and id [K]; false where the row is
// undecided (a NaN, or a tie among the chosen or at the K-th place)
inline bool topk_row(const float* row, int64_t E, int64_t K, float* v, int64_t* id) {
  bool ok = true;
  int64_t n = 0;  // kept so far, v[0] >= ... >= v[n - 1]
  float out = -std::numeric_limits<float>::infinity();  // the best value not kept
  bool any_out = false;
  for (int64_t j = 0; j < E; ++j) {
    const float a = row[j];
    if (std::isnan(a)) ok = false;
    if (n == K && !(a > v[K - 1])) {
      if (!any_out || a > out) out = a, any_out = true;
      continue;
    }
    if (n == K) {  // v[K - 1] leaves
      if (!any_out || v[K - 1] > out) out = v[K - 1], any_out = true;
    } else {
      ++n;
    }
    int64_t i = n - 1;
    for (; i > 0 && a > v[i - 1]; --i) v[i] = v[i - 1], id[i] = id[i - 1];
    v[i] = a, id[i] = j;
  }
  for (int64_t i = 0; i + 1 < K; ++i) ok = ok && v[i] != v[i + 1];
  return ok && !(any_out && out == v[K - 1]);
}

// the rows flagged undecided, as an int64 tensor of row indices
inline torch::Tensor flagged_rows(const std::vector<uint8_t>& flags, const torch::TensorOptions& opts) {
  std::vector<int64_t> rows;
  for (int64_t t = 0; t < (int64_t)flags.size(); ++t)
    if (flags[t]) rows.push_back(t);
  auto out = torch::empty({(int64_t)rows.size()}, opts.dtype(at::kLong));
  std::copy(rows.begin(), rows.end(), out.data_ptr<int64_t>());
  return out;
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> topk_rows(torch::Tensor x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "topk_rows: contiguous float32 x [T, E]");
  const int64_t T = x.size(0), E = x.size(1);
  TORCH_CHECK(K >= 1 && K <= E, "topk_rows: need 1 <= K <= E");
  auto values = torch::empty({T, K}, x.options());
  auto ids = torch::empty({T, K}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<uint8_t> undecided(T, 0);
  at::parallel_for(0, T, grain(E * 8), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) undecided[t] = !topk_row(xp + t * E, E, K, vp + t * K, ip + t * K);
  });
  return {values, ids, flagged_rows(undecided, x.options())};
}

// o [H] = sum over k with pt[k] >= 0 of wt[k] * yp[pt[k]], float32 in k order, rounded once to X. 64 columns
// at a time, their sums in registers over the K rows (against sums through a row buffer in L1: the tiled
// kernel's call 1.9% faster at 512 tokens, A/B in one process; the same additions in the same order, so the
// same bits)
template <typename X>
inline void combine_row(const X* yp, const int64_t* pt, const float* wt, int64_t K, int64_t H, X* o) {
  int64_t i = 0;
#ifdef ADAPT_VW
  constexpr int NV = 4;
  for (; i + NV * VW <= H; i += NV * VW) {
    vf acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = vzero();
    for (int64_t k = 0; k < K; ++k) {
      if (pt[k] < 0) continue;  // a slot served by another rank
      const X* row = yp + pt[k] * H + i;
      const vf vw = vset1(wt[k]);
      for (int j = 0; j < NV; ++j) acc[j] = vadd(acc[j], vmul(vw, vload(row + j * VW)));
    }
    for (int j = 0; j < NV; ++j) vstore(o + i + j * VW, acc[j]);
  }
  for (; i + VW <= H; i += VW) {
    vf acc = vzero();
    for (int64_t k = 0; k < K; ++k)
      if (pt[k] >= 0) acc = vadd(acc, vmul(vset1(wt[k]), vload(yp + pt[k] * H + i)));
    vstore(o + i, acc);
  }
#endif
  for (; i < H; ++i) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k)
      if (pt[k] >= 0) acc += wt[k] * f32(yp[pt[k] * H + i]);
    o[i] = from_f32<X>(acc);
  }
}

// op[t] = combine_row of token t's K slots (pos[t * K + k], w[t, k]), every token
template <typename X>
void combine_rows(const X* yp, const int64_t* pos, const float* wp, int64_t T, int64_t K, int64_t H, X* op) {
  at::parallel_for(0, T, grain(H * K), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) combine_row(yp, pos + t * K, wp + t * K, K, H, op + t * H);
  });
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
  float_or_bf16(ys, "moe_combine", [&](auto tag) {
    using X = decltype(tag);
    combine_rows(ys.data_ptr<X>(), pp, w.data_ptr<float>(), T, K, H, out.data_ptr<X>());
  });
  return out;
}


}  // namespace adapt_cpu
