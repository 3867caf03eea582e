"""An OpenAI-compatible server as a validation target (``adapt validate --endpoint URL``): a black box.

What a black box offers is its API: greedy completions of token-id prompts with the top-N logprobs of every
generated token, chat completions, streams, and its behaviour under concurrent load. ``EndpointRunner``
answers ``generate_greedy`` through ``POST /v1/completions`` (``prompt`` as token ids, ``temperature: 0``,
``logprobs: N``); ``prefill_logits`` and ``layer_outputs`` raise ``Skip``: the weights' internals are not
visible through the API.

Token ids: the chosen tokens come from the server's ``token_ids`` (vLLM's and adapt's ``return_token_ids``)
where it sends them; the top-N alternatives come keyed by token text, and a ``token_id:N`` key (vLLM's
``return_tokens_as_token_ids``; adapt serve without a tokenizer) is read as the id. Any other text is mapped
back through the reference tokenizer (each id decoded alone; a text two ids share cannot be mapped and is
dropped). ``token_ids_source`` says which happened and goes into the report.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapt.errors import ValidationInputError
from adapt.validate.checklist import Skip
from adapt.validate.openai_client import Client, EndpointError
from adapt.validate.target import Generation

EXTENSIONS = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
BLACK_BOX = "an endpoint is a black box: its logits and layer outputs are not visible through the API"


def _byte_level_inverse() -> dict[str, int]:
    """The GPT-2 byte-level alphabet, inverted: printable bytes stand for themselves, the other 68 bytes for
    the code points from 256 up, in byte order (the mapping ByteLevel tokenizers store tokens in)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_bytes(tokenizer: Any, i: int, inverse: dict[str, int] | None) -> bytes:
    backend = getattr(tokenizer, "backend", None)
    raw = backend.id_to_token(i) if backend is not None else None
    if raw is not None and inverse is not None and all(c in inverse for c in raw):
        return bytes(inverse[c] for c in raw)
    if raw is not None and len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):  # byte fallback
        return bytes([int(raw[3:5], 16)])
    return tokenizer.decode([i], skip_special_tokens=False).encode("utf-8")


class TokenMap:
    """Token text -> id through the reference tokenizer, each id decoded alone. A text several ids share (a
    byte-level piece of a multi-byte character decodes alone to U+FFFD) is resolved, for generated tokens, by
    ``resolve``: the ids whose bytes spell the server's whole text; for top-N alternatives it is dropped."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        n = min(vocab_size, getattr(tokenizer, "vocab_size", vocab_size))
        backend = getattr(tokenizer, "backend", None)
        inverse = _byte_level_inverse() if type(getattr(backend, "decoder", None)).__name__ == "ByteLevel" else None
        self.candidates: dict[str, list[int]] = {}
        self.bytes: list[bytes] = []
        for i in range(n):
            self.candidates.setdefault(tokenizer.decode([i], skip_special_tokens=False), []).append(i)
            self.bytes.append(_token_bytes(tokenizer, i, inverse))
        self.ids = {s: c[0] for s, c in self.candidates.items() if len(c) == 1}

    def __call__(self, text: str) -> int | None:
        return self.ids.get(text)

    def resolve(self, texts: list[str], full_text: str, limit: int = 100_000) -> list[int] | None:
        """Ids of the generated ``texts`` whose bytes concatenate to ``full_text`` (a token may also spell
        nothing: special tokens are left out of the text); None when no assignment fits."""
        data = full_text.encode("utf-8")
        options = [self.candidates.get(t) or ([int(t[9:])] if t.startswith("token_id:") and t[9:].isdigit() else [])
                   for t in texts]
        budget = [limit]
        dead: set[tuple[int, int]] = set()

        def walk(k: int, pos: int) -> list[int] | None:
            if k == len(options):
                return [] if pos == len(data) else None
            if (k, pos) in dead or budget[0] <= 0:
                return None
            budget[0] -= 1
            for i in options[k]:
                b = self.bytes[i] if i < len(self.bytes) else b""
                for step in ([len(b)] if data.startswith(b, pos) else []) + ([0] if len(options[k]) == 1 else []):
                    rest = walk(k + 1, pos + step)
                    if rest is not None:
                        return [i] + rest
            dead.add((k, pos))
            return None

        return walk(0, 0)


def _id_of(text: str, tokmap: TokenMap | None) -> int | None:
    if text.startswith("token_id:") and text[9:].isdigit():
        return int(text[9:])
    return tokmap(text) if tokmap is not None else None


@dataclass
class Completion:
    """One completion choice read back: tokens, top-N logprobs per token, text, finish reason."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    text: str
    finish_reason: str | None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] = field(default_factory=dict)


