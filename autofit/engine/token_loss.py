"""How micro-batch losses add up to the global batch's loss: by the model's own token count, by
label tokens, or by rows.
The weighting and the two probes that choose it — what the model counts,
whether it shifts labels — share one probing wrapper around the model's device and call.

A token-level loss is a mean over label tokens, so a micro-batch's mean weighs its share of the
global batch's tokens, not of its rows. Hugging Face models say how they count: a forward that
takes `num_items_in_batch` divides its summed loss by it, so handing every micro-batch the global
batch's count makes the micro losses add up to the full-batch mean (each micro-batch then weighs
1). Which models honour it is found out, not guessed from class names: a forward that accepts the
keyword (`**kwargs` included, after unwrapping `torch.compile` and DDP) is probed once, unwrapped,
on two rows of the first batch's tensors (labels set to 0, so every one counts) in eval mode under
no_grad with the RNG forked; the ratio of its loss with `num_items_in_batch=1` to its plain loss is
the number of labels it counts (shifted by one for causal LMs), or 1 when it ignores the count.

A `loss_fn` that takes a `num_items_in_batch` keyword gets the same global count (the model's
count when the model honours it, else the labels that are not -100, or the rows when the batch has
no labels) and weighs 1. Any other loss (a `loss_fn`, or a model's own that ignores the count) is
asked how it reduces over its batch (engine/reduction: a mean over rows, over label tokens shifted
or not, or a sum) and weighted by that; what was found is said once. A loss that matches none is
weighted by rows, with a warning naming the losses measured.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Callable

import torch

from autofit import torch_internals as ti
from autofit.engine.batches import IGNORE_INDEX, rows_of, labels_of, slice_batch, weights
from autofit.engine.reading import rng_untouched
from autofit.engine.reduction import ROWS, SHIFTED, SUM, ask_reduction, couples_in_training
from autofit.plans.coupling import declared
from autofit.engine.reduction import output_loss as _loss

log = logging.getLogger("autofit")

ITEMS = "num_items_in_batch"


def unwrap(model):
    """The module whose forward defines the signature: through torch.compile and DDP/DataParallel."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel
    while True:
        if ti.compiled_original(model) is not None:
            model = ti.compiled_original(model)
        elif isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        else:
            return model


def forward_takes_items(model) -> bool:
    """Whether the model's forward accepts `num_items_in_batch` (by name or through **kwargs)."""
    inner = unwrap(model)
    if getattr(inner, "accepts_loss_kwargs", True) is False:  # Hugging Face's own opt-out
        return False
    return _takes(inner.forward, var_keyword=True)


def loss_fn_takes_items(loss_fn) -> bool:
    """Whether `loss_fn` names a `num_items_in_batch` parameter (**kwargs alone does not count)."""
    return _takes(loss_fn, var_keyword=False)


def _takes(fn, var_keyword: bool) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == ITEMS and p.kind != p.POSITIONAL_ONLY) or (var_keyword and p.kind == p.VAR_KEYWORD)
               for p in params)


def label_tokens(shifted: bool) -> Callable:
    """Counts a batch's label tokens (not -100); a causal LM's first label of each row never counts."""
    def count(batch):
        labels = labels_of(batch)
        if labels is None or labels.is_floating_point():
            return None
        if shifted and labels.dim() >= 2:
            labels = labels[..., 1:]
        return int((labels != IGNORE_INDEX).sum())
    return count


def weightless(batch):
    """A micro-batch that counts no label token (weight 0) but must still run (FSDP's collectives
    pair across ranks), made safe to run: its loss is a mean over no token, NaN, and 0 * NaN is NaN
    in the loss and, through a division by the count, in the gradients. So its last label (which
    counts, shifted or not) becomes 0, in a copy (the user's batch is untouched): the loss is
    finite and the weight 0 makes its contribution exactly zero. A batch without integer labels
    is returned as it is."""
    labels = labels_of(batch)
    if labels is None or labels.is_floating_point() or labels.numel() == 0:
        return batch
    counted = labels.clone()
    counted.view(-1)[-1] = 0
    return {**batch, "labels": counted}


def _rows_or_labels(batch):
    counted = label_tokens(False)(batch)
    return rows_of(batch) if counted is None else counted


@dataclass(frozen=True)
class LossWeighting:
    """What one micro-batch's loss weighs, and what its forward (or loss_fn) is told."""

    count: Callable | None = None   # batch -> items its loss averages over; None: rows
    pass_items: bool = False        # hand num_items_in_batch=count(global batch) on; each part weighs 1
    why: str = "rows: a per-row mean"
    summed: bool = False            # the loss is a sum over its batch: micro losses add, each weighs 1
    coupled: str = ""               # how the loss of two rows differs from its parts' (it couples rows)

    def shares(self, batch, parts) -> list[float]:
        if self.summed:
            return [1.0] * len(parts)
        if self.pass_items:
            self.items(batch)  # refuses a batch with no label token, as weights() does
            return [1.0] * len(parts)
        return weights(batch, parts, self.count)

    def items(self, batch) -> dict:
        """The keyword every micro-batch of `batch` gets: {} or {"num_items_in_batch": n}."""
        if not self.pass_items:
            return {}
        n = self.count(batch)
        if n == 0:
            raise ValueError("the batch has no label token to learn from (every label is -100); "
                             "drop such batches or check the labels.")
        return {ITEMS: n}


