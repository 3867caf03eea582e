"""Tokenizer: encode / decode / chat template against transformers on the same files, streaming, errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from adapt.errors import CheckpointError, RuntimeConfigError
from adapt.runtime.tiny_tokenizer import MIN_VOCAB_SIZE, build_tiny_tokenizer
from adapt.runtime.tokenizer import ChatTemplateError, Tokenizer

REPO = Path(__file__).resolve().parents[2]

SENTENCES = [
    "the cat sat on the mat",
    "the dog ate my homework",
    "a quick brown fox jumps over the lazy dog",
    "hello world, hello there",
    "tokenizers turn text into numbers and numbers into text",
]
TEXTS = [
    "hello world",
    "the lazy cat jumps",
    "  leading and trailing spaces  ",
    "unseen wörds: naïve café 日本語 🙂",
    "<s> literal special tokens </s> inside",
    "",
]

# A Llama-2-style template: BOS in the template, role checks with raise_exception, tojson for tools.
LLAMA_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + (sys + ' ' if loop.first and sys else '')"
    " + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if tools %}{{ '\n<tools>' + (tools | tojson) + '</tools>' }}{% endif %}"
)

CHATS = [
    [{"role": "user", "content": "hello there"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is a cat?"},
        {"role": "assistant", "content": "an animal"},
        {"role": "user", "content": "and a dog <tag> & \"quotes\"?"},
    ],
]


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece-like BPE (Metaspace, BOS post-processor) trained here on a few sentences."""
    tok = Backend(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    d = tmp_path_factory.mktemp("sp")
    tok.save(str(d / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "chat_template": LLAMA_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    assert build_tiny_tokenizer(d, 600) == 600
    return d


@pytest.mark.parametrize("which", ["sp_dir", "tiny_dir"])
def test_encode_decode_match_transformers(which: str, request: pytest.FixtureRequest) -> None:
    d: Path = request.getfixturevalue(which)
    ours = Tokenizer.from_dir(d)
    auto = AutoTokenizer.from_pretrained(str(d))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    assert ours.bos_token == auto.bos_token and ours.eos_token == auto.eos_token
    assert ours.bos_token_id == auto.bos_token_id and ours.eos_token_id == auto.eos_token_id
    assert ours.vocab_size == len(auto)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special), (text, special)
            assert ids == fast.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    assert ours.encode("hello")[0] == ours.bos_token_id


def test_word_level_clean_up_matches_transformers(tmp_path: Path) -> None:
    tok = Backend(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES + ["it's done , isn't it ? no !", "end ."], trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    for clean in (True, False):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": clean}))
        ours, auto = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
        for text in ["hello world, hello there.", "it's done, isn't it?", "the cat sat !"]:
            ids = ours.encode(text)
            assert ids == auto.encode(text), text
            for skip in (True, False):
                assert ours.decode(ids, skip) == auto.decode(ids, skip_special_tokens=skip), (clean, text)
        if clean:
            assert ours.decode(ours.encode("it's done , isn't it ?")) == "it's done, isn't it?"


def test_chat_template_matches_transformers(sp_dir: Path) -> None:
    ours = Tokenizer.from_dir(sp_dir)
    auto = AutoTokenizer.from_pretrained(str(sp_dir))
    tools = [{"type": "function", "function": {"name": "f", "description": "<é>"}}]
    for chat in CHATS:
        for gen in (True, False):
            want = auto.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == want
        want_ids = auto.apply_chat_template(chat, tokenize=True, return_dict=False)
        if isinstance(want_ids, dict) or hasattr(want_ids, "input_ids"):
            want_ids = want_ids["input_ids"]
        assert ours.encode_chat(chat) == list(want_ids)
    with_tools = auto.apply_chat_template(CHATS[0], tools=tools, tokenize=False)
    assert ours.apply_chat_template(CHATS[0], tools=tools) == with_tools
    assert '"<é>"' in with_tools  # plain json.dumps, no HTML escaping, no ASCII escaping


def test_tiny_chat_template_matches_transformers(tiny_dir: Path) -> None:
    ours, auto = Tokenizer.from_dir(tiny_dir), AutoTokenizer.from_pretrained(str(tiny_dir))
    chat = [{"role": "system", "content": "You are kind."}, {"role": "user", "content": "hello"}]
    text = ours.apply_chat_template(chat)
    assert text == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = ours.encode_chat(chat)
    assert ids[0] == ours.token_to_id("<|im_start|>") and ours.decode(ids, skip_special_tokens=False) == text


def test_raise_exception_and_sandbox(sp_dir: Path) -> None:
    ours = Tokenizer.from_dir(sp_dir)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours.apply_chat_template(bad)
    assert issubclass(ChatTemplateError, RuntimeConfigError)
    escape = Tokenizer(ours.backend, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        escape.apply_chat_template(CHATS[0])
    mutate = Tokenizer(ours.backend, chat_template="{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        mutate.apply_chat_template(CHATS[0])
    helpers = Tokenizer(
        ours.backend,
        chat_template="{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
        "{% endfor %}|{{ strftime_now('%Y') | length }}|{% generation %}g{% endgeneration %}|{{ extra }}",
    )
    assert helpers.apply_chat_template(CHATS[1], extra=7) == "be brief|4|g|7"


def test_template_sources(tmp_path: Path, sp_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((sp_dir / "tokenizer.json").read_bytes())
    no_template = Tokenizer.from_dir(tmp_path)
    assert no_template.bos_token is None and no_template.chat_template is None
    with pytest.raises(CheckpointError, match="no chat_template"):
        no_template.apply_chat_template(CHATS[0])
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named, "bos_token": "<s>"}))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CHATS[0]) == "D<s>"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CHATS[1]) == "J4"
    assert AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(CHATS[1], tokenize=False) == "J4"
    broken = Tokenizer(no_template.backend, chat_template="{% for %}")
    with pytest.raises(CheckpointError, match="does not parse"):
        broken.apply_chat_template(CHATS[0])


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        Tokenizer.from_dir(tmp_path)


def test_post_processor_alone_adds_bos_as_in_transformers(tmp_path: Path, sp_dir: Path) -> None:
    backend = Backend.from_file(str(sp_dir / "tokenizer.json"))
    backend.post_processor = None
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": True}))
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.config_add_bos_token is True and not ours.adds_bos_token
    assert ours.encode("hello") == AutoTokenizer.from_pretrained(str(tmp_path)).encode("hello")
    with_post = Tokenizer.from_dir(sp_dir)
    assert with_post.adds_bos_token and with_post.config_add_bos_token is True


@pytest.mark.parametrize("which", ["sp_dir", "tiny_dir"])
def test_incremental_decoder_streams_stable_text(which: str, request: pytest.FixtureRequest) -> None:
    tok = Tokenizer.from_dir(request.getfixturevalue(which))
    for text in ["hello world 🙂 and 日本語 the cat", "the dog ate", "é🙂"]:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]  # type: ignore[list-item]
        dec = tok.incremental_decoder()
        deltas = [dec.push(i) for i in ids]
        assert "".join(deltas) + dec.flush() == tok.decode(ids) == dec.text
        assert all("\ufffd" not in d for d in deltas)
    if which == "tiny_dir":  # byte-level: an emoji is four byte tokens, held back until complete
        emoji = tok.encode("🙂", add_special_tokens=False)
        assert len(emoji) > 1
        dec = tok.incremental_decoder()
        assert [dec.push(i) for i in emoji] == [""] * (len(emoji) - 1) + ["🙂"]
        dec = tok.incremental_decoder()
        dec.push(emoji[:-1])
        assert dec.flush() == tok.decode(emoji[:-1]) and "\ufffd" in dec.text


def test_tiny_tokenizer_is_deterministic_and_sized(tmp_path: Path, tiny_dir: Path) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "123", "RAYON_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    code = "import sys; from adapt.runtime.tiny_tokenizer import build_tiny_tokenizer as b; b(sys.argv[1], 600)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "other")], check=True, env=env)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        digest = [hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (tiny_dir, tmp_path / "other")]
        assert digest[0] == digest[1], name
    assert build_tiny_tokenizer(tmp_path / "min", MIN_VOCAB_SIZE) == MIN_VOCAB_SIZE
    most = build_tiny_tokenizer(tmp_path / "big", 50_000)
    assert 1000 < most < 50_000
    assert Tokenizer.from_dir(tmp_path / "big").vocab_size == most
    with pytest.raises(RuntimeConfigError, match="vocab_size >= 261"):
        build_tiny_tokenizer(tmp_path / "small", 100)
    tok = Tokenizer.from_dir(tiny_dir)
    assert [tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2, 3, 4]
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) < len(text) // 2 and tok.decode(ids) == text  # the merges were learned
