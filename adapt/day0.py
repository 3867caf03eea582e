"""``adapt day0 [MODEL] --out DIR``: profile -> ops -> plan -> shard -> run -> validate -> report, in one directory.

Each stage is the stage's own command (``python -m adapt <stage> ...``, the same spelling a user types),
run as a child process with its output in ``DIR/logs/<stage>.log``, so a stage is exactly what the user
would get by hand and day0 depends on no stage's internals. validate runs in this process (it is the
library below this module). Every stage is logged with its time, exit status and artifacts; a stage
whose command does not exist yet, or whose input a failed stage did not produce, is ``skip`` with the
reason, never faked. With no MODEL the built-in tiny-k2 is written first (``adapt init-model``).

``DIR`` afterwards::

    model/ (when built in)  profile.json  ops.json  plan.yaml  plan.json  shard/  run.json  validate/  logs/
    day0.json (the stage records)  day0.md (the same as a table, then the operator-mapping table of ops.json)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapt.builtin import BUILTIN_CONFIGS
from adapt.source import is_hub_id, resolve_model

DEFAULT_MODEL = "tiny-k2"
STAGE_TIMEOUT_S = 600
RUN_PROMPT = "The capital of France is"
RUN_IDS = "1,17,42,99,7"  # checkpoints without a tokenizer


@dataclass
class Stage:
    """One stage's record: status pass | fail | skip, seconds, artifacts (paths relative to DIR)."""

    name: str
    status: str
    seconds: float = 0.0
    artifacts: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    message: str = ""


@dataclass
class Day0Result:
    out: Path
    stages: list[Stage]
    exit_code: int
    seconds: float
    validate_exit: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"out": str(self.out), "exit_code": self.exit_code, "seconds": round(self.seconds, 3),
                "validate_exit_code": self.validate_exit, "stages": [asdict(s) for s in self.stages]}


def devices_present() -> tuple[str, int]:
    """(device type, count): accelerators torch can see, else ("cpu", 1)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda", torch.cuda.device_count()
    for name in ("xpu", "npu", "mps"):
        mod = getattr(torch, name, None)
        try:
            if mod is not None and mod.is_available():
                return name, int(getattr(mod, "device_count", lambda: 1)())
        except Exception:  # noqa: BLE001 - a backend probe must never stop day0
            continue
    return "cpu", 1


class _Chain:
    def __init__(self, out: Path, log: Callable[[str], None]):
        self.out, self.log, self.stages = out, log, []
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def rel(self, p: Path) -> str:
        try:
            return str(p.relative_to(self.out))
        except ValueError:
            return str(p)

    def record(self, st: Stage) -> Stage:
        self.stages.append(st)
        arts = ", ".join(st.artifacts) or "-"
        self.log(f"[day0] {st.name:<9} {st.status:<4} {st.seconds:7.2f}s  {arts}" + (f"  ({st.message})" if st.message else ""))
        return st

    def skip(self, name: str, why: str) -> Stage:
        return self.record(Stage(name, "skip", message=why))

    def cli(self, name: str, args: list[str], artifacts: list[Path], stdout_to: Path | None = None) -> Stage:
        """Run ``python -m adapt ARGS``; pass when it exits 0 and every artifact exists."""
        cmd = [sys.executable, "-m", "adapt", *args]
        logf = self.out / "logs" / f"{name}.log"
        t0 = time.perf_counter()
        env = dict(os.environ, ADAPT_DEBUG="")
        with logf.open("w") as lf:
            out_f = stdout_to.open("w") if stdout_to is not None else lf
            try:
                proc = subprocess.run(cmd, stdout=out_f, stderr=lf, timeout=STAGE_TIMEOUT_S, env=env)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = 124
            finally:
                if stdout_to is not None:
                    out_f.close()
        secs = time.perf_counter() - t0
        text = logf.read_text(errors="replace")
        shown = [a for a in artifacts if a.exists()] + [logf]
        if rc != 0 and ("No such command" in text or "no such command" in text.lower()):
            return self.record(Stage(name, "skip", secs, [self.rel(logf)], cmd[2:],
                                     f"`adapt {args[0]}` is not available yet"))
        missing = [self.rel(a) for a in artifacts if not a.exists()]
        if rc != 0 or missing:
            last = text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"
            why = f"exit {rc}: {last[:200]}" if rc else f"did not write {', '.join(missing)}"
            return self.record(Stage(name, "fail", secs, [self.rel(a) for a in shown], cmd[2:], why))
        return self.record(Stage(name, "pass", secs, [self.rel(a) for a in shown], cmd[2:]))


def _world_size(plan_json: Path) -> int:
    try:
        d = json.loads(plan_json.read_text())
    except (OSError, json.JSONDecodeError):
        return 1
    plan = d.get("plan", d) if isinstance(d, dict) else {}
    rec = plan.get("recommended", plan) if isinstance(plan, dict) else {}
    try:
        return max(1, int(rec.get("world_size") or int(rec.get("tp", 1)) * int(rec.get("pp", 1)) * int(rec.get("dp", 1))))
    except (TypeError, ValueError, AttributeError):
        return 1


def day0(model: str | None, out: str | Path, log: Callable[[str], None] = print, device: str | None = None,
         dtype: str = "float32", checklist: str | Path | None = None) -> Day0Result:
    """Run the whole chain into ``out``; see the module docstring. Returns every stage's record."""
    t_all = time.perf_counter()
    if model is not None and (Path(model).expanduser().exists() or not is_hub_id(model)):
        resolve_model(model)  # no such model, or a broken config: one line before anything is written
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    c = _Chain(out, log)
    if model is None or (model in BUILTIN_CONFIGS and not Path(model).expanduser().exists()):
        mdir = out / "model"  # a built-in name (tiny-qwen2.5-vl ...): its checkpoint is written here first
        st = c.cli("init", ["init-model", model or DEFAULT_MODEL, str(mdir)],
                   [mdir / "config.json", mdir / "model.safetensors"])
        model = str(mdir) if st.status == "pass" else None
    if model is None:
        return _finish(c, t_all, None)
    kind, count = devices_present()
    dev = device or ("cpu" if kind == "cpu" else kind)
    c.cli("profile", ["profile", model, "--format", "json", "--out", str(out / "profile.json")], [out / "profile.json"])
    c.cli("ops", ["ops", model, "--device", dev, "--dtype", dtype, "--format", "json", "--out", str(out / "ops.json")],
          [out / "ops.json"])  # which kernel runs each op on this device (the operator-mapping table)
    plan_yaml, plan_json = out / "plan.yaml", out / "plan.json"
    p = c.cli("plan", ["plan", model, "--devices-per-node", str(count), "--nodes", "1", "--format", "json",
                       "--out", str(plan_yaml)], [plan_yaml], stdout_to=plan_json)
    if p.status == "pass":
        p.artifacts.append(c.rel(plan_json))
        if kind == "cpu":
            p.message = "no accelerator present: planned for 1 device of the default hardware"
    shard_dir = out / "shard"
    if not Path(model).is_dir():
        c.skip("shard", f"{model} is not a checkpoint directory")
        target = None
    elif p.status != "pass":
        c.skip("shard", "no plan.yaml (the plan stage did not pass)")
        target = None
    else:
        s = c.cli("shard", ["shard", "run", model, "--plan", str(plan_yaml), "--out", str(shard_dir), "--force"],
                  [shard_dir / "manifest.json"])
        target = shard_dir if s.status == "pass" else None
    if target is None:
        c.skip("run", "no shard output to run")
    else:
        world = _world_size(plan_json)
        prompt = ["--prompt", RUN_PROMPT] if (Path(model) / "tokenizer.json").is_file() else ["--prompt-ids", RUN_IDS]
        args = ["run", str(target), *prompt, "--max-tokens", "16", "--temperature", "0",
                "--format", "json", "--device", dev, "--dtype", dtype]
        if world > 1:
            args += ["--nproc", str(world)]
        c.cli("run", args, [out / "run.json"], stdout_to=out / "run.json")
    vexit = _validate(c, target, model, dev, dtype, checklist)
    return _finish(c, t_all, vexit)


