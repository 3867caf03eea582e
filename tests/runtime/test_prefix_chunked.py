"""Prefix caching and chunked prefill: the block manager's reference counts and LRU, the scheduler's chunks
interleaved with decode steps, and greedy outputs identical with and without either (GQA and MLA)."""

from __future__ import annotations

import pytest
import torch

from adapt.runtime.cache.block_manager import BlockManager
from adapt.runtime.cache.prefix_cache import block_keys
from adapt.runtime.sampling import SamplingParams
from adapt.runtime.scheduler import Scheduler


def test_shared_blocks_are_refcounted_and_idle_ones_evicted_lru():
    bm = BlockManager(8, 4, prefix_caching=True)
    a = list(range(10))  # two full blocks and a partial one
    bm.allocate(1, len(a))
    bm.cache_blocks(1, a, len(a))
    assert bm.match_prefix(a) == bm.block_table(1)[:2]
    assert bm.match_prefix(a[:8]) == bm.block_table(1)[:1]  # the last token is always computed
    assert bm.match_prefix([99] + a[1:]) == []  # keys chain the whole prefix
    pre = bm.match_prefix(a + [50, 51])
    bm.allocate(2, 12, pre)
    assert bm.block_table(2)[:2] == bm.block_table(1)[:2] and bm.usage().used_blocks == 4
    bm.free(1)
    bm.free(2)
    assert bm.usage().used_blocks == 0 and bm.num_free_blocks == 8  # idle cached blocks count as free
    assert bm.match_prefix(a) != []  # ... and still hold the prefix
    bm.allocate(3, 8 * 4)  # every block: the idle cached ones are evicted
    assert bm.prefix_cache.num_idle == 0 and bm.match_prefix(a) == []
    with pytest.raises(Exception):
        BlockManager(8, 4, window=16, prefix_caching=True)


def test_block_keys_chain():
    k = block_keys(list(range(8)), 4)
    assert len(k) == 2 and block_keys(list(range(4, 8)), 4, 0, k[0]) == k[1:]



def test_chunked_prefill_alternates_with_decode():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_batched_tokens=8, chunked_prefill=True)
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    short = s.add([1, 2, 3], sp)
    b = s.schedule()
    assert b.kind == "prefill" and b.sampled == [0]
    s.postprocess([short], [7])
    s.add(list(range(1, 31)), sp)  # 30 tokens: four chunks of at most 8
    kinds, chunks = [], []
    while len(chunks) < 4:
        b = s.schedule()
        kinds.append(b.kind)
        if b.kind == "prefill":
            chunks.append((b.chunk_start(0), b.context_lens[0], b.sampled))
        s.postprocess([b.seqs[i] for i in b.sampled], [5] * len(b.sampled))
    assert chunks == [(0, 8, []), (8, 16, []), (16, 24, []), (24, 30, [0])]
    assert kinds == ["decode", "prefill"] * 4  # the short stream advances between chunks
    assert short.num_output_tokens == 5


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])  # GQA, and MLA with its latent cache
def test_greedy_identical_with_prefix_cache_and_chunks(kind, tmp_path):
    from adapt.runtime.engine import Engine
    from tests.fixtures.tiny import save_tiny

    _, name = save_tiny(kind, tmp_path / kind, max_position_embeddings=512)
    kw = dict(kv_cache_memory="8MiB", max_model_len=512, max_num_seqs=16)
    base = Engine.from_pretrained(name, **kw)
    g = torch.Generator().manual_seed(0)
    v = base.spec.vocab_size
    common = torch.randint(3, v, (70,), generator=g).tolist()
    prompts = [common + torch.randint(3, v, (k,), generator=g).tolist() for k in (5, 17, 1, 40)]
    prompts.append(torch.randint(3, v, (150,), generator=g).tolist())
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = [r.token_ids for r in base.generate(prompts, sp)]
    for pc, ch in ((False, True), (True, True)):
        e = Engine.from_pretrained(name, enable_prefix_caching=pc, enable_chunked_prefill=ch,
                                   max_num_batched_tokens=24, **kw)
        for _ in range(2):  # the second pass finds every prompt's blocks cached
            assert [r.token_ids for r in e.generate(prompts, sp)] == ref, (pc, ch)
        if pc:
            assert e.block_manager.prefix_cache.hits >= 64 * 4
        assert e.block_manager.usage().used_blocks == 0
