"""Batches: how big one is, how to split it along dimension 0, and how much each part weighs."""

from __future__ import annotations

from collections.abc import Mapping

import torch

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


def batch_size(batch) -> int:
    """Rows along dimension 0, the same for every tensor of the batch, else a ValueError saying which."""
    sizes = {}
    for path, value in _fields(batch):
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise ValueError(f"{path} is a 0-dimensional tensor and cannot be split along dimension "
                                 f"0; give every tensor of a batch a leading batch dimension.")
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
    """Elements per row, summed over the batch's tensors: how long a batch's rows are.

    Memory grows with it, whatever dimension grows: for token batches it is the number of fields
    times the sequence length (plus one per label), for images it is fixed. The sizes a plan was
    proven for are kept per row length (`ladder.SizeLog`).
    """
    rows = max(batch_size(batch), 1)
    return sum(v.numel() // rows for _, v in _fields(batch) if isinstance(v, torch.Tensor))


def slice_batch(batch, start: int, stop: int):
    """Rows [start, stop) of every tensor; non-tensor leaves are shared by all micro-batches."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({k: slice_batch(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, start, stop) for v in batch)
    return batch


def split(batch, micro_batch_size: int) -> list:
    """Micro-batches of `micro_batch_size` rows; the last one may be shorter."""
    n = batch_size(batch)
    return [slice_batch(batch, i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)]


def labels_of(batch):
    if isinstance(batch, Mapping) and isinstance(batch.get("labels"), torch.Tensor):
        return batch["labels"]
    return None


def token_counter(model) -> "callable | None":
    """For token-level losses: a function counting the label tokens a batch contributes.

    Causal language models shift labels by one inside their loss, so their first label never counts.
    """
    shifted = _is_causal_lm(model)

    def count(batch):
        labels = labels_of(batch)
        if labels is None or labels.dim() < 2 or labels.is_floating_point():
            return None
        if shifted:
            labels = labels[..., 1:]
        return int((labels != IGNORE_INDEX).sum())
    return count


# LM-head models whose loss does not shift labels (they predict masked/permuted tokens in place).
_UNSHIFTED_LM_HEADS = {"XLNetLMHeadModel", "XLMWithLMHeadModel", "FlaubertWithLMHeadModel"}


def _is_causal_lm(model) -> bool:
    """Whether the model's own loss shifts labels by one (next-token prediction)."""
    name = type(model).__name__
    if name in _UNSHIFTED_LM_HEADS:
        return False
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def weights(batch, parts: list, count_tokens=None) -> list[float]:
    """Each micro-batch's share of the global batch: label tokens when the loss is per token, else rows."""
    if count_tokens is not None:
        total = count_tokens(batch)
        if total is not None:
            if total == 0:
                raise ValueError("the batch has no label token to learn from (every label is -100); "
                                 "drop such batches or check the labels.")
            return [count_tokens(p) / total for p in parts]
    total = batch_size(batch)
    return [batch_size(p) / total for p in parts]


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

    from .reading import is_one_shot
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