def probe_counting(model, batch, device) -> str | None:
    """How the model counts the items its loss averages over, found with two rows of `batch`:
    "shifted" (next-token labels), "unshifted", or None (the loss ignores `num_items_in_batch`, or
    the probe could not tell)."""
    labels = labels_of(batch)
    if labels is None or labels.dim() == 0 or rows_of(batch) < 2:
        return None
    try:
        with _probing(model, device) as inner:
            part = _tensors(batch, 2)
            if not part["labels"].is_floating_point():
                part["labels"] = torch.zeros_like(part["labels"])  # every label counts: the counts differ
            unshifted = part["labels"].numel()
            shifted = part["labels"][..., 1:].numel() if part["labels"].dim() >= 2 else None
            part = device.to_device(part)
            mean = _loss(inner.forward(**part))
            one = torch.ones((), dtype=torch.long, device=mean.device) if mean is not None else 1
            summed = _loss(inner.forward(**part, **{ITEMS: one}))
            mean, summed = [None if x is None else x.item() for x in (mean, summed)]
    except Exception as error:  # noqa: BLE001 -- a probe never stops a run; training will show the error
        log.info("num_items_in_batch probe of %s failed (%s: %s); micro-batches are weighted without it",
                 type(unwrap(model)).__name__, type(error).__name__, error)
        return None
    if mean is None or summed is None or not math.isfinite(mean) or mean == 0:
        return None
    ratio = summed / mean
    if math.isclose(ratio, unshifted, rel_tol=1e-4):
        return "unshifted"
    if shifted is not None and math.isclose(ratio, shifted, rel_tol=1e-4):
        return "shifted"
    return None


_SHIFTS: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def token_counter(model, device=None) -> "callable | None":
    """For token-level losses: a function counting the label tokens a batch contributes.

    A model whose loss shifts labels by one (next-token prediction) never counts a row's first
    label; the model says so itself (`shifts_labels`, asked at the first batch with
    per-token labels, rows moved with `device`, an autofit device, or where the model is). Serves
    evaluation and throughput, on the module inside torch.compile/DDP wrappers.
    """
    def count(batch):
        labels = labels_of(batch)
        if labels is None or labels.dim() < 2 or labels.is_floating_point():
            return None
        if shifts_labels(model, batch, device):
            labels = labels[..., 1:]
        return int((labels != IGNORE_INDEX).sum())
    return count


def shifts_labels(model, batch, device=None, call=None) -> bool:
    """Whether the model's own loss shifts per-token labels by one (next-token prediction), so a
    row's first label never counts. Found by asking the model, not its class name, once per model:
    one row of `batch` with only the first and the last label of the row kept; a loss that moves
    when the last label changes but not when the first one does shifts them. False when `batch`
    has no per-token labels or the model's loss does not tell (the labels that are not -100 count).
    `call(module, kwargs) -> output` runs the probe's forwards (default: `module.forward(**kwargs)`;
    a sharded model's must go through FSDP's hooks on every rank at once)."""
    labels = labels_of(batch)
    if labels is None or labels.dim() < 2 or labels.is_floating_point() or labels.shape[-1] < 2:
        return False
    inner = unwrap(model)
    if inner not in _SHIFTS:
        _SHIFTS[inner] = _probe_shift(inner, batch, device if device is not None else _ModelsDevice(inner),
                                      call)
    return _SHIFTS[inner]


def _probe_shift(model, batch, device, call=None) -> bool:
    call = call if call is not None else (lambda module, kwargs: module.forward(**kwargs))
    try:
        with _probing(model, device) as inner:
            part = device.to_device(_tensors(batch, 1))
            kept = torch.full_like(part["labels"], IGNORE_INDEX)
            kept[..., 0] = kept[..., -1] = 0
            first, last = kept.clone(), kept.clone()
            first[..., 0] = last[..., -1] = 1
            losses = [_loss(call(inner, {**part, "labels": labels})) for labels in (kept, first, last)]
            base, first, last = [math.nan if x is None else x.item() for x in losses]
    except Exception as error:  # noqa: BLE001 -- a probe never stops a run
        log.info("cannot tell whether %s shifts its labels (%s: %s); every label that is not -100 counts",
                 type(model).__name__, type(error).__name__, error)
        return False
    if not (math.isfinite(base) and _moved(base, last)):
        log.info("cannot tell whether %s shifts its labels (its loss does not follow them); every label "
                 "that is not -100 counts", type(model).__name__)
        return False
    return not _moved(base, first)


def _moved(a: float, b: float) -> bool:
    return math.isfinite(b) and abs(a - b) > 1e-6 * max(abs(a), abs(b))


