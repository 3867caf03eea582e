"""The fused CPU kernels' build (adapt/runtime/cpu_kernels.py): built where a compiler exists, cached,
switchable off, a failed build falls back to the torch kernels, and an engine gives the same tokens."""

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from adapt.runtime import cpu_kernels
from adapt.runtime.engine import Engine
from adapt.runtime.init_model import init_model
from adapt.runtime.kernels import fused
from adapt.runtime.sampling import SamplingParams

CAN_BUILD = (sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
             and shutil.which("c++") is not None and shutil.which("ninja") is not None)
TINY_SOURCE = """#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", []() { return 42; }); }
"""


@pytest.fixture
def uninstalled():
    """No fused module in this process for the test's duration (restored after)."""
    saved, status, failed = fused._module, cpu_kernels._status, cpu_kernels._failed
    fused.install(None)
    cpu_kernels._failed = False
    yield
    fused.install(saved)
    cpu_kernels._status, cpu_kernels._failed = status, failed


@pytest.mark.skipif(not CAN_BUILD, reason="needs Linux, a C++ compiler and ninja")
def test_builds_where_a_compiler_exists():
    # the kernel tests skip their fused half when this does not build; here that is a failure
    assert cpu_kernels.load() is not None, cpu_kernels.status()
    assert cpu_kernels.status().startswith("on (") and fused.module() is not None
    with fused.disabled():
        assert fused.module() is None
    assert fused.module() is not None


def test_switched_off_by_env(monkeypatch, uninstalled):
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    assert cpu_kernels.load() is None and fused.module() is None
    assert cpu_kernels.status() == "off (ADAPT_CPU_KERNELS=0)"


@pytest.mark.skipif(not CAN_BUILD, reason="needs Linux, a C++ compiler and ninja")
def test_failed_build_leaves_the_torch_kernels(tmp_path, monkeypatch, uninstalled):
    bad = tmp_path / "broken.cpp"
    bad.write_text("#error this source does not compile\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", bad)
    assert cpu_kernels.load(tmp_path / "build") is None and fused.module() is None
    assert cpu_kernels.status().startswith("unavailable (")
    # remembered: in this process, and for the next one (no second build attempt, no "building" note)
    assert cpu_kernels.load(tmp_path / "build") is None and not cpu_kernels.needs_build()
    assert list((tmp_path / "build").glob("*/*.failed"))
    cpu_kernels._failed = False
    assert cpu_kernels.load(tmp_path / "build") is None and "failed earlier" in cpu_kernels.status()
    x = torch.randn(3, 8)
    from adapt.runtime.kernels.norm import rms_norm
    assert torch.equal(rms_norm(x, torch.ones(8)), torch.nn.functional.rms_norm(x, (8,), eps=1e-6))


@pytest.mark.skipif(not CAN_BUILD, reason="needs Linux, a C++ compiler and ninja")
def test_cached_build_survives_a_stale_lock_and_is_reused(tmp_path, monkeypatch, uninstalled):
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY_SOURCE)
    monkeypatch.setattr(cpu_kernels, "SOURCE", src)
    root = tmp_path / "build"
    key = cpu_kernels._key()
    (root / key).mkdir(parents=True)
    (root / key / "lock").write_text("")  # torch's build baton, as a process killed mid-build leaves it
    mod = cpu_kernels.load(root)
    assert mod is not None and mod.answer() == 42
    lib = root / key / f"adapt_cpu_{key}.so"
    assert lib.is_file()
    # a new process imports the cached library without building (no compiler on PATH)
    probe = ("import sys; from pathlib import Path; from adapt.runtime import cpu_kernels as c; "
             f"c.SOURCE = Path({str(src)!r}); m = c.load(Path({str(root)!r})); print(m.answer(), c.status())")
    env = dict(os.environ, PATH="/nonexistent", CXX="/nonexistent/c++")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("42 on (") and str(lib) in out.stdout


@pytest.mark.skipif(not CAN_BUILD, reason="needs Linux, a C++ compiler and ninja")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_equal_with_and_without_fused_kernels(tmp_path_factory, dtype):
    path = init_model("tiny-llama", tmp_path_factory.mktemp("llama"))
    eng = Engine.from_pretrained(path, dtype=dtype, kv_cache_memory="16MiB", block_size=8)
    prompts = [[1] + [(11 * i + 5 * j) % 400 + 7 for j in range(2 + 9 * i)] for i in range(5)]
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [r.token_ids for r in eng.generate(prompts, p)]
    assert eng.last_stats["cpu_kernels"].startswith("on (")
    with fused.disabled():
        want = [r.token_ids for r in eng.generate(prompts, p)]
        logits_t = eng.prefill_logits(prompts[-1])
    logits_f = eng.prefill_logits(prompts[-1])
    if dtype == "float32":  # a few ulp apart: the same greedy tokens
        assert got == want
        assert (logits_f - logits_t).abs().max().item() < 1e-4
    else:  # bfloat16 rounding of differently summed attention and norms can flip a near-tie token
        assert torch.equal(logits_f.argmax(-1), logits_t.argmax(-1))
        assert torch.nn.functional.cosine_similarity(logits_f, logits_t, dim=-1).min().item() > 0.999


@pytest.mark.skipif(not CAN_BUILD, reason="needs Linux, a C++ compiler and ninja")
def test_fused_attention_refuses_tables_that_leave_the_cache():
    # the fused kernel reads cache rows in place: a bad block id or a length past the table is an error,
    # never an out-of-bounds read
    from adapt.runtime.kernels.paged_attention import paged_decode_attention

    assert cpu_kernels.load() is not None
    q, k = torch.randn(2, 4, 16), torch.randn(6, 4, 2, 16)
    tables = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)  # block 9 of 6
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_decode_attention(q, k, k, tables, torch.tensor([5, 6], dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        paged_decode_attention(q, k, k, tables[:, :1], torch.tensor([5, 3], dtype=torch.int32), 0.25)


def test_fused_kernels_step_aside_for_autograd():
    from adapt.runtime.kernels.activation import silu_and_mul
    from adapt.runtime.kernels.norm import rms_norm

    x = torch.randn(3, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    (rms_norm(x, w).sum() + silu_and_mul(x).sum()).backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.skipif(not CAN_BUILD, reason="needs Linux, a C++ compiler and ninja")
def test_fused_attention_ignores_released_blocks_before_the_window():
    # a sliding-window sequence's blocks before its window may be released (-1): they are never read
    from adapt.runtime.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref

    assert cpu_kernels.load() is not None
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 16, generator=g)
    k, v = torch.randn(6, 4, 2, 16, generator=g), torch.randn(6, 4, 2, 16, generator=g)
    tables = torch.tensor([[-1, -1, 4, 1]], dtype=torch.int32)
    lens = torch.tensor([15], dtype=torch.int32)
    got = paged_decode_attention(q, k, v, tables, lens, 0.25, window=6)
    want = paged_decode_attention_ref(q, k, v, tables.clamp(min=0), lens, 0.25, window=6)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.skipif(not CAN_BUILD, reason="needs Linux, a C++ compiler and ninja")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [20, 40, 100])  # the 16-lane bodies, their scalar tails, tails alone
def test_fused_elementwise_kernels_equal_their_torch_forms_at_odd_widths(dtype, width):
    # all round where the torch ops round: RoPE and the residual sum are bitwise in both dtypes; SiLU's exp
    # and RMSNorm's mean are within a few float32 ulp of torch's (bitwise after bfloat16 rounding here)
    from adapt.runtime.kernels.activation import silu_and_mul
    from adapt.runtime.kernels.norm import fused_add_rms_norm, rms_norm
    from adapt.runtime.kernels.rope import apply_rope

    assert cpu_kernels.load() is not None
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(7, 3 * width, generator=g) * 3).to(dtype)
    qk = x[:, : 2 * width].view(7, 2, width)  # a strided view, as the fused qkv projection gives
    cos, sin = (torch.randn(7, width, generator=g).to(dtype) for _ in range(2))
    r = torch.randn(7, 3 * width, generator=g).to(dtype)
    w = (torch.rand(3 * width, generator=g) + 0.5).to(dtype)
    fused_out = [apply_rope(qk, cos, sin), silu_and_mul(x[:, : 2 * width].contiguous()), rms_norm(x, w),
                 *fused_add_rms_norm(x, r, w)]
    with fused.disabled():
        torch_out = [apply_rope(qk, cos, sin), silu_and_mul(x[:, : 2 * width].contiguous()), rms_norm(x, w),
                     *fused_add_rms_norm(x, r, w)]
    for i, (a, b) in enumerate(zip(fused_out, torch_out)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if dtype == torch.bfloat16 or i in (0, 4):
            assert torch.equal(a, b), i
        else:
            assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item()), i


