"""Text in and out of the runtime: a checkpoint's tokenizer.json, its special tokens and chat template.

``Tokenizer.from_dir`` reads ``tokenizer.json`` with the ``tokenizers`` library (or, without one, a
tiktoken BPE file such as Kimi-K2's, rebuilt as the same byte-level BPE by ``tiktoken_bpe``), the special tokens and
``chat_template`` from ``tokenizer_config.json`` (a ``chat_template.jinja`` file takes priority, as in
transformers). Chat templates are untrusted code from the checkpoint, so they render in jinja2's
immutable sandbox with the helpers transformers gives them (``raise_exception``, ``tojson``,
``strftime_now``, loop controls, trimmed blocks).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

from adapt.errors import CheckpointError, RuntimeConfigError

__all__ = ["ChatTemplateError", "IncrementalDecoder", "Tokenizer"]


class ChatTemplateError(RuntimeConfigError):
    """A chat template failed to render (often its ``raise_exception`` rejecting the messages)."""


class Tokenizer:
    """A ``tokenizers`` tokenizer plus the checkpoint's special tokens and chat template."""

    def __init__(
        self,
        backend: _Backend,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        config_add_bos_token: bool | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        # What tokenizer_config.json says. As in transformers 5, tokenizer.json's post-processor alone decides
        # which special tokens encode() adds; ``adds_bos_token`` says what it does, so a check can compare.
        self.config_add_bos_token = config_add_bos_token
        # transformers 5 applies this WordPiece-era cleanup to non-BPE models only; so do we.
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` from ``path``."""
        from adapt.runtime.tiktoken_bpe import build_tokenizer, find_tiktoken

        root = Path(path)
        file = root / "tokenizer.json"
        config = _read_json(root / "tokenizer_config.json")
        if file.is_file():
            try:
                backend = _Backend.from_file(str(file))
            except Exception as e:  # the tokenizers library raises a bare Exception on malformed files
                raise CheckpointError(f"cannot read {file}: {e}") from None
        elif find_tiktoken(root) is not None:  # Kimi-K2: tiktoken BPE + its pattern in tokenization_*.py
            backend = build_tokenizer(root, config)
        else:
            raise CheckpointError(f"{root} has no tokenizer.json or tiktoken.model")
        special = _read_json(root / "special_tokens_map.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token", special.get("bos_token"))),
            eos_token=_token_text(config.get("eos_token", special.get("eos_token"))),
            chat_template=template if isinstance(template, str) else None,
            config_add_bos_token=config.get("add_bos_token") if isinstance(config.get("add_bos_token"), bool) else None,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    # -- vocabulary ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Entries in the vocabulary, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token) if self.eos_token is not None else None

    @property
    def adds_bos_token(self) -> bool:
        """Whether ``encode(text)`` starts with the BOS token."""
        bos = self.bos_token_id
        return bos is not None and self.encode("")[:1] == [bos]

    # -- text <-> ids ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer adds (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, leaving out special tokens unless ``skip_special_tokens`` is False."""
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A streaming detokenizer for one sequence's generated tokens."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template; extra kwargs reach the template."""
        if self.chat_template is None:
            raise CheckpointError("the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **_plain(kwargs),
            "messages": _plain(messages),
            "tools": _plain(tools),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes its own BOS, so none is added."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _template(self) -> jinja2.Template:
        assert self.chat_template is not None
        try:
            return _sandbox().from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise CheckpointError(f"chat template does not parse: {e}") from None


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas, holding back text that is not yet stable.

    Text is emitted only when the decoded window does not end in U+FFFD (a UTF-8 character split across
    tokens). The window starts one emitted step back, so decoders that treat a leading token specially
    (SentencePiece's leading space) see the same context as a full decode. The deltas plus ``flush()``
    concatenate to ``decode(all ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # window start
        self._read = 0  # ids up to here are emitted

    def push(self, token_id: int | list[int]) -> str:
        """Add one token (or several); returns the newly stable text, possibly ''."""
        self.ids.extend([token_id] if isinstance(token_id, int) else token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The held-back rest at the end of the stream (an incomplete character shows as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        delta = self._decode(self.ids[self._prefix :])[len(prefix_text) :]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


def _clean_up_spaces(text: str) -> str:
    """Drop the space a word-level decode puts before punctuation and English contractions."""
    for old, new in _CLEAN_UP:
        text = text.replace(old, new)
    return text


_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m")]
_CLEAN_UP += [(" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as the config writes it: a string or an AddedToken dict with 'content'."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types, so the sandbox sees no foreign objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    # Subclasses (enums, numpy scalars) go back to the base type, whatever their own methods say.
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return str(value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps, as transformers gives.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _sandbox() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
