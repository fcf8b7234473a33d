"""Agreements inside FSDP2's collectives, so a rank that failed in an attempt never leaves the others
waiting in one (see autofit.distributed.lockstep).

FSDP gathers each unit's parameters in forward and (resharded after forward) again in backward,
prefetching the unit backward reaches next, and reduce-scatters each unit's gradients after its
backward (in the last micro-batch's), those of units whose inputs need no gradient in a callback at
the end of backward. Every one of these goes through the unit's communication objects (FSDP's
`AllGather` / `ReduceScatter` comms, the ones `set_custom_all_gather` replaces), which allocate the
collective's buffers first and then run it. autofit wraps each comm: its call holds an agreement
(`check()`: every rank says whether it is still in the attempt) and only then runs the collective.
So everything FSDP allocates for a collective (the gather's output, the reduce-scatter's input and
output, casts and copy-ins) happens before the agreement, and nothing between the agreement and the
collective can fail: a rank whose allocation failed is at its own agreement after backward, which
meets this one, and every rank raises there. A user's own custom comm is wrapped the same way.
"""

from __future__ import annotations

from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _Agreed:
    """The comm FSDP had, with the agreement held before each collective while the guards are armed."""

    def __init__(self, inner, guards):
        self.inner, self.guards = inner, guards

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, *args, **kwargs):
        if self.guards.armed:
            self.guards.check()
        return self.inner(*args, **kwargs)


class _AgreedAllGather(_Agreed, AllGather):
    __call__ = _Agreed.__call__


class _AgreedReduceScatter(_Agreed, ReduceScatter):
    __call__ = _Agreed.__call__


def _groups(unit):
    return unit._get_fsdp_state()._fsdp_param_groups


class Guards:
    def __init__(self, model, units, check):
        self.model, self.units, self.check = model, units, check
        self.armed = False   # only inside an attempt (training or evaluation)
        self.wrapped = []    # (param group, its all-gather comm, its reduce-scatter comm)
        for unit in units:
            for group in _groups(unit):
                gather, reduce = group._all_gather_comm, group._reduce_scatter_comm
                self.wrapped.append((group, gather, reduce))
                group._all_gather_comm = _AgreedAllGather(gather, self)
                group._reduce_scatter_comm = _AgreedReduceScatter(reduce, self)

    def remove(self) -> None:
        """FSDP's own comms back (a user's custom one included)."""
        for group, gather, reduce in self.wrapped:
            group._all_gather_comm, group._reduce_scatter_comm = gather, reduce
        self.wrapped = []
