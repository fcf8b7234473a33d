"""Evaluation: the model's loss (and metrics) on held-out data, with its own batch size and OOM ladder.
The evaluator's loop, its attempt, its ladder and its metric checks read as one.

Evaluation never trains (guarantee 5): it runs in `torch.inference_mode()` with the model in eval
mode, creates no gradient, never touches the optimizer, and never changes the training plan. It has
its own batch size, larger than training's micro-batch where memory allows (no saved activations,
no gradients), and its own small ladder: on an out-of-memory error the evaluation batch is halved,
a size known to fail is never tried again, and the rows that failed are evaluated again at the
smaller size, so every sample counts exactly once. An `EvalSizer` remembers the working size between
calls, which is how `autofit.run` keeps it from one epoch to the next.

The loss is the weighted mean of the per-batch mean losses, weighted by rows, or by label tokens for
token-level losses (as in training), so it equals one plain `torch.no_grad()` pass over all the data
at once, whatever sizes the ladder settled on.

Data:
- a map-style `Dataset`: read in order (no shuffling) and collated with `default_collate`, as many
  samples at a time as the current evaluation batch size;
- any iterable of batches (a `DataLoader`, a list): each batch it yields is evaluated in evaluation
  batches of the current size (the whole batch at once when no size was asked for); batches are
  never merged.

`metric_fn(output, batch) -> dict[str, float]` is called once per evaluation batch with the model's
output for that batch (what `model(...)` returned, e.g. a Hugging Face output with `.logits`; with a
`loss_fn`, the output of the last top-level `model(...)` call it made, or None if it made none) and
the batch itself, on the device. Each value is that batch's mean over its samples (a float or a
0-dimensional tensor); the result is their mean weighted by the batch's samples, so a metric that is
a mean over samples (accuracy) comes out exact.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from autofit import torch_internals as ti
from autofit.engine.attempt import Attempter, Outcome, outside, until_fits
from autofit.engine.batches import slice_batch
from autofit.engine.token_loss import token_counter
from autofit.engine.interfaces import Batch, Data, Device, LossFn, MetricFn, Pace, Size
from autofit.engine.kept import copied, joined
from autofit.engine.layout import Layout
from autofit.gpu.device import open_device
from autofit.recipes.eval_pace import Alone
from autofit.recipes.eval_data import Cursor, check_arguments, check_data, is_map_dataset, units
from autofit.recipes.eval_sizer import EvalAttempt, EvalSizer
from autofit.errors import DoesNotFit, MetricError, NoLossError
from autofit.gpu.oom import is_oom
from autofit.engine.step import compute_loss

log = logging.getLogger("autofit")

# A map-style Dataset evaluated on its own, with no size asked for, starts here; the ladder halves it.
DEFAULT_DATASET_BATCH = 128
# autofit.run starts evaluation at this many times the training micro-batch: an inference forward
# keeps one layer's working memory instead of every layer's saved activations, and needs neither
# gradients nor a second copy of anything, so several training micro-batches fit in its place.
EVAL_START_FACTOR = 4
RESERVED_KEYS = ("epoch", "loss", "samples", "batch_size")


@dataclass
class EvalResult:
    loss: float                 # weighted mean loss over every sample (label tokens for token losses)
    samples: int                # rows evaluated
    batch_size: int             # the evaluation batch that worked (most rows in one forward at the end)
    attempts: list = field(default_factory=list)   # list[EvalAttempt]
    metrics: dict = field(default_factory=dict)    # name -> sample-weighted mean of metric_fn values
    weight: float = 0.0         # what the loss is a mean over: rows, or label tokens (to combine ranks')
    # What a loss_fn returning (loss, kept) kept, joined over every row evaluated, in order (this
    # rank's rows), as normal tensors on the device: an evaluation's final recurrent state, say.
    kept: object = None

    def record(self, epoch: int) -> dict:
        """The entry autofit.run appends to `result.eval_history`."""
        return {"epoch": epoch, "loss": self.loss, "samples": self.samples,
                "batch_size": self.batch_size, **self.metrics}


# -- the evaluator ------------------------------------------------------------------------------

def _modes(model):
    return [(m, m.training) for m in model.modules()]


def _buffers(model):
    return {(id(m), name): b for m in model.modules() for name, b in ti.own_buffers(m).items() if b is not None}


def _normal_buffers(model, before: dict) -> None:
    """Buffers a forward (re)created under inference_mode are inference tensors, which autograd
    refuses to save for backward; give them back as normal tensors so training can go on."""
    for m in model.modules():
        for name, b in list(ti.own_buffers(m).items()):
            if b is not None and b.is_inference() and before.get((id(m), name)) is not b:
                ti.own_buffers(m)[name] = b.clone()


def _metric_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


@dataclass(frozen=True)
class EvalOptions:
    """How one evaluation runs, besides its model, data, device and sizer (see `evaluate`)."""

    loss_fn: LossFn | None = None          # already seeing batches as the data gives them
    metric_fn: MetricFn | None = None
    batch_size: int | None = None          # the most rows one forward may take
    start_batch_size: int | None = None
    expect_like: Batch | None = None
    progress: bool = False
    pace: Pace | None = None               # None: alone


class _Evaluator:
    def __init__(self, model, device, options: EvalOptions, sizer: EvalSizer, first_reason: str):
        self.model, self.device = model, device
        self.loss_fn, self.metric_fn = options.loss_fn, options.metric_fn
        self.sizer, self.ceiling, self.expect_like = sizer, options.batch_size, options.expect_like
        self.pace = options.pace if options.pace is not None else Alone()
        self.count_tokens = token_counter(model, device) if self.loss_fn is None else None
        self.reason = first_reason
        self.attempts: list[EvalAttempt] = []
        self.output = None  # the model's output of the current forward, for metric_fn
        self.loss_sum, self.weight_sum, self.samples = 0.0, 0, 0
        self.metric_sums: dict[str, float] = {}
        self.kept: list = []  # each accepted forward's kept outputs (engine/kept.py), in row order
        self.final_rows = 0  # most rows run in one forward since the last step-down
        self.trying = 0      # rows of the current attempt (under a lockstep: the most any rank runs)
        # Whatever evaluation made is an inference tensor; training state (params, grads, optimizer)
        # is not: those are what to name when memory stays above the baseline. Under no_grad (a
        # sharded model) it is whatever lives outside the model.
        holders = (lambda: [t for t in device.live_tensors() if t.is_inference()]) \
            if self.pace.grad_mode is torch.inference_mode else outside(device, model)
        self.attempter = Attempter(device, holders=holders, free=self.pace.abandon)

    def capture(self, module, args, output):
        self.output = output

    def run(self, units, progress: bool) -> EvalResult:
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = units = tqdm(units, desc="eval", leave=False)
        cursor = Cursor(units, self.expect_like)
        try:
            while True:
                outcome = until_fits(partial(self.attempt, cursor),
                                     partial(self.after_oom, cursor=cursor))
                if outcome.value is None:
                    break  # the data is done (on every rank)
                self.accept(*outcome.value, cursor, outcome.peak)
        finally:
            if bar is not None:
                bar.close()
            self.pace.close()
        if self.samples == 0:
            raise ValueError("evaluation data yielded no batch; give at least one.")
        if self.weight_sum == 0:
            raise ValueError("the evaluation data has no label token (every label is -100), so it has no "
                             "loss; check the labels.")
        metrics = {k: v / self.samples for k, v in self.metric_sums.items()}
        return EvalResult(self.loss_sum / self.weight_sum, self.samples, self.final_rows,
                          self.attempts, metrics, self.weight_sum, self.kept)

    def attempt(self, cursor):
        """One forward of as many rows of the current unit as the sizer allows now; None when the
        data is done. Under a lockstep every rank agrees on the size first, and a rank whose data
        is done runs one row of its own, dropped, so the ranks' forwards pair."""
        failure, want = None, None
        try:
            left = cursor.remaining()
            want = None if left is None else self.sizer.rows(left, self.ceiling)
        except Exception as error:  # told to the other ranks, then raised
            failure = error
        try:
            size = self.pace.size(want, failure)
        finally:
            failure = None
        if size is None:
            return Outcome(True, None)
        if size == 0:
            raise DoesNotFit(
                f"evaluation of one row ran out of memory earlier (batch {cursor.index}) on "
                f"{self.device.describe()}; free memory held outside the model (an old optimizer, "
                f"outputs kept in a list) or evaluate with a larger budget.", attempts=self.attempts,
                budget=self.device.budget)
        self.trying = size
        mine = min(want or 0, size)
        part = cursor.take(mine) if mine else self._filler(cursor)
        self.device.reset_peak_memory_stats()
        return self.attempter(lambda: self.paced(part, cursor.index, cursor.first + cursor.pos, mine)
                              + (mine, size), peak=self.device.max_memory_allocated)

    def _filler(self, cursor):
        if cursor.filler is not None:
            return cursor.filler
        if self.expect_like is not None:
            return slice_batch(self.expect_like, 0, 1)
        raise ValueError("this rank's share of the evaluation data has no row, and a sharded model's "
                         "forward must run on every rank; give every rank evaluation rows (at least "
                         "as many rows as ranks).")

    def paced(self, part, index: int, first: int, rows: int):
        """`forward`, then the ranks' agreement on how it went (nothing in one process)."""
        failure, value = None, (0.0, 0, None, None)
        try:
            with self.pace.forward():
                value = self.forward(part, index, first, rows)
        except Exception as error:  # noqa: BLE001 -- every rank hears of it, then it is raised
            failure = error
        try:
            self.pace.after(failure)
        finally:
            failure = None
        return value

    def after_oom(self, outcome, cursor) -> bool:
        size, index, first = self.trying, cursor.index, cursor.first + cursor.pos
        self.attempts.append(EvalAttempt(size, "oom", self.reason, index, first, outcome.peak, outcome.error))
        key = (index, first, size)  # as in training: the cache's holes replay the same size once
        if why := self.attempter.empty_cache_for_replay(outcome, key):
            self.reason = why
            return True
        new = self.sizer.oom(size)
        if new is None:
            raise DoesNotFit(
                f"evaluation ran out of memory with a batch of 1 row (batch {index}, sample "
                f"{first}) on {self.device.describe()}; the training plan is "
                f"untouched. Free memory held outside the model (an old optimizer, outputs kept "
                f"in a list) or evaluate with a larger budget.", attempts=self.attempts,
                budget=self.device.budget)
        self.reason = f"halved after {size} rows ran out of memory"
        self.final_rows = 0
        log.warning("evaluation ran out of memory with %d rows (%s); halving to %d", size, outcome.error, new)
        return True

    def forward(self, part, index: int, first: int, size: int):
        """One evaluation batch of `size` rows (0: a filler row whose result is dropped): (loss as
        a float, its weight, metrics). Allocates on the device."""
        weight = self.count_tokens(part) if self.count_tokens is not None and size else None
        if weight is None:
            weight = size
        try:
            with self.pace.grad_mode():
                part = self.device.to_device(part)
                keeps = []
                try:
                    loss = compute_loss(self.model, part, self.loss_fn, keep=keeps.append)
                except NoLossError as error:
                    raise NoLossError(f"cannot evaluate {type(self.model).__name__}: {error}") from None
                value = loss.float().item() if weight else 0.0  # a batch with no label token has no loss
                del loss
                metrics = self.metrics(part, index, first, size) if self.metric_fn is not None and size else None
        finally:
            self.output = None  # the hook's output of this forward, passed to metric_fn only
        kept = copied(keeps[0]) if keeps and size else None  # a filler's are dropped
        return value, weight, metrics, kept

    def metrics(self, part, index: int, first: int, size: int) -> dict:
        name = _metric_name(self.metric_fn)
        where = f"evaluation batch {index} (samples {first}-{first + size - 1})"
        try:
            values = self.metric_fn(self.output, part)
            if not isinstance(values, Mapping):
                raise TypeError(f"it returned {type(values).__name__}; return a dict of name -> float")
            out = {}
            for key, v in values.items():
                if not isinstance(key, str) or key in RESERVED_KEYS:
                    raise ValueError(f"metric name {key!r} is not allowed; use a str other than "
                                     f"{', '.join(RESERVED_KEYS)}")
                out[key] = float(v.item() if isinstance(v, torch.Tensor) else v)
            return out
        except Exception as error:
            if is_oom(error):
                raise
            raise MetricError(f"metric_fn {name} failed on {where}: {type(error).__name__}: {error}. "
                              f"The model is back in its previous mode; fix the metric function or "
                              f"pass metric_fn=None.") from error

    def accept(self, loss, weight, metrics, kept, rows, size, cursor, peak) -> None:
        """Count a forward that fitted: `rows` of this rank's data (0 for a filler) in an attempt
        of `size` rows (the most any rank ran)."""
        self.sizer.ok(size)
        last = self.attempts[-1] if self.attempts else None
        if last is None or last.outcome == "oom":
            self.attempts.append(EvalAttempt(size, "ok", self.reason, cursor.index, cursor.first + cursor.pos,
                                             peak))
            self.reason = "kept: fitted the previous evaluation batch"
        self.final_rows = max(self.final_rows, size)
        if kept is not None and rows:
            self.kept.append(kept)
        cursor.advance(rows)
        if weight:
            self.loss_sum += loss * weight
            self.weight_sum += weight
        if metrics is not None:
            if self.samples and set(metrics) != set(self.metric_sums):
                raise MetricError(f"metric_fn {_metric_name(self.metric_fn)} returned the keys "
                                  f"{sorted(metrics)} on evaluation batch {cursor.index} but "
                                  f"{sorted(self.metric_sums)} before; return the same keys every time.")
            for key, v in metrics.items():
                self.metric_sums[key] = self.metric_sums.get(key, 0.0) + v * rows
        self.samples += rows


