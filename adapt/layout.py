"""WeightLayout: the one declarative table of every tensor a checkpoint holds.

Each row says the HF name, shape, dtype, role, and how the tensor splits under parallelism. Parameter
counts come from it, ``adapt shard`` slices by it, the runtime loader maps by it and ``validate`` checks
against it. Nothing else in adapt spells out checkpoint tensor names.

Split kinds:
  column      dim 0 splits over tensor-parallel ranks (q/k/v, gate/up, their biases)
  row         dim 1 splits over tensor-parallel ranks (o_proj, down_proj)
  vocab       dim 0 (vocabulary) splits over tensor-parallel ranks (embedding, lm_head)
  expert      a routed expert's tensor, owned whole by one expert-parallel rank; ``tp_dim`` says how it
              splits further when the expert-parallel group is smaller than the tensor-parallel one
  replicated  every rank holds all of it (norms, routers, MLA down-projections, vision tower)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from adapt.spec import ModelSpec, ceil_div, dtype_bytes


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    split: str  # column | row | vocab | expert | replicated
    layer: int | None = None  # decoder layer index (MTP layers continue after the last layer)
    expert: int | None = None
    tp_dim: int | None = None  # the dim tensor parallelism slices (column/vocab: 0, row: 1)
    head_size: int | None = None  # rows per attention head along tp_dim: KV heads replicate when tp > heads
    mtp: bool = False
    scale_of: str | None = None  # a quantized weight's companion (scales, zero points, shape) of that tensor
    packed_dim: int | None = None  # int4: eight values to an int32 along this dim (compressed-tensors)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape in the file: ``shape``, or with ``packed_dim`` eight int4 values to an int32."""
        if self.packed_dim is None:
            return self.shape
        s = list(self.shape)
        s[self.packed_dim] = ceil_div(s[self.packed_dim], 8)
        return tuple(s)

    @property
    def stored_dtype(self) -> str:
        return "int32" if self.packed_dim is not None else self.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.stored_shape:
            n *= s
        return int(n * dtype_bytes(self.stored_dtype))

    @property
    def is_param(self) -> bool:
        """A model weight (not a quantized weight's scale, zero point or shape tensor)."""
        return self.scale_of is None


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every weight of the main model (MTP layers excluded)
    active: int  # the weights one token touches: embedding, lm_head, top-k + shared experts, the rest
    embedding: int
    lm_head: int
    mtp: int  # MTP (next-n prediction) layers, counted apart
    vision: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(total=self.total, active=self.active, embedding=self.embedding, lm_head=self.lm_head,
                    mtp=self.mtp, vision=self.vision)


class WeightLayout:
    """The table of every tensor of a model, derived from its ModelSpec."""

    def __init__(self, spec: ModelSpec, tensors: list[TensorSpec]):
        self.spec = spec
        self.tensors: tuple[TensorSpec, ...] = tuple(tensors)
        self.by_name: dict[str, TensorSpec] = {t.name: t for t in self.tensors}
        assert len(self.by_name) == len(self.tensors), "duplicate tensor names in the layout"

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> "WeightLayout":
        return cls(spec, _build(spec))

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, name: str) -> TensorSpec:
        return self.by_name[name]

    def main(self) -> list[TensorSpec]:
        """The tensors of the main model (MTP layers excluded), scales included."""
        return [t for t in self.tensors if not t.mtp]

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        return [t for t in self.tensors if t.layer == layer]

    @cached_property
    def params(self) -> ParamCounts:
        spec = self.spec
        main = [t for t in self.tensors if t.is_param and not t.mtp]
        total = sum(t.numel for t in main)
        embedding = sum(t.numel for t in main if t.role == "embed")
        lm_head = sum(t.numel for t in main if t.role == "lm_head")
        vision = sum(t.numel for t in main if t.role in ("vision", "projector"))
        routed = sum(t.numel for t in main if t.split == "expert")
        active = total - routed
        if spec.moe is not None:
            per_expert = {}
            for t in main:
                if t.split == "expert":
                    per_expert.setdefault(t.layer, 0)
                    per_expert[t.layer] += t.numel
            for layer, n in per_expert.items():
                active += n * spec.moe.top_k // spec.moe.num_experts
        mtp = sum(t.numel for t in self.tensors if t.is_param and t.mtp)
        return ParamCounts(total=total, active=active, embedding=embedding, lm_head=lm_head, mtp=mtp, vision=vision)

    def weight_bytes(self, weights_dtype: str | None = None, include_mtp: bool = False) -> int:
        """Bytes of the checkpoint's weights; with ``weights_dtype`` the big matrices are re-costed.

        FP8 (``float8_e4m3fn``) adds one float32 scale per 128x128 block of every quantizable matrix.
        """
        total = 0.0
        for t in self.tensors:
            if t.mtp and not include_mtp:
                continue
            if weights_dtype is None:
                total += t.nbytes
                continue
            if t.scale_of is not None:
                continue  # re-derived below for the dtype asked for
            quantizable = is_quantizable(t)
            if quantizable:
                total += t.numel * dtype_bytes(weights_dtype)
                if weights_dtype == "float8_e4m3fn":
                    bm, bn = self.spec.quant.block_size if self.spec.quant else (128, 128)
                    total += ceil_div(t.shape[0], bm) * ceil_div(t.shape[1], bn) * 4
            else:
                total += t.numel * dtype_bytes(self.spec.dtype if self.spec.dtype != "float32" else "float32")
        return int(total)


