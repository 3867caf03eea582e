"""Engine behaviour: ragged batches, cache reuse and freeing, sampling and stop rules, int8 KV, errors."""

import json

import pytest
import torch

from adapt.errors import CheckpointError, RuntimeConfigError
from adapt.runtime.cache.kv_pool import KVCacheSpec
from adapt.runtime.engine import Engine, parse_memory
from adapt.runtime.init_model import init_model
from adapt.runtime.models.moe import MoE
from adapt.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    return init_model("tiny-k2", tmp_path_factory.mktemp("k2"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return init_model("tiny-llama", tmp_path_factory.mktemp("llama"))


def _ragged(n=8):
    return [[1] + [(13 * i + 7 * j) % 500 + 5 for j in range(3 + 5 * i)] for i in range(n)]


@pytest.mark.parametrize("which", ["k2", "llama"])
def test_ragged_batch_equals_each_alone(which, request):
    eng = Engine.from_pretrained(request.getfixturevalue(which), kv_cache_memory="16MiB", block_size=8)
    prompts = _ragged(8)
    batch = [r.token_ids for r in eng.generate(prompts, GREEDY)]
    alone = [eng.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert batch == alone
    st = eng.last_stats
    assert st["kv_cache"]["blocks_used_after"] == 0 and st["kv_cache"]["blocks_peak_used"] > 0
    assert st["decode_tokens_per_s"] > 0 and st["prefill_tokens"] > 0


def test_preemption_keeps_greedy_tokens(llama):
    # a cache too small for all 8 sequences at once forces recompute preemption
    full = Engine.from_pretrained(llama, kv_cache_memory="16MiB", block_size=4)
    per_block = full.pool.bytes_per_token * 4
    small = Engine.from_pretrained(llama, kv_cache_memory=str(per_block * 12), block_size=4)
    assert small.pool.num_blocks == 12
    prompts = _ragged(4)
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert [r.token_ids for r in small.generate(prompts, p)] == [r.token_ids for r in full.generate(prompts, p)]
    assert small.last_stats["preemptions"] > 0


def test_sampling_seed_stop_and_limits(llama):
    eng = Engine.from_pretrained(llama, kv_cache_memory="16MiB")
    ids = eng.tokenizer.encode("Hello there")
    s = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    a, b = eng.generate([ids, ids], s)
    assert a.token_ids == b.token_ids == eng.generate([ids], s)[0].token_ids  # per-request seed
    greedy = eng.generate([ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(greedy.token_ids) == 10 and greedy.finish_reason == "length"
    stop_id = greedy.token_ids[3]
    r = eng.generate([ids], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(stop_id,)))[0]
    assert r.finish_reason == "stop" and r.token_ids[-1] == stop_id and len(r.token_ids) <= 4
    text = eng.tokenizer.decode(greedy.token_ids)
    probe = text[len(text) // 2:len(text) // 2 + 2]
    if probe.strip():
        r = eng.generate([ids], SamplingParams(temperature=0, max_tokens=10, stop=(probe,), ignore_eos=True))[0]
        assert r.finish_reason == "stop" and probe not in r.text


def test_int8_kv_cache_halves_bytes_and_runs(k2, llama):
    for kind in ("mha", "mla"):
        args = (2, 8, 128) if kind == "mha" else (2, 512, 64)
        mk = KVCacheSpec.mha if kind == "mha" else KVCacheSpec.mla
        bf, q = mk(*args, torch.bfloat16), mk(*args, torch.bfloat16, quant="int8")
        assert q.bytes_per_token() / bf.bytes_per_token() <= 0.52  # half, plus one fp32 scale per vector
    for path in (k2, llama):
        ref = Engine.from_pretrained(path, kv_cache_memory="16MiB")
        eng = Engine.from_pretrained(path, kv_cache_memory="16MiB", kv_cache_dtype="int8")
        assert eng.pool.spec.quant == "int8"
        prompts = _ragged(3)
        a = [r.token_ids for r in ref.generate(prompts, GREEDY)]
        b = [r.token_ids for r in eng.generate(prompts, GREEDY)]
        agree = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(map(len, a))
        assert agree > 0.5


def test_bfloat16_runs(k2):
    eng = Engine.from_pretrained(k2, dtype="bfloat16", kv_cache_memory="16MiB")
    r = eng.generate(_ragged(2), GREEDY)
    assert all(len(x.token_ids) == 12 for x in r)


def test_errors_are_one_line(k2, tmp_path):
    for kw, msg in ((dict(device="nosuchdevice"), "device"), (dict(dtype="int4"), "--dtype"),
                    (dict(kernels="fast"), "--kernels"), (dict(kv_cache_dtype="fp4"), "--kv-cache-dtype")):
        with pytest.raises(RuntimeConfigError, match=msg) as e:
            Engine.from_pretrained(k2, kv_cache_memory="1MiB", **kw)
        assert "\n" not in str(e.value)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeConfigError, match="cuda"):
            Engine.from_pretrained(k2, device="cuda")
    with pytest.raises(RuntimeConfigError):
        parse_memory("lots")
    assert parse_memory("2GiB") == (2 << 30, None) and parse_memory("0.5") == (None, 0.5)
    eng = Engine.from_pretrained(k2, kv_cache_memory="1MiB")
    with pytest.raises(RuntimeConfigError, match="vocabulary"):
        eng.generate([[1, 99999]], GREEDY)
    with pytest.raises(CheckpointError):
        (tmp_path / "config.json").write_text(json.dumps(json.loads((k2 / "config.json").read_text())))
        Engine.from_pretrained(tmp_path, kv_cache_memory="1MiB")


def test_loads_shard_output_and_index_sharded(k2, tmp_path):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(k2 / "model.safetensors"))
    names = sorted(tensors)
    # index.json-sharded checkpoint
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (ck / f).write_bytes((k2 / f).read_bytes())
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for f, ns in halves.items():
        save_file({n: tensors[n] for n in ns}, str(ck / f))
    (ck / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in halves.items() for n in ns}}))
    # adapt shard output: one rank, and two ranks (which a single-rank run refuses)
    from adapt.cli.main import main

    out, out2 = tmp_path / "shards", tmp_path / "shards2"
    for args in (["shard", "run", str(k2), "--out", str(out)], ["shard", "run", str(k2), "--out", str(out2),
                                                                 "--tp", "2"]):
        try:
            main(args)
        except SystemExit as e:
            assert not e.code
    ids = [0, 5, 9, 33]
    ref = Engine.from_pretrained(k2, kv_cache_memory="1MiB").prefill_logits(ids)
    for path in (ck, out):
        assert torch.equal(Engine.from_pretrained(path, kv_cache_memory="1MiB").prefill_logits(ids), ref)
    with pytest.raises(CheckpointError, match="2 ranks"):
        Engine.from_pretrained(out2, kv_cache_memory="1MiB")


