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
  first instead of bisecting blindly; when a size at or below a guess has failed, the guess was
  wrong and the search bisects between what fitted and that failure.

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

    def __init__(self, device, caps: str, usable: float, calibration: float | None = None):
        self.device, self.caps, self.usable = device, caps, usable
        self.known = calibration              # from the plan cache, for this model and device
        self.measured: float | None = None    # this run's own factor: measured / predicted ...
        self.measured_at = 0                  # ... at this micro-batch, the largest measured
        self.estimator = None
        self.rows = self.length = None        # the estimated batch's rows and row length
        self.estimates: dict = {}             # plan -> MemoryEstimate
        self.guessed: dict = {}               # config -> the last size guessed for it

    @property
    def calibration(self) -> float:
        """The factor applied to estimates: this run's own once measured, else the cached one.
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

    def predicted(self, plan: Plan, micro_batch: int | None = None) -> int | None:
        """The uncalibrated peak (of `caps`) of `plan` at `micro_batch` rows, or None when there is
        no estimator (any more)."""
        if self.estimator is None:
            return None
        m = plan.micro_batch_size if micro_batch is None else micro_batch
        plan = plan.with_micro_batch(min(m, self.rows), self.rows)
        if plan not in self.estimates:
            try:
                with rng_untouched():  # fake-tensor work must not move the RNG the run draws from
                    self.estimates[plan] = self.estimator.measure(plan)
            except Exception as error:  # the guide is optional: the search bisects without it
                log.warning("micro-batch search: cannot estimate %s (%s); searching without "
                            "estimates", plan.describe(), one_line(error))
                self.estimator = None
                return None
        return self.estimates[plan].peak(self.caps)

    def observe(self, plan: Plan, peak: int, length) -> None:
        """A good attempt of `plan` on rows `length` long whose allocated peak was `peak` (on a
        step after the first: the optimizer state is there, as in the estimate)."""
        if length != self.length:
            return
        measured = self.device.max_memory_reserved() if self.caps == "reserved" else peak
        predicted = self.predicted(plan)
        if not predicted or not measured:
            return
        # The factor of the largest micro-batch measured: the nearest to where the search probes
        # (what an estimate misses is part constant, part proportional to the rows).
        if plan.micro_batch_size >= self.measured_at:
            self.measured, self.measured_at = measured / predicted, plan.micro_batch_size

    def largest(self, plan: Plan, fit: int, ceiling: int, length=None) -> int | None:
        """The largest micro-batch in [fit, ceiling) predicted to fit `plan`'s configuration, or
        None when the guide cannot say (other row lengths, no estimator, a guess proven wrong)."""
        config = config_of(plan)
        if length != self.length or self.estimator is None:
            return None
        if config in self.guessed and self.guessed[config] >= ceiling:
            return None  # a size at or below the last guess failed: bisect from here on
        top = min(ceiling - 1, self.rows)

        def fits(m: int) -> bool | None:
            peak = self.predicted(plan, m)
            return None if peak is None else peak * self.calibration <= self.usable

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
        self.guessed[config] = lo
        return lo
