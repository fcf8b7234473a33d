"""How a loss reduces over its batch, asked of the loss itself: a mean over rows, a mean over label
tokens (shifted by one for next-token prediction, or not), or a sum.

Two rows of the first batch are enough. The loss of row 0 alone (a), of row 1 alone (b) and of
both (ab) tell the reductions apart: a sum gives ab = a + b, a mean over rows (a + b) / 2, a mean
over label tokens (na·a + nb·b) / (na + nb), where na and nb count the rows' label tokens. So that
the counts differ, and differ whether the loss shifts labels or not, the probe's labels are set:
every label of row 0 counts (0), only the first and the last of row 1 (T and 2 tokens unshifted,
T - 1 and 1 shifted). The probe runs as `token_loss`'s others do (eval mode, no_grad, host memory,
RNG forked), and whatever the loss's forward (and the hooks a `loss_fn` reaches through the model's
`__call__`) writes on the model is put back. The same three losses in training mode tell whether
the training forward couples the rows (`couples_in_training`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from autofit.engine.batches import IGNORE_INDEX, rows_of, labels_of, slice_batch
from autofit.engine.kept import loss_and_kept
from autofit.engine.model_state import Attributes, Generators
from autofit.gpu.device import _map_tensors

log = logging.getLogger("autofit")

ROWS, SUM, SHIFTED, UNSHIFTED = "rows", "sum", "shifted", "unshifted"
TOLERANCE = 1e-4  # relative: one row's loss against two rows' in fp32 (another summation order)


@dataclass(frozen=True)
class Reduction:
    """What the probe found: `kind` (ROWS, SUM, SHIFTED, UNSHIFTED label tokens; None when no
    reduction matched or several did) and `measured`, the three losses in words."""

    kind: str | None
    measured: str
    ambiguous: bool = False  # several reductions match: the rows' losses were alike
    finite: bool = True      # False: some loss was not a finite number (no loss found, or nan)


def probe_rows(batch) -> list | None:
    """(row 0, row 1, both) of `batch` for the probe, with labels set as the module docstring says
    when the batch has per-token integer labels; None when the batch has fewer than two rows."""
    if rows_of(batch) < 2:
        return None
    both = _map_tensors(slice_batch(batch, 0, 2), lambda t: t.clone())  # a loss_fn may write to its batch
    labels = labels_of(both)
    if labels is not None and labels.dim() >= 2 and not labels.is_floating_point() and labels.shape[-1] >= 3:
        labels = torch.zeros_like(labels)
        labels[1] = IGNORE_INDEX
        labels[1, ..., 0] = labels[1, ..., -1] = 0
        both = type(both)({**both, "labels": labels}) if isinstance(both, Mapping) else both
    return [slice_batch(both, 0, 1, 2), slice_batch(both, 1, 2, 2), both]


def _counts(batch) -> dict:
    """{kind: (row 0's label tokens, row 1's)} for the token reductions the batch can tell apart."""
    labels = labels_of(batch)
    if labels is None or labels.dim() < 2 or labels.is_floating_point() or labels.shape[-1] < 3:
        return {}
    kept = labels != IGNORE_INDEX
    counts = {UNSHIFTED: kept, SHIFTED: kept[..., 1:]}
    return {kind: (int(k[0].sum()), int(k[1].sum())) for kind, k in counts.items()}


def _predicted(a: float, b: float, rows) -> dict:
    """{reduction: the loss of both rows it predicts from the loss of each}."""
    predicted = {ROWS: (a + b) / 2, SUM: a + b}
    for kind, (na, nb) in _counts(rows[2]).items():
        if na + nb:
            predicted[kind] = (na * a + nb * b) / (na + nb)
    return predicted


def _matches(value: float, a: float, b: float, ab: float) -> bool:
    return abs(value - ab) <= TOLERANCE * max(abs(a), abs(b), abs(ab), 1e-30)


def classify(a: float, b: float, ab: float, rows) -> Reduction:
    """The reduction whose prediction of `ab` from `a` and `b` matches (see the module docstring)."""
    measured = f"loss of row 0 {a:.6g}, of row 1 {b:.6g}, of both {ab:.6g}"
    if not all(math.isfinite(x) for x in (a, b, ab)):
        return Reduction(None, measured, finite=False)
    predicted = _predicted(a, b, rows)
    matches = [kind for kind, value in predicted.items() if _matches(value, a, b, ab)]
    if len(matches) == 1:
        return Reduction(matches[0], measured)
    if not matches:  # the nearest known reduction, to say how far the loss is from it
        kind = min(predicted, key=lambda k: abs(predicted[k] - ab))
        measured += f"; {_WORDS.get(kind, 'a mean over label tokens')} would give {predicted[kind]:.6g}"
    return Reduction(None, measured, ambiguous=len(matches) > 1)


_WORDS = {ROWS: "a mean over rows", SUM: "a sum over rows"}


def probe_reduction(loss_of, batch) -> Reduction | None:
    """How `loss_of(part) -> float` reduces over rows, from two rows of `batch`; None when the batch
    has fewer than two rows. The caller runs it inside `token_loss._probing` and `state_kept`."""
    rows = probe_rows(batch)
    if rows is None:
        return None
    a, b, ab = (loss_of(part) for part in rows)
    return classify(a, b, ab, rows)


@contextlib.contextmanager
def state_kept(model):
    """Everything of the model a probe's forward may write, put back after it: buffers, parameters
    that require no gradient, generators the model holds, its modules' own attributes (a counter;
    trained parameters are only written by an optimizer, which a probe never runs)."""
    with torch.no_grad():
        saved = [(t, t.detach().to("cpu", copy=True)) for t in model.buffers()]
        saved += [(p, p.detach().to("cpu", copy=True)) for p in model.parameters() if not p.requires_grad]
    kept = [Generators(model), Attributes(model)]
    for part in kept:
        part.capture()
    try:
        yield
    finally:
        with torch.no_grad():
            for t, copy in saved:
                t.copy_(copy)
        for part in kept:
            part.restore()


class _Forward:
    """The model as a probe hands it to a loss_fn: calling it runs `forward` (hooks the user put on
    the model see training forwards only); every attribute is the model's."""

    def __init__(self, module):
        self.__dict__["_module"] = module

    def __call__(self, *args, **kwargs):
        return self._module.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


