"""Every command in README.md's Commands sections runs offline as written and does what the README says.

The commands are read from the README at test time (tests/flows/readme_commands.py). Each block runs in its own
directory, its commands in order, through bash with the installed `adapt` first on PATH. The README's placeholder
inputs are made real before a block runs: hub ids resolve from a hub cache holding the shared published configs
(HF_HUB_OFFLINE=1), `./DeepSeek-V3`, `./ref-model`, `./my-model` are tiny checkpoints, `/path/to/Kimi-K2-Instruct`
is the shared Kimi-K2 config. Every command must match a rule below that checks what the README promises of it;
a command no rule knows fails `test_every_readme_command_has_a_rule`, so a new README line cannot go unchecked.
Only commands that need hardware this host lacks (a CUDA device) are skipped, and they run where it exists.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from tests.fixtures.configs import SHARED_CONFIGS
from tests.flows.readme_commands import Block, readme_blocks

BLOCKS = readme_blocks()
TIMEOUT = 900  # a hang guard only: day0 took >300 s once with six test runs sharing 2 cores


@dataclass
class Result:
    command: str
    returncode: int
    stdout: str
    stderr: str
    cwd: Path


@dataclass
class Rule:
    pattern: str  # re.search against the command
    check: Callable[[Result], None]
    needs: tuple[str, ...] = ()  # inputs to create in the block's directory first (see PREPARE)
    skip: Callable[[], str | None] = lambda: None  # a reason to skip on this host, or None
    background: bool = False  # a server: started, checked, its port handed to the later commands of the block
    subst: dict[str, str] = field(default_factory=dict)  # README placeholder -> what this test runs


def _ok(*needles: str, files: tuple[str, ...] = (), stream: str = "both") -> Callable[[Result], None]:
    """Exit 0, every needle in the output, every file present and non-empty."""
    def check(r: Result) -> None:
        assert r.returncode == 0, f"{r.command!r} exited {r.returncode}: {r.stderr[-2000:]}"
        text = {"out": r.stdout, "err": r.stderr, "both": r.stdout + r.stderr}[stream]
        for n in needles:
            assert n in text, f"{r.command!r}: {n!r} not in its output: {text[-2000:]}"
        for f in files:
            p = r.cwd / f
            assert p.exists() and (p.is_dir() or p.stat().st_size > 0), f"{r.command!r} left no {f}"
    return check


def _json(check: Callable[[object], None]) -> Callable[[Result], None]:
    def run(r: Result) -> None:
        assert r.returncode == 0, f"{r.command!r} exited {r.returncode}: {r.stderr[-2000:]}"
        check(json.loads(r.stdout))
    return run


def _no_cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device"


def _no_triton() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("triton") else "triton is not installed"


def _shard(ranks: int, out: str) -> Callable[[Result], None]:
    def check(r: Result) -> None:
        _ok(files=(f"{out}/manifest.json",))(r)
        assert len(list((r.cwd / out).glob("rank-*"))) == ranks
    return check


def _tokens(r: Result) -> list[str]:
    assert r.returncode == 0, f"{r.command!r} exited {r.returncode}: {r.stderr[-2000:]}"
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert lines, f"{r.command!r} printed nothing"
    return lines


def _torchrun_equals_nproc(r: Result) -> None:
    assert _tokens(r) == _tokens(_state["nproc"]), "torchrun and --nproc 2 generated different text"


def _remember_nproc(r: Result) -> None:
    _ok("collective bytes per decode step", "rank 1: measured/estimated")(r)  # --collective-stats
    _state["nproc"] = r


def _completion(r: Result) -> None:
    _json(lambda d: _assert(d["object"] == "text_completion" and d["choices"][0]["text"] is not None, d))(r)


def _chat_stream(r: Result) -> None:
    _ok()(r)
    events = [line[len("data: "):] for line in r.stdout.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.stdout[-1000:]
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def _image_chat(r: Result) -> None:
    """A chat completion whose prompt holds the photo's image tokens (more than the text alone)."""
    def check(d: dict) -> None:
        assert d["object"] == "chat.completion" and d["choices"][0]["message"]["content"] is not None, d
        assert d["usage"]["completion_tokens"] == 8 and d["usage"]["prompt_tokens"] > 30, d["usage"]
    _json(check)(r)


