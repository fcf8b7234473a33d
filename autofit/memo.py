"""What a run remembers between runs: the plan that worked for this job on this device.

A cached plan is the start of the next run of the same job, and the sizes it was proven against
are loaded into the micro-batch search, so the second run makes no OOM attempt and no probe.
A cache that cannot be read or written never stops training: it is reported and skipped.
"""

from __future__ import annotations

import logging
import time

from .cache import PlanCache
from .fingerprint import job_key
from .ladder import SizeLog, config_of
from .plan import Plan

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
            global_batch=global_batch, precision=precision, device_name=device.name,
            device_total=getattr(device, "total_bytes", None), budget=device.budget)
        self.cache = PlanCache()
        self.started = time.perf_counter()

    def recall(self, sizes: SizeLog) -> tuple[Plan, dict] | None:
        """The cached plan and its entry, with the sizes it was proven against loaded into `sizes`."""
        if not self.enabled:
            return None
        try:
            entry = self.cache.get(self.key)
            plan = self.cache.get_plan(self.key) if entry is not None else None
        except Exception as error:  # a locked or unreadable cache must not stop training
            log.warning("plan cache %s not read: %s", self.cache.path, error)
            return None
        if plan is None:
            return None
        # The cached plan is taken as settled: no upward probe, so a rerun makes no OOM attempt.
        config = config_of(plan)
        sizes.fits[config] = plan.micro_batch_size
        sizes.fails[config] = plan.micro_batch_size + 1
        return plan, entry

    def remember(self, plan: Plan, sizes: SizeLog, attempts, samples: int,
                 calibration: float | None = None) -> None:
        if not self.enabled:
            return
        ok = [a.peak_bytes for a in attempts if a.outcome == "ok" and a.plan == plan]
        seconds = time.perf_counter() - self.started
        entry = {
            "plan": plan.to_dict(),
            "peak_bytes": max(ok) if ok else 0,
            "calibration": calibration,
            "throughput": samples / seconds if seconds > 0 and samples else None,
            "smallest_failing_micro_batch": sizes.fails.get(config_of(plan)),
        }
        try:
            self.cache.put(self.key, self.fields, entry)
        except Exception as error:
            log.warning("plan cache %s not written: %s", self.cache.path, error)
