"""tp2 / ep2 runs of quantized shards give one rank's greedy tokens and logits (float32, gloo, tiny models).

The one-rank reference is the unsharded quantized checkpoint (tests/fixtures/quant.py) run by adapt's engine.
The shards keep its stored form (``--dtype keep``, checked by ``shard verify --source``): a DeepSeek-V3 fp8
checkpoint (16 x 16 blocks, so that every tp2 split falls on block edges), compressed-tensors Llama int4 (groups
of 16, symmetric and with zero points) and int8 (per channel), Qwen3-MoE int4; and the float Llama / Qwen3-MoE
sharded with ``--quantize int4 --group-size 16`` (round-to-nearest per group: groups that tile each rank's
columns give the bytes the fixture's whole-tensor quantization gives). All layouts share one launch of two forked ranks; fp8 tp2 and
dp2.ep2 also go through the CLI (``adapt run --nproc 2``).
"""

from __future__ import annotations

import json

import pytest
import torch

from adapt.runtime.sampling import SamplingParams

from .harness import spawn

PROMPTS = [[1, 5, 9, 33, 70, 11], [1, 7], [1, 200, 4]]
MAX_TOKENS = 6
LAYOUTS = [  # (model, how it is sharded, degrees)
    ("ds-fp8", "keep", dict(tp=2)), ("ds-fp8", "keep", dict(tp=2, ep=2)), ("ds-fp8", "keep", dict(dp=2, ep=2)),
    ("llama-int4", "keep", dict(tp=2)), ("llama-int4z", "keep", dict(tp=2)), ("llama-int8", "keep", dict(tp=2)),
    ("qwen3moe-int4", "keep", dict(tp=2, ep=2)), ("qwen3moe-int4", "keep", dict(tp=2)),
    ("llama-int4", "int4", dict(tp=2)), ("qwen3moe-int4", "int4", dict(tp=2, ep=2)),
]
KIND = {"ds-fp8": "fp8", "llama-int4": "int4", "llama-int4z": "int4", "llama-int8": "int8", "qwen3moe-int4": "int4"}
GROUP = 16  # divides every rank's K at tp2 (llama's o_proj: 48 per rank)


def _name(model, how, deg):
    return f"{model}-{how}-" + "".join(f"{k}{v}" for k, v in deg.items())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from adapt.shard import shard, verify
    from tests.fixtures.quant import save_quantized

    root = tmp_path_factory.mktemp("qdist")
    models = {"ds-fp8": save_quantized("deepseek_v3", root / "ds", "fp8", block=(16, 16))[0],
              "llama-int4": save_quantized("llama", root / "llama", "int4", group=GROUP)[0],
              "llama-int4z": save_quantized("llama", root / "llama-z", "int4", group=GROUP, symmetric=False)[0],
              "llama-int8": save_quantized("llama", root / "llama-8", "int8")[0],
              "qwen3moe-int4": save_quantized("qwen3_moe", root / "qwen3moe", "int4", group=GROUP)[0]}
    outs = {}
    for model, how, deg in LAYOUTS:
        out = root / _name(model, how, deg)
        if how == "keep":
            shard(models[model], out, dtype="keep", **deg)
            rep = verify(out, source=models[model])
            assert rep.ok, [p.line() for p in rep.problems]
        else:  # the float source the fixture quantized
            shard(models[model].parent / "src", out, quantize=how, group_size=GROUP, **deg)
        outs[_name(model, how, deg)] = out
    return models, outs


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _ranks(rank: int, world: int, dirs: list[str]) -> list:
    from adapt.runtime.distributed.generate import generate, open_distributed
    from adapt.runtime.quant.weight import QuantizedWeight

    out = []
    for d in dirs:
        eng, ctx = open_distributed(d, timeout_s=60, kv_cache_memory="16MiB")
        res = generate(eng, ctx, PROMPTS, _greedy(MAX_TOKENS))
        held = sorted({m.kind for m in eng.model.modules() if isinstance(m, QuantizedWeight)})
        out.append(([(r.prompt_token_ids, r.token_ids) for r in res] if res is not None else None,
                    [eng.prefill_logits(p) for p in PROMPTS], eng.weight_bytes, held))
    return out


def test_quantized_shards_match_one_rank(ckpts):
    from adapt.runtime.engine import Engine

    models, outs = ckpts
    got = spawn(_ranks, 2, [str(outs[_name(*x)]) for x in LAYOUTS])
    for li, (model, how, deg) in enumerate(LAYOUTS):
        eng = Engine.from_pretrained(models[model], dtype="float32", kv_cache_memory="16MiB")
        want = [(r.prompt_token_ids, r.token_ids) for r in eng.generate(PROMPTS, _greedy(MAX_TOKENS))]
        assert got[0][li][0] == want, (model, deg)
        for rank in range(2):
            _, logits, nbytes, held = got[rank][li]
            assert held == [KIND[model]], (model, deg, rank, held)  # still quantized
            for p, a in zip(PROMPTS, logits):
                b = eng.prefill_logits(p)
                assert torch.allclose(a, b, atol=1e-4, rtol=0), (model, deg, rank, (a - b).abs().max().item())
            ratio = nbytes / eng.weight_bytes
            print(f"{model} {deg} rank {rank}: weight_bytes {nbytes} = {ratio:.3f} x one rank's")
            if "tp" in deg:  # every linear split (or its experts divided): about half of one rank's bytes
                assert 0.4 <= ratio <= 0.6, (model, deg, rank, ratio)
            else:  # dp2.ep2: attention and dense layers replicated, the routed experts halved
                assert 0.5 < ratio < 0.95, (model, deg, rank, ratio)


@pytest.mark.parametrize("deg", [dict(tp=2), dict(dp=2, ep=2)], ids=["tp2", "dp2ep2"])
def test_fp8_cli_matches_one_rank(ckpts, deg):
    """`adapt run --nproc 2` on the shards (dp2.ep2 drives the CLI's data-parallel generate)."""
    from tests.distributed.test_launch import _adapt

    models, outs = ckpts
    args = ["--prompt-ids", "1,5,9,33,70,11", "--max-tokens", "8", "--ignore-eos", "--format", "json",
            "--dtype", "float32"]
    one, _ = _adapt("run", str(models["ds-fp8"]), *args)
    two, _ = _adapt("run", str(outs[_name("ds-fp8", "keep", deg)]), *args, "--nproc", "2", timeout=240)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-1500:], two.stderr[-1500:])
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert [(o["prompt_token_ids"], o["token_ids"]) for o in a["outputs"]] == \
        [(o["prompt_token_ids"], o["token_ids"]) for o in b["outputs"]]
    ratio = b["stats"]["weight_bytes"] / a["stats"]["weight_bytes"]  # rank 0's resident bytes
    assert (0.4 <= ratio <= 0.6) if "tp" in deg else (0.5 < ratio < 0.95), ratio
    plan = "tp{}.pp1.ep{}.dp{}".format(deg.get("tp", 1), deg.get("ep", 1), deg.get("dp", 1))
    assert b["stats"]["weights"]["quantized"] and b["stats"]["parallel"]["plan"] == plan
