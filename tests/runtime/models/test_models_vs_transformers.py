"""adapt's own models against transformers on tiny random checkpoints of every text family (float32).

Acceptance (issue 5): greedy generation of 32 tokens from several prompts equals transformers'
generate(do_sample=False) token for token, and prefill logits differ by at most 1e-4.
"""

import copy

import pytest
import torch

from adapt.runtime.engine import Engine
from adapt.runtime.sampling import SamplingParams
from tests.fixtures.tiny import TINY
from tests.runtime.models.conftest import VARIANTS

FAMILIES = list(TINY) + list(VARIANTS)
PROMPTS = [[1, 5, 9], [1, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110], [7], [1, 200, 3, 4, 5]]


def _hf_greedy(hf, prompt, n):
    # the EOS id set to one the model cannot emit, so that EOS is an ordinary token as under ignore_eos:
    # min_new_tokens would instead ban EOS, and greedy picks another token where EOS is the argmax
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id = hf.config.vocab_size
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=gc, max_new_tokens=n, do_sample=False)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_matches_transformers(tiny_dir, name):
    hf, path = tiny_dir(name)
    eng = Engine.from_pretrained(path, kv_cache_memory="8MiB")
    ids = [1, 5, 9, 33, 7, 100, 3, 64, 17, 250]
    logits = eng.prefill_logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() <= 1e-4
    res = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for p, r in zip(PROMPTS, res):
        assert r.token_ids == _hf_greedy(hf, p, 32), f"{name}: prompt {p}"
    assert eng.block_manager.usage().used_blocks == 0  # every block returned on completion


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "deepseek_v3"])
def test_hidden_states_match_transformers(tiny_dir, name):
    hf, path = tiny_dir(name)
    eng = Engine.from_pretrained(path, kv_cache_memory="8MiB")
    ids = [1, 5, 9, 33, 7, 100]
    out = eng.prefill(ids, return_hidden_states=True)
    attn = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, o, i=i: attn.__setitem__(i, o[0]))
             for i, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    for h in hooks:
        h.remove()
    hs = out.hidden_states
    assert torch.allclose(hs["embed"], ref.hidden_states[0][0], atol=1e-6)
    n = len(hf.model.layers)
    for i in range(n - 1):
        assert (hs[f"layers.{i}"] - ref.hidden_states[i + 1][0]).abs().max() < 1e-5
    assert (hs["norm"] - ref.hidden_states[n][0]).abs().max() < 1e-5
    for i in range(n):
        assert (hs[f"layers.{i}.attn"] - attn[i][0]).abs().max() < 1e-5
        for key in ("input_norm", "post_attn_norm", "mlp"):
            assert hs[f"layers.{i}.{key}"].shape == (len(ids), hf.config.hidden_size)


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_reference_kernels_agree(tiny_dir, name):
    _, path = tiny_dir(name)
    a = Engine.from_pretrained(path, kv_cache_memory="8MiB")
    b = Engine.from_pretrained(path, kernels="reference", kv_cache_memory="8MiB")
    ids = [1, 5, 9, 33, 7]
    assert (a.prefill_logits(ids) - b.prefill_logits(ids)).abs().max() < 1e-5
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in a.generate([ids, ids[:2]], p)] == [r.token_ids for r in b.generate([ids, ids[:2]], p)]


def test_sliding_window_model_returns_blocks_and_still_matches(tiny_dir):
    # every layer windowed (W = 5): with 4-token blocks each sequence holds at most 3 blocks however long
    # it grows, and the tokens still equal transformers'
    hf, path = tiny_dir("mistral_window5")
    eng = Engine.from_pretrained(path, kv_cache_memory="8MiB", block_size=4)
    assert eng.block_manager.window == 5
    res = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for p, r in zip(PROMPTS, res):
        assert r.token_ids == _hf_greedy(hf, p, 32), f"prompt {p}"
    # peak: the prefill holds whole prompts (11 tokens: 3 blocks), decode at most 3 blocks per sequence
    assert eng.last_stats["kv_cache"]["blocks_peak_used"] <= 3 * len(PROMPTS)
    assert eng.block_manager.usage().used_blocks == 0
    full = Engine.from_pretrained(tiny_dir("mistral")[1], kv_cache_memory="8MiB", block_size=4)
    assert full.block_manager.window is None


def test_sliding_window_preemption_keeps_tokens(tiny_dir):
    # a pool too small for every sequence at once: preempted sequences (tables with released -1 entries)
    # are freed and recomputed, and the tokens do not change
    _, path = tiny_dir("mistral_window5")
    full = Engine.from_pretrained(path, kv_cache_memory="8MiB", block_size=4)
    per_block = full.pool.bytes_per_token * 4
    # each request alone fits (a preempted one is recomputed with one prefill of all its tokens: 9 blocks)
    small = Engine.from_pretrained(path, kv_cache_memory=str(per_block * 9), block_size=4)
    prompts = [[1, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110], [1, 200, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5],
               [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [r.token_ids for r in small.generate(prompts, p)] == [r.token_ids for r in full.generate(prompts, p)]
    assert small.last_stats["preemptions"] > 0 and small.block_manager.usage().used_blocks == 0


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_softmax_routers_run_fused(tiny_dir, name):
    # the softmax routers take the fused router kernel where it runs here (float32 here: router_panel), the
    # DeepSeek ones keep theirs; both forms give the same logits (and test_matches_transformers holds with it)
    from adapt.runtime import cpu_kernels
    from adapt.runtime.kernels.moe_routing import router_panel
    from adapt.runtime.backends.cpu_layouts import routers_form
    from adapt.runtime.models.moe import MoE

    _, path = tiny_dir(name)
    eng = Engine.from_pretrained(path, kv_cache_memory="8MiB")
    blocks = [m for m in eng.model.modules() if isinstance(m, MoE)]
    assert blocks
    fused = cpu_kernels.load() is not None and router_panel(blocks[0].moe.num_experts, torch.float32) > 0
    for b in blocks:
        assert (b.prepared_router is not None) == (fused and not b.deepseek)
    assert routers_form(eng.model) == ("fused" if fused and not blocks[0].deepseek else "torch")
    ids = [1, 5, 9, 33, 7, 100, 3]
    a = eng.prefill_logits(ids)
    for b in blocks:
        b.prepared_router = None
    assert routers_form(eng.model) == "torch"
    assert (a - eng.prefill_logits(ids)).abs().max().item() < 1e-5