def _validate(c: _Chain, target: Path | None, model: str, device: str, dtype: str,
              checklist: str | Path | None) -> int | None:
    if target is None:
        c.skip("validate", "no shard output to validate")
        return None
    from adapt.errors import AdaptError
    from adapt.validate.runner import validate

    t0 = time.perf_counter()
    vdir = c.out / "validate"
    try:
        res = validate(target, model, vdir, device=device, dtype=dtype, checklist=checklist)
    except AdaptError as e:
        c.record(Stage("validate", "fail", time.perf_counter() - t0, message=str(e)))
        return 2
    s = res.report.summary["by_status"]
    status = "pass" if res.exit_code == 0 else "fail"
    c.record(Stage("validate", status, time.perf_counter() - t0, [c.rel(p) for p in res.paths.values()],
                   ["validate", str(target), "--reference", model, "--out", str(vdir)],
                   f"{s['pass']} pass, {s['fail']} fail, {s['skip']} skip, {s['error']} error"))
    return res.exit_code


def render_markdown(res: Day0Result) -> str:
    rows = ["| stage | status | seconds | artifacts | note |", "|---|---|---:|---|---|"]
    for s in res.stages:
        note = s.message.replace("|", "\\|")
        rows.append(f"| {s.name} | {s.status} | {s.seconds:.2f} | {', '.join(s.artifacts)} | {note} |")
    text = (f"# adapt day0\n\nexit code {res.exit_code}, {res.seconds:.1f}s; validation report: "
            f"validate/report.html\n\n" + "\n".join(rows) + "\n")
    ops = res.out / "ops.json"
    if ops.is_file():  # the ops stage's table (adapt ops), as markdown
        from adapt.runtime.backends.table import to_markdown

        text += "\n## Operator mapping\n\n" + to_markdown(json.loads(ops.read_text()))
    return text


def _finish(c: _Chain, t_all: float, vexit: int | None) -> Day0Result:
    failed = any(s.status == "fail" for s in c.stages)
    code = vexit if vexit else (1 if failed else 0)
    res = Day0Result(c.out, c.stages, code, time.perf_counter() - t_all, vexit)
    c.record(Stage("report", "pass", 0.0, ["day0.json", "day0.md"]))
    res.seconds = time.perf_counter() - t_all
    (c.out / "day0.json").write_text(json.dumps(res.to_dict(), indent=2) + "\n")
    (c.out / "day0.md").write_text(render_markdown(res))
    return res