def _assert(cond: bool, what: object) -> None:
    assert cond, what


def _baseline(r: Result) -> None:
    _ok(files=("report/report.json", "baseline.json"))(r)
    doc = json.loads((r.cwd / "baseline.json").read_text())
    assert "signature" in json.dumps(doc) and "Jane Doe" in json.dumps(doc)


def _endpoint_report(r: Result) -> None:
    _ok(files=("report/report.json", "report/report.html"))(r)
    doc = json.loads((r.cwd / "report/report.json").read_text())
    st = {it["id"]: it["status"] for it in doc["items"]}
    assert st["greedy_token_match"] == "pass" and st["hidden_states"] == "skip", st
    assert doc["environment"]["endpoint"]["served_model_name"] == "ref-model"


def _endpoint_golden(r: Result) -> None:
    _ok("wrote golden-ep/golden.json", files=("golden-ep/golden.json",))(r)
    ep = json.loads((r.cwd / "golden-ep/golden.json").read_text())["endpoint"]
    assert ep["v1_models"]["data"][0]["id"] == "ref-model" and ep["token_ids"] == ["server (return_token_ids)"], ep


def _endpoint_golden_report(r: Result) -> None:
    _ok(files=("report-ep/report.json",))(r)
    doc = json.loads((r.cwd / "report-ep/report.json").read_text())
    st = {it["id"]: it["status"] for it in doc["items"]}
    assert st["greedy_token_match"] == st["top1_agreement"] == "pass" and st["prefill_logits"] == "skip", st


def _bench_json(d: dict, n: int) -> None:
    assert d["completed"] == n and d["failed"] == 0 and d["errors"] == {}, d
    for k in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert {"mean", "p50", "p90", "p99"} <= set(d[k]), d[k]
    assert d["output_tokens_per_s"] > 0 and d["goodput"] > 0
    assert d["server_metrics"]["generation_tokens"] == d["output_tokens"], d["server_metrics"]


_state: dict[str, Result] = {}

