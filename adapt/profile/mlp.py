"""MLP rows of one decoder layer: dense SwiGLU, or MoE (router, routed experts, shared experts).

MoE FLOPs count the top-k routed experts of every token (2 * 3 * hidden * moe_intermediate per token
and expert) plus the shared experts. Weight bytes count only the experts a batch is expected to touch:
with T tokens each choosing k of E experts uniformly, an expert is untouched with probability
(1 - k/E)^T, so E * (1 - (1 - k/E)^T) distinct experts are read (the "expected distinct experts" of
a balls-into-bins draw; real routing is skewed, which lowers this figure).
"""

from __future__ import annotations

from adapt.profile.costs import Dtypes, gemm, linear, norm
from adapt.profile.rows import ModuleRow
from adapt.spec import ModelSpec


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """E * (1 - (1 - k/E)^T): distinct experts T tokens touch under uniform top-k routing."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _swiglu(prefix: str, phase: str, kind: str, t: int, h: int, inter: int, dt: Dtypes, bias: bool = False,
            names=("gate_proj", "up_proj", "down_proj")) -> list[ModuleRow]:
    g, u, d = names
    return [linear(f"{prefix}.{g}", phase, kind, t, h, inter, dt, bias),
            linear(f"{prefix}.{u}", phase, kind, t, h, inter, dt, bias),
            linear(f"{prefix}.{d}", phase, kind, t, inter, h, dt, bias)]


def mlp_rows(spec: ModelSpec, phase: str, kind: str, batch: int, context: int, dt: Dtypes) -> list[ModuleRow]:
    """Rows of the MLP sublayer (post-attention norm included) of one layer of ``kind``."""
    h = spec.hidden_size
    t = batch * (context if phase == "prefill" else 1)
    rows = [norm("post_attention_layernorm", phase, kind, t, h, dt)]
    if kind == "dense":
        return rows + _swiglu("mlp", phase, kind, t, h, spec.intermediate_size, dt, spec.mlp_bias)
    m = spec.moe
    moe = "block_sparse_moe" if spec.family == "mixtral" else "mlp"
    e, k, inter = m.num_experts, m.top_k, m.intermediate_size
    router = linear(f"{moe}.gate", phase, kind, t, h, e, dt, quantizable=False, op="router",
                    note=f"{m.scoring} scores, top-{k} of {e}" + (f", {m.n_group} groups" if m.n_group > 1 else ""))
    if m.correction_bias:
        router.weight_bytes += dt.plain(e)
    rows.append(router)
    n = expected_experts(e, k, t)
    pairs = t * k
    ex = gemm(f"{moe}.experts", phase, kind, pairs, h, inter, n * 3 * dt.matrix(inter, h), dt, op="expert_gemm",
              note=f"top-{k} of {e} experts; weights of {n:.1f} expected distinct experts (uniform routing)")
    # the row holds gate, up and down of every (token, expert) pair: 3 GEMMs of [pairs, h] x [h, inter]
    ex.flops *= 3
    ex.act_read_bytes = pairs * (2 * h + inter) * dt.a
    ex.act_write_bytes = pairs * (2 * inter + h) * dt.a
    ex.output_shape = (pairs, h)
    rows.append(ex)
    if m.num_shared_experts and m.shared_intermediate_size:
        name = "shared_experts" if spec.family == "deepseek" else "shared_expert"
        rows += _swiglu(f"{moe}.{name}", phase, kind, t, h, m.shared_intermediate_size, dt)
    if m.shared_expert_gate:
        rows.append(linear(f"{moe}.shared_expert_gate", phase, kind, t, h, 1, dt, quantizable=False, op="router",
                           note="sigmoid gate of the shared expert"))
    return rows
