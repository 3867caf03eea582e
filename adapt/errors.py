"""One hierarchy for the errors a user can cause.

The CLI maps every ``AdaptError`` to a one-line message and a non-zero exit; a traceback is shown only
with ``ADAPT_DEBUG=1``. ``assert`` is kept for internal invariants.
"""

from __future__ import annotations


class AdaptError(Exception):
    """Base of every error a user can cause. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class ConfigError(AdaptError):
    """A model config is malformed, incomplete or inconsistent."""


class UnsupportedModelError(ConfigError):
    """The config's ``model_type`` is not one adapt knows."""


class ModelNotFoundError(AdaptError):
    """MODEL is neither a directory, a config file, a built-in name nor a reachable hub id."""


class HardwareError(AdaptError):
    """An unknown or malformed hardware / cluster description."""


class PlanError(AdaptError):
    """A parallel layout that does not divide the model, or a malformed plan file."""


class CheckpointError(AdaptError):
    """A checkpoint that is missing, malformed, unsafe or does not match the layout."""


class ShardError(AdaptError):
    """Sharding or verification of a sharded output failed."""


class RuntimeConfigError(AdaptError):
    """The runtime cannot run as asked (device, dtype, memory budget, arguments)."""


class DistributedError(AdaptError):
    """A rank failed, timed out or could not join."""


class ValidationInputError(AdaptError):
    """validate could not run: bad checklist, reference, golden directory or baseline (exit 2)."""

    exit_code = 2


class SignatureError(ValidationInputError):
    """A baseline whose signature is missing or does not verify (exit 2)."""


class ImageInputError(AdaptError):
    """An image a user passed cannot be used: unreadable, not an image, truncated, too large, too many.
    ``code`` names the case for an API error body (adapt serve's 400s)."""

    def __init__(self, message: str, code: str = "invalid_image"):
        super().__init__(message)
        self.code = code
