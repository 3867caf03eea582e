"""The preallocated paged KV cache: one block pool per layer, sized from a memory budget.

Legend: NB blocks, BS block size (tokens per block), Hkv kv heads, D key head dim, Dv value head dim,
R + Dr the MLA latent (kv_lora_rank + rope head dim), S = NB * BS slots.

Layouts per layer:
  mha  k [NB, BS, Hkv, D]   v [NB, BS, Hkv, Dv]     int8: k_scale, v_scale [NB, BS, Hkv] float32
  mla  latent [NB, BS, R + Dr]                       int8: latent_scale [NB, BS, 1] float32
int8 is symmetric per token and head: ``x ~= q * scale`` with ``scale = amax(|x|) / 127``.
Slots index the pool viewed as ``[S, ...]``; the block manager maps token positions to slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from adapt.errors import RuntimeConfigError

__all__ = [
    "DEFAULT_MEMORY_FRACTION",
    "KVCacheSpec",
    "KVPool",
    "KVPoolUsage",
    "LayerKV",
    "available_memory_bytes",
    "kv_cache_budget",
    "num_blocks_for_budget",
    "quantize_int8",
]

DEFAULT_MEMORY_FRACTION = 0.9  # of free memory, as vLLM's gpu_memory_utilization default
_SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-token cache shape of every layer. ``bytes_per_token`` counts all layers and int8 scales."""

    num_layers: int
    kind: Literal["mha", "mla"]
    dtype: torch.dtype
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim
    quant: Literal["int8"] | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise RuntimeConfigError(f"KV cache needs num_layers >= 1, got {self.num_layers}")
        if self.kind == "mha":
            if min(self.num_kv_heads, self.head_dim, self.v_head_dim) < 1:
                raise RuntimeConfigError(
                    f"mha KV cache needs num_kv_heads, head_dim, v_head_dim >= 1, got "
                    f"{self.num_kv_heads}, {self.head_dim}, {self.v_head_dim}"
                )
        elif self.kind == "mla":
            if self.latent_dim < 1:
                raise RuntimeConfigError(f"mla KV cache needs latent_dim >= 1, got {self.latent_dim}")
        else:
            raise RuntimeConfigError(f"KV cache kind must be 'mha' or 'mla', got {self.kind!r}")
        if self.quant not in (None, "int8"):
            raise RuntimeConfigError(f"KV cache quant must be None or 'int8', got {self.quant!r}")
        if self.quant is None and not self.dtype.is_floating_point:
            raise RuntimeConfigError(f"unquantized KV cache needs a floating dtype, got {self.dtype}")

    @classmethod
    def mha(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        v_head_dim: int | None = None,
        quant: Literal["int8"] | None = None,
    ) -> KVCacheSpec:
        """Standard (MHA / GQA / MQA) attention cache; ``v_head_dim`` defaults to ``head_dim``."""
        v = head_dim if v_head_dim is None else v_head_dim
        return cls(num_layers, "mha", dtype, num_kv_heads, head_dim, v, quant=quant)

    @classmethod
    def mla(
        cls,
        num_layers: int,
        kv_lora_rank: int,
        rope_head_dim: int,
        dtype: torch.dtype,
        quant: Literal["int8"] | None = None,
    ) -> KVCacheSpec:
        """Multi-head latent attention cache (DeepSeek-V2/V3, Kimi-K2): one latent per token."""
        return cls(num_layers, "mla", dtype, latent_dim=kv_lora_rank + rope_head_dim, quant=quant)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the cache data tensors (int8 when quantized)."""
        return torch.int8 if self.quant == "int8" else self.dtype

    def bytes_per_token_per_layer(self) -> int:
        """Cache bytes one token takes in one layer, scales included."""
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        scale = _SCALE_DTYPE.itemsize if self.quant == "int8" else 0
        if self.kind == "mha":
            return (self.head_dim + self.v_head_dim) * self.num_kv_heads * elem + 2 * self.num_kv_heads * scale
        return self.latent_dim * elem + scale

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes across all layers."""
        return self.num_layers * self.bytes_per_token_per_layer()


def num_blocks_for_budget(spec: KVCacheSpec, block_size: int, budget_bytes: int) -> int:
    """How many blocks of ``block_size`` tokens fit in ``budget_bytes``; at least one or an error."""
    if block_size < 1:
        raise RuntimeConfigError(f"block_size must be >= 1, got {block_size}")
    block_bytes = spec.bytes_per_token() * block_size
    n = int(budget_bytes) // block_bytes
    if n < 1:
        raise RuntimeConfigError(
            f"KV cache budget of {int(budget_bytes)} bytes holds no block: one block of {block_size} tokens "
            f"takes {block_bytes} bytes ({spec.bytes_per_token()} per token x {block_size})"
        )
    return n


def available_memory_bytes(device: torch.device | str) -> int:
    """Free memory on ``device``: MemAvailable from /proc/meminfo on CPU, mem_get_info on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        meminfo = Path("/proc/meminfo")
        if meminfo.exists():
            for line in meminfo.read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the value is in kB
        raise RuntimeConfigError("cannot read MemAvailable from /proc/meminfo; pass --kv-cache-memory BYTES")
    raise RuntimeConfigError(f"cannot measure free memory on device {device.type!r}; pass --kv-cache-memory BYTES")


def kv_cache_budget(
    device: torch.device | str,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
) -> int:
    """Bytes for the KV cache: ``memory_bytes`` if given, else ``memory_fraction`` of free device memory."""
    if memory_bytes is not None:
        if memory_bytes <= 0:
            raise RuntimeConfigError(f"--kv-cache-memory must be > 0 bytes, got {memory_bytes}")
        return int(memory_bytes)
    fraction = DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction
    if not 0.0 < fraction <= 1.0:
        raise RuntimeConfigError(f"KV cache memory fraction must be in (0, 1], got {fraction}")
    return int(available_memory_bytes(device) * fraction)


@dataclass
class LayerKV:
    """One layer's cache tensors. MLA uses ``k`` for the latent and leaves ``v`` None."""

    k: torch.Tensor  # mha [NB, BS, Hkv, D]; mla [NB, BS, R + Dr]
    v: torch.Tensor | None = None  # mha [NB, BS, Hkv, Dv]
    k_scale: torch.Tensor | None = None  # int8 only: mha [NB, BS, Hkv]; mla [NB, BS, 1]
    v_scale: torch.Tensor | None = None  # int8 mha only: [NB, BS, Hkv]