RULES: list[Rule] = [
    # adapt profile
    Rule(r"^adapt profile /path/to/Kimi-K2-Instruct --hardware h200 --batch 8 --context 8192$",
         _ok("H200", "batch=8", "context=8192", "TPOT"), needs=("Kimi-K2-Instruct",),
         subst={"/path/to/Kimi-K2-Instruct": "./Kimi-K2-Instruct"}),
    Rule(r"^adapt profile deepseek-ai/DeepSeek-V3 --phase decode --weights-dtype fp8 --format json \| jq \.totals$",
         _json(lambda d: _assert(set(d) == {"decode"} and d["decode"]["tpot_s"] > 0, d))),
    Rule(r"^adapt profile tiny-k2 --format html --out profile\.html$",
         lambda r: (_ok(files=("profile.html",))(r), _assert("<svg" in (r.cwd / "profile.html").read_text(), r))),
    Rule(r"^adapt hardware list$", _ok("h100-sxm", "h200")),
    # adapt plan
    Rule(r"^adapt plan deepseek-ai/DeepSeek-V3 -H h200 --nodes 1 --context 32768 --concurrency 8$",
         _ok("recommended")),
    Rule(r"^adapt plan meta-llama/Llama-3\.1-405B .*--out plan\.yaml --emit vllm$",
         _ok("vllm serve", files=("plan.yaml",))),
    Rule(r"^adapt plan --check plan\.yaml meta-llama/Llama-3\.1-405B -H h100-sxm$", _ok()),
    Rule(r"^adapt plan MODEL --cluster cluster\.yaml --format json \| jq \.recommended$",
         _json(lambda d: _assert(d is not None and d["world_size"] >= 1, d)), needs=("cluster.yaml",),
         subst={"MODEL": "tiny-k2"}),
    # adapt shard
    Rule(r"^adapt shard \./DeepSeek-V3 --out \./ds3-tp8 --tp 8 --ep 8 ", _shard(8, "ds3-tp8"), needs=("DeepSeek-V3",)),
    Rule(r"^adapt shard \./DeepSeek-V3 --out \./ds3-pp +--plan plan\.yaml$", _shard(8, "ds3-pp"),
         needs=("DeepSeek-V3", "plan.yaml")),
    Rule(r"^adapt shard verify \./ds3-tp8$", _ok("OK: 8 files")),
    Rule(r"^adapt shard verify \./ds3-tp8 --source \./DeepSeek-V3$", _ok("OK: 8 files")),
    # multi-rank
    Rule(r"^adapt init-model tiny-k2 k2$", _ok(files=("k2/config.json", "k2/model.safetensors"))),
    Rule(r"^adapt shard k2 --out k2-tp2ep2 --tp 2 --ep 2$", _shard(2, "k2-tp2ep2")),
    Rule(r"^adapt run k2-tp2ep2 --nproc 2 .*--collective-stats$", _remember_nproc),
    Rule(r"^torchrun --nproc-per-node 2 -m adapt run k2-tp2ep2 ", _torchrun_equals_nproc),
    # adapt run
    Rule(r"^adapt init-model tiny-llama \./tiny-llama$", _ok(files=("tiny-llama/config.json",))),
    Rule(r"^adapt shard \./tiny-llama --out \./tiny-llama-int4 --quantize int4 --group-size 32$",
         _shard(1, "tiny-llama-int4")),
    Rule(r"^adapt run \./tiny-llama-int4 --prompt-ids 1,2,3 --format json \| jq \.stats\.weights$",
         _ok("int4 g32", stream="out")),
    Rule(r"^adapt init-model tiny-k2 \./tiny-k2$", _ok(files=("tiny-k2/config.json", "tiny-k2/tokenizer.json"))),
    Rule(r"^adapt run \./tiny-k2 --prompt \"Hello there\" --prompt \"The quick brown fox\" --max-tokens 16$",
         lambda r: _assert(len(_tokens(r)) >= 2, r.stdout)),
    Rule(r"^adapt run tiny-llama --prompt-ids 1,2,3 --prompt-ids 1,5 --format json \| jq \.stats$",
         _json(lambda d: _assert(d["decode_tokens"] > 0 and d["prefill_tokens"] == 5, d))),
    Rule(r"^adapt run \./my-model --prompt \"Write a poem\" --chat ", lambda r: _tokens(r), needs=("my-model",)),
    Rule(r"^adapt run \./shards .*--device cuda", _ok(), skip=_no_cuda),
    Rule(r"^adapt ops tiny-k2 --device cuda --format json \| jq \.ops$",
         _json(lambda d: _assert(len(d) >= 8 and all(o["impl"] for o in d)
                                 and {o["impl"] for o in d} <= {"triton", "torch"}, d))),
    Rule(r"^adapt ops tiny-k2 --device cpu$", _ok("mla_decode", "C++ fused", "cpu")),
    Rule(r"^TRITON_INTERPRET=1 adapt run tiny-llama --prompt-ids 1,2,3 --kernels triton --dtype float32 ",
         _json(lambda d: _assert(d["requested"] == "triton" and d["ops"]["paged_decode_attention"] == "triton", d)),
         skip=_no_triton),
    Rule(r"^adapt init-model tiny-qwen2\.5-vl \./tiny-vl$", _ok(files=("tiny-vl/preprocessor_config.json",))),
    Rule(r"^adapt run \./tiny-vl --image photo\.png --prompt \"What is in the picture\?\" --chat --max-tokens 8$",
         lambda r: _tokens(r), needs=("photo.png",)),
    Rule(r"^adapt run \./tiny-vl --image photo\.png --prompt .*--format json \| jq \.stats\.vision$",
         _json(lambda d: _assert(d["images"] == 1 and d["tokens"] > 0 and d["encoder_s"] > 0, d)),
         needs=("photo.png",)),
    # adapt serve
    Rule(r"^adapt serve tiny-llama --port 0$", _ok(), background=True),
    Rule(r"^adapt serve \./ckpt --device cuda", _ok(), skip=_no_cuda),
    Rule(r"^curl -s localhost:8000/v1/completions ", _completion),
    Rule(r"^curl -s localhost:8000/v1/chat/completions .*\"stream\": true", _chat_stream),
    Rule(r"^curl -s localhost:8000/metrics \| grep adapt:time_to_first_token$",
         _ok("# HELP adapt:time_to_first_token_seconds", "adapt:time_to_first_token_seconds_count")),
    Rule(r"^adapt serve tiny-qwen2\.5-vl --port 8000 --allow-remote-images --limit-images-per-prompt 2 "
         r"--image-fetch-timeout 5$", _ok(), background=True, subst={"--port 8000": "--port 0"}),
    Rule(r"^jq -n --arg url \"data:image/png;base64,\$\(base64 < photo\.png .*\| curl -s "
         r"localhost:8000/v1/chat/completions -d @-$", _image_chat, needs=("photo.png",)),
    # adapt validate
    Rule(r"^adapt validate dump \./ref-model --out golden/$", _ok(files=("golden",)), needs=("ref-model",)),
    Rule(r"^adapt validate \./shard-out --reference golden/ --out report/$", _ok(files=("report/report.html",)),
         needs=("shard-out",)),
    Rule(r"^adapt validate \./shard-out --reference golden/ --out report/ --write-baseline baseline\.json "
         r"--signer \"Jane Doe\"$", _baseline),
    Rule(r"^adapt validate \./shard-out --reference golden/ --out report/ --baseline baseline\.json$", _ok()),
    Rule(r"^adapt validate dump \./Kimi-K2-Instruct --stream --dry-run --memory-budget 32GB$",
         _ok("passes", "reads", "peak memory"), needs=("Kimi-K2-Instruct",)),
    Rule(r"^adapt validate dump deepseek-ai/DeepSeek-V3 --stream --dry-run --format json \| jq \.bytes_read$",
         _json(lambda d: _assert(isinstance(d, int) and d > 10 ** 12, d))),
    Rule(r"^adapt validate dump \./ref-model --out golden-streamed/ --stream --memory-budget 32GB$",
         _ok("streamed: read", files=("golden-streamed/golden.json",)), needs=("ref-model",)),
    # adapt slice
    Rule(r"^adapt slice \./DeepSeek-V3 --out ds3-slice --layers 0-1 --experts 0-3$",
         _ok("n_routed_experts", files=("ds3-slice/slice.json", "ds3-slice/config.json")), needs=("DeepSeek-V3",)),
    Rule(r"^adapt slice verify ds3-slice --source \./DeepSeek-V3$", _ok("ok:")),
    Rule(r"^adapt validate ds3-slice --reference ds3-slice --out slice-report/$",
         _ok(files=("slice-report/report.html",))),
    Rule(r"^adapt serve \./ref-model --port 8000$", _ok(), needs=("ref-model",), background=True,
         subst={"--port 8000": "--port 0"}),
    Rule(r"^adapt validate --endpoint http://localhost:8000 --reference \./ref-model --out report/$",
         _endpoint_report),
    Rule(r"^adapt validate dump --endpoint http://localhost:8000 \./ref-model --out golden-ep/$",
         _endpoint_golden),
    Rule(r"^adapt validate \./ref-model --reference golden-ep/ --out report-ep/$", _endpoint_golden_report),
    # adapt bench serve
    Rule(r"^adapt bench serve --endpoint http://localhost:8000 --requests 16 --concurrency 4 --input-len 32 "
         r"--output-len 8 --format json$", _json(lambda d: _bench_json(d, 16))),
    Rule(r"^adapt bench serve --endpoint http://localhost:8000 --requests 16 --rate 20 --output-len 8 "
         r"--slo ttft=0\.5,itl=0\.05$", _ok("completed 16, failed 0", "goodput", "server /metrics", stream="out")),
    # adapt day0
    Rule(r"^adapt day0 --out day0/$", _ok(files=("day0/day0.md", "day0/validate/report.html"))),
    Rule(r"^adapt day0 \./my-model --out day0/$", _ok(files=("day0/day0.md", "day0/validate/report.html")),
         needs=("my-model",)),
]


