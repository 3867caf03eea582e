"""``adapt validate dump --endpoint URL MODEL --out GOLDEN``: a golden recorded from a running server.

The reference stack of a release is often a server on the model's native hardware (vLLM on its GPUs), not
transformers on a CPU. This records, through that server's OpenAI-compatible API, what a black box can give
for the same seeded prompts ``adapt validate dump MODEL`` uses, in the same golden format, so that
``adapt validate TARGET --reference GOLDEN`` (and ``--endpoint``) read it like any other golden:

- greedy continuations with the top-N logprobs of every generated token (``generation``, as ever);
- per prompt position, the top-N next-token logprobs (``prompt_top.{p}.ids`` / ``.logprobs`` [T-1, K]: row t
  is the distribution after tokens 0..t, the row of the prefill logits it stands for; K = top-N plus the
  prompt's own token, padded with id -1), from vLLM's ``prompt_logprobs`` or else the legacy ``echo``;
- each long-context rung's prompt and the top-N logprobs of the next token after it (``long.{L}.ids``,
  ``long.{L}.top_ids`` / ``long.{L}.top_logprobs``);
- the server's rendering of the chat item's messages (``chat.prompt_token_ids``), which ``chat_template_parity``
  then holds another server to, and a copy of MODEL's tokenizer files.

There are no logits and no layer outputs: the items that need them skip with that reason. MODEL gives the
config (the prompts are drawn from its vocabulary; only config.json is needed, a hub id fetches nothing else)
and, from a checkpoint directory or ``--tokenizer``, the tokenizer that maps token texts back to ids when the
server sends none. golden.json's ``endpoint`` block records the server's ``/v1/models`` and ``/version``
answers and where the token ids came from. Every request is made before anything is written: a server that is
down, answers 500s or malformed JSON is one ``ValidationInputError`` (exit 2) and GOLDEN is left as it was.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from adapt.errors import AdaptError, ValidationInputError
from adapt.validate.checklist import Skip
from adapt.validate.checks.endpoint import CHAT
from adapt.validate.golden import DEFAULT_LONG, FORMAT, VERSION
from adapt.validate.openai_client import Client, EndpointError
from adapt.validate.reference import PROMPT_LENGTHS, fixed_prompts, long_prompt

SOURCE = "endpoint"
# copied into GOLDEN so that `validate --endpoint --reference GOLDEN` maps token texts and renders the template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tiktoken.model")


def _model_config(model: str | Path):
    from adapt.source import resolve_model

    try:
        src = resolve_model(str(model))
        spec = src.spec()
    except AdaptError as e:
        raise ValidationInputError(f"MODEL {model}: {e}") from None
    return src, spec


def _choice(doc: dict[str, Any]):
    """(choices[0] parsed by the service's own response model, adapt/runtime/server/protocol.py; its legacy
    ``logprobs`` as sent: servers leave out parts of it, such as ``text_offset``)."""
    from pydantic import ValidationError

    from adapt.runtime.server.protocol import CompletionChoice

    ch = doc.get("choices")
    raw = ch[0] if isinstance(ch, list) and ch and isinstance(ch[0], dict) else {}
    try:
        choice = CompletionChoice.model_validate({**raw, "logprobs": None})
    except ValidationError as e:
        raise EndpointError("malformed", f"/v1/completions: choices[0] is not a completion choice "
                                         f"({e.errors()[0]['loc']}: {e.errors()[0]['msg']})") from None
    lp = raw.get("logprobs")
    if lp is not None and not (isinstance(lp, dict) and all(isinstance(lp.get(k), list) for k in
                                                            ("tokens", "token_logprobs", "top_logprobs"))):
        raise EndpointError("malformed", f"/v1/completions: choices[0].logprobs is not the legacy logprobs "
                                         f"object: {str(lp)[:200]}")
    return choice, lp


def _vllm_rows(rows: list, n: int) -> list[dict[int, float]]:
    """vLLM's ``prompt_logprobs`` ([None, {id: {logprob, ...}}, ...]) -> per logits row {id: logprob}."""
    if len(rows) != n + 1 or rows[0] is not None:
        raise EndpointError("malformed", f"/v1/completions: prompt_logprobs has {len(rows)} entries for a prompt "
                                         f"of {n + 1} tokens (expected None first)")
    out = []
    for k, row in enumerate(rows[1:], start=1):
        d = {}
        for key, v in (row or {}).items():
            lp = v.get("logprob") if isinstance(v, dict) else v
            if not str(key).lstrip("-").isdigit() or not isinstance(lp, (int, float)):
                raise EndpointError("malformed", f"/v1/completions: prompt_logprobs[{k}] entry {key!r}: {v!r}")
            d[int(key)] = float(lp)
        out.append(d)
    return out


