"""Scheduler: admission, decode, preemption by recompute, stop rules, abort, driven by a fake engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from adapt.errors import RuntimeConfigError
from adapt.runtime.cache.block_manager import BlockManager
from adapt.runtime.sampling import SamplingParams
from adapt.runtime.scheduler import ScheduledBatch, Scheduler, SeqStatus, Sequence

VOCAB = 50
EOS = 0


def next_token(tokens: list[int]) -> int:
    """A deterministic stand-in for a model: the next token is a function of the whole history."""
    h = 7
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return 1 + h % (VOCAB - 1)  # never EOS


class FakeEngine:
    """Runs batches against a slot -> (seq_id, position, token) store and checks what attention would read."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv: dict[int, tuple[int, int, int]] = {}
        self.batches: list[ScheduledBatch] = []

    def step(self) -> list[Sequence]:
        batch = self.sched.schedule()
        assert batch is not None
        self.batches.append(batch)
        bs = self.sched.block_manager.block_size
        new = []
        for seq, slots, table, ctx in zip(batch.seqs, batch.slot_mappings, batch.block_tables, batch.context_lens):
            tokens = seq.token_ids
            first = 0 if batch.kind == "prefill" else len(tokens) - 1
            assert len(slots) == len(tokens) - first and ctx == len(tokens)
            for pos, slot in zip(range(first, len(tokens)), slots):
                self.kv[slot] = (seq.seq_id, pos, tokens[pos])
            # what paged attention reads through the block table must be exactly this sequence's tokens
            read = [self.kv[table[p // bs] * bs + p % bs] for p in range(ctx)]
            assert read == [(seq.seq_id, p, tokens[p]) for p in range(ctx)]
            new.append(next_token(tokens))
        return self.sched.postprocess(batch.seqs, new)

    def run(self) -> None:
        while self.sched.has_unfinished:
            self.step()


def char_detok(ids: list[int]) -> str:
    return "".join("" if i == EOS else chr(ord("a") + i % 26) for i in ids)


def test_prefill_then_decode_until_length() -> None:
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, eos_token_ids=[EOS])
    seq = sched.add([5, 6, 7, 8, 9], SamplingParams(max_tokens=6))
    eng = FakeEngine(sched)
    eng.run()
    assert [b.kind for b in eng.batches] == ["prefill"] + ["decode"] * 5
    assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "length"
    assert seq.num_output_tokens == 6 and seq.text is None  # no detokenizer
    assert bm.num_free_blocks == 16 and sched.schedule() is None


def test_admission_limits() -> None:
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=12, watermark=0.0)
    seqs = [sched.add([1] * 5, SamplingParams(max_tokens=4)) for _ in range(5)]
    batch = sched.schedule()
    assert batch is not None and batch.kind == "prefill"
    assert batch.seqs == seqs[:2] and batch.num_tokens == 10  # a third would exceed 12 batched tokens
    batch2 = sched.schedule()
    assert batch2 is not None and batch2.kind == "prefill" and batch2.seqs == [seqs[2]]  # max_num_seqs = 3
    assert sched.schedule().kind == "decode"  # type: ignore[union-attr]
    assert list(sched.waiting) == seqs[3:]


def test_watermark_holds_back_admission() -> None:
    bm = BlockManager(100, 1)
    sched = Scheduler(bm, watermark=0.05)  # keep 5 blocks free while others run
    a = sched.add([1] * 50, SamplingParams(max_tokens=2))
    b = sched.add([1] * 46, SamplingParams(max_tokens=2))
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [a] and list(sched.waiting) == [b]


def test_preemption_recomputes_and_matches_unpreempted_run() -> None:
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]

    def outputs(num_blocks: int) -> tuple[list[list[int]], list[int], list[ScheduledBatch]]:
        sched = Scheduler(BlockManager(num_blocks, 2), watermark=0.0)
        seqs = [sched.add(p, SamplingParams(max_tokens=9)) for p in prompts]
        eng = FakeEngine(sched)
        eng.run()
        assert sched.block_manager.num_free_blocks == num_blocks
        return [s.output_ids for s in seqs], [s.num_preemptions for s in seqs], eng.batches

    roomy, no_preempt, _ = outputs(64)
    tight, preempts, batches = outputs(7)
    assert sum(no_preempt) == 0 and sum(preempts) > 0
    assert tight == roomy  # recompute gives the same tokens
    assert all(len(o) == 9 for o in tight)
    first = next(b for b in batches if b.preempted)
    assert first.kind == "decode"
    # the newest running sequence is the one preempted, and it goes to the front of the queue
    assert first.preempted[0].seq_id == max(s.seq_id for s in first.seqs + first.preempted)
    # a recompute prefills prompt and generated tokens again (the fake engine checks every slot)
    recomputed = [
        (len(slots), seq.num_prompt_tokens)
        for b in batches
        if b.kind == "prefill"
        for seq, slots in zip(b.seqs, b.slot_mappings)
        if len(slots) > seq.num_prompt_tokens
    ]
    assert recomputed


