"""A small byte-level BPE tokenizer built from a fixed text, for adapt's built-in tiny models.

The merges are learned here by a plain BPE loop (most frequent pair, ties to the smallest pair), not by
the ``tokenizers`` trainer, so the result depends only on this file: the same bytes on every run.
Byte-level means any text encodes, with no unknown token.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from adapt.errors import RuntimeConfigError

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_tokenizer"]

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TEXT = """\
Hello! Hello, world. Hello there, how are you today? I am fine, thank you, and you?
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs into the woods.
Once upon a time there was a small model that wanted to speak. It read a few sentences and learned to
write words, then phrases, then whole lines of text. It was not wise, but it was quick and it was kind.
A language model predicts the next token from the tokens before it. Attention lets every token look at
the tokens that came earlier; the cache keeps their keys and values so that each new token costs little.
Mixture of experts models send each token to a few experts chosen by a router, and the experts that are
not chosen do no work for that token. Latent attention stores a small latent vector for every token and
rebuilds the keys and values from it when they are needed.
What is the capital of France? The capital of France is Paris. What is two plus two? Two plus two is four.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 100 128 256 512 1000 1024 2048 4096 2024 2025 3.14 0.5 -1
Please write a short poem about the sea. The sea is wide, the sea is deep, the sea is where the sailors
sleep. The waves come in, the waves go out, and that is what the sea is about.
Can you help me? Yes, I can help you. What do you need? I need a plan, a map and a little time.
Good morning, good afternoon, good evening and good night. See you soon, see you later, goodbye!
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
{"name": "adapt", "version": 1, "ok": true, "items": [1, 2, 3]}
The user asked a question and the assistant gave an answer. The system said to be helpful and honest.
Thinking step by step: first read the question, then find the facts, then write the answer clearly.
It is a truth that every test should be small, fast and deterministic, and that every error message should
say what went wrong and what to do about it. Measure twice, cut once.
In the morning the baker opens the shop, lights the oven and bakes bread, rolls and sweet cakes for the
people of the town. Children walk to school, workers ride their bicycles to the factory, and an old man
feeds the birds in the park. By noon the market is full of voices: farmers sell apples, pears, potatoes,
carrots, onions, cheese, eggs and honey, and everyone argues about the price of butter.
A computer has a processor, memory, storage and a network. Programs are written in languages such as
Python, C, Rust and Go. A compiler translates source code into machine instructions; an interpreter runs
the program directly. Tensors are arrays of numbers with a shape and a type, such as float32, bfloat16 or
int8, and a matrix multiplication combines two of them into a third.
History teaches us that great rivers shaped the first cities. Farmers learned to read the seasons,
merchants travelled along roads and across oceans, and writers recorded laws, stories, songs and letters.
Mountains, forests, deserts, islands, lakes and valleys: the geography of each country changed the
language, the food, the music and the customs of its people.
My favourite colours are red, orange, yellow, green, blue and purple. The weather was cold in January,
rainy in April, warm in July and windy in October. Monday, Tuesday, Wednesday, Thursday, Friday,
Saturday and Sunday make a week; twelve months make a year.
Question: why is the sky blue? Answer: sunlight is scattered by the air, and blue light scatters more
than red light, so the sky looks blue during the day and red or orange at sunset.
Bonjour, comment allez-vous? Hola, como estas? Guten Tag! Ciao! Ni hao.
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, \u00fcber.
"""


def _train_merges(words: Counter[str], budget: int) -> list[tuple[str, str]]:
    """Up to ``budget`` BPE merges over ``words`` (pre-tokenized, byte-level characters)."""
    splits = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < budget:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, freq in words.items():
            symbols = splits[w]
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent, ties to the smallest pair
        merges.append(best)
        a, b = best
        for w, symbols in splits.items():
            i, out = 0, []
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == a and symbols[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            splits[w] = out
    return merges


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> int:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` to ``out_dir``; returns the vocabulary size.

    The vocabulary holds the special tokens (ids 0-4: ``<s>``, ``</s>``, ``<pad>``, ``<|im_start|>``,
    ``<|im_end|>``), the 256 byte symbols, then learned merges up to ``vocab_size`` entries. It is exactly
    ``vocab_size`` unless the built-in text runs out of pairs to merge first (at 1,229 entries), in
    which case the smaller size is returned. ``encode`` adds ``<s>``; the chat template is ChatML.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise RuntimeConfigError(f"tiny tokenizer needs vocab_size >= {MIN_VOCAB_SIZE} (5 special + 256 bytes)")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = Counter(w for w, _ in byte_level.pre_tokenize_str(_TEXT))
    merges = _train_merges(words, vocab_size - MIN_VOCAB_SIZE)

    vocab: dict[str, int] = {}
    for token in [*SPECIAL_TOKENS, *alphabet, *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))  # a merge can rebuild an existing string: keep the first id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return len(vocab)