class _Recorder:
    """The requests of one dump through ``endpoint.EndpointRunner`` (token-id negotiation, id mapping)."""

    def __init__(self, runner, top_n: int):
        self.run, self.top_n = runner, top_n
        self.prompt_source = "none"

    def chat_prompt_ids(self, messages: list[dict[str, Any]]) -> tuple[list[int] | None, str]:
        """The server's rendering of ``messages`` through its chat template (``prompt_token_ids`` of a
        ``/v1/chat/completions``), or None and why: a server that refuses chat or sends no ids is recorded, not fatal."""
        run = self.run
        try:
            doc = run.client.post_negotiated("/v1/chat/completions", run._body(messages=messages, max_tokens=1,
                                             temperature=0.0), {"return_token_ids": True})
        except EndpointError as e:
            return None, f"/v1/chat/completions failed: {e}"
        ch = doc.get("choices")
        ids = ch[0].get("prompt_token_ids") if isinstance(ch, list) and ch and isinstance(ch[0], dict) else None
        ids = ids or doc.get("prompt_token_ids")  # adapt serve sends them in the choice, vLLM at the top level
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            return ids, "server (prompt_token_ids)"
        return None, "the server sends no prompt_token_ids"

    def next_token_top(self, ids: Sequence[int]) -> tuple[dict[int, float], str | None]:
        """The top-N logprobs of the next token after ``ids``, or why they cannot be recorded. The greedy token
        is the top-1, so its id (``return_token_ids``, ``token_id:N``, or its text mapped) must be known; an
        alternative whose text several ids share is left out (fewer ids compared, never a wrong one)."""
        try:
            c = self.run.complete(ids, 1, self.top_n)
        except Skip as e:
            return {}, e.reason
        if not c.logprobs or not c.logprobs[0]:
            raise EndpointError("malformed", f"/v1/completions: no top-{self.top_n} logprobs after a "
                                             f"{len(ids)}-token prompt")
        return c.logprobs[0], None

    def prompt_top(self, ids: Sequence[int]) -> list[dict[int, float]] | None:
        """Top-N logprobs per prompt position (rows 0..T-2 of the prefill logits), or None when the server
        offers neither ``prompt_logprobs`` nor ``echo``. Through ``echo`` the alternatives come keyed by text: a
        row with a text several ids share is left empty (compared nowhere) rather than kept with a hole."""
        run, client = self.run, self.run.client
        body = run._body(prompt=[int(t) for t in ids], max_tokens=1, temperature=0.0)
        if "prompt_logprobs" not in client.dropped:
            doc = client.post_negotiated("/v1/completions", body, {"prompt_logprobs": self.top_n})
            rows = _choice(doc)[0].prompt_logprobs
            if rows is not None:
                self.prompt_source = "prompt_logprobs (token ids)"
                return _vllm_rows(rows, len(ids) - 1)
            client.dropped.add("prompt_logprobs")  # accepted but ignored: never asked again
        if "echo" in client.dropped:
            return None
        doc = client.post_negotiated("/v1/completions", {**body, "logprobs": self.top_n}, {"echo": True})
        if "echo" in client.dropped:
            return None
        lp = _choice(doc)[1]
        if lp is None or len(lp["tokens"]) < len(ids) or len(lp["top_logprobs"]) < len(ids):
            raise EndpointError("malformed", "/v1/completions with echo: the logprobs do not cover the prompt")
        raw = lp["top_logprobs"][1:len(ids)]
        tops = run._tops(raw, len(ids) - 1)
        self.prompt_source = ("echo (token_id:N keys)" if all(str(t).startswith("token_id:") for t in lp["tokens"])
                              else "echo (texts mapped through the reference tokenizer)")
        for k, (t, v) in enumerate(zip(ids[1:], lp["token_logprobs"][1:len(ids)])):
            if len(tops[k]) < len(raw[k] or {}):  # a text several ids share was dropped: its top-1 is unknown
                tops[k] = {}
            elif isinstance(v, (int, float)):
                tops[k].setdefault(int(t), float(v))
        return tops


def _pad(rows: list[dict[int, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    k = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), k), -1, dtype=torch.long)
    vals = torch.full((len(rows), k), math.nan, dtype=torch.float64)
    for i, r in enumerate(rows):
        for j, (t, v) in enumerate(sorted(r.items(), key=lambda kv: -kv[1])):
            ids[i, j], vals[i, j] = t, v
    return ids, vals


