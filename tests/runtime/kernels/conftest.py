import pytest

from adapt.runtime import cpu_kernels
from adapt.runtime.kernels import fused


@pytest.fixture(params=["torch", "fused"])
def kernel_form(request):
    """Run a test with the kernels' torch form, then with the fused CPU kernels (cpu_kernels.py)."""
    if request.param == "torch":
        with fused.disabled():
            yield "torch"
        return
    if cpu_kernels.load() is None:  # test_cpu_kernels.py fails where a compiler exists and this does not build
        pytest.skip(f"fused CPU kernels {cpu_kernels.status()}")
    yield "fused"
