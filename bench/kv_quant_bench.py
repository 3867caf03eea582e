"""int8 KV cache against the bf16 cache on the built-in tiny models: bytes per token, top-1 agreement, KL.

Both engines run in bfloat16 on the same prompts; the int8 run is teacher-forced with the bf16 run's
greedy tokens, so every decode step compares next-token distributions over the same context.
Prints JSON: per model, KV bytes per token (int8 / bf16), top-1 agreement and mean / max
KL(p_bf16 || p_int8) over all decode steps.

    python bench/kv_quant_bench.py [--device cpu] [--steps 32] [--prompts 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapt.runtime.engine import Engine  # noqa: E402
from adapt.runtime.init_model import init_model  # noqa: E402
from adapt.runtime.sampling import SamplingParams  # noqa: E402
from adapt.runtime.scheduler import Scheduler  # noqa: E402


def step_logits(eng: Engine, prompts, steps, forced=None):
    """Logits [steps, V] per prompt over the decode; tokens are greedy, or ``forced[i]`` when given."""
    sched = Scheduler(eng.block_manager, eos_token_ids=())
    p = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    seqs = [sched.add(list(x), p) for x in prompts]
    logs = {s.seq_id: [] for s in seqs}
    while sched.has_unfinished:
        sb = sched.schedule()
        logits = eng.runner.step(sb)
        toks = []
        for row, s in zip(logits, sb.seqs):
            logs[s.seq_id].append(row)
            i = seqs.index(s)
            k = len(s.output_ids)
            toks.append(int(forced[i][k]) if forced is not None else int(row.argmax()))
        sched.postprocess(sb.seqs, toks)
    out = [torch.stack(logs[s.seq_id]) for s in seqs]
    return out, [s.output_ids for s in seqs]


def compare(path: Path, device: str, steps: int, n_prompts: int) -> dict:
    ref = Engine.from_pretrained(path, device=device, dtype="bfloat16", kv_cache_memory="64MiB")
    q = Engine.from_pretrained(path, device=device, dtype="bfloat16", kv_cache_memory="64MiB", kv_cache_dtype="int8")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, ref.spec.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 64, (n_prompts,), generator=g)]
    a, toks = step_logits(ref, prompts, steps)
    b, _ = step_logits(q, prompts, steps, forced=toks)
    la, lb = torch.cat(a).float(), torch.cat(b).float()
    pa, lpa, lpb = la.softmax(-1), la.log_softmax(-1), lb.log_softmax(-1)
    kl = (pa * (lpa - lpb)).sum(-1)
    return {
        "kv_bytes_per_token_bf16": ref.pool.bytes_per_token,
        "kv_bytes_per_token_int8": q.pool.bytes_per_token,
        "bytes_ratio": round(q.pool.bytes_per_token / ref.pool.bytes_per_token, 4),
        "positions": int(la.shape[0]),
        "top1_agreement": round((la.argmax(-1) == lb.argmax(-1)).float().mean().item(), 4),
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "logit_max_abs_diff": (la - lb).abs().max().item(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--models", default="tiny-k2,tiny-llama,tiny-qwen3-moe")
    args = ap.parse_args()
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = init_model(name, Path(tmp) / name)
            report[name] = compare(path, args.device, args.steps, args.prompts)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
