"""GQA layers run q / k norm, rope and the cache write as one fused call (GQAAttention._joined) where the
cpu forms of those ops are the layer's kernels: the logits of every step equal the unjoined path's."""

import pytest
import torch

from adapt.runtime import cpu_kernels
from adapt.runtime.engine import Engine
from adapt.runtime.kernels import fused
from adapt.runtime.model_runner import ModelRunner
from adapt.runtime.models.attention import GQAAttention
from adapt.runtime.sampling import SamplingParams


def _run(path, dtype, monkeypatch, joined: bool):
    seen, calls = [], [0]
    execute, pick = ModelRunner.execute, GQAAttention._joined

    def record(self, *a, **kw):
        out = execute(self, *a, **kw)
        seen.append(out.clone())
        return out

    def count(self, *a, **kw):
        ext = pick(self, *a, **kw) if joined else None
        calls[0] += ext is not None
        return ext

    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "execute", record)
        m.setattr(GQAAttention, "_joined", count)
        eng = Engine.from_pretrained(path, dtype=dtype, kv_cache_memory="8MiB")
        eng.generate([[1, 5, 9, 33, 7], [2, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return seen, calls[0]


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_joined_path_equals_unjoined_bitwise(tiny_dir, monkeypatch, name, dtype):
    if cpu_kernels.load() is None or fused.vectorized() is None:
        pytest.skip(f"vectorized fused CPU kernels {cpu_kernels.status()}")
    _, path = tiny_dir(name)
    a, n_joined = _run(path, dtype, monkeypatch, True)
    b, n_plain = _run(path, dtype, monkeypatch, False)
    assert n_joined > 0 and n_plain == 0  # the fused path ran, and the other did not
    assert len(a) == len(b) and len(a) > 1
    for x, y in zip(a, b):
        assert torch.equal(x, y)
