"""Prefix caching: full KV blocks found again by the hash of their tokens and of every token before them.

Plain Python, no torch. A full block's key is ``sha256(parent key | its block_size token ids)``, so a key
names the whole prefix up to the block's end: two prompts share the cached blocks of their longest common
prefix of whole blocks. A block freed by every sequence that used it (reference count 0) keeps its key and
its KV and waits, least recently used first, until a new allocation needs the memory (``evict``). sha256
rather than Python's hash: a collision would silently serve another prompt's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

__all__ = ["PrefixCache", "block_keys"]


def block_keys(token_ids: list[int], block_size: int, start: int = 0, parent: bytes = b"",
               stop: int | None = None) -> list[bytes]:
    """Keys of the full blocks ``start, start + 1, ...`` of ``token_ids`` (up to token ``stop``), chained
    from ``parent`` (the key of block ``start - 1``, b"" for the first block)."""
    n = len(token_ids) if stop is None else min(stop, len(token_ids))
    keys = []
    for b in range(start, n // block_size):
        chunk = array("q", token_ids[b * block_size:(b + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """key -> block for blocks whose KV is computed, and the LRU list of those no sequence holds."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached blocks, oldest first
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which found cached

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def num_idle(self) -> int:
        """Cached blocks that no sequence holds (free memory that still holds a prefix)."""
        return len(self._idle)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Blocks of the longest run of leading keys that are cached."""
        out = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def add(self, key: bytes, block: int) -> None:
        """Record that ``block`` holds the KV of the prefix ``key`` (first writer wins)."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def key_of(self, block: int) -> bytes:
        return self._key_of[block]

    def holds(self, block: int) -> bool:
        return block in self._key_of

    def park(self, block: int) -> None:
        """A cached block's last holder let go: keep it until evicted (most recently used last)."""
        self._idle[block] = None

    def unpark(self, block: int) -> None:
        """A sequence takes an idle cached block again."""
        del self._idle[block]

    def evict(self) -> int | None:
        """Forget the least recently used idle block and return it, or None if there is none."""
        if not self._idle:
            return None
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block

    def clear(self) -> list[int]:
        """Forget every idle block; returns them (now plain free blocks)."""
        blocks = list(self._idle)
        for b in blocks:
            del self._block_of[self._key_of.pop(b)]
        self._idle.clear()
        return blocks