@pytest.mark.parametrize("which", ["k2", "llama"])
def test_prepacked_bf16_linears_change_nothing(which, request):
    # oneDNN-packed linears (the CPU default for bfloat16) must give the very tokens of plain F.linear
    from adapt.runtime.kernels.moe_experts import onednn_packs
    from adapt.runtime.backends.cpu_layouts import can_prepack

    if not can_prepack(torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN linear")
    if not onednn_packs(torch.bfloat16):  # e.g. AMD Zen 3: no AVX512-BF16, so oneDNN keeps bf16 plain
        pytest.skip("this CPU does not pack torch.bfloat16 for oneDNN")
    path = request.getfixturevalue(which)
    packed = Engine.from_pretrained(path, dtype="bfloat16", kv_cache_memory="16MiB")
    plain = Engine.from_pretrained(path, dtype="bfloat16", kv_cache_memory="16MiB", prepack="off")
    n_packed = sum(p.is_mkldnn for p in packed.model.parameters())
    assert n_packed > 0 and not any(p.is_mkldnn for p in plain.model.parameters())
    # routers and MLA's kv_b_proj are read as tensors elsewhere and stay plain
    for name, p in packed.model.named_parameters():
        if name.endswith("gate.weight") or "kv_b_proj" in name:
            assert not p.is_mkldnn, name
    prompts = _ragged(4)
    a = [r.token_ids for r in packed.generate(prompts, GREEDY)]
    b = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    assert a == b
    with pytest.raises(RuntimeConfigError, match="prepack"):
        Engine.from_pretrained(path, kv_cache_memory="16MiB", prepack="yes")


def test_float16_runs_where_onednn_cannot_pack_it(llama):
    # float16 packs only on CPUs with FP16 support; elsewhere its linears stay on F.linear
    from adapt.runtime.kernels.moe_experts import onednn_packs

    eng = Engine.from_pretrained(llama, dtype="float16", kv_cache_memory="16MiB")
    assert any(p.is_mkldnn for p in eng.model.parameters()) == onednn_packs(torch.float16)
    assert len(eng.generate([[1, 5, 9]], GREEDY)[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("which", ["k2", "llama"])
def test_prepacked_fp32_linears_stay_within_fp32_tolerance(which, request, monkeypatch):
    # float32 packs by default (another summation order); 'exact' keeps it on F.linear, bitwise. The
    # experts pack where a timed trial says packing wins on this host: pinned to "wins" here
    import adapt.runtime.backends.cpu_layouts as moe_mod
    from adapt.runtime.backends.cpu_layouts import can_prepack

    if not can_prepack(torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(moe_mod, "packing_wins", lambda block, dtype, form="onednn": form == "onednn")
    path = request.getfixturevalue(which)
    packed = Engine.from_pretrained(path, kv_cache_memory="16MiB")
    exact = Engine.from_pretrained(path, kv_cache_memory="16MiB", prepack="exact")
    plain = Engine.from_pretrained(path, kv_cache_memory="16MiB", prepack="off")
    tiled = [m for m in packed.model.modules() if isinstance(m, moe_mod.PanelWeight)]
    assert sum(p.is_mkldnn for p in packed.model.parameters()) + len(tiled) > 0
    from adapt.runtime.kernels.linear_tiled import linear_tiles
    # float32 linears take the tiled FMA GEMM's column panels where this build has it, else oneDNN's layout
    assert bool(tiled) == linear_tiles(64, 64, torch.float32)
    assert not any(p.is_mkldnn for e in (exact, plain) for p in e.model.parameters())
    packed.generate([[1, 2, 3]], GREEDY)
    plain.generate([[1, 2, 3]], GREEDY)
    forms = packed.last_stats["linears"]
    assert forms.get("fma panels", 0) == len(tiled) and sum(forms.values()) > 0
    assert set(plain.last_stats["linears"]) == {"plain"}
    ids = [0, 5, 9, 33, 2, 17, 40]
    a, b = packed.prefill_logits(ids), plain.prefill_logits(ids)
    assert torch.equal(exact.prefill_logits(ids), b)
    assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
    prompts = _ragged(4)
    assert [r.token_ids for r in packed.generate(prompts, GREEDY)] == \
        [r.token_ids for r in plain.generate(prompts, GREEDY)]
    moes = [m for m in packed.model.modules() if isinstance(m, MoE)]
    # float32 experts packed too
    assert all(isinstance(m.prepared_experts, moe_mod.OneDNNExperts) and m.w_gate_up is None for m in moes)
    assert not any(m.prepared_experts is not None for m in exact.model.modules() if isinstance(m, MoE))
    assert (which == "k2") == bool(moes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_tiled_moe_experts_keep_tokens_and_logits(k2, dtype, monkeypatch):
    # the fused tiled MoE kernel (moe_gemm.h) where its trial wins, pinned to "wins" here: the same greedy
    # tokens as the unpacked model in float32 and logits within float32 tolerance; never under 'exact'
    import adapt.runtime.backends.cpu_layouts as moe_mod
    from adapt.runtime import cpu_kernels
    from adapt.runtime.kernels.moe_tiled import tiles

    cpu_kernels.load()
    if not tiles(128, 64, getattr(torch, dtype)):
        pytest.skip(f"the tiled MoE kernel does not run {dtype} on this host")
    monkeypatch.setattr(moe_mod, "packing_wins", lambda block, dtype, form="onednn": form == "tiled")
    tiled = Engine.from_pretrained(k2, dtype=dtype, kv_cache_memory="16MiB")
    plain = Engine.from_pretrained(k2, dtype=dtype, kv_cache_memory="16MiB", prepack="off")
    exact = Engine.from_pretrained(k2, dtype=dtype, kv_cache_memory="16MiB", prepack="exact")
    moes = [m for m in tiled.model.modules() if isinstance(m, MoE)]
    assert moes and all(isinstance(m.prepared_experts, moe_mod.TiledExperts) and m.w_gate_up is None for m in moes)
    tiled.generate([[1, 2, 3]], GREEDY)
    assert tiled.last_stats["moe_experts"].startswith("tiled (")
    plain.generate([[1, 2, 3]], GREEDY)
    assert plain.last_stats["moe_experts"] == "stacked"
    assert not any(m.prepared_experts is not None for e in (plain, exact) for m in e.model.modules()
                   if isinstance(m, MoE))
    ids = [0, 5, 9, 33, 2, 17, 40]
    a, b = tiled.prefill_logits(ids).float(), plain.prefill_logits(ids).float()
    if dtype == "float32":
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
        prompts = _ragged(4)
        assert [r.token_ids for r in tiled.generate(prompts, GREEDY)] == \
            [r.token_ids for r in plain.generate(prompts, GREEDY)]
    else:  # 16-bit: another accumulation order (AMX tiles, or float32 sums rounded once); the logits stay close
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item() > 0.999


def test_a_pinned_moe_strategy_keeps_the_experts_stacked(k2, monkeypatch):
    import adapt.runtime.backends.cpu_layouts as moe_mod

    monkeypatch.setattr(moe_mod, "packing_wins", lambda block, dtype, form="onednn": True)
    monkeypatch.setenv("ADAPT_MOE_STRATEGY", "loop")
    eng = Engine.from_pretrained(k2, kv_cache_memory="16MiB")
    eng.generate([[1, 2, 3]], GREEDY)
    assert eng.last_stats["moe_experts"] == "stacked"


def test_a_bad_moe_strategy_pin_is_refused_at_load(llama, monkeypatch):
    from adapt.errors import RuntimeConfigError

    monkeypatch.setenv("ADAPT_MOE_STRATEGY", "fastest")
    with pytest.raises(RuntimeConfigError, match="ADAPT_MOE_STRATEGY must be auto or one of"):
        Engine.from_pretrained(llama, kv_cache_memory="16MiB")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_tied_head_packs_the_embedding_which_reads_its_panels(dtype, tmp_path):
    # where linear_tiled takes the dtype, a head tied to the embedding takes column panels in the embedding
    # itself (no second copy), and the embedding's lookup reads them: the same rows, logits within tolerance
    from adapt.runtime.backends.cpu_layouts import PanelWeight
    from adapt.runtime.kernels.linear_tiled import linear_tiles
    from tests.fixtures.tiny import save_tiny

    hf, path = save_tiny("llama_tied", tmp_path / "tied")
    packed = Engine.from_pretrained(path, dtype=dtype, kv_cache_memory="16MiB")
    plain = Engine.from_pretrained(path, dtype=dtype, kv_cache_memory="16MiB", prepack="off")
    v, h = hf.config.vocab_size, hf.config.hidden_size
    emb, head = packed.model.embed, packed.model.lm_head
    assert head.tied is emb and head.weight is None
    if not linear_tiles(v, h, getattr(torch, dtype)):
        assert isinstance(emb.weight, torch.Tensor)
        pytest.skip(f"linear_tiled does not take {dtype} here")
    assert isinstance(emb.weight, PanelWeight) and isinstance(plain.model.embed.weight, torch.Tensor)
    ids = torch.tensor([0, 3, v - 1, 17, 3])
    assert torch.equal(emb.rows(ids), plain.model.embed.rows(ids))
    packed.generate([[1, 2, 3]], GREEDY)
    assert packed.last_stats["linears"]["fma panels"] >= 1
    toks = [5, 9, 33, 2, 17, 40]
    a, b = packed.prefill_logits(toks).float(), plain.prefill_logits(toks).float()
    if dtype == "float32":
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
        prompts = _ragged(4)
        assert [r.token_ids for r in packed.generate(prompts, GREEDY)] == \
            [r.token_ids for r in plain.generate(prompts, GREEDY)]
    else:
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item() > 0.999


def test_cpu_weights_in_huge_pages_change_no_token(k2, monkeypatch):
    # every weight and packed expert of the tiny model through host_memory.empty_huge (its 4 MiB floor lowered
    # to 0): each starts on a 2 MiB boundary, and the tokens and logits are those of plain pages, bit for bit
    import adapt.runtime.backends.cpu_layouts as moe_mod
    from adapt.runtime import host_memory

    if not host_memory.huge_pages_wanted():
        pytest.skip("no transparent huge pages here")
    monkeypatch.setattr(moe_mod, "packing_wins", lambda block, dtype, form="onednn": form == "tiled")
    monkeypatch.setenv("ADAPT_HUGE_PAGES", "0")
    plain = Engine.from_pretrained(k2, dtype="float32", kv_cache_memory="16MiB")
    monkeypatch.setenv("ADAPT_HUGE_PAGES", "1")
    monkeypatch.setattr(host_memory, "HUGE_MIN", 0)
    huge = Engine.from_pretrained(k2, dtype="float32", kv_cache_memory="16MiB")
    params = [p for p in huge.model.parameters() if not p.is_mkldnn]
    assert params and all(p.data_ptr() % host_memory.HUGE == 0 for p in params)
    assert any(p.data_ptr() % host_memory.HUGE for p in plain.model.parameters() if not p.is_mkldnn)
    prompts = _ragged(3)
    assert [r.token_ids for r in huge.generate(prompts, GREEDY)] == \
        [r.token_ids for r in plain.generate(prompts, GREEDY)]
    assert torch.equal(huge.prefill_logits([1, 5, 9]), plain.prefill_logits([1, 5, 9]))
    st = huge.last_stats["huge_pages"]
    assert st["wanted"] is True and st["mode"] in ("always", "madvise") and st["anon_huge_bytes"] is not None
