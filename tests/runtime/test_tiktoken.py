"""A tokenizer shipped as a tiktoken BPE file (Kimi-K2's layout: tiktoken.model, the pre-tokenizer pattern
in tokenization_*.py, special tokens in tokenizer_config.json), against tiktoken itself as the oracle."""

from __future__ import annotations

import base64
import collections
import json

import pytest

from adapt.errors import CheckpointError
from adapt.runtime.tokenizer import Tokenizer

# a Kimi-like pattern: Han runs, letters without Han (class intersection), case-insensitive contractions,
# digit triples, punctuation, newlines and spaces
PARTS = [r"[\p{Han}]+",
         r"[^\r\n\p{L}\p{N}]?[\p{L}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
         r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"]
CORPUS = ("The quick brown fox jumps over the lazy dog. It's 2026, and we'll ship 1,234 tokens!\n"
          "Day-0 bring-up of trillion-parameter models: 模型 推理 加速器 上线 模型推理。 "
          "print(\"hello world\") # code too\n\n  indented    spaces\tand tabs. DON'T STOP; I'M HERE.\n") * 3
TEXTS = ["", "hello world", "The quick brown fox, it's 2026!", "模型推理 on a new accelerator 加速器",
         "  leading and trailing  ", "line one\nline two\r\n\nthree", "numbers 1234567 and 3.14159",
         "emoji 🚀🔥 and accents: café naïve", "<|im_start|>user\nhi<|im_end|>", "DON'T you'll WE'VE"]
SPECIAL = {"[BOS]": 0, "[EOS]": 1, "<|im_start|>": 3, "<|im_end|>": 4}  # offsets past the BPE ranks; 2 is a gap


def _train(n_merges: int = 300) -> dict[bytes, int]:
    """A real byte-level BPE rank table trained on CORPUS (whitespace-split pieces)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(tuple(bytes([c]) for c in w.encode()) for w in CORPUS.replace("\n", " \n").split(" "))
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        new = collections.Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return ranks


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def kimi_like(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiktoken")
    ranks = _train()
    (d / "tiktoken.model").write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
    body = ",\n    ".join(f"r\"\"\"{p}\"\"\"" for p in PARTS)
    (d / "tokenization_fake.py").write_text(f'import tiktoken\n\nclass T:\n    pat_str = "|".join([\n    {body}\n])\n')
    n = len(ranks)
    cfg = {"added_tokens_decoder": {str(n + off): {"content": c, "special": True} for c, off in SPECIAL.items()},
           "bos_token": "[BOS]", "eos_token": "[EOS]",
           "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d, ranks


def test_encodes_as_tiktoken_does(kimi_like):
    tiktoken = pytest.importorskip("tiktoken")
    d, ranks = kimi_like
    n = len(ranks)
    enc = tiktoken.Encoding("kimi-like", pat_str="|".join(PARTS), mergeable_ranks=ranks,
                            special_tokens={c: n + off for c, off in SPECIAL.items()})
    tok = Tokenizer.from_dir(d)
    for text in TEXTS + [CORPUS]:
        assert tok.encode(text) == enc.encode(text, allowed_special="all"), text
        ids = enc.encode(text, allowed_special="all")
        assert tok.decode(ids, skip_special_tokens=False) == enc.decode(ids), text


def test_special_tokens_ids_and_chat(kimi_like):
    d, ranks = kimi_like
    n = len(ranks)
    tok = Tokenizer.from_dir(d)
    assert tok.bos_token_id == n and tok.eos_token_id == n + 1 and tok.token_to_id("<|im_end|>") == n + 4
    assert tok.vocab_size == n + 5  # the gap at n + 2 holds a reserved placeholder
    assert tok.encode("") == []  # no BOS added: tiktoken tokenizers add none
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == n + 3 and ids[-1] == n + 4
    assert tok.decode(ids) == "user\nhi"


def test_errors_are_clear(kimi_like, tmp_path):
    d, _ = kimi_like
    bad = tmp_path / "nopattern"
    bad.mkdir()
    (bad / "tiktoken.model").write_bytes((d / "tiktoken.model").read_bytes())
    with pytest.raises(CheckpointError, match="pat_str"):
        Tokenizer.from_dir(bad)
    (bad / "tokenization_x.py").write_text((d / "tokenization_fake.py").read_text())
    (bad / "tiktoken.model").write_bytes(b"not-base64!! x\n")
    with pytest.raises(CheckpointError, match="line 1"):
        Tokenizer.from_dir(bad)
    (bad / "tiktoken.model").write_bytes(base64.b64encode(b"a") + b" 0\n")
    with pytest.raises(CheckpointError, match="256 single bytes"):
        Tokenizer.from_dir(bad)
    empty = tmp_path / "none"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="tokenizer.json or tiktoken.model"):
        Tokenizer.from_dir(empty)


def test_run_and_shard_read_a_tiktoken_checkpoint(kimi_like, tmp_path):
    # a tiny K2 checkpoint whose tokenizer is the tiktoken one: adapt run encodes text with it, and an
    # adapt shard output carries the files it needs (tiktoken.model and the pattern's tokenization_*.py)
    from adapt.runtime.checkpoint import open_model
    from adapt.runtime.init_model import init_model
    from adapt.runtime.parallel import SINGLE
    from adapt.shard import shard

    d, _ = kimi_like
    ck = tmp_path / "k2"
    init_model("tiny-k2", ck)
    (ck / "tokenizer.json").unlink()
    for f in ("tiktoken.model", "tokenization_fake.py", "tokenizer_config.json"):
        (ck / f).write_bytes((d / f).read_bytes())
    opened = open_model(str(ck), SINGLE)
    assert opened.tokenizer is not None and opened.tokenizer.encode("hello world")
    out = tmp_path / "out"
    shard(ck, out, tp=1)
    assert (out / "tokenization_fake.py").is_file() and (out / "tiktoken.model").is_file()
    assert open_model(str(out), SINGLE).tokenizer.encode("hello") == opened.tokenizer.encode("hello")


def test_rebuilt_tokenizer_is_cached(kimi_like, _cache):
    d, _ = kimi_like
    first = Tokenizer.from_dir(d)
    (entry,) = (_cache / "tokenizers").glob("tiktoken-*.json")
    assert Tokenizer.from_dir(d).encode(CORPUS) == first.encode(CORPUS)
    entry.write_text("{damaged")
    assert Tokenizer.from_dir(d).encode(CORPUS) == first.encode(CORPUS)  # rebuilt, not an error
