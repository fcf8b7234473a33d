"""How each rank's data comes, told apart at the first agreement (see autofit.distributed.lockstep):
per rank (a DistributedSampler, or first batches that differ: each rank's batch is its share of
the global batch) or the same global batches on every rank (each rank takes its rows); and each
rank's share of evaluation data."""

from __future__ import annotations

import zlib

import torch

from autofit.engine.batches import _fields, slice_batch
from autofit.engine.batches import rows_of

ITERABLE, SAMPLED, DATASET = range(3)  # how a rank's data came: batches, a DistributedSampler, a Dataset


def distributed_sampler(data):
    """The `DistributedSampler` a DataLoader draws from (its sampler or its batch sampler's), or None."""
    from torch.utils.data.distributed import DistributedSampler
    for sampler in (getattr(data, "sampler", None),
                    getattr(getattr(data, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def content_hash(batch) -> int:
    """A crc32 of a batch's content (every tensor's dtype, shape and bytes; other leaves' repr), to
    tell whether the ranks were given the same batch."""
    crc = 0
    for path, value in _fields(batch):
        crc = zlib.crc32(path.encode(), crc)
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            crc = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), crc)
            crc = zlib.crc32(t.view(-1).view(torch.uint8).numpy().tobytes(), crc)
        else:
            crc = zlib.crc32(repr(value).encode(), crc)
    return crc


def per_rank(kinds: set, digests: list[float], world: int) -> bool:
    """Whether each rank's batches are its share (True) or every rank's are the global batches, from
    every rank's data kind and first batch's `content_hash`; refused when they cannot be told apart."""
    if SAMPLED in kinds:
        if kinds == {SAMPLED}:
            return True
        raise ValueError("some ranks' data has a DistributedSampler and some has not, so autofit "
                         "cannot tell whether a batch is a rank's share or the global batch; give "
                         "every rank a DataLoader with a DistributedSampler, or every rank the same "
                         "global batches.")
    distinct = len(set(digests))
    if distinct == 1:
        return False
    if DATASET in kinds:
        raise ValueError("the ranks' Datasets differ (their first global batches are not equal), so "
                         "autofit cannot tell whether batch_size is each rank's share or the global "
                         "batch; pass the same Dataset on every rank (autofit takes each rank's rows), "
                         "or a DataLoader with a DistributedSampler.")
    if distinct < world:
        groups = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        shown = "; ".join("ranks " + ", ".join(map(str, g)) for g in groups.values())
        raise ValueError(f"some ranks were given the same first batch and others different ones ("
                         f"same within: {shown}), so autofit cannot tell whether a batch is a "
                         f"rank's share or the global batch; give every rank the same global "
                         f"batches, or each rank its own (a DataLoader with a DistributedSampler).")
    return True


def eval_share(data, rank: int, world: int):
    """This rank's share of the evaluation data, so each sample is evaluated once: a contiguous
    part of a map-style Dataset, the rows [r*n/W, (r+1)*n/W) of each batch of an iterable, or the
    data itself when a DistributedSampler already gives each rank its share."""
    from autofit.recipes.eval_data import is_map_dataset
    if distributed_sampler(data) is not None:
        return data
    if is_map_dataset(data):
        n = len(data)
        return torch.utils.data.Subset(data, range(rank * n // world,
                                                   (rank + 1) * n // world))
    return _RowShare(data, rank, world)


class _RowShare:
    """An iterable of batches yielding rank r's rows [r*n/W, (r+1)*n/W) of each (empty ones skipped)."""

    def __init__(self, data, rank: int, world: int):
        self.data, self.rank, self.world = data, rank, world

    def __iter__(self):
        for batch in self.data:
            n = rows_of(batch)
            lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
            if hi > lo:
                yield slice_batch(batch, lo, hi)
