"""The engine loop: one background thread that owns the engine and batches every client's requests.

Step-level continuous batching over the engine's own parts (``Scheduler``, ``ModelRunner``, ``sample``),
as ``Engine.generate`` uses them, but with one long-lived scheduler: between two model steps the loop
admits whatever requests arrived, so a new request joins the running batch at the next step instead of
waiting for the current batch to finish. A long prompt is prefilled in chunks (``max_num_batched_tokens``)
in steps that alternate with the running sequences' decode steps. Each step's new token of each sequence
is turned into a text delta (``IncrementalDecoder``; text that may still become a stop string is held
back) and put on its request's sink; sinks are flushed once per step (``sink.flush`` hooks), so an
asyncio server wakes once per step, not once per token. While the loop runs it is the only user of the
engine's KV cache.

A burst of requests reaching an idle loop is admitted together: the loop waits while they keep arriving
(``batch_window_s`` after the latest, or while ``arriving()`` says the HTTP side holds requests it has not
submitted yet; at most ``10 x batch_window_s`` in all) before its first step. Without the wait
the first arrival's prefill starts at once and holds the GIL (the CPU kernels do), the HTTP thread cannot
parse the rest, and a burst of 16 runs as prefill(1), decode(1), prefill(15): two extra steps, ~3% of a
64-token round on a 2-core host. A lone request's first token comes ``batch_window_s`` later.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from adapt.errors import AdaptError
from adapt.runtime.sampling import SamplingParams, make_generator, sample
from adapt.runtime.scheduler import ScheduledBatch, Scheduler, Sequence


@dataclass
class Delta:
    """New output of one sequence: text (possibly ''), token ids, and per token (id, logprob, top list)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None  # set on the last delta of the sequence
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]] | None] | None = None  # first delta only


@dataclass
class Failed:
    """The sequence could not be admitted or the step failed; ``status`` 400, 500 or 503."""

    index: int
    message: str
    status: int = 500


@dataclass
class Timing:
    """When a sequence arrived, was first scheduled, produced its first and latest token (monotonic s)."""

    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class _Track:
    out: Any  # has put(event)
    index: int
    params: SamplingParams
    generator: torch.Generator | None
    decoder: Any = None
    emitted: str = ""
    timing: Timing = field(default_factory=lambda: Timing(time.monotonic()))
    drop_output: bool = False  # max_tokens 0: the one sampled token is not returned
    prompt_lps: list | None = None  # collected prompt logprobs (position 0: None)


