"""`adapt plan` end to end: JSON contract, plan.yaml round trip, --check, --emit, one-line errors."""

import json

import pytest
import yaml

from adapt.cli.main import main
from tests.plan.conftest import CONFIGS

DSV3 = str(CONFIGS / "deepseek-ai__DeepSeek-V3.json")
L405 = str(CONFIGS / "meta-llama__Llama-3.1-405B.json")
FIELDS = {"tp", "pp", "ep", "dp", "world_size", "nodes", "memory_per_device_bytes", "est_ttft_s", "est_tpot_s",
          "est_tokens_per_s"}


def run(capsys, *argv):
    try:
        main(["plan", *argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract(capsys):
    code, out, _ = run(capsys, DSV3, "-H", "h200", "--context", "32768", "--format", "json")
    assert code == 0
    doc = json.loads(out)
    assert FIELDS <= set(doc["recommended"])
    assert doc["recommended"]["nodes"] == 1 and doc["recommended"]["world_size"] == 8
    assert doc["candidates"] and all(FIELDS <= set(c) for c in doc["candidates"])
    assert all({"layout", "reason"} <= set(r) for r in doc["rejected"])


def test_nothing_fits_is_null_and_non_zero(capsys):
    code, out, err = run(capsys, L405, "-H", "h100-sxm", "--nodes", "1", "--format", "json")
    assert code != 0
    doc = json.loads(out)
    assert doc["recommended"] is None and doc["candidates"] == []
    assert err.strip().count("\n") == 0 and "needs" in err and "GB usable" in err


def test_fp8_min_devices_and_table(capsys):
    code, out, err = run(capsys, L405, "--max-nodes", "2", "--weights-dtype", "fp8", "--objective", "min-devices")
    assert code == 0 and "tp8.pp1.ep1.dp1" in out and "on 8 devices (1 node(s))" in err


def test_out_then_check_and_emit(capsys, tmp_path):
    plan = tmp_path / "plan.yaml"
    code, _, _ = run(capsys, DSV3, "-H", "h200", "--context", "32768", "--out", str(plan), "--format", "json")
    assert code == 0
    d = yaml.safe_load(plan.read_text())
    assert d["world_size"] == 8 and len(d["ranks"]) == 8
    r0 = d["ranks"][0]
    assert {"rank", "node", "local_rank", "tp", "pp", "ep", "dp", "layers", "experts"} <= set(r0)
    assert sorted(e for r in d["ranks"] if r["tp"] == 0 or d["degrees"]["ep"] > 1 for e in r["experts"])[:1] == [0]
    code, out, _ = run(capsys, DSV3, "-H", "h200", "--check", str(plan))
    assert code == 0 and "OK" in out and "covered once per replica" in out
    for engine, flag in (("vllm", "vllm serve"), ("sglang", "sglang.launch_server")):
        code, out, _ = run(capsys, DSV3, "-H", "h200", "--check", str(plan), "--emit", engine)
        assert code == 0 and flag in out


def test_emit_flags(capsys):
    code, out, _ = run(capsys, L405, "--nodes", "2", "--emit", "vllm")
    assert code == 0 and "--tensor-parallel-size 8 --pipeline-parallel-size 2" in out
    code, out, _ = run(capsys, DSV3, "-H", "h200", "--objective", "throughput", "--emit", "sglang")
    assert code == 0 and "--tp-size 8" in out and "--ep-size" in out


def _plan(tmp_path, capsys):
    p = tmp_path / "good.yaml"
    assert run(capsys, L405, "--nodes", "2", "--out", str(p))[0] == 0
    return yaml.safe_load(p.read_text())


def _one_line_error(capsys, tmp_path, *argv):
    code, out, err = run(capsys, *argv)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(colour="red"), "'colour'"),
    (lambda d: d.update(world_size=12), "'world_size'"),
    (lambda d: d["degrees"].update(cp=2), "'degrees.cp'"),
    (lambda d: d.update(ranks=[r for r in d["ranks"] if r["rank"] != 5]), "gap: rank 5"),
    (lambda d: d["ranks"].__setitem__(3, dict(d["ranks"][3], rank=2)), "'ranks[3].rank' 2 overlaps"),
    (lambda d: d["ranks"][0].update(gpu=1), "'ranks[0].gpu'"),
    (lambda d: d["ranks"][9].update(node=0), "'ranks[9].node'"),
    (lambda d: d.update(layer_ranges=[[0, 60], [62, 126]]), "'layer_ranges[1]'"),
])
def test_bad_plan_files(capsys, tmp_path, edit, field):
    d = _plan(tmp_path, capsys)
    edit(d)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(d))
    line = _one_line_error(capsys, tmp_path, L405, "--nodes", "2", "--check", str(bad))
    assert field in line


