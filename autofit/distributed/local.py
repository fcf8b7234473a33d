"""The lockstep of a single process: every agreement of `distributed.lockstep.Lockstep` with one
party, so `recipes/training` and the recipes on it never branch on whether torch.distributed runs."""

from __future__ import annotations

import contextlib

from autofit.engine.batches import row_elements, rows_of


class Local:
    """The lockstep of a single process: `distributed.Lockstep`'s interface, nothing to agree on."""

    rank, world = 0, 1

    def __init__(self, model):
        self.module = model
        self.global_rows = 0  # rows of the last global batch
        self.plan_shape = (0, 0)  # its (rows, elements per row), which its plan covers

    def scope(self):
        return contextlib.nullcontext(self)

    def hello(self, first, data, device, *, dataset: bool) -> None:
        pass

    def check_optimizer(self, optimizer) -> None:
        pass

    def epochs(self, epoch_batches):
        return epoch_batches

    def eval_share(self, data):
        return data

    def combine_eval(self, result):
        return result

    def agree_budgets(self, device, tensor_budget) -> None:
        pass

    def estimate_view(self, device):
        return device

    def cache_view(self, device):
        return device

    def agree_start(self, choose, sizes):
        return choose()

    def local(self, batch):
        return batch

    def first_shape(self, first) -> tuple[int, int]:
        return rows_of(first), row_elements(first)

    def next_batch(self, batch, count=None):
        self.global_rows = rows_of(batch)
        self.plan_shape = (self.global_rows, row_elements(batch))
        return batch

    def check_dataset(self, length: int, batch_size: int) -> None:
        pass

    sharded = None

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass
