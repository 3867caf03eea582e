"""Qwen2.5-VL's vision tower: patch embedding, 2-D rope, window / full attention blocks, patch merger.

# Legend: N patches of all images (each C * Tp * p * p values, in the processor's merge-block order),
# U = N / m^2 merge units, Hv tower width, D head dim, H text width, m spatial merge size.

The processor flattens each image into patches grouped by m x m merge blocks. The tower:
  1. patch embedding: the Conv3d (kernel = stride = [Tp, p, p], no bias) on one patch is a dot
     product, computed as one GEMM over the flattened patches;
  2. 2-D rope: each patch's (row, column) in its image; D/4 frequencies (theta^(-2j/(D/2))) for the
     row and D/4 for the column, cos/sin = cat(f_h, f_w, f_h, f_w), applied rotate-half in float32;
  3. window permutation: merge units are reordered so that each window of ``window_size / (m p)``
     units a side is contiguous (partial windows at the bottom / right edge kept, empty ones
     dropped); the rope angles follow the same permutation;
  4. blocks (RMSNorm 1e-6, qkv with bias, rope, attention, proj; RMSNorm, SiLU gate/up/down with
     biases): blocks in ``fullatt_block_indexes`` attend over the whole image, the others only within
     their window;
  5. merger: RMSNorm, m^2 neighbours concatenated, linear -> GELU -> linear to H; then the inverse
     permutation restores the processor's order, which is the order of the placeholder tokens.

Captured: ``vision.embed`` (patch embedding, processor order), ``vision.blocks.{i}`` (each block's
output, in window order as transformers' blocks see it), ``projector`` ([U, H], the merger's output in token order).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from adapt.runtime.models.layers import ColumnParallelLinear, Linear, RMSNorm
from adapt.runtime.vision.common import Weight, activation, tower_attention
from adapt.spec import VisionSpec
from adapt.runtime.module import Module


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class VisionBlock(Module):
    def __init__(self, v: VisionSpec, p: str):
        super().__init__()
        hv = v.hidden_size
        self.num_heads, self.head_dim = v.num_heads, hv // v.num_heads
        self.norm1 = RMSNorm(f"{p}.norm1.weight", hv, 1e-6)
        self.norm2 = RMSNorm(f"{p}.norm2.weight", hv, 1e-6)
        self.qkv = Linear(f"{p}.attn.qkv.weight", hv, 3 * hv, f"{p}.attn.qkv.bias")
        self.proj = Linear(f"{p}.attn.proj.weight", hv, hv, f"{p}.attn.proj.bias")
        m, i = f"{p}.mlp", v.intermediate_size
        # gate | up as one GEMM over the normed input, replicated (ctx unused); SiLU's gate then takes the
        # fused silu_and_mul kernel (rounding as silu(gate) * up does)
        self.gate_up = ColumnParallelLinear([(f"{m}.{n}.weight", f"{m}.{n}.bias", i)
                                             for n in ("gate_proj", "up_proj")], hv, None)
        self.down = Linear(f"{m}.down_proj.weight", i, hv, f"{m}.down_proj.bias")
        self.act_name = v.hidden_act
        self.act = activation(v.hidden_act)

    def forward(self, x, cu, cos, sin, kernels):
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        y = kernels.rms_norm(x, self.norm1.weight, self.norm1.eps)
        q, k, v = self.qkv(y).view(t, 3, h, d).unbind(1)  # [N, h, D] each
        c, s = cos[:, None], sin[:, None]  # [N, 1, D] float32
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        o = tower_attention(kernels, q, k, v, cu, d ** -0.5)
        x = x + self.proj(o.reshape(t, h * d))
        y = kernels.rms_norm(x, self.norm2.weight, self.norm2.eps)
        gu = self.gate_up(y)  # [N, 2I]
        if self.act_name == "silu":
            return x + self.down(kernels.silu_and_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        return x + self.down(self.act(gate) * up)


class QwenVisionTower(Module):
    """The tower and its merger (the projector); ``forward`` returns [U, H] in placeholder order."""

    def __init__(self, v: VisionSpec, prefix: str = "visual."):
        super().__init__()
        self.spec = v
        hv, m = v.hidden_size, v.spatial_merge_size
        self.patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        self.patch = Weight(f"{prefix}patch_embed.proj.weight", hv, v.in_channels, v.temporal_patch_size,
                            v.patch_size, v.patch_size)
        self.blocks = nn.ModuleList(VisionBlock(v, f"{prefix}blocks.{i}") for i in range(v.num_layers))
        merged = hv * m * m
        self.ln_q = RMSNorm(f"{prefix}merger.ln_q.weight", hv, 1e-6)
        self.mlp0 = Linear(f"{prefix}merger.mlp.0.weight", merged, merged, f"{prefix}merger.mlp.0.bias")
        self.mlp2 = Linear(f"{prefix}merger.mlp.2.weight", merged, v.out_hidden_size, f"{prefix}merger.mlp.2.bias")
        d = hv // v.num_heads
        self.inv_freq = 1.0 / (v.rope_theta ** (torch.arange(0, d // 2, 2, dtype=torch.float, device="cpu") / (d // 2)))

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]], kernels,
                capture: dict | None = None) -> torch.Tensor:
        """patches [N, C * Tp * p * p] of images with grids (t, h, w) in patches -> [U, H]."""
        v, dev = self.spec, patches.device
        mu = v.spatial_merge_size ** 2
        w = self.patch.weight
        x = torch.nn.functional.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1))  # [N, Hv]
        _record(capture, "vision.embed", x)
        n = x.shape[0]
        pos = vision_positions(grids, v.spatial_merge_size).to(dev)  # [N, 2]
        freqs = pos[..., None].float() * self.inv_freq.to(dev)  # [N, 2, D/4]
        hw = freqs.flatten(1)  # [N, D/2] = cat(f_h, f_w)
        emb = torch.cat((hw, hw), dim=-1)
        order, cu_win = window_index(grids, v.spatial_merge_size, v.window_size, v.patch_size)
        order, cu_win = order.to(dev), cu_win.to(dev)
        perm = (order[:, None] * mu + torch.arange(mu, device=dev)).reshape(-1)  # patch permutation [N]
        x, emb = x[perm], emb[perm]
        cos, sin = emb.cos(), emb.sin()
        cu_full = _frames_cu(grids, dev)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cu_full if i in v.fullatt_blocks else cu_win, cos, sin, kernels)
            _record(capture, f"vision.blocks.{i}", x)
        y = kernels.rms_norm(x, self.ln_q.weight, self.ln_q.eps).view(n // mu, -1)
        y = self.mlp2(torch.nn.functional.gelu(self.mlp0(y)))  # [U, H], window order
        y = y[torch.argsort(order)]
        _record(capture, "projector", y)
        return y


def vision_positions(grids: list[tuple[int, int, int]], m: int) -> torch.Tensor:
    """(row, column) of every patch [N, 2], in the processor's merge-block order, repeated per frame."""
    out = []
    for t, h, w in grids:
        hp = torch.arange(h)[:, None].expand(h, w)
        wp = torch.arange(w)[None, :].expand(h, w)
        shape = (h // m, m, w // m, m)
        hp = hp.reshape(shape).transpose(1, 2).flatten()
        wp = wp.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack((hp, wp), dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_index(grids: list[tuple[int, int, int]], m: int, window: int, patch: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(merge-unit order [U] that makes each window contiguous, cu_seqlens of the windows in patches)."""
    side = window // m // patch  # window side in merge units
    order, cu, base = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // m, w // m
        idx = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for f in range(t):
            for r0 in range(0, gh, side):
                for c0 in range(0, gw, side):
                    block = idx[f, r0:r0 + side, c0:c0 + side].reshape(-1)
                    order.append(block + base)
                    cu.append(cu[-1] + block.numel() * m * m)
        base += t * gh * gw
    return torch.cat(order), torch.tensor(cu, dtype=torch.int32)


def _frames_cu(grids, dev) -> torch.Tensor:
    # full attention spans one frame of one image (transformers repeats h * w per frame)
    lens = [h * w for t, h, w in grids for _ in range(t)]
    return torch.tensor([0] + _cumsum(lens), dtype=torch.int32, device=dev)


def _cumsum(xs):
    out, s = [], 0
    for x in xs:
        s += x
        out.append(s)
    return out


def _record(capture: dict | None, name: str, x: torch.Tensor) -> None:
    if capture is not None:
        capture[name] = x.detach().clone()