@pytest.mark.skipif(not CAN_BUILD, reason="needs Linux, a C++ compiler and ninja")
def test_concurrent_first_builds_and_a_truncated_library(tmp_path, monkeypatch, uninstalled):
    # the ranks of a first multi-rank run all load at once: one builds, the others wait and import it
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY_SOURCE + "// concurrent\n")  # its own key: a module name this process has not loaded
    root = tmp_path / "build"
    probe = ("from pathlib import Path; from adapt.runtime import cpu_kernels as c; "
             f"c.SOURCE = Path({str(src)!r}); m = c.load(Path({str(root)!r})); print(m.answer() if m else c.status())")
    procs = [subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-300:] for o in outs]
    assert [o[0].strip() for o in outs] == ["42"] * 3
    # a library cut short (a kill while linking) is rebuilt, not left to fail every later load
    monkeypatch.setattr(cpu_kernels, "SOURCE", src)
    lib = root / cpu_kernels._key() / f"adapt_cpu_{cpu_kernels._key()}.so"
    lib.write_bytes(lib.read_bytes()[:4096])
    mod = cpu_kernels.load(root)
    assert mod is not None and mod.answer() == 42, cpu_kernels.status()


def test_scalar_builds_leave_silu_and_rope_to_torch(uninstalled):
    # a build without AVX-512 runs scalar loops: SiLU (an exp per element) and RoPE stay with torch there
    from types import SimpleNamespace

    from adapt.runtime.kernels.activation import silu_and_mul
    from adapt.runtime.kernels.rope import apply_rope

    def boom(*a, **k):
        raise AssertionError("the scalar build's kernel was called")

    fused.install(SimpleNamespace(VECTOR="none", silu_and_mul=boom, rope_rotate_half=boom))
    x = torch.randn(3, 8)
    assert torch.equal(silu_and_mul(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    q, c = torch.randn(3, 2, 8), torch.randn(3, 8)
    with fused.disabled():
        want = apply_rope(q, c, c)
    assert torch.equal(apply_rope(q, c, c), want)


@pytest.mark.skipif(not CAN_BUILD, reason="needs Linux, a C++ compiler and ninja")
@pytest.mark.parametrize("V", [1, 7, 16, 33, 32000])
def test_fused_argmax_equals_torch_max_indices(V):
    # greedy sampling's argmax: the first maximal index, the first NaN's in a row holding one, -inf rows
    from adapt.runtime.sampling import _argmax

    assert cpu_kernels.load() is not None
    g = torch.Generator().manual_seed(V)
    x = torch.randn(9, V, generator=g)
    x[1] = float("-inf")
    x[2, V // 2] = float("nan")
    x[3, -1] = float("nan")
    x[3, V // 3] = float("nan")
    x[4] = x[4].round()  # ties: the lowest index wins
    x[5, 0] = float("nan")
    x[6] = 0.0
    x[6, V - 1] = -0.0
    x[7, -1] = float("inf")
    got = _argmax(x)
    with fused.disabled():
        want = _argmax(x)
    assert torch.equal(got, want) and torch.equal(want, x.argmax(-1))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        fused.module().argmax_rows(x.double())


@pytest.mark.slow
@pytest.mark.skipif(not CAN_BUILD or platform.machine() != "x86_64", reason="needs x86-64 Linux, a C++ compiler, ninja")
@pytest.mark.parametrize("isa,flags", [("avx2", "-mno-avx512f"), ("none", "-mno-avx512f -mno-avx2 -mno-fma"),
                                       ("avx512 avx512_bf16", "-mno-amx-tile -mno-amx-bf16")])
def test_kernels_on_lesser_x86_builds(tmp_path, isa, flags):
    # the AVX2 form and the scalar form of the fused kernels, built on this host, pass the kernel tests; so
    # does the AVX512-BF16 form of the tiled MoE kernel's bfloat16 GEMM (an AMX host built without AMX)
    if "bf16" in isa and "avx512_bf16" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX512-BF16")
    env = dict(os.environ, ADAPT_CPU_KERNELS_CFLAGS=flags, ADAPT_CPU_KERNELS_DIR=str(tmp_path / "build"))
    probe = ("from adapt.runtime import cpu_kernels as c; m = c.load(); "
             "print((m.VECTOR + (' ' + m.moe_tiled_bf16_gemm() if 'bf16' in " + repr(isa) + " else '')) "
             "if m else c.status())")
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, env=env)
    assert got.stdout.strip() == isa, got.stdout + got.stderr[-500:]
    here = os.path.dirname(__file__)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(here, "kernels"),
                          __file__, "-m", "not slow"], capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-2000:]
