"""Capacity: which plans fit a memory budget, and which of those runs fastest.

`rank` estimates plans with fake tensors (`autofit.estimate`) and returns them as `Candidate`s,
fastest first; `choose` takes the fastest that fits; `needs_message` says, when none fits, what takes
the memory and what to do about it.

Cost model
----------
`cost` is the relative time of one optimizer step as autofit weighs plans: 1.0 is the whole global
batch in one fp32 micro-batch, without checkpointing or offload. It is a model, not a benchmark:

- micro-batches: a micro-batch of `n` rows costs `max(n, BUSY_FLOOR) + MICRO_OVERHEAD` row-units.
  Below BUSY_FLOOR (8) rows a GPU is not kept busy, so 2 rows take as long as 8; every micro-batch
  also pays a fixed cost (kernel launches, synchronisation) worth MICRO_OVERHEAD (1) row. So fewer,
  larger micro-batches are faster, and micro-batches below 8 are heavily penalised.
- precision: mixed precision (bf16/fp16) is charged MIXED_PRECISION_COST (1.15x). It runs faster
  on tensor cores, but it changes the mathematics, and autofit prefers exact math: the factor is
  set just above the accumulation cost of micro-batches of 8 rows ((8+1)/8 = 1.125), so exact
  fp32 with accumulation down to micro-batch 8 ranks before bf16 — the order the runtime ladder
  walks (accumulation first, then bf16). fp32 below micro-batch 8 ranks after bf16, and so may a
  small batch split unevenly (9 rows as 8 + 1 cost 1.8: the second micro-batch idles the GPU).
- checkpointing: CHECKPOINT_COST (4/3): backward recomputes the forward (forward is ~1/3 of a step).
  Chosen so that bf16 at micro-batch >= 8 (<= 1.125 * 1.15 = 1.29) ranks before checkpointing, as
  in the ladder.
- offload: OFFLOAD_COST (3x): the optimizer update runs on the host and every step copies the
  gradients there and the parameters back. The slowest lever, used when nothing else fits.

Search
------
For a fixed configuration (precision, checkpointing, offload) memory grows with the micro-batch, so
`rank` does not estimate every plan: configurations are visited in order of their best possible cost,
and in each it searches for the largest micro-batch that fits (interpolating the peak between known
points, with the resident bytes — parameters, gradients, optimizer state — as the value at zero
rows), considering only sizes that could beat the best plan found so far. A configuration whose
resident bytes alone exceed the budget is skipped without an estimate.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autofit.engine.batches import batch_size
from autofit.engine.checkpointing import Checkpointing
from autofit.estimator.estimate import Estimator, MemoryEstimate
from autofit.estimator.sharded import ShardedEstimator, sharding_of
from autofit.plans.ladder import BUSY_FLOOR, config_of
from autofit.gpu.memory import format_breakdown
from autofit.plans import precision as precisions
from autofit.plans.plan import Plan
from autofit.plans.precision import MIXED_PRECISION_COST  # noqa: F401  (its old import path)
from autofit.plans.precision import get as get_precision
from autofit.sizes import format_size, parse_size

MICRO_OVERHEAD = 1            # fixed cost of one micro-batch, in rows
CHECKPOINT_COST = 4 / 3       # one more forward
OFFLOAD_COST = 3.0            # host update and transfers
TIGHT = 0.8                   # resident bytes above this share of the budget: check frugal plans first


@dataclass(frozen=True)
class Candidate:
    """A plan with its estimate; `fits` against the budget `rank` was given (margin, calibration)."""

    plan: Plan
    estimate: MemoryEstimate
    fits: bool
    cost: float  # relative step time, lower is faster (see the module docstring)


def micro_batch_sizes(global_batch: int) -> list[int]:
    """The micro-batch sizes worth trying, largest first: for each number of micro-batches k, the
    smallest size that needs only k of them (ceil(global_batch / k)). Halvings are among them;
    every other size uses more memory than one of these for the same number of micro-batches."""
    _check_positive("global_batch", global_batch)
    return sorted({-(-global_batch // k) for k in range(1, global_batch + 1)}, reverse=True)


def plan_cost(plan: Plan, global_batch: int) -> float:
    """Relative step time of `plan` for a global batch (1.0: one fp32 micro-batch of all of it)."""
    _check_positive("global_batch", global_batch)
    m = min(plan.micro_batch_size, global_batch)
    full, last = divmod(global_batch, m)
    rows = full * (max(m, BUSY_FLOOR) + MICRO_OVERHEAD)
    if last:
        rows += max(last, BUSY_FLOOR) + MICRO_OVERHEAD
    cost = rows / (max(global_batch, BUSY_FLOOR) + MICRO_OVERHEAD)
    cost *= get_precision(plan.precision).cost
    if plan.checkpointing:
        cost *= CHECKPOINT_COST
    if plan.offload_optimizer:
        cost *= OFFLOAD_COST
    return cost


def candidate_plans(global_batch: int, precision: str = precisions.AUTO, *, bf16_supported: bool = True,
                    allow_offload: bool = True, checkpointing: bool = True) -> list[Plan]:
    """Every plan worth considering for a global batch, fastest first (by `plan_cost`; ties: fp32,
    no checkpointing, no offload, larger micro-batch first).

    Micro-batches: `micro_batch_sizes(global_batch)`. Precision: "auto" gives fp32 and bf16 (fp16
    where bf16 is unsupported); a fixed precision gives only itself. Checkpointing off and on
    (`checkpointing=False`: off only), offload off and on (`allow_offload=False`: off only).
    """
    allowed = precisions.allowed(precision, bf16_supported)
    plans = [Plan.for_batch(global_batch, m, precision=p, checkpointing=c, offload_optimizer=o)
             for p in allowed
             for c in ((False, True) if checkpointing else (False,))
             for o in ((False, True) if allow_offload else (False,))
             for m in micro_batch_sizes(global_batch)]
    order = {p: i for i, p in enumerate(precisions.names())}
    return sorted(plans, key=lambda p: (plan_cost(p, global_batch), order[p.precision], p.checkpointing,
                                        p.offload_optimizer, -p.micro_batch_size))


class _OutOfEstimates(Exception):
    pass


def rank(model, batch, budget, *, precision: str = precisions.AUTO, optimizer=None, loss_fn=None,
         margin: float = 0.9, device_type: str = "cuda", calibration: float = 1.0,
         max_estimates: int | None = None, bf16_supported: bool = True,
         allow_offload: bool = True, sharding=None) -> list[Candidate]:
    """Estimate plans for one global `batch` against `budget` bytes; the candidates, fastest first.

    A candidate fits when `estimate.peak_bytes * calibration <= budget * margin` (calibration: a
    factor for what the estimate misses, e.g. 1.1 for allocator fragmentation). Only the plans the
    search needed are estimated (see the module docstring); `max_estimates` caps them. When no
    plan fits, the most frugal plan is estimated all the same, so `needs_message` can say why.
    `sharding` (autofit.estimator.sharded.Sharding; read from a model sharded with FSDP2): the plans
    are priced for one rank, `batch` being its share of the global batch.
    """
    budget = parse_size(budget)
    precisions.check_policy(precision)  # a bad precision fails before any work
    if not (isinstance(margin, (int, float)) and 0 < margin <= 1):
        raise ValueError(f"margin must be in (0, 1] but got {margin!r}; 0.9 keeps 10% of the budget free.")
    if not (isinstance(calibration, (int, float)) and calibration > 0):
        raise ValueError(f"calibration must be a positive number but got {calibration!r}.")
    if max_estimates is not None and (isinstance(max_estimates, bool) or not isinstance(max_estimates, int)
                                      or max_estimates < 1):
        raise ValueError(f"max_estimates must be a positive int or None but got {max_estimates!r}.")
    global_batch = batch_size(batch)
    # A model sharded with FSDP2 (or a `sharding` to price): one rank's peak, on its `batch`.
    sharding = sharding if sharding is not None else sharding_of(model)
    if sharding is not None:
        estimator = ShardedEstimator(model, batch, sharding, optimizer, loss_fn, device_type=device_type)
        allow_offload = False  # FSDP2 offloads with CPUOffloadPolicy, not autofit's optimizer offload
    else:
        estimator = Estimator(model, batch, optimizer, loss_fn, device_type=device_type)
    plans = candidate_plans(global_batch, precision, bf16_supported=bf16_supported,
                            allow_offload=allow_offload,
                            checkpointing=Checkpointing(estimator.model).available)
    limit = budget * margin / calibration
    measured: dict[Plan, Candidate] = {}

    def measure(plan: Plan) -> Candidate:
        if plan not in measured:
            if max_estimates is not None and len(measured) >= max_estimates:
                raise _OutOfEstimates
            est = estimator.measure(plan)
            measured[plan] = Candidate(plan, est, est.peak_bytes * calibration <= budget * margin,
                                       plan_cost(plan, global_batch))
        return measured[plan]

    configs: dict[tuple, list[Plan]] = {}
    for plan in plans:
        configs.setdefault(config_of(plan), []).append(plan)

    def floor(offloaded: bool) -> int:
        return _floor(estimator.resident, measured.values(), offloaded)

    best = math.inf
    try:
        frugal = _most_frugal(plans)
        if floor(frugal.offload_optimizer) > limit:
            measure(frugal)  # nothing fits; one estimate says with what
            return _sorted(measured, plans)
        if floor(frugal.offload_optimizer) > TIGHT * limit:
            # Little room beyond what every plan holds: first see whether the most frugal plans
            # (one row per micro-batch, checkpointing, offload; each precision) fit at all.
            tight = [p for p in plans if config_of(p)[1:] == config_of(frugal)[1:]
                     and p.micro_batch_size == frugal.micro_batch_size]
            if not any(measure(p).fits for p in tight):
                return _sorted(measured, plans)
        # Visit configurations by their best possible cost (their largest micro-batch).
        for _, group in sorted(configs.items(), key=lambda kv: plan_cost(kv[1][0], global_batch)):
            group = sorted(group, key=lambda p: -p.micro_batch_size)
            group = [p for p in group if plan_cost(p, global_batch) < best]
            if group:
                found = _largest_fitting(group, measure, limit,
                                         functools.partial(floor, group[0].offload_optimizer))
                if found is not None:
                    best = min(best, plan_cost(found, global_batch))
        if not any(c.fits for c in measured.values()) and plans:
            measure(frugal)
    except _OutOfEstimates:
        pass
    return _sorted(measured, plans)


def _sorted(measured: dict, plans: list[Plan]) -> list[Candidate]:
    order = {p: i for i, p in enumerate(plans)}
    return sorted(measured.values(), key=lambda c: (c.cost, order.get(c.plan, 0)))


def _floor(resident: dict, measured, offloaded: bool) -> int:
    """Bytes any plan of this kind needs whatever its micro-batch: what it holds at its optimizer
    step (measured once a plan that steps on the device was estimated)."""
    floor = resident["params"] + resident["grads"] + (0 if offloaded else resident["optimizer"])
    steps = [c.estimate.step_bytes for c in measured
             if c.plan.offload_optimizer == offloaded and c.estimate.step_bytes is not None]
    return max([floor] + steps)


def _most_frugal(plans: list[Plan]) -> Plan:
    """The plan most likely to use the least memory: smallest micro-batch, checkpointing, offload,
    mixed precision."""
    return min(plans, key=lambda p: (p.micro_batch_size, not p.offload_optimizer, not p.checkpointing,
                                     not get_precision(p.precision).mixed))


def _largest_fitting(group: list[Plan], measure, limit: float, floor) -> Plan | None:
    """The plan of `group` (one configuration, micro-batch descending) with the largest micro-batch
    that fits, found by interpolation search on the peak; None when none fits. `floor()`: bytes
    every plan of the group needs; above the limit, none fits and the search stops."""
    fail, fit = -1, len(group)  # indices: group[:fail+1] known to fail, group[fit:] known to fit
    bisect = False
    while fit - fail > 1:
        if fit == len(group) and floor() > limit:
            return None  # parameters, gradients (and state) alone are too big
        if fail < 0:
            i = 0  # the fastest first: when it fits, nothing else of this configuration is needed
            interpolated = False
        elif bisect:
            i = (fail + fit) // 2
            interpolated = False
        else:
            i = _interpolate(group, measure, fail, fit, limit, floor())
            interpolated = True
        before = fit - fail
        if measure(group[i]).fits:
            fit = i
        else:
            fail = i
        # An interpolation that shrank the bracket by a single plan: bisect next time.
        bisect = interpolated and before - (fit - fail) <= 1
    return group[fit] if fit < len(group) else None


def _interpolate(group, measure, fail: int, fit: int, limit: float, floor: int) -> int:
    """Where the straight line through the nearest known peaks crosses the limit."""
    m_hi = group[fail].micro_batch_size
    p_hi = measure(group[fail]).estimate.peak_bytes
    if fit < len(group):
        m_lo, p_lo = group[fit].micro_batch_size, measure(group[fit]).estimate.peak_bytes
    else:
        m_lo, p_lo = 0, floor  # at zero rows: what the step holds whatever the batch
    if p_hi <= p_lo:
        target = m_lo
    else:
        target = m_lo + (limit - p_lo) * (m_hi - m_lo) / (p_hi - p_lo)
    for i in range(fail + 1, fit):
        if group[i].micro_batch_size <= target:
            return i
    return fit - 1


def choose(candidates) -> Candidate | None:
    """The fastest candidate that fits, or None."""
    fitting = [c for c in candidates if c.fits]
    return min(fitting, key=lambda c: c.cost) if fitting else None


def needs_message(candidates, budget, *, margin: float = 0.9, calibration: float = 1.0,
                  no_offload: str | None = None) -> str:
    """Why no candidate fits `budget`, in the field's words, and what to do; or which one fits.
    `no_offload`: why this caller cannot offload the optimizer (its advice then leaves it out)."""
    budget = parse_size(budget)
    candidates = list(candidates)
    usable = budget * margin / calibration
    of_budget = f"of a {format_size(budget)} budget"
    if margin != 1 or calibration != 1:
        of_budget += f" ({format_size(usable)} usable at margin {margin:g}"
        of_budget += f", calibration {calibration:g})" if calibration != 1 else ")"
    chosen = choose(candidates)
    if chosen is not None:
        return (f"{chosen.plan.describe()} fits: {format_breakdown(chosen.estimate.breakdown)} "
                f"{of_budget}.")
    if not candidates:
        return "no plan was estimated; nothing is known to fit."
    smallest = min(candidates, key=lambda c: c.estimate.peak_bytes)
    resident = smallest.estimate.resident
    state = f"{smallest.estimate.optimizer} state"
    weights = resident["params"] + resident["grads"]
    everything = weights + resident["optimizer"]
    offloaded = [c for c in candidates if c.plan.offload_optimizer]
    if weights > usable:
        without = "" if no_offload else \
            f", even with the {state} ({format_size(resident['optimizer'])}) offloaded"
        return (f"parameters and gradients alone need {format_size(weights)} {of_budget}{without}: use a "
                f"smaller model, freeze part of it, or a GPU with more memory.")
    if everything > usable and not offloaded:
        advice = "offload the optimizer or use a smaller model" if not no_offload else \
            f"use a smaller model or an optimizer with less state ({no_offload})"
        return (f"parameters, gradients and {state} alone need {format_size(everything)} {of_budget}: "
                f"{advice}.")
    tried = min(offloaded or candidates, key=lambda c: c.estimate.peak_bytes)
    acts = tried.estimate.breakdown["activations"]
    held = "parameters and gradients" if tried.plan.offload_optimizer else \
        f"parameters, gradients and {state}"
    held_bytes = weights if tried.plan.offload_optimizer else everything
    advice = "shorten the sequences or use a smaller model"
    if not tried.plan.offload_optimizer and not no_offload:
        advice += ", or offload the optimizer"
    return (f"the smallest plan tried ({tried.plan.describe()}) needs "
            f"{format_size(tried.estimate.peak_bytes)} {of_budget}: {held} take "
            f"{format_size(held_bytes)} and activations {format_size(acts)} at "
            f"{tried.plan.micro_batch_size} row(s) per micro-batch; {advice}.")


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int but got {value!r}.")
