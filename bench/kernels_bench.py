"""The Triton kernels against the plain-torch forms (the ``torch`` backend's implementations) and torch's fused
``scaled_dot_product_attention``, on CUDA in bfloat16 (issue 33, point 5).

Cases: paged decode attention (GQA 32:8, head_dim 128, blocks of 16 in a shuffled block table), MLA decode in the
absorbed form (DeepSeek-V3's 128 heads, latent 512 + rope 64) and the MoE layer (softmax top-8 router + 128 experts,
H 2048, I 768: Qwen3-30B-A3B's), at batch 1 / 16 / 64 and 1K / 8K context (the MoE layer has no context: batch
only). Per case: the median time of each implementation over rounds that alternate them, the Triton kernel's
ratio to each peer (peer time / Triton time: above 1 the kernel is faster), the largest difference of each output
from the torch form's, and for the attention cases the bandwidth achieved reading the cache (bytes of K/V or of
the latents read / time) with its share of the device's peak (PEAK_GBPS by device name, or ``--peak-gbps``).
The SDPA peer reads a dense contiguous cache ([B, Hkv, L, D], GQA through ``enable_gqa``), laid out before timing:
it is the floor a non-paged kernel reaches, not a paged form.

    python bench/kernels_bench.py [--repeat 20] [--peak-gbps 3350] [--cases decode,mla,moe]
    python bench/kernels_bench.py --interpret-smoke    # tiny shapes, TRITON_INTERPRET=1, float32 on CPU

Prints a table to stderr as cases finish and one JSON document to stdout. Without CUDA it says so in one line and
exits 0; ``--interpret-smoke`` runs every path on tiny shapes under Triton's interpreter and exits 1 when an output
differs from the torch form's by more than 1e-4 (float32).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if "--interpret-smoke" in sys.argv:  # triton reads it at its first import: before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# HBM / GDDR peak bandwidth in GB/s by device name (vendor data sheets); the first substring found wins, so the
# more specific names come first
PEAK_GBPS = (
    ("GB200", 8000), ("B200", 8000), ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350),
    ("H800", 3350), ("H20", 4000), ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100-PCIE-80GB", 1935),
    ("A100", 1555), ("A800", 2039), ("L40S", 864), ("L40", 864), ("L4", 300), ("A10G", 600), ("A10", 600),
    ("RTX 4090", 1008), ("RTX 3090", 936), ("V100", 900), ("MI325X", 6000), ("MI300X", 5300), ("MI250X", 3277),
)

# the full-size shapes (CUDA) and the tiny ones of --interpret-smoke: (batches, contexts, dims)
FULL = dict(batches=(1, 16, 64), contexts=(1024, 8192), block=16,
            gqa=dict(hq=32, hkv=8, d=128), mla=dict(h=128, dn=128, dv=128, r=512, dr=64),
            moe=dict(e=128, k=8, h=2048, i=768))
SMOKE = dict(batches=(1, 3), contexts=(37,), block=16,
             gqa=dict(hq=6, hkv=2, d=40), mla=dict(h=4, dn=16, dv=16, r=32, dr=8),
             moe=dict(e=8, k=2, h=48, i=40))
SMOKE_TOL = 1e-4  # float32 kernel against the torch form: the kernels' own tests hold 1e-5 against the twins


def peak_gbps(name: str) -> float | None:
    return next((float(v) for k, v in PEAK_GBPS if k.lower() in name.lower()), None)


def impls(op: str) -> dict:
    """op -> {"triton": fn, "torch": fn}: the registered implementations of the two backends."""
    from adapt.runtime.backends import get_backend

    return {name: get_backend(name).ops[op].fn for name in ("triton", "torch")}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def alternate(fns: dict, dev: torch.device, repeat: int, warmup: int) -> dict:
    """name -> median seconds of one call; each round calls every fn once, in turn, so that all see the same
    state of the device (clocks, caches, a shared host)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            sync(dev)
            t = time.perf_counter()
            fn()
            sync(dev)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def paged(b: int, ctx: int, bs: int, dev: torch.device, g: torch.Generator):
    """Block tables of b sequences of ctx keys each over a shuffled pool of blocks (the last one partly used
    when bs does not divide ctx), and their lengths."""
    per = -(-ctx // bs)
    perm = torch.randperm(b * per, generator=g).view(b, per).to(torch.int32)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    return perm.to(dev), lens.to(dev), b * per


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def decode_case(b, ctx, cfg, dtype, dev, args, g):
    c = cfg["gqa"]
    hq, hkv, d, bs = c["hq"], c["hkv"], c["d"], cfg["block"]
    tables, lens, nb = paged(b, ctx, bs, dev, g)
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dev, dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dev, dtype)
    q = torch.randn(b, hq, d, generator=g).to(dev, dtype)
    scale = d ** -0.5
    # SDPA's dense cache: each sequence's keys in order, [B, Hkv, L, D]
    rows = tables.long()[:, :, None] * bs + torch.arange(bs, device=dev)  # [B, MAXB, BS] flat slots
    rows = rows.view(b, -1)[:, :ctx]
    kd = k_cache.view(-1, hkv, d)[rows].transpose(1, 2).contiguous()
    vd = v_cache.view(-1, hkv, d)[rows].transpose(1, 2).contiguous()
    fn = impls("paged_decode_attention")
    fns = {name: (lambda f=f: f(q, k_cache, v_cache, tables, lens, scale)) for name, f in fn.items()}
    fns["sdpa"] = lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale, enable_gqa=True)[:, :, 0]
    bytes_read = b * ctx * hkv * 2 * d * k_cache.element_size()
    return run_case(f"decode_attention b{b} ctx{ctx}", fns, dev, args, bytes_read,
                    dict(batch=b, context=ctx, heads=f"{hq}:{hkv}", head_dim=d, block=bs))


