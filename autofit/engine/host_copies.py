"""Host copies of device tensors that a replay may need, made without making the host wait.

A start state is captured before every global batch and read only when an attempt fails. A
blocking copy to pageable host memory drains the device's queue at every capture; a copy into
pinned memory with `non_blocking=True` is queued behind the work already there and the host goes
on. The host copies are kept and written again at the next capture (no allocation per step). They
are read back only by copies to the device, which the device's queue orders after the copies that
filled them: nothing waits for them. (On the CPU and the simulated GPU a copy is a copy.)
"""

from __future__ import annotations

import torch

from autofit.engine.optimizer_state import local


class HostCopies:
    """`take(key, tensor)`: a host copy of `tensor`, started now, in the host tensor `key` had at
    the last capture when it still fits (same shape, dtype and strides), else in a new one made by
    `device.host_empty` (pinned on CUDA). `copies` counts the copies (tests, benchmarks)."""

    def __init__(self, device):
        self.device = device
        self.copies = 0
        self._kept: dict = {}  # key -> host tensor, written again by the next capture

    def take(self, key, tensor: torch.Tensor) -> torch.Tensor:
        shard = local(tensor.detach())
        host = self._kept.get(key)
        if host is None or host.dtype != shard.dtype or host.shape != shard.shape \
                or host.stride() != shard.stride():
            with self.device.host():
                host = self.device.host_empty(shard)
            self._kept[key] = host
        with torch.no_grad():
            host.copy_(shard, non_blocking=True)
        self.copies += 1
        return host

    def keep_only(self, keys) -> None:
        """Forget the host tensors of keys not taken at this capture (a buffer that went away)."""
        if len(keys) != len(self._kept):
            self._kept = {k: v for k, v in self._kept.items() if k in keys}