@dataclass(frozen=True)
class KVPoolUsage:
    """Memory figures of a pool; ``used_*`` from the block manager's count of used blocks."""

    num_blocks: int
    used_blocks: int
    block_size: int
    capacity_tokens: int
    used_tokens_capacity: int
    bytes_per_token: int
    total_bytes: int
    used_bytes: int


class KVPool:
    """Preallocated KV blocks for all layers, zero-initialised. ``layers[i]`` holds layer i's tensors."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device | str) -> None:
        if num_blocks < 1 or block_size < 1:
            raise RuntimeConfigError(f"KV pool needs num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.layers = [self._new_layer() for _ in range(spec.num_layers)]

    @classmethod
    def from_budget(
        cls,
        spec: KVCacheSpec,
        block_size: int,
        device: torch.device | str,
        memory_bytes: int | None = None,
        memory_fraction: float | None = None,
        max_blocks: int | None = None,
    ) -> KVPool:
        """A pool filling the budget (see ``kv_cache_budget``), capped at ``max_blocks`` if given."""
        budget = kv_cache_budget(device, memory_bytes, memory_fraction)
        n = num_blocks_for_budget(spec, block_size, budget)
        if max_blocks is not None:
            n = min(n, max_blocks)
        return cls(spec, n, block_size, device)

    def _new_layer(self) -> LayerKV:
        s, nb, bs = self.spec, self.num_blocks, self.block_size
        data = dict(dtype=s.storage_dtype, device=self.device)
        scale = dict(dtype=_SCALE_DTYPE, device=self.device)
        q = s.quant == "int8"
        if s.kind == "mha":
            return LayerKV(
                k=torch.zeros(nb, bs, s.num_kv_heads, s.head_dim, **data),
                v=torch.zeros(nb, bs, s.num_kv_heads, s.v_head_dim, **data),
                k_scale=torch.zeros(nb, bs, s.num_kv_heads, **scale) if q else None,
                v_scale=torch.zeros(nb, bs, s.num_kv_heads, **scale) if q else None,
            )
        return LayerKV(
            k=torch.zeros(nb, bs, s.latent_dim, **data),
            k_scale=torch.zeros(nb, bs, 1, **scale) if q else None,
        )

    # -- figures ---------------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes per token across all layers, scales included."""
        return self.spec.bytes_per_token()

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        """Bytes actually allocated by the pool's tensors."""
        tensors = [t for layer in self.layers for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def usage(self, used_blocks: int = 0) -> KVPoolUsage:
        """Pool figures with ``used_blocks`` (from ``BlockManager.usage()``) in use."""
        block_bytes = self.bytes_per_token * self.block_size
        return KVPoolUsage(
            num_blocks=self.num_blocks,
            used_blocks=used_blocks,
            block_size=self.block_size,
            capacity_tokens=self.capacity_tokens,
            used_tokens_capacity=used_blocks * self.block_size,
            bytes_per_token=self.bytes_per_token,
            total_bytes=self.total_bytes,
            used_bytes=used_blocks * block_bytes,
        )

    # -- reference write / read (kernels may write the tensors directly) ------------------------------

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Store tokens at ``slots`` [T]: mha k [T, Hkv, D], v [T, Hkv, Dv]; mla k = latent [T, R + Dr]."""
        if (v is None) != (self.spec.kind == "mla"):
            raise RuntimeConfigError(f"a {self.spec.kind} cache write takes {'k and v' if v is None else 'k only'}")
        lkv = self.layers[layer]
        slots = slots.to(device=self.device, dtype=torch.long)
        for data, scale, x in ((lkv.k, lkv.k_scale, k), (lkv.v, lkv.v_scale, v)):
            if data is None or x is None:
                continue
            if scale is None:
                _slots_view(data)[slots] = x.to(data.dtype)
            else:
                q, s = quantize_int8(x)  # mha s [T, Hkv]; mla s [T]
                _slots_view(data)[slots] = q
                _slots_view(scale)[slots] = s.reshape(slots.shape[0], *scale.shape[2:])

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """Gather (and dequantize) tokens at ``slots`` [T]: mha returns (k, v), mla returns (latent,)."""
        lkv = self.layers[layer]
        slots = slots.to(device=self.device, dtype=torch.long)
        out = []
        for data, scale in ((lkv.k, lkv.k_scale), (lkv.v, lkv.v_scale)):
            if data is None:
                continue
            x = _slots_view(data)[slots]
            if scale is not None:
                s = _slots_view(scale)[slots]  # mha [T, Hkv]; mla [T, 1]
                x = x.to(torch.float32) * (s.unsqueeze(-1) if self.spec.kind == "mha" else s)
            out.append(x.to(dtype or self.spec.dtype))
        return tuple(out)


def _slots_view(t: torch.Tensor) -> torch.Tensor:
    """[NB, BS, ...] -> [S, ...] without a copy."""
    return t.view(-1, *t.shape[2:])


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: x [..., D] -> (q int8 [..., D], scale float32 [...])."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale

