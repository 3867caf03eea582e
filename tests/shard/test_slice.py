"""`adapt slice`: a smaller checkpoint of real weights that transformers loads, every stage runs and `adapt
validate` passes, with a manifest tying each tensor to its source bytes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapt.errors import ConfigError, ShardError
from adapt.shard.slice import slice_checkpoint, verify_slice
from tests.fixtures.tiny import save_tiny

from .conftest import write_fp8_checkpoint


def _cli(*argv) -> int:
    from adapt.cli.main import main

    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.fixture(scope="module")
def ds3(tmp_path_factory):
    _, d = save_tiny("deepseek_v3", tmp_path_factory.mktemp("ds3") / "m")  # 3 layers (1 dense), 8 experts, 4 groups
    return d


@pytest.fixture(scope="module")
def sliced(ds3, tmp_path_factory):
    out = tmp_path_factory.mktemp("slice") / "s"
    assert _cli("slice", ds3, "--out", out, "--layers", "0-1", "--experts", "0-3") == 0
    return out


def test_transformers_loads_the_slice_and_the_config_says_what_changed(sliced):
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(sliced, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace) \
        == (2, 4, 2, 2, 1)
    doc = json.loads((sliced / "slice.json").read_text())
    assert {a["key"] for a in doc["adjustments"]} >= {"num_hidden_layers", "n_routed_experts", "n_group"}
    assert all(a["why"] for a in doc["adjustments"])
    assert doc["tensors"]["model.layers.1.mlp.gate.weight"]["rows"] == [0, 1, 2, 3]
    assert doc["tensors"]["model.layers.1.mlp.experts.3.up_proj.weight"]["source"] == \
        "model.layers.1.mlp.experts.3.up_proj.weight"
    assert not (sliced / "manifest.json").exists()  # not mistaken for an adapt shard output


def test_provenance_ties_each_tensor_to_its_source_bytes(ds3, sliced, tmp_path):
    import shutil

    rep = verify_slice(sliced, ds3)
    assert rep["source_checked"] and rep["tensors"] == len(json.loads((sliced / "slice.json").read_text())["tensors"])
    assert _cli("slice", "verify", sliced, "--source", ds3) == 0
    # a slice whose file was rewritten with other bytes (the manifest's file hash updated to hide it) fails
    bad = shutil.copytree(sliced, tmp_path / "bad")
    doc = json.loads((bad / "slice.json").read_text())
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    f = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    ts = load_file(bad / f)
    ts[name] = ts[name] + 1e-3
    save_file(ts, bad / f, metadata={"format": "pt"})
    with pytest.raises(ShardError, match="changed"):
        verify_slice(bad)
    from adapt.shard.slice import _file_sha

    doc["files"][f] = _file_sha(bad / f)
    (bad / "slice.json").write_text(json.dumps(doc))
    with pytest.raises(ShardError, match=name):
        verify_slice(bad)
    # a source that is not the one it was cut from fails against it
    other = save_tiny("deepseek_v3", tmp_path / "other", seed=1)[1]
    with pytest.raises(ShardError, match="changed since"):
        verify_slice(sliced, other)


def test_all_experts_slice_computes_the_source_layers(ds3, tmp_path):
    """Real weights: with every expert kept, the slice's two layers are the source's first two, bit for bit."""
    from adapt.validate.reference import HFReference

    out = tmp_path / "s"
    doc = slice_checkpoint(ds3, out, [0, 1])
    assert {a["key"] for a in doc["adjustments"]} == {"num_hidden_layers", "num_nextn_predict_layers"}
    a, b = HFReference(ds3).layers(0), HFReference(out).layers(0)
    for n in ("embedding", "layers.0", "layers.1.attention", "layers.1.mlp", "layers.1"):
        assert torch.equal(a[n], b[n]), n


def test_the_slice_runs_through_every_stage(sliced, tmp_path, capsys):
    assert _cli("profile", sliced, "--format", "json") == 0
    assert json.loads(capsys.readouterr().out)
    assert _cli("plan", sliced, "-H", "h100-sxm", "--format", "json") == 0
    capsys.readouterr()
    assert _cli("shard", sliced, "--out", tmp_path / "sh", "--tp", "2", "--ep", "2") == 0
    assert _cli("shard", "verify", tmp_path / "sh", "--source", sliced) == 0
    capsys.readouterr()
    assert _cli("run", sliced, "--prompt-ids", "5,9,13", "--max-tokens", "4", "--format", "json") == 0
    assert len(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]) == 4
    assert _cli("validate", sliced, "--reference", sliced, "--out", tmp_path / "v") == 0


def test_groups_bad_selections_and_existing_out(ds3, tmp_path, capsys):
    doc = slice_checkpoint(ds3, tmp_path / "a", [1, 2], [0, 2, 4, 6])  # one expert of each group: not whole groups
    adj = {a["key"]: a for a in doc["adjustments"]}
    assert adj["n_group"]["to"] == 1 and adj["topk_group"]["to"] == 1 and "plain top-k" in adj["n_group"]["why"]
    assert adj["first_k_dense_replace"]["to"] == 0
    assert verify_slice(tmp_path / "a", ds3)["tensors"] > 0
    with pytest.raises(ConfigError, match="at least 2"):
        slice_checkpoint(ds3, tmp_path / "b", [1], [3])
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.partial-*"))
    assert _cli("slice", ds3, "--out", tmp_path / "c", "--layers", "0-5") == 1
    assert "out of range" in capsys.readouterr().err
    assert _cli("slice", ds3, "--out", tmp_path / "a", "--layers", "0") == 1
    assert "--force" in capsys.readouterr().err
    assert _cli("slice", ds3, "--out", tmp_path / "a", "--layers", "0", "--force") == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_hidden_layers"] == 1


def test_fp8_slice_keeps_bytes_scales_and_mtp(tmp_path):
    src = write_fp8_checkpoint(tmp_path / "fp8")  # 3 layers (1 dense), 4 experts, one MTP layer (index 3)
    doc = slice_checkpoint(src, tmp_path / "s", [1], [2, 3], keep_mtp=True)
    t = doc["tensors"]
    assert t["model.layers.0.mlp.experts.0.gate_proj.weight"]["source"] == "model.layers.1.mlp.experts.2.gate_proj.weight"
    assert t["model.layers.0.mlp.experts.0.gate_proj.weight"]["dtype"] == "float8_e4m3fn"
    assert "model.layers.0.mlp.experts.1.down_proj.weight_scale_inv" in t
    assert t["model.layers.1.enorm.weight"]["source"] == "model.layers.3.enorm.weight"  # MTP renumbered after
    assert t["model.layers.1.mlp.experts.1.up_proj.weight"]["source"] == "model.layers.3.mlp.experts.3.up_proj.weight"
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["quantization_config"]["quant_method"] == "fp8"
    assert verify_slice(tmp_path / "s", src)["source_checked"]
    no_mtp = slice_checkpoint(src, tmp_path / "n", [1], [2, 3])
    assert not any(".layers.1." in n for n in no_mtp["tensors"])
    assert json.loads((tmp_path / "n" / "config.json").read_text())["num_nextn_predict_layers"] == 0