_QUANT_ROLES = {"attn_q", "attn_k", "attn_v", "attn_o", "attn_q_a", "attn_q_b", "attn_kv_a", "attn_kv_b",
                "mlp_gate", "mlp_up", "mlp_down", "expert_gate", "expert_up", "expert_down", "shared_gate",
                "shared_up", "shared_down", "mtp_eh_proj"}


def is_quantizable(t: TensorSpec, lm_head: bool = False) -> bool:
    """Linear weights that an FP8 block-quantized checkpoint stores in FP8 (DeepSeek-V3 convention); with
    ``lm_head``, the untied output head too (``adapt shard --quantize-lm-head``)."""
    return (t.role in _QUANT_ROLES or (lm_head and t.role == "lm_head")) and len(t.shape) == 2


PART_RULES = {"weight_scale_inv": "[ceil(N / block), ceil(K / block)]", "weight_scale": "[N, ceil(K / group)]",
              "weight_zero_point": "[ceil(N / 8), ceil(K / group)] int32", "weight_shape": "[2]"}


def part_rule(name: str) -> str | None:
    """The stored-shape rule of a quantized weight's companion tensor, for error messages: 'weight_scale_inv is
    [ceil(N / block), ceil(K / block)]'; None for other tensors."""
    key = next((k for k in PART_RULES if name.endswith(k)), None)
    return f"{key} is {PART_RULES[key]}" if key else None


def quantized_tensors(q, name: str, shape: tuple[int, int], role: str, split: str, layer, expert, tp_dim,
                      head_size, mtp: bool, scale_dtype: str) -> list[TensorSpec]:
    """The tensors a quantized linear weight ``name`` ([N, K]) is stored as (``QuantSpec``'s formats): the weight
    itself, then its companions, each naming it in ``scale_of``. A per-channel scale [N, 1] follows the weight's
    rows and is whole on ranks that split K; a group or block scale splits along the weight's split dim."""
    n, k = shape
    base = name[: -len("weight")] if name.endswith(".weight") else name + "_"

    def part(pname, pshape, dtype, pdim=tp_dim, packed=None, psplit=split):
        return TensorSpec(pname, pshape, dtype, "scale", psplit, layer, expert, pdim, None, mtp, scale_of=main,
                          packed_dim=packed)

    if q.method == "fp8":
        main = name
        bm, bn = q.block_size
        return [TensorSpec(name, shape, "float8_e4m3fn", role, split, layer, expert, tp_dim, head_size, mtp),
                part(name + "_scale_inv", (ceil_div(n, bm), ceil_div(k, bn)), "float32")]
    if q.group_size and k % q.group_size:
        from adapt.errors import ConfigError

        raise ConfigError(f"{base}weight: group_size {q.group_size} does not divide K = {k} ({k} % {q.group_size} = "
                          f"{k % q.group_size}); {q.fmt} groups must tile each row")
    groups = ceil_div(k, q.group_size) if q.group_size else 1
    gdim = tp_dim if (groups > 1 or tp_dim == 0) else None  # [N, 1] scales are whole where K splits
    if q.bits == 8:
        main = name
        return [TensorSpec(name, shape, "int8", role, split, layer, expert, tp_dim, head_size, mtp),
                part(base + "weight_scale", (n, 1), scale_dtype, gdim)]
    main = base + "weight_packed"
    out = [TensorSpec(main, shape, "int4", role, split, layer, expert, tp_dim, head_size, mtp, packed_dim=1),
           part(base + "weight_scale", (n, groups), scale_dtype, gdim),
           part(base + "weight_shape", (2,), "int64", None, psplit="expert" if split == "expert" else "replicated")]
    if not q.symmetric:
        out.append(part(base + "weight_zero_point", (n, groups), "int4", gdim, packed=0))
    return out


