"""Per-row outputs a loss keeps beside itself: state carried from one global batch to the next.

A truncated-BPTT loop feeds each batch the recurrent state the previous batch ended with. Under
autofit that state is a field of the batch (split with its rows like the inputs, `batch_dim` saying
where its rows are) and the new state is returned by the loss: `loss_fn` may return
`(loss, kept)`, `kept` a tensor or a tuple/list/dict of tensors with one row per row of its
micro-batch, laid out as the batch is. `step(batch).kept` joins the micro-batches' `kept` in row
order, detached, from the attempt that succeeded only: a failed attempt's outputs are dropped with
it, so the state handed on is the plain loop's whatever the split and however many replays.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from autofit.engine.batches import rows_of


def loss_and_kept(result):
    """(loss, kept) of what a loss returned: a loss alone, or a pair (loss, kept)."""
    if isinstance(result, tuple) and not hasattr(result, "_fields") and len(result) == 2 \
            and isinstance(result[0], torch.Tensor):
        return result[0], result[1]
    return result, None


def detached(kept):
    """`kept` with every tensor detached (nothing of the step's graph is held by it)."""
    return _map(kept, lambda t: t.detach())


def copied(kept):
    """`kept` of an inference-mode forward as normal tensors (copies), which training may take as
    inputs (autograd refuses to save inference tensors)."""
    with torch.inference_mode(False):
        return _map(kept, torch.clone)


def join(parts: list):
    """The row-first parts' leaves concatenated along dimension 0, in order; None for no part."""
    if not parts or parts[0] is None:
        return None
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if len(parts) > 1 else first
    if isinstance(first, Mapping):
        _same_structure(parts, set(first))
        return type(first)({k: join([p[k] for p in parts]) for k in first})
    if isinstance(first, (list, tuple)):
        _same_structure(parts, len(first))
        items = [join([p[i] for p in parts]) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    raise TypeError(f"a loss_fn's kept outputs must be tensors, or a tuple/list/dict of them, but got "
                    f"{type(first).__name__}; return (loss, kept) with per-row tensors.")


def joined(parts: list, layout, rows: int | None = None):
    """Kept outputs as a loss_fn returned them (laid out as the batch, `layout`), joined along
    their rows and given back in that layout; None for no part. `rows`: how many rows they must
    cover (one per row of the batch), else a ValueError saying so."""
    if not parts:
        return None
    whole = join([layout.rows_first(p, "kept outputs") for p in parts])
    if rows is not None:
        if rows_of(whole) != rows:
            raise ValueError(f"the loss_fn's kept outputs have {rows_of(whole)} rows for a batch of {rows}: "
                             f"each micro-batch must return one row per row it was given (laid out as "
                             f"the batch is, batch_dim), and every micro-batch must return them.")
    return layout.as_given(whole, "kept outputs")


def _same_structure(parts, shape) -> None:
    seen = [set(p) if isinstance(p, Mapping) else len(p) for p in parts]
    if any(s != shape for s in seen):
        raise ValueError(f"a loss_fn returned kept outputs of different structures across micro-batches "
                         f"({seen}); return the same fields for every micro-batch.")


def _map(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return type(value)({k: _map(v, fn) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        items = [_map(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
