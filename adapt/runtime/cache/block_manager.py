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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from adapt.errors import RuntimeConfigError

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

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None) -> None:
        if num_blocks < 1:
            raise RuntimeConfigError(f"KV cache needs at least 1 block, got num_blocks={num_blocks}")
        if block_size < 1:
            raise RuntimeConfigError(f"block_size must be >= 1, got {block_size}")
        if window is not None and window < 1:
            raise RuntimeConfigError(f"window must be >= 1, got {window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self._released: dict[int, int] = {}  # leading blocks of a sequence returned under the window
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}  # tokens with a slot (cached or about to be written)

    # -- queries ---------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence."""
        return len(self._free)

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks that hold ``n_tokens`` tokens: ``ceil(n_tokens / block_size)``."""
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_tokens: int, watermark_blocks: int = 0) -> bool:
        """Whether ``n_tokens`` fit while leaving at least ``watermark_blocks`` blocks free."""
        return self.blocks_needed(n_tokens) + watermark_blocks <= len(self._free)

    def can_append(self, seq_id: int) -> bool:
        """Whether ``append_slot(seq_id)`` would succeed (room in the last block, or a free block)."""
        return self._num_tokens_of(seq_id) % self.block_size != 0 or len(self._free) > 0

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
        """Used and total blocks and tokens."""
        return CacheUsage(
            used_blocks=self.num_blocks - len(self._free),
            total_blocks=self.num_blocks,
            used_tokens=sum(self._num_tokens.values()) - self.block_size * sum(self._released.values()),
            capacity_tokens=self.num_blocks * self.block_size,
        )

    # -- mutations -------------------------------------------------------------------------------------

    def allocate(self, seq_id: int, n_tokens: int) -> list[int]:
        """Give a new sequence blocks for its first ``n_tokens`` tokens; returns its block table."""
        if seq_id in self._tables:
            raise RuntimeConfigError(f"sequence {seq_id} already has cache blocks")
        if n_tokens < 0:
            raise RuntimeConfigError(f"n_tokens must be >= 0, got {n_tokens}")
        need = self.blocks_needed(n_tokens)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {need} KV blocks for {n_tokens} tokens, "
                f"only {len(self._free)} of {self.num_blocks} are free"
            )
        table = [self._free.popleft() for _ in range(need)]
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = n_tokens
        self._released[seq_id] = 0
        return list(table)

    def append_slot(self, seq_id: int) -> int:
        """Reserve the slot for the sequence's next token, taking a new block at a block boundary."""
        table, n = self._table_of(seq_id), self._num_tokens[seq_id]
        if n == len(table) * self.block_size:
            if not self._free:
                raise OutOfBlocksError(
                    f"no free KV block for token {n} of sequence {seq_id} (all {self.num_blocks} in use)"
                )
            table.append(self._free.popleft())
        self._num_tokens[seq_id] = n + 1
        slot = table[n // self.block_size] * self.block_size + n % self.block_size
        if self.window is not None:  # blocks wholly before n + 1 - W: no later query reads them
            done, gone = self._released[seq_id], max(0, n + 1 - self.window) // self.block_size
            for j in range(done, gone):
                self._free.append(table[j])
                table[j] = -1
            self._released[seq_id] = max(done, gone)
        return slot

    def free(self, seq_id: int) -> None:
        """Return all of the sequence's blocks to the pool and forget it."""
        table = self._table_of(seq_id)
        # Most recently used blocks go back last, so the oldest free blocks are reused first.
        self._free.extend(b for b in table if b >= 0)
        del self._tables[seq_id]
        del self._num_tokens[seq_id]
        del self._released[seq_id]

    # -- helpers ---------------------------------------------------------------------------------------

    def _table_of(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise RuntimeConfigError(f"unknown sequence id {seq_id} in the block manager") from None

    def _num_tokens_of(self, seq_id: int) -> int:
        self._table_of(seq_id)
        return self._num_tokens[seq_id]
