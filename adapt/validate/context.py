"""What every check receives: the target, the reference, the dtype, and memoized runs of both.

Several items read the same runs (five text-inference items share one prefill per prompt), so the
target's answers are computed once here. A check that needs a stage which is missing calls
``need_runner()`` and the item becomes ``skip`` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from adapt.validate.checklist import Skip, normalize_dtype
from adapt.validate.target import Generation, ModelRunner, Target


@dataclass
class ValidationContext:
    target: Target
    reference: Any  # reference.HFReference | golden.GoldenReference
    dtype: str = "float32"
    device: str = "cpu"
    first_divergence: dict[str, Any] | None = None
    layer_curve: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    _memo: dict[tuple, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dtype = normalize_dtype(self.dtype)

    def need_runner(self) -> ModelRunner:
        if self.target.runner is None:
            raise Skip(self.target.reason or "no target runtime")
        return self.target.runner

    def memo(self, key: tuple, fn):
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    @property
    def prompts(self) -> list[list[int]]:
        return self.reference.prompts

    def target_logits(self, i: int) -> torch.Tensor:
        run = self.need_runner()
        return self.memo(("logits", i), lambda: run.prefill_logits(self.prompts[i]))

    def target_generation(self, i: int, max_new_tokens: int, top_n: int) -> Generation:
        run = self.need_runner()
        return self.memo(("gen", i, max_new_tokens, top_n),
                         lambda: run.generate_greedy(self.prompts[i], max_new_tokens, top_n))

    def target_layers(self, i: int) -> dict[str, torch.Tensor]:
        run = self.need_runner()
        return self.memo(("layers", i), lambda: run.layer_outputs(self.prompts[i]))

    def plain_torch(self):
        """transformers at the target dtype on CPU (the 2x rule's "plain torch"), or Skip."""
        p = self.reference.plain_torch(self.dtype)
        if p is None:
            raise Skip(f"{self.dtype} thresholds compare against plain torch in {self.dtype}, which needs a "
                       "transformers reference (--reference HF_DIR), not a golden directory")
        return p

    def plain_logits(self, i: int) -> torch.Tensor:
        p = self.plain_torch()
        return self.memo(("plain_logits", i), lambda: p.prefill_logits(self.prompts[i]))

    def plain_layers(self, i: int) -> dict[str, torch.Tensor]:
        p = self.plain_torch()
        return self.memo(("plain_layers", i), lambda: p.layer_outputs(self.prompts[i]))

    @property
    def low_precision(self) -> bool:
        return self.dtype != "float32"