def _choice(doc: dict, path: str) -> dict:
    ch = doc.get("choices")
    if not isinstance(ch, list) or not ch or not isinstance(ch[0], dict):
        raise EndpointError("malformed", f"{path}: the answer has no choices[0]: {str(doc)[:200]}")
    return ch[0]


class EndpointRunner:
    """``target.ModelRunner`` over an OpenAI-compatible server (generation only; see the module docstring)."""

    runtime = "endpoint"

    def __init__(self, client: Client, model: str | None, num_layers: int, vocab_size: int,
                 tokmap: TokenMap | None = None):
        self.client, self.model = client, model
        self.name = model or client.url
        self.num_layers, self.vocab_size = num_layers, vocab_size
        self.tokmap = tokmap
        self.sources: set[str] = set()  # how token ids were obtained, over every answer
        self._lock = threading.Lock()

    def _body(self, **kw: Any) -> dict[str, Any]:
        return ({"model": self.model} if self.model else {}) | kw

    def _ids(self, texts: Sequence[str], given: Any, what: str, full_text: str = "") -> list[int]:
        if isinstance(given, list) and all(isinstance(t, int) for t in given):
            self._note("server (return_token_ids)")
            return list(given)
        out = [_id_of(s, self.tokmap) for s in texts]
        if all(s.startswith("token_id:") for s in texts):
            self._note("token_id:N keys")
            return out
        if any(i is None for i in out):
            fit = self.tokmap.resolve(texts, full_text) if self.tokmap is not None else None
            if fit is None:
                bad = next(s for s, i in zip(texts, out) if i is None)
                raise Skip(f"{what}: the server sends no token ids and its token text {bad!r} is shared by several "
                           "ids of the reference tokenizer and does not spell the answer's text: token identity "
                           "cannot be established (serve with return_token_ids or return_tokens_as_token_ids)")
            out = fit
        self._note("reference tokenizer")
        return out

    def _note(self, how: str) -> None:
        with self._lock:
            self.sources.add(how)

    def _tops(self, tops: Any, n: int) -> list[dict[int, float]]:
        out = []
        for step in tops[:n] if isinstance(tops, list) else []:
            d = {}
            for s, v in (step or {}).items():
                i = _id_of(str(s), self.tokmap)
                if i is not None and isinstance(v, (int, float)):
                    d[i] = float(v)
            out.append(dict(sorted(d.items(), key=lambda kv: -kv[1])))
        return out

    def complete(self, ids: Sequence[int], max_tokens: int, top_n: int = 5, timeout: float | None = None
                 ) -> Completion:
        """Greedy ``/v1/completions`` of a token-id prompt with top-N logprobs."""
        body = self._body(prompt=[int(t) for t in ids], max_tokens=int(max_tokens), temperature=0.0,
                          logprobs=int(top_n))
        doc = self.client.post_negotiated("/v1/completions", body, EXTENSIONS, timeout)
        c = _choice(doc, "/v1/completions")
        lp = c.get("logprobs") or {}
        texts = lp.get("tokens") if isinstance(lp, dict) else None
        if not isinstance(texts, list):
            raise EndpointError("malformed", "/v1/completions: no logprobs.tokens in the answer (the server ignored "
                                             f"'logprobs': {top_n})")
        tokens = self._ids([str(t) for t in texts], c.get("token_ids"), "/v1/completions", str(c.get("text") or ""))
        tops = self._tops(lp.get("top_logprobs"), len(tokens))
        chosen = lp.get("token_logprobs") or []
        for k, t in enumerate(tokens):  # the chosen token's own logprob belongs in its step's dict
            if k < len(tops) and k < len(chosen) and isinstance(chosen[k], (int, float)):
                tops[k].setdefault(t, float(chosen[k]))
        return Completion(tokens, tops, str(c.get("text") or ""), c.get("finish_reason"),
                          c.get("prompt_token_ids"), doc.get("usage") or {})

    def stream_complete(self, ids: Sequence[int], max_tokens: int, timeout: float | None = None
                        ) -> tuple[list[int] | None, str]:
        """The same greedy completion streamed: (token ids when the server sends them, reassembled text)."""
        body = self._body(prompt=[int(t) for t in ids], max_tokens=int(max_tokens), temperature=0.0)
        events = self.client.post_negotiated("/v1/completions", body, EXTENSIONS, timeout, stream=True)
        ids_out: list[int] | None = [] if "return_token_ids" not in self.client.dropped else None
        text = ""
        for _, ev in events:
            for c in ev.get("choices") or []:
                text += str(c.get("text") or "")
                if ids_out is not None:
                    ids_out += list(c.get("token_ids") or [])
        return ids_out, text

    # ------------------------------------------------------------------------------------ ModelRunner

    def generate_greedy(self, ids: Sequence[int], max_new_tokens: int, top_n: int = 5) -> Generation:
        c = self.complete(ids, max_new_tokens, top_n)
        if len(c.tokens) < max_new_tokens and "ignore_eos" in self.client.dropped:
            raise Skip(f"the server stopped after {len(c.tokens)} of {max_new_tokens} tokens "
                       f"({c.finish_reason}) and does not take ignore_eos")
        return Generation(c.tokens, c.logprobs)

    def prefill_logits(self, ids: Sequence[int]):
        raise Skip(f"needs the logits of every prompt position: {BLACK_BOX}")

    def layer_outputs(self, ids: Sequence[int]):
        raise Skip(f"needs per-layer hidden states: {BLACK_BOX}")


