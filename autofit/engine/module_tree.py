"""A model's modules, walked once and walked again only when the tree changes.

A start state is captured before every global batch; walking `model.modules()` for each of its
parts (buffers, untrained parameters, attributes, generators) costs hundreds of microseconds per
step on a transformer, every step, for a tree that does not change while it trains. `ModuleTree`
keeps the list of modules and walks again when torch registers a module anywhere in the process
(`register_module_module_registration_hook`: `setattr`, `add_module`, `register_module`,
`ModuleList.append`, `ModuleDict` writes). A module removed from the tree stays in the list until
the next walk, which only costs a capture of a module nothing uses. A module put into a container
without registering it (`ModuleList.insert` writes the container's slots directly) is seen at the
next walk: `refresh()` forces one.
"""

from __future__ import annotations

import torch

_registrations = [0]  # modules registered anywhere in this process, since the hook was installed
_hook = None


def _registered(module, name, submodule) -> None:
    _registrations[0] += 1


def _watch_registrations() -> None:
    """Count module registrations from now on (one global hook per process; it returns None, so
    it changes nothing it sees)."""
    global _hook
    if _hook is None:
        _hook = torch.nn.modules.module.register_module_module_registration_hook(_registered)


class ModuleTree:
    """`modules()`: the model's modules as `model.modules()` lists them, walked again only after a
    module was registered somewhere (or after `refresh()`); `walks` counts the walks."""

    def __init__(self, model: torch.nn.Module):
        _watch_registrations()
        self.model = model
        self.walks = 0
        self._modules: list = []
        self._seen = None  # the registration count at the last walk

    def modules(self) -> list:
        if self._seen != _registrations[0]:
            self._seen = _registrations[0]
            self._modules = list(self.model.modules())
            self.walks += 1
        return self._modules

    @property
    def version(self) -> int:
        """The number of the current walk: what a part caches from the tree is stale when it moved."""
        self.modules()
        return self.walks

    def refresh(self) -> None:
        self._seen = None
