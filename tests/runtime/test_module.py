"""adapt.runtime.module.Module: calls go to forward, no hooks, and frozen attribute copies stay in step."""

import pytest
import torch
import torch.nn as nn

from adapt.runtime.module import Module


class Leaf(Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 2), requires_grad=False)
        self.register_buffer("scale", torch.full((2,), 2.0))
        self.plain = 3

    def forward(self, x):
        return x @ self.weight.T * self.scale + self.plain


class Inherits(Leaf):  # no forward of its own: calls its parent's
    pass


class Tree(Module):
    def __init__(self):
        super().__init__()
        self.a = Leaf()
        self.rest = nn.ModuleList([Leaf(), Inherits()])
        self.bias = None

    def forward(self, x):
        for m in (self.a, *self.rest):
            x = m(x)
        return x


def _same_as_registered(m: nn.Module) -> None:
    for store in ("_parameters", "_buffers", "_modules"):
        for k, v in getattr(m, store).items():
            assert m.__dict__.get(k, "missing") is v, (type(m).__name__, k)


def test_call_is_forward_and_hooks_refused():
    assert Leaf.__call__ is Leaf.forward and Inherits.__call__ is Leaf.forward
    t = Tree()
    x = torch.ones(1, 2)
    assert torch.equal(t(x), t.forward(x))
    for reg in (t.a.register_forward_hook, t.a.register_forward_pre_hook, t.register_full_backward_hook):
        with pytest.raises(TypeError, match="without nn.Module's hooks"):
            reg(lambda *a: None)
    with pytest.raises(TypeError, match="runs its class's forward"):
        t.a.forward = lambda x: x


def test_freeze_copies_and_keeps_in_step():
    t = Tree()
    x = torch.ones(1, 2)
    before = t(x)
    t.freeze()
    for m in t.modules():
        if isinstance(m, Module):
            _same_as_registered(m)
    assert torch.equal(t(x), before)

    new = nn.Parameter(torch.zeros(2, 2), requires_grad=False)
    t.a.weight = new  # assigning a registered name
    assert t.a.weight is new and dict(t.a.named_parameters())["weight"] is new
    t.a.scale = torch.ones(2)  # a buffer
    assert t.a.scale is t.a._buffers["scale"]
    replaced = Leaf()
    t.a = replaced  # a submodule
    assert t.a is replaced and t._modules["a"] is replaced
    t.a.register_buffer("extra", torch.zeros(1))
    t.a.add_module("child", Leaf())
    _same_as_registered(t.a)

    del t.a.weight
    with pytest.raises(AttributeError):
        t.a.weight  # noqa: B018
    t.a.weight = nn.Parameter(torch.eye(2), requires_grad=False)
    _same_as_registered(t.a)
    t.a.plain = 4  # a plain attribute, in __dict__ as ever
    t.bias = torch.ones(2)
    assert t.a.plain == 4 and torch.equal(t.bias, torch.ones(2))

    t.to(torch.float64)  # _apply makes new parameters and buffers
    for m in t.modules():
        if isinstance(m, Module):
            _same_as_registered(m)
    assert t.rest[0].weight.dtype == torch.float64 and t.rest[0].scale.dtype == torch.float64
    assert t.rest[0](torch.ones(1, 2, dtype=torch.float64)).dtype == torch.float64

    t.thaw()
    assert "weight" not in t.a.__dict__ and "_frozen" not in t.a.__dict__ and t.a.weight is t.a._parameters["weight"]
    t.a._parameters["weight"] = nn.Parameter(torch.full((2, 2), 5.0), requires_grad=False)  # a direct write, thawed
    assert float(t.a.weight[0, 0]) == 5.0
