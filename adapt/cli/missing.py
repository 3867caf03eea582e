"""The one line for a third-party package a command needs and this environment lacks.

Every import a base command reaches is a base dependency, and the optional ones are guarded where they are
imported; this is the net under both for an environment that drifted from adapt's metadata (a package removed
by hand, an editable install whose pyproject.toml changed since). The line names the package and the command
that installs it, read from the installed distribution's own requirements, so it never drifts from pyproject.toml.
"""

from __future__ import annotations

import re
from importlib import metadata

# import name -> distribution name where they differ
_DISTRIBUTIONS = {
    "yaml": "pyyaml",
    "PIL": "pillow",
    "huggingface_hub": "huggingface-hub",
    "prometheus_client": "prometheus-client",
    "compressed_tensors": "compressed-tensors",
    "lm_eval": "lm-eval",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> list[tuple[str, str | None]]:
    """(distribution, extra or None) for each requirement of the installed adapt."""
    try:
        requires = metadata.requires("adapt") or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for req in requires:
        name = _norm(re.split(r"[ <>=!~;\[(]", req, maxsplit=1)[0])
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        out.append((name, extra.group(1) if extra else None))
    return out


def missing_package_line(e: ModuleNotFoundError) -> str | None:
    """The error line for a missing third-party module, or None when the module is adapt's own (a bug)."""
    module = (e.name or "").split(".")[0]
    if not module or module == "adapt":
        return None
    dist = _DISTRIBUTIONS.get(module, _norm(module))
    extras = [extra for name, extra in _requirements() if name == dist]
    if None in extras:
        how = f"it is one of adapt's dependencies: reinstall adapt (`pip install -e .` in a checkout) or `pip install {dist}`"
    elif extras:
        how = f"install adapt's '{extras[0]}' extra: pip install 'adapt[{extras[0]}]' (or `pip install -e '.[{extras[0]}]'`)"
    else:
        how = f"install it: pip install {dist}"
    return f"this command needs the Python package '{dist}', which is not installed; {how}"