# Public API (docs/run.md): the keywords users pass; inside, they are one frozen EvalOptions.
def evaluate(model: torch.nn.Module, data: Data, *, loss_fn: LossFn | None = None, batch_size: int | None = None,
             budget: Size | None = None, metric_fn: MetricFn | None = None, device: Device | None = None,
             start_batch_size: int | None = None, sizer: EvalSizer | None = None,
             expect_like: Batch | None = None, progress: bool = False, pace: Pace | None = None,
             batch_dim: int | dict | None = None, layout: Layout | None = None) -> EvalResult:
    """Evaluate `model` on `data` without training it; returns an EvalResult.

    - `batch_size`: the most rows one forward pass may take (and, without `start_batch_size`, the
      first size tried). Default: a map-style Dataset starts at DEFAULT_DATASET_BATCH rows; an
      iterable's batches are evaluated whole. Either way an OOM halves the evaluation batch.
    - `start_batch_size`: the first size tried when `sizer` knows none yet (autofit.run passes
      EVAL_START_FACTOR times the training micro-batch).
    - `sizer`: an EvalSizer kept between calls: the size that worked is reused, a size that failed is
      never tried again.
    - `device`: an open autofit Device (autofit.run passes its own); else one is opened for `budget`
      (as in autofit.run) and the model is placed on it.
    - `expect_like`: a training batch; each evaluation batch must have the same keys/arity.
    - `metric_fn(output, batch) -> dict[str, float]`: see the module docstring.
    - `pace`: how evaluation keeps step with other ranks (autofit.recipes.eval_pace; a sharded
      model's run passes autofit.distributed.eval_lockstep's); None: alone.
    - `batch_dim`: where the rows of the data's batches are (autofit.engine.layout; 1 for
      time-first batches); `loss_fn` and `metric_fn` see batches as the data gives them.
      `layout`: autofit.run's own (its data already row-first, its loss_fn already seeing batches
      as given), instead of `batch_dim`.
    The model's train/eval mode (each submodule's) is restored afterwards, also on error; parameters,
    gradients and the optimizer are never touched.
    """
    check_arguments(model, loss_fn, metric_fn, batch_size, start_batch_size, device, budget)
    check_data(data)
    if layout is None:
        layout = _layout(model, data, batch_dim)
        data, loss_fn = layout.over(data), layout.loss_fn(loss_fn)
    options = EvalOptions(loss_fn=loss_fn, metric_fn=layout.metric_fn(metric_fn), batch_size=batch_size,
                          start_batch_size=start_batch_size, expect_like=expect_like, progress=progress,
                          pace=pace)
    sizer = sizer if sizer is not None else EvalSizer()
    reason = _first_size(sizer, options, data)
    opened = contextlib.nullcontext(device) if device is not None else open_device(budget)
    with opened as dev:
        if device is None:
            dev.place_model(model)
        with _evaluation_mode(model, dev):
            result = _evaluate_on(dev, model, data, options, sizer, reason)
        result.kept = joined(result.kept, layout)
        return result