@pytest.mark.parametrize("text, field", [
    ("hardware: h200\ngpus_per_node: 8\n", "'gpus_per_node'"),
    ("devices_per_node: 8\n", "'hardware'"),
    ("hardware: h200\nmemory_utilization: 1.5\n", "'memory_utilization'"),
    ("hardware: h200\nnodes: 2\nmax_nodes: 4\n", "'nodes'"),
    ("hardware: h200\ninter_node_bandwidth: -1\n", "'inter_node_bandwidth'"),
    ("hardware: h200\ndevices_per_node: 0\n", "'devices_per_node'"),  # 0 is not "the hardware's default"
    ("hardware: {name: x, memory_bytes: 1, memory_bandwidth: 1, flops: {bfloat16: 1}, source: s, hbm: 3}\n",
     "'hbm'"),
    ("hardware: [h200\n", "malformed YAML"),
])
def test_bad_cluster_files(capsys, tmp_path, text, field):
    f = tmp_path / "cluster.yaml"
    f.write_text(text)
    assert field in _one_line_error(capsys, tmp_path, L405, "--cluster", str(f))


def test_cluster_file(capsys, tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text("hardware: h100-sxm\ndevices_per_node: 8\nnodes: 2\ninter_node_bandwidth: 2.5e10\n"
                 "memory_utilization: 0.85\n")
    code, out, _ = run(capsys, L405, "--cluster", str(f), "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["recommended"]["nodes"] == 2
    assert doc["cluster"]["inter_node_bandwidth"] == 2.5e10 and doc["cluster"]["memory_utilization"] == 0.85


@pytest.mark.parametrize("argv, field", [
    (("--devices-per-node", "0"), "'devices_per_node'"),
    (("--inter-node-bandwidth", "0"), "'inter_node_bandwidth'"),
    (("--intra-node-latency", "0"), "'intra_node_latency_s'"),
    (("--top", "0"), "--top"),
])
def test_zero_is_an_error_not_the_default(capsys, tmp_path, argv, field):
    assert field in _one_line_error(capsys, tmp_path, L405, *argv)


def test_check_uses_the_workload_the_plan_was_searched_for(capsys, tmp_path):
    """`plan --out plan.yaml --weights-dtype fp8` then `plan --check plan.yaml` (the README's two lines) checks the
    plan at fp8: before, --check fell back to the native bf16 and said 104 GB per device does not fit."""
    f = tmp_path / "plan.yaml"
    code, _, _ = run(capsys, L405, "-H", "h100-sxm", "--max-nodes", "2", "--weights-dtype", "fp8", "--out", str(f))
    assert code == 0
    code, out, err = run(capsys, "--check", str(f), L405, "-H", "h100-sxm")
    assert code == 0 and "OK tp8.pp1.ep1.dp1" in out, err
    code, _, err = run(capsys, "--check", str(f), L405, "-H", "h100-sxm", "--weights-dtype", "bf16")  # given: wins
    assert code != 0 and "does not fit" in err


def test_ep_alone_names_the_two_layouts_it_likely_means(capsys, tmp_path):
    """`--ep 2` with tp = dp = 1 used to say "ep over the tp x dp ranks of a stage: 1 is not divisible by 2
    (1 = 0 x 2 + 1)"; now one line says what ep spans and the two layouts a user likely means."""
    from adapt.runtime.init_model import init_model

    ckpt = init_model("tiny-k2", tmp_path / "k2")
    plan = tmp_path / "plan.yaml"  # a hand-written plan: one rank, ep 2
    plan.write_text("degrees: {tp: 1, pp: 1, ep: 2, dp: 1}\nworld_size: 1\n")
    for argv in (["shard", str(ckpt), "--out", str(tmp_path / "out"), "--ep", "2"],
                 ["plan", "--check", str(plan), str(ckpt)]):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
        _, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code != 0 and len(lines) == 1, err
        assert "--ep 2 splits the experts over the tp x dp ranks of a pipeline stage" in lines[0]
        assert "--tp 2 --ep 2 (vLLM's TP + expert parallel)" in lines[0]
        assert "--dp 2 --ep 2 (SGLang's DP-attention + EP)" in lines[0]
    assert not (tmp_path / "out").exists()