def mla_case(b, ctx, cfg, dtype, dev, args, g):
    c = cfg["mla"]
    h, dn, dv, r, dr, bs = c["h"], c["dn"], c["dv"], c["r"], c["dr"], cfg["block"]
    tables, lens, nb = paged(b, ctx, bs, dev, g)
    latent = torch.randn(nb, bs, r + dr, generator=g).to(dev, dtype)
    kv_b = (torch.randn(h * (dn + dv), r, generator=g) * r ** -0.5).to(dev, dtype)
    q_nope = torch.randn(b, h, dn, generator=g).to(dev, dtype)
    q_pe = torch.randn(b, h, dr, generator=g).to(dev, dtype)
    scale = (dn + dr) ** -0.5
    rows = (tables.long()[:, :, None] * bs + torch.arange(bs, device=dev)).view(b, -1)[:, :ctx]
    dense = latent.view(-1, r + dr)[rows][:, None].contiguous()  # [B, 1, L, R + Dr]
    w = kv_b.float().view(h, dn + dv, r)
    w_uk, w_uv = w[:, :dn], w[:, dn:]

    def sdpa():  # the same absorbed form, the attention over the latents by torch's fused kernel
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope.float(), w_uk)
        qq = torch.cat((q_lat, q_pe.float()), -1).to(dtype)[:, :, None]  # [B, H, 1, R + Dr]
        o = F.scaled_dot_product_attention(qq, dense, dense[..., :r], scale=scale, enable_gqa=True)[:, :, 0]
        return torch.einsum("bhr,hvr->bhv", o.float(), w_uv).to(dtype)

    fn = impls("mla_decode")
    fns = {name: (lambda f=f: f(q_nope, q_pe, latent, tables, lens, kv_b, dv, scale)) for name, f in fn.items()}
    fns["sdpa"] = sdpa
    bytes_read = b * ctx * (r + dr) * latent.element_size()
    return run_case(f"mla_decode b{b} ctx{ctx}", fns, dev, args, bytes_read,
                    dict(batch=b, context=ctx, heads=h, latent=r, rope=dr, block=bs))


def moe_case(t, cfg, dtype, dev, args, g):
    c = cfg["moe"]
    e, k, h, inter = c["e"], c["k"], c["h"], c["i"]
    x = (torch.randn(t, h, generator=g) * 0.5).to(dev, dtype)
    gate = (torch.randn(e, h, generator=g) * h ** -0.5).to(dev, dtype)
    # held as the runtime holds them: [E, 2I, H] and [E, H, I] views of transposed storage (models/moe.py)
    w_gu = (torch.randn(e, h, 2 * inter, generator=g) * h ** -0.5).to(dev, dtype).transpose(1, 2)
    w_dn = (torch.randn(e, inter, h, generator=g) * inter ** -0.5).to(dev, dtype).transpose(1, 2)
    route, experts = impls("router_softmax_topk"), impls("moe_experts_fused")

    def layer(name):
        def run():
            _, wts, ids = route[name](x, gate, None, k, True)
            return experts[name](x, wts.to(dtype), ids, w_gu, w_dn, 0, None)
        return run

    fns = {name: layer(name) for name in ("triton", "torch")}
    _, _, ids = route["torch"](x, gate, None, k, True)
    touched = int(ids.unique().numel())  # experts whose weights a call reads
    bytes_read = touched * 3 * h * inter * w_gu.element_size()
    return run_case(f"moe_layer t{t}", fns, dev, args, bytes_read,
                    dict(tokens=t, experts=e, top_k=k, hidden=h, inter=inter, experts_touched=touched))


