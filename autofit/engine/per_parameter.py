"""The per-parameter step: the optimizer's `foreach` off, so its update allocates one parameter's
temporaries at a time instead of a list's (foreach AdamW's `_foreach_sqrt` makes a copy of every
moment at once).

Each param_group's own `foreach` is recorded the first time the switch sees the group (a group the
user adds with `add_param_group` mid-run is recorded when the next step's switch runs, before it is
changed) and put back when the switch goes off. While it is on, `optimizer.state_dict()` reports the
user's values, not the forced ones, and `load_state_dict` takes the loaded values as the user's:
a checkpoint saved under this plan resumes as the user's optimizer.
"""

from __future__ import annotations


class ForeachOff:
    """`on()` turns `foreach` off in every group (each time: an attempt's restore may have put the
    groups back); `off()` gives each group its own value again."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.own: dict | None = None  # id(group) -> (group, its own foreach); None: the switch is off
        self._hooks = []

    def on(self) -> None:
        if self.own is None:
            self.own = {}
            self._hooks = [self.optimizer.register_state_dict_post_hook(self._saved),
                           self.optimizer.register_load_state_dict_post_hook(self._loaded)]
        for group in self.optimizer.param_groups:
            if id(group) not in self.own:
                self.own[id(group)] = (group, group.get("foreach"))
            group["foreach"] = False

    def off(self) -> None:
        if self.own is None:
            return
        for group, value in self.own.values():
            group["foreach"] = value
        for hook in self._hooks:
            hook.remove()
        self.own, self._hooks = None, []

    def _saved(self, optimizer, state_dict: dict) -> dict:
        """The user's own `foreach` in a state_dict taken while the switch is on."""
        for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
            if id(group) in self.own:
                saved["foreach"] = self.own[id(group)][1]
        return state_dict

    def _loaded(self, optimizer) -> None:
        """load_state_dict made new groups holding the loaded values: those are the user's now."""
        self.own = {}
        self.on()


def per_parameter_applies(plan, model, optimizer, device, checkpointing) -> str | None:
    """The per-parameter step's `applies` (plans/switches.py); with offload the host step runs, so
    it is not asked."""
    if plan.per_parameter_step and not plan.offload_optimizer:
        problem = per_parameter_problem(optimizer, device)
        if problem:
            return f"a per-parameter optimizer step does not apply: {problem}"
    return None


def per_parameter_problem(optimizer, device) -> str | None:
    """Why switching the optimizer's groups to `foreach=False` would change nothing, or None."""
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    if not groups or any("foreach" not in g for g in groups):
        return f"{name} has no foreach option"
    if any(g.get("fused") for g in groups):
        return f"{name} is fused (one kernel per step, no foreach temporaries)"
    # torch picks foreach for foreach=None only on CUDA.
    if all(g["foreach"] is False or (g["foreach"] is None and device.type != "cuda") for g in groups):
        return f"{name} already updates one parameter at a time (foreach off)"
    return None
