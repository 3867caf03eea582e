"""Paged KV-cache bookkeeping: which cache blocks hold which sequence's tokens.

Plain Python, no torch. The KV pool (``kv_pool.py``) holds ``num_blocks`` blocks of ``block_size`` token
slots each; a slot index is ``block * block_size + offset`` into the pool viewed as ``[NB * BS, ...]``.
A sequence's *block table* lists its blocks in token order, so token position ``p`` lives in slot
``table[p // BS] * BS + p % BS``.

Invariants (checked by the tests): a block is owned by at most one sequence; every block is either free
or in exactly one table; ``free`` returns all of a sequence's blocks to the pool.

With a sliding ``window`` W (a model whose every layer attends to the W latest tokens only), the token at
position n sees keys n - W < j <= n, so once its slot is reserved every block wholly before n + 1 - W is
never read again: ``append_slot`` returns those blocks to the pool and marks them -1 in the table (the
attention kernels mask those positions and clamp the ids). A decoding sequence then holds at most
ceil(W / BS) + 1 blocks, whatever its length, so more sequences share the pool; a prefill (and the
recompute of a preempted sequence) still takes blocks for all of its tokens, which is why the
scheduler's admission bound stays prompt + max_tokens.

With ``prefix_caching`` (not with a window) blocks are reference counted: a full block whose KV is
computed is recorded under the key of its prefix (``prefix_cache.py``, ``cache_blocks``), a new sequence
starts from the cached blocks of its longest cached prefix (``match_prefix`` then ``allocate(...,
prefix=...)``), and a block nobody holds any more stays cached until an allocation evicts it (least
recently used first). Such idle blocks count as free in ``num_free_blocks`` and ``usage``. A shared block
is only ever read: a prompt reuses whole blocks strictly before its last token, so every block a
sequence writes is its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from adapt.errors import RuntimeConfigError
from adapt.runtime.cache.prefix_cache import PrefixCache, block_keys

__all__ = ["BlockManager", "CacheUsage", "OutOfBlocksError"]


class OutOfBlocksError(RuntimeConfigError):
    """The KV pool has too few free blocks for the request."""


@dataclass(frozen=True)
class CacheUsage:
    """A snapshot of how full the cache is."""

    used_blocks: int
    total_blocks: int
    used_tokens: int
    capacity_tokens: int

    @property
    def block_fraction(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


class BlockManager:
    """Allocates fixed-size cache blocks to sequences and maps token positions to pool slots."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None,
                 prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise RuntimeConfigError(f"KV cache needs at least 1 block, got num_blocks={num_blocks}")
        if block_size < 1:
            raise RuntimeConfigError(f"block_size must be >= 1, got {block_size}")
        if window is not None and window < 1:
            raise RuntimeConfigError(f"window must be >= 1, got {window}")
        if prefix_caching and window is not None:
            raise RuntimeConfigError("prefix caching needs full attention (this model's layers use a sliding window)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self._released: dict[int, int] = {}  # leading blocks of a sequence returned under the window
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}  # tokens with a slot (cached or about to be written)
        self.prefix_cache = PrefixCache() if prefix_caching else None
        self._refs = [0] * num_blocks
        self._keys: dict[int, list[bytes]] = {}  # per sequence: keys of its leading cached blocks

    # -- queries ---------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence (idle cached blocks included)."""
        return len(self._free) + (self.prefix_cache.num_idle if self.prefix_cache is not None else 0)

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks that hold ``n_tokens`` tokens: ``ceil(n_tokens / block_size)``."""
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_tokens: int, watermark_blocks: int = 0, prefix: list[int] = ()) -> bool:
        """Whether ``n_tokens`` fit while leaving at least ``watermark_blocks`` blocks free, the first
        ``len(prefix)`` blocks being the cached ``prefix`` (idle ones among them stop being free)."""
        pc = self.prefix_cache
        idle = sum(1 for b in prefix if pc.is_idle(b)) if pc is not None else 0
        return self.blocks_needed(n_tokens) - len(prefix) + idle + watermark_blocks <= self.num_free_blocks

    def can_append(self, seq_id: int) -> bool:
        """Whether ``append_slot(seq_id)`` would succeed (room in the last block, or a free block)."""
        return self._num_tokens_of(seq_id) % self.block_size != 0 or self.num_free_blocks > 0

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the longest prefix of whole blocks of ``token_ids`` before its last token
        (at least one token is always left to compute); [] without prefix caching. Changes nothing."""
        if self.prefix_cache is None or len(token_ids) <= self.block_size:
            return []
        return self.prefix_cache.lookup(block_keys(token_ids, self.block_size, stop=len(token_ids) - 1))

    def cache_blocks(self, seq_id: int, token_ids: list[int], n_computed: int) -> None:
        """Record the sequence's full blocks among its first ``n_computed`` tokens (their KV is written, or
        is being written by the step now scheduled) so that later prompts can reuse them."""
        pc = self.prefix_cache
        if pc is None:
            return
        keys = self._keys[seq_id]
        table = self._table_of(seq_id)
        new = block_keys(token_ids, self.block_size, len(keys), keys[-1] if keys else b"", n_computed)
        for j, k in enumerate(new, start=len(keys)):
            pc.add(k, table[j])
        keys.extend(new)

    def clear_prefix_cache(self) -> int:
        """Forget every cached block nobody holds; returns how many."""
        if self.prefix_cache is None:
            return 0
        blocks = self.prefix_cache.clear()
        self._free.extend(blocks)
        return len(blocks)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks in token order (a copy)."""
        return list(self._table_of(seq_id))

    def num_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence that have a slot."""
        return self._num_tokens_of(seq_id)

    def slot(self, seq_id: int, position: int) -> int:
        """The pool slot of token ``position`` of the sequence."""
        return self.slot_mapping(seq_id, position, position + 1)[0]

    def slot_mapping(self, seq_id: int, start: int, stop: int) -> list[int]:
        """Pool slots of token positions ``[start, stop)``; positions must already have a slot."""
        table, n = self._table_of(seq_id), self._num_tokens[seq_id]
        if not 0 <= start <= stop <= n:
            raise RuntimeConfigError(f"slot_mapping({seq_id}, {start}, {stop}) outside the {n} allocated tokens")
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def usage(self) -> CacheUsage:
        """Used and total blocks and tokens (idle cached blocks are not used)."""
        return CacheUsage(
            used_blocks=self.num_blocks - self.num_free_blocks,
            total_blocks=self.num_blocks,
            used_tokens=sum(self._num_tokens.values()) - self.block_size * sum(self._released.values()),
            capacity_tokens=self.num_blocks * self.block_size,
        )

    # -- mutations -------------------------------------------------------------------------------------

    def allocate(self, seq_id: int, n_tokens: int, prefix: list[int] = ()) -> list[int]:
        """Give a new sequence blocks for its first ``n_tokens`` tokens, starting with the cached blocks
        ``prefix`` (from ``match_prefix``); returns its block table."""
        if seq_id in self._tables:
            raise RuntimeConfigError(f"sequence {seq_id} already has cache blocks")
        if n_tokens < 0:
            raise RuntimeConfigError(f"n_tokens must be >= 0, got {n_tokens}")
        if prefix and (self.prefix_cache is None or len(prefix) * self.block_size >= max(n_tokens, 1)):
            raise RuntimeConfigError(f"sequence {seq_id}: a cached prefix of {len(prefix)} blocks for {n_tokens} tokens")
        if not self.can_allocate(n_tokens, 0, prefix):
            need = self.blocks_needed(n_tokens) - len(prefix)
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {need} KV blocks for {n_tokens} tokens, "
                f"only {self.num_free_blocks} of {self.num_blocks} are free"
            )
        table = []
        for b in prefix:
            if self._refs[b] == 0:
                self.prefix_cache.unpark(b)
            self._refs[b] += 1
            table.append(b)
        table += [self._take() for _ in range(self.blocks_needed(n_tokens) - len(prefix))]
        if self.prefix_cache is not None:
            self.prefix_cache.queries += n_tokens
            self.prefix_cache.hits += len(prefix) * self.block_size
            self._keys[seq_id] = [self.prefix_cache.key_of(b) for b in prefix]  # cache_blocks adds the rest
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = n_tokens
        self._released[seq_id] = 0
        return list(table)

    def append_slot(self, seq_id: int) -> int:
        """Reserve the slot for the sequence's next token, taking a new block at a block boundary."""
        table, n = self._table_of(seq_id), self._num_tokens[seq_id]
        if n == len(table) * self.block_size:
            if not self.num_free_blocks:
                raise OutOfBlocksError(
                    f"no free KV block for token {n} of sequence {seq_id} (all {self.num_blocks} in use)"
                )
            table.append(self._take())
        self._num_tokens[seq_id] = n + 1
        slot = table[n // self.block_size] * self.block_size + n % self.block_size
        if self.window is not None:  # blocks wholly before n + 1 - W: no later query reads them
            done, gone = self._released[seq_id], max(0, n + 1 - self.window) // self.block_size
            for j in range(done, gone):
                self._release(table[j])
                table[j] = -1
            self._released[seq_id] = max(done, gone)
        return slot

    def free(self, seq_id: int) -> None:
        """Return all of the sequence's blocks to the pool and forget it."""
        table = self._table_of(seq_id)
        # Most recently used blocks go back last, so the oldest free blocks are reused first; cached blocks
        # go tail first, so a prefix's last blocks are evicted before its first (which more prompts share).
        for b in table:
            if b >= 0 and not (self.prefix_cache is not None and self.prefix_cache.holds(b)):
                self._release(b)
        for b in reversed(table):
            if b >= 0 and self.prefix_cache is not None and self.prefix_cache.holds(b):
                self._release(b)
        del self._tables[seq_id]
        del self._num_tokens[seq_id]
        del self._released[seq_id]
        self._keys.pop(seq_id, None)

    def _take(self) -> int:
        b = self._free.popleft() if self._free else self.prefix_cache.evict()
        self._refs[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            if self.prefix_cache is not None and self.prefix_cache.holds(b):
                self.prefix_cache.park(b)
            else:
                self._free.append(b)

    # -- helpers ---------------------------------------------------------------------------------------

    def _table_of(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise RuntimeConfigError(f"unknown sequence id {seq_id} in the block manager") from None

    def _num_tokens_of(self, seq_id: int) -> int:
        self._table_of(seq_id)
        return self._num_tokens[seq_id]