def run_case(name, fns, dev, args, bytes_read, shape):
    with torch.inference_mode():
        outs = {k: fn() for k, fn in fns.items()}
        secs = alternate(fns, dev, args.repeat, args.warmup)
    tri = secs["triton"]
    row = {"case": name, **shape, "ms": {k: round(v * 1e3, 4) for k, v in secs.items()},
           "triton_speedup": {f"vs_{k}": round(v / tri, 3) for k, v in secs.items() if k != "triton"},
           "max_diff_vs_torch": {k: diff(o, outs["torch"]) for k, o in outs.items() if k != "torch"},
           "bytes_read": bytes_read, "triton_GBps": round(bytes_read / tri / 1e9, 2)}
    if args.peak_gbps:
        row["triton_share_of_peak"] = round(bytes_read / tri / 1e9 / args.peak_gbps, 3)
    print(table_line(row), file=sys.stderr, flush=True)
    return row


def table_line(row) -> str:
    ms = "  ".join(f"{k} {v:.3f} ms" for k, v in row["ms"].items())
    sp = "  ".join(f"x{v:.2f} {k}" for k, v in row["triton_speedup"].items())
    bw = f"  {row['triton_GBps']:.0f} GB/s" + (f" ({100 * row['triton_share_of_peak']:.0f}% of peak)"
                                              if "triton_share_of_peak" in row else "")
    return f"{row['case']:<28} {ms}  | triton {sp}{bw}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--interpret-smoke", action="store_true",
                    help="tiny shapes under TRITON_INTERPRET=1 in float32 on CPU: the paths run, outputs checked")
    ap.add_argument("--cases", default="decode,mla,moe")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-gbps", type=float, default=None, help="the device's peak memory bandwidth (GB/s)")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = sorted(set(cases) - {"decode", "mla", "moe"})
    if bad:
        print(f"kernels_bench: --cases takes decode, mla, moe; got {', '.join(bad)}", file=sys.stderr)
        return 2
    from adapt.runtime.backends.triton_backend import missing

    if missing() is not None:
        print(f"kernels_bench: {missing()}", file=sys.stderr)
        return 0 if not torch.cuda.is_available() else 1
    if args.interpret_smoke:
        cfg, dev, dtype = SMOKE, torch.device("cpu"), torch.float32
        args.repeat, args.warmup = 1, 0
    else:
        if not torch.cuda.is_available():
            print("kernels_bench: no CUDA device here (torch.cuda.is_available() is False): nothing timed; "
                  "run it on a GPU, or --interpret-smoke to check its paths on CPU", file=sys.stderr)
            return 0
        cfg, dev, dtype = FULL, torch.device("cuda"), torch.bfloat16
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    if args.peak_gbps is None and dev.type == "cuda":
        args.peak_gbps = peak_gbps(name)
        if args.peak_gbps is None:
            print(f"kernels_bench: no peak bandwidth known for {name!r}: pass --peak-gbps for the share of peak",
                  file=sys.stderr)
    import triton

    g = torch.Generator().manual_seed(0)
    rows = []
    for b in cfg["batches"]:
        for ctx in cfg["contexts"]:
            if "decode" in cases:
                rows.append(decode_case(b, ctx, cfg, dtype, dev, args, g))
            if "mla" in cases:
                rows.append(mla_case(b, ctx, cfg, dtype, dev, args, g))
        if "moe" in cases:
            rows.append(moe_case(b, cfg, dtype, dev, args, g))
    report = {"device": name, "dtype": str(dtype).replace("torch.", ""), "peak_GBps": args.peak_gbps,
              "interpreted": args.interpret_smoke, "repeat": args.repeat,
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "cuda": torch.version.cuda, "python": platform.python_version()},
              "cases": rows}
    if not args.interpret_smoke:
        speed = [min(r["triton_speedup"].get("vs_torch", 0), 99) for r in rows]
        report["goals"] = {"triton>=2x_torch_forms": all(s >= 2 for s in speed),
                           "decode_attention>=50%_peak_bw": all(r.get("triton_share_of_peak", 0) >= 0.5 for r in rows
                                                                if r["case"].startswith("decode"))}
    print(json.dumps(report, indent=2))
    if args.interpret_smoke:
        worst = max((v, r["case"], k) for r in rows for k, v in r["max_diff_vs_torch"].items())
        if worst[0] > SMOKE_TOL:
            print(f"kernels_bench: {worst[2]} differs from the torch form by {worst[0]:.2e} on {worst[1]} "
                  f"(> {SMOKE_TOL:g})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
