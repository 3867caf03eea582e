"""Bad input through the CLI: non-zero exit, one line on stderr, no traceback; ADAPT_DEBUG=1 shows it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapt.cli.main import main
from tests.fixtures.tiny import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def write(tmp_path, data, name="config.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def bad_inputs(tmp_path):
    # every llama key has a transformers default; DeepSeek-V2's num_experts_per_tok has none
    no_topk = tiny_config("deepseek_v2")
    del no_topk["num_experts_per_tok"]
    return {
        "malformed JSON": ([write(tmp_path, '{"model_type": "llama",', "a.json")], "malformed JSON at line 1"),
        "missing key": ([write(tmp_path, no_topk, "b.json")], "missing required key 'num_experts_per_tok'"),
        "no model_type": ([write(tmp_path, {"hidden_size": 64}, "c.json")], "no 'model_type'"),
        "unknown model_type": ([write(tmp_path, {"model_type": "gpt_neox"}, "d.json")],
                               "supported: llama, mistral"),
        "heads not dividing hidden": ([write(tmp_path, tiny_config("llama", hidden_size=66, head_dim=None), "e.json")],
                                      "not divisible by num_attention_heads"),
        "kv heads not dividing heads": ([write(tmp_path, tiny_config("llama", num_key_value_heads=3), "f.json")],
                                        "not divisible by num_key_value_heads"),
        "unknown hardware": (["tiny-llama", "--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'; built-in: "),
        "missing hardware file": (["tiny-llama", "--hardware", "nope.yaml"], "does not exist"),
        "bad format": (["tiny-llama", "--format", "xml"], "--format must be one of"),
        "bad phase": (["tiny-llama", "--phase", "train"], "--phase must be one of"),
        "bad dtype": (["tiny-llama", "--weights-dtype", "fp7"], "unknown dtype 'fp7'"),
        "unknown model": (["no-such-model"], "is not a directory, a config file"),
    }


def test_bad_inputs_one_line_no_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ADAPT_DEBUG", raising=False)
    for what, (argv, message) in bad_inputs(tmp_path).items():
        code, out, err = run(["profile", *argv], capsys)
        assert code != 0, what
        assert out == "", what
        lines = err.strip().splitlines()
        assert len(lines) == 1, (what, err)
        assert lines[0].startswith("error: ") and message in lines[0], (what, lines[0])
        assert "Traceback" not in err


def test_bad_hardware_yaml(tmp_path, capsys):
    bad = write(tmp_path, "name: X\nmemory_bytes: -1\n", "hw.yaml")
    code, _, err = run(["profile", "tiny-llama", "--hardware", bad], capsys)
    assert code == 1 and "missing required key" in err and len(err.strip().splitlines()) == 1
    broken = write(tmp_path, "name: [unclosed\n", "hw2.yaml")
    code, _, err = run(["profile", "tiny-llama", "--hardware", broken], capsys)
    assert code == 1 and "malformed YAML" in err


def test_debug_shows_traceback(tmp_path):
    cfg = write(tmp_path, {"model_type": "gpt_neox"})
    env = dict(os.environ, ADAPT_DEBUG="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "adapt", "profile", cfg], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=60)
    assert r.returncode != 0
    assert "Traceback (most recent call last)" in r.stderr and "UnsupportedModelError" in r.stderr
    env.pop("ADAPT_DEBUG")
    r = subprocess.run([sys.executable, "-m", "adapt", "profile", cfg], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv, message", [
    (["shard", "--bogus"], "No such option: --bogus"),
    (["run"], "Missing argument 'model'"),
    (["profile", "tiny-llama", "--format"], "requires an argument"),
    (["no-such-command"], "No such command 'no-such-command'"),
])
def test_usage_errors_one_line_exit_2(argv, message, capsys, monkeypatch):
    # typer >= 0.26 raises its own copy of click's exceptions: each is a usage error here, not an internal one
    monkeypatch.delenv("ADAPT_DEBUG", raising=False)
    code, out, err = run(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, (argv, err)
    assert lines[0].startswith("error: ") and message in lines[0] and "internal error" not in lines[0]


def test_only_the_invoked_command_is_imported():
    """`adapt shard ...` imports shard's command file alone (each file costs start-up time); `adapt --help`
    and an unknown command still see every command."""
    code = ("import sys\nfrom adapt.cli.main import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('adapt.cli.')))")

    def loaded(*argv):
        p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT)
        return p.stdout, p.stderr

    out, _ = loaded("shard", "--help")
    assert "adapt.cli.shard" in out and "adapt.cli.day0" not in out and "adapt.cli.plan'" not in out
    out, _ = loaded("init-model", "--help")
    assert "adapt.cli.init_model" in out and "adapt.cli.shard" not in out
    out, _ = loaded("--help")
    for cmd in ("day0", "init-model", "plan", "profile", "run", "serve", "shard", "validate", "hardware"):
        assert cmd in out
    _, err = loaded("shrad")
    assert "No such command 'shrad'" in err


def test_commands_registered_across_calls(capsys):
    """One process, several commands (as the tests and `day0` do): each call finds its own command."""
    for argv, text in ((["plan", "--help"], "--devices-per-node"), (["profile", "--help"], "--phase"),
                       (["shard", "verify", "--help"], "--source")):
        try:
            main(argv)  # --help returns (standalone_mode off)
        except SystemExit as e:
            assert e.code == 0, argv
        out = capsys.readouterr().out
        assert text in out, (argv, out[-500:])


def test_a_missing_package_is_named_with_its_install_command(capsys, tmp_path, monkeypatch):
    """The newcomer's `adapt day0` stopped with "internal error: ModuleNotFoundError: No module named
    'transformers'". transformers is a base dependency now; a package missing anyway is named with the command that
    installs it, read from adapt's own requirements (base or extra), never "internal error"."""
    from importlib import metadata

    from adapt.cli.missing import missing_package_line

    reqs = ["transformers>=4.57", "pytest>=8; extra == \"test\"", "triton>=3; extra == \"triton\""]
    monkeypatch.setattr(metadata, "requires", lambda name: reqs)
    line = missing_package_line(ModuleNotFoundError("x", name="transformers"))
    assert "'transformers'" in line and "one of adapt's dependencies" in line and "pip install -e ." in line
    assert "pip install 'adapt[triton]'" in missing_package_line(ModuleNotFoundError("x", name="triton.language"))
    assert "pip install some-pkg" in missing_package_line(ModuleNotFoundError("x", name="some_pkg"))
    assert missing_package_line(ModuleNotFoundError("x", name="adapt.nothing")) is None  # adapt's own: a bug

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ModuleNotFoundError
    from adapt.runtime.init_model import init_model

    ckpt = init_model("tiny-llama", tmp_path / "m")
    code, out, err = run(["validate", "dump", str(ckpt), "--out", str(tmp_path / "g")], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: this command needs the Python package "
                                                                 "'transformers'"), err
    assert "internal error" not in err and not (tmp_path / "g" / "golden.json").exists()
