"""glibc malloc tuning for CPU inference (adapt/runtime/host_memory.py): applied once, switchable off."""

import os
import platform
import subprocess
import sys

import pytest

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