def rule_for(command: str) -> Rule:
    hits = [r for r in RULES if re.search(r.pattern, command)]
    assert len(hits) == 1, (f"README command {command!r} matches {len(hits)} rules of tests/flows/test_readme.py: "
                            "give it exactly one that checks what the README says it does")
    return hits[0]


def test_every_readme_command_has_a_rule():
    commands = [c for b in BLOCKS for c in b.commands]
    assert len(commands) >= 25, commands
    for c in commands:
        rule_for(c)


# --- inputs the README's commands assume ----------------------------------------------------------------------

def _adapt(*args: str, cwd: Path, env: dict) -> None:
    p = subprocess.run([sys.executable, "-m", "adapt", *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr[-2000:]


def _prepare(name: str, cwd: Path, env: dict) -> None:
    if (cwd / name).exists():
        return
    if name == "Kimi-K2-Instruct":
        (cwd / name).mkdir()
        shutil.copy(SHARED_CONFIGS / "moonshotai__Kimi-K2-Instruct.json", cwd / name / "config.json")
    elif name == "DeepSeek-V3":  # tp 8 x ep 8 needs 8 heads, 8 experts and sizes that split 8 ways
        from tests.fixtures.tiny import save_tiny

        save_tiny("deepseek_v3", cwd / name, num_attention_heads=8, num_key_value_heads=8, n_group=4)
    elif name == "plan.yaml":
        _prepare("DeepSeek-V3", cwd, env)
        _adapt("plan", "./DeepSeek-V3", "--out", "plan.yaml", cwd=cwd, env=env)
    elif name == "cluster.yaml":
        (cwd / name).write_text("hardware: h100-sxm\ndevices_per_node: 8\nnodes: 1\n")
    elif name == "ref-model":
        _adapt("init-model", "tiny-k2", "./ref-model", cwd=cwd, env=env)
    elif name == "shard-out":
        _prepare("ref-model", cwd, env)
        _adapt("shard", "./ref-model", "--out", "./shard-out", cwd=cwd, env=env)  # one rank: validate runs one process
    elif name == "photo.png":
        from tests.runtime.vision.vlm import make_image

        make_image(120, 80).save(cwd / name)
    elif name == "my-model":
        _adapt("init-model", "tiny-llama", "./my-model", cwd=cwd, env=env)
    else:
        raise AssertionError(f"no recipe for the README input {name!r}")


def _hub_cache(root: Path) -> Path:
    """A hub cache holding every shared published config, laid out as huggingface_hub writes it."""
    for cfg in SHARED_CONFIGS.glob("*__*.json"):
        owner, name = cfg.stem.split("__", 1)
        repo = root / f"models--{owner}--{name}"
        snap = repo / "snapshots" / ("0" * 40)
        snap.mkdir(parents=True)
        shutil.copy(cfg, snap / "config.json")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
    return root


@pytest.fixture(scope="module")
def readme_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    env = dict(os.environ)
    env.update(HF_HUB_CACHE=str(_hub_cache(root / "hub")), HF_HUB_OFFLINE="1", XDG_CONFIG_HOME=str(root / "config"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join(p for p in [str(Path.cwd()), env.get("PYTHONPATH", "")] if p))
    env.pop("ADAPT_SIGNING_KEY", None)
    return root, env


def _start_server(command: str, cwd: Path, env: dict) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(command, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True, executable="/bin/bash")
    seen = []
    for line in p.stderr:  # README: prints "serving tiny-llama on http://127.0.0.1:PORT" on stderr
        seen.append(line)
        m = re.search(r"serving \S+ on (http://127\.0\.0\.1:(\d+))", line)
        if m:
            return p, m.group(2)
    p.wait(10)
    raise AssertionError(f"{command!r} exited {p.returncode} before serving: {''.join(seen)[-2000:]}")


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block: Block, readme_env):
    root, env = readme_env
    cwd = root / block.id
    cwd.mkdir()
    servers: list[subprocess.Popen] = []
    port = None
    ran = 0
    try:
        for command in block.commands:
            rule = rule_for(command)
            reason = rule.skip()
            if reason:
                continue
            for name in rule.needs:
                _prepare(name, cwd, env)
            runnable = command
            for placeholder, real in rule.subst.items():
                runnable = runnable.replace(placeholder, real)
            if port is not None:
                runnable = runnable.replace("localhost:8000", f"127.0.0.1:{port}")
            if rule.background:
                server, port = _start_server(runnable, cwd, env)
                servers.append(server)
                ran += 1
                continue
            p = subprocess.run(runnable, shell=True, cwd=cwd, env=env, capture_output=True, text=True,
                               timeout=TIMEOUT, executable="/bin/bash")
            rule.check(Result(command, p.returncode, p.stdout, p.stderr, cwd))
            ran += 1
    finally:
        for s in servers:  # SIGTERM drains and exits 0 (README)
            os.killpg(s.pid, signal.SIGTERM)
            assert s.wait(30) == 0, s.stderr.read()[-2000:]
    if not ran:
        pytest.skip("every command of this block needs hardware this host lacks")
