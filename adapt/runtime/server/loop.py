"""The engine loop: one background thread that owns the engine and batches every client's requests.

Step-level continuous batching over the engine's own parts (``Scheduler``, ``ModelRunner``, ``sample``),
as ``Engine.generate`` uses them, but with one long-lived scheduler: between two model steps the loop
admits whatever requests arrived, so a new request joins the running batch at the next step instead of
waiting for the current batch to finish. Each step's new token of each sequence is turned into a text
delta (``IncrementalDecoder``; text that may still become a stop string is held back) and put on its
request's queue. While the loop runs it is the only user of the engine's KV cache.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from adapt.errors import AdaptError
from adapt.runtime.sampling import SamplingParams, make_generator, sample
from adapt.runtime.scheduler import Scheduler, Sequence


@dataclass
class Delta:
    """New output of one sequence: text (possibly ''), token ids, and per token (id, logprob, top list)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None  # set on the last delta of the sequence
    prompt_token_ids: list[int] | None = None


@dataclass
class Failed:
    """The sequence could not be admitted or the step failed; ``status`` 400 or 500."""

    index: int
    message: str
    status: int = 500


@dataclass
class _Track:
    out: queue.Queue
    index: int
    params: SamplingParams
    generator: torch.Generator | None
    decoder: Any = None
    emitted: str = ""


class EngineLoop:
    """Owns ``engine`` from ``start()`` to ``stop()``; ``submit`` and ``abort`` are thread-safe."""

    def __init__(self, engine, max_num_seqs: int | None = None):
        self.engine = engine
        tok = engine.tokenizer
        self.scheduler = Scheduler(engine.block_manager, max_num_seqs=max_num_seqs or engine.max_num_seqs,
                                   max_num_batched_tokens=engine.max_num_batched_tokens,
                                   max_model_len=engine.max_model_len, eos_token_ids=engine.eos_token_ids,
                                   detokenize=tok.decode if tok is not None else None)
        self._inbox: deque = deque()
        self._aborts: deque = deque()
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._tracks: dict[int, _Track] = {}
        self._stopping = False
        self.error: str | None = None  # set when the loop died
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "requests": 0, "max_batch_seqs": 0}
        self._thread = threading.Thread(target=self._run, name="adapt-engine-loop", daemon=True)

    # -- client side (any thread) ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, out: queue.Queue, index: int = 0) -> int:
        """Queue one sequence; its Delta / Failed events go to ``out``. Returns its id for ``abort``."""
        sid = next(self._ids)
        with self._cv:
            self._inbox.append((sid, list(prompt_ids), params, out, index))
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
                    inbox, self._inbox = list(self._inbox), deque()
                    aborts, self._aborts = list(self._aborts), deque()
                for item in inbox:
                    self._admit(*item)
                for sid in aborts:
                    if self.scheduler.abort(sid) is not None:
                        self._tracks.pop(sid, None)
                if self.scheduler.has_unfinished:
                    self._step()
        except Exception as e:  # the device failed: tell every waiting client, then stop serving
            self.error = f"{type(e).__name__}: {e}"
            for sid, tr in list(self._tracks.items()):
                tr.out.put(Failed(tr.index, f"engine step failed: {self.error}"))
            self._tracks.clear()
        finally:
            self._drain()

    def _drain(self) -> None:
        for sid, tr in list(self._tracks.items()):
            self.scheduler.abort(sid)
            tr.out.put(Failed(tr.index, "the service is shutting down", 503))
        self._tracks.clear()
        with self._cv:
            for sid, _, _, out, index in self._inbox:
                out.put(Failed(index, "the service is shutting down", 503))
            self._inbox.clear()

    def _admit(self, sid: int, prompt_ids: list[int], params: SamplingParams, out: queue.Queue, index: int) -> None:
        bad = [t for t in prompt_ids if not 0 <= t < self.engine.spec.vocab_size]
        if bad:
            out.put(Failed(index, f"token id {bad[0]} is outside the vocabulary [0, {self.engine.spec.vocab_size})",
                           400))
            return
        try:
            self.scheduler.add(prompt_ids, params, seq_id=sid)
        except AdaptError as e:
            out.put(Failed(index, str(e), 400))
            return
        tok = self.engine.tokenizer
        self._tracks[sid] = _Track(out, index, params, make_generator(params, self.engine.device),
                                   tok.incremental_decoder() if tok is not None else None)
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
        gens = [self._tracks[s.seq_id].generator for s in sb.seqs]
        logits = self.engine.runner.step(sb)
        res = sample(logits, [s.params for s in sb.seqs], gens)
        tokens = res.token_ids.tolist()
        lps = res.logprobs.tolist() if res.logprobs is not None else [None] * len(tokens)
        self.stats["steps"] += 1
        self.stats["max_batch_seqs"] = max(self.stats["max_batch_seqs"], len(sb.seqs))
        self.stats[f"{sb.kind}_tokens"] += sb.num_tokens
        self.scheduler.postprocess(sb.seqs, tokens)
        for i, seq in enumerate(sb.seqs):
            tr = self._tracks[seq.seq_id]
            lp = [(tokens[i], lps[i], res.top_logprobs[i] or [])] if tr.params.logprobs is not None else []
            self._emit(seq, tr, tokens[i], lp)

    def _emit(self, seq: Sequence, tr: _Track, tok: int, lp: list) -> None:
        first = seq.num_output_tokens == 1
        if seq.is_finished:
            del self._tracks[seq.seq_id]
            final = seq.text or ""
            text = final[len(tr.emitted):] if final.startswith(tr.emitted) else final
            tr.out.put(Delta(tr.index, text, [tok], lp, seq.finish_reason or "stop",
                             seq.prompt_ids if first else None))
            return
        text = ""
        if tr.decoder is not None:
            tr.decoder.push(tok)
            safe = _hold_back(tr.decoder.text, tr.params.stop)
            if len(safe) > len(tr.emitted) and safe.startswith(tr.emitted):
                text, tr.emitted = safe[len(tr.emitted):], safe
        tr.out.put(Delta(tr.index, text, [tok], lp, None, seq.prompt_ids if first else None))


def _hold_back(text: str, stops: tuple[str, ...]) -> str:
    """``text`` without its longest suffix that is a prefix of a stop string (it may yet become one)."""
    cut = 0
    for s in stops:
        for n in range(min(len(s), len(text)), 0, -1):
            if text.endswith(s[:n]):
                cut = max(cut, n)
                break
    return text[:len(text) - cut] if cut else text


def wait_event(out: queue.Queue, deadline: float):
    """The next event from ``out``, or None once ``deadline`` (time.monotonic) has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    try:
        return out.get(timeout=left)
    except queue.Empty:
        return None