class _Builder:
    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.out: list[TensorSpec] = []
        self.wdtype = spec.weight_dtype
        self.dtype = spec.dtype

    def add(self, name, shape, role, split="replicated", layer=None, expert=None, tp_dim=None, head_size=None,
            mtp=False, quantizable=False):
        shape = tuple(int(s) for s in shape)
        q = self.spec.quant
        if quantizable and q is not None and q.quantizes(name):
            self.out += quantized_tensors(q, name, shape, role, split, layer, expert, tp_dim, head_size, mtp,
                                          self.dtype)
            return
        self.out.append(TensorSpec(name, shape, self.dtype, role, split, layer, expert, tp_dim, head_size, mtp))

    def linear(self, prefix, out_f, in_f, role, split, layer, expert=None, bias=False, head_size=None, mtp=False):
        tp_dim = {"column": 0, "row": 1}.get(split)
        if split == "expert":
            tp_dim = 1 if role.endswith("down") else 0
        self.add(f"{prefix}.weight", (out_f, in_f), role, split, layer, expert, tp_dim, head_size, mtp,
                 quantizable=role in _QUANT_ROLES)
        if bias:
            bsplit = split if split in ("column", "expert") and tp_dim == 0 else "replicated"
            self.add(f"{prefix}.bias", (out_f,), role + "_bias", bsplit, layer, expert,
                     0 if bsplit != "replicated" else None, head_size, mtp)

    def norm(self, name, size, layer=None, mtp=False, role="norm", bias=False):
        self.add(f"{name}.weight", (size,), role, layer=layer, mtp=mtp)
        if bias:
            self.add(f"{name}.bias", (size,), role, layer=layer, mtp=mtp)


def _text_prefix(spec: ModelSpec) -> tuple[str, str]:
    if spec.family == "llava":
        return "language_model.model.", "language_model.lm_head.weight"
    return "model.", "lm_head.weight"


def _attention(b: _Builder, p: str, i: int, mtp: bool) -> None:
    s, a = b.spec, b.spec.attention
    h = s.hidden_size
    if a.kind == "mla":
        if a.q_lora_rank:
            b.linear(f"{p}.q_a_proj", a.q_lora_rank, h, "attn_q_a", "replicated", i, mtp=mtp)
            b.norm(f"{p}.q_a_layernorm", a.q_lora_rank, i, mtp, role="q_a_norm")
            b.linear(f"{p}.q_b_proj", a.num_heads * a.head_dim, a.q_lora_rank, "attn_q_b", "column", i,
                     head_size=a.head_dim, mtp=mtp)
        else:
            b.linear(f"{p}.q_proj", a.num_heads * a.head_dim, h, "attn_q", "column", i, head_size=a.head_dim,
                     mtp=mtp)
        b.linear(f"{p}.kv_a_proj_with_mqa", a.kv_lora_rank + a.qk_rope_head_dim, h, "attn_kv_a", "replicated", i,
                 mtp=mtp)
        b.norm(f"{p}.kv_a_layernorm", a.kv_lora_rank, i, mtp, role="kv_a_norm")
        b.linear(f"{p}.kv_b_proj", a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank, "attn_kv_b",
                 "column", i, head_size=a.qk_nope_head_dim + a.v_head_dim, mtp=mtp)
        b.linear(f"{p}.o_proj", h, a.num_heads * a.v_head_dim, "attn_o", "row", i, bias=a.o_bias,
                 head_size=a.v_head_dim, mtp=mtp)
        return
    d = a.head_dim
    b.linear(f"{p}.q_proj", a.num_heads * d, h, "attn_q", "column", i, bias=a.qkv_bias, head_size=d, mtp=mtp)
    b.linear(f"{p}.k_proj", a.num_kv_heads * d, h, "attn_k", "column", i, bias=a.qkv_bias, head_size=d, mtp=mtp)
    b.linear(f"{p}.v_proj", a.num_kv_heads * d, h, "attn_v", "column", i, bias=a.qkv_bias, head_size=d, mtp=mtp)
    b.linear(f"{p}.o_proj", h, a.num_heads * d, "attn_o", "row", i, bias=a.o_bias, head_size=d, mtp=mtp)
    if a.qk_norm:
        b.norm(f"{p}.q_norm", d, i, mtp, role="q_norm")
        b.norm(f"{p}.k_norm", d, i, mtp, role="k_norm")


