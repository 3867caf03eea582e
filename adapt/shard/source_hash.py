"""The sha256 of a source checkpoint file, computed once and reused when that is free and safe.

Three ways, in this order (the manifest records which, as ``sha256_from``):

- ``cached``: the resume state (journal or previous manifest in OUT) holds a digest for the same file
  name with the same size, mtime_ns and inode; the file is assumed unchanged when all three are.
- ``hub-blob``: the file is a Hugging Face hub cache entry, ``.../snapshots/<rev>/<name>`` a symlink to
  ``.../blobs/<64 hex>``. The hub stores git-LFS files under their LFS oid, which is the sha256 of the
  content (non-LFS files are stored under a 40-hex git sha1 and do not qualify). Trust assumption: the
  cache is intact, i.e. nobody edited a blob in place after the hub client downloaded it. Pass
  ``trust_hub_cache=False`` (``adapt shard --rehash-source``) to hash anyway; ``adapt shard verify
  --source`` always re-hashes.
- ``hub-local-dir``: the file was downloaded with ``hf download ... --local-dir DIR`` (``hf_hub_download(...,
  local_dir=DIR)``), which leaves ``DIR/.cache/huggingface/download/<name>.metadata``: the commit, the
  file's etag (the LFS oid, i.e. the sha256, for LFS files) and the time it was written. The etag is used
  when it is 64 hex digits and the file was not modified after that time (the hub client's own rule for
  reusing a local file, with its one-second allowance). Same trust assumption and opt-out as ``hub-blob``.
- ``hashed``: hashed by ``adapt shard`` while it reads the file for the outputs (:mod:`adapt.shard.fanout`),
  so each source byte is read once; ``source_digest`` hashes a file on its own.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from adapt.shard.hashing import sha256_file

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def hub_blob_sha256(path: Path) -> str | None:
    """The sha256 a hub-cache symlink's blob name gives, or None when ``path`` is not such an entry."""
    path = Path(path)
    if not path.is_symlink() or path.parent.parent.name != "snapshots":
        return None
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    repo = path.parent.parent.parent
    if not _SHA256.match(target.name) or target.parent != (repo / "blobs").resolve() or not target.is_file():
        return None
    return target.name


def hub_local_dir_sha256(path: Path, st: os.stat_result) -> str | None:
    """The sha256 the hub client recorded when it downloaded ``path`` into a ``--local-dir``, or None."""
    path = Path(path)
    meta = path.parent / ".cache" / "huggingface" / "download" / f"{path.name}.metadata"
    try:
        if not meta.is_file() or meta.stat().st_size > 4096:
            return None
        lines = meta.read_text(encoding="utf-8").splitlines()
        etag, written = lines[1].strip().strip('"'), float(lines[2])
    except (OSError, UnicodeDecodeError, IndexError, ValueError):
        return None
    if not _SHA256.match(etag) or st.st_mtime - 1 > written:
        return None
    return etag


def recorded_digest(path: Path, st: os.stat_result, known: dict | None, trust_hub_cache: bool = True
                    ) -> dict | None:
    """{size, mtime_ns, ino, sha256, sha256_from} for a source file whose (followed) stat is ``st``, when its
    sha256 is on record (cached, hub-blob, hub-local-dir); None when it has to be hashed."""
    base = dict(size=st.st_size, mtime_ns=st.st_mtime_ns, ino=st.st_ino)
    if known and all(known.get(k) == v for k, v in base.items()) and _SHA256.match(str(known.get("sha256", ""))):
        return dict(base, sha256=known["sha256"], sha256_from="cached")
    blob = hub_blob_sha256(path) if trust_hub_cache else None
    if blob is not None:
        return dict(base, sha256=blob, sha256_from="hub-blob")
    local = hub_local_dir_sha256(path, st) if trust_hub_cache else None
    if local is not None:
        return dict(base, sha256=local, sha256_from="hub-local-dir")
    return None


def hashed_digest(st: os.stat_result, sha256: str) -> dict:
    return dict(size=st.st_size, mtime_ns=st.st_mtime_ns, ino=st.st_ino, sha256=sha256, sha256_from="hashed")


def source_digest(path: Path, st: os.stat_result, known: dict | None, trust_hub_cache: bool = True) -> dict:
    """As ``recorded_digest``, hashing the file when nothing is on record."""
    return recorded_digest(path, st, known, trust_hub_cache) or hashed_digest(st, sha256_file(path))