def ask_reduction(model, batch, loss_fn, device, probing):
    """The probe of the loss (the loss_fn's or the model's own), run inside `probing(model, device)`
    (token_loss's: eval mode, no_grad, host memory, RNG forked), or None when the batch has fewer
    than two rows or the probe failed (said, never fatal)."""
    try:
        with probing(model, device) as inner, state_kept(inner):  # copies in host memory
            return probe_reduction(lambda part: _probe_loss(inner, part, loss_fn, device), batch)
    except Exception as error:  # noqa: BLE001 -- a probe never stops a run; training will show the error
        log.info("cannot ask how the loss reduces over its batch (%s: %s); micro-batches are weighted as "
                 "before", type(error).__name__, error)
        return None


def _probe_loss(inner, part, loss_fn, device) -> float:
    """The loss of one probe `part` (the loss_fn's, or the model's own), NaN when it is not a scalar."""
    part = device.to_device(part)
    if loss_fn is not None:
        loss = loss_and_kept(loss_fn(_Forward(inner), part))[0]
    else:
        out = inner.forward(**part) if isinstance(part, Mapping) else \
            inner.forward(*part) if isinstance(part, (list, tuple)) else inner.forward(part)
        loss = out if isinstance(out, torch.Tensor) else output_loss(out)
    return loss.item() if isinstance(loss, torch.Tensor) and loss.dim() == 0 else math.nan


# Draws of the training forward under different seeds: equal losses mean it draws nothing at random
# (three, so that dropout's masks on two rows cannot all happen to agree).
SEEDS = (1, 2, 3)


def _seed(seed: int) -> None:
    """Every global generator a forward may draw from, seeded alike (the probe's rows then draw the
    same sequence, so a layer-drop decided by `random.random()` decides alike for each)."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")  # (code that never imported it cannot draw from it)
    if numpy is not None:
        numpy.random.seed(seed)


def couples_in_training(model, batch, loss_fn, device, probing, kind: str) -> str | None:
    """Whether the training forward couples the rows of `batch` although the loss reduces as `kind`
    (found in eval mode): the three losses in words when it does, else None.

    Batch-coupled layers are known by class (BatchNorm) or declared; this measures the rest (a layer
    of the user's that normalises with statistics over the batch) on two rows in training mode. It
    can tell only where the training forward is deterministic: a loss of both rows that moves with
    the seed (dropout, noise) says nothing about coupling, so such a model is not judged (None).
    Comparing each layer's output on fewer rows, or watching which buffers a forward writes, would
    not do: the first is blurred by the same randomness, the second flags counters and spectral
    norm's vectors and misses a BatchNorm without running statistics."""
    if rows_of(batch) < 2:
        return None
    try:
        with probing(model, device, train=True) as inner, state_kept(inner):
            rows = probe_rows(batch)
            def loss_of(part, seed):
                _seed(seed)
                return _probe_loss(inner, part, loss_fn, device)
            both = [loss_of(rows[2], seed) for seed in SEEDS]
            if len(set(both)) > 1:
                return None
            a, b, ab = loss_of(rows[0], SEEDS[0]), loss_of(rows[1], SEEDS[0]), both[0]
            predicted = _predicted(a, b, rows).get(kind)
    except Exception as error:  # noqa: BLE001 -- a probe never stops a run (BatchNorm1d refuses one row)
        log.info("cannot ask whether the training forward couples rows (%s: %s)", type(error).__name__, error)
        return None
    if predicted is None or not all(math.isfinite(x) for x in (a, b, ab)) or _matches(predicted, a, b, ab):
        return None
    return (f"loss of row 0 {a:.6g}, of row 1 {b:.6g}, of both {ab:.6g}; "
            f"{_WORDS.get(kind, 'a mean over label tokens')} would give {predicted:.6g}")


def output_loss(out):
    """The scalar loss a model's output carries (`.loss` or ["loss"]), or None."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None
