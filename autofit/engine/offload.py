"""Optimizer-state offload: the update runs on the host, the device keeps parameters and gradients.

`Offloaded` stands in for the user's optimizer during offloaded plans. It shares the user's
`param_groups` (so a scheduler that changes the learning rate still reaches the update) and keeps
an optimizer of the same class over fp32 host copies of the parameters. Each step copies the
gradients to the host, runs the same update there, and copies the parameters back in place, so the
device never allocates for the update.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict

import torch

_HOST_ONLY_DEFAULTS = {"foreach": None, "fused": None, "capturable": False}


class Offloaded:
    def __init__(self, optimizer: torch.optim.Optimizer, device):
        self.optimizer = optimizer
        self.device = device
        with torch.no_grad(), device.host():
            self.pairs = [(p, p.detach().to("cpu", copy=True)) for g in optimizer.param_groups
                          for p in g["params"]]
            self.host = _host_copy(optimizer, {id(p): h for p, h in self.pairs})
            groups = [{k: g[k] for k in _HOST_ONLY_DEFAULTS if k in g} for g in self.host.param_groups]
            self.host.load_state_dict(_state_dict_copy(optimizer, lambda v: v.detach().to("cpu", copy=True)))
            _restore_group_options(self.host, groups)
        # The device copy of the state is now redundant: free it.
        optimizer.state.clear()
        self.clip = None  # clip(host params) before each update: gradient clipping on the host copy

    @property
    def param_groups(self):
        return self.optimizer.param_groups  # shared: GradScaler and schedulers act on these

    @property
    def state(self):
        return self.host.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("optimizer offload does not support closures; use a plain optimizer "
                             "or a ladder without offload_optimizer.")
        with torch.no_grad(), self.device.host():
            for group, host_group in zip(self.optimizer.param_groups, self.host.param_groups):
                for k, v in group.items():  # learning-rate schedules act on the user's groups
                    if k != "params" and k not in _HOST_ONLY_DEFAULTS:
                        host_group[k] = v
            for p, h in self.pairs:
                h.grad = None if p.grad is None else p.grad.detach().to("cpu", h.dtype, copy=True)
            if self.clip is not None:
                self.clip([h for _, h in self.pairs])
            self.host.step()
            for _, h in self.pairs:
                h.grad = None
            for group, host_group in zip(self.optimizer.param_groups, self.host.param_groups):
                for k, v in host_group.items():  # what the step wrote to its groups (step counters)
                    if k != "params" and k not in _HOST_ONLY_DEFAULTS:
                        group[k] = v
        with torch.no_grad():
            for p, h in self.pairs:
                p.copy_(h)

    def give_back(self) -> None:
        """Put the state back into the user's optimizer (on the device), e.g. at the end of a run."""
        options = [{k: g[k] for k in _HOST_ONLY_DEFAULTS if k in g} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(_state_dict_copy(self.host, self.device.to_device))
        for group, kept in zip(self.optimizer.param_groups, options):
            group.update(kept)
        self.host.state.clear()


def _host_copy(optimizer, host_params: dict):
    """An optimizer like the user's over the host parameters: the same class and every attribute
    (a subclass's own constructor arguments included) deep-copied, each device parameter mapped to
    its host copy, the state left out (it is loaded next) and the hooks shared, not copied."""
    host = type(optimizer).__new__(type(optimizer))
    memo = dict(host_params)
    for k, v in optimizer.__dict__.items():
        if k == "state":
            host.state = defaultdict(dict)
        elif k.endswith("_hooks"):
            host.__dict__[k] = copy.copy(v)
        else:
            host.__dict__[k] = copy.deepcopy(v, memo)
    for options in [host.defaults] + host.param_groups:
        options.update({k: v for k, v in _HOST_ONLY_DEFAULTS.items() if k in options})
    return host


def rebuild_problem(optimizer) -> str | None:
    """Why `Offloaded` cannot copy this optimizer over host copies, or None when it can: it must
    step without a closure and keep its defaults in a dict. (Its constructor is never called
    again: `_host_copy` keeps every attribute, a subclass's own arguments included.)"""
    cls = type(optimizer)
    name = cls.__name__
    try:
        step = inspect.signature(cls.step)
    except (TypeError, ValueError):
        return f"{name}.step cannot be read"
    closure = step.parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return f"{name}.step needs a closure"
    if not isinstance(getattr(optimizer, "defaults", None), dict):
        return f"{name} keeps no defaults to rebuild it from"
    return None


def _restore_group_options(optimizer, groups) -> None:
    # load_state_dict copies the saved groups' options; keep the host-only ones.
    for group, wanted in zip(optimizer.param_groups, groups):
        for k in _HOST_ONLY_DEFAULTS:
            if k in group:
                group[k] = wanted[k]


def _state_dict_copy(optimizer, move) -> dict:
    """The optimizer's state_dict with every state tensor but `step` passed through `move`.

    load_state_dict alone would share tensors that are already on the target device (always the
    case on the simulated GPU, whose host and device are both the CPU); `step` stays where
    load_state_dict's own policy puts it.
    """
    saved = optimizer.state_dict()
    saved["state"] = {i: {k: (move(v) if torch.is_tensor(v) and k != "step" else v)
                          for k, v in s.items()}
                      for i, s in saved["state"].items()}
    return saved
