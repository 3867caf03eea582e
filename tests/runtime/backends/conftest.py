from pathlib import Path

import pytest

PLUGIN_DIR = Path(__file__).with_name("plugin")


@pytest.fixture
def acme(monkeypatch):
    """The example plugin installed (its dist-info on sys.path), the registry reloaded before and after."""
    from adapt.runtime.backends import plugins

    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    plugins(refresh=True)
    import acme_backend

    yield acme_backend
    monkeypatch.undo()
    plugins(refresh=True)
