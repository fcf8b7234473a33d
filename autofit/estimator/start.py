"""Where a run starts: the cached plan, else the fastest plan the estimator predicts to fit.

The capacity check estimates candidate plans on fake tensors before the first step. The run then
starts from the fastest plan predicted to fit the budget, and OOMs only correct the estimate. It
compares like with like (`headroom`): where the budget caps what the caching allocator reserves (a
CUDA card; a simulated GPU with caps="reserved") the estimate's reserved peak; where it caps live
tensor bytes (the simulated GPU's default) the allocated peak. The estimates hold the device's own
bytes (cuBLAS/cuBLASLt workspaces, `autofit.gpu.workspaces`: a card's by its compute capability, a
simulated GPU's as made), and the budget keeps back only what no estimate can place: cuDNN's
convolution workspaces, on a model with convolutions. Estimates are scaled by the calibration measured for this model
on this device (`autofit.estimator.guide`). When no plan can fit, the run stops before training with
what would be needed. The check is optional: when the estimator cannot follow the model (an error of
any kind inside it), that is said in one line and the run starts as it would without the check.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from autofit.engine.batches import rows_of, row_elements
from autofit.estimator.capacity import (Fit, Space, choose, leanest, make_estimator, needs_message, no_offload,
                                        own_bytes, rank, usable_bytes)
from autofit.estimator.guide import Guide
from autofit.gpu.workspaces import Workspaces
from autofit.errors import DoesNotFit, one_line
from autofit.plans.applies import not_applicable
from autofit.plans.plan import Plan
from autofit.plans.sizelog import config_of
from autofit.engine.reading import rng_untouched
from autofit.sizes import format_size

log = logging.getLogger("autofit")

# The CUDA context lies outside the budget: `tensor_budget` reads the free memory after the context
# exists, and `autofit probe` subtracts its context reserve from the card's memory.
SETTLE_WITHIN = 0.1  # from an estimated start, probe upward only for gains above 10%


def tensor_budget(device) -> int | None:
    """Bytes tensors may occupy on the device, or None where nothing is counted or limited."""
    if not device.counts:
        return None
    if device.budget is not None:
        return device.budget
    free = device.free_bytes()
    return None if free is None else free + device.memory_allocated()


def budget_caps(device) -> str:
    """The peak the device's budget limits: "reserved" on CUDA (set_per_process_memory_fraction caps
    what the caching allocator reserves) and on a simulated GPU made with caps="reserved";
    "allocated" where the budget caps live tensor bytes (the simulated GPU's default)."""
    if device.type == "cuda":
        return "reserved"
    return getattr(getattr(device, "gpu", None), "caps", "allocated")


def headroom(device, model=None) -> dict:
    """`Fit`'s fields for comparing an estimate with this device's budget: which peak, the
    device's own bytes the estimates hold (`workspaces`: None where it has none), and the bytes kept
    back for what no estimate places (cuDNN's workspaces for `model`'s convolutions; for any model
    when `model` is None)."""
    workspaces = Workspaces.of_device(device)
    return {"caps": budget_caps(device), "reserve": workspaces.reserve(model),
            "workspaces": workspaces if workspaces.resident else None}


def make_guide(device, calibration: float | None = None, model=None) -> Guide | None:
    """A Guide for the device's budget (None where nothing is counted or limited)."""
    budget = tensor_budget(device)
    if budget is None:
        return None
    room = headroom(device, model)
    constant = own_bytes(room["workspaces"], room["caps"])
    return Guide(device, room["caps"], usable_bytes(budget, reserve=room["reserve"]), calibration,
                 constant=constant)


def longest_batch(data, first):
    """The batch with the most elements when the data is a list of batches (the longest sequence
    decides the plan), else the first."""
    if not isinstance(data, Sequence) or isinstance(data, (str, bytes)) or len(data) > 10_000:
        return first

    def elements(batch):
        from autofit.gpu.device import _tensors
        return sum(t.numel() for t in _tensors(batch))
    return max(data, key=elements)


def _first_whole_fitting(plans, estimator, budget, fit: Fit):
    """(plan, reason) for the first of `plans` predicted to fit `budget` (as `fit` judges them), or
    None."""
    usable = fit.usable(budget, estimator)
    for plan in plans:
        peak = estimator.measure(plan).peak(fit.caps)
        if peak * fit.calibration <= usable:
            reason = (f"estimated: the first whole-batch plan of the ladder predicted to fit (peak "
                      f"{format_size(peak)} of {format_size(budget)}); batch-coupled layers keep the "
                      f"batch whole first")
            log.info("capacity check: %s", reason)
            return plan, reason
    return None


def cannot_estimate(model, error: BaseException, instead: str) -> None:
    """Say in one line that the capacity check could not estimate `model`, why, and what happens."""
    log.warning("capacity check: cannot estimate %s (%s); %s", type(model).__name__,
                one_line(error), instead)


@dataclass(frozen=True)
class TrainingStep:
    """The training step a capacity check prices: `model` on one global `batch`, with its
    `optimizer` and `loss_fn` as `autofit.estimate` takes them."""

    model: object
    batch: object
    optimizer: object = None
    loss_fn: object = None


def estimated_start(step: TrainingStep, device, precision: str, sizes, *, coupling=None,
                    guide: Guide | None = None):
    """(plan, reason) from the capacity check of `step` on `device`, None when there is nothing to
    check against; the sizes predicted not to fit are recorded in `sizes` (a SizeLog). With
    `coupling` (a plans.coupling.Coupling) that keeps the batch whole first, the start is the first
    whole-batch plan of its ladder predicted to fit; the fastest plan of all only when none does.
    `guide` (from `make_guide`) gives the calibration and keeps the estimator for the run's upward
    search."""
    budget = tensor_budget(device)
    if budget is None:
        return None
    model, batch = step.model, step.batch
    device_type = "cuda" if device.type == "cuda" else "cpu"
    room = headroom(device, model)
    calibration = 1.0 if guide is None else guide.calibration
    whole = [] if coupling is None else \
        [p for p in coupling.whole_plans(rows_of(batch), precision, device.supports_bf16())
         if not_applicable(p, model, step.optimizer, device) is None]
    try:
        with rng_untouched(model):  # fake-tensor work must not move the RNG the first step draws from
            estimator = make_estimator(model, batch, step.optimizer, step.loss_fn, device_type=device_type,
                                       workspaces=room["workspaces"])
            # (the fit keeps back what a sharded estimate does not hold: see capacity.unplaced)
            fit = Fit(calibration=calibration, **room)
            kept = _first_whole_fitting(whole, estimator, budget, fit)
            if kept is not None:
                sizes.record(kept[0], ok=True, length=row_elements(batch))
                return kept
            if coupling is not None and not coupling.allow_split:  # no split to rank: the ladder tries each whole plan
                log.info("capacity check: no whole-batch plan predicted to fit, and allow_split=False "
                         "forbids splitting; starting from the whole batch, the ladder tries each whole plan")
                return None
            candidates = rank(estimator, batch, budget, fit=fit,
                              space=Space(precision, bf16_supported=device.supports_bf16()))
    except Exception as error:  # the check is optional: an estimator failure never stops a run
        cannot_estimate(model, error, "starting from the whole global batch; the ladder finds the plan")
        return None
    chosen = choose(candidates)
    if chosen is None:
        raise _refusal(candidates, budget, device, rows_of(batch), estimator, room, calibration)
    length = row_elements(batch)
    _record_over(candidates, chosen.plan, sizes, length, fit.usable(budget, estimator), fit)
    plan, widened = chosen.plan, ""
    if guide is not None and estimator._sampled is None:  # never real steps in the middle of a run
        plan, widened = _widened(guide, estimator, candidates, chosen.plan, sizes, length)
    # The chosen size is what a batch this long gets back to after a probe on shorter ones.
    sizes.record(plan, ok=True, length=length)
    peak = "reserved peak" if room["caps"] == "reserved" else "peak"
    calibrated = f", calibration {calibration:.3f}" if calibration != 1 else ""
    reason = (f"estimated: fastest plan predicted to fit ({peak} "
              f"{format_size(chosen.estimate.peak(room['caps']))} of {format_size(budget)}{calibrated}, "
              f"{len(candidates)} plan(s) estimated){widened}")
    log.info("capacity check: %s", reason)
    return plan, reason


def _refusal(candidates, budget: int, device, rows: int, estimator, room: dict, calibration: float) -> DoesNotFit:
    """The capacity check's refusal when no candidate fits: what is needed, and the plan it names
    (the leanest offloaded one where any was estimated) with its breakdown."""
    named = leanest([c for c in candidates if c.plan.offload_optimizer] or candidates, room["caps"])
    needs = needs_message(candidates, budget, calibration=calibration, no_offload=no_offload(estimator), **room)
    return DoesNotFit(f"no plan can fit global batch {rows} on {device.describe()}, checked before "
                      f"training: {needs}",
                      breakdown=named.estimate.breakdown if named else None, budget=budget,
                      plan=named.plan if named else None)


def _record_over(candidates, chosen: Plan, sizes, length, usable: float, fit: Fit) -> None:
    """Record in `sizes` the chosen configuration's larger sizes predicted over the budget even
    uncalibrated: they bound the upward search (for rows as long as the estimated batch's, the
    longest of a list, and shorter); those only a calibration above 1 rules out stay open to the
    guide's probe, since the run measures its own calibration."""
    for c in candidates:
        if c.estimate.peak(fit.caps) * min(fit.calibration, 1.0) > usable and config_of(c.plan) == config_of(chosen) \
                and c.plan.micro_batch_size > chosen.micro_batch_size:
            sizes.record(c.plan, ok=False, length=length)


def _widened(guide: Guide, estimator, candidates, chosen: Plan, sizes, length) -> tuple[Plan, str]:
    """(the plan the run starts with, what the reason adds): the guide keeps the estimator and its
    estimates, and where the budget caps reserved bytes starts at the largest size predicted to fit
    a run starting with it (see Guide.start)."""
    guide.attach(estimator, candidates, length)
    with estimator.sharing_dispatch_cache():  # the sizes searched share the parameters' ops
        plan = guide.start(chosen, sizes.fail(chosen, length), length)
    if plan == chosen:
        return plan, ""
    return plan, (f"; micro-batch {plan.micro_batch_size}, the largest predicted to fit a run starting "
                  f"with it (reserved peak {format_size(guide.predicted(plan))})")
