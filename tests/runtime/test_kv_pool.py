"""KV pool: spec arithmetic, budget sizing, layouts, int8 round trip, memory sources."""

from __future__ import annotations

import pytest
import torch

from adapt.errors import RuntimeConfigError
from adapt.runtime.cache import kv_pool
from adapt.runtime.cache.block_manager import BlockManager
from adapt.runtime.cache.kv_pool import (
    KVCacheSpec,
    KVPool,
    available_memory_bytes,
    kv_cache_budget,
    num_blocks_for_budget,
    quantize_int8,
)

HKV, D, DV = 4, 64, 48


def test_bytes_per_token_mha_bf16_vs_int8() -> None:
    bf16 = KVCacheSpec.mha(1, HKV, D, torch.bfloat16, v_head_dim=DV)
    int8 = KVCacheSpec.mha(1, HKV, D, torch.bfloat16, v_head_dim=DV, quant="int8")
    assert bf16.bytes_per_token() == (D + DV) * HKV * 2
    assert int8.bytes_per_token() == (D + DV) * HKV * 1 + 2 * HKV * 4
    assert 0.5 < int8.bytes_per_token() / bf16.bytes_per_token() < 0.55
    layers = KVCacheSpec.mha(7, HKV, D, torch.float32)
    assert layers.bytes_per_token() == 7 * 2 * D * HKV * 4 == 7 * layers.bytes_per_token_per_layer()


def test_bytes_per_token_mla() -> None:
    # DeepSeek-V3: kv_lora_rank 512, qk_rope_head_dim 64, 61 layers
    spec = KVCacheSpec.mla(61, 512, 64, torch.bfloat16)
    assert spec.latent_dim == 576 and spec.bytes_per_token() == 61 * 576 * 2
    assert KVCacheSpec.mla(1, 512, 64, torch.bfloat16, quant="int8").bytes_per_token() == 576 + 4


def test_spec_validation() -> None:
    with pytest.raises(RuntimeConfigError, match="kind"):
        KVCacheSpec(1, "gqa", torch.float16)  # type: ignore[arg-type]
    with pytest.raises(RuntimeConfigError, match="num_kv_heads"):
        KVCacheSpec(1, "mha", torch.float16, num_kv_heads=0, head_dim=8, v_head_dim=8)
    with pytest.raises(RuntimeConfigError, match="latent_dim"):
        KVCacheSpec(1, "mla", torch.float16)
    with pytest.raises(RuntimeConfigError, match="quant"):
        KVCacheSpec.mha(1, 1, 8, torch.float16, quant="fp8")  # type: ignore[arg-type]
    with pytest.raises(RuntimeConfigError, match="num_layers"):
        KVCacheSpec.mha(0, 1, 8, torch.float16)


def test_num_blocks_for_budget() -> None:
    spec = KVCacheSpec.mha(2, 2, 8, torch.float16)  # 2 * 2*8*2*2 = 128 bytes per token
    assert spec.bytes_per_token() == 128
    assert num_blocks_for_budget(spec, 16, 128 * 16 * 10 + 5) == 10
    with pytest.raises(RuntimeConfigError, match="holds no block"):
        num_blocks_for_budget(spec, 16, 100)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_mha_pool_layout_and_usage(quant: str | None) -> None:
    spec = KVCacheSpec.mha(3, HKV, D, torch.bfloat16, v_head_dim=DV, quant=quant)  # type: ignore[arg-type]
    budget = spec.bytes_per_token() * 8 * 5
    pool = KVPool.from_budget(spec, block_size=8, device="cpu", memory_bytes=budget)
    assert pool.num_blocks == 5 and pool.capacity_tokens == 40 and len(pool.layers) == 3
    layer = pool.layers[0]
    assert layer.k.shape == (5, 8, HKV, D) and layer.v is not None and layer.v.shape == (5, 8, HKV, DV)
    if quant:
        assert layer.k.dtype == torch.int8 and layer.k_scale is not None and layer.v_scale is not None
        assert layer.k_scale.shape == layer.v_scale.shape == (5, 8, HKV)
        assert layer.k_scale.dtype == torch.float32
    else:
        assert layer.k.dtype == torch.bfloat16 and layer.k_scale is None
    assert pool.total_bytes == budget  # bytes_per_token counts exactly what is allocated
    u = pool.usage(used_blocks=2)
    assert (u.used_blocks, u.used_tokens_capacity, u.used_bytes) == (2, 16, 2 * 8 * spec.bytes_per_token())
    assert KVPool.from_budget(spec, 8, "cpu", memory_bytes=budget, max_blocks=3).num_blocks == 3