@dataclass
class EndpointInfo:
    """What the server says about itself, recorded in the report's environment block."""

    url: str
    model: str | None
    models: Any
    version: Any
    max_model_len: int | None

    def to_dict(self, runner: EndpointRunner | None = None) -> dict[str, Any]:
        d = {"url": self.url, "served_model_name": self.model, "v1_models": self.models, "version": self.version,
             "max_model_len": self.max_model_len}
        if runner is not None:
            d["token_ids"] = sorted(runner.sources) or ["none requested"]
            d["extensions_refused"] = sorted(runner.client.dropped)
        return d


def probe(client: Client, served_model_name: str | None) -> EndpointInfo:
    """GET /v1/models (and /version); nothing answering is ``ValidationInputError`` (exit 2)."""
    try:
        status, models = client.get("/v1/models")
    except EndpointError as e:
        raise ValidationInputError(f"--endpoint {client.url}: nothing could be reached ({e})") from None
    if status != 200:
        raise ValidationInputError(f"--endpoint {client.url}: GET /v1/models answered HTTP {status}"
                                   + (" (wrong --api-key?)" if status in (401, 403) else f": {str(models)[:200]}"))
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        raise ValidationInputError(f"--endpoint {client.url}: GET /v1/models is not an OpenAI model list: "
                                   f"{str(models)[:200]}")
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    model = served_model_name
    if model is None:
        if len(ids) != 1:
            raise ValidationInputError(f"--endpoint {client.url} serves {len(ids)} models ({', '.join(map(str, ids))}): "
                                       "name one with --served-model-name")
        model = ids[0]
    elif model not in ids:
        raise ValidationInputError(f"--served-model-name {model!r}: the endpoint serves {', '.join(map(str, ids))}")
    card = next(m for m in data if isinstance(m, dict) and m.get("id") == model)
    mml = card.get("max_model_len") or card.get("context_length")
    try:
        vs, version = client.get("/version", timeout=min(client.timeout, 10.0))
        version = version if vs == 200 else None
    except EndpointError:
        version = None
    return EndpointInfo(client.url, model, models, version, int(mml) if isinstance(mml, int) else None)


def reference_tokenizer(reference: Any, tokenizer_dir: str | Path | None = None):
    """The reference's tokenizer (adapt.runtime.tokenizer.Tokenizer) or None: ``tokenizer_dir``, else the
    reference checkpoint directory, else a golden directory's copy."""
    from adapt.runtime.tokenizer import Tokenizer

    for d in ([tokenizer_dir] if tokenizer_dir else []) + [getattr(reference, "path", None)]:
        if d is None:
            continue
        d = Path(d)
        if (d / "tokenizer.json").is_file() or (d / "tiktoken.model").is_file():
            try:
                return Tokenizer.from_dir(d)
            except Exception as e:  # noqa: BLE001 - a broken tokenizer is said, the run goes on without it
                raise ValidationInputError(f"tokenizer {d}: {e}") from None
    if tokenizer_dir:
        raise ValidationInputError(f"--tokenizer {tokenizer_dir}: no tokenizer.json or tiktoken.model")
    return None


def open_endpoint(url: str, reference: Any, *, api_key: str | None = None, served_model_name: str | None = None,
                  timeout: float = 60.0, tokenizer_dir: str | Path | None = None):
    """(Target, EndpointInfo, tokenizer or None) for ``--endpoint URL`` checked against ``reference``."""
    from adapt.validate.target import Target

    try:
        client = Client(url, api_key=api_key, timeout=timeout)
    except ValueError as e:
        raise ValidationInputError(str(e)) from None
    info = probe(client, served_model_name)
    tok = reference_tokenizer(reference, tokenizer_dir)
    tokmap = TokenMap(tok, reference.vocab_size) if tok is not None else None
    runner = EndpointRunner(client, info.model, reference.num_layers, reference.vocab_size, tokmap)
    target = Target(Path(info.model or "endpoint"), "endpoint", "endpoint", runner)
    return target, info, tok
