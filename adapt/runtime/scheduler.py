"""Continuous batching over a paged KV cache: admit, prefill, decode, preempt, stop.

Plain Python, no torch. Each ``schedule()`` returns one batch, either a *prefill* of newly admitted
sequences (every token of each is computed and cached) or a *decode* step of all running sequences (the
last token of each is computed and cached). The engine runs the batch, samples one token per sequence and
hands the tokens to ``postprocess``, which applies the stop rules and frees finished sequences' blocks.

Admission is first come, first served while blocks allow, keeping a small watermark of free blocks so
running sequences can grow. When a decode step finds no free block, the newest running sequence is
preempted: its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
(prompt and generated tokens prefilled again) when blocks free up, as vLLM's recompute preemption.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Protocol

from adapt.errors import RuntimeConfigError
from adapt.runtime.cache.block_manager import BlockManager

__all__ = ["FinishReason", "ScheduledBatch", "Scheduler", "SeqStatus", "Sequence", "StopParams"]

FinishReason = Literal["stop", "length", "abort"]


class StopParams(Protocol):
    """The fields of ``SamplingParams`` the scheduler reads (kept structural so no torch is imported)."""

    @property
    def max_tokens(self) -> int: ...
    @property
    def stop(self) -> tuple[str, ...]: ...
    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...
    @property
    def ignore_eos(self) -> bool: ...


class SeqStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and state. ``text`` is set on finish when a detokenizer is given."""

    seq_id: int
    prompt_ids: list[int]
    params: StopParams
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    text: str | None = None  # final output text, stop string and stop token removed
    num_preemptions: int = 0
    mm: object | None = None  # the request's images and their features (vision/request.py); opaque here
    _checked_chars: int = field(default=0, init=False, repr=False)  # output text searched for stop strings

    @property
    def token_ids(self) -> list[int]:
        """Prompt then generated tokens."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass
class ScheduledBatch:
    """One step's work. Prefill: every token of ``seq.token_ids``; decode: the last token of each seq.

    ``slot_mappings[i]`` are the cache slots the step writes for ``seqs[i]`` (prefill: one per token,
    decode: one), ``block_tables[i]`` its blocks, ``context_lens[i]`` its cached tokens after the step.
    """

    kind: Literal["prefill", "decode"]
    seqs: list[Sequence]
    block_tables: list[list[int]]
    slot_mappings: list[list[int]]
    context_lens: list[int]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(len(s) for s in self.slot_mappings)


class Scheduler:
    """Decides which sequences run each step and when they stop.

    ``detokenize(ids) -> str`` is needed only for stop strings and for ``Sequence.text``; ``eos_token_ids``
    stop a sequence unless its params say ``ignore_eos``. ``max_model_len`` caps prompt plus output.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        watermark: float = 0.01,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise RuntimeConfigError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs}, {max_num_batched_tokens}"
            )
        if not 0.0 <= watermark < 1.0:
            raise RuntimeConfigError(f"watermark must be in [0, 1), got {watermark}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admitted first
        self._live: dict[int, Sequence] = {}
        self._ids = itertools.count()

    # -- requests --------------------------------------------------------------------------------------

    def add(self, prompt_ids: list[int], params: StopParams, seq_id: int | None = None, mm: object | None = None
            ) -> Sequence:
        """Queue a request; raises RuntimeConfigError if it could never fit the model or the cache."""
        if not prompt_ids:
            raise RuntimeConfigError("prompt must have at least one token")
        if params.stop and self.detokenize is None:
            raise RuntimeConfigError("stop strings need a detokenizer; none was given to the scheduler")
        n = len(prompt_ids)
        if self.max_model_len is not None and n > self.max_model_len:
            raise RuntimeConfigError(f"prompt has {n} tokens, more than max_model_len={self.max_model_len}")
        # The last sampled token is never cached, so a sequence caches at most this many tokens.
        most = n + params.max_tokens - 1
        if self.max_model_len is not None:
            most = min(most, self.max_model_len - 1)
        bm = self.block_manager
        if bm.blocks_needed(max(most, n)) > bm.num_blocks:
            raise RuntimeConfigError(
                f"request needs up to {max(most, n)} cached tokens ({n} prompt + {params.max_tokens} max_tokens); "
                f"the KV cache holds {bm.num_blocks * bm.block_size}"
            )
        sid = next(self._ids) if seq_id is None else seq_id
        if sid in self._live:
            raise RuntimeConfigError(f"sequence id {sid} is already in use")
        seq = Sequence(sid, list(prompt_ids), params, mm=mm)
        self._live[sid] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish a waiting or running sequence with reason 'abort'; None if it is not live."""
        seq = self._live.get(seq_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._finish(seq, "abort", list(seq.output_ids))
        return seq

    @property
    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    # -- scheduling ------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """The next step: a prefill if any waiting sequence can be admitted, else a decode; None if idle."""
        batch = self._schedule_prefill()
        if batch is None and self.running:
            batch = self._schedule_decode()
            if not batch.seqs:  # everyone was preempted: start over from the waiting queue
                retry = self._schedule_prefill()
                if retry is not None:
                    retry.preempted = batch.preempted
                batch = retry
        return batch

    def _schedule_prefill(self) -> ScheduledBatch | None:
        bm = self.block_manager
        seqs: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_tokens
            # A lone sequence is always admitted if it fits the cache, so a long recompute cannot stall.
            if seqs and tokens + n > self.max_num_batched_tokens:
                break
            watermark = self.watermark_blocks if (self.running or seqs) else 0
            if not bm.can_allocate(n, watermark):
                break
            self.waiting.popleft()
            bm.allocate(seq.seq_id, n)
            seq.status = SeqStatus.RUNNING
            seqs.append(seq)
            tokens += n
        if not seqs:
            return None
        self.running.extend(seqs)
        return ScheduledBatch(
            kind="prefill",
            seqs=seqs,
            block_tables=[bm.block_table(s.seq_id) for s in seqs],
            slot_mappings=[bm.slot_mapping(s.seq_id, 0, s.num_tokens) for s in seqs],
            context_lens=[s.num_tokens for s in seqs],
        )

    def _schedule_decode(self) -> ScheduledBatch:
        bm = self.block_manager
        queue = deque(self.running)
        scheduled: list[Sequence] = []
        slots: list[list[int]] = []
        preempted: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            while not bm.can_append(seq.seq_id):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                slots.append([bm.append_slot(seq.seq_id)])
                scheduled.append(seq)
        self.running = list(scheduled)  # batch.seqs must not change when sequences finish
        return ScheduledBatch(
            kind="decode",
            seqs=scheduled,
            block_tables=[bm.block_table(s.seq_id) for s in scheduled],
            slot_mappings=slots,
            context_lens=[bm.num_tokens(s.seq_id) for s in scheduled],
            preempted=preempted,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- after the step --------------------------------------------------------------------------------

    def postprocess(self, seqs: list[Sequence], new_token_ids: list[int]) -> list[Sequence]:
        """Append each sequence's new token, apply the stop rules; returns the sequences that finished.

        Order of the rules: a stop token id (or EOS unless ``ignore_eos``), then stop strings, then
        ``max_tokens`` / ``max_model_len`` ('length'). A stop string is cut from ``text`` with everything
        after it, as OpenAI's API does; ``output_ids`` keep every generated token.
        """
        if len(seqs) != len(new_token_ids):
            raise RuntimeConfigError(f"postprocess got {len(new_token_ids)} tokens for {len(seqs)} sequences")
        finished = []
        for seq, tok in zip(seqs, new_token_ids):
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            tok = int(tok)
            seq.output_ids.append(tok)
            if self._check_stop(seq, tok):
                finished.append(seq)
        return finished

    def _check_stop(self, seq: Sequence, tok: int) -> bool:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            seq.stop_reason = tok
            self._finish(seq, "stop", seq.output_ids[:-1])
            return True
        if p.stop and self.detokenize is not None:
            text = self.detokenize(seq.output_ids)
            # Re-search a margin before the checked part: a stop string may straddle tokens, and trailing
            # replacement characters of a split UTF-8 sequence change once the rest arrives.
            start = max(0, seq._checked_chars - max(len(s) for s in p.stop) - 4)
            hits = [(i, s) for s in p.stop if (i := text.find(s, start)) >= 0]
            seq._checked_chars = len(text)
            if hits:
                index, stop = min(hits)
                seq.stop_reason = stop
                self._finish(seq, "stop", None)
                seq.text = text[:index]
                return True
        if seq.num_output_tokens >= p.max_tokens or (
            self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        ):
            self._finish(seq, "length", seq.output_ids)
            return True
        return False

    def _finish(self, seq: Sequence, reason: FinishReason, text_ids: list[int] | None) -> None:
        if seq.seq_id in self.block_manager:
            self.block_manager.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if text_ids is not None and self.detokenize is not None:
            seq.text = self.detokenize(text_ids)
        del self._live[seq.seq_id]
