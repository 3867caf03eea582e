"""Prefill attention memory grows linearly with the prompt: the tiled kernel never forms L x L scores.

Measured in a subprocess as the growth of peak RSS over one long prefill, after the model and KV pool
are allocated and a short warm-up ran. Bounds: the model's activations are ~10 KB per token here, so a
linear prefill grows by a few tens of MB per 8K tokens; full float32 scores would need
2 heads x L^2 x 4 bytes = 512 MB at 8K and 8 GB at 32K.
"""

import json
import subprocess
import sys

import pytest

from tests.fixtures.tiny import save_tiny

SCRIPT = r"""
import json, resource, sys
from adapt.runtime.engine import Engine
from adapt.runtime.sampling import SamplingParams
n = int(sys.argv[2])
eng = Engine.from_pretrained(sys.argv[1], kv_cache_memory=str(n * 600), max_num_batched_tokens=1 << 17)
eng.generate([[1, 2, 3] * 40], SamplingParams(temperature=0, max_tokens=2))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
eng.generate([[(7 * i) % 250 + 3 for i in range(n)]], SamplingParams(temperature=0, max_tokens=1))
print(json.dumps({"growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))
"""


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    _, d = save_tiny("llama", tmp_path_factory.mktemp("long"), num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, max_position_embeddings=40000, rope_scaling=None)
    return d


def _growth(path, n):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(n)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["growth_mb"]


def test_prefill_8k_memory_is_linear(long_model):
    assert _growth(long_model, 8192) < 150  # quadratic scores alone: 512 MB


@pytest.mark.slow
def test_prefill_32k_memory_is_linear(long_model):
    assert _growth(long_model, 32768) < 400  # quadratic scores alone: 8 GB