def _write(out: Path, tensors: dict[str, torch.Tensor], doc: dict[str, Any], extra: list[Path]) -> None:
    """Write into a fresh directory beside ``out`` (with copies of the ``extra`` files) and move it in place,
    golden.json last."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for f in extra:
            shutil.copyfile(f, tmp / f.name)
        save_file(tensors, str(tmp / "tensors.safetensors"))
        (tmp / "golden.json").write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
        if not out.exists():
            os.replace(tmp, out)
            return
        for name in [f.name for f in extra] + ["tensors.safetensors", "golden.json"]:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dump_endpoint_golden(
    url: str, model: str | Path, out: str | Path, *, api_key: str | None = None,
    served_model_name: str | None = None, timeout: float = 60.0, tokenizer_dir: str | Path | None = None,
    max_new_tokens: int = 16, top_n: int = 20, long_lengths: Sequence[int] = DEFAULT_LONG,
    long_budget_s: float = 60.0, prompt_lengths: Sequence[int] = PROMPT_LENGTHS,
) -> dict[str, Any]:
    """Record a golden from the server at ``url`` (see the module docstring); returns golden.json's content."""
    from adapt.validate.endpoint import EndpointRunner, TokenMap, probe, reference_tokenizer

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValidationInputError(f"--out {out} exists and is not a directory")
    src, spec = _model_config(model)
    try:
        client = Client(url, api_key=api_key, timeout=timeout)
    except ValueError as e:
        raise ValidationInputError(str(e)) from None
    info = probe(client, served_model_name)
    tok = reference_tokenizer(SimpleNamespace(path=src.directory), tokenizer_dir)
    runner = EndpointRunner(client, info.model, spec.num_layers, spec.vocab_size,
                            TokenMap(tok, spec.vocab_size) if tok is not None else None)
    rec = _Recorder(runner, top_n)
    prompts = fixed_prompts(spec.vocab_size, prompt_lengths)
    tensors: dict[str, torch.Tensor] = {}
    gens, long_done, skipped = [], [], []
    where = f"--endpoint {client.url}"
    try:
        for p, ids in enumerate(prompts):
            c = runner.complete(ids, max_new_tokens, top_n)
            if len(c.tokens) < max_new_tokens:
                refused = " and refuses ignore_eos" if "ignore_eos" in client.dropped else ""
                raise ValidationInputError(
                    f"{where} stopped prompt {p} after {len(c.tokens)} of {max_new_tokens} tokens "
                    f"({c.finish_reason}){refused}: dump with a smaller --max-new-tokens (nothing written)")
            gens.append({"tokens": c.tokens[:max_new_tokens],
                         "logprobs": [[[t, lp] for t, lp in d.items()] for d in c.logprobs[:max_new_tokens]]})
            rows = rec.prompt_top(ids)
            if rows is not None:
                tensors[f"prompt_top.{p}.ids"], tensors[f"prompt_top.{p}.logprobs"] = _pad(rows)
        last = None
        for length in sorted(set(long_lengths)):
            why = None
            if info.max_model_len and length + 1 > info.max_model_len:
                why = f"beyond the server's max_model_len {info.max_model_len}"
            elif spec.max_position_embeddings and length > spec.max_position_embeddings:
                why = f"beyond max_position_embeddings {spec.max_position_embeddings}"
            elif last is not None and last[1] * (length / last[0]) ** 2 > long_budget_s:
                why = f"estimated {last[1] * (length / last[0]) ** 2:.0f}s > budget {long_budget_s:.0f}s"
            if why:
                skipped.append({"length": length, "reason": why})
                continue
            ids = long_prompt(spec.vocab_size, length)
            t0 = time.perf_counter()
            top, why = rec.next_token_top(ids)
            last = (length, max(time.perf_counter() - t0, 1e-3))
            if why:
                skipped.append({"length": length, "reason": why})
                continue
            tensors[f"long.{length}.ids"] = torch.tensor(ids, dtype=torch.long)
            tensors[f"long.{length}.top_ids"], tensors[f"long.{length}.top_logprobs"] = (t[0] for t in _pad([top]))
            long_done.append(length)
        chat_ids, chat_source = rec.chat_prompt_ids(CHAT)
    except EndpointError as e:
        raise ValidationInputError(f"{where}: {e} (nothing written)") from None
    except Skip as e:
        raise ValidationInputError(f"{where}: {e.reason} (nothing written)") from None
    provenance = info.to_dict(runner)
    provenance["prompt_logprobs"] = rec.prompt_source
    doc = {
        "format": FORMAT, "version": VERSION, "model": str(model), "source": SOURCE,
        "config": src.config, "num_layers": spec.num_layers, "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "reference": f"endpoint {client.url} ({info.model})", "endpoint": provenance, "prompts": prompts,
        "generation": {"max_new_tokens": max_new_tokens, "top_n": top_n, "prompts": gens},
        "layer_stats": [], "long_context": {"lengths": long_done, "skipped": skipped, "top_n": top_n},
        "chat": {"messages": CHAT, "prompt_token_ids": chat_ids, "source": chat_source},
        "tensors": "tensors.safetensors",
    }
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else src.directory
    extra = [tok_dir / n for n in TOKENIZER_FILES if tok_dir is not None and (tok_dir / n).is_file()]
    _write(out, tensors, doc, extra)
    return doc
