"""What a run remembers between runs: the plan that worked for this job on this device.

A cached plan is the start of the next run of the same job, and the sizes it was proven against
are loaded into the micro-batch search, so the second run makes no OOM attempt and no probe. The
cached plan is the one proven for the longest rows trained (variable-length data); the sizes proven
for shorter rows come with it.
A cache that cannot be read or written never stops training: it is reported and skipped.

Each entry also carries the calibration its run measured (measured peak / estimated peak, see
`autofit.estimator.guide`; raised to the lower bound an out-of-memory attempt proved when nothing
was measured after it) and which peak it compares ("reserved" or "allocated"). The factor is
about the model on the device, not about the job: `calibration` finds the newest one stored for the
same model on the same device (same torch and autofit), whatever its batch, budget or optimizer.
"""

from __future__ import annotations

import logging
import math
import time

from autofit.cache.store import PlanCache
from autofit.cache.fingerprint import DeviceKey, job_key
from autofit.plans.sizelog import SizeLog, config_of
from autofit.plans import precision as precisions
from autofit.plans.plan import Plan

log = logging.getLogger("autofit")


class Memo:
    def __init__(self, *, model, batch, optimizer, global_batch: int, precision: str, device,
                 enabled: bool = True):
        # Only a device that can run out of memory has anything worth remembering.
        self.enabled = enabled and device.counts
        self.key = self.fields = None
        self.cache = None
        if not self.enabled:
            return
        self.key, self.fields = job_key(
            model=model, batch=batch, optimizer_name=type(optimizer).__name__,
            global_batch=global_batch, precision=precision,
            device=DeviceKey(device.name, getattr(device, "total_bytes", None), device.budget,
                             getattr(device, "parallel", None)))
        self.global_batch = global_batch
        self.precision = precision
        try:
            self.cache = PlanCache()
        except Exception as error:  # a path that is a directory, say: never stops training
            log.warning("plan cache not used: %s", error)
            self.enabled = False
            return
        self.started = time.perf_counter()
        self.known: dict = {}  # caps -> the calibration read for this model and device

    def calibration(self, caps: str) -> float | None:
        """The newest calibration cached for this model on this device comparing `caps` peaks,
        or None (none stored, or no cache)."""
        if not self.enabled:
            return None
        try:
            entries = self.cache.entries()  # newest first; invalid rows are skipped there
        except Exception as error:  # a cache that cannot be read never stops training
            log.warning("plan cache %s not read: %s", self.cache.path, error)
            return None
        same = ("model", "device", "torch", "autofit")
        for row in entries:
            entry, fields = row["entry"], row["fields"]
            if all(fields.get(k) == self.fields[k] for k in same) and \
                    entry.get("calibrated_peak") == caps and entry.get("calibration") is not None:
                self.known[caps] = entry["calibration"]
                return entry["calibration"]
        return None

    def recall(self, sizes: SizeLog, not_applicable=None) -> tuple[Plan, dict] | None:
        """The cached plan and its entry, with the sizes it was proven against loaded into `sizes`.
        A row that cannot be read or contradicts the job (another precision than the one asked
        for, a plan `not_applicable(plan) -> reason | None` refuses) is ignored with a warning."""
        if not self.enabled:
            return None
        try:
            return self._recall(sizes, not_applicable)
        except Exception as error:  # never raises into a run
            log.warning("plan cache %s: entry %s ignored: %s", self.cache.path, self.key[:12], error)
            return None

    def _recall(self, sizes: SizeLog, not_applicable) -> tuple[Plan, dict] | None:
        try:
            entry = self.cache.get(self.key)
            plan = self.cache.get_plan(self.key) if entry is not None else None
        except Exception as error:  # a locked or unreadable cache must not stop training
            log.warning("plan cache %s not read: %s", self.cache.path, error)
            return None
        if plan is None:
            return None
        wrong = None
        if self.precision != precisions.AUTO and plan.precision != self.precision:
            wrong = f"its plan is {plan.precision} but this job asks for precision={self.precision!r}"
        elif not_applicable is not None:
            wrong = not_applicable(plan)
        if wrong:
            log.warning("plan cache %s: entry %s ignored: %s", self.cache.path, self.key[:12], wrong)
            return None
        config = config_of(plan)
        try:
            known = SizeLog.from_json(entry["sizes"]) if "sizes" in entry else None
        except (KeyError, TypeError, ValueError) as error:
            log.warning("plan cache %s: the sizes of entry %s are unreadable (%s); using its plan only",
                        self.cache.path, self.key[:12], error)
            known = None
        if known is not None:
            try:  # sizes must be positive ints at int (or every) lengths
                _check_sizes(known)
            except (TypeError, ValueError) as error:
                log.warning("plan cache %s: the sizes of entry %s are unreadable (%s); using its plan "
                            "only", self.cache.path, self.key[:12], error)
                known = None
        if known is None or not known.fits.get(config):  # an entry of an earlier autofit
            known = SizeLog()
            known.record(plan, True)  # for every length
        # The sizes proven for each row length are taken as settled: no upward probe at those
        # lengths, so a rerun on the same data makes no OOM attempt.
        known.settle_proven(plan)
        sizes.adopt(known)
        return plan, entry

    def remember(self, plan: Plan, sizes: SizeLog, attempts, samples: int,
                 calibration: float | None = None, throughput: float | None = None,
                 calibrated: str | None = None, steady: bool | None = None) -> None:
        """Cache the plan proven for the longest rows trained, with the sizes proven for each length.
        `calibration`: the factor this run measured, comparing `calibrated` peaks ("reserved" or
        "allocated"); without one, the factor read at the start (if any) is kept. `steady`: whether the
        plan ran a step with the optimizer state resident (None: read from `attempts`, see
        `ran_steady`); a plan that did not is not cached."""
        if not self.enabled:
            return
        longest = sizes.longest_fit(plan)
        length = None
        if longest is not None:
            length, size = longest
            plan = plan.with_micro_batch(size, self.global_batch)
        if not (ran_steady(plan, attempts) if steady is None else steady):
            # The first step makes the optimizer state and lazily made buffers: a plan that only
            # fitted that step may not fit the next (issue 39); it is not worth remembering.
            log.info("plan cache: %s not cached: it ran no step after the run's first", plan.describe())
            return
        if calibration is None and calibrated is not None:  # keep what is known, never erase it
            calibration = self.known[calibrated] if calibrated in self.known else \
                self.calibration(calibrated)
        ok = [a.peak_bytes for a in attempts if a.outcome == "ok" and a.plan == plan]
        seconds = time.perf_counter() - self.started
        config = config_of(plan)
        mine = SizeLog(fits={config: dict(sizes.fits.get(config, {}))},
                       fails={config: dict(sizes.fails.get(config, {}))})
        entry = {
            "plan": plan.to_dict(),
            "peak_bytes": max(ok) if ok else 0,
            "calibration": calibration,
            "calibrated_peak": calibrated,
            # samples/s: measured by the caller (autofit.tune), else over this run
            "throughput": throughput if throughput is not None else (
                samples / seconds if seconds > 0 and samples else None),
            "smallest_failing_micro_batch": sizes.fail(plan, length=math.inf if length is None else length),
            # Elements per row (batches.row_elements) of the longest batch the plan was proven on;
            # None: for any length.
            "proven_row_elements": length,
            "sizes": mine.to_json(),
        }
        try:
            self.cache.put(self.key, self.fields, entry)
        except Exception as error:
            log.warning("plan cache %s not written: %s", self.cache.path, error)


def ran_steady(plan: Plan, attempts) -> bool:
    """Whether `plan` (or its configuration at a micro-batch at least as large) ran a good step after
    the run's first good step, when the optimizer state is resident; an offloaded plan's first step
    proves as much (its state is made in host memory)."""
    good = [a for a in attempts if a.outcome == "ok"]
    config = config_of(plan)
    return any(config_of(a.plan) == config and a.plan.micro_batch_size >= plan.micro_batch_size
               and (i > 0 or a.plan.offload_optimizer) for i, a in enumerate(good))


def _check_sizes(known: SizeLog) -> None:
    for table in (known.fits, known.fails):
        for key, sizes in table.items():
            for length, size in sizes.items():
                if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                    raise ValueError(f"size {size!r} for {list(key)} is not a positive int")
                if isinstance(length, bool) or not isinstance(length, (int, float)) or length < 0:
                    raise ValueError(f"row length {length!r} for {list(key)} is not a number")
