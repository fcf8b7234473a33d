"""Replicas kept equal without a DDP wrapper: rank 0's parameters and buffers broadcast in place once
every rank has arrived, the gradients summed with in-place all-reduces, rank 0's buffers broadcast
after each agreed backward (as DDP's broadcast_buffers). Every call here comes right after an
agreement every rank reached, and none allocates, so none can fail on one rank only. Sharded
parameters (FSDP2's DTensors) are left to FSDP: each rank keeps its own shard, reduced by FSDP."""

from __future__ import annotations

import itertools

import torch

from autofit.distributed import internals
from autofit.distributed.fsdp import is_dtensor


class Replicas:
    def __init__(self, module, group, src: int, sync_buffers: bool):
        self.group, self.src, self.sync_buffers = group, src, sync_buffers
        ignored = internals.ddp_ignored(module)
        self.buffers = [b for name, b in module.named_buffers() if name not in ignored]
        self.module = module
        self.refresh()

    def refresh(self) -> None:
        """Read the module's parameters again (shard=True replaces them by DTensors)."""
        self.params = [p for p in self.module.parameters() if p.requires_grad and not is_dtensor(p)]

    def broadcast_from_rank0(self) -> None:
        """Rank 0's replicated parameters and buffers to every rank, in place (what DDP's
        constructor does, here behind an agreement)."""
        with torch.no_grad():
            for tensor in itertools.chain(self.module.parameters(), self.buffers):
                if not is_dtensor(tensor):
                    torch.distributed.broadcast(tensor, src=self.src, group=self.group)

    def fill_missing_grads(self) -> list[float]:
        """Zero gradients where this rank has none, so every rank reduces the same tensors; returns
        which gradients this rank had (a parameter that no rank used gets None back)."""
        mask = []
        for p in self.params:
            mask.append(0.0 if p.grad is None else 1.0)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return mask

    def reduce_grads(self, verdict) -> None:
        """Sum the gradients over the ranks in place (nothing is allocated: nothing can fail); a
        parameter that no rank used (`verdict.masks`) gets None back."""
        used = [max(column) for column in zip(*verdict.masks)] if self.params else []
        works = []
        for p, u in zip(self.params, used):
            if not u:
                p.grad = None
                continue
            works.append(torch.distributed.all_reduce(p.grad, group=self.group, async_op=True))
        for work in works:
            work.wait()

    def broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, as DDP does (autofit does it after the agreed backward)."""
        if not self.sync_buffers:
            return
        for b in self.buffers:
            torch.distributed.broadcast(b, src=self.src, group=self.group)
