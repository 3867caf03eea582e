import json

import pytest
from safetensors import safe_open

from adapt.layout import WeightLayout
from adapt.spec import ModelSpec
from tests.fixtures.tiny import MULTIMODAL, TINY, save_tiny


def _saved(out_dir):
    names = {}
    for f in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                names[k] = tuple(fh.get_slice(k).get_shape())
    return names


@pytest.mark.parametrize("name", list(TINY) + list(MULTIMODAL))
def test_layout_equals_save_pretrained(name, tmp_path):
    model, out = save_tiny(name, tmp_path / name)
    cfg = json.loads((out / "config.json").read_text())
    spec = ModelSpec.from_hf_config(cfg)
    layout = WeightLayout.from_spec(spec)
    expected = _saved(out)
    # transformers does not save DeepSeek-V3's MTP layer; hub checkpoints do, so the layout lists it apart
    got = {t.name: t.shape for t in layout if not t.mtp}
    assert set(got) - set(expected) == set(), "layout lists tensors the checkpoint lacks"
    assert set(expected) - set(got) == set(), "checkpoint holds tensors the layout lacks"
    assert got == expected
    # parameter count agrees with transformers (which keeps e_score_correction_bias as a buffer)
    n_buffers = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    n_params = sum(p.numel() for p in model.parameters())
    assert layout.params.total == n_params + n_buffers
