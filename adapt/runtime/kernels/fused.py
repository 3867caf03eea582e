"""The handle of the fused CPU kernels (csrc/cpu_kernels.cpp), which adapt.runtime.cpu_kernels builds for
the host and installs here; until then, or when they cannot be built, ``module()`` is None and every
kernel runs its torch form. A kernel calls the fused one only for tensors it takes (CPU, float32 or
bfloat16, the layouts it reads) and falls back to its torch form otherwise.
"""

_module = None
_off = 0  # depth of `disabled()` blocks


def module():
    """The installed extension module, or None (not built, not buildable, turned off, or disabled())."""
    return None if _off else _module


def installed():
    """The installed extension module even inside disabled() (layouts packed for it stay its layouts)."""
    return _module


def vectorized():
    """The installed module when its loops are vectorized (built with AVX-512 or AVX2 + FMA), else None.
    SiLU and RoPE use it only then: their scalar loops (an exp per element, bfloat16 rounding) are slower
    than torch's vectorized ops (2-core Xeon, a scalar build: SiLU-and-mul [16, 4096] float32 106 us
    against torch's 22; the AVX2 build 13, the AVX-512 one 11)."""
    mod = module()
    return mod if mod is not None and getattr(mod, "VECTOR", "none") in ("avx512", "avx2") else None


def install(mod) -> None:
    """Make ``mod`` (the built extension, or None to remove it) the fused kernels of this process."""
    global _module
    _module = mod


class disabled:
    """``with disabled():`` runs the torch form of every kernel (tests compare the two)."""

    def __enter__(self):
        global _off
        _off += 1
        return self

    def __exit__(self, *exc):
        global _off
        _off -= 1
        return False
