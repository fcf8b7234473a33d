"""Batches: how big one is, how to split it along dimension 0, and how much each part weighs."""

from __future__ import annotations

from collections.abc import Mapping

import torch

try:  # numpy arrays in a batch are split like tensors; numpy itself is optional
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

IGNORE_INDEX = -100  # the label value Hugging Face losses skip


def _fields(batch, path="batch"):
    """(path, value) for every leaf of a batch, e.g. ("batch['input_ids']", tensor)."""
    if isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _fields(v, f"{path}[{k!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            yield from _fields(v, f"{path}[{i}]")
    else:
        yield path, batch


# -- which fields are per-row -------------------------------------------------------------------
# The rows of a batch are dimension 0 of its arrays (tensors and numpy arrays), which must agree.
# Dicts, namedtuples and lists/tuples holding an array are structure: each item is a field of its
# own. A list/tuple of plain Python values (strings, numbers, None, nested lists of them) is one
# field, per-row when its length is the number of rows (default_collate's text and id fields),
# else metadata that every micro-batch gets whole. A plain list of as many lists as rows, each of
# which is itself as long as the rows, reads both as one list per row and as per-field columns
# (what default_collate makes of per-sample lists): that is ambiguous, and refused.

ROWS, WHOLE, STRUCTURE = "rows", "whole", "structure"


def is_array(value) -> bool:
    return isinstance(value, torch.Tensor) or (np is not None and isinstance(value, np.ndarray))


def _holds_array(value) -> bool:
    if is_array(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_array(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_array(v) for v in value)
    return False


def _sequence_kind(value, rows: int, path: str) -> str:
    """ROWS, WHOLE or STRUCTURE for a list/tuple field of a batch with `rows` rows."""
    if (isinstance(value, tuple) and hasattr(value, "_fields")) or _holds_array(value):
        return STRUCTURE
    per_row = len(value) == rows
    columns = len(value) > 0 and all(isinstance(v, (list, tuple)) and len(v) == rows for v in value)
    if per_row and columns and rows > 1:
        raise ValueError(
            f"{path} is ambiguous: a list of {rows} lists of {rows} values each could be one list per "
            f"row or {rows} per-row columns (as default_collate makes of per-sample lists), and the "
            f"batch has {rows} rows; make it a tensor or numpy array (rows along dimension 0), or a "
            f"list of per-row tuples of another length.")
    if columns and not per_row:
        return STRUCTURE
    return ROWS if per_row else WHOLE


def _arrays(batch, path="batch"):
    """(path, array) for every array of the batch's structure (where its rows are counted)."""
    if is_array(batch):
        yield path, batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _arrays(v, f"{path}[{k!r}]")
    elif isinstance(batch, (list, tuple)) and _holds_array(batch):
        for i, v in enumerate(batch):
            yield from _arrays(v, f"{path}[{i}]")


def per_row_fields(batch, path="batch", rows=None):
    """(path, value) for every field split with the rows: arrays and per-row lists."""
    rows = rows_of(batch) if rows is None else rows
    if is_array(batch):
        yield path, batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from per_row_fields(v, f"{path}[{k!r}]", rows)
    elif isinstance(batch, (list, tuple)):
        kind = _sequence_kind(batch, rows, path)
        if kind == ROWS:
            yield path, batch
        elif kind == STRUCTURE:
            for i, v in enumerate(batch):
                yield from per_row_fields(v, f"{path}[{i}]", rows)


def rows_of(batch) -> int:
    """Rows along dimension 0, the same for every array (tensor, numpy array) of the batch, else a
    ValueError saying which."""
    sizes = {}
    for path, value in _arrays(batch):
        if value.ndim == 0:
            kind = "tensor" if isinstance(value, torch.Tensor) else "numpy array"
            raise ValueError(f"{path} is a 0-dimensional {kind} and cannot be split along "
                             f"dimension 0; give every tensor of a batch a leading batch dimension.")
        sizes[path] = value.shape[0]
    if not sizes:
        raise ValueError(f"the batch holds no tensor (got {type(batch).__name__}); a batch is a tensor, "
                         f"a tuple/list or a dict of tensors whose dimension 0 is the batch.")
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{p} has {n}" for p, n in sizes.items())
        raise ValueError(f"cannot split the batch along dimension 0: its tensors disagree ({shown}); "
                         f"make every tensor's dimension 0 the batch dimension.")
    return next(iter(sizes.values()))


def row_elements(batch) -> int:
    """Elements per row, summed over the batch's arrays: how long a batch's rows are.

    Memory grows with it, whatever dimension grows: for token batches it is the number of fields
    times the sequence length (plus one per label), for images it is fixed. The sizes a plan was
    proven for are kept per row length (`sizelog.SizeLog`). Per-row Python lists hold no device
    memory and count nothing.
    """
    rows = max(rows_of(batch), 1)
    return sum(_numel(v) // rows for _, v in per_row_fields(batch, rows=rows) if is_array(v))


def tokens_per_row(batch) -> int | None:
    """Token positions per row of a token batch: the longest integer field with positions (an
    integer array of two or more dimensions, e.g. input_ids of rows x sequence), as numel / rows.
    None when the batch has none (images, audio features, tabular rows): its rows are the unit of
    work. The cost model weighs a micro-batch of tokens by them (autofit.estimator.cost)."""
    rows = max(rows_of(batch), 1)
    counts = [_numel(v) // rows for _, v in per_row_fields(batch, rows=rows)
              if is_array(v) and v.ndim >= 2 and _is_integer(v)]
    return max(counts) if counts else None


def _is_integer(array) -> bool:
    if isinstance(array, torch.Tensor):
        return not array.dtype.is_floating_point and not array.dtype.is_complex and array.dtype != torch.bool
    return array.dtype.kind in "iu"


def _numel(array) -> int:
    return array.numel() if isinstance(array, torch.Tensor) else int(array.size)


def slice_batch(batch, start: int, stop: int, rows: int | None = None):
    """Rows [start, stop) of every per-row field (see `per_row_fields`); other fields are shared
    whole by all micro-batches. A value holding no array has no rows and comes back as it is."""
    if not _holds_array(batch):
        return batch
    return _slice(batch, start, stop, rows_of(batch) if rows is None else rows, "batch")


def _slice(batch, start, stop, rows, path):
    if is_array(batch):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({k: _slice(v, start, stop, rows, f"{path}[{k!r}]") for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        kind = _sequence_kind(batch, rows, path)
        if kind == ROWS:
            return type(batch)(batch[start:stop])
        if kind == WHOLE:
            return batch
        items = (_slice(v, start, stop, rows, f"{path}[{i}]") for i, v in enumerate(batch))
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def split(batch, micro_batch_size: int) -> list:
    """Micro-batches of `micro_batch_size` rows; the last one may be shorter."""
    n = rows_of(batch)
    return [slice_batch(batch, i, min(i + micro_batch_size, n), n) for i in range(0, n, micro_batch_size)]


def labels_of(batch):
    if isinstance(batch, Mapping) and isinstance(batch.get("labels"), torch.Tensor):
        return batch["labels"]
    return None


def weights(batch, parts: list, count_tokens=None) -> list[float]:
    """Each micro-batch's share of the global batch: label tokens when the loss is per token, else rows."""
    if count_tokens is not None:
        total = count_tokens(batch)
        if total is not None:
            if total == 0:
                raise ValueError("the batch has no label token to learn from (every label is -100); "
                                 "drop such batches or check the labels.")
            return [count_tokens(p) / total for p in parts]
    total = rows_of(batch)
    return [rows_of(p) / total for p in parts]


def dataset_batches(dataset, batch_size_: int):
    """Global batches of a map-style dataset, in order, the last one shorter (no shuffling: the
    user's DataLoader is the place for that)."""
    from torch.utils.data import DataLoader
    return DataLoader(dataset, batch_size=batch_size_, shuffle=False)


def peek(data, epochs: int, what: str = "data"):
    """(first batch, data that yields every batch again, first included) for an iterable of batches.

    A one-shot iterator can be read once: with several epochs it is refused; else the peeked batch
    is chained back in front of it.
    """
    import itertools

    from autofit.engine.reading import is_one_shot
    one_shot = is_one_shot(data)  # never iter() a DataLoader just to ask
    if one_shot and epochs > 1:
        raise ValueError(f"{what} is a one-shot iterator ({type(data).__name__}) but epochs={epochs}; "
                         f"pass a DataLoader or a list so each epoch can read it again.")
    head = iter(data)
    try:
        first = next(head)
    except StopIteration:
        raise ValueError(f"{what} ({type(data).__name__}) yielded no batch; give at least one.") from None
    return first, (itertools.chain([first], head) if one_shot else data)
