"""Calibrated estimates steering a run's upward micro-batch search.

The capacity check predicts which plans fit before the first step; a `Guide` keeps its estimator
(fake copies, no device memory) for the rest of the run and learns from what the run measures:
- `observe(plan, peak)`: a good attempt's measured peak (the reserved peak where the budget caps
  reserved bytes: CUDA, a simulated GPU with caps="reserved"; the allocated peak otherwise) against
  the estimate of the same plan gives the calibration factor measured / predicted. The factor of
  the largest micro-batch measured is applied to every later estimate (see `calibration`) and stored
  in the plan cache per model and device (`autofit.cache.memo`), so the next run's capacity check
  starts calibrated.
- `largest(plan, fit, ceiling)`: the largest micro-batch in [fit, ceiling) whose calibrated
  estimate fits the usable budget. The controller's upward probe (`SizeLog.probe_up`) goes there
  first instead of bisecting blindly.
- `failed(plan, length, reached)`: an attempt that ran out of memory proves a lower bound on the
  factor: its real peak exceeded the usable budget (and reached at least `reached`, what it held
  when it failed plus the allocation that failed), so factor > that / predicted. The calibration
  becomes the larger of the factor and the bound, so later estimates (this configuration's, other
  configurations', the next run's through the cache) no longer call the failed step a fit. In the
  configuration that failed, a guess is then at most the bisection's midpoint between what fitted
  and the failure: estimates proven wrong there only ever lower the blind search's next size.
  A failure the guide is not told of (one at or below its last guess) leaves the search to bisect.
  The capacity check's start plan failing on the run's first step teaches it too: the next
  probe, from the ladder's step-down, guesses under the bound. (The step-down itself is the
  ladder's: a bound learned at a large micro-batch is far too high for a small one where the
  estimate's constant part, weights and optimizer state, dominates.)

Constants are not factors: the estimates hold the device's own bytes (`constant`: the cuBLAS and
cuBLASLt workspaces, autofit.gpu.workspaces), which a measurement holds too. The factor is learned
from, and applied to, the rest: (measured - constant) / (predicted - constant), so bytes that are the
same at every micro-batch never grow with it (a factor learned at one row is not applied to the
workspaces again at 32).

The rule between a bound and a factor: the calibration is the larger of the two, the factor in
force when the attempt failed (this run's, else the cached one) having been proven too low. A later
good measurement that becomes the applied factor replaces the bound: a measured factor is better
information than a bound, which holds only as tightly as the point where the step failed (an OOM
early in a step bounds its peak loosely), and a bound kept above measurements would hold the search
below sizes that fit (where what an estimate misses is part constant, the factor of a small
micro-batch is below that of a large one). `measured`, the factor the plan cache keeps, is that
larger of the two at the run's end: a run whose failures nothing measured after keeps its bound,
so the next run of the model starts below the size that failed; that run's own measurements replace
it, as they replace any cached factor.

Where the budget caps reserved bytes, what fits depends on the cache's history: the segments a
step leaves are where the next step's blocks go, so a size that fits a fresh cache may not fit after
a smaller step (measured on a DistilBERT: 14 rows fit after 14, 12 or 8 rows, not after 11 or 13).
There every estimate replays the step before it first (`Estimator.measure(plan, after=...)`, laid
out from one walk per plan: autofit.estimator.replayed): a probe, the step of the plan the run is
at; `start`, the plan's own first step, which is why a run that caps reserved bytes starts at the
largest size so predicted rather than growing to it later.

Only rows as long as the estimated batch's are guided (the estimate is for that length); a
guide whose estimator fails is said once in the log and steps aside: the search bisects as before.
"""

from __future__ import annotations

import logging

from autofit.errors import one_line
from autofit.plans.plan import Plan
from autofit.plans.sizelog import config_of
from autofit.engine.reading import rng_untouched

log = logging.getLogger("autofit")


