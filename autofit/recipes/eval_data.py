"""Evaluation's inputs: the arguments and the data that may be evaluated, whether its batches match
the training batches, and the order its units are read in (a map-style Dataset is collated as many
samples at a time as the evaluation batch size)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from autofit.engine.batches import rows_of
from autofit.engine.batches import peek, slice_batch
from autofit.engine.reading import rng_untouched


def is_map_dataset(data) -> bool:
    from torch.utils.data import Dataset, IterableDataset
    return isinstance(data, Dataset) and not isinstance(data, IterableDataset)


def check_arguments(model, loss_fn, metric_fn, batch_size, start_batch_size, device, budget) -> None:
    """TypeError/ValueError naming the value for a bad argument of `autofit.evaluate`."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module but got {type(model).__name__}.")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (model, batch) -> scalar loss but got {loss_fn!r}.")
    if metric_fn is not None and not callable(metric_fn):
        raise TypeError(f"metric_fn must be a callable (output, batch) -> dict[str, float] but got "
                        f"{metric_fn!r}.")
    for name, value in (("batch_size", batch_size), ("start_batch_size", start_batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None but got {value!r}.")
    if device is not None and budget is not None:
        raise ValueError("pass device= (an open autofit device) or budget=, not both; the device "
                         "already has its budget.")


def check_data(data) -> None:
    if is_map_dataset(data):
        if len(data) == 0:
            raise ValueError(f"evaluation data is an empty {type(data).__name__}; give at least one sample.")
        return
    if isinstance(data, (torch.Tensor, Mapping)) or not hasattr(data, "__iter__"):
        raise TypeError(f"evaluation data must be a map-style Dataset or an iterable of batches (a "
                        f"DataLoader, a list of batches) but got {type(data).__name__}; wrap a single "
                        f"batch in a list: [batch].")


def _structure_diff(expected, got, path: str = "batch") -> str | None:
    """Where `got` departs from `expected` in keys or arity, in words; None when they agree."""
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping):
            return (f"{path} is a {type(got).__name__}, but in the training batches it is a mapping "
                    f"with keys {list(expected)}")
        for key in expected:
            if key not in got:
                return f"the field {path}[{key!r}] is missing, which the training batches have"
        for key in got:
            if key not in expected:
                return f"the field {path}[{key!r}] is extra, which the training batches do not have"
        for key in expected:
            diff = _structure_diff(expected[key], got[key], f"{path}[{key!r}]")
            if diff:
                return diff
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or isinstance(got, torch.Tensor):
            return (f"{path} is a {type(got).__name__}, but in the training batches it is a "
                    f"{type(expected).__name__} of {len(expected)} fields")
        if len(got) < len(expected):
            return (f"the field {path}[{len(got)}] is missing: the evaluation batch has {len(got)} "
                    f"fields, the training batches {len(expected)}")
        if len(got) > len(expected):
            return (f"the field {path}[{len(expected)}] is extra: the evaluation batch has {len(got)} "
                    f"fields, the training batches {len(expected)}")
        for i, (e, g) in enumerate(zip(expected, got)):
            diff = _structure_diff(e, g, f"{path}[{i}]")
            if diff:
                return diff
        return None
    if isinstance(expected, torch.Tensor) and not isinstance(got, torch.Tensor):
        return f"{path} is a {type(got).__name__}, but in the training batches it is a tensor"
    return None


def check_structure(batch, expect_like, index: int = 0) -> None:
    """ValueError naming the field when `batch` lacks or adds a field of `expect_like`."""
    if expect_like is None:
        return
    diff = _structure_diff(expect_like, batch)
    if diff:
        raise ValueError(f"evaluation batch {index} does not match the training data: {diff}. Give the "
                         f"evaluation data the same fields as the training data (the loss needs the "
                         f"same inputs and labels).")


def units(data, sizer, ceiling: int | None, host=contextlib.nullcontext):
    """(index, first sample, batch) in order; a Dataset is read `sizer`'s current size at a time and
    collated in host memory (`host()`), as a DataLoader would."""
    if is_map_dataset(data):
        from torch.utils.data import default_collate
        n, start, index = len(data), 0, 0
        while start < n:
            rows = sizer.rows(n - start, ceiling) or 1  # 0 (one row known to fail) is raised later
            with host():
                unit = default_collate([data[i] for i in range(start, start + rows)])
            yield index, start, unit
            del unit
            start, index = start + rows, index + 1
        return
    start = 0
    for index, batch in enumerate(data):
        yield index, start, batch
        start += rows_of(batch)


class Cursor:
    """Where evaluation is in its units: the unit being evaluated (`index`, `first` sample, `unit`,
    `rows`) and the rows of it done (`pos`); `filler`, one row of the first unit, for a forward
    that only keeps other ranks company (autofit.distributed.eval_lockstep)."""

    def __init__(self, units, expect_like=None):
        self._units, self.expect_like = iter(units), expect_like
        self.index = self.first = self.pos = self.rows = 0
        self.unit = self.filler = None
        self.read = 0  # units read so far

    def remaining(self) -> int | None:
        """Rows of the current unit not yet evaluated, reading the next unit when this one is done
        (a unit of no rows is passed over); None when the data is done."""
        while self.unit is None or self.pos >= self.rows:
            self.unit = None
            nxt = next(self._units, None)
            if nxt is None:
                self.index, self.first = self.read, self.first + self.rows  # one past the end
                self.rows = self.pos = 0
                return None
            self.index, self.first, unit = nxt
            self.rows, self.pos, self.read = rows_of(unit), 0, self.read + 1
            check_structure(unit, self.expect_like, self.index)
            self.unit = unit
            if self.filler is None and self.rows:
                self.filler = slice_batch(unit, 0, 1)
        return self.rows - self.pos

    def take(self, rows: int):
        """The next `rows` rows of the current unit (not yet counted as done: `advance`)."""
        return slice_batch(self.unit, self.pos, self.pos + rows)

    def advance(self, rows: int) -> None:
        self.pos += rows


def check_eval_data(data, expect_like=None, epochs: int = 1):
    """Check evaluation data before training starts; returns data safe to evaluate `epochs` times.

    Raises TypeError/ValueError for data that is not a Dataset or an iterable of batches, that is
    empty, a one-shot iterator asked for several epochs, or whose first batch differs from
    `expect_like` in keys or arity.
    """
    check_data(data)
    if is_map_dataset(data):
        if expect_like is not None:
            from torch.utils.data import default_collate
            check_structure(default_collate([data[0]]), expect_like)
        return data
    with rng_untouched(data):  # a shuffled loader draws its order when evaluation reads it, not now
        first, again = peek(data, epochs, "evaluation data")
    rows_of(first)
    check_structure(first, expect_like)
    return again
