import json

import pytest

from adapt.errors import ConfigError, ModelNotFoundError
from adapt.source import resolve_model


def test_dir_config_and_builtin(tmp_path):
    cfg = resolve_model("tiny-k2").config
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    src = resolve_model(str(tmp_path / "m"))
    assert src.kind == "dir" and src.directory == tmp_path / "m" and src.spec().family == "deepseek"
    src = resolve_model(str(tmp_path / "m" / "config.json"))
    assert src.kind == "config" and src.directory is None
    assert resolve_model("tiny-llama").kind == "builtin"


def test_errors(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path / "empty"))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        resolve_model(str(bad))
    with pytest.raises(ModelNotFoundError, match="built-in model"):
        resolve_model("not a model")


def test_hub_offline_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_model("someone/some-model-that-is-not-cached")
