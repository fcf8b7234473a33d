"""Agreements inside FSDP2's collectives, so a rank that failed in an attempt never leaves the others
waiting in one (see autofit.distributed.lockstep).

FSDP gathers each unit's parameters in forward and (resharded after forward) again in backward,
prefetching the unit backward reaches next, and reduce-scatters each unit's gradients after its
backward (in the last micro-batch's), those of units whose inputs need no gradient in a callback at
the end of backward. Every one of these goes through the unit's communication objects (FSDP's
`AllGather` / `ReduceScatter` comms, the ones `set_custom_all_gather` replaces), which allocate the
collective's buffers first and then run it. autofit wraps each comm: its call holds an agreement
(`check(collective)`: every rank says whether it is still in the attempt, and which collective it
is about to run) and only then runs the collective.
So everything FSDP allocates for a collective (the gather's output, the reduce-scatter's input and
output, casts and copy-ins) happens before the agreement, and nothing between the agreement and the
collective can fail: a rank whose allocation failed is at its own agreement after backward, which
meets this one, and every rank raises there. A user's own custom comm is wrapped the same way.
"""

from __future__ import annotations

import time

from autofit.distributed import internals
from autofit.gpu.simulate import active_gpu

AllGather, ReduceScatter = internals.comm_classes()

# Which collective a rank is about to run, carried by its agreement: ranks that agree to go on but
# are about to run different collectives (their FSDP states diverged) would abort in gloo or wait
# in NCCL; the agreement stops every rank with a LockstepError naming both instead.
GATHER, REDUCE = 1, 2
_KIND_NAMES = {GATHER: "the all-gather", REDUCE: "the reduce-scatter"}
# kind (2 bits), parameter group (14) and output elements (36, clamped) in one float64 entry, exactly
_GROUP_BITS, _NUMEL_BITS = 14, 36


def collective_id(kind: int, group: int, numel: int) -> int:
    return (((kind << _GROUP_BITS) + min(group, (1 << _GROUP_BITS) - 1)) << _NUMEL_BITS) + \
        min(numel, (1 << _NUMEL_BITS) - 1)


def describe_collective(value: float) -> str:
    """'the all-gather of parameter group 2 (8544 elements)', or what 0 means (an agreement
    outside any collective)."""
    value = int(value)
    if not value:
        return "the attempt's end (no collective)"
    numel, rest = value & ((1 << _NUMEL_BITS) - 1), value >> _NUMEL_BITS
    kind, group = rest >> _GROUP_BITS, rest & ((1 << _GROUP_BITS) - 1)
    return f"{_KIND_NAMES.get(kind, 'a collective')} of parameter group {group} ({numel} elements)"


class _Agreed:
    """The comm FSDP had, with the agreement held before each collective while the guards are armed."""

    KIND = 0  # GATHER or REDUCE

    def __init__(self, inner, guards, index: int):
        self.inner, self.guards, self.index = inner, guards, index  # index: the param group's

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, *args, **kwargs):
        if self.guards.armed:
            output = kwargs.get("output_tensor", args[0] if args else None)
            self.guards.check(collective_id(self.KIND, self.index, output.numel() if output is not None else 0))
        work = self.inner(*args, **kwargs)
        if active_gpu() is not None:
            # gloo's thread drops the collective's buffers after the caller's wait returns, and on a
            # simulated GPU that free is a Python callback waiting for the GIL: let it run now, so
            # the peak does not depend on when the interpreter switches threads.
            time.sleep(0)
        return work


class _AgreedAllGather(_Agreed, AllGather):
    KIND = GATHER
    __call__ = _Agreed.__call__


class _AgreedReduceScatter(_Agreed, ReduceScatter):
    KIND = REDUCE
    __call__ = _Agreed.__call__


class Guards:
    def __init__(self, model, units, check):
        self.model, self.units, self.check = model, units, check
        self.armed = False   # only inside an attempt (training or evaluation)
        self.wrapped = []    # (param group, its all-gather comm, its reduce-scatter comm)
        for unit in units:
            for group in internals.param_groups(unit):
                gather, reduce = internals.comms(group)
                index = len(self.wrapped)
                self.wrapped.append((group, gather, reduce))
                internals.set_comms(group, _AgreedAllGather(gather, self, index),
                                    _AgreedReduceScatter(reduce, self, index))

    def remove(self) -> None:
        """FSDP's own comms back (a user's custom one included)."""
        for group, gather, reduce in self.wrapped:
            internals.set_comms(group, gather, reduce)
        self.wrapped = []