class Guide:
    """One run's calibrated estimates; `caps` is the peak the budget limits, `usable` the bytes a
    calibrated peak may take, `calibration` the factor known before the run (None: 1)."""

    def __init__(self, device, caps: str, usable: float, calibration: float | None = None,
                 constant: int = 0):
        self.device, self.caps, self.usable = device, caps, usable
        self.constant = constant              # bytes in every estimate and measurement alike
        self.known = calibration              # from the plan cache, for this model and device
        self.ratio: float | None = None       # measured / predicted ...
        self.measured_at = 0                  # ... at this micro-batch, the largest measured
        self.bound: float | None = None       # the factor is above this: proven by an OOM
        self.failures: set = set()            # configurations in which a step the guide learned from failed
        self.estimator = None
        self.rows = self.length = None        # the estimated batch's rows and row length
        self.estimates: dict = {}             # plan -> MemoryEstimate
        self.guessed: dict = {}               # config -> the last size guessed for it
        self.previous: Plan | None = None     # the plan of the run's last good step, as seen here

    @property
    def measured(self) -> float | None:
        """This run's own factor (what the plan cache keeps), or None: the ratio measured at the
        largest micro-batch measured (before that, the cached factor), raised to the bound an
        out-of-memory attempt proved."""
        factor = self.ratio if self.ratio is not None else self.known
        if self.bound is None:
            return self.ratio
        return self.bound if factor is None else max(factor, self.bound)

    @property
    def calibration(self) -> float:
        """The factor applied to estimates: this run's own once measured or bounded, else the cached one.
        Where the budget caps reserved bytes, never under 1: the reserved peak depends on what the
        cache held before the step (a run that grew its micro-batch reuses segments a fresh cache
        would not have), so one step's shortfall says little about a larger plan's. The allocated
        peak is the step's own, and an estimate found high is trusted to be high."""
        factor = self.measured if self.measured is not None else self.known
        if factor is None:
            return 1.0
        return max(factor, 1.0) if self.caps == "reserved" else factor

    def attach(self, estimator, candidates, length: int) -> None:
        """Keep the capacity check's estimator and the estimates it made (rows `length` long)."""
        estimator.forget_source()
        self.estimator, self.rows, self.length = estimator, estimator.rows, length
        for c in candidates:
            self.estimates[c.plan] = c.estimate

    def predicted(self, plan: Plan, micro_batch: int | None = None, after: Plan | None = None,
                  steps_aside: bool = True) -> int | None:
        """The uncalibrated peak (of `caps`) of `plan` at `micro_batch` rows, or None when there is
        no estimator (any more). Where the budget caps reserved bytes, the step of `after` (default:
        `plan` itself, as a run starting with it) is replayed through the allocator model first, and
        the model is capped at the bytes a calibrated peak may take: a capped allocator releases its
        cached segments at the cap, so a step may fit under it whose unbounded peak would not.
        `steps_aside`: whether an estimate that fails ends the guide (else only this answer is None)."""
        if self.estimator is None:
            return None
        m = plan.micro_batch_size if micro_batch is None else micro_batch
        plan = plan.with_micro_batch(min(m, self.rows), self.rows)
        if self.caps == "reserved":
            after = plan if after is None else after.with_micro_batch(min(after.micro_batch_size, self.rows),
                                                                      self.rows)
            limit = int(self.uncalibrated(self.usable))
            key = (plan, after, limit)
        else:  # the allocated peak is the step's own, whatever the cache held
            key, limit = plan, None
        if key not in self.estimates:
            try:
                self._measure(key, plan, after, limit)
            except Exception as error:  # the guide is optional: the search bisects without it
                if not steps_aside:
                    return None
                log.warning("micro-batch search: cannot estimate %s (%s); searching without "
                            "estimates", plan.describe(), one_line(error))
                self.estimator = None
                return None
        return self.estimates[key].peak(self.caps)

    def _measure(self, key, plan: Plan, after: Plan | None, limit: int | None) -> None:
        with rng_untouched(self.estimator.model):  # nor the RNG the run draws from
            self.estimates[key] = (self.estimator.measure(plan, after=after, limit=limit)
                                   if self.caps == "reserved" else self.estimator.measure(plan))

    def calibrated(self, peak: int) -> float:
        """`peak` (an estimate holding `constant`) with the factor applied to all but the constant."""
        return (peak - self.constant) * self.calibration + self.constant

    def uncalibrated(self, usable: float) -> float:
        """The largest estimated peak whose calibrated peak is within `usable`."""
        return (usable - self.constant) / self.calibration + self.constant

    def saves(self, moved: Plan, unmoved: Plan) -> tuple[bool, int, int] | None:
        """Whether `moved` (a precision or checkpointing move) is predicted to peak lower than
        `unmoved` (the same micro-batch without the move): (saves, its peak, the unmoved peak), or
        None when the guide cannot say."""
        if moved.micro_batch_size > (self.rows or 0):
            return None
        # A move the estimator cannot follow (a kernel without bf16) is for the run to find out.
        peak, without = self.predicted(moved, steps_aside=False), self.predicted(unmoved, steps_aside=False)
        if peak is None or without is None:
            return None
        return peak < without, peak, without

    def observe(self, plan: Plan, peak: int, length, first: bool = False) -> None:
        """A good attempt of `plan` on rows `length` long whose allocated peak was `peak` (on a
        step after the first: the optimizer state is there, as in the estimate). Of the run's
        `first` good step only the plan is kept: the step the next one's replay follows."""
        if length != self.length:
            return
        if first:
            self.previous = plan
            return
        measured = self.device.max_memory_reserved() if self.caps == "reserved" else peak
        predicted = self.predicted(plan, after=self.previous)
        self.previous = plan
        if not predicted or not measured or predicted <= self.constant or measured <= self.constant:
            return
        # The factor of the largest micro-batch measured: the nearest to where the search probes
        # (what an estimate misses is part constant, part proportional to the rows).
        if plan.micro_batch_size >= self.measured_at:
            self.ratio = (measured - self.constant) / (predicted - self.constant)
            self.measured_at = plan.micro_batch_size
            self.bound = None  # a measurement replaces a bound: see the module's docstring

    def failed(self, plan: Plan, length, reached: int | None = None) -> None:
        """An attempt of `plan` on rows `length` long ran out of memory (a verdict: not one replayed
        for fragmentation or retried as transient); `reached`: the bytes it is known to have needed
        at least, or None. Its real peak (of `caps`) was over the usable budget: at least one byte
        more, the least that makes the failed step itself predicted not to fit again (no other
        margin: a guess proven wrong lowers the next one to the midpoint anyway, see `largest`)."""
        if length != self.length:
            return
        predicted = self.predicted(plan, after=self.previous)  # as the guess that chose it replayed it
        if not predicted or predicted <= self.constant:
            return
        bound = (max(self.usable + 1, reached or 0) - self.constant) / (predicted - self.constant)
        self.bound = bound if self.bound is None else max(self.bound, bound)
        config = config_of(plan)
        self.failures.add(config)
        self.guessed.pop(config, None)  # learned from: guide again, under the bound

    def start(self, plan: Plan, ceiling: int | None, length=None) -> Plan:
        """The plan a run starts with: `plan` at the largest micro-batch below `ceiling` (default: all
        rows) predicted to fit a run that starts with it, where the budget caps reserved bytes;
        `plan` itself elsewhere (the probe reaches that size by the second global batch, the
        allocated peak not depending on the steps before) or when the guide cannot say."""
        chosen = plan
        if self.caps == "reserved":
            top = self.largest(plan, plan.micro_batch_size, ceiling or self.rows + 1, length, start=True)
            if top is not None:
                chosen = plan.with_micro_batch(top, self.rows)
        self.previous = chosen
        return chosen

    def largest(self, plan: Plan, fit: int, ceiling: int, length=None, start: bool = False) -> int | None:
        """The largest micro-batch in [fit, ceiling) predicted to fit `plan`'s configuration, or
        None when the guide cannot say (other row lengths, no estimator, a guess proven wrong by a
        failure it was not told of). In a configuration where a step failed (`failed`), at most the
        midpoint of [fit, ceiling]. Each size is estimated after a step of `plan` at `fit` (the plan
        the run is at), or after its own first step with `start` (see the module's docstring)."""
        config = config_of(plan)
        if length != self.length or self.estimator is None:
            return None
        if config in self.guessed and self.guessed[config] >= ceiling:
            return None  # a size at or below the last guess failed, unlearned from: bisect
        top = min(ceiling - 1, self.rows)

        def fits(m: int) -> bool | None:
            peak = self.predicted(plan, m, after=None if start else plan.with_micro_batch(fit, self.rows))
            return None if peak is None else self.calibrated(peak) <= self.usable

        lo, hi = fit, top + 1  # lo fits (proven), hi does not (known or predicted)
        first = fits(top) if top > fit else False
        if first is None:
            return None
        if first:
            lo = top
        while hi - lo > 1:
            mid = (lo + hi) // 2
            verdict = fits(mid)
            if verdict is None:
                return None
            lo, hi = (mid, hi) if verdict else (lo, mid)
        if config in self.failures:  # estimates proven wrong here: never above the blind search's size
            lo = min(lo, (fit + ceiling) // 2)
        self.guessed[config] = lo
        return lo
