import json

import pytest

from adapt.spec import ModelSpec
from tests.fixtures.configs import SHARED_CONFIGS

CONFIGS = SHARED_CONFIGS
CONFIG_NAMES = sorted(p.stem for p in CONFIGS.glob("*.json"))


def shared_spec(stem: str) -> ModelSpec:
    return ModelSpec.from_hf_config(json.loads((CONFIGS / f"{stem}.json").read_text()), name=stem)


@pytest.fixture(scope="session")
def spec_of():
    cache = {}

    def get(stem):
        if stem not in cache:
            cache[stem] = shared_spec(stem)
        return cache[stem]
    return get