def _mlp(b: _Builder, p: str, i: int, inter: int, mtp: bool, names=("gate_proj", "up_proj", "down_proj"),
         kind="mlp", split_in="column", split_out="row", expert=None) -> None:
    h = b.spec.hidden_size
    bias = b.spec.mlp_bias and kind == "mlp"
    g, u, dn = names
    b.linear(f"{p}.{g}", inter, h, f"{kind}_gate", split_in, i, expert, bias=bias, mtp=mtp)
    b.linear(f"{p}.{u}", inter, h, f"{kind}_up", split_in, i, expert, bias=bias, mtp=mtp)
    b.linear(f"{p}.{dn}", h, inter, f"{kind}_down", split_out, i, expert, bias=bias, mtp=mtp)


def _moe(b: _Builder, p: str, i: int, mtp: bool) -> None:
    s, m = b.spec, b.spec.moe
    h = s.hidden_size
    if s.family == "mixtral":
        b.add(f"{p}.block_sparse_moe.gate.weight", (m.num_experts, h), "router", layer=i, mtp=mtp)
        for e in range(m.num_experts):
            _mlp(b, f"{p}.block_sparse_moe.experts.{e}", i, m.intermediate_size, mtp, ("w1", "w3", "w2"), "expert",
                 "expert", "expert", e)
        return
    b.add(f"{p}.mlp.gate.weight", (m.num_experts, h), "router", layer=i, mtp=mtp)
    if m.correction_bias:
        b.add(f"{p}.mlp.gate.e_score_correction_bias", (m.num_experts,), "router_bias", layer=i, mtp=mtp)
    for e in range(m.num_experts):
        _mlp(b, f"{p}.mlp.experts.{e}", i, m.intermediate_size, mtp, kind="expert", split_in="expert",
             split_out="expert", expert=e)
    if m.num_shared_experts and m.shared_intermediate_size:
        name = "shared_experts" if s.family == "deepseek" else "shared_expert"
        _mlp(b, f"{p}.mlp.{name}", i, m.shared_intermediate_size, mtp, kind="shared")
    if m.shared_expert_gate:
        b.add(f"{p}.mlp.shared_expert_gate.weight", (1, h), "shared_expert_gate", layer=i, mtp=mtp)


def _decoder_layer(b: _Builder, prefix: str, i: int, kind: str, mtp: bool = False) -> None:
    s = b.spec
    p = f"{prefix}layers.{i}"
    b.norm(f"{p}.input_layernorm", s.hidden_size, i, mtp)
    _attention(b, f"{p}.self_attn", i, mtp)
    b.norm(f"{p}.post_attention_layernorm", s.hidden_size, i, mtp)
    if kind == "moe":
        _moe(b, p, i, mtp)
    else:
        _mlp(b, f"{p}.mlp", i, s.intermediate_size, mtp)


