import pytest

from adapt.errors import RuntimeConfigError
from adapt.runtime.distributed.backends import BACKENDS, backend_for, resolve_backend


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("cuda", "nccl"), ("cuda:3", "nccl"), ("npu:0", "hccl"),
                                            ("musa", "mccl"), ("xpu", "xccl")])
def test_registry(device, backend):
    assert backend_for(device) == backend


def test_override_wins():
    assert backend_for("cuda", "gloo") == "gloo"
    assert backend_for("weird", "mybackend") == "mybackend"


def test_unknown_device_names_registry():
    with pytest.raises(RuntimeConfigError, match="BACKENDS.*--dist-backend"):
        backend_for("tpu:0")


def test_registry_is_extensible(monkeypatch):
    monkeypatch.setitem(BACKENDS, "tpu", "xla")
    assert resolve_backend("tpu") == "xla"


def test_missing_plugin_is_clear():
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu installed")
    except ImportError:
        pass
    with pytest.raises(RuntimeConfigError, match="torch_npu"):
        resolve_backend("npu")
