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


def _adapt(*args, **env):
    import os
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e.update(env)
    return subprocess.run([sys.executable, "-m", "adapt", *args], capture_output=True, text=True, env=e, timeout=120)


def test_hub_id_without_network_fails_at_once_with_adapt_line_only(tmp_path):
    """A hub whose host does not resolve (`.invalid` never does) is not retried: no hub client log line, one
    error line of adapt's naming the host and the fix."""
    p = _adapt("profile", "deepseek-ai/DeepSeek-V3", HF_ENDPOINT="https://hub.adapt-test.invalid",
               HF_HUB_CACHE=str(tmp_path))
    assert p.returncode != 0 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("error: cannot fetch config.json of 'deepseek-ai/DeepSeek-V3'")
    assert "hub.adapt-test.invalid does not resolve" in lines[0] and "local directory" in lines[0]
    assert "thrown while requesting" not in p.stderr and "Retry" not in p.stderr


def test_hub_id_without_network_is_read_from_the_cache(tmp_path):
    from tests.fixtures.configs import SHARED_CONFIGS

    snap = tmp_path / "models--deepseek-ai--DeepSeek-V3" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((SHARED_CONFIGS / "deepseek-ai__DeepSeek-V3.json").read_text())
    (tmp_path / "models--deepseek-ai--DeepSeek-V3" / "refs").mkdir()
    (tmp_path / "models--deepseek-ai--DeepSeek-V3" / "refs" / "main").write_text("a" * 40)
    p = _adapt("profile", "deepseek-ai/DeepSeek-V3", "--format", "json", HF_ENDPOINT="https://hub.adapt-test.invalid",
               HF_HUB_CACHE=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["params"]["total"] == 671_026_419_200  # the published count, from the cache
    assert p.stderr == ""


def test_hub_host_lookup_is_bounded(monkeypatch):
    """getaddrinfo has no timeout of its own; a resolver that hangs counts as no network after the bound."""
    import threading

    import adapt.source as source

    release = threading.Event()
    monkeypatch.setattr(source.socket, "getaddrinfo", lambda *a, **k: release.wait(30))
    try:
        assert source._hub_host_resolves("https://huggingface.co", timeout=0.05) is False
    finally:
        release.set()
    monkeypatch.setattr(source.socket, "getaddrinfo", lambda *a, **k: [("ok",)])
    assert source._hub_host_resolves("https://huggingface.co", timeout=5) is True
