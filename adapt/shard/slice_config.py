"""The config.json of a slice: fewer layers and experts, every key that depends on them adjusted and stated.

``slice_config`` returns the new config and the list of adjustments (key, from, to, why). The result is
checked by parsing it back into a ModelSpec: the slice's layer kinds (dense / MoE) and sliding windows must
be the chosen source layers', or the selection cannot be expressed and is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from adapt.errors import ConfigError
from adapt.spec import ModelSpec

_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def parse_ids(text: str, what: str, limit: int) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; each id in [0, limit)."""
    out: list[int] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise ConfigError(f"--{what} takes ids and ranges like 0-3,8; got {text!r}") from None
        if a > b:
            raise ConfigError(f"--{what}: range {part} runs backwards")
        out.extend(range(a, b + 1))
    if not out:
        raise ConfigError(f"--{what}: no ids in {text!r}")
    bad = [i for i in out if not 0 <= i < limit]
    if bad:
        raise ConfigError(f"--{what}: {bad[0]} is out of range (the model has {limit})")
    if len(set(out)) != len(out):
        raise ConfigError(f"--{what}: {text!r} names an id twice")
    return sorted(out)


def _set(cfg: dict, adj: list, key: str, value: Any, why: str) -> None:
    if cfg.get(key) != value:
        adj.append({"key": key, "from": cfg.get(key), "to": value, "why": why})
        cfg[key] = value


def _groups(spec: ModelSpec, experts: Sequence[int]) -> tuple[int, int, str]:
    """(n_group, topk_group, why) for a kept expert set under group-limited routing."""
    m = spec.moe
    size = m.num_experts // m.n_group
    kept = {e // size for e in experts}
    whole = all(sum(1 for e in experts if e // size == g) == size for g in kept)
    if whole and size >= 2:
        return len(kept), min(m.topk_group, len(kept)), "the kept experts are whole routing groups"
    return 1, 1, "the kept experts are not whole routing groups: one group, routing is plain top-k over them"


def slice_config(cfg: dict, layers: Sequence[int], experts: Sequence[int] | None,
                 keep_mtp: bool) -> tuple[dict, list[dict]]:
    """The slice's config and its adjustments; ConfigError when the selection cannot be expressed."""
    spec = ModelSpec.from_hf_config(cfg)
    new = copy.deepcopy(cfg)
    adj: list[dict] = []
    n = len(layers)
    _set(new, adj, "num_hidden_layers", n, f"layers {list(layers)} kept")
    kinds = [spec.layer_kinds[i] for i in layers]
    if isinstance(new.get("layer_types"), list):
        _set(new, adj, "layer_types", [cfg["layer_types"][i] for i in layers], "the kept layers' types")
    if "max_window_layers" in new and spec.attention.window_layers is not None:
        kept = [j for j, i in enumerate(layers) if i in spec.attention.window_layers]
        if kept and kept != list(range(kept[0], n)):
            raise ConfigError("the kept layers' sliding windows cannot be expressed by max_window_layers")
        _set(new, adj, "max_window_layers", kept[0] if kept else n, "the kept layers' sliding windows")
    if spec.moe is not None:
        if "first_k_dense_replace" in cfg:
            lead = next((j for j, k in enumerate(kinds) if k == "moe"), n)
            _set(new, adj, "first_k_dense_replace", lead, "dense layers lead the kept layers")
            if "moe_layer_freq" in cfg:
                _set(new, adj, "moe_layer_freq", 1, "every kept layer after the dense ones is MoE")
        if "mlp_only_layers" in cfg or "decoder_sparse_step" in cfg:
            _set(new, adj, "decoder_sparse_step", 1, "layer kinds given by mlp_only_layers")
            _set(new, adj, "mlp_only_layers", [j for j, k in enumerate(kinds) if k == "dense"],
                 "the kept dense layers")
    elif experts is not None:
        raise ConfigError(f"--experts: {spec.model_type} has no routed experts")
    if spec.moe is not None and experts is not None:
        k = len(experts)
        key = next((x for x in _EXPERT_KEYS if x in cfg), "num_experts")
        _set(new, adj, key, k, f"experts {list(experts)} kept, renumbered 0-{k - 1}")
        _set(new, adj, "num_experts_per_tok", min(spec.moe.top_k, k), "top-k cannot exceed the experts kept")
        if spec.moe.n_group > 1 or "n_group" in cfg:
            g, tg, why = _groups(spec, experts)
            if k // g < 2 and spec.moe.scoring == "sigmoid":
                raise ConfigError("--experts: keep at least 2 experts (group scores sum each group's top 2)")
            _set(new, adj, "n_group", g, why)
            _set(new, adj, "topk_group", tg, why)
    mtp = spec.num_mtp_layers
    if mtp and not keep_mtp:
        _set(new, adj, "num_nextn_predict_layers", 0, "MTP layers dropped (--keep-mtp keeps them)")
    got = ModelSpec.from_hf_config(new)
    if list(got.layer_kinds) != kinds:
        raise ConfigError(f"the kept layers' kinds {kinds} cannot be expressed in {spec.model_type}'s config "
                          f"(it would give {list(got.layer_kinds)}); keep dense layers before MoE layers")
    for j, i in enumerate(layers):
        if got.attention.window_of(j) != spec.attention.window_of(i):
            raise ConfigError(f"layer {i}'s sliding window cannot be kept at slice layer {j}")
    return new, adj
