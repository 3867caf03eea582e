"""The check functions of every kind in checklists/day0.yaml; importing this package registers them."""

from adapt.validate.checks import end_to_end, image, layers, loading, operators, paths  # noqa: F401
from adapt.validate.checks import endpoint, service, weight_quant  # noqa: F401

__all__ = ["end_to_end", "image", "layers", "loading", "operators", "paths", "weight_quant"]
