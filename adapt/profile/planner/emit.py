"""The vLLM / SGLang launch flags equivalent to a layout (as those engines spell them).

vLLM: ``--enable-expert-parallel`` makes the expert-parallel group tp x dp, so adapt's ep = tp x dp maps to
it and ep = 1 to its default (experts tensor-parallel); other ep values have no vLLM equivalent.
SGLang: ``--tp-size`` is the ranks of a stage (tp x dp); with ``--enable-dp-attention`` attention runs
``--dp-size`` data-parallel groups of tp-size/dp-size ranks; ``--ep-size`` sets the expert-parallel degree.
"""

from __future__ import annotations

import shlex

from adapt.errors import PlanError

ENGINES = ("vllm", "sglang")
_KV = {"float8_e4m3fn": "fp8_e4m3", "bfloat16": "auto", "float16": "auto"}


def launch_flags(engine: str, model: str, tp: int, pp: int, ep: int, dp: int, nodes: int, context: int,
                 concurrency: int, memory_utilization: float, kv_dtype: str = "bfloat16") -> list[str]:
    """Command lines (one per line; comments start with #) launching the layout on the engine."""
    if engine not in ENGINES:
        raise PlanError(f"--emit must be one of {', '.join(ENGINES)}; got {engine!r}")
    q = shlex.quote(model)
    kv = _KV.get(kv_dtype, kv_dtype)
    lines = []
    if engine == "vllm":
        args = [f"vllm serve {q}", f"--tensor-parallel-size {tp}", f"--pipeline-parallel-size {pp}"]
        if dp > 1:
            args.append(f"--data-parallel-size {dp}")
        if ep > 1:
            if ep != tp * dp:
                lines.append(f"# vLLM's expert parallelism spans tp x dp = {tp * dp} ranks; ep={ep} has no "
                             "vLLM equivalent (nearest: --enable-expert-parallel)")
            args.append("--enable-expert-parallel")
        args += [f"--max-model-len {context}", f"--max-num-seqs {concurrency}",
                 f"--gpu-memory-utilization {memory_utilization:g}"]
        if kv != "auto":
            args.append(f"--kv-cache-dtype {kv}")
        if nodes > 1:
            lines.append(f"# {nodes} nodes: start a Ray cluster spanning them first (vLLM multi-node serving)")
        lines.append(" ".join(args))
        return lines
    args = [f"python -m sglang.launch_server --model-path {q}", f"--tp-size {tp * dp}"]
    if dp > 1:
        args += [f"--dp-size {dp}", "--enable-dp-attention"]
    if ep > 1:
        args.append(f"--ep-size {ep}")
    if pp > 1:
        args.append(f"--pp-size {pp}")
    args += [f"--context-length {context}", f"--max-running-requests {concurrency}",
             f"--mem-fraction-static {memory_utilization:g}"]
    if kv != "auto":
        args.append(f"--kv-cache-dtype {kv}")
    if nodes > 1:
        args += [f"--nnodes {nodes}", "--node-rank $NODE_RANK", "--dist-init-addr $MASTER_ADDR:5000"]
    lines.append(" ".join(args))
    return lines