@contextlib.contextmanager
def _probing(model, device, train: bool = False):
    """The module itself (no DDP collective, no compilation for a probe) in eval mode (`train`: in
    the modes the run trains it in, a module the user keeps in eval mode included), under no_grad,
    in host memory, leaving the RNG and each module's train/eval mode as they were. Call its
    `forward`, not `__call__`: hooks the user put on the model (step counters, fault injection) see
    training forwards only (a sharded model's probe excepted: FSDP gathers in its hooks, see
    shifts_labels)."""
    inner = unwrap(model)
    modes = [(m, m.training) for m in inner.modules()]
    try:
        with rng_untouched(inner), torch.no_grad(), device.host():
            if not train:
                inner.eval()
            yield inner
    finally:
        for module, mode in modes:
            module.training = mode


def _tensors(batch, rows: int) -> dict:
    """The first `rows` rows of a dict batch, tensors only: other fields are the loss_fn's business."""
    return {k: v for k, v in slice_batch(batch, 0, min(rows, rows_of(batch))).items()
            if isinstance(v, torch.Tensor)}


class _ModelsDevice:
    """Where no autofit device is given: the probe's row goes where the model's parameters are."""

    def __init__(self, model):
        self.param = next(model.parameters(), None)

    def host(self):
        return contextlib.nullcontext()

    def to_device(self, batch):
        return batch if self.param is None else {k: v.to(self.param.device) for k, v in batch.items()}


def loss_weighting(model, batch, loss_fn, device, probe: bool = True, call=None, ask: bool = True) -> LossWeighting:
    """The weighting of a run's micro-batches, decided once from its first batch (and said once).
    A loss that takes `num_items_in_batch` is told the global count; any other is asked how it
    reduces (engine/reduction: rows mean, label-token mean shifted or not, sum). `probe=False`
    never runs the model (a sharded model's forward communicates): whether its loss shifts labels
    is still asked, through `call` (see shifts_labels), and a loss_fn is weighted by rows; `ask=False`
    does not ask the reduction (under torch.distributed every rank must weigh alike, and a probe that
    failed on one rank only would part them), so a loss_fn is weighted by rows and a model's own
    loss by its label tokens."""
    name = type(unwrap(model)).__name__
    labels = labels_of(batch)
    token_level = labels is not None and labels.dim() >= 2 and not labels.is_floating_point()
    fn_items = loss_fn is not None and loss_fn_takes_items(loss_fn)
    counting = None
    if (loss_fn is None or fn_items) and labels is not None and isinstance(batch, Mapping) \
            and probe and forward_takes_items(model):
        counting = probe_counting(model, batch, device)
    if fn_items:
        count = label_tokens(counting == "shifted") if counting else _rows_or_labels
        return LossWeighting(count, True, f"loss_fn gets num_items_in_batch ({counting or 'labels not -100, else rows'})")
    if loss_fn is None and counting is not None:
        return LossWeighting(label_tokens(counting == "shifted"), True,
                             f"{name} divides its loss by num_items_in_batch ({counting} labels)")
    whose = "loss_fn" if loss_fn is not None else f"{name}'s loss"
    found = ask_reduction(model, batch, loss_fn, device, probing=_probing) if probe and ask else None
    if found is not None and found.kind is not None:
        weighting = _reduced(found.kind, whose)
        said = weighting.why if found.kind in (ROWS, SUM) else f"a mean over {weighting.why}"
        log.info("%s is %s (asked with two rows: %s); micro-batches are weighted by it",
                 whose, said, found.measured)
        if not declared(unwrap(model)):  # (layers known or declared are plans/coupling's)
            measured = couples_in_training(model, batch, loss_fn, device, _probing, found.kind)
            if measured is not None:  # weighted as found, but the training forward couples rows
                return replace(weighting, coupled=f"{whose} in training mode ({measured})")
        return weighting
    if found is not None and found.finite and not found.ambiguous:
        # Not a weighted combination of its rows' losses: the rows are coupled (in-batch negatives,
        # a batch statistic). plans/coupling says so once and keeps the batch whole first.
        return LossWeighting(why="rows: the loss couples its rows, so a split batch is weighted by rows",
                             coupled=f"{whose} ({found.measured})")
    if loss_fn is not None:
        if token_level:
            log.info("loss_fn takes no num_items_in_batch keyword, so micro-batches are weighted by rows; "
                     "for a mean over label tokens, give loss_fn a num_items_in_batch parameter and divide "
                     "the summed loss by it (autofit passes the global batch's label-token count)")
        return LossWeighting()
    weighting = LossWeighting()
    if token_level:
        shifted = shifts_labels(model, batch, device, call)
        weighting = LossWeighting(label_tokens(shifted), False,
                                  f"label tokens (not -100, {'shifted' if shifted else 'unshifted'})")
    if labels is not None and forward_takes_items(model):
        log.info("%s's loss ignores num_items_in_batch although its forward takes it; micro-batches are "
                 "weighted by %s", name, weighting.why if token_level else "rows")
    return weighting


def _reduced(kind: str, whose: str) -> LossWeighting:
    if kind == SUM:
        return LossWeighting(why="a sum over its rows: micro-batch losses add, each weighs 1", summed=True)
    if kind == ROWS:
        return LossWeighting(why="a mean over rows")
    return LossWeighting(label_tokens(kind == SHIFTED), False, f"label tokens (not -100, {kind})")