class EngineLoop:
    """Owns ``engine`` from ``start()`` to ``stop()``; ``submit`` and ``abort`` are thread-safe.

    ``on_finish(seq, timing)`` and ``on_token(seconds since the previous token)`` are called on the loop
    thread (metrics); ``flush_hooks`` after every iteration that may have put events."""

    def __init__(self, engine, max_num_seqs: int | None = None,
                 on_finish: Callable[[Sequence, Timing], None] | None = None,
                 on_token: Callable[[float], None] | None = None, batch_window_s: float = 0.002,
                 arriving: Callable[[], int] | None = None):
        self.engine = engine
        self.batch_window_s = batch_window_s
        self.arriving = arriving or (lambda: 0)
        tok = engine.tokenizer
        self.scheduler = Scheduler(engine.block_manager, max_num_seqs=max_num_seqs or engine.max_num_seqs,
                                   max_num_batched_tokens=engine.max_num_batched_tokens,
                                   max_model_len=engine.max_model_len, eos_token_ids=engine.eos_token_ids,
                                   detokenize=tok.decode if tok is not None else None,
                                   chunked_prefill=getattr(engine, "enable_chunked_prefill", False),
                                   prefix_caching=getattr(engine, "enable_prefix_caching", False))
        self.on_finish, self.on_token = on_finish, on_token
        self.flush_hooks: list[Callable[[], None]] = []
        self._inbox: deque = deque()
        self._aborts: deque = deque()
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._tracks: dict[int, _Track] = {}
        self._stopping = False
        self.error: str | None = None  # set when the loop died
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "requests": 0, "max_batch_seqs": 0,
                      "preemptions": 0}
        self._thread = threading.Thread(target=self._run, name="adapt-engine-loop", daemon=True)

    # -- client side (any thread) ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, out: Any, index: int = 0,
               drop_output: bool = False, mm: Any = None) -> int:
        """Queue one sequence; its Delta / Failed events go to ``out.put``. Returns its id for ``abort``.
        ``mm``: the prompt's images (vision/request.py RequestImages, placeholders already expanded)."""
        sid = next(self._ids)
        with self._cv:
            self._inbox.append((sid, list(prompt_ids), params, out, index, drop_output, time.monotonic(), mm))
            self._cv.notify()
        return sid

    def abort(self, seq_id: int) -> None:
        with self._cv:
            self._aborts.append(seq_id)
            self._cv.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def load(self) -> dict[str, int]:
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting) + len(self._inbox)}

    # -- the loop thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._inbox or self._aborts or self.scheduler.has_unfinished):
                        self._cv.wait(1.0)
                    if self._stopping:
                        break
                    if self._inbox and not self.scheduler.has_unfinished:
                        self._gather_burst()
                    inbox, self._inbox = list(self._inbox), deque()
                    aborts, self._aborts = list(self._aborts), deque()
                for item in inbox:
                    self._admit(*item)
                for sid in aborts:
                    seq = self.scheduler.abort(sid)
                    tr = self._tracks.pop(sid, None)
                    if seq is not None and tr is not None and self.on_finish is not None:
                        self.on_finish(seq, tr.timing)
                if self.scheduler.has_unfinished:
                    self._step()
                self._flush()
        except Exception as e:  # the device failed: tell every waiting client, then stop serving
            self.error = f"{type(e).__name__}: {e}"
            for sid, tr in list(self._tracks.items()):
                self.scheduler.abort(sid)
                tr.out.put(Failed(tr.index, f"engine step failed: {self.error}"))
            self._tracks.clear()
        finally:
            self._drain()
            self._flush()

    def _gather_burst(self) -> None:
        """Idle, with arrivals: wait (holding ``_cv``'s lock only between waits) while more keep coming."""
        w = self.batch_window_s
        if w <= 0:
            return
        deadline = time.monotonic() + 10 * w
        n = len(self._inbox)
        while not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(min(w, left))
            if len(self._inbox) == n and self.arriving() <= 0:
                return
            n = len(self._inbox)

    def _flush(self) -> None:
        for hook in self.flush_hooks:
            hook()

    def _drain(self) -> None:
        for sid, tr in list(self._tracks.items()):
            self.scheduler.abort(sid)
            tr.out.put(Failed(tr.index, "the service is shutting down", 503))
        self._tracks.clear()
        with self._cv:
            for item in self._inbox:
                item[3].put(Failed(item[4], "the service is shutting down", 503))
            self._inbox.clear()

    def _admit(self, sid: int, prompt_ids: list[int], params: SamplingParams, out: Any, index: int,
               drop_output: bool, arrival: float, mm: Any = None) -> None:
        bad = [t for t in prompt_ids if not 0 <= t < self.engine.spec.vocab_size]
        if bad:
            out.put(Failed(index, f"token id {bad[0]} is outside the vocabulary [0, {self.engine.spec.vocab_size})",
                           400))
            return
        try:
            self.scheduler.add(prompt_ids, params, seq_id=sid, mm=mm)
        except AdaptError as e:
            out.put(Failed(index, str(e), 400))
            return
        tok = self.engine.tokenizer
        self._tracks[sid] = _Track(out, index, params, make_generator(params, self.engine.device),
                                   tok.incremental_decoder() if tok is not None else None, timing=Timing(arrival),
                                   drop_output=drop_output,
                                   prompt_lps=[None] if params.prompt_logprobs is not None else None)
        self.stats["requests"] += 1

    @torch.inference_mode()
    def _step(self) -> None:
        sb = self.scheduler.schedule()
        if sb is None:  # cannot happen while add() checks capacity; never spin on it
            for seq in list(self.scheduler.waiting):
                tr = self._tracks.pop(seq.seq_id)
                self.scheduler.abort(seq.seq_id)
                tr.out.put(Failed(tr.index, "the KV cache cannot admit the request", 503))
            return
        now = time.monotonic()
        for s in sb.seqs:
            t = self._tracks[s.seq_id].timing
            if t.scheduled is None:
                t.scheduled = now
        self.stats["preemptions"] += len(sb.preempted)
        logits, prompt_logits = self.engine.runner.step_with_prompt_logits(sb)
        self.stats["steps"] += 1
        self.stats["max_batch_seqs"] = max(self.stats["max_batch_seqs"], len(sb.seqs))
        self.stats[f"{sb.kind}_tokens"] += sb.num_tokens
        for i, rows in prompt_logits.items():
            self._prompt_logprobs(sb, i, rows)
        idx = sb.sampled  # rows whose sequence has all its tokens cached: they sample a token
        if not idx:
            return
        seqs = [sb.seqs[i] for i in idx]
        trs = [self._tracks[s.seq_id] for s in seqs]
        hist = [(s.prompt_ids, s.output_ids) for s in seqs] if any(t.params.has_penalties for t in trs) else None
        rows = logits[idx] if len(idx) != len(sb.seqs) else logits
        params, gens = [t.params for t in trs], [t.generator for t in trs]
        res = sample(rows, params, gens) if hist is None else sample(rows, params, gens, hist)
        tokens = res.token_ids.tolist()
        lps = res.logprobs.tolist() if res.logprobs is not None else [None] * len(tokens)
        self.scheduler.postprocess(seqs, tokens)
        now = time.monotonic()
        for i, seq in enumerate(seqs):
            tr = trs[i]
            lp = [(tokens[i], lps[i], res.top_logprobs[i] or [])] if tr.params.logprobs is not None else []
            t = tr.timing
            if t.last_token is not None and self.on_token is not None:
                self.on_token(now - t.last_token)
            if t.first_token is None:
                t.first_token = now
            t.last_token = now
            self._emit(seq, tr, tokens[i], lp)

    def _prompt_logprobs(self, sb: ScheduledBatch, i: int, rows: torch.Tensor) -> None:
        """Logprobs of the prompt tokens the chunk's logits predict (row j predicts token start + j + 1)."""
        seq = sb.seqs[i]
        tr = self._tracks[seq.seq_id]
        if tr.prompt_lps is None or len(tr.prompt_lps) >= seq.num_prompt_tokens:
            return  # not asked, or already complete (a recompute after preemption)
        start = sb.context_lens[i] - len(sb.slot_mappings[i])
        targets = seq.prompt_ids[start + 1: sb.context_lens[i] + 1]
        if not targets:
            return
        lsm = torch.log_softmax(rows[: len(targets)].float(), dim=-1)  # [n, V]
        tgt = torch.tensor(targets, device=lsm.device)
        chosen = lsm.gather(-1, tgt[:, None])[:, 0].tolist()
        k = tr.params.prompt_logprobs or 0
        tops: list[list[tuple[int, float]]] = [[] for _ in targets]
        if k:
            vals, ids = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
            tops = [list(zip(a, b)) for a, b in zip(ids.tolist(), vals.tolist())]
        tr.prompt_lps.extend((t, lp, top) for t, lp, top in zip(targets, chosen, tops))

    def _emit(self, seq: Sequence, tr: _Track, tok: int, lp: list) -> None:
        first = seq.num_output_tokens == 1
        plp = tr.prompt_lps if first else None
        pids = seq.prompt_ids if first else None
        if tr.drop_output:  # max_tokens 0: the prompt's logprobs were the answer
            self._tracks.pop(seq.seq_id, None)
            self.scheduler.abort(seq.seq_id)
            tr.out.put(Delta(tr.index, "", [], [], "length", pids, plp))
            if self.on_finish is not None:
                self.on_finish(seq, tr.timing)
            return
        if seq.is_finished:
            del self._tracks[seq.seq_id]
            final = seq.text or ""
            text = final[len(tr.emitted):] if final.startswith(tr.emitted) else final
            tr.out.put(Delta(tr.index, text, [tok], lp, seq.finish_reason or "stop", pids, plp))
            if self.on_finish is not None:
                self.on_finish(seq, tr.timing)
            return
        text = ""
        if tr.decoder is not None:
            tr.decoder.push(tok)
            safe = _hold_back(tr.decoder.text, tr.params.stop)
            if len(safe) > len(tr.emitted) and safe.startswith(tr.emitted):
                text, tr.emitted = safe[len(tr.emitted):], safe
        tr.out.put(Delta(tr.index, text, [tok], lp, None, pids, plp))


def _hold_back(text: str, stops: tuple[str, ...]) -> str:
    """``text`` without its longest suffix that is a prefix of a stop string (it may yet become one)."""
    cut = 0
    for s in stops:
        for n in range(min(len(s), len(text)), 0, -1):
            if text.endswith(s[:n]):
                cut = max(cut, n)
                break
    return text[:len(text) - cut] if cut else text
