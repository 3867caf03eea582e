"""Qwen2.5-VL's M-RoPE positions for the language model: three streams (temporal, height, width).

Text tokens take the same position in all three streams, counting on from the previous token. An
image's placeholder tokens (one per merged patch, row-major over its (h/m) x (w/m) grid) take
t = start, h = start + row, w = start + column, where start is the position after the text before it;
text after the image continues from max(image positions) + 1. ``delta`` = (max position + 1) - prompt
length: a decode token at sequence index i takes position i + delta in all three streams.

In the attention, cos/sin are computed per stream and ``mrope_section`` (in frequencies; doubled for the
rotate-half layout) says which stream each band of frequencies reads: [t, h, w, t, h, w].
"""

from __future__ import annotations

import torch


def mrope_positions(token_ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]], m: int
                    ) -> tuple[list[list[int]], int]:
    """([3][T] positions, delta) of a prompt whose image placeholder runs are in ``grids`` order."""
    t, h, w = [], [], []
    pos, i, img, n = 0, 0, 0, len(token_ids)
    while i < n:
        if token_ids[i] != image_token_id:
            t.append(pos), h.append(pos), w.append(pos)
            pos += 1
            i += 1
            continue
        gt, gh, gw = grids[img]
        gh, gw = gh // m, gw // m
        for f in range(gt):
            for r in range(gh):
                for c in range(gw):
                    t.append(pos + f), h.append(pos + r), w.append(pos + c)
        i += gt * gh * gw
        pos += max(gh, gw)  # transformers: the next text position after a still image
        img += 1
    top = max(max(t), max(h), max(w)) if t else -1
    return [t, h, w], top + 1 - n


def mrope_cos_sin(rotary, positions: torch.Tensor, kernels, section: tuple[int, ...], dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, Dr] from positions [3, T]: each frequency band from its stream."""
    three, t = positions.shape
    cos, sin = kernels.rope_cos_sin(rotary.freq_on(positions.device), positions.reshape(-1), rotary.factor, dtype)
    cos, sin = cos.view(three, t, -1), sin.view(three, t, -1)
    bands = list(section) * 2
    return (torch.cat([c[j % 3] for j, c in enumerate(cos.split(bands, dim=-1))], dim=-1),
            torch.cat([s[j % 3] for j, s in enumerate(sin.split(bands, dim=-1))], dim=-1))
