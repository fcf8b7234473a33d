"""Whole copies of a model's and an optimizer's state, the parts of a `replay.StartState` that keep
everything rather than what a replay of one global batch can change:
- `Tensors`: every parameter's and buffer's values (host copies, written back into the same
  tensors), the gradients present (the tensors themselves) and each submodule's train/eval mode;
- `OptimizerState`: the optimizer's state, each parameter's dict and its tensors' values, put back
  into the same objects (what a measurement's steps added goes);
- `StateDicts`: host copies of `state_dict()`s, loaded back with `load_state_dict` (a Trainer's run
  restarted from its start: the model, its optimizer and scheduler).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from autofit.engine import optimizer_state


def host_copy(obj):
    """A deep copy with every tensor copied to host memory (load_state_dict puts them back)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return copy.deepcopy(obj)


class Tensors:
    """A model's parameter and buffer values, its gradients and its modes."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def capture(self) -> None:
        model = self.model
        self.tensors = list({id(t): t for t in list(model.parameters()) + list(model.buffers())}.values())
        self.values = [t.detach().to("cpu", copy=True) for t in self.tensors]
        self.grads = [(p, p.grad) for p in model.parameters()]
        self.modes = [(m, m.training) for m in model.modules()]

    def restore(self) -> None:
        with torch.no_grad():
            for t, v in zip(self.tensors, self.values):
                t.copy_(v)
        for p, g in self.grads:
            p.grad = g
        for m, training in self.modes:
            m.training = training


class OptimizerState:
    """An optimizer's state (every optimizer it wraps, values at any depth), put back into the same
    dicts and tensors (what a measurement's steps added goes): `optimizer_state.Copy`."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def capture(self) -> None:
        self.copy = optimizer_state.Copy(self.optimizer)

    def restore(self) -> None:
        self.copy.restore()


class StateDicts:
    """Host copies of some objects' `state_dict()` (made inside `device.host()`), loaded back in order. `fresh`: the objects
    whose copy is copied again for each load (an optimizer's or a scheduler's load keeps what it
    is given); the others (a model's, which copies in place) load the copy itself."""

    def __init__(self, objects: list, fresh: list, device=None):
        self.objects, self.fresh = objects, [any(o is f for f in fresh) for o in objects]
        self.device = device  # its host(): where the copies are made

    def capture(self) -> None:
        with self.device.host() if self.device is not None else contextlib.nullcontext():
            self.saved = [host_copy(o.state_dict()) for o in self.objects]

    def restore(self) -> None:
        for obj, saved, fresh in zip(self.objects, self.saved, self.fresh):
            obj.load_state_dict(host_copy(saved) if fresh else saved)
