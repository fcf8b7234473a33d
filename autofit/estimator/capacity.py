"""Capacity: which plans fit a memory budget, and which of those runs fastest.
Ranking, choosing and the per-rank pricing share the candidates' one
shape; the cost model is in estimator/cost, the replays in estimator/guide.

`rank` estimates plans with fake tensors (`autofit.estimate`) and returns them as `Candidate`s,
fastest first (by the cost model of `autofit.estimator.cost`); `choose` takes the fastest that fits;
`needs_message` says, when none fits, what takes the memory and what to do about it.

Fits
----
A plan fits (`Fit`) when its predicted peak, times the calibration, is within the budget less a reserve:
the peak the budget caps — `caps="reserved"` (a card, whose memory limit caps what the caching
allocator reserves) compares the estimate's reserved peak, `caps="allocated"` (a budget on live
tensor bytes) its allocated peak — so the check compares like with like; the estimates hold the
device's own bytes (`workspaces`: cuBLAS's, autofit.gpu.workspaces) and the `reserve` keeps room only
for what no estimate places (cuDNN's workspaces, `autofit.estimator.start.headroom`). `calibration`
is what measured peaks taught about this model on this device (`autofit.estimator.guide`).

Where the reserved peak decides, it is the peak of the allocator capped at the limit: a card's
allocator that reaches its limit releases its cached segments and retries before it fails, so a plan
whose live bytes fit but whose unbounded reserved peak does not is decided by replaying its step's
allocations under the cap (`Estimator.capped`, from the record of the walk: no second walk). A plan
that fits so carries the capped reserved peak; one that does not keeps its unbounded estimate.

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

import contextlib
import functools
import logging
import math
from dataclasses import dataclass

from autofit.engine.batches import rows_of, tokens_per_row
from autofit.engine.checkpointing import Checkpointing
from autofit.estimator.cost import candidate_plans, plan_cost
from autofit.estimator.estimate import Estimator, MemoryEstimate
from autofit.estimator.sharded import ShardedEstimator, sharding_of
from autofit.plans.sizelog import config_of
from autofit.sizes import format_breakdown
from autofit.gpu.oom import summarize
from autofit.gpu.workspaces import Workspaces
from autofit.plans import precision as precisions
from autofit.plans.plan import Plan
from autofit.plans.precision import get as get_precision
from autofit.sizes import format_size, parse_size

log = logging.getLogger("autofit")

TIGHT = 0.8                   # resident bytes above this share of the budget: check frugal plans first
CAPS = ("allocated", "reserved")


@dataclass(frozen=True)
class Candidate:
    """A plan with its estimate; `fits` against the budget `rank` was given, as its `Fit` judges."""

    plan: Plan
    estimate: MemoryEstimate
    fits: bool
    cost: float  # relative step time, lower is faster (see the module docstring)


class _OutOfEstimates(Exception):
    pass


class _Dropped(Exception):
    """A plan whose estimate raised an error that the plain plan (fp32, no move) did not."""


# Why a sharded model's plans never offload the optimizer: `needs_message` then leaves offload out
# of its advice, and says this instead.
SHARDED_NO_OFFLOAD = ("autofit's optimizer offload does not apply to FSDP2's sharded parameters; with "
                      "more ranks each holds a smaller shard")


def no_offload(estimator) -> str | None:
    """Why the plans `estimator` prices cannot offload the optimizer (for `needs_message`), or None."""
    return SHARDED_NO_OFFLOAD if isinstance(estimator, ShardedEstimator) else None


def make_estimator(model, batch, optimizer=None, loss_fn=None, *, device_type: str = "cuda",
                   sharding=None, workspaces=None) -> Estimator:
    """The estimator `rank` prices plans with: one rank's (`ShardedEstimator`) for a model sharded
    with FSDP2 (or a `sharding` to price), else the fake-tensor `Estimator`; `workspaces`
    (autofit.gpu.workspaces): the device's own bytes, added to every estimate."""
    sharding = sharding if sharding is not None else sharding_of(model)
    if sharding is not None:
        return ShardedEstimator(model, batch, sharding, optimizer, loss_fn, device_type=device_type)
    return Estimator(model, batch, optimizer, loss_fn, device_type=device_type, workspaces=workspaces)


def unplaced(estimator, workspaces, caps: str) -> int:
    """The device's own bytes `estimator`'s estimates do not hold (a sharded estimate's: FSDP2's
    estimator prices tensors only), kept back from the budget instead."""
    if getattr(estimator, "workspaces", None) is workspaces:
        return 0
    return own_bytes(workspaces, caps)


