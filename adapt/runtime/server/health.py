"""GET /health/golden: replay recorded prompts through the service and answer 200 only when the greedy
tokens still equal the recorded ones, so "healthy but wrong" (a rank that computes garbage while the
process stays up) is visible to a load balancer.

The recording is an ``adapt validate dump`` golden directory (or its golden.json: ``prompts`` and
``generation.prompts[i].tokens``), or a JSON file ``{"cases": [{"prompt_token_ids": [...], "token_ids":
[...]}]}``. The replay goes through the same engine loop as client requests (greedy, ``ignore_eos``,
as many tokens as recorded) and is repeated when the last answer is older than the interval.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from adapt.errors import RuntimeConfigError
from adapt.runtime.sampling import SamplingParams
from adapt.runtime.server.errors import APIError
from adapt.runtime.server.requests import GenRequest

MAX_CASES = 8


def load_golden(path: str | Path, vocab_size: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, recorded greedy tokens) pairs from a golden directory, golden.json or a cases file."""
    p = Path(path)
    f = p / "golden.json" if p.is_dir() else p
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RuntimeConfigError(f"--health-golden {path}: cannot read {f} ({e})") from None
    cases = []
    try:
        if isinstance(doc, dict) and "cases" in doc:
            cases = [(list(map(int, c["prompt_token_ids"])), list(map(int, c["token_ids"]))) for c in doc["cases"]]
        elif isinstance(doc, dict) and "generation" in doc:
            gens = doc["generation"]["prompts"]
            cases = [(list(map(int, pr)), list(map(int, g["tokens"]))) for pr, g in zip(doc["prompts"], gens)]
    except (KeyError, TypeError, ValueError) as e:
        raise RuntimeConfigError(f"--health-golden {path}: malformed ({type(e).__name__}: {e})") from None
    cases = [(pr, tk) for pr, tk in cases if pr and tk][:MAX_CASES]
    if not cases:
        raise RuntimeConfigError(f"--health-golden {path}: no recorded prompts with tokens (expected an adapt "
                                 "golden directory or {\"cases\": [{\"prompt_token_ids\", \"token_ids\"}]})")
    bad = [t for pr, tk in cases for t in pr + tk if not 0 <= t < vocab_size]
    if bad:
        raise RuntimeConfigError(f"--health-golden {path}: token id {bad[0]} is outside this model's vocabulary "
                                 f"[0, {vocab_size}): recorded from another model?")
    return cases


class GoldenCheck:
    """The replay and its last answer (status, body)."""

    def __init__(self, service, cases: list[tuple[list[int], list[int]]], source: str, interval_s: float = 300.0):
        self.service, self.cases, self.source, self.interval_s = service, cases, source, interval_s
        self.last: tuple[float, int, dict[str, Any]] | None = None
        self._lock: asyncio.Lock | None = None

    async def run(self) -> tuple[int, dict[str, Any]]:
        """Replay every case now."""
        results, ok = [], True
        t0 = time.perf_counter()
        for i, (prompt, want) in enumerate(self.cases):
            req = GenRequest("completion", None, [prompt], SamplingParams(temperature=0, max_tokens=len(want),
                                                                          ignore_eos=True), True,
                             return_token_ids=True)
            try:
                got = (await self.service.generate(req))["choices"][0]["token_ids"]
            except APIError as e:
                results.append({"case": i, "match": False, "error": e.message})
                ok = False
                continue
            first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b),
                         None if len(got) == len(want) else min(len(got), len(want)))
            results.append({"case": i, "match": first is None, "tokens": len(want),
                            **({"first_mismatch": first, "expected": want[first:first + 4],
                                "got": got[first:first + 4]} if first is not None else {})})
            ok = ok and first is None
        body = {"status": "ok" if ok else "mismatch", "source": self.source, "cases": results,
                "seconds": round(time.perf_counter() - t0, 3), "checked_at": int(time.time())}
        status = 200 if ok else 503
        self.last = (time.monotonic(), status, body)
        return status, body

    async def answer(self) -> tuple[int, dict[str, Any]]:
        """The last answer, replayed first when it is older than the interval (one replay at a time)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.last is None or time.monotonic() - self.last[0] > self.interval_s:
                return await self.run()
        return self.last[1], self.last[2]