def _layout(model, data, batch_dim) -> Layout:
    layout = Layout(batch_dim)
    layout.check_model(model)
    if not layout.row_first and is_map_dataset(data):
        raise ValueError(f"batch_dim={batch_dim!r} with a map-style Dataset "
                         f"({type(data).__name__}): its samples are collated rows first; pass "
                         f"batches laid out as batch_dim says (a DataLoader or a list), or no batch_dim.")
    return layout


def _first_size(sizer: EvalSizer, options: EvalOptions, data) -> str:
    """Give `sizer` the first evaluation batch size when it knows none yet; returns why that size."""
    if sizer.size is not None:
        reason = f"kept: {sizer.size} rows, the evaluation batch of an earlier evaluation"
    elif options.start_batch_size is not None:
        sizer.size, reason = options.start_batch_size, f"start: start_batch_size={options.start_batch_size}"
    elif options.batch_size is not None:
        sizer.size, reason = options.batch_size, f"start: batch_size={options.batch_size}"
    elif is_map_dataset(data):
        sizer.size, reason = DEFAULT_DATASET_BATCH, f"start: the default of {DEFAULT_DATASET_BATCH} rows"
    else:
        reason = "start: each batch as the data yields it"
    if sizer.fails is not None:
        reason += f" (below {sizer.fails} rows, known to fail)"
    return reason


@contextlib.contextmanager
def _evaluation_mode(model, device):
    """The model in eval mode, and every submodule's mode and normal buffers back afterwards."""
    modes, buffers = _modes(model), _buffers(model)
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
        _normal_buffers(model, buffers)
        device.empty_cache()


def _evaluate_on(device, model, data, options: EvalOptions, sizer: EvalSizer, reason: str) -> EvalResult:
    evaluator = _Evaluator(model, device, options, sizer, reason)
    hook = model.register_forward_hook(evaluator.capture) if options.metric_fn is not None else None
    try:
        return evaluator.run(units(data, sizer, options.batch_size, device.host), options.progress)
    finally:
        if hook is not None:
            hook.remove()
        evaluator.output = None