def own_bytes(workspaces, caps: str) -> int:
    """The bytes of the device's own an estimate of `caps` holds (a constant, whatever the plan)."""
    if workspaces is None:
        return 0
    from autofit.estimator.estimate import own_reserved
    return own_reserved(workspaces) if caps == "reserved" else workspaces.resident


def usable_bytes(budget: int, *, margin: float = 1.0, reserve: int = 0) -> float:
    """The bytes a plan's peak (times its calibration) may take of `budget`."""
    return (budget - reserve) * margin


@dataclass(frozen=True)
class Fit:
    """How a candidate is judged against the budget: it fits when
    `estimate.peak(caps) * calibration <= (budget - reserve) * margin`. `caps` is the peak the
    budget limits ("allocated" or "reserved"), `reserve` bytes are kept for what no estimate sees,
    `calibration` is a factor for what the estimate misses (measured peak / predicted, see
    autofit.estimator.guide), `margin` an extra share to keep free (1: none). `workspaces`
    (autofit.gpu.workspaces, `headroom`'s): the device's own bytes, in every estimate; an estimator
    that does not hold them (a sharded one) has them kept back from the budget instead."""

    margin: float = 1.0
    caps: str = "allocated"
    reserve: int = 0
    calibration: float = 1.0
    workspaces: Workspaces | None = None

    def __post_init__(self):
        margin, caps, reserve, calibration = self.margin, self.caps, self.reserve, self.calibration
        if not (isinstance(margin, (int, float)) and 0 < margin <= 1):
            raise ValueError(f"margin must be in (0, 1] but got {margin!r}; 1 keeps nothing back beyond "
                             f"the reserve.")
        if caps not in CAPS:
            raise ValueError(f"caps must be one of {', '.join(CAPS)} but got {caps!r}: the peak the "
                             f"budget limits.")
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"reserve must be a non-negative int of bytes but got {reserve!r}.")
        if not (isinstance(calibration, (int, float)) and calibration > 0):
            raise ValueError(f"calibration must be a positive number but got {calibration!r}.")

    def usable(self, budget: int, estimator) -> float:
        """The bytes a plan's peak (times the calibration) may take of `budget`, less the device's
        own bytes that `estimator`'s estimates do not hold."""
        reserve = self.reserve + unplaced(estimator, self.workspaces, self.caps)
        return usable_bytes(budget, margin=self.margin, reserve=reserve)


@dataclass(frozen=True)
class Space:
    """Which plans `rank` searches: those of the `precision` policy (bf16 only where
    `bf16_supported`), offloading the optimizer only where `allow_offload`; `max_estimates` caps the
    estimates the search may make (None: no cap)."""

    precision: str = precisions.AUTO
    bf16_supported: bool = True
    allow_offload: bool = True
    max_estimates: int | None = None

    def __post_init__(self):
        precisions.check_policy(self.precision)  # a bad precision fails before any work
        if self.max_estimates is not None and (isinstance(self.max_estimates, bool)
                                               or not isinstance(self.max_estimates, int)
                                               or self.max_estimates < 1):
            raise ValueError(f"max_estimates must be a positive int or None but got {self.max_estimates!r}.")

    def plans(self, estimator, batch) -> list[Plan]:
        """The candidate plans for one global `batch` that `estimator` prices."""
        allow_offload, reshard = self.allow_offload, (None,)
        if isinstance(estimator, ShardedEstimator):
            allow_offload = False  # FSDP2 offloads with CPUOffloadPolicy, not autofit's optimizer offload
            reshard = estimator.reshard_choices
        return candidate_plans(rows_of(batch), self.precision, bf16_supported=self.bf16_supported,
                               allow_offload=allow_offload,
                               checkpointing=Checkpointing(estimator.model).available, reshard=reshard,
                               tokens_per_row=tokens_per_row(batch))


def rank(estimator, batch, budget, *, fit: Fit = Fit(), space: Space = Space()) -> list[Candidate]:
    """Estimate the plans of `space` for one global `batch` against `budget` bytes, judged as `fit`
    says; the candidates, fastest first.

    `estimator`: an `Estimator` of this model and batch (`make_estimator`; one rank's for a model
    sharded with FSDP2, `batch` then being its share of the global batch). Only the plans the
    search needed are estimated (see the module docstring); `space.max_estimates` caps them. When no
    plan fits, the most frugal plan is estimated all the same, so `needs_message` can say why.
    """
    budget = parse_size(budget)
    plans = space.plans(estimator, batch)
    search = _Search(estimator, batch, budget, fit, space.max_estimates)
    # The plans searched share most of their ops' shapes: one dispatch cache for all of them.
    sharing = getattr(estimator, "sharing_dispatch_cache", None)
    with sharing() if sharing is not None else contextlib.nullcontext():
        try:
            search.run(plans)
        except _OutOfEstimates:
            pass
    return _sorted(search.measured, plans)


