"""Turns a scheduled batch into tensors, runs the model, returns the next-token logits.

# Legend: T packed tokens, B sequences, MAXB the widest block table of the step, V vocabulary.

Prefill packs every token of every sequence with ``cu_seqlens`` boundaries and takes logits at each
sequence's last token only; decode runs one token per sequence over the paged cache, batched.
"""

from __future__ import annotations

import torch

from adapt.runtime.cache.kv_pool import KVPool
from adapt.runtime.models.batch import ForwardBatch
from adapt.runtime.models.decoder import CausalLM
from adapt.runtime.scheduler import ScheduledBatch
from adapt.runtime.vision.request import decode_delta, step_inputs


class ModelRunner:
    def __init__(self, model: CausalLM, kernels, device: torch.device, pool: KVPool | None):
        self.model, self.kernels, self.device, self.pool = model, kernels, device, pool
        model.freeze()  # parameters and submodules read without nn.Module.__getattr__ (runtime/module.py)
        # the pool holds this rank's layers; attention indexes the cache by global layer index
        start = model.layer_range[0]
        self.kv_layers = [None] * start + list(pool.layers) if pool is not None else None

    def _t(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def prepare(self, sb: ScheduledBatch) -> tuple[torch.Tensor, ForwardBatch, torch.Tensor | None]:
        """(input_ids [T], ForwardBatch, rows of the hidden states to take logits from or None: all)."""
        ids, fb, rows, _ = self._prepare(sb, ())
        return ids, fb, rows

    def _prepare(self, sb: ScheduledBatch, all_rows) -> tuple[torch.Tensor, ForwardBatch, torch.Tensor | None, list]:
        """prepare(), and for prefill the hidden-state rows of every token of the sequences ``all_rows``
        (indices into sb.seqs) besides every sequence's last; returns also, per sequence, its rows' range
        in the logits."""
        kv = self.kv_layers
        if sb.kind == "prefill":
            ids, pos, cu, cu_k, ctx, rows, spans = [], [], [0], [0], [], [], []
            bs = self.pool.block_size if self.pool is not None else 1
            cached = any(sb.chunk_start(i) > 0 for i in range(len(sb.seqs)))
            for i, s in enumerate(sb.seqs):
                a, b = sb.chunk_start(i), sb.context_lens[i]
                ids.extend(s.token_ids[a:b])
                pos.extend(range(a, b))
                cu.append(cu[-1] + b - a)
                cu_k.append(cu_k[-1] + b)
                if cached:  # every sequence's keys come from the cache: [0, b)
                    t = sb.block_tables[i]
                    ctx.extend(t[p // bs] * bs + p % bs for p in range(b))
                first = len(rows)
                rows.extend(range(cu[-2], cu[-1]) if i in all_rows else (cu[-1] - 1,))
                spans.append((first, len(rows)))
            slots = [x for m in sb.slot_mappings for x in m]
            fb = ForwardBatch("prefill", self._t(pos), self.kernels, slot_mapping=self._t(slots),
                              cu_seqlens=self._t(cu, torch.int32), kv=kv, attn_tiles=prefill_tiles(max(sb.context_lens)),
                              context_slots=self._t(ctx) if cached else None,
                              cu_seqlens_k=self._t(cu_k, torch.int32) if cached else None)
            if any(s.mm is not None for s in sb.seqs):  # images: features into their placeholders, M-RoPE
                fb.mm_embeds, fb.mrope_positions = step_inputs(self.model, self.kernels, sb.seqs, self.device)
            return self._t(ids), fb, self._t(rows), spans
        width = max(len(t) for t in sb.block_tables)
        tables = [t + [0] * (width - len(t)) for t in sb.block_tables]
        lens = sb.context_lens
        fb = ForwardBatch("decode", self._t([n - 1 + decode_delta(s) for n, s in zip(lens, sb.seqs)]), self.kernels,
                          slot_mapping=self._t([m[0] for m in sb.slot_mappings]),
                          block_tables=self._t(tables, torch.int32), seq_lens=self._t(lens, torch.int32), kv=kv)
        return self._t([s.last_token_id for s in sb.seqs]), fb, None, [(i, i + 1) for i in range(len(sb.seqs))]

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, fb: ForwardBatch, rows: torch.Tensor | None) -> torch.Tensor:
        """Logits [B, V] float32 at ``rows`` of the final hidden states (all rows when None)."""
        h = self.model(input_ids, fb)
        if rows is not None:
            h = h.index_select(0, rows)
        return self.model.compute_logits(h).float()

    def step(self, sb: ScheduledBatch) -> torch.Tensor:
        """Logits [B, V] at each sequence's last computed token."""
        return self.execute(*self.prepare(sb))

    def step_with_prompt_logits(self, sb: ScheduledBatch) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """step(), and for prefill sequences that ask for prompt logprobs (``params.prompt_logprobs``) the
        logits [chunk, V] of every token of their chunk, by index into sb.seqs."""
        want = [i for i, s in enumerate(sb.seqs) if sb.kind == "prefill"
                and getattr(s.params, "prompt_logprobs", None) is not None and sb.chunk_start(i) < s.num_prompt_tokens]
        if not want:
            return self.step(sb), {}
        ids, fb, rows, spans = self._prepare(sb, set(want))
        logits = self.execute(ids, fb, rows)
        last = torch.tensor([b - 1 for _, b in spans], device=logits.device)
        return logits.index_select(0, last), {i: logits[spans[i][0]: spans[i][1]] for i in want}


def prefill_tiles(max_len: int) -> tuple[int, int]:
    """(q_tile, k_tile) of the prefill attention for prompts up to max_len tokens. Score tiles that stay
    near the cache beat fewer, larger ones: the Python loop's cost is small against the O(L^2) work at
    the lengths where tiles get many (2-core Xeon, torch 2.13, 12 q / 4 kv heads of 64, one causal
    prompt, ms, q/k tiles 128/256 | 128/512 | 512/1024: 2048 tokens 52 | 51 | 81-114, 4096 tokens
    172-178 | 184-186 | 390). Memory stays O(q_tile * k_tile) per head."""
    if max_len <= 1024:
        return 128, 256
    return 128, 512
