"""Input checks before anything is written: malformed safetensors, layout mismatches, pickle, OUT safety."""

from __future__ import annotations

import json
import struct
import tracemalloc

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapt.cli.main import main
from adapt.errors import CheckpointError, ShardError
from adapt.shard import shard, verify
from adapt.shard.header import (HeaderFormatError, HeaderTooLargeError, OffsetError, SizeMismatchError,
                                TruncatedFileError, read_header)


def _raw(header: dict, data: bytes = b"", length: int | None = None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


CASES = {
    "too_large": (_raw({}, length=1 << 40), HeaderTooLargeError),
    "big_but_truncated": (_raw({}, length=50 << 20), TruncatedFileError),
    "overlap": (_raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)), OffsetError),
    "size_mismatch": (_raw({"a": {"dtype": "F32", "shape": [1 << 30], "data_offsets": [0, 8]}}, bytes(8)),
                      SizeMismatchError),
    "truncated_data": (_raw({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)),
                       TruncatedFileError),
    "gap": (_raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), OffsetError),
    "bad_json": (struct.pack("<Q", 5) + b"{nope", HeaderFormatError),
    "bad_dtype": (_raw({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, bytes(1)), HeaderFormatError),
    "short": (b"\x01\x02", TruncatedFileError),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_header_typed_error_without_allocation(case, tmp_path):
    data, err = CASES[case]
    p = tmp_path / "model.safetensors"
    p.write_bytes(data)
    tracemalloc.start()
    with pytest.raises(err) as e:
        read_header(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["too_large", "overlap", "size_mismatch", "truncated_data"])
def test_cli_one_line_error(case, llama_ckpt, tmp_path, capsys):
    victim = sorted(llama_ckpt.glob("*.safetensors"))[0]
    victim.write_bytes(CASES[case][0])
    with pytest.raises(SystemExit) as e:
        main(["shard", str(llama_ckpt), "--out", str(tmp_path / "o"), "--tp", "2"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def _rewrite(ckpt, key, fn):
    """Apply fn to the tensors of the checkpoint file holding key, keeping the index consistent."""
    idx = json.loads((ckpt / "model.safetensors.index.json").read_text())
    f = idx["weight_map"][key]
    t = load_file(str(ckpt / f))
    fn(t)
    save_file(t, str(ckpt / f), metadata={"format": "pt"})
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != f} | {k: f for k in t}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(idx))


def test_missing_extra_misshaped_listed_before_writing(llama_ckpt, tmp_path):
    def damage(t):
        del t["lm_head.weight"]
        t["bogus.weight"] = torch.zeros(2)
    _rewrite(llama_ckpt, "lm_head.weight", damage)
    _rewrite(llama_ckpt, "model.layers.1.input_layernorm.weight",
             lambda t: t.__setitem__("model.layers.1.input_layernorm.weight", torch.zeros(7)))
    with pytest.raises(CheckpointError) as e:
        shard(llama_ckpt, tmp_path / "o", tp=2)
    msg = str(e.value)
    assert "1 missing: lm_head.weight" in msg and "1 extra: bogus.weight" in msg and "mis-shaped" in msg
    assert "[7] (expected [64])" in msg
    assert not (tmp_path / "o").exists()


def test_pickle_refused_unless_allowed(tiny_ckpts, tmp_path):
    src = tiny_ckpts["qwen2"]
    d = tmp_path / "pk"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    sd = {}
    for f in src.glob("*.safetensors"):
        sd.update(load_file(str(f)))
    torch.save(sd, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="--allow-pickle"):
        shard(d, tmp_path / "o", tp=2)
    shard(d, tmp_path / "o", tp=2, allow_pickle=True)
    assert verify(tmp_path / "o", source=d, allow_pickle=True).ok



class _RunsCode:
    """A pickle payload that would create a file when unpickled by a full (not weights-only) unpickler."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_that_runs_code_is_refused_even_when_allowed(tiny_ckpts, tmp_path):
    # --allow-pickle loads with torch.load(weights_only=True): a payload with code is refused, not run
    src = tiny_ckpts["qwen2"]
    d = tmp_path / "evil"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    marker = tmp_path / "ran"
    torch.save({"model.embed_tokens.weight": _RunsCode(marker)}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        shard(d, tmp_path / "o", tp=2, allow_pickle=True)
    assert not marker.exists() and not (tmp_path / "o").exists()

def test_index_path_escape_refused(llama_ckpt, tmp_path):
    idx = json.loads((llama_ckpt / "model.safetensors.index.json").read_text())
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = "../outside.safetensors"
    (llama_ckpt / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="unsafe file name"):
        shard(llama_ckpt, tmp_path / "o")


def test_non_adapt_out_dir_needs_force(llama_ckpt, tmp_path):
    o = tmp_path / "o"
    o.mkdir()
    (o / "precious.txt").write_text("x")
    with pytest.raises(ShardError, match="--force"):
        shard(llama_ckpt, o, tp=2)
    shard(llama_ckpt, o, tp=2, force=True)
    assert (o / "precious.txt").read_text() == "x" and verify(o, source=llama_ckpt).ok
    shard(llama_ckpt, o, pp=2)  # an adapt directory: rerun with another plan needs no --force
    rep = verify(o, source=llama_ckpt)
    assert rep.ok, [p.line() for p in rep.problems]


def test_cli_plan_yaml_and_conflict(llama_ckpt, tmp_path, capsys):
    import yaml

    from adapt.plan import ParallelPlan
    from adapt.source import read_config
    from adapt.spec import ModelSpec

    spec = ModelSpec.from_hf_config(read_config(llama_ckpt / "config.json"))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(ParallelPlan.build(spec, tp=2, pp=2).to_dict()))
    main(["shard", str(llama_ckpt), "--out", str(tmp_path / "o"), "--plan", str(plan), "--format", "json"])
    s = json.loads(capsys.readouterr().out)
    assert s["world_size"] == 4 and s["plan"] == {"tp": 2, "pp": 2, "ep": 1, "dp": 1}
    with pytest.raises(SystemExit):
        main(["shard", str(llama_ckpt), "--out", str(tmp_path / "o2"), "--plan", str(plan), "--tp", "2"])
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("option,value", [("--max-file-size", "0"), ("--max-file-size", "infGB"),
                                          ("--max-file-size", "1e400GB"), ("--memory-budget", "abc"),
                                          ("--memory-budget", "nanMB"), ("--memory-budget", "-2GB")])
def test_cli_bad_size_names_its_option(option, value, llama_ckpt, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["shard", str(llama_ckpt), "--out", str(tmp_path / "o"), "--tp", "2", f"{option}={value}"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {option} must be a size") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
