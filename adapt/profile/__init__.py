"""adapt.profile: FLOPs and bytes per module and phase, the roofline, and the memory footprint.

Entry points: :func:`profile_model` (returns a :class:`Profile`; ``.to_dict()`` is the JSON contract),
:func:`kv_bytes_per_token`, :func:`kv_bytes_by_context`, :func:`activation_peak_bytes`,
:func:`expected_experts`.
"""

from adapt.profile.memory import (KV_CONTEXTS, activation_peak_bytes, kv_bytes, kv_bytes_by_context,
                                  kv_bytes_per_token, kv_bytes_per_token_per_layer)
from adapt.profile.mlp import expected_experts
from adapt.profile.model import PHASES, Profile, phase_rows, profile_model
from adapt.profile.rows import OPS, ModuleRow

__all__ = ["profile_model", "Profile", "ModuleRow", "phase_rows", "kv_bytes_per_token", "kv_bytes_per_token_per_layer",
           "kv_bytes", "kv_bytes_by_context", "activation_peak_bytes", "expected_experts", "KV_CONTEXTS", "PHASES",
           "OPS"]
