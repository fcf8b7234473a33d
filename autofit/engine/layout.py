"""Where the rows of a batch are (`batch_dim=`), for batches that are not row-first.

autofit splits a global batch along its rows. Most loaders put them along dimension 0; a
time-first batch (`(time, batch, ...)`, as `nn.LSTM(batch_first=False)` reads it, or the
word-language-model loop's `batchify`) has them along dimension 1. `batch_dim=1` says so for every
array of the batch; `batch_dim={"tokens": 1, "lengths": 0}` (keys of a dict batch) or `{0: 1, 2: 1}`
(positions of a tuple batch) says it per field, fields not named being row-first.

Inside autofit every batch is row-first: `Layout.rows_first` turns each array into a view with its
rows moved to dimension 0 (`movedim`, no copy), so splitting, weighing, replaying and the
estimator are the row-first code; `Layout.as_given` turns a micro-batch back just before the user's
loss, model or metric sees it, contiguous as a plain loop's sliced and moved micro-batch is. The
values the model reads are those of the plain loop's `batch[:, start:stop]`.

A model that says its own layout is checked against `batch_dim`: a recurrent or attention layer
built with `batch_first=False` reads `(time, batch, ...)` inputs, so such a model trained with the
default `batch_dim=0` is refused by the layer's name (the tensors' lengths along dimension 0 often
agree, and autofit would split time); pass `batch_dim=1`, or `batch_dim=0` to say the rows are
along dimension 0 anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from autofit.engine.batches import is_array

# Layers whose `batch_first` says which dimension of their input is the batch.
_LAYOUT_LAYERS = (torch.nn.RNNBase, torch.nn.MultiheadAttention, torch.nn.Transformer,
                  torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)


class Layout:
    """The rows' dimension of each field of a batch: `rows_first` and its inverse `as_given`."""

    def __init__(self, batch_dim=None):
        self.given = batch_dim is not None  # said by the user (a model's own layout is then theirs)
        batch_dim = 0 if batch_dim is None else batch_dim
        if isinstance(batch_dim, Mapping):
            for key, dim in batch_dim.items():
                _check_dim(dim, f"batch_dim[{key!r}]")
            self.default, self.fields = 0, dict(batch_dim)
        else:
            _check_dim(batch_dim, "batch_dim")
            self.default, self.fields = batch_dim, {}
        self.batch_dim = batch_dim

    @property
    def row_first(self) -> bool:
        """Whether every field's rows are along dimension 0 (nothing to move)."""
        return self.default == 0 and all(d == 0 for d in self.fields.values())

    def rows_first(self, batch, what: str = "batch"):
        """`batch` with every array's rows along dimension 0 (views of its tensors)."""
        if self.row_first:
            return batch
        return self._map(batch, what, _to_rows)

    def as_given(self, batch, what: str = "batch"):
        """A row-first (micro-)batch back in the layout the data gave, each moved array contiguous."""
        if self.row_first:
            return batch
        return self._map(batch, what, _from_rows)

    def loss_fn(self, loss_fn):
        """`loss_fn` seeing batches as given (None: the model's own loss on them). The wrapper
        names `num_items_in_batch` only when `loss_fn` does, so the weighting reads it alike, and
        returns what `loss_fn` returns (kept outputs included)."""
        if self.row_first:
            return loss_fn
        if loss_fn is None:
            from autofit.engine.step import compute_loss

            def given(model, batch):
                return compute_loss(model, self.as_given(batch))
            return given
        from autofit.engine.token_loss import loss_fn_takes_items

        if loss_fn_takes_items(loss_fn):
            def given(model, batch, num_items_in_batch=None):
                return loss_fn(model, self.as_given(batch), num_items_in_batch=num_items_in_batch)
        else:
            def given(model, batch):
                return loss_fn(model, self.as_given(batch))
        return given

    def metric_fn(self, metric_fn):
        """`metric_fn(output, batch)` seeing the batch as given."""
        if self.row_first or metric_fn is None:
            return metric_fn

        @functools.wraps(metric_fn)  # its name is the one errors give
        def given(output, batch):
            return metric_fn(output, self.as_given(batch))
        return given

    def over(self, data):
        """An iterable of batches made row-first as they are read (`data` itself when nothing moves)."""
        return data if self.row_first else _RowsFirst(data, self)

    def check_model(self, model) -> None:
        """Refuse the default layout for a model whose layers read time-first inputs."""
        if self.given:
            return
        for name, module in model.named_modules():
            if isinstance(module, _LAYOUT_LAYERS) and not getattr(module, "batch_first", True):
                raise ValueError(
                    f"{name or 'the model'} ({type(module).__name__}) was built with batch_first=False: "
                    f"it reads (time, batch, ...) inputs, and autofit splits a batch along its rows, "
                    f"by default dimension 0; pass batch_dim=1 if the batches are time-first (each "
                    f"array's dimension 1 the rows; a dict {{field: dim}} per field), or batch_dim=0 "
                    f"if dimension 0 is the rows anyway.")

    # -- one pass over the fields --------------------------------------------------------------
    def _map(self, batch, what, move):
        if self.fields:
            if isinstance(batch, Mapping):
                keys = list(batch)
            elif isinstance(batch, (list, tuple)):
                keys = list(range(len(batch)))
            else:
                raise ValueError(f"batch_dim={self.batch_dim!r} names fields, but the {what} is a "
                                 f"{type(batch).__name__}; give an int, or a dict/tuple batch.")
            missing = [k for k in self.fields if k not in keys]
            if missing:
                raise ValueError(f"batch_dim names {missing!r}, which the {what} does not have (its "
                                 f"fields: {keys!r}); name only its fields.")
            items = {k: _leaves(batch[k], self.fields.get(k, 0), f"{what}[{k!r}]", move) for k in keys}
            if isinstance(batch, Mapping):
                return type(batch)(items)
            values = [items[k] for k in keys]
            return type(batch)(*values) if hasattr(batch, "_fields") else type(batch)(values)
        return _leaves(batch, self.default, what, move)


class _RowsFirst:
    """Batches of `data`, each made row-first when read; as long as `data` when it has a length."""

    def __init__(self, data, layout):
        self.data, self.layout = data, layout

    def __iter__(self):
        return (self.layout.rows_first(batch) for batch in self.data)

    def __len__(self):
        return len(self.data)


def _check_dim(dim, name) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"{name} must be a dimension index >= 0 (0: rows first, 1: time first) "
                         f"but got {dim!r}.")


def _leaves(value, dim, path, move):
    if is_array(value):
        return move(value, dim, path)
    if isinstance(value, Mapping):
        return type(value)({k: _leaves(v, dim, f"{path}[{k!r}]", move) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        items = [_leaves(v, dim, f"{path}[{i}]", move) for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _to_rows(array, dim, path):
    if dim == 0:
        return array
    if array.ndim <= dim:
        raise ValueError(f"{path} has shape {tuple(array.shape)}, no dimension {dim} to hold the rows "
                         f"(batch_dim); give that field its own dimension in a dict batch_dim, e.g. "
                         f"{{field: 0}}.")
    return _movedim(array, dim, 0)


def _from_rows(array, dim, path):
    if dim == 0:
        return array
    moved = _movedim(array, 0, dim)
    return moved if not isinstance(moved, torch.Tensor) or moved.is_contiguous() else moved.contiguous()


def _movedim(array, source, destination):
    if isinstance(array, torch.Tensor):
        return array.movedim(source, destination)
    import numpy as np
    return np.moveaxis(array, source, destination)
