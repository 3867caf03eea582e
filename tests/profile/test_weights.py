import pytest

from adapt.profile.weights import weight_summary
from adapt.spec import ModelSpec
from tests.fixtures.tiny import MULTIMODAL, TINY, tiny_config
from tests.profile.conftest import SHARED, shared


@pytest.mark.parametrize("name", SHARED)
def test_reduced_layout_equals_full_layout(name):
    spec, layout = shared(name)
    for dtype in (None, "float8_e4m3fn", "bfloat16"):
        fast = weight_summary(spec, dtype)
        assert fast.params == layout.params
        assert fast.weights_bytes == layout.weight_bytes(dtype)
        assert fast.mtp_bytes == layout.weight_bytes(dtype, include_mtp=True) - layout.weight_bytes(dtype)


@pytest.mark.parametrize("name", list(TINY) + list(MULTIMODAL))
def test_reduced_layout_tiny(name):
    from adapt.layout import WeightLayout

    spec = ModelSpec.from_hf_config(tiny_config(name))
    layout = WeightLayout.from_spec(spec)
    assert weight_summary(spec).params == layout.params
    assert weight_summary(spec, "int4").weights_bytes == layout.weight_bytes("int4")
