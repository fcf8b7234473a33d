"""Host-device synchronisations counted, op by op: what makes the host wait for the device.

A step that makes the host wait leaves the device idle while the host catches up: `loss.item()`
once per step is what a plain loop pays; anything more is overhead. `SyncCounter` is a dispatch mode
that counts the ops that wait for the device's results on CUDA, on any device whose memory the
given autofit device tells apart (a CUDA card, the simulated GPU):
- reading a value on the host: `_local_scalar_dense` (`.item()`, `float()`, `int()`), `is_nonzero`
  (`bool()`), `equal`;
- ops whose output size depends on the data: `nonzero`, `masked_select`, the `unique` family;
- a copy from the device to host memory, unless it is non-blocking into pinned memory
  (`device.is_pinned`: what `device.host_empty` makes).
`counts` holds each op's count; `total` their sum. Used by the overhead benchmark and the tests
that hold a steady step to the plain loop's count.
"""

from __future__ import annotations

import collections
import traceback

from autofit import torch_internals as ti

READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique",
                   "_unique2", "unique_dim", "unique_consecutive"})


class SyncCounter(ti.TorchDispatchMode):
    """`with SyncCounter(device) as syncs:` counts what waits for `device` (an autofit device:
    `on_device(t)`, `is_pinned(t)`) in `syncs.counts` ({op name: count})."""

    def __init__(self, device, host_values=()):
        super().__init__()
        self.device = device
        self.counts: collections.Counter = collections.Counter()
        self.stacks: list = []  # (op, the Python stack) of each count, when `traced`
        self.traced = False
        # Tensors a card keeps in host memory that the simulated GPU counts as its own (an
        # optimizer's step counters, unless it is capturable): reading them waits for nothing.
        self._host_values = {id(t) for t in host_values}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in READS:
            if self.device.on_device(args[0]) and id(args[0]) not in self._host_values:
                self._count(name)
        elif name == "copy_" and self._waits(args[1], args[0], _non_blocking(args, kwargs, 2)):
            self._count("copy to host")
        elif name == "_to_copy" and self._waits(args[0], out, kwargs.get("non_blocking", False)):
            self._count("copy to host")
        return out

    def _count(self, name: str) -> None:
        self.counts[name] += 1
        if self.traced:
            self.stacks.append((name, "".join(traceback.format_stack(limit=12)[:-2])))

    def _waits(self, source, target, non_blocking: bool) -> bool:
        """A copy from the device to the host that the host waits for."""
        on_device = self.device.on_device
        if not on_device(source) or on_device(target):
            return False
        return not (non_blocking and self.device.is_pinned(target))


def _non_blocking(args, kwargs, index: int) -> bool:
    return bool(args[index]) if len(args) > index else bool(kwargs.get("non_blocking", False))
