"""Agreements in front of FSDP2's collectives, so a rank that failed in an attempt never leaves the
others waiting in one (see autofit.distributed.lockstep).

FSDP gathers each unit's parameters in forward and (resharded after forward) again in backward,
prefetching the unit backward reaches next, and reduce-scatters each unit's gradients after its
backward (in the last micro-batch's), those of units whose inputs need no gradient in a callback at
the end of backward. Before each of these, every rank holds an agreement (`check(bytes, device)`):
room for what the collective allocates is made first and freed again (so the collective's own
allocation reuses it and cannot fail), then every rank says whether it is still in the attempt. A
rank that failed in between is at its own agreement after backward, which meets this one, and every
rank raises there. The hooks run before FSDP's: a pre-forward hook put first, a hook on each unit's
outputs registered before FSDP's own, an autograd function around the inputs applied after FSDP's
(so its backward runs first), a callback queued before FSDP's.
"""

from __future__ import annotations

import torch

from autofit.engine.batches import _fields


def _grad_leaves(value) -> list[torch.Tensor]:
    return [t for _, t in _fields(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def _groups(unit):
    return unit._get_fsdp_state()._fsdp_param_groups


def _gathered(unit) -> tuple[int, torch.device | None]:
    """(bytes of the parameters `unit` all-gathers itself, not its sub-units', the shards' device)."""
    params = [fp.sharded_param for group in _groups(unit) for fp in group.fsdp_params]
    size = sum(p.numel() * p.element_size() for p in params)  # numel of a DTensor: the whole tensor's
    return size, (params[0].device if params else None)


def _needs_gather(unit) -> bool:
    return any(group.is_sharded for group in _groups(unit))


class Guards:
    def __init__(self, model, units, check):
        self.model, self.units, self.check = model, units, check
        self.armed = False   # only inside a training attempt
        self.reducing = False  # this micro-batch's backward reduce-scatters (gradient sync on)
        self.order: list = []  # units in the order this forward ran them
        self.sizes = {id(u): _gathered(u) for u in units}
        self.hooks = []
        for unit in units:
            self.hooks += [unit.register_forward_pre_hook(self._before_gather, prepend=True),
                           unit.register_forward_pre_hook(self._around_inputs, with_kwargs=True),
                           unit.register_forward_hook(self._after_forward, prepend=True)]

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def _agree(self, size: int, device) -> None:
        self.check(size, device)

    # -- forward -------------------------------------------------------------------------------
    def _before_gather(self, unit, args) -> None:
        if not self.armed:
            return
        if unit is self.model:
            self.order = []
        self.order.append(unit)
        size, device = self.sizes[id(unit)]
        self._agree(size if _needs_gather(unit) else 0, device)

    def _around_inputs(self, unit, args, kwargs):
        if not (self.armed and self.reducing):
            return None
        done = [False]

        def before_reduce():
            if not done[0]:
                done[0] = True
                self._agree(*self.sizes[id(unit)])
        wrap = lambda t: _BeforeReduce.apply(before_reduce, t) if isinstance(t, torch.Tensor) and t.requires_grad else t  # noqa: E731
        return (tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()})

    def _after_forward(self, unit, args, output) -> None:
        leaves = _grad_leaves(output) if self.armed else []
        if not leaves:
            return
        done = [False]

        def before_backward(grad):
            if done[0]:
                return None
            done[0] = True
            if unit is self.model:  # backward starts: the end-of-backward reduce gets its agreement too
                torch.autograd.Variable._execution_engine.queue_callback(self._before_final)
            size, device = self.sizes[id(unit)]
            need = size if _needs_gather(unit) else 0
            k = next((i for i, u in enumerate(self.order) if u is unit), 0)
            if k > 0 and _needs_gather(self.order[k - 1]):  # FSDP prefetches the unit before it
                need += self.sizes[id(self.order[k - 1])][0]
            self._agree(need, device)
            return None
        for t in leaves:
            t.register_hook(before_backward)

    def _before_final(self) -> None:
        if self.armed and self.reducing:
            size, device = max(self.sizes.values(), key=lambda s: s[0])
            self._agree(size, device)


class _BeforeReduce(torch.autograd.Function):
    """Identity in forward; in backward, the agreement before the unit's reduce-scatter."""

    @staticmethod
    def forward(ctx, hook, tensor):
        ctx.hook = hook
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return None, grad
