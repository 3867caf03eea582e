"""glibc malloc tuning for CPU inference (adapt/runtime/host_memory.py): applied once, switchable off."""

import os
import platform
import subprocess
import sys

import pytest
import torch

PROBE = "from adapt.runtime.host_memory import tune_malloc; print(tune_malloc(), tune_malloc())"


def _probe(**env):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tuning_applies_once_on_glibc_and_can_be_switched_off():
    assert _probe() == ["True", "True"]  # the second call returns the first call's outcome
    assert _probe(ADAPT_MALLOC_TUNING="0") == ["False", "False"]


MALLINFO = """
import ctypes, sys
from adapt.runtime.host_memory import tune_malloc
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[1] == "1":
    tune_malloc()
a = libc.mallinfo2()
p = libc.malloc(16 << 20)  # a 16 MB temporary, as a forward pass makes many of
b = libc.mallinfo2()
libc.free(p)
c = libc.mallinfo2()
print(b.hblkhd - a.hblkhd, c.arena - a.arena)  # bytes mmap-ed for it, heap bytes still held after the free
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc"
                    or tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 33), reason="glibc >= 2.33")
def test_a_large_temporary_comes_from_the_heap_and_stays_there_after_free():
    res = {}
    for mode in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", MALLINFO, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        res[mode] = [int(v) for v in out.stdout.split()]
    assert res["0"][0] >= 16 << 20 and res["0"][1] == 0  # default glibc: mmap-ed, unmapped on free
    assert res["1"][0] == 0 and res["1"][1] >= 16 << 20  # tuned: from the heap, kept for the next allocation


# -- weights in transparent huge pages (empty_huge) -------------------------------------------------------

from adapt.runtime import host_memory  # noqa: E402


def _vma_flags(addr: int) -> set[str] | None:
    """The VmFlags of the mapping holding ``addr`` (Linux /proc/self/smaps), or None if none holds it."""
    inside, flags = False, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0] if line.strip() else ""
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                flags = set(line.split()[1:])
    return flags


needs_thp = pytest.mark.skipif(not host_memory.huge_pages_wanted(), reason="no transparent huge pages here")


@needs_thp
def test_a_large_tensor_starts_on_a_huge_page_advised_before_its_first_touch():
    t = host_memory.empty_huge((3, 1024, 1024), torch.float32)  # 12 MiB
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE == 0
    assert "hg" in _vma_flags(t.data_ptr())  # MADV_HUGEPAGE holds for its mapping
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * t.numel()
    u = host_memory.empty_huge((5, 1 << 20), torch.bfloat16)  # another dtype, its own mapping
    assert u.data_ptr() % host_memory.HUGE == 0 and u.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@needs_thp
def test_the_mapping_goes_with_the_tensor():
    t = host_memory.empty_huge((4 << 20,), torch.float32)
    addr = t.data_ptr()
    view = t[1:]  # a view keeps the mapping
    del t
    assert _vma_flags(addr) is not None
    del view
    flags = _vma_flags(addr)
    assert flags is None or "hg" not in flags  # unmapped (or the address reused by an unadvised mapping)


def test_small_tensors_and_the_switch_keep_plain_pages(monkeypatch):
    small = host_memory.empty_huge((1000, 100), torch.float32)  # 400 KB: plain torch.empty
    assert small.shape == (1000, 100)
    assert "hg" not in (_vma_flags(small.data_ptr()) or set())
    monkeypatch.setenv("ADAPT_HUGE_PAGES", "0")
    assert not host_memory.huge_pages_wanted()
    big = host_memory.empty_huge((4, 1 << 20), torch.float32)
    assert big.shape == (4, 1 << 20) and "hg" not in (_vma_flags(big.data_ptr()) or set())
    assert host_memory.huge_pages_status()["wanted"] is False


def test_thp_mode_reads_the_kernel_setting():
    assert host_memory.thp_mode() in ("always", "madvise", "never", "unavailable")
