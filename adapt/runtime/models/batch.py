"""What one forward step needs besides the token ids: positions, cache slots, sequence boundaries.

# Legend: T tokens of the step (sequences concatenated), B sequences, MAXB block-table width.

A prefill step concatenates every token of B sequences (``cu_seqlens``); a decode step has one token per
sequence and reads the paged cache (``block_tables``, ``seq_lens`` counting the new token). A prefill
whose sequences start after a cached prefix (a prefix-cache hit or a later chunk of a chunked prefill)
carries ``context_slots`` / ``cu_seqlens_k``: attention reads their keys back from the cache.
``kv`` is the pool's per-layer tensors (None: compute without caching, as ``prefill_logits`` does).
``capture``, when a dict, receives each layer's intermediate outputs by name (see models/__init__).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adapt.runtime.kernels import Kernels
from adapt.runtime.kernels.paged_attention import decode_meta


@dataclass
class ForwardBatch:
    kind: str  # "prefill" | "decode"
    positions: torch.Tensor  # [T] int64
    kernels: Kernels
    slot_mapping: torch.Tensor | None = None  # [T] int64 cache slot of each token (None: no cache write)
    cu_seqlens: torch.Tensor | None = None  # [B + 1] int32, prefill
    block_tables: torch.Tensor | None = None  # [B, MAXB] int32, decode
    seq_lens: torch.Tensor | None = None  # [B] int32, decode: cached tokens including this one
    kv: list | None = None  # LayerKV per global layer index (None: no cache)
    capture: dict[str, torch.Tensor] | None = None
    rope: dict = field(default_factory=dict)  # cos/sin per rope, computed once per step
    memo: dict = field(default_factory=dict)  # other per-step values every layer shares
    attn_tiles: tuple[int, int] = (128, 256)  # prefill (q_tile, k_tile)
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [N] of the step, image features [N, H])
    mrope_positions: torch.Tensor | None = None  # [3, T] Qwen2.5-VL prefill (models/qwen2_vl.py)
    # prefill over cached context (prefix caching, chunked prefill): the step's queries attend to every
    # cached token of their sequence, read back from the cache at these slots (all sequences' [0, end))
    context_slots: torch.Tensor | None = None  # [Tk] int64
    cu_seqlens_k: torch.Tensor | None = None  # [B + 1] int32 offsets of each sequence's keys in Tk

    @property
    def is_prefill(self) -> bool:
        return self.kind == "prefill"

    def decode_meta(self, block_size: int):
        """The paged decode attention's per-step metadata (kernels.decode_meta), computed once per step."""
        key = ("decode_meta", block_size)
        if key not in self.memo:
            self.memo[key] = decode_meta(self.block_tables, self.seq_lens, block_size)
        return self.memo[key]

    def slots_checked(self) -> bool:
        """Whether slot_mapping is int64 without negative (padding) slots, tested once per step."""
        if "slots_checked" not in self.memo:
            sm = self.slot_mapping
            self.memo["slots_checked"] = (sm is not None and sm.dtype == torch.long
                                          and not bool((sm < 0).any()))
        return self.memo["slots_checked"]

    def record(self, name: str, x: torch.Tensor) -> None:
        if self.capture is not None:
            self.capture[name] = x.detach().clone()
