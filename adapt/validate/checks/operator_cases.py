"""Random inputs for every kernel of ``adapt.runtime.kernels``, so each can be run against its twin.

# Legend: T tokens, B sequences, H heads, Hkv kv heads, D head dim, E experts, K top-k, NB blocks,
# BS block size, R MLA latent rank, Dr rope dims, Dn / Dv MLA nope / value dims.

A case builds its inputs in float32 from a seeded generator; ``make(dtype)`` casts the floating
inputs to ``dtype`` (index tensors and scales stay as they are) and gives fresh cache tensors each
call, so in-place kernels (cache writes) can be run twice. ``out(args, ret)`` returns the tensors to
compare: the return value, or the caches an in-place kernel wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class UnsupportedCase(Exception):
    """A kernel this device cannot run in the asked dtype (it is reported, never passed)."""


@dataclass(frozen=True)
class Case:
    make: Callable[[torch.dtype], tuple[list[Any], dict[str, Any]]]
    out: Callable[[list[Any], Any], list[torch.Tensor]]


def _ret(args: list[Any], ret: Any) -> list[torch.Tensor]:
    return list(ret) if isinstance(ret, tuple) else [ret]


def _routing(args: list[Any], ret: Any) -> list[torch.Tensor]:
    # (weights [T, K], ids [T, K]): id order within a row is an implementation detail; sort by id
    w, ids = ret
    order = ids.argsort(dim=-1)
    return [w.gather(-1, order), ids.gather(-1, order)]


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


def _case(args: list[Any], kwargs: dict[str, Any] | None = None, out=_ret, fresh: tuple[int, ...] = (),
          keep_fp32: tuple[int, ...] = (), pack: tuple[int, ...] = (), transposed: tuple[int, ...] = (),
          tile: tuple[int, ...] = (), panel: tuple[int, ...] = (), router: tuple[int, ...] = ()) -> Case:
    """``fresh``: positions cloned per call (caches written in place); ``keep_fp32``: never cast;
    ``pack``: stacked expert weights [E, N, K], packed per expert for oneDNN after the cast;
    ``tile``: stacked expert weights packed for the fused tiled MoE kernel (moe_tiled.pack_tiled);
    ``panel``: a dense [N, K] weight packed in the same kernel's column panels (linear_tiled.pack_linear);
    ``transposed``: [E, N, K] weights held as views of [E, K, N] storage, as the runtime's MoE holds them;
    ``router``: the router weight [E, H] just before, packed here for the fused router where it runs
    (moe_routing.pack_router; elsewhere None, and the kernel runs its two-kernel form, as the runtime does)."""
    kwargs = kwargs or {}

    def make(dtype: torch.dtype):
        a = []
        for i, x in enumerate(args):
            y = x if i in keep_fp32 else _cast(x, dtype)
            if i in pack:
                from adapt.runtime.kernels.moe_experts import onednn_packs, pack_expert_weights

                if not onednn_packs(y.dtype):
                    raise UnsupportedCase(f"this CPU does not pack {str(y.dtype).replace('torch.', '')} for oneDNN")
                y = pack_expert_weights(y)
            if i in tile:
                from adapt.runtime.kernels.moe_tiled import pack_tiled, tiled_panel, tiles

                if not tiles(y.shape[1], y.shape[2], y.dtype):
                    dt = str(y.dtype).replace("torch.", "")
                    raise UnsupportedCase(f"the fused tiled MoE kernel does not run {dt} here")
                y = pack_tiled(y, tiled_panel(y.dtype))
            if i in panel:
                from adapt.runtime.kernels.linear_tiled import linear_tiles, pack_linear
                from adapt.runtime.kernels.moe_tiled import tiled_panel

                if not linear_tiles(y.shape[0], y.shape[1], y.dtype):
                    dt = str(y.dtype).replace("torch.", "")
                    raise UnsupportedCase(f"the tiled linear does not take {dt} here (float32, and 16-bit types "
                                          "where oneDNN has no native linear for them, with a vector layer)")
                y = pack_linear(y, tiled_panel(y.dtype))
            if i in router:
                from adapt.runtime.kernels.moe_routing import pack_router

                y = pack_router(a[-1])
            if i in transposed:
                y = y.transpose(1, 2).contiguous().transpose(1, 2)
            a.append(y.clone() if i in fresh else y)
        return a, dict(kwargs)

    return Case(make, out)


def build_cases(seed: int = 0) -> dict[str, Case]:
    """One case per kernel name (the names of ``adapt.runtime.kernels.Kernels``)."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    from adapt.runtime.kernels import rope

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    t, hq, hkv, d = 12, 4, 2, 16
    nb, bs = 8, 4
    block_tables = torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 11], dtype=torch.int32)
    slots = torch.tensor([0, 1, 2, 5, 9, 13, 17, -1, 20, 21, 30, 31])
    inv_freq, _ = rope.rope_inv_freq(d, 10000.0)
    cos, sin = rope.rope_cos_sin(inv_freq, torch.arange(t))
    h, r, dr, dn, dv, e, k, inter = 4, 16, 8, 16, 16, 8, 2, 24
    kv_b = rn(h * (dn + dv), r, scale=0.3)
    xq = rn(t, hkv, d)
    q8, s8 = xq.clamp(-3, 3).mul(127 / 3).round().to(torch.int8), torch.rand(t, hkv, generator=g) + 0.01
    return {
        "varlen_attention": _case([rn(t, hq, d), rn(t, hkv, d), rn(t, hkv, d), cu, d ** -0.5]),
        "paged_decode_attention": _case([rn(2, hq, d), rn(nb, bs, hkv, d), rn(nb, bs, hkv, d), block_tables,
                                         seq_lens, d ** -0.5]),
        "write_kv_cache": _case([rn(t, hkv, d), rn(t, hkv, d), torch.zeros(nb, bs, hkv, d),
                                 torch.zeros(nb, bs, hkv, d), slots], fresh=(2, 3),
                                out=lambda a, _r: [a[2], a[3]]),
        "mla_prefill": _case([rn(t, h, dn), rn(t, h, dr), rn(t, r), rn(t, dr), kv_b, dv, cu, (dn + dr) ** -0.5]),
        "mla_decode": _case([rn(2, h, dn), rn(2, h, dr), rn(nb, bs, r + dr), block_tables, seq_lens, kv_b, dv,
                             (dn + dr) ** -0.5]),
        "write_mla_cache": _case([rn(t, r), rn(t, dr), torch.zeros(nb, bs, r + dr), slots], fresh=(2,),
                                 out=lambda a, _r: [a[2]]),
        "rms_norm": _case([rn(t, 64), rn(64).abs() + 0.5], {"eps": 1e-6}),
        "fused_add_rms_norm": _case([rn(t, 64), rn(t, 64), rn(64).abs() + 0.5], {"eps": 1e-6}),
        "apply_rope": _case([rn(t, hq, d), cos, sin]),
        "softmax_topk": _case([rn(t, e), k, True], out=_routing),
        "router_softmax_topk": _case([rn(t, 32), rn(e, 32, scale=0.3), None, k, True], router=(2,),
                                     out=lambda a, r: [r[0], *_routing(a, r[1:])]),
        "deepseek_v2_topk": _case([rn(t, e), k], {"method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                                                  "routed_scaling_factor": 1.5}, out=_routing),
        "sigmoid_grouped_topk": _case([rn(t, e), k, rn(e, scale=0.1)], {"n_group": 4, "topk_group": 2,
                                      "norm_topk_prob": True, "routed_scaling_factor": 2.5}, out=_routing),
        "moe_experts": _case([rn(t, 32), torch.rand(t, k, generator=g), torch.randint(0, e, (t, k), generator=g),
                              rn(e, inter, 32, scale=0.2), rn(e, inter, 32, scale=0.2), rn(e, 32, inter, scale=0.2)],
                             keep_fp32=(1,)),
        "moe_experts_fused": _case([rn(t, 32), torch.rand(t, k, generator=g),
                                    torch.randint(0, e, (t, k), generator=g), rn(e, 2 * inter, 32, scale=0.2),
                                    rn(e, 32, inter, scale=0.2)], keep_fp32=(1,), transposed=(3, 4)),
        "moe_experts_packed": _case([rn(t, 32), torch.rand(t, k, generator=g),
                                     torch.randint(0, e, (t, k), generator=g), rn(e, 2 * inter, 32, scale=0.2),
                                     rn(e, 32, inter, scale=0.2)], keep_fp32=(1,), pack=(3, 4)),
        # the tiled kernel's shapes: 2I and H multiples of its column blocks (32), H and I of 32 (AMX)
        "moe_experts_tiled": _case([rn(t, 64), torch.rand(t, k, generator=g), torch.randint(0, e, (t, k), generator=g),
                                    rn(e, 64, 64, scale=0.15), rn(e, 64, 32, scale=0.2)], keep_fp32=(1,),
                                   tile=(3, 4)),
        # N a multiple of the panel (64 with AVX-512, 16 with AVX2); K need not be
        "linear_tiled": _case([rn(t, 96), rn(128, 96, scale=0.1), rn(128)], panel=(1,)),
        "quantize_int8": _case([xq]),
        "dequantize_int8": _case([q8, s8], keep_fp32=(1,)),
        "silu_and_mul": _case([rn(t, 2 * inter)]),
    }