def _vision(b: _Builder) -> None:
    s, v = b.spec, b.spec.vision
    hv = v.hidden_size
    if v.kind == "clip":
        t = "vision_tower."
        b.add(f"{t}embeddings.class_embedding", (hv,), "vision")
        b.add(f"{t}embeddings.patch_embedding.weight", (hv, v.in_channels, v.patch_size, v.patch_size), "vision")
        b.add(f"{t}embeddings.position_embedding.weight", ((v.image_size // v.patch_size) ** 2 + 1, hv), "vision")
        b.add(f"{t}pre_layrnorm.weight", (hv,), "vision")
        b.add(f"{t}pre_layrnorm.bias", (hv,), "vision")
        for i in range(v.num_layers):
            p = f"{t}encoder.layers.{i}"
            for n in ("layer_norm1", "layer_norm2"):
                b.add(f"{p}.{n}.weight", (hv,), "vision")
                b.add(f"{p}.{n}.bias", (hv,), "vision")
            for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
                b.add(f"{p}.self_attn.{n}.weight", (hv, hv), "vision")
                b.add(f"{p}.self_attn.{n}.bias", (hv,), "vision")
            b.add(f"{p}.mlp.fc1.weight", (v.intermediate_size, hv), "vision")
            b.add(f"{p}.mlp.fc1.bias", (v.intermediate_size,), "vision")
            b.add(f"{p}.mlp.fc2.weight", (hv, v.intermediate_size), "vision")
            b.add(f"{p}.mlp.fc2.bias", (hv,), "vision")
        b.add(f"{t}post_layernorm.weight", (hv,), "vision")
        b.add(f"{t}post_layernorm.bias", (hv,), "vision")
        for n, (o, i_) in (("linear_1", (s.hidden_size, hv)), ("linear_2", (s.hidden_size, s.hidden_size))):
            b.add(f"multi_modal_projector.{n}.weight", (o, i_), "projector")
            if v.projector_bias:
                b.add(f"multi_modal_projector.{n}.bias", (o,), "projector")
        return
    t = "visual."
    b.add(f"{t}patch_embed.proj.weight", (hv, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
          "vision")
    for i in range(v.num_layers):
        p = f"{t}blocks.{i}"
        b.add(f"{p}.norm1.weight", (hv,), "vision")
        b.add(f"{p}.norm2.weight", (hv,), "vision")
        b.add(f"{p}.attn.qkv.weight", (3 * hv, hv), "vision")
        b.add(f"{p}.attn.qkv.bias", (3 * hv,), "vision")
        b.add(f"{p}.attn.proj.weight", (hv, hv), "vision")
        b.add(f"{p}.attn.proj.bias", (hv,), "vision")
        for n, shape in (("gate_proj", (v.intermediate_size, hv)), ("up_proj", (v.intermediate_size, hv)),
                         ("down_proj", (hv, v.intermediate_size))):
            b.add(f"{p}.mlp.{n}.weight", shape, "vision")
            b.add(f"{p}.mlp.{n}.bias", (shape[0],), "vision")
    merged = hv * v.spatial_merge_size ** 2
    b.add(f"{t}merger.ln_q.weight", (hv,), "projector")
    b.add(f"{t}merger.mlp.0.weight", (merged, merged), "projector")
    b.add(f"{t}merger.mlp.0.bias", (merged,), "projector")
    b.add(f"{t}merger.mlp.2.weight", (v.out_hidden_size, merged), "projector")
    b.add(f"{t}merger.mlp.2.bias", (v.out_hidden_size,), "projector")


def _build(spec: ModelSpec) -> list[TensorSpec]:
    b = _Builder(spec)
    prefix, head = _text_prefix(spec)
    h, vocab = spec.hidden_size, spec.vocab_size
    b.add(f"{prefix}embed_tokens.weight", (vocab, h), "embed", "vocab", tp_dim=0)
    for i, kind in enumerate(spec.layer_kinds):
        _decoder_layer(b, prefix, i, kind)
    b.norm(f"{prefix}norm", h)
    if not spec.tie_word_embeddings:
        # compressed-tensors quantizes every Linear its config targets that ``ignore`` does not list, lm_head
        # included (llm-compressor writes ignore: [lm_head] to keep it); DeepSeek's fp8 keeps lm_head in bf16
        ct = spec.quant is not None and spec.quant.method == "compressed-tensors"
        b.add(head, (vocab, h), "lm_head", "vocab", tp_dim=0, quantizable=ct)
    if spec.vision is not None:
        _vision(b)
    # DeepSeek-V3 MTP modules (num_nextn_predict_layers), stored as layers after the last decoder layer.
    for j in range(spec.num_mtp_layers):
        i = spec.num_layers + j
        p = f"{prefix}layers.{i}"
        b.add(f"{p}.embed_tokens.weight", (vocab, h), "mtp_embed", "vocab", layer=i, tp_dim=0, mtp=True)
        b.norm(f"{p}.enorm", h, i, mtp=True)
        b.norm(f"{p}.hnorm", h, i, mtp=True)
        b.linear(f"{p}.eh_proj", h, 2 * h, "mtp_eh_proj", "replicated", i, mtp=True)
        _decoder_layer(b, prefix, i, "moe" if spec.moe else "dense", mtp=True)
        b.norm(f"{p}.shared_head.norm", h, i, mtp=True)
        b.add(f"{p}.shared_head.head.weight", (vocab, h), "mtp_head", "vocab", layer=i, tp_dim=0, mtp=True)
    return b.out
