// Fused CPU kernels of the adapt runtime (built at first use by adapt/runtime/cpu_kernels.py).
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


#include "attention.h"
#include "common.h"
#include "elementwise.h"
#include "moe.h"
#include "moe_gemm.h"
#include "quant_gemm.h"
#include "quant_moe.h"

using namespace adapt_cpu;

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
  m.def("qk_norm_rope", &qk_norm_rope);
  m.def("argmax_rows", &argmax_rows);
  m.def("moe_pad_gather", &moe_pad_gather);
  m.def("moe_combine", &moe_combine);
  m.def("topk_rows", &topk_rows);
  m.def("router_softmax_topk", &router_softmax_topk);
  m.def("moe_experts_tiled", &moe_experts_tiled);
  m.def("moe_tiled_dtypes", &moe_tiled_dtypes);
  m.def("moe_tiled_bf16_gemm", &moe_tiled_bf16_gemm);
  m.def("quant_linear", &quant_linear);
  m.def("quant_moe", &quant_moe);
  m.def("quant_moe_takes", &quant_moe_takes);
#ifdef ADAPT_QDP
  m.attr("QUANT_BF16_DOT") = true;  // bf16 decode of int8 / int4 weights by vdpbf16ps (quant_dot_bf16.h)
#else
  m.attr("QUANT_BF16_DOT") = false;
#endif
#ifdef ADAPT_QA8
  m.attr("QUANT_A8_DOT") = true;  // int8-activation decode of int8 / int4 weights by vpdpbusd (quant_dot_a8.h)
#else
  m.attr("QUANT_A8_DOT") = false;
#endif
  m.def("linear_tiled", &linear_tiled, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
#ifdef ADAPT_VW
  m.attr("PANEL") = FMA_NR;  // columns per packed float32 panel of the tiled MoE kernel and linear_tiled
  std::vector<int64_t> router;  // the router panels router_softmax_topk takes: FMA_NR, then narrower
  for (int64_t nv = FMA_NV; nv >= 1; nv /= 2) router.push_back(nv * VW);
  m.attr("ROUTER_PANELS") = router;
  m.attr("ROUTER_VNNI") = router_vnni_runs();  // the bfloat16 router vnni-packed on AVX512-BF16's dp_gemm
#else
  m.attr("PANEL") = 0;
  m.attr("ROUTER_PANELS") = std::vector<int64_t>{};
#endif
}