def test_add_rejects_requests_larger_than_the_cache() -> None:
    sched = Scheduler(BlockManager(2, 4))
    with pytest.raises(RuntimeConfigError, match="KV cache holds 8"):
        sched.add([1] * 5, SamplingParams(max_tokens=5))
    sched.add([1] * 5, SamplingParams(max_tokens=4))  # caches at most 8 tokens


def test_stop_token_and_eos_rules() -> None:
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, eos_token_ids=[EOS], detokenize=char_detok)
    eos = sched.add([1, 2], SamplingParams(max_tokens=10))
    ignored = sched.add([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    custom = sched.add([1, 2], SamplingParams(max_tokens=10, stop_token_ids=(7,), ignore_eos=True))
    batch = sched.schedule()
    assert batch is not None
    done = sched.postprocess(batch.seqs, [EOS, EOS, 3])
    assert done == [eos] and eos.finish_reason == "stop" and eos.stop_reason == EOS and eos.text == ""
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [ignored, custom]
    assert sched.postprocess(batch.seqs, [4, 7]) == [custom]
    assert custom.text == "d" and custom.output_ids == [3, 7] and custom.stop_reason == 7
    batch = sched.schedule()
    assert sched.postprocess(batch.seqs, [EOS]) == [ignored]  # type: ignore[union-attr]
    assert ignored.finish_reason == "length" and ignored.output_ids == [EOS, 4, EOS]
    assert bm.num_free_blocks == 8 and not sched.has_unfinished


def run_scripted(stop: tuple[str, ...], script: list[int], max_tokens: int = 20) -> Sequence:
    sched = Scheduler(BlockManager(16, 4), detokenize=char_detok)
    seq = sched.add([1], SamplingParams(max_tokens=max_tokens, stop=stop))
    for tok in script:
        batch = sched.schedule()
        assert batch is not None
        if sched.postprocess(batch.seqs, [tok]):
            break
    return seq


def test_stop_strings_are_cut_like_openai() -> None:
    # tokens map to letters: 7 -> h, 4 -> e, 11 -> l, 14 -> o, 22 -> w
    seq = run_scripted(("lo",), [7, 4, 11, 14, 22, 14])
    assert seq.finish_reason == "stop" and seq.stop_reason == "lo"
    assert seq.text == "he" and seq.output_ids == [7, 4, 11, 14]  # stops as soon as "helo" holds it
    seq = run_scripted(("zz", "el"), [7, 4, 11, 14])
    assert seq.text == "h" and seq.stop_reason == "el"
    seq = run_scripted(("xyz",), [7, 4, 11], max_tokens=3)
    assert seq.finish_reason == "length" and seq.text == "hel"


def test_max_model_len_caps_length() -> None:
    sched = Scheduler(BlockManager(16, 4), max_model_len=6)
    seq = sched.add([1, 2, 3, 4], SamplingParams(max_tokens=100))
    FakeEngine(sched).run()
    assert seq.finish_reason == "length" and seq.num_tokens == 6
    with pytest.raises(RuntimeConfigError, match="max_model_len=6"):
        sched.add([1] * 7, SamplingParams())


def test_abort_and_add_errors() -> None:
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, detokenize=char_detok)
    running = sched.add([1, 2, 3], SamplingParams(max_tokens=5))
    sched.schedule()
    waiting = sched.add([1, 2], SamplingParams(max_tokens=5), seq_id=42)
    assert sched.abort(running.seq_id) is running and running.finish_reason == "abort"
    assert sched.abort(42) is waiting and waiting.status is SeqStatus.FINISHED
    assert sched.abort(42) is None and bm.num_free_blocks == 8 and not sched.has_unfinished
    assert sched.postprocess([running], [5]) == [] and running.output_ids == []  # aborted mid-step
    with pytest.raises(RuntimeConfigError, match="at least one token"):
        sched.add([], SamplingParams())
    sched.add([1], SamplingParams(), seq_id=3)
    with pytest.raises(RuntimeConfigError, match="already in use"):
        sched.add([1], SamplingParams(), seq_id=3)
    with pytest.raises(RuntimeConfigError, match="detokenizer"):
        Scheduler(bm).add([1], SamplingParams(stop=("x",)))


def test_many_requests_with_preemption_finish_and_free() -> None:
    sched = Scheduler(BlockManager(12, 4), max_num_seqs=6, watermark=0.0, eos_token_ids=[EOS])
    seqs = [sched.add([i + 1] * (1 + i % 5), SamplingParams(max_tokens=3 + i % 7)) for i in range(20)]
    eng = FakeEngine(sched)
    eng.run()
    assert all(s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == 12
    assert max(len(b.seqs) for b in eng.batches) <= 6


def test_no_torch_import() -> None:
    import adapt.runtime.scheduler as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.split(".")[0] == "torch" or m.endswith("sampling") for m in modules)


def test_scheduler_and_block_manager_load_without_torch() -> None:
    code = "import sys, adapt.runtime.scheduler, adapt.runtime.cache.block_manager; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "False"
