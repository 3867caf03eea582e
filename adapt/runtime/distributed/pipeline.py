"""Pipeline-parallel model runner: layer stages, hidden states over send/recv, micro-batches.

# Legend: T packed tokens of a micro-batch, H hidden, B sequences of the step, V vocabulary.

It stands in for the engine's ModelRunner (same ``prepare`` / ``execute`` / ``step``). A scheduled batch
of several sequences is cut into micro-batches (default ``min(pp, B)``), so stage p works on micro-batch
i + 1 while stage p + 1 works on i. Between stages one tensor travels: the residual stream
``hidden + residual`` [T, H] (the next layer's fused add-norm then gets ``(0, that)``, which is exact),
so a stage boundary sends ``tokens x hidden`` as the planner counts. The last stage's logits [B, V] are
broadcast over the pp group so that every rank's scheduler samples the same tokens. With pp = 1 it only
opens a step for the byte accounting.

Lockstep (dp > 1 with MoE layers, whose all-to-alls span the stage's tp x dp ranks): before every step
each rank says whether it has work (``ctx.any_work``, one flag all-reduced over the stage); a replica
that has none (finished, or given fewer prompts) runs ``idle_step``: every MoE layer of its stage with
0 tokens of its own, still computing the experts it holds for the other replicas' rows. ``drain`` runs
idle steps until no rank of the stage has work: the collective termination. Micro-batches are 1 then,
so that every replica runs each MoE layer once per step.
"""

from __future__ import annotations

import os
import signal

import torch

from adapt.runtime.scheduler import ScheduledBatch

from .context import DistributedContext


def split_batch(sb: ScheduledBatch, parts: int) -> list[ScheduledBatch]:
    """Contiguous micro-batches of a scheduled batch, by sequences (at most ``parts``)."""
    n = len(sb.seqs)
    parts = max(1, min(parts, n))
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [ScheduledBatch(sb.kind, sb.seqs[a:b], sb.block_tables[a:b], sb.slot_mappings[a:b],
                           sb.context_lens[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


class PipelineRunner:
    """A ModelRunner over a DistributedContext: pp stages with micro-batches, every rank gets the logits."""

    def __init__(self, base, ctx: DistributedContext, micro_batches: int | None = None):
        self.base, self.ctx = base, ctx
        self.model, self.kernels, self.device, self.pool = base.model, base.kernels, base.device, base.pool
        self.moe_idle = [m.idle for m in self.model.modules() if hasattr(m, "idle")]  # layer order
        self.lockstep = ctx.dp_size > 1 and bool(self.moe_idle)
        self.micro_batches = 1 if self.lockstep else (micro_batches or ctx.pp_size)
        self.dtype = next(p.dtype for p in self.model.parameters() if not getattr(p, "keep_fp32", False))

    def prepare(self, sb: ScheduledBatch):
        return self.base.prepare(sb)  # its kv list is indexed by global layer

    def step(self, sb: ScheduledBatch) -> torch.Tensor:
        if self.lockstep:
            self.ctx.any_work(True)
        self.ctx.step(sb.kind, len(sb.seqs))
        _inject_fault(self.ctx.rank, len(self.ctx.steps))
        if self.ctx.pp_size == 1:
            return self.base.step(sb)
        mbs = split_batch(sb, self.micro_batches)
        return self._run([self.prepare(mb) for mb in mbs], len(sb.seqs))

    @torch.inference_mode()
    def idle_step(self) -> None:
        """A step with no tokens of this replica: every MoE layer of the stage serves the other replicas."""
        self.ctx.step("idle", 0)
        for idle in self.moe_idle:
            idle(self.kernels, self.dtype, self.device)

    def drain(self) -> int:
        """After this replica's work: idle steps until no rank of the stage has work; returns how many."""
        n = 0
        if self.lockstep:
            while self.ctx.any_work(False):
                self.idle_step()
                n += 1
        return n

    def execute(self, input_ids: torch.Tensor, fb, rows: torch.Tensor | None) -> torch.Tensor:
        if self.ctx.pp_size == 1:
            return self.base.execute(input_ids, fb, rows)
        n = rows.numel() if rows is not None else input_ids.numel()
        return self._run([(input_ids, fb, rows)], n)

    @torch.inference_mode()
    def _run(self, parts, num_rows: int) -> torch.Tensor:
        ctx, model = self.ctx, self.model
        h_size = model.spec.hidden_size
        logits = []
        for ids, fb, rows in parts:
            inter = None
            if not ctx.is_first_stage:
                s = ctx.recv((ids.shape[0], h_size), self.dtype, ctx.pp_rank - 1)
                inter = (torch.zeros_like(s), s)
            out = model(ids, fb, inter)
            if ctx.is_last_stage:
                if rows is not None:
                    out = out.index_select(0, rows)
                logits.append(model.compute_logits(out).float())
            else:
                h, res = out
                ctx.send(h if res is None else h + res, ctx.pp_rank + 1)
        if ctx.is_last_stage:
            out = torch.cat(logits)
        else:
            out = torch.empty(num_rows, model.spec.vocab_size, dtype=torch.float32, device=self.device)
        return ctx.broadcast(out, ctx.stage_peer(ctx.pp_size - 1), group="pp")


def _inject_fault(rank: int, step: int) -> None:
    """Fault injection for the fault tests: ADAPT_INJECT_FAULT=RANK:STEP:kill|raise."""
    spec = os.environ.get("ADAPT_INJECT_FAULT")
    if not spec:
        return
    r, s, how = spec.split(":")
    if int(r) == rank and int(s) == step:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault at step {step}")
