"""params.total / params.active of every shared config against the published figures.

Rule for a published figure P: the count must lie within max(1% of P, half a unit of P's last published
digit) of P. "32B" is published to 1B, so 31.5B-32.5B passes; "12.9B" to 0.1B; "46.7B" to 0.1B. A
figure published as a rounded integer of billions cannot be held to 1% when the rounding itself is
larger (DeepSeek-V3 "37B" is 36.63B, 1.01% away). Qwen2.5-VL-3B's "3B" is only the model name, not a
published count: its checkpoint holds 3.75B weights (3.09B language model incl. the tied 0.31B
embedding, 0.67B vision tower and merger), so it is tested against the exact layout count.

Conventions for "activated", per publisher:
- Kimi-K2 (32B) and DeepSeek-V3 (37B) exclude the input embedding and include the output head:
  ``active_non_embedding`` (31.69B, 36.63B). ``active`` (every weight one token touches) is 32.86B /
  37.55B.
- Qwen3-235B-A22B (22B) includes embedding and head: ``active`` = 22.19B. Its "234B non-embedding"
  excludes both the embedding and the output head.
- Mixtral 8x7B (12.9B active) includes both: ``active`` = 12.88B.
- dense models: active == total.
"""

import pytest

from tests.profile.conftest import SHARED, shared

B = 10 ** 9


def close(count: int, published: float, unit: float) -> bool:
    return abs(count - published) <= max(0.01 * published, unit / 2)


# name: (total published, its unit, which active count, active published, its unit)
PUBLISHED = {
    "moonshotai__Kimi-K2-Instruct": (1000 * B, 1000 * B, "active_non_embedding", 32 * B, B),
    "deepseek-ai__DeepSeek-V3": (671 * B, B, "active_non_embedding", 37 * B, B),
    "Qwen__Qwen3-235B-A22B": (235 * B, B, "active", 22 * B, B),
    "meta-llama__Llama-3.1-405B": (405 * B, B, "active", 405 * B, B),
    "meta-llama__Llama-3.1-8B": (8 * B, B, "active", 8 * B, B),
    "mistralai__Mixtral-8x7B-v0.1": (46.7 * B, 0.1 * B, "active", 12.9 * B, 0.1 * B),
    "llava-hf__llava-1.5-7b-hf": (7 * B, B, "active", 7 * B, B),
}
EXACT_TOTAL = {"deepseek-ai__DeepSeek-V3": 671_026_419_200, "moonshotai__Kimi-K2-Instruct": 1_026_408_232_448,
               "Qwen__Qwen2.5-VL-3B-Instruct": 3_754_622_976}


@pytest.mark.parametrize("name", SHARED)
def test_params_against_published(name):
    _, layout = shared(name)
    p = layout.params.as_dict()
    p["active_non_embedding"] = p["active"] - p["embedding"]
    if name in EXACT_TOTAL:
        assert p["total"] == EXACT_TOTAL[name]
    if name in PUBLISHED:
        total, tu, which, active, au = PUBLISHED[name]
        assert close(p["total"], total, tu), p
        assert close(p[which], active, au), (which, p[which])
    assert p["active"] <= p["total"]


def test_conventions_spelled_out():
    kimi = shared("moonshotai__Kimi-K2-Instruct")[1].params
    ds = shared("deepseek-ai__DeepSeek-V3")[1].params
    qwen = shared("Qwen__Qwen3-235B-A22B")[1].params
    assert round((kimi.active - kimi.embedding) / B, 2) == 31.69
    assert round((ds.active - ds.embedding) / B, 2) == 36.63
    assert round(qwen.active / B, 2) == 22.19
    # Qwen3 "234B non-embedding" excludes the embedding and the (untied) output head
    assert close(qwen.total - qwen.embedding - qwen.lm_head, 234 * B, B)
    # the incl.-embedding active count of Kimi-K2 is not the published 32B convention
    assert not close(kimi.active, 32 * B, B)
    # DeepSeek-V3 files hold 685B: 671B main + the MTP module, counted apart
    assert close(ds.total + ds.mtp, 685 * B, B)


def test_qwen25_vl_exact_split():
    spec, layout = shared("Qwen__Qwen2.5-VL-3B-Instruct")
    p = layout.params
    assert spec.tie_word_embeddings and p.lm_head == 0
    assert p.total == 3_754_622_976 and p.vision == 668_684_288
    assert p.total - p.vision == 3_085_938_688  # the Qwen2.5-3B language model, tied embedding once


def test_llava_vision_is_listed():
    _, layout = shared("llava-hf__llava-1.5-7b-hf")
    p = layout.params
    # CLIP ViT-L/14-336 (303.5M) + 2-layer projector (21.0M)
    assert p.vision == 324_487_168
    assert close(p.total - p.vision, 6.74 * B, 0.01 * B)  # Vicuna-7B / Llama-2-7B
