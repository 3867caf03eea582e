"""A worked example of a vendor backend plugin: "acme", for CPUs and a made-up "npu" device type, overriding
two ops (rms_norm and silu_and_mul) and leaving every other op to adapt's own kernels.

A vendor package registers its backend in its packaging metadata:

    [project.entry-points."adapt.backends"]
    acme = "acme_backend:backend"

The test registers it the same way: the ``acme_backend-0.1.dist-info`` directory beside this file is what
``pip install`` would write, and putting this directory on sys.path makes importlib.metadata find it.
"""

import torch

from adapt.runtime.backends import Backend, Impl

CALLS = {"rms_norm": 0, "silu_and_mul": 0}  # the tests check that the runtime ran these


def rms_norm(x, weight, eps=1e-6):
    CALLS["rms_norm"] += 1
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_and_mul(x):
    CALLS["silu_and_mul"] += 1
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def backend() -> Backend:
    return Backend("acme", {"rms_norm": Impl(rms_norm, form="acme vector unit"), "silu_and_mul": silu_and_mul},
                   devices=("cpu", "npu"), description="an example vendor backend (tests)")
