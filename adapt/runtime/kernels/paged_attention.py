"""Decode attention over a paged KV cache (the cache write by slot mapping is in kv_write.py).

# Legend: B sequences (one query token each), Hq query heads, Hkv kv heads, G = Hq // Hkv,
# D qk head dim, Dv v head dim, NB cache blocks, BS tokens per block, MAXB block-table width,
# T tokens being written, c blocks per step, n = c * BS keys per step.

The cache is k_cache [NB, BS, Hkv, D], v_cache [NB, BS, Hkv, Dv]; token j of sequence b lives at
block block_tables[b, j // BS], offset j % BS, i.e. at slot block * BS + offset. An int8 cache
carries k_scale / v_scale [NB, BS, Hkv] float32 (one scale per token and head, see kv_quant.py).

The kernel is vectorized over the batch: it walks the block tables c blocks at a time (a Python
loop over block chunks, never over tokens), gathers those blocks for every sequence at once,
masks positions >= seq_len, and merges chunks with an online softmax (split-K / flash-decoding
style), so the gathered K/V never exceed B * n * Hkv * (D + Dv) elements. Blocks are gathered whole
with index_select along NB (one memcpy per block); when every sequence
fits in one chunk (the common decode case) the online-softmax bookkeeping is skipped.
A sliding window W hides keys j < seq_len - W (the new token at seq_len - 1 sees the W latest,
itself included); chunks before every sequence's window are not read.
"""

from functools import cached_property

import torch

from . import fused
from .rows import take_rows as _take_rows


class DecodeMeta:
    """What every layer's decode attention of one step shares (``decode_meta``), each part computed the
    first time a layer reads it: the fused CPU kernel reads none of them, the torch form all."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, blocks_per_step: int):
        self.seq_lens = seq_lens.to(torch.long)  # [B] int64
        self._tables, self._bs, self._per = block_tables, block_size, blocks_per_step
        self.cache: dict = {}  # per (Hq, Hkv[, window]): the stacked-heads bias / window mask of this step

    @cached_property
    def num_blocks(self) -> int:
        """Blocks of the longest sequence."""
        b = self.seq_lens.shape[0]
        return (int(self.seq_lens.max()) + self._bs - 1) // self._bs if b > 0 else 0

    @cached_property
    def blocks(self) -> torch.Tensor | None:
        """[B * num_blocks] int64 block ids when the step is one chunk (num_blocks <= blocks_per_step), else None."""
        n = self.num_blocks
        return self._tables[:, :n].reshape(-1).to(torch.long).clamp(min=0) if 0 < n <= self._per else None

    @cached_property
    def masked(self) -> torch.Tensor | None:
        """[B, num_blocks * BS] True past each sequence's end (one-chunk steps), else None."""
        if self.blocks is None:
            return None
        pos = torch.arange(self.num_blocks * self._bs, device=self.seq_lens.device)
        return pos[None, :] >= self.seq_lens[:, None]

    @cached_property
    def any_empty(self) -> bool:
        """Some sequence has no key."""
        return bool((self.seq_lens == 0).any()) if self.seq_lens.shape[0] > 0 else False


