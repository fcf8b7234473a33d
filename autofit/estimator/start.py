"""Where a run starts: the cached plan, else the fastest plan the estimator predicts to fit.

The capacity check estimates candidate plans on fake tensors before the first step. The run then
starts from the fastest plan predicted to fit within MARGIN of the budget, and OOMs only correct
the estimate. When no plan can fit, the run stops before training with what would be needed.
The check is optional: when the estimator cannot follow the model (an error of any kind inside it),
that is said in one line and the run starts as it would without the check.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from autofit.engine.batches import batch_size, row_elements
from autofit.estimator.capacity import choose, needs_message, rank
from autofit.estimator.estimate import Estimator
from autofit.errors import DoesNotFit, one_line
from autofit.plans.applies import not_applicable
from autofit.plans.ladder import config_of
from autofit.engine.reading import rng_untouched
from autofit.sizes import format_size

log = logging.getLogger("autofit")

MARGIN = 0.9        # room left for what the estimate misses (fragmentation on a real card)
SETTLE_WITHIN = 0.1  # from an estimated start, probe upward only for gains above 10%


def tensor_budget(device) -> int | None:
    """Bytes tensors may occupy on the device, or None where nothing is counted or limited."""
    if not device.counts:
        return None
    if device.budget is not None:
        return device.budget
    free = device.free_bytes()
    return None if free is None else free + device.memory_allocated()


def longest_batch(data, first):
    """The batch with the most elements when the data is a list of batches (the longest sequence
    decides the plan), else the first."""
    if not isinstance(data, Sequence) or isinstance(data, (str, bytes)) or len(data) > 10_000:
        return first

    def elements(batch):
        from autofit.gpu.device import _tensors
        return sum(t.numel() for t in _tensors(batch))
    return max(data, key=elements)


def _first_whole_fitting(plans, model, batch, optimizer, loss_fn, device_type, budget):
    """(plan, reason) for the first of `plans` predicted to fit within MARGIN of `budget`, or None."""
    if not plans:
        return None
    estimator = Estimator(model, batch, optimizer, loss_fn, device_type=device_type)
    for plan in plans:
        peak = estimator.measure(plan).peak_bytes
        if peak <= budget * MARGIN:
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


def estimated_start(model, batch, optimizer, loss_fn, device, precision: str, sizes, coupling=None):
    """(plan, reason) from the capacity check, None when there is nothing to check against; the
    sizes predicted not to fit are recorded in `sizes` (a SizeLog). With `coupling` (a
    plans.coupling.Coupling) that keeps the batch whole first, the start is the first whole-batch
    plan of its ladder predicted to fit; the fastest plan of all only when none does."""
    budget = tensor_budget(device)
    if budget is None:
        return None
    device_type = "cuda" if device.type == "cuda" else "cpu"
    whole = [] if coupling is None else \
        [p for p in coupling.whole_plans(batch_size(batch), precision, device.supports_bf16())
         if not_applicable(p, model, optimizer, device) is None]
    try:
        with rng_untouched():  # fake-tensor work must not move the RNG the first step draws from
            kept = _first_whole_fitting(whole, model, batch, optimizer, loss_fn, device_type, budget)
            if kept is not None:
                sizes.record(kept[0], ok=True, length=row_elements(batch))
                return kept
            candidates = rank(model, batch, budget, precision=precision, optimizer=optimizer,
                              loss_fn=loss_fn, margin=MARGIN, device_type=device_type,
                              bf16_supported=device.supports_bf16())
    except Exception as error:  # the check is optional: an estimator failure never stops a run
        cannot_estimate(model, error, "starting from the whole global batch; the ladder finds the plan")
        return None
    chosen = choose(candidates)
    if chosen is None:
        leanest = min(candidates, key=lambda c: c.estimate.peak_bytes) if candidates else None
        raise DoesNotFit(
            f"no plan can fit global batch {batch_size(batch)} on {device.describe()}, checked before "
            f"training: {needs_message(candidates, budget, margin=MARGIN)}",
            breakdown=leanest.estimate.breakdown if leanest else None, budget=budget,
            plan=leanest.plan if leanest else None)
    # Sizes predicted over the whole budget bound the upward search; those predicted only inside
    # the margin stay open to a probe, since the estimate may be high (OOMs correct it).
    # Both hold for rows as long as the estimated batch's (the longest of a list), and shorter.
    length = row_elements(batch)
    for c in candidates:
        if c.estimate.peak_bytes > budget and config_of(c.plan) == config_of(chosen.plan) \
                and c.plan.micro_batch_size > chosen.plan.micro_batch_size:
            sizes.record(c.plan, ok=False, length=length)
    # The chosen size is what a batch this long gets back to after a probe on shorter ones.
    sizes.record(chosen.plan, ok=True, length=length)
    reason = (f"estimated: fastest plan predicted to fit (peak {format_size(chosen.estimate.peak_bytes)} "
              f"of {format_size(budget)}, {len(candidates)} plan(s) estimated)")
    log.info("capacity check: %s", reason)
    return chosen.plan, reason
