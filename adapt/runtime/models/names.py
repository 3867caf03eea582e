"""Checkpoint names from the WeightLayout: a layer asks for its tensors by (layer, role, expert).

The WeightLayout is the one table of tensor names; model files never spell a name themselves.
Roles are the layout's (``attn_q``, ``attn_q_bias``, ``mlp_gate``, ``expert_up``, ``router`` ...); a
layer's two RMSNorms share the role ``norm`` and come in layout order (input, post-attention).
"""

from __future__ import annotations

from collections import defaultdict

from adapt.errors import CheckpointError
from adapt.layout import WeightLayout


class LayoutNames:
    """Index of a layout's main (non-MTP) tensors by (layer, role, expert)."""

    def __init__(self, layout: WeightLayout):
        self.index: dict[tuple, list[str]] = defaultdict(list)
        for t in layout.main():
            if t.is_param:
                self.index[(t.layer, t.role, t.expert)].append(t.name)

    def get(self, layer: int | None, role: str, expert: int | None = None, nth: int = 0) -> str | None:
        names = self.index.get((layer, role, expert), [])
        return names[nth] if nth < len(names) else None

    def __call__(self, layer: int | None, role: str, expert: int | None = None, nth: int = 0) -> str:
        name = self.get(layer, role, expert, nth)
        if name is None:
            raise CheckpointError(f"the weight layout has no {role!r} tensor for layer {layer}"
                                  + (f" expert {expert}" if expert is not None else ""))
        return name
