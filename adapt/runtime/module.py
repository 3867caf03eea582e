"""Module: the base of the runtime's own layers, an nn.Module without nn.Module's per-call costs.

A decode step of a small model is bound by Python as much as by its kernels: the bench MoE (8 layers, int4
weights, int8 activations) makes ~70 module calls and ~250 reads of parameters and submodules a token. Two of
nn.Module's costs go:

- ``m(x)`` is ``type(m).forward(m, x)``: nn.Module.__call__'s hook dispatch is left out. The runtime registers no
  hooks on its layers (validate hooks transformers' modules), and asking for one on these raises, so a hook is
  never silently skipped; so does assigning an instance ``forward`` (another class does it: distributed/moe.py).
- ``freeze()`` (ModelRunner, once the weights are loaded and packed) copies each module's parameters, buffers and
  submodules into its instance ``__dict__``, where attribute lookup finds them before nn.Module.__getattr__.
  Assigning, deleting, registering and ``_apply`` (``.to()``, ``.float()``) keep the copies in step (a module
  put under a frozen one is frozen with it); code that writes
  ``_parameters`` itself does so before the freeze (the loaders) or calls ``thaw()`` first.

Bench MoE, batch 1, int4 g128 with int8 activations and lm_head, 2 threads (2-core Xeon, load < 1): 432 ->
509 tok/s, median of 7 runs; the bf16 model, bound by its weights, 189 -> 197.
"""

from __future__ import annotations

import torch.nn as nn

_STORES = ("_parameters", "_buffers", "_modules")


class Module(nn.Module):
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.__call__ = cls.forward

    def _no_hooks(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is a runtime layer, called without nn.Module's hooks "
                        "(adapt/runtime/module.py); record intermediates with ForwardBatch.capture")

    register_forward_hook = register_forward_pre_hook = _no_hooks
    register_full_backward_hook = register_full_backward_pre_hook = register_backward_hook = _no_hooks

    def freeze(self) -> "Module":
        """Copy every runtime module's parameters, buffers and submodules into its __dict__ (this one's and its
        descendants')."""
        for m in self.modules():
            if isinstance(m, Module):
                m._copy_in()
        return self

    def thaw(self) -> "Module":
        """Undo freeze() on this module and its descendants."""
        for m in self.modules():
            if isinstance(m, Module) and m.__dict__.pop("_frozen", False):
                for store in _STORES:
                    for k in getattr(m, store):
                        m.__dict__.pop(k, None)
        return self

    def _copy_in(self) -> None:
        d = self.__dict__
        for store in _STORES:
            d.update(d[store])
        d["_frozen"] = True

    def _sync(self, name: str) -> None:
        d = self.__dict__
        for store in _STORES:
            if name in d[store]:
                d[name] = v = d[store][name]
                if isinstance(v, Module) and not v.__dict__.get("_frozen", False):
                    v.freeze()  # a module put under a frozen one is frozen too
                return

    def __setattr__(self, name, value) -> None:
        if name == "forward":
            raise TypeError(f"{type(self).__name__}: a runtime layer runs its class's forward (adapt/runtime/module.py); "
                            "give it another class (as runtime/distributed/moe.py does) instead of an instance forward")
        frozen = self.__dict__.get("_frozen", False)
        if frozen and any(name in self.__dict__[s] for s in _STORES):
            self.__dict__.pop(name, None)  # let nn.Module see the registered name, as before the freeze
        super().__setattr__(name, value)
        if frozen:
            self._sync(name)

    def register_parameter(self, name, param) -> None:
        super().register_parameter(name, param)
        if self.__dict__.get("_frozen", False):
            self._sync(name)

    def register_buffer(self, name, tensor, persistent=True) -> None:
        super().register_buffer(name, tensor, persistent)
        if self.__dict__.get("_frozen", False):
            self._sync(name)

    def add_module(self, name, module) -> None:
        super().add_module(name, module)
        if self.__dict__.get("_frozen", False):
            self._sync(name)

    def __delattr__(self, name) -> None:
        if self.__dict__.get("_frozen", False) and any(name in self.__dict__[s] for s in _STORES):
            self.__dict__.pop(name, None)
        super().__delattr__(name)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.__dict__.get("_frozen", False):
            self._copy_in()
        return out