@pytest.mark.parametrize("quant", [None, "int8"])
def test_mla_pool_layout(quant: str | None) -> None:
    spec = KVCacheSpec.mla(2, 32, 16, torch.float32, quant=quant)  # type: ignore[arg-type]
    pool = KVPool(spec, num_blocks=4, block_size=4, device="cpu")
    layer = pool.layers[1]
    assert layer.k.shape == (4, 4, 48) and layer.v is None and layer.v_scale is None
    assert (layer.k_scale is not None) == (quant == "int8")
    if layer.k_scale is not None:
        assert layer.k_scale.shape == (4, 4, 1)
    assert pool.total_bytes == spec.bytes_per_token() * 16


def test_write_read_round_trip_with_block_manager() -> None:
    torch.manual_seed(0)
    bm = BlockManager(6, 4)
    bm.allocate(0, 3)
    bm.allocate(1, 6)
    slots = torch.tensor(bm.slot_mapping(1, 0, 6))
    k, v = torch.randn(6, HKV, D), torch.randn(6, HKV, DV)
    exact = KVPool(KVCacheSpec.mha(1, HKV, D, torch.float32, v_head_dim=DV), 6, 4, "cpu")
    exact.write(0, slots, k, v)
    rk, rv = exact.read(0, slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert exact.layers[0].k[bm.block_table(0)[0]].abs().sum() == 0  # other sequences untouched

    q = KVPool(KVCacheSpec.mha(1, HKV, D, torch.float32, v_head_dim=DV, quant="int8"), 6, 4, "cpu")
    q.write(0, slots, k, v)
    qk, qv = q.read(0, slots)
    # symmetric int8 rounding error is at most half a step: amax / 127 / 2 per token and head
    assert ((qk - k).abs() <= k.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()
    assert ((qv - v).abs() <= v.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()

    mla = KVPool(KVCacheSpec.mla(1, 32, 16, torch.float32, quant="int8"), 6, 4, "cpu")
    latent = torch.randn(6, 48)
    mla.write(0, slots, latent)
    (back,) = mla.read(0, slots)
    assert back.shape == (6, 48)
    assert ((back - latent).abs() <= latent.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()
    with pytest.raises(RuntimeConfigError, match="k only"):
        mla.write(0, slots, latent, latent)
    with pytest.raises(RuntimeConfigError, match="k and v"):
        q.write(0, slots, k)


def test_quantize_int8_zero_rows() -> None:
    qz, sz = quantize_int8(torch.zeros(2, 3, 8))
    assert qz.dtype == torch.int8 and (qz == 0).all() and sz.shape == (2, 3) and (sz > 0).all()


def test_budget_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kv_cache_budget("cpu", memory_bytes=12345) == 12345
    with pytest.raises(RuntimeConfigError, match="must be > 0"):
        kv_cache_budget("cpu", memory_bytes=0)
    with pytest.raises(RuntimeConfigError, match="fraction"):
        kv_cache_budget("cpu", memory_fraction=1.5)
    with pytest.raises(RuntimeConfigError, match="--kv-cache-memory"):
        kv_cache_budget("meta")
    monkeypatch.setattr(kv_pool, "available_memory_bytes", lambda device: 1000)
    assert kv_cache_budget("cpu", memory_fraction=0.5) == 500
    assert kv_cache_budget("cpu") == 900


def test_available_memory_cpu_reads_meminfo() -> None:
    avail = available_memory_bytes("cpu")
    text = open("/proc/meminfo").read()
    kb = int(next(line for line in text.splitlines() if line.startswith("MemAvailable:")).split()[1])
    assert abs(avail - kb * 1024) < 2**30  # read moments apart


def test_available_memory_cuda_uses_mem_get_info(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (777, 1000))
    assert available_memory_bytes("cuda:0") == 777


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_from_free_memory() -> None:
    spec = KVCacheSpec.mla(2, 32, 16, torch.bfloat16, quant="int8")
    pool = KVPool.from_budget(spec, 16, "cuda", memory_fraction=0.5, max_blocks=8)
    assert pool.num_blocks == 8 and pool.layers[0].k.is_cuda
    slots = torch.arange(5, device="cuda")
    latent = torch.randn(5, 48, device="cuda")
    pool.write(0, slots, latent)
    (back,) = pool.read(0, slots, torch.float32)
    assert ((back - latent).abs() <= latent.abs().amax(-1, keepdim=True) / 254 + 1e-3).all()
