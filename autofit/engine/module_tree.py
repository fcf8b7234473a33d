"""A model's modules, walked once and walked again only when the tree changes.

A start state is captured before every global batch; walking `model.modules()` for each of its
parts (buffers, untrained parameters, attributes, generators) at every step would cost every step
the same work for a tree that does not change while it trains. `ModuleTree` keeps the list of
modules (and their parameter and buffer slots) and walks again when torch registers a module
anywhere in the process (`register_module_module_registration_hook`: `setattr`, `add_module`,
`register_module`, `ModuleList.append`, `ModuleDict` writes); its parameter list is read again
when a parameter is registered (`register_parameter`, a Parameter assigned as an attribute), the
modules holding buffers when a buffer is. A module removed from the tree stays in the list until
the next walk, which only costs a capture of a module nothing uses. A module put into a container
without registering it (`ModuleList.insert` writes the container's slots directly) is seen at the
next registration anywhere.
"""

from __future__ import annotations

import functools
import itertools
import operator

import torch

from autofit import torch_internals as ti

_not_none = functools.partial(operator.is_not, None)
_registrations = [0]  # modules registered anywhere in this process, since the hook was installed
_hook = None


_parameter_registrations = [0]  # parameters registered (or replaced through setattr) anywhere


def _registered(module, name, submodule) -> None:
    _registrations[0] += 1


def _parameter_registered(module, name, param) -> None:
    _parameter_registrations[0] += 1


_buffer_registrations = [0]  # buffers registered (or replaced through setattr) anywhere


def _buffer_registered(module, name, buffer) -> None:
    _buffer_registrations[0] += 1


def _watch_registrations() -> None:
    """Count module and parameter registrations from now on (global hooks, once per process; they
    return None, so they change nothing they see)."""
    global _hook
    if _hook is None:
        hooks = torch.nn.modules.module
        _hook = (hooks.register_module_module_registration_hook(_registered),
                 hooks.register_module_parameter_registration_hook(_parameter_registered),
                 hooks.register_module_buffer_registration_hook(_buffer_registered))


def registrations() -> tuple[int, int]:
    """(modules, buffers) registered anywhere in this process so far: what is derived from a walk
    of a module is stale once this moved."""
    _watch_registrations()
    return _registrations[0], _buffer_registrations[0]


class ModuleTree:
    """`modules()`: the model's modules as `model.modules()` lists them, walked again only after a
    module was registered somewhere; `walks` counts the walks."""

    def __init__(self, model: torch.nn.Module):
        _watch_registrations()
        self.model = model
        self.walks = 0
        self._modules: list = []
        self._seen = None  # the registration count at the last walk
        self._slots = None
        self._parameters = None  # ((walk, parameter registrations), the parameters then)
        self._reads = 0
        self._buffer_slots = None  # ((walk, buffer registrations), modules holding a buffer then)

    def modules(self) -> list:
        if self._seen != _registrations[0]:
            self._seen = _registrations[0]
            self._modules = list(self.model.modules())
            self._slots = None
            self.walks += 1
        return self._modules

    def slots(self) -> list[tuple]:
        """(module, its own parameter slots, its own buffer slots) for every module: the dicts
        themselves, so a parameter or buffer registered or replaced since is read where it is."""
        modules = self.modules()
        if self._slots is None:
            self._slots = [(m, ti.own_parameters(m), ti.own_buffers(m)) for m in modules]
        return self._slots

    def buffer_slots(self) -> list[tuple]:
        """(module, its own buffer slots) for the modules that hold a buffer, found again after a
        module or a buffer was registered anywhere (`register_buffer`, a buffer assigned)."""
        key = (self.version, _buffer_registrations[0])
        if self._buffer_slots is None or self._buffer_slots[0] != key:
            self._buffer_slots = (key, [(m, own) for m, _params, own in self.slots() if own])
        return self._buffer_slots[1]

    def parameters(self) -> list:
        """Every parameter in the tree's slots (a parameter shared by two modules twice), read from
        the slots again after a module or a parameter was registered anywhere (`register_parameter`,
        a Parameter assigned as an attribute); the same list object until then."""
        key = (self.version, _parameter_registrations[0])
        if self._parameters is None or self._parameters[0] != key:
            dicts = map(operator.itemgetter(1), self.slots())
            found = list(filter(_not_none, itertools.chain.from_iterable(map(dict.values, dicts))))
            self._parameters = (key, found)
            self._reads += 1
        return self._parameters[1]

    @property
    def parameters_read(self) -> int:
        """How many times `parameters()` read the slots: what is derived from its list is stale
        when this moved."""
        self.parameters()
        return self._reads

    @property
    def version(self) -> int:
        """The number of the current walk: what a part caches from the tree is stale when it moved."""
        self.modules()
        return self.walks
