"""`adapt init-model` and `adapt run` end to end through the CLI."""

import json
import os
import subprocess
import sys

import pytest
import torch

ADAPT = [sys.executable, "-m", "adapt"]


def _run(args, env_cache, check=True):
    """In a subprocess: the real console script, stdout and stderr apart."""
    env = dict(os.environ, ADAPT_CACHE=str(env_cache))
    out = subprocess.run(ADAPT + args, capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def _run_here(args, env_cache, capsys, monkeypatch):
    """In this process (no interpreter start-up): returns (exit code, stdout, stderr)."""
    from adapt.cli.main import main

    monkeypatch.setenv("ADAPT_CACHE", str(env_cache))
    code = 0
    try:
        main(args)
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("adapt-cache")


def test_init_model_is_deterministic_and_loads_in_transformers(tmp_path, cache, capsys, monkeypatch):
    import transformers

    from adapt.runtime.engine import Engine
    from adapt.runtime.sampling import SamplingParams

    a, b = tmp_path / "a", tmp_path / "b"
    assert _run_here(["init-model", "tiny-k2", str(a)], cache, capsys, monkeypatch)[0] == 0
    assert _run_here(["init-model", "tiny-k2", str(b)], cache, capsys, monkeypatch)[0] == 0
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    hf = transformers.AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    eng = Engine.from_pretrained(a, kv_cache_memory="4MiB")
    ids = eng.tokenizer.encode("Hello there, how are you?")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(ids):]
    assert (eng.prefill_logits(ids) - ref).abs().max() < 1e-4
    got = eng.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    assert got == want.tolist()


def test_init_model_into_a_file_or_an_existing_model(tmp_path, cache, capsys, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    code, _, err = _run_here(["init-model", "tiny-llama", str(f)], cache, capsys, monkeypatch)
    assert code == 1 and err.strip() == f"error: {f} exists and is not a directory" and f.read_text() == "x"
    d = tmp_path / "m"
    for _ in range(2):  # a rewrite replaces the files in place
        assert _run_here(["init-model", "tiny-llama", str(d)], cache, capsys, monkeypatch)[0] == 0
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                   "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "m"]  # no temporary directory left


def test_run_json_builtin_batch(cache):
    out = _run(["run", "tiny-k2", "--prompt", "Hello there", "--prompt", "The quick brown fox", "--prompt-ids",
                "1,2,3", "--max-tokens", "6", "--ignore-eos", "--format", "json", "--kv-cache-memory", "8MiB"], cache)
    doc = json.loads(out.stdout)  # stdout holds the JSON document alone
    assert len(doc["outputs"]) == 3
    assert doc["outputs"][2]["prompt_token_ids"] == [1, 2, 3]
    assert all(len(o["token_ids"]) == 6 and isinstance(o["text"], str) for o in doc["outputs"])
    st = doc["stats"]
    assert st["prefill_tokens_per_s"] > 0 and st["decode_tokens_per_s"] > 0
    assert st["kv_cache"]["blocks_used_after"] == 0 and st["kv_cache"]["blocks_peak_used"] >= 3


def test_run_prepack_modes_give_the_same_greedy_tokens(cache, capsys, monkeypatch):
    # --prepack off / exact / auto: float32 packed sums in another order, within 1e-5; greedy tokens agree
    runs = []
    for mode in ("off", "exact", "auto"):
        code, out, err = _run_here(["run", "tiny-llama", "--prompt-ids", "1,2,3", "-n", "8", "--ignore-eos",
                                    "--prepack", mode, "--format", "json", "--kv-cache-memory", "4MiB"],
                                   cache, capsys, monkeypatch)
        assert code == 0, err
        runs.append(json.loads(out)["outputs"][0]["token_ids"])
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 8


def test_run_text_sampling_int8_and_chat(cache, capsys, monkeypatch):
    code, out, err = _run_here(
        ["run", "tiny-llama", "-p", "Hello", "--chat", "-n", "4", "--temperature", "0.8", "--seed", "3",
         "--top-k", "40", "--top-p", "0.9", "--kv-cache-dtype", "int8", "--dtype", "bfloat16",
         "--kernels", "reference", "--kv-cache-memory", "4MiB", "--stop", "zzzz"], cache, capsys, monkeypatch)
    assert code == 0 and out.startswith("[0] ") and "decode" in err


def test_run_errors_are_one_line(cache, tmp_path, capsys, monkeypatch):
    cases = [(["tiny-llama", "--prompt-ids", "1,2", "--device", "nosuchdevice"], "device"),
             (["tiny-llama", "--prompt-ids", "1,2", "--dtype", "int4"], "--dtype"),
             (["tiny-llama", "--prompt-ids", "1,2", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
             (["tiny-llama", "--prompt-ids", "1,x"], "--prompt-ids"),
             (["tiny-llama", "--prompt-ids", "1,2", "--prepack", "always"], "--prepack"),
             ([str(tmp_path / "nope"), "--prompt-ids", "1"], "error:")]
    for args, msg in cases:
        code, out, err = _run_here(["run"] + args, cache, capsys, monkeypatch)
        assert code == 1 and err.strip().count("\n") == 0 and msg in err and out == "", err
