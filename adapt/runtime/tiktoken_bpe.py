"""Tokenizers that ship as a tiktoken BPE file (``tiktoken.model``, e.g. Kimi-K2) instead of tokenizer.json.

A tiktoken file lists every token as ``base64(bytes) rank``; encoding splits the text with a pre-tokenizer
regex, maps a piece that is a whole token straight to its rank and otherwise merges byte pairs, lowest
rank first. The same tokenizer in the ``tokenizers`` library is a byte-level BPE: each token's bytes
written in the GPT-2 byte-to-unicode alphabet, one merge per multi-byte token (the two tokens the rank
order splits it into), ranks as merge priorities, ``ignore_merges`` for whole-token pieces. The regex
is not in the tiktoken file: the checkpoint's tokenizer code holds it (``pat_str`` in
tokenization_*.py), and it is read from there as data, with ``ast``, never executed. Special tokens and
their ids come from tokenizer_config.json's ``added_tokens_decoder``; ids left between them are filled
with reserved placeholders so that every id keeps its place.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from adapt.errors import AdaptError, CheckpointError
from adapt.fileio import atomic_write

TIKTOKEN_FILES = ("tiktoken.model",)


def find_tiktoken(root: Path) -> Path | None:
    """The tiktoken BPE file of a checkpoint directory, if it has one."""
    for name in TIKTOKEN_FILES:
        if (root / name).is_file():
            return root / name
    return None


def read_ranks(path: Path) -> dict[bytes, int]:
    """``base64 rank`` lines -> {token bytes: rank}; a malformed line is a CheckpointError naming it."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
            except (ValueError, TypeError):
                raise CheckpointError(f"{path.name} line {i}: expected 'base64-token rank'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{path.name}: ranks must be 0..{len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise CheckpointError(f"{path.name}: the 256 single bytes must all be tokens")
    return ranks


def find_pattern(root: Path) -> str:
    """The pre-tokenizer regex of a tiktoken tokenizer: a ``pat_str`` string (or ``"|".join`` of string
    literals) assigned in the checkpoint's tokenization_*.py, read with ast."""
    for py in sorted(root.glob("tokenization*.py")):
        try:
            tree = ast.parse(py.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {t.id if isinstance(t, ast.Name) else getattr(t, "attr", None) for t in targets}
                if "pat_str" in names and node.value is not None:
                    pattern = _literal_pattern(node.value)
                    if pattern:
                        return pattern
    raise CheckpointError(f"{root} has a tiktoken tokenizer but no pre-tokenizer pattern: adapt looks for a "
                          "string 'pat_str' in tokenization*.py")


def _literal_pattern(node: ast.expr) -> str | None:
    # "..." or "sep".join([...literals...]) (also a tuple); anything computed is not read
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple))):
        parts = node.args[0].elts
        if all(isinstance(p, ast.Constant) and isinstance(p.value, str) for p in parts):
            return node.func.value.value.join(p.value for p in parts)
    return None


def _byte_alphabet() -> dict[int, str]:
    # GPT-2's reversible byte -> printable unicode map, the alphabet of tokenizers' ByteLevel
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _split(token: bytes, ranks: dict[bytes, int], limit: int) -> tuple[bytes, bytes]:
    # the two tokens the rank order splits ``token`` into: byte-pair merges lowest rank first, using only
    # tokens ranked below it, until two parts are left
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise CheckpointError(f"tiktoken token {token!r} (rank {limit}) is not a merge of two lower-ranked tokens")
    return parts[0], parts[1]


def special_tokens(config: dict[str, Any], first_id: int) -> list[tuple[int, str, bool]]:
    """(id, content, special) of tokenizer_config.json's added_tokens_decoder, ids from ``first_id`` on."""
    added = config.get("added_tokens_decoder") or {}
    out = []
    for key, entry in added.items():
        try:
            tid = int(key)
            content = entry["content"] if isinstance(entry, dict) else str(entry)
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"tokenizer_config.json: bad added_tokens_decoder entry {key!r}") from None
        if tid < first_id:
            raise CheckpointError(f"tokenizer_config.json: added token {content!r} has id {tid}, inside the "
                                  f"{first_id} BPE ranks")
        out.append((tid, content, bool(entry.get("special", True)) if isinstance(entry, dict) else True))
    return sorted(out)


def build_tokenizer(root: Path, config: dict[str, Any]):
    """A ``tokenizers.Tokenizer`` equal to the checkpoint's tiktoken tokenizer. Recovering the merges of a
    160K-token vocabulary takes seconds in Python, so the result is cached as a tokenizer.json under
    $ADAPT_CACHE/tokenizers, keyed by the sha256 of the tiktoken file, the pattern and the special tokens."""
    from tokenizers import Tokenizer

    path = find_tiktoken(root)
    if path is None:
        raise CheckpointError(f"{root} has no tiktoken file ({', '.join(TIKTOKEN_FILES)})")
    pattern = find_pattern(root)
    raw = path.read_bytes()
    key = hashlib.sha256(raw + b"\0" + pattern.encode() + b"\0" +
                         json.dumps(config.get("added_tokens_decoder") or {}, sort_keys=True).encode()).hexdigest()
    from adapt.runtime.init_model import cache_root

    cached = cache_root() / "tokenizers" / f"tiktoken-{key[:32]}.json"
    if cached.is_file():
        try:
            return Tokenizer.from_file(str(cached))
        except Exception:  # a damaged cache entry: rebuild it
            pass
    tok = _build(path, pattern, config)
    try:
        atomic_write(cached, tok.to_str())
    except AdaptError:  # a read-only cache only costs the rebuild next time
        pass
    return tok


def _build(path: Path, pattern: str, config: dict[str, Any]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = read_ranks(path)
    alpha = _byte_alphabet()

    def text(b: bytes) -> str:
        return "".join(alpha[x] for x in b)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {text(tok): rank for tok, rank in by_rank}
    merges = [tuple(text(p) for p in _split(tok, ranks, rank)) for tok, rank in by_rank if len(tok) > 1]
    try:
        bpe = models.BPE(vocab, merges, ignore_merges=True)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    except Exception as e:  # tokenizers raises a bare Exception on a pattern Oniguruma rejects
        raise CheckpointError(f"tiktoken tokenizer: {e}") from None
    tok.decoder = decoders.ByteLevel()
    n = len(ranks)
    specials = special_tokens(config, n)
    have = {tid: (content, special) for tid, content, special in specials}
    top = max(have, default=n - 1)
    added = []
    for tid in range(n, top + 1):  # one entry per id, placeholders in the gaps
        content, special = have.get(tid, (f"<|adapt_reserved_{tid}|>", True))
        added.append(AddedToken(content, special=special, normalized=False))
    tok.add_special_tokens(added)
    for tid, content, _ in specials:
        if tok.token_to_id(content) != tid:
            raise CheckpointError(f"tiktoken tokenizer: special token {content!r} should have id {tid}, "
                                  f"got {tok.token_to_id(content)}")
    return tok
