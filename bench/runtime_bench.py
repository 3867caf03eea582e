"""adapt's runtime against transformers on the same ~100-200M-parameter models, built in this script.

Prints one JSON document, per dtype (float32 and bfloat16 by default, both on the same weights): for a
dense llama-like model and a MoE model (32 experts), decode tokens/s at batch 1 and 16 and prefill
tokens/s, for adapt and transformers; the MoE layer alone against
transformers' experts implementation (its default, and eager) at 1, 16 and 512 tokens of the hidden states
the model feeds it (and 512 random ones, which route evenly), with the expert path adapt measured fastest; the bandwidth
achieved at batch-1 float32 decode of the dense model (weight bytes read per token x tokens/s) against
a memory-copy bandwidth measured in the same run, in rounds alternated with the decode rounds. Medians of
a few repeats after a warm-up.

    python bench/runtime_bench.py [--device cpu] [--dtypes float32,bfloat16] [--decode-tokens 32]
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

from adapt.runtime.backends.cpu_layouts import OneDNNExperts, OneDNNWeight, PanelWeight, TiledExperts  # noqa: E402
from adapt.runtime.engine import Engine  # noqa: E402
from adapt.runtime.tactics import TACTICS, host  # noqa: E402
from adapt.runtime.models.batch import ForwardBatch  # noqa: E402
from adapt.runtime.models.layers import linear  # noqa: E402
from adapt.runtime.sampling import SamplingParams  # noqa: E402

DENSE = dict(model_type="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2)
MOE = dict(model_type="qwen3_moe", hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
           num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=32000, num_experts=32,
           num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1,
           mlp_only_layers=[], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, repeat=3, warmup=1):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def build(cfg, path: Path):
    import transformers

    torch.manual_seed(0)
    c = dict(cfg)
    mt = c.pop("model_type")
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(mt, **c))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("gate.weight"):
                p.normal_(0, 0.1)
    hf.save_pretrained(path)
    return hf.eval(), sum(p.numel() for p in hf.parameters())


def prompts(b, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 30000, (b, n), generator=g).tolist()


def bench_model(name, hf, n_params, dtype, dev, args, tmp):
    hf = hf.to(device=dev, dtype=getattr(torch, dtype))
    eng = Engine.from_pretrained(tmp / name, device=str(dev), dtype=dtype, kv_cache_memory="1GiB")
    out = {"params": n_params}
    n = args.decode_tokens
    for b in (1, 16):
        ps = prompts(b, 16, b)
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        eng.generate(ps, sp)  # warm-up
        runs = [eng.generate(ps, sp) and eng.last_stats["decode_tokens_per_s"] for _ in range(args.repeat)]
        ours = statistics.median(runs)
        ids = torch.tensor(ps, device=dev)
        kw = dict(do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            t1 = timed(lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), dev, args.repeat)
            tn = timed(lambda: hf.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, **kw), dev, args.repeat)
        theirs = b * n / (tn - t1)
        out[f"decode_b{b}"] = {"adapt_tok_s": round(ours, 2), "transformers_tok_s": round(theirs, 2),
                               "ratio": round(ours / theirs, 3)}
    pb, pn = 4, args.prefill_len
    ps = prompts(pb, pn, 7)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng.generate(ps, sp)
    ours = statistics.median([eng.generate(ps, sp) and eng.last_stats["prefill_tokens_per_s"]
                              for _ in range(args.repeat)])
    ids = torch.tensor(ps, device=dev)
    with torch.inference_mode():
        t = timed(lambda: hf(ids, logits_to_keep=1), dev, args.repeat)
    theirs = pb * pn / t
    out["prefill"] = {"tokens": pb * pn, "adapt_tok_s": round(ours, 2), "transformers_tok_s": round(theirs, 2),
                      "ratio": round(ours / theirs, 3)}
    return hf, eng, out


def moe_layer(hf, eng, dev, args):
    """The first MoE block alone: adapt's MoE (router + grouped experts kernel) vs transformers' block."""
    ours_block = eng.model.layers[0].mlp
    theirs_block = hf.model.layers[0].mlp
    h = hf.config.hidden_size
    res = {}
    impls = ["grouped_mm", "eager"]
    # the block's real inputs: what the model feeds its first MoE block on 2 x 256 prompt tokens (its routing
    # is skewed, as real routing is; random inputs route evenly and flatter padded / grouped kernels)
    seen = []
    hook = theirs_block.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    with torch.inference_mode():
        hf(torch.tensor(prompts(2, 256, 11), device=dev))
    hook.remove()
    real = seen[0].reshape(-1, h).to(eng.dtype)  # [512, H]
    for t in (1, 16, 512, "512_random"):
        x = real[:t] if isinstance(t, int) else (torch.randn(512, h, device=dev) * 0.5).to(eng.dtype)
        t = x.shape[0] if isinstance(t, int) else t
        fb = ForwardBatch("prefill", torch.zeros(x.shape[0], dtype=torch.long, device=dev), eng.kernels)
        with torch.inference_mode():
            ours = timed(lambda: ours_block(x, fb), dev, args.repeat * 3)
            row = {"adapt_ms": round(ours * 1e3, 3),
                   "adapt_path": ("tiled kernel" if isinstance(ours_block.prepared_experts, TiledExperts) else
                                  "packed loop" if isinstance(ours_block.prepared_experts, OneDNNExperts)
                                  else TACTICS.last)}
            for impl in impls:
                try:
                    hf.set_experts_implementation(impl) if hasattr(hf, "set_experts_implementation") else \
                        setattr(hf.config, "_experts_implementation", impl)
                    y = theirs_block(x[None])
                    y = y[0] if isinstance(y, tuple) else y
                    err = (y[0] - ours_block(x, fb)).abs().max().item()
                    theirs = timed(lambda: theirs_block(x[None]), dev, args.repeat * 3)
                    row[f"transformers_{impl}_ms"] = round(theirs * 1e3, 3)
                    row[f"ratio_vs_{impl}"] = round(theirs / ours, 3)
                    row[f"maxdiff_vs_{impl}"] = err
                except Exception as e:  # an implementation this torch build lacks
                    row[f"transformers_{impl}"] = f"unavailable: {type(e).__name__}: {str(e)[:80]}"
        # torch's dense GEMM chain with the same multiply-adds (T * K rows): the block's floor where torch's GEMM
        # runs near the device's peak (float32; bfloat16 on AMX). Where it does not (bfloat16 on AMD Zen 3: ~1 s)
        # the two fields below are under 1 and say so
        rows, inter = x.shape[0] * hf.config.num_experts_per_tok, ours_block.num_inter
        a, b = (torch.randn(n, m, device=dev, dtype=eng.dtype) for n, m in ((rows, h), (h, 2 * inter)))
        c, d = (torch.randn(n, m, device=dev, dtype=eng.dtype) for n, m in ((rows, inter), (inter, h)))
        dense = timed(lambda: (a @ b, c @ d), dev, args.repeat * 3)
        row["dense_gemm_same_flops_ms"] = round(dense * 1e3, 3)
        row["adapt_vs_dense_gemm"] = round(ours / dense, 3)  # 1.0: the block costs what its multiply-adds do
        # the ratio a block with no routing and no cost beyond that GEMM chain would reach against the peer
        peer = next((row[k] for k in ("transformers_grouped_mm_ms", "transformers_eager_ms") if k in row), None)
        if peer is not None:  # the peer the goal names
            row["ratio_ceiling_at_dense_gemm"] = round(peer / row["dense_gemm_same_flops_ms"], 3)
        res[f"tokens_{t}"] = row
    return res


def gemm_floor(eng, dev, b, args):
    """Tokens/s if a decode step of b sequences did nothing but its weight GEMMs (every 2-D weight but the
    embedding, streamed in model order, packed as the engine holds them): the ceiling for a runtime doing
    these GEMMs in this dtype on this device."""
    held = {id(m.weight): m for m in eng.model.modules() if isinstance(m, (OneDNNWeight, PanelWeight))}
    ws = [held.get(id(p), p) for n, p in eng.model.named_parameters()
          if (p.dim() == 2 or id(p) in held) and not n.startswith("embed")]
    if eng.model.lm_head.tied is not None:
        ws.append(eng.model.lm_head.tied.weight)

    def k_of(w):
        return (w.weight if isinstance(w, torch.nn.Module) else w).shape[1]

    def gemm(x, w):  # an expert weight packed for oneDNN (OneDNNExperts) runs oneDNN's linear
        if isinstance(w, torch.Tensor) and w.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return linear(x, w)

    xs = {k_of(w): torch.randn(b, k_of(w), device=dev, dtype=eng.dtype) for w in ws}
    with torch.inference_mode():
        t = timed(lambda: [gemm(xs[k_of(w)], w) for w in ws], dev, args.repeat * 3)
    return b / t


def copy_bandwidth(dev):
    n = 256 << 20  # bytes
    a = torch.empty(n // 4, dtype=torch.float32, device=dev).normal_()
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), dev, repeat=5, warmup=2)
    return 2 * n / t  # bytes read + written per second


def bandwidth_b1(eng, dev, wbytes, args):
    """Batch-1 decode rounds alternated with copy-bandwidth rounds, so that both see the same state of a
    shared host (its copy figure moved 23-47 GB/s between runs of one session here); the fraction is the
    median of the per-round fractions. Also the b1 GEMM floor: the fraction a step doing nothing but its
    weight GEMVs would reach."""
    ps, sp = prompts(1, 16, 1), SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    eng.generate(ps, sp)
    rounds = []
    for _ in range(max(3, args.repeat)):
        eng.generate(ps, sp)
        tok_s = eng.last_stats["decode_tokens_per_s"]
        bw = copy_bandwidth(dev)
        rounds.append((wbytes * tok_s / bw, wbytes * tok_s, bw, gemm_floor(eng, dev, 1, args) * wbytes / bw))
    frac = statistics.median(r[0] for r in rounds)
    return {"weight_bytes_per_token": wbytes,
            "achieved_GBps": round(statistics.median(r[1] for r in rounds) / 1e9, 3),
            "copy_GBps": round(statistics.median(r[2] for r in rounds) / 1e9, 3),
            "fraction_of_copy": round(frac, 3),
            "fraction_per_round": [round(r[0], 3) for r in rounds],
            "gemm_floor_fraction_of_copy": round(statistics.median(r[3] for r in rounds), 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; both run on the same models")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    import transformers
    report = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version()},
              "hardware": {"device": str(dev), "cpu": platform.processor() or platform.machine(),
                           "threads": torch.get_num_threads(),
                           # the CPU model and features (AMX, AVX-512 bf16/fp16) decide which kernels win
                           "host": host()}}
    goals = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, cfg in (("dense", DENSE), ("moe", MOE)):
            hf, n_params = build(cfg, tmp / name)
            for dtype in dtypes:
                hf, eng, res = bench_model(name, hf, n_params, dtype, dev, args, tmp)
                sec = report.setdefault(dtype, {})
                if name == "dense":
                    res["decode_b16"]["gemm_floor_tok_s"] = round(gemm_floor(eng, dev, 16, args), 2)
                    goals[f"{dtype}: dense decode_b16_vs_transformers>=1.5"] = res["decode_b16"]["ratio"] >= 1.5
                    if dtype == "float32":
                        # weight bytes one decoded token reads: every weight but the embedding (one row of it)
                        wbytes = sum(p.numel() * p.element_size() for n, p in eng.model.named_parameters()
                                     if not n.startswith("embed"))
                        res["bandwidth_b1_fp32"] = bandwidth_b1(eng, dev, wbytes, args)
                        goals["float32: b1_decode>=50%_copy_bw"] = res["bandwidth_b1_fp32"]["fraction_of_copy"] >= 0.5
                else:
                    res["moe_layer"] = moe_layer(hf, eng, dev, args)
                    r512 = res["moe_layer"]["tokens_512"]
                    goals[f"{dtype}: moe decode_b16_vs_transformers>=1.5"] = res["decode_b16"]["ratio"] >= 1.5
                    goals[f"{dtype}: moe_layer_512_vs_transformers>=2"] = r512.get(
                        "ratio_vs_grouped_mm", r512.get("ratio_vs_eager", 0)) >= 2
                sec[name] = res
                del eng
    from adapt.runtime import cpu_kernels

    # whether adapt's fused CPU kernels ran (built per host at the first engine load; torch forms otherwise)
    report["hardware"]["cpu_kernels"] = cpu_kernels.status() if dev.type == "cpu" else None
    report["goals_met"] = goals
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
