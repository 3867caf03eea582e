"""Vision-tower rows for one image (phase ``vision``): CLIP ViT (llava) and the Qwen2.5-VL ViT.

The image size is the tower's own (CLIP: ``image_size``) or, for Qwen2.5-VL's dynamic resolution, a
448 x 448 image (1024 patches of 14 x 14). Attention is bidirectional: N^2 pairs per head (Qwen2.5-VL:
window attention of ``window_size`` pixels in the layers not in ``fullatt_block_indexes``).
transformers runs every CLIP layer even though llava reads layer -2; so do these rows.
"""

from __future__ import annotations

from adapt.profile.costs import Dtypes, gemm, linear, norm
from adapt.profile.rows import ModuleRow
from adapt.spec import ModelSpec

QWEN_VL_IMAGE = 448


def _plain_linear(name, t, i, o, dt, bias=True, op="gemm"):
    return linear(name, "vision", "vision", t, i, o, dt, bias=bias, quantizable=False, op=op)


def _attn_core(name: str, tokens: int, pairs: int, heads: int, d: int, dt: Dtypes) -> ModuleRow:
    a = dt.a
    return ModuleRow(name, "vision", "attention", name, None, "vision", 2.0 * heads * pairs * 2 * d, 0.0,
                     3 * tokens * heads * d * a, tokens * heads * d * a, input_shape=(1, heads, tokens, d),
                     output_shape=(1, heads, tokens, d), compute_dtype=dt.act, note="bidirectional")


def vision_rows(spec: ModelSpec, dt: Dtypes) -> list[ModuleRow]:
    """Rows of encoding one image with the vision tower and projector."""
    v = spec.vision
    hv, rows = v.hidden_size, []
    d = hv // v.num_heads
    if v.kind == "clip":
        patches = (v.image_size // v.patch_size) ** 2
        n = patches + 1
        t = "vision_tower."
        rows.append(gemm(f"{t}embeddings.patch_embedding", "vision", "vision", patches,
                         v.in_channels * v.patch_size ** 2, hv, dt.plain(hv * v.in_channels * v.patch_size ** 2),
                         dt, compute=dt.act, note="conv as GEMM over patches"))
        for i in range(v.num_layers):
            p = f"{t}encoder.layers.{i}"
            rows += [norm(f"{p}.layer_norm1", "vision", "vision", n, hv, dt),
                     *[_plain_linear(f"{p}.self_attn.{x}", n, hv, hv, dt) for x in ("q_proj", "k_proj", "v_proj")],
                     _attn_core(f"{p}.self_attn.attn", n, n * n, v.num_heads, d, dt),
                     _plain_linear(f"{p}.self_attn.out_proj", n, hv, hv, dt),
                     norm(f"{p}.layer_norm2", "vision", "vision", n, hv, dt),
                     _plain_linear(f"{p}.mlp.fc1", n, hv, v.intermediate_size, dt),
                     _plain_linear(f"{p}.mlp.fc2", n, v.intermediate_size, hv, dt)]
        rows += [_plain_linear("multi_modal_projector.linear_1", patches, hv, spec.hidden_size, dt, v.projector_bias),
                 _plain_linear("multi_modal_projector.linear_2", patches, spec.hidden_size, spec.hidden_size, dt,
                               v.projector_bias)]
        return rows
    vcfg = spec.config().get("vision_config") or {}
    full = set(vcfg.get("fullatt_block_indexes", [7, 15, 23, 31]))
    window = int(vcfg.get("window_size", 112)) // v.patch_size  # patches per window side
    side = QWEN_VL_IMAGE // v.patch_size
    n = side * side
    win_tokens = min(n, window * window)
    t = "visual."
    kin = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    rows.append(gemm(f"{t}patch_embed.proj", "vision", "vision", n, kin, hv, dt.plain(hv * kin), dt, compute=dt.act,
                     note=f"{QWEN_VL_IMAGE}x{QWEN_VL_IMAGE} image, conv3d as GEMM over {n} patches"))
    for i in range(v.num_layers):
        p = f"{t}blocks.{i}"
        pairs = n * n if i in full else n * win_tokens
        core = _attn_core(f"{p}.attn.attn", n, pairs, v.num_heads, d, dt)
        core.note = "full attention" if i in full else f"window attention ({win_tokens} patches per window)"
        rows += [norm(f"{p}.norm1", "vision", "vision", n, hv, dt), _plain_linear(f"{p}.attn.qkv", n, hv, 3 * hv, dt),
                 core, _plain_linear(f"{p}.attn.proj", n, hv, hv, dt), norm(f"{p}.norm2", "vision", "vision", n, hv, dt),
                 _plain_linear(f"{p}.mlp.gate_proj", n, hv, v.intermediate_size, dt),
                 _plain_linear(f"{p}.mlp.up_proj", n, hv, v.intermediate_size, dt),
                 _plain_linear(f"{p}.mlp.down_proj", n, v.intermediate_size, hv, dt)]
    merged, m = hv * v.spatial_merge_size ** 2, n // v.spatial_merge_size ** 2
    rows += [norm(f"{t}merger.ln_q", "vision", "vision", n, hv, dt),
             _plain_linear(f"{t}merger.mlp.0", m, merged, merged, dt),
             _plain_linear(f"{t}merger.mlp.2", m, merged, v.out_hidden_size, dt)]
    return rows