class _Search:
    """One `rank`'s search: the candidates measured so far and the configurations dropped.

    An object, not nested closures: `measure` calls itself, and a closure that does holds the
    estimator (and batch) in a reference cycle."""

    def __init__(self, estimator, batch, budget: int, fit: Fit, max_estimates: int | None):
        self.estimator, self.fit, self.max_estimates = estimator, fit, max_estimates
        self.usable = fit.usable(budget, estimator)
        self.limit = self.usable / fit.calibration
        self.rows, self.tokens = rows_of(batch), tokens_per_row(batch)  # token batches weigh their tokens
        self.measured: dict[Plan, Candidate] = {}
        self.dropped: dict[tuple, str] = {}  # configurations whose move cannot run: {config: the error}

    def cost(self, plan: Plan) -> float:
        return plan_cost(plan, self.rows, self.tokens)

    def measure(self, plan: Plan) -> Candidate:
        """`plan`'s candidate, estimated once (_Dropped: its configuration cannot run)."""
        if config_of(plan) in self.dropped:
            raise _Dropped
        if plan not in self.measured:
            if self.max_estimates is not None and len(self.measured) >= self.max_estimates:
                raise _OutOfEstimates
            est = self._capped(plan, self._estimate(plan))
            fits = est.peak(self.fit.caps) * self.fit.calibration <= self.usable
            self.measured[plan] = Candidate(plan, est, fits, self.cost(plan))
        return self.measured[plan]

    def fits(self, plan: Plan) -> bool:
        try:
            return self.measure(plan).fits
        except _Dropped:
            return False

    def floor(self, offloaded: bool) -> int:
        return _floor(self.estimator.resident, self.measured.values(), offloaded)

    def _estimate(self, plan: Plan) -> MemoryEstimate:
        """The estimator's estimate; _Dropped when it raises an error the plain plan does not."""
        try:
            return self.estimator.measure(plan)
        except Exception as error:
            plain = plan.plain()
            if plain == plan:
                raise  # the plain plan's own error is the job's (the check falls back)
            self.measure(plain)  # raises when the plain plan fails too: then it is the job's error
            self.dropped[config_of(plan)] = f"{type(error).__name__}: {summarize(error)}"
            log.warning("estimating %s raised %s, which %s did not; plans like it are left out of the "
                        "capacity check", plan.describe(), self.dropped[config_of(plan)], plain.describe())
            raise _Dropped from None

    def _capped(self, plan: Plan, est: MemoryEstimate) -> MemoryEstimate:
        capped_of = getattr(self.estimator, "capped", None)  # None: an estimator with no record
        if self.fit.caps == "reserved" and capped_of is not None \
                and est.peak_bytes <= self.limit < est.peak("reserved"):
            # Live bytes fit, the unbounded reserved peak does not: a card's allocator releases
            # its cached segments at the cap and retries. The step's allocations replayed under
            # the cap decide; a plan that fits reports the capped peak.
            capped = capped_of(plan, int(self.limit))
            return capped if capped.peak("reserved") <= self.limit else est
        return est

    def run(self, plans: list[Plan]) -> None:
        """Measure what the search needs (_OutOfEstimates: `max_estimates` ran out)."""
        frugal = _most_frugal(plans)
        if self.floor(frugal.offload_optimizer) > self.limit:
            self.fits(frugal)  # nothing fits; one estimate says with what
            return
        if self.floor(frugal.offload_optimizer) > TIGHT * self.limit:
            # Little room beyond what every plan holds: first see whether the most frugal plans
            # (one row per micro-batch, checkpointing, offload; each precision) fit at all.
            tight = [p for p in plans if config_of(p)[1:] == config_of(frugal)[1:]
                     and p.micro_batch_size == frugal.micro_batch_size]
            if not any(self.fits(p) for p in tight):
                return
        self._by_configuration(plans)
        if not any(c.fits for c in self.measured.values()) and plans:
            self.fits(frugal)

    def _by_configuration(self, plans: list[Plan]) -> None:
        """Visit configurations by their best possible cost (their largest micro-batch), each
        searched for its largest fitting micro-batch among those that could beat the best so far."""
        configs: dict[tuple, list[Plan]] = {}
        for plan in plans:
            configs.setdefault(config_of(plan), []).append(plan)
        best = math.inf
        for _, group in sorted(configs.items(), key=lambda kv: self.cost(kv[1][0])):
            group = [p for p in sorted(group, key=lambda p: -p.micro_batch_size) if self.cost(p) < best]
            if not group:
                continue
            try:
                found = _largest_fitting(group, self.measure, self.limit,
                                         functools.partial(self.floor, group[0].offload_optimizer), self.fit.caps)
            except _Dropped:
                continue  # a configuration whose move cannot run: the others are searched
            if found is not None:
                best = min(best, self.cost(found))


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
    mixed precision; under FSDP2 resharding after forward and a reduce-scatter per micro-batch."""
    # Named switch by switch, not read from the registry: the order is each one's saving in memory.
    return min(plans, key=lambda p: (p.micro_batch_size, not p.offload_optimizer, not p.checkpointing,
                                     not get_precision(p.precision).mixed,
                                     p.reshard_after_forward is False, not p.reduce_each_micro_batch))


def _largest_fitting(group: list[Plan], measure, limit: float, floor, caps: str = "allocated") -> Plan | None:
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
            i = _interpolate(group, measure, fail, fit, limit, floor(), caps)
            interpolated = True
        before = fit - fail
        if measure(group[i]).fits:
            fit = i
        else:
            fail = i
        # An interpolation that shrank the bracket by a single plan: bisect next time.
        bisect = interpolated and before - (fit - fail) <= 1
    return group[fit] if fit < len(group) else None


def _interpolate(group, measure, fail: int, fit: int, limit: float, floor: int,
                 caps: str = "allocated") -> int:
    """Where the straight line through the nearest known peaks crosses the limit."""
    m_hi = group[fail].micro_batch_size
    p_hi = measure(group[fail]).estimate.peak(caps)
    if fit < len(group):
        m_lo, p_lo = group[fit].micro_batch_size, measure(group[fit]).estimate.peak(caps)
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


def leanest(candidates, caps: str = "allocated") -> Candidate | None:
    """The candidate with the smallest peak of `caps`, or None. Among equal peaks (reserved peaks
    are whole segments: many plans of a small model reserve the same 2 MiB) the smallest allocated
    peak, then the fewest rows: a refusal names the plan that needs least, not the first estimated."""
    return min(candidates, key=lambda c: (c.estimate.peak(caps), c.estimate.peak_bytes, c.plan.micro_batch_size),
               default=None)


def choose(candidates) -> Candidate | None:
    """The fastest candidate that fits, or None."""
    fitting = [c for c in candidates if c.fits]
    return min(fitting, key=lambda c: c.cost) if fitting else None


def needs_message(candidates, budget, *, margin: float = 1.0, calibration: float = 1.0,
                  caps: str = "allocated", reserve: int = 0, no_offload: str | None = None,
                  workspaces=None) -> str:
    """Why no candidate fits `budget`, in the field's words, and what to do; or which one fits.
    `no_offload`: why this caller cannot offload the optimizer (its advice then leaves it out);
    `workspaces` is `headroom`'s, already in the candidates' estimates."""
    budget = parse_size(budget)
    candidates = list(candidates)
    usable = max(usable_bytes(budget, margin=margin, reserve=reserve) / calibration, 0)
    of_budget = f"of a {format_size(budget)} budget"
    if margin != 1 or calibration != 1:
        of_budget += f" ({format_size(usable)} usable at margin {margin:g}"
        of_budget += f", calibration {calibration:g}" if calibration != 1 else ""
        of_budget += f", {format_size(reserve)} kept for cuDNN's workspaces)" if reserve else ")"
    elif reserve:
        of_budget += f" ({format_size(usable)} usable, {format_size(reserve)} kept for cuDNN's workspaces)"
    reserved = " reserved" if caps == "reserved" else ""
    chosen = choose(candidates)
    if chosen is not None:
        return (f"{chosen.plan.describe()} fits: {format_breakdown(chosen.estimate.breakdown)} "
                f"{of_budget}.")
    if not candidates:
        return "no plan was estimated; nothing is known to fit."
    smallest = leanest(candidates, caps)
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
    tried = leanest(offloaded or candidates, caps)
    acts = tried.estimate.breakdown["activations"]
    held = "parameters and gradients" if tried.plan.offload_optimizer else \
        f"parameters, gradients and {state}"
    held_bytes = weights if tried.plan.offload_optimizer else everything
    advice = "shorten the sequences or use a smaller model"
    if not tried.plan.offload_optimizer and not no_offload:
        advice += ", or offload the optimizer"
    return (f"the smallest plan tried ({tried.plan.describe()}) needs "
            f"{format_size(tried.estimate.peak(caps))}{reserved} {of_budget}: {held} take "
            f"{format_size(held_bytes)} and activations {format_size(acts)} at "
            f"{tried.plan.micro_batch_size} row(s) per micro-batch; {advice}.")

