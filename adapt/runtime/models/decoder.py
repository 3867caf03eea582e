"""The decoder skeleton every family shares: embedding, pre-norm decoder layers, final norm, lm_head.

A family file (llama.py, deepseek.py) says which attention a layer has and how rope is laid out;
dense or MoE feed-forward follows ``spec.layer_kinds``. Only ``ctx.layers`` are built; the first
stage holds the embedding, the last the final norm and lm_head (pipeline parallelism passes
``(hidden, residual)`` between stages through ``forward``).

Captured intermediates (``ForwardBatch.capture``), [T, H] each unless noted:
  embed                      the embedding output (transformers' hidden_states[0])
  layers.{i}.input_norm      input RMSNorm output
  layers.{i}.attn            self-attention output, after o_proj
  layers.{i}.post_attn_norm  post-attention RMSNorm output
  layers.{i}.router_logits   MoE layers: router logits [T, E]
  layers.{i}.mlp             MLP / MoE block output (shared experts included)
  layers.{i}                 the layer's output, residual included (transformers' hidden_states[i + 1])
  norm                       the final RMSNorm output (transformers' last hidden_states entry)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from adapt.errors import UnsupportedModelError
from adapt.layout import WeightLayout
from adapt.runtime.models.batch import ForwardBatch
from adapt.runtime.models.layers import ParallelLMHead, RMSNorm, VocabParallelEmbedding
from adapt.runtime.models.mlp import DenseMLP
from adapt.runtime.models.moe import MoE
from adapt.runtime.models.names import LayoutNames
from adapt.runtime.parallel import ParallelContext
from adapt.spec import ModelSpec
from adapt.runtime.module import Module


class DecoderLayer(Module):
    def __init__(self, spec: ModelSpec, n: LayoutNames, i: int, attn: nn.Module, ctx: ParallelContext):
        super().__init__()
        self.index = i
        self.input_norm = RMSNorm(n(i, "norm", nth=0), spec.hidden_size, spec.rms_norm_eps)
        self.attn = attn
        self.post_attn_norm = RMSNorm(n(i, "norm", nth=1), spec.hidden_size, spec.rms_norm_eps)
        if spec.layer_kinds[i] == "moe":
            self.mlp = MoE(spec, n, i, ctx)
        else:
            self.mlp = DenseMLP(n, i, spec.hidden_size, spec.intermediate_size, ctx)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch):
        """x: the previous layer's MLP output (or the embedding when residual is None)."""
        k, i = batch.kernels, self.index
        if residual is None:
            residual, h = x, k.rms_norm(x, self.input_norm.weight, self.input_norm.eps)
        else:
            h, residual = k.fused_add_rms_norm(x, residual, self.input_norm.weight, self.input_norm.eps)
        capture = batch.capture is not None  # the names are formatted only when hidden states are taken
        if capture:
            batch.record(f"layers.{i}.input_norm", h)
        a = self.attn(h, batch, i)
        if capture:
            batch.record(f"layers.{i}.attn", a)
        h, residual = k.fused_add_rms_norm(a, residual, self.post_attn_norm.weight, self.post_attn_norm.eps)
        if capture:
            batch.record(f"layers.{i}.post_attn_norm", h)
        m = self.mlp(h, batch)
        if capture:
            batch.record(f"layers.{i}.mlp", m)
            batch.record(f"layers.{i}", residual + m)
        return m, residual


class CausalLM(Module):
    """Base of the family models: subclasses define ``make_attention`` and ``setup_rope``."""

    def __init__(self, spec: ModelSpec, layout: WeightLayout, ctx: ParallelContext, kernels):
        super().__init__()
        if spec.hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act {spec.hidden_act!r} is not supported (silu only)")
        self.spec, self.ctx = spec, ctx
        n = LayoutNames(layout)
        start, stop = ctx.layers if ctx.layers is not None else (0, spec.num_layers)
        self.layer_range = (start, stop)
        first = ctx.is_first_stage
        last = ctx.is_last_stage
        self.embed = (VocabParallelEmbedding(n(None, "embed"), spec.vocab_size, spec.hidden_size, ctx)
                      if first or (last and spec.tie_word_embeddings) else None)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, n, i, self.make_attention(spec, n, i, ctx), ctx) for i in range(start, stop))
        self.norm = RMSNorm(n(None, "norm"), spec.hidden_size, spec.rms_norm_eps) if last else None
        self.lm_head = None
        if last:
            tied = self.embed if spec.tie_word_embeddings else None
            self.lm_head = ParallelLMHead(n.get(None, "lm_head"), spec.vocab_size, spec.hidden_size, ctx, tied)
        self.setup_rope(spec, kernels)

    def make_attention(self, spec: ModelSpec, n: LayoutNames, i: int, ctx: ParallelContext) -> nn.Module:
        raise NotImplementedError

    def setup_rope(self, spec: ModelSpec, kernels) -> None:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """input_ids [T] -> final hidden states [T, H] on the last stage, else (hidden, residual) for the
        next stage; a later stage passes the previous stage's pair as ``intermediate``."""
        if intermediate is None:
            h, residual = self.embed(input_ids), None
            if batch.mm_embeds is not None:  # image features replace their placeholder tokens' embeddings
                rows, feats = batch.mm_embeds
                h = h.index_copy(0, rows, feats.to(h.dtype))
            batch.record("embed", h)
        else:
            h, residual = intermediate
        for layer in self.layers:
            h, residual = layer(h, residual, batch)
        if self.norm is None:
            return h, residual
        if residual is None:  # a stage with no layers
            out = batch.kernels.rms_norm(h, self.norm.weight, self.norm.eps)
        else:
            out, _ = batch.kernels.fused_add_rms_norm(h, residual, self.norm.weight, self.norm.eps)
        batch.record("norm", out)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] (gathered over tp)."""
        return self.lm_head(hidden)
