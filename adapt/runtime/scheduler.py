"""Continuous batching over a paged KV cache: admit, prefill, decode, preempt, stop.

Plain Python, no torch. Each ``schedule()`` returns one batch, either a *prefill* of newly admitted
sequences (their tokens are computed and cached) or a *decode* step of all running sequences (the
last token of each is computed and cached). The engine runs the batch, samples one token per sequence
whose tokens are all cached (``batch.sampled``) and hands the tokens to ``postprocess``, which applies the
stop rules and frees finished sequences' blocks.

With ``prefix_caching`` a new sequence starts from the cached blocks of its longest cached prefix and
computes only the rest. With ``chunked_prefill`` a prefill step computes at most
``max_num_batched_tokens`` tokens: a longer prompt is computed in chunks over several prefill steps, and
while any sequence is decoding, prefill and decode steps alternate, so a long prompt delays the running
streams' next token by one chunk's time instead of its whole prefill.

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
    num_computed: int = 0  # tokens whose KV is cached (or written by the step just scheduled)
    prefill_end: int = 0  # tokens the current prefill computes before the first sample
    num_cached_prompt: int = 0  # tokens the prefix cache supplied at the last admission
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

    @property
    def in_prefill(self) -> bool:
        """Running but not all of its prefill computed yet (chunked prefill)."""
        return self.status is SeqStatus.RUNNING and self.num_computed < self.prefill_end


@dataclass
class ScheduledBatch:
    """One step's work. Prefill: every token of ``seq.token_ids``; decode: the last token of each seq.

    ``slot_mappings[i]`` are the cache slots the step writes for ``seqs[i]`` (prefill: one per token
    of its chunk, decode: one), ``block_tables[i]`` its blocks, ``context_lens[i]`` its cached tokens after
    the step: a prefill computes tokens ``[context_lens[i] - len(slot_mappings[i]), context_lens[i])``.
    ``sampled``: indices of the sequences whose logits are sampled (decode: all; prefill: those whose
    chunk ends their prefill).
    """

    kind: Literal["prefill", "decode"]
    seqs: list[Sequence]
    block_tables: list[list[int]]
    slot_mappings: list[list[int]]
    context_lens: list[int]
    preempted: list[Sequence] = field(default_factory=list)
    sampled: list[int] | None = None

    def __post_init__(self) -> None:
        if self.sampled is None:
            self.sampled = list(range(len(self.seqs)))

    def chunk_start(self, i: int) -> int:
        """First token position the step computes for ``seqs[i]``."""
        return self.context_lens[i] - len(self.slot_mappings[i])

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
        chunked_prefill: bool = False,
        prefix_caching: bool = False,
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
        self.chunked_prefill = chunked_prefill
        self.prefix_caching = prefix_caching and block_manager.prefix_cache is not None
        self._last_kind: str | None = None
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
        """The next step: a prefill if a sequence is mid-prefill or a waiting one can be admitted, else a
        decode; with chunked prefill a decode comes between two prefill steps. None if idle."""
        decoding = any(not s.in_prefill for s in self.running)
        batch = None
        if not (self.chunked_prefill and self._last_kind == "prefill" and decoding):
            batch = self._schedule_prefill()
        if batch is None and decoding:
            batch = self._schedule_decode()
            if not batch.seqs:  # everyone was preempted: start over from the waiting queue
                retry = self._schedule_prefill()
                if retry is not None:
                    retry.preempted = batch.preempted
                batch = retry
        if batch is None and self.running:  # only sequences mid-prefill (decode had nothing to do)
            batch = self._schedule_prefill()
        self._last_kind = batch.kind if batch is not None else None
        return batch

    def _schedule_prefill(self) -> ScheduledBatch | None:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        chunks: list[tuple[Sequence, int, int]] = []
        for seq in self.running:  # sequences mid-prefill continue first, oldest first
            if seq.in_prefill and budget > 0:
                start, end = seq.num_computed, min(seq.prefill_end, seq.num_computed + budget)
                chunks.append((seq, start, end))
                budget -= end - start
                seq.num_computed = end
                bm.cache_blocks(seq.seq_id, seq.token_ids, end)
        admitted = 0
        while self.waiting and len(self.running) + admitted < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_tokens
            # images: placeholder ids say nothing of the pixels, and the features enter in one prefill
            whole = seq.mm is not None
            reuse = self.prefix_caching and not whole and not _wants_prompt_logprobs(seq)
            prefix = bm.match_prefix(seq.token_ids) if reuse else []
            cached = len(prefix) * bm.block_size
            if self.chunked_prefill and not whole:
                if budget <= 0:
                    break
                end = min(n, cached + budget)
            else:
                # A lone sequence is always admitted if it fits the cache, so a long recompute cannot stall.
                if chunks and n - cached > budget:
                    break
                end = n
            watermark = self.watermark_blocks if (self.running or chunks) else 0
            if not bm.can_allocate(n, watermark, prefix):
                break
            self.waiting.popleft()
            bm.allocate(seq.seq_id, n, prefix)
            seq.status = SeqStatus.RUNNING
            seq.num_computed, seq.prefill_end, seq.num_cached_prompt = cached, n, cached
            self.running.append(seq)
            admitted += 1
            chunks.append((seq, cached, end))
            budget -= end - cached
            # recorded now, so a later sequence of this same step can share the blocks: each layer writes
            # the whole step's KV before any sequence's attention reads it
            seq.num_computed = end
            if not whole:
                bm.cache_blocks(seq.seq_id, seq.token_ids, end)
        if not chunks:
            return None
        seqs = [c[0] for c in chunks]
        return ScheduledBatch(
            kind="prefill",
            seqs=seqs,
            block_tables=[bm.block_table(s.seq_id) for s in seqs],
            slot_mappings=[bm.slot_mapping(s.seq_id, a, b) for s, a, b in chunks],
            context_lens=[b for _, _, b in chunks],
            sampled=[i for i, (s, _, b) in enumerate(chunks) if b == s.prefill_end],
        )

    def _schedule_decode(self) -> ScheduledBatch:
        bm = self.block_manager
        prefilling = [s for s in self.running if s.in_prefill]
        queue = deque(s for s in self.running if not s.in_prefill)
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
                seq.num_computed += 1
                if seq.mm is None:
                    bm.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed)
                scheduled.append(seq)
        self.running = list(scheduled) + prefilling  # batch.seqs must not change when sequences finish
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
        seq.num_computed = seq.prefill_end = 0
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
        seq.num_computed = seq.prefill_end = 0
        if seq.seq_id in self.block_manager:
            self.block_manager.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if text_ids is not None and self.detokenize is not None:
            seq.text = self.detokenize(text_ids)
        del self._live[seq.seq_id]


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    # cached positions have no logits: a sequence that asks for its prompt's logprobs computes them all
    return getattr(seq.params, "prompt_logprobs", None) is not None
