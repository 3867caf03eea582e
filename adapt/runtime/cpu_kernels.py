"""Builds the fused CPU kernels (kernels/csrc/cpu_kernels.cpp) for this host, caches and installs them.

Why: a CPU decode step of a small batch is bound by the number of torch ops as much as by the weight
GEMMs. Every op pays dispatch and a pass over memory that the weight stream has just pushed out of the
caches (2-core Xeon: a 5 us RMSNorm takes 18 us right after a linear, 30 us after a 64 MB copy). In
torch, RMSNorm is seven ops, RoPE five, the paged decode attention seven to nine, the cache write two.
On the bench dense model in bfloat16 at batch 16, these ops took 7.4 ms of a 22.5 ms step, the linears
12.6 ms. One C++ function per kernel does each in a single pass (kernels/fused.py says which kernels
use them and when); the torch forms stay, as the fallback and for every other device, and the twins stay
the oracle.

``load()`` builds with g++ through torch.utils.cpp_extension (about 25 s on 2 cores, once per host and
source) into ``DIR/<key>/``, where key hashes the source, torch's and Python's versions and this CPU's
model and features (the build uses -march=native). DIR is ``$ADAPT_CPU_KERNELS_DIR``, by default
``$ADAPT_CACHE/cpu-kernels``. A later process imports the cached library directly. A missing compiler or
a failed build leaves the torch kernels in use: ``load`` returns None and ``status()`` says why.
``ADAPT_CPU_KERNELS=0`` turns the fused kernels off. Several processes building at once (the ranks of a
first multi-rank run) are serialized by a lock that a killed process releases (torch's own lock file
would then stay and hang the next build; it is removed under ours). A build is used only once its
library's size and sha256 are recorded beside it, so a library cut short by a kill while linking is
built again rather than mapped. A build that fails (no usable compiler) is recorded too, and later
processes do not try again until its directory is deleted.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

import torch

from adapt.runtime.kernels import fused

ENV = "ADAPT_CPU_KERNELS"
DIR_ENV = "ADAPT_CPU_KERNELS_DIR"
SOURCE = Path(fused.__file__).with_name("csrc") / "cpu_kernels.cpp"
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
FLAGS_ENV = "ADAPT_CPU_KERNELS_CFLAGS"  # extra compiler flags, e.g. -mno-avx512f to build the AVX2 form


def cflags() -> list[str]:
    import shlex

    return CFLAGS + shlex.split(os.environ.get(FLAGS_ENV, ""))


_status = "not loaded"
_failed = False  # this process tried and could not: the torch kernels, without trying again


def wanted() -> bool:
    """False when ``ADAPT_CPU_KERNELS`` turns the fused kernels off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def status() -> str:
    """One line: whether the fused CPU kernels are in use, and why not."""
    if not wanted():
        return f"off ({ENV}=0)"
    return _status


def build_dir() -> Path:
    d = os.environ.get(DIR_ENV)
    if d:
        return Path(d).expanduser()
    from adapt.runtime.init_model import cache_root

    return cache_root() / "cpu-kernels"


def needs_build() -> bool:
    """Whether ``load()`` would compile (wanted, not loaded, neither built nor failed before)."""
    if not wanted() or fused._module is not None or _failed:
        return False
    try:
        key = _key()
    except OSError:
        return False
    lib = build_dir() / key / f"adapt_cpu_{key}.so"
    return not _complete(lib) and not lib.with_suffix(".failed").is_file()


def _key() -> str:
    caps = torch._C._cpu._get_cpu_capability() if hasattr(torch._C, "_cpu") else {}
    h = hashlib.sha256()
    for f in [SOURCE] + sorted(SOURCE.parent.glob("*.h")):  # the module and the headers it includes
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(repr((torch.__version__, sys.version_info[:2], platform.machine(), str(caps.get("cpu_name", "")),
                   sorted(k for k, v in caps.items() if v is True), cflags())).encode())
    return h.hexdigest()[:16]


def load(root: Path | str | None = None):
    """Build (if needed), import and install the fused kernels; the module, or None with the reason in
    ``status()`` (the torch kernels then stay in use). Idempotent, and cheap once built."""
    global _status, _failed
    if not wanted():
        fused.install(None)
        return None
    if fused._module is not None:
        return fused._module
    if _failed:
        return None
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        _status = f"unavailable (no build for {platform.machine()})"
        return None
    try:
        key = _key()
        name = f"adapt_cpu_{key}"
        build = Path(root) / key if root is not None else build_dir() / key
        build.mkdir(parents=True, exist_ok=True)
        lib = build / f"{name}.so"
        failed = lib.with_suffix(".failed")
        complete = _complete(lib)
        if not complete and failed.is_file():  # a build of this source on this host failed before
            _failed = True
            _status = f"unavailable (the build failed earlier: {failed.read_text()[:160]}; delete {build} to retry)"
            return None
        mod = _import(name, lib) if complete else _build(name, build)
    except Exception as e:  # no compiler, no ninja, a failed build, an unwritable cache: torch kernels
        _failed = True
        _status = f"unavailable ({_first_line(e)[:200]})"
        return None
    fused.install(mod)
    _status = f"on ({lib})"
    return mod


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _complete(lib: Path) -> bool:
    """Whether ``lib`` is a finished build: its size and sha256 as recorded after the build returned (a
    library cut short by a kill while linking would crash the process that maps it)."""
    try:
        rec = json.loads(lib.with_suffix(".ok").read_text())
        return lib.stat().st_size == rec["size"] and hashlib.sha256(lib.read_bytes()).hexdigest() == rec["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _import(name: str, lib: Path):
    spec = importlib.util.spec_from_file_location(name, lib,
                                                  loader=importlib.machinery.ExtensionFileLoader(name, str(lib)))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(name: str, build: Path):
    import fcntl

    from torch.utils.cpp_extension import load as build_extension

    lib = build / f"{name}.so"
    with open(build / ".adapt-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if _complete(lib):
            return _import(name, lib)  # another process built it while we waited
        (build / "lock").unlink(missing_ok=True)  # torch's baton, stale if it exists while we hold ours
        lib.unlink(missing_ok=True)  # unrecorded: perhaps cut short; ninja would take it as up to date
        try:
            mod = build_extension(name, [str(SOURCE)], extra_cflags=cflags(), extra_ldflags=["-fopenmp"],
                             build_directory=str(build), verbose=False)
        except Exception as e:  # remembered, so that later processes do not spend the build time again
            lib.with_suffix(".failed").write_text(_first_line(e))
            raise
        rec = json.dumps({"size": lib.stat().st_size, "sha256": hashlib.sha256(lib.read_bytes()).hexdigest()})
        tmp = lib.with_suffix(".ok.tmp")
        tmp.write_text(rec)
        os.replace(tmp, lib.with_suffix(".ok"))  # the commit point of the build
        return mod
