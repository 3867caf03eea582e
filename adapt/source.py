"""Resolve a MODEL argument: a checkpoint directory, a config.json path, a built-in name or a hub id."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from adapt.builtin import BUILTIN_CONFIGS, builtin_config
from adapt.errors import ConfigError, ModelNotFoundError
from adapt.spec import ModelSpec

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model came from: its config, and its directory when it has weights on disk."""

    name: str
    config: dict
    directory: Path | None = None  # checkpoint directory, if any
    kind: str = "dir"  # dir | config | builtin | hub

    def spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(self.config, name=self.name)


def read_config(path: Path) -> dict:
    """Read a config.json with a one-line error for every way it can be wrong."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ModelNotFoundError(f"cannot read {path}: {e.strerror}") from e
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return cfg


def is_hub_id(model: str) -> bool:
    """Whether MODEL has the form of a hub repository id (owner/name)."""
    return bool(_HUB_ID.match(model))


def resolve_model(model: str) -> ModelSource:
    """Turn MODEL into a ModelSource. Built-in names win over same-named relative paths that don't exist."""
    path = Path(model).expanduser()
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ModelNotFoundError(f"{path} has no config.json")
        return ModelSource(path.name, read_config(cfg_path), path, "dir")
    if path.is_file():
        return ModelSource(path.stem, read_config(path), None, "config")
    cfg = builtin_config(model)
    if cfg is not None:
        return ModelSource(model, cfg, None, "builtin")
    if _HUB_ID.match(model):
        return _from_hub(model)
    raise ModelNotFoundError(
        f"{model!r} is not a directory, a config file, a built-in model ({', '.join(BUILTIN_CONFIGS)}) "
        "or a hub id (owner/name)")


def _hub_host_resolves(endpoint: str, timeout: float = 3.0) -> bool:
    """Whether the hub's host name resolves within ``timeout`` seconds (getaddrinfo itself has no timeout)."""
    host = urlparse(endpoint).hostname
    if not host:
        return False
    done: list[bool] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
            done.append(True)
        except OSError:
            done.append(False)

    t = threading.Thread(target=lookup, daemon=True)
    t.start()
    t.join(timeout)
    return bool(done and done[0])


@contextlib.contextmanager
def _quiet_hub():
    """huggingface_hub logs its retries ("... thrown while requesting HEAD ...") before it raises; adapt says one line."""
    log = logging.getLogger("huggingface_hub")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _from_hub(repo_id: str) -> ModelSource:
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise ModelNotFoundError(f"huggingface_hub is not installed: cannot fetch {repo_id}") from e
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    # No network: the hub client would spend ~20 s retrying a name that does not resolve. Look the host up first
    # and, when it does not resolve, answer from the cache alone.
    unreachable = not offline and not _hub_host_resolves(constants.ENDPOINT)
    try:
        with _quiet_hub():
            try:
                local = hf_hub_download(repo_id, "config.json", local_files_only=offline or unreachable,
                                        etag_timeout=5)
            except LocalEntryNotFoundError as e:  # offline / unreachable and not cached (an EntryNotFoundError too)
                raise ConnectionError(str(e)) from e
    except (RepositoryNotFoundError, EntryNotFoundError) as e:
        raise ModelNotFoundError(f"hub repo {repo_id!r} has no config.json or does not exist") from e
    except Exception as e:  # offline, unreachable, gated: huggingface_hub raises many types
        if offline:
            why = "HF_HUB_OFFLINE is set and it is not in the cache"
        elif unreachable:
            why = f"the hub's host {urlparse(constants.ENDPOINT).hostname} does not resolve (no network?) " \
                  "and it is not in the cache"
        else:
            why = f"the hub is unreachable ({type(e).__name__})"
        raise ModelNotFoundError(
            f"cannot fetch config.json of {repo_id!r}: {why}; "
            f"download it into the cache ({cache}) or pass a local directory or config.json") from e
    return ModelSource(repo_id, read_config(Path(local)), None, "hub")
