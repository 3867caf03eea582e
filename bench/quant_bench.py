"""Decode with weights held quantized (int8 per channel, int4 groups) against bf16 on the same model, adapt's engine.

Builds the dense ~120M llama-shaped model and the MoE model of bench/runtime_bench.py (its builders), writes
int8 and int4 copies of each with ``adapt shard --quantize`` (the same function in-process; compressed-tensors,
lm_head kept unquantized as that format's default ``ignore`` does) and, with ``--lm-head both`` (the default),
int8+lm_head / int4+lm_head copies with ``--quantize-lm-head`` (a tied head untied: lm_head quantized, the
embedding kept in bf16 for the lookup), each also with ``--activations int8`` (W8A8 / W4A8: "-a8" forms, the
linears' inputs quantized to int8 per token, as llama.cpp's Q8_0 / Q4_0 quantize theirs to Q8). It times batch-1 and batch-16 greedy decode tokens/s of the forms in
rounds whose order alternates, so that all see the same state of a shared host; each ratio is the median of
the per-round ratios. Prints one JSON document with the weight bytes each form holds, the bytes one decode
step reads (the weights less an embedding that only has rows looked up: the batch-1 ceiling's numerator) and
the goals (issue 30: int8 >= 1.6x and int4 >= 2.5x bf16 at batch 1).

llama.cpp is the second peer where llama-cpp-python and gguf import (this bench installs nothing; without them
the report says the peer is absent): bench/gguf_peer.py writes the same weights as GGUF BF16 / Q8_0 / Q4_0
(and F32, checked against adapt float32: logits and greedy tokens), and llama.cpp's greedy decode at the same
batch sizes, prompts, token counts and threads runs in the same alternated rounds; ratios adapt bf16 / BF16,
int8 / Q8_0, int4 / Q4_0 (with and without lm_head quantized), and top-1 agreement of every form with adapt
float32 on one 64-token prompt.

    python bench/quant_bench.py [--models dense,moe] [--decode-tokens 32] [--rounds 5] [--group-size 128]
                                [--lm-head both|plain|quantized] [--activations both|none|int8]
    python bench/quant_bench.py --smoke   # tiny models, one round: checks the bench runs, no figures to read
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gguf_peer  # noqa: E402
from runtime_bench import DENSE, MOE, build  # noqa: E402

from adapt.runtime.engine import Engine  # noqa: E402
from adapt.runtime.sampling import SamplingParams  # noqa: E402
from adapt.runtime.tactics import host  # noqa: E402
from adapt.shard.run import shard  # noqa: E402

# form -> (--quantize, --quantize-lm-head, --activations): weight-only (W8A16, W4A16) and with the linears' inputs
# quantized to int8 per token (W8A8, W4A8: "-a8", the int8 dot llama.cpp's Q8_0 / Q4_0 also run)
QUANTS = {f"{q}{a}{h}": (q, bool(h), "int8" if a else "none")
          for a in ("", "-a8") for h in ("", "+lm_head") for q in ("int8", "int4")}
GOALS_B1 = {"int8": 1.6, "int4": 2.5}
SMOKE = {"dense": dict(DENSE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512),
         "moe": dict(MOE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512, num_experts=8, moe_intermediate_size=32)}


def prompts(b, n, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(30000, vocab), (b, n), generator=g).tolist()


def decode_tok_s(eng, ps, n) -> float:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    eng.generate(ps, sp)
    return eng.last_stats["decode_tokens_per_s"]


def read_bytes(eng) -> int:
    """Weight bytes one decode step reads: all it holds, less an embedding that is not also the head (only its
    looked-up rows are read)."""
    m = eng.model
    untied = m.embed is not None and m.lm_head is not None and m.lm_head.tied is None
    return eng.weight_bytes - (m.embed.weight.numel() * m.embed.weight.element_size() if untied else 0)


def bench_model(name, cfg, args, tmp: Path):
    hf, n_params = build(cfg, tmp / name)
    del hf
    src = tmp / name
    paths = {"bf16": src}
    quants = [f for f in QUANTS if (args.lm_head == "both" or QUANTS[f][1] == (args.lm_head == "quantized"))
              and (args.activations == "both" or QUANTS[f][2] == args.activations)]
    forms = ["bf16"] + quants
    for f in quants:
        q, head, act = QUANTS[f]
        t = time.perf_counter()
        paths[f] = tmp / f"{name}-{f}"
        shard(src, paths[f], quantize=q, group_size=args.group_size, quantize_lm_head=head, activations=act)
        print(f"# {name}: shard --quantize {q}{' --quantize-lm-head' * head} --activations {act} in "
              f"{time.perf_counter() - t:.1f}s", file=sys.stderr)
    engines = {f: Engine.from_pretrained(paths[f], dtype="bfloat16", kv_cache_memory="512MiB") for f in forms}
    res = {"params": n_params}
    n = args.decode_tokens
    for f, eng in engines.items():
        decode_tok_s(eng, prompts(1, 8, 0, cfg["vocab_size"]), 4)  # warm-up, and last_stats filled
        res.setdefault("weight_bytes", {})[f] = eng.weight_bytes  # resident, as stats.weight_bytes reports
        res.setdefault("read_bytes_per_step", {})[f] = read_bytes(eng)
        res.setdefault("weights", {})[f] = eng.weights_held
    timers = {f: (lambda ps, n, e=e: decode_tok_s(e, ps, n)) for f, e in engines.items()}
    peers, res["llama_cpp"] = llama_cpp(src, tmp / f"{name}-gguf", engines, args, cfg["vocab_size"])
    timers |= {f: (lambda ps, n, m=m: m.generate(ps, n)[1]) for f, m in peers.items()}
    for b in args.batches:
        ps = prompts(b, 16, b, cfg["vocab_size"])
        for t in timers.values():
            t(ps, n)  # warm-up at this batch
        rounds = []
        for r in range(args.rounds):
            order = list(timers) if r % 2 == 0 else list(timers)[::-1]  # alternate: no form always after another
            rounds.append({f: timers[f](ps, n) for f in order})
        row = {f"{f}_tok_s": round(statistics.median(x[f] for x in rounds), 2) for f in timers}
        for q in quants:
            row[f"{q}_vs_bf16"] = round(statistics.median(x[q] / x["bf16"] for x in rounds), 3)
            row[f"{q}_vs_bf16_per_round"] = [round(x[q] / x["bf16"], 3) for x in rounds]
        for f, peer in gguf_peer.VERSUS.items():
            if f in engines and peer in peers:
                row[f"{f}_vs_{peer}"] = round(statistics.median(x[f] / x[peer] for x in rounds), 3)
                row[f"{f}_vs_{peer}_per_round"] = [round(x[f] / x[peer], 3) for x in rounds]
        res[f"decode_b{b}"] = row
    # the batch-1 ceiling the bytes set, if decode read nothing but the weights once a step
    rb = res["read_bytes_per_step"]
    res["bytes_ratio_vs_bf16"] = {q: round(rb["bf16"] / rb[q], 3) for q in quants}
    for m in peers.values():
        m.close()
    return res


def llama_cpp(src: Path, tmp: Path, engines: dict, args, vocab: int):
    """llama.cpp's BF16 / Q8_0 / Q4_0 of the same weights (bench/gguf_peer.py), timed beside adapt's forms, and
    its report: the F32 GGUF checked against adapt float32, top-1 agreement of every form with adapt float32."""
    why = gguf_peer.absent()
    if why or args.no_llama_cpp:
        return {}, {"absent": why or "--no-llama-cpp"}
    tmp.mkdir()
    ref = Engine.from_pretrained(src, dtype="float32", kv_cache_memory="128MiB")
    ids = prompts(1, 64, 99, vocab)[0]
    seq_len = max(len(ids), 16 + args.decode_tokens) + 16
    peers, rep = gguf_peer.open_peers(src, tmp, ref, torch.get_num_threads(), seq_len, ids)
    rep["top1_vs_adapt_fp32"] = gguf_peer.top1_agreement(ref, engines, peers, ids)
    n_params = sum(e.numel() for e in ref.model.state_dict().values()) if hasattr(ref.model, "state_dict") else None
    rep["bytes_per_param"] = {f: round(e.weight_bytes / n_params, 4) for f, e in engines.items()} | {
        f: round(b / n_params, 4) for f, b in rep["file_bytes"].items()} if n_params else None
    return peers, rep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--lm-head", default="both", choices=("both", "plain", "quantized"),
                    help="quantized forms with lm_head kept bf16 (plain), quantized too, or both")
    ap.add_argument("--activations", default="both", choices=("both", "none", "int8"),
                    help="quantized forms weight-only (none), with int8 per-token activations (int8), or both")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave out the llama.cpp peer where it is installed")
    ap.add_argument("--smoke", action="store_true", help="tiny models, one round, 4 tokens: the bench runs")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    cfgs = {"dense": DENSE, "moe": MOE}
    if args.smoke:
        cfgs, args.rounds, args.decode_tokens, args.group_size = SMOKE, 1, 4, 32
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in names if m not in cfgs]
    if bad:
        sys.exit(f"quant_bench: --models takes dense and/or moe; got {','.join(bad)}")
    import transformers

    report = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version()},
              "hardware": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                           "host": host()},
              "settings": {"decode_tokens": args.decode_tokens, "rounds": args.rounds, "group_size": args.group_size,
                           "smoke": args.smoke}}
    goals = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            res = bench_model(name, cfgs[name], args, Path(tmp))
            report[name] = res
            if 1 in args.batches:
                for f in (f for f in QUANTS if f"{f}_vs_bf16" in res["decode_b1"]):
                    g = GOALS_B1[QUANTS[f][0]]
                    goals[f"{name}: {f} b1 >= {g}x bf16"] = res["decode_b1"][f"{f}_vs_bf16"] >= g
    from adapt.runtime import cpu_kernels

    report["hardware"]["cpu_kernels"] = cpu_kernels.status()
    report["goals_met"] = goals
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