def decode_meta(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                blocks_per_step: int = 16) -> DecodeMeta:
    """The per-step part of paged_decode_attention, to pass as ``meta`` to every layer of the step."""
    return DecodeMeta(block_tables, seq_lens, block_size, blocks_per_step)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    blocks_per_step: int = 16,
    meta: DecodeMeta | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One decode step: q [B, Hq, D] over the paged cache -> out [B, Hq, Dv] (q.dtype).

    block_tables [B, MAXB] int (entries past a sequence's last block are ignored, may be -1);
    seq_lens [B] int, ragged, each <= MAXB * BS (a sequence of length 0 yields zeros).
    k_scale / v_scale [NB, BS, Hkv]: give them when the cache is int8 (dequantized per chunk).
    meta: ``decode_meta(block_tables, seq_lens, BS, blocks_per_step)`` of this step, shared by its layers.
    window: sliding window (the latest ``window`` keys of each sequence), None for all keys.
    """
    b, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    dv = v_cache.shape[-1]
    g = hq // hkv
    ext = fused.module()
    if (ext is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16, torch.int8)
            and (k_cache.dtype == torch.int8) == (k_scale is not None) == (v_scale is not None)
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and b > 0 and not q.requires_grad):
        # tasks of (sequence, kv heads) reading the cache rows in place: no gathered copy, no casts
        return ext.paged_decode(q if q.stride(-1) == 1 else q.contiguous(), k_cache, v_cache,
                                block_tables.contiguous(), seq_lens.contiguous(), scale, k_scale, v_scale,
                                int(window or 0))
    if meta is None:
        meta = decode_meta(block_tables, seq_lens, bs, blocks_per_step)
    seq_lens, num_blocks = meta.seq_lens, meta.num_blocks
    qg = q.float().reshape(b, hkv, g, d)  # [B, Hkv, G, D]
    dev = q.device
    if num_blocks == 0:
        return q.new_zeros(b, hq, dv)
    if meta.blocks is not None and k_scale is None and v_scale is None and hkv * num_blocks * bs <= _STACKED_MAX:
        return _stacked_heads(q, k_cache, v_cache, meta, scale, window)
    if meta.blocks is not None:  # one chunk (every decode up to BS * blocks_per_step keys): plain softmax
        n = num_blocks * bs
        kc = _gather_blocks(k_cache, k_scale, meta.blocks, b, n)  # [B, Hkv, n, D]
        vc = _gather_blocks(v_cache, v_scale, meta.blocks, b, n)  # [B, Hkv, n, Dv]
        s = torch.matmul(qg, kc.transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, n]
        s.masked_fill_(_masked(meta, bs, window)[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out = torch.matmul(p, vc)  # [B, Hkv, G, Dv]
        if meta.any_empty:  # a sequence with no key: softmax over nothing, zeros by contract
            out.masked_fill_((seq_lens == 0)[:, None, None, None], 0.0)
        return out.view(b, hq, dv).to(q.dtype)
    m = torch.full((b, hkv, g, 1), float("-inf"), device=dev)
    l = torch.zeros(b, hkv, g, 1, device=dev)
    acc = torch.zeros(b, hkv, g, dv, device=dev)
    first = 0  # first block any sequence's window reaches
    if window:
        first = max(0, int((seq_lens - window).clamp(min=0).min()) // bs)
    for c0 in range(first, num_blocks, blocks_per_step):
        c1 = min(c0 + blocks_per_step, num_blocks)
        n = (c1 - c0) * bs
        kc = _gather(k_cache, k_scale, block_tables[:, c0:c1], n)  # [B, Hkv, n, D] float32
        vc = _gather(v_cache, v_scale, block_tables[:, c0:c1], n)  # [B, Hkv, n, Dv] float32
        s = torch.matmul(qg, kc.transpose(-1, -2)) * scale  # [B, Hkv, G, n]
        pos = torch.arange(c0 * bs, c1 * bs, device=dev)
        masked = pos[None, :] >= seq_lens[:, None]  # [B, n]
        if window:
            masked |= pos[None, :] < (seq_lens - window)[:, None]
        s.masked_fill_(masked[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
        p = torch.exp(s - m_safe)  # [B, Hkv, G, n]
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vc)  # [B, Hkv, G, Dv]
        m = m_new
    out = torch.where(l > 0, acc / l.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(acc))
    return out.view(b, hq, dv).to(q.dtype)


# the stacked-heads path computes every query head against every kv head's keys (Hkv x the scores'
# multiply-adds, all tiny at decode) while keys are at most this many rows per sequence
_STACKED_MAX = 1024


def _masked(meta: DecodeMeta, bs: int, window: int | None) -> torch.Tensor:
    # [B, num_blocks * BS] True where a key is hidden: past the sequence's end, or before its window
    if not window:
        return meta.masked
    key = ("masked", window)
    if key not in meta.cache:
        pos = torch.arange(meta.num_blocks * bs, device=meta.seq_lens.device)
        meta.cache[key] = meta.masked | (pos[None, :] < (meta.seq_lens - window)[:, None])
    return meta.cache[key]


def _stacked_heads(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMeta,
                   scale: float, window: int | None = None) -> torch.Tensor:
    # One chunk with the gathered blocks left in cache order: [B, n * Hkv, D], row j = key j // Hkv of
    # kv head j % Hkv. Each query head scores all n * Hkv rows in one bmm; a per-step additive bias puts
    # -inf on other kv heads' rows and on positions past the sequence, so the softmax over the row is
    # exactly the per-head softmax over that head's keys (masked rows weigh 0 in the second bmm). This
    # avoids the transposing gather copies and the 4-D matmul reshapes: 7 ops for the whole attention.
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    dv = v_cache.shape[-1]
    rows = meta.num_blocks * bs * hkv
    kc = _take_rows(k_cache, meta.blocks).view(b, rows, d)
    vc = _take_rows(v_cache, meta.blocks).view(b, rows, dv)
    if kc.dtype != torch.float32:
        kc, vc = kc.float(), vc.float()
    s = torch.baddbmm(_stacked_bias(meta, hq, hkv, bs, window), q.float(), kc.transpose(1, 2),
                      alpha=scale)  # [B, Hq, rows]
    out = torch.bmm(torch.softmax(s, dim=-1), vc)  # [B, Hq, Dv]
    if meta.any_empty:  # a sequence with no key: softmax over nothing, zeros by contract
        out.masked_fill_((meta.seq_lens == 0)[:, None, None], 0.0)
    return out.to(q.dtype)


def _stacked_bias(meta: DecodeMeta, hq: int, hkv: int, bs: int, window: int | None = None) -> torch.Tensor:
    # [B, Hq, n * Hkv] float32: 0 where row j is a key of query head h's kv head before seq_len (and in
    # the window), else -inf
    key = (hq, hkv, window)
    if key not in meta.cache:
        n = meta.num_blocks * bs
        dev = meta.seq_lens.device
        j = torch.arange(n * hkv, device=dev)
        own = (j[None, :] % hkv) == (torch.arange(hq, device=dev)[:, None] // (hq // hkv))  # [Hq, rows]
        keep = own[None] & ((j // hkv)[None, None, :] < meta.seq_lens[:, None, None])  # [B, Hq, rows]
        if window:
            keep &= (j // hkv)[None, None, :] >= (meta.seq_lens - window)[:, None, None]
        meta.cache[key] = torch.zeros(keep.shape, device=dev).masked_fill_(~keep, float("-inf"))
    return meta.cache[key]


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, tables: torch.Tensor, n: int) -> torch.Tensor:
    # whole blocks by index_select along NB (one contiguous copy per block of a contiguous cache; MLA
    # passes a strided slice of its latent), returned as [B, Hkv, n, D] float32
    blocks = tables.reshape(-1).to(torch.long).clamp(min=0)  # [B * c]
    return _gather_blocks(cache, scale, blocks, tables.shape[0], n)


def _gather_blocks(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, b: int,
                   n: int) -> torch.Tensor:
    # float32 [B, Hkv, n, D] made contiguous by the one copy that also converts the dtype, so the two
    # matmuls of the caller read it without copying again (a transposed view made each of them copy)
    _, _, h, d = cache.shape
    x = _take_rows(cache, blocks).view(b, n, h, d)
    if scale is not None:
        x = x.float() * scale.index_select(0, blocks).view(b, n, h, 1).float()
    return torch.empty(b, h, n, d, dtype=torch.float32, device=cache.device).copy_(x.transpose(1, 2))






def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    blocks_per_step: int = 16,
    meta: DecodeMeta | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Reference twin: per sequence, gather contiguous K/V token by token, plain softmax (``meta``,
    the kernel's per-step shortcut, is ignored)."""
    b, hq, _ = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = q.new_zeros(b, hq, v_cache.shape[-1])
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        ks, vs = [], []
        for j in range(max(0, n - window) if window else 0, n):
            blk, off = int(block_tables[i, j // bs]), j % bs
            kj, vj = k_cache[blk, off], v_cache[blk, off]  # [Hkv, D], [Hkv, Dv]
            if k_scale is not None:
                kj = (kj.float() * k_scale[blk, off, :, None]).to(q.dtype)
            if v_scale is not None:
                vj = (vj.float() * v_scale[blk, off, :, None]).to(q.dtype)
            ks.append(kj.to(q.dtype))
            vs.append(vj.to(q.dtype))
        kk = torch.stack(ks).repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, n, D]
        vv = torch.stack(vs).repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, n, Dv]
        scores = torch.matmul(q[i].unsqueeze(1), kk.transpose(1, 2)) * scale  # [Hq, 1, n]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[i] = torch.matmul(probs, vv).squeeze(1)
    return out
