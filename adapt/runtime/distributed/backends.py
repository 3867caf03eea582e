"""Device type -> torch.distributed backend.

The registry is a plain dict so a new accelerator is one line (or one ``--dist-backend`` flag)::

    cpu -> gloo   cuda -> nccl   npu -> hccl   musa -> mccl   xpu -> xccl

A vendor backend (hccl, mccl) is registered with torch.distributed when its torch plugin (torch_npu,
torch_musa) is imported; ``resolve_backend`` imports the plugin named in ``PLUGINS`` first.
"""

from __future__ import annotations

import importlib

from adapt.errors import RuntimeConfigError

BACKENDS: dict[str, str] = {
    "cpu": "gloo",
    "cuda": "nccl",
    "npu": "hccl",
    "musa": "mccl",
    "xpu": "xccl",
}

# torch plugins that register a device type and its collective backend when imported
PLUGINS: dict[str, str] = {"npu": "torch_npu", "musa": "torch_musa"}


def device_type(device: str) -> str:
    """'cuda:1' -> 'cuda'."""
    return str(device).split(":", 1)[0].strip().lower()


def backend_for(device: str, override: str | None = None) -> str:
    """The backend for a torch device string; ``override`` (the --dist-backend flag) wins.

    Raises RuntimeConfigError naming the registry when the device type is unknown."""
    if override:
        return override
    kind = device_type(device)
    try:
        return BACKENDS[kind]
    except KeyError:
        known = ", ".join(f"{k} -> {v}" for k, v in BACKENDS.items())
        raise RuntimeConfigError(
            f"no torch.distributed backend is registered for device type {kind!r} "
            f"(adapt.runtime.distributed.backends.BACKENDS: {known}); pass --dist-backend NAME "
            "or add the device to BACKENDS") from None


def resolve_backend(device: str, override: str | None = None) -> str:
    """backend_for, after importing the device's torch plugin when one is listed (torch_npu, torch_musa)."""
    name = backend_for(device, override)
    plugin = PLUGINS.get(device_type(device))
    if plugin:
        try:
            importlib.import_module(plugin)
        except ImportError as e:
            raise RuntimeConfigError(f"device {device!r} needs the torch plugin {plugin!r} for backend "
                                     f"{name!r}: {e}") from None
    return name
