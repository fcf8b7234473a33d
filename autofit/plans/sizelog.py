"""SizeLog: the micro-batch sizes seen to fit or fail, per plan configuration and per row length.

The ladder's micro-batch moves and the controller's upward search read it; the plan cache and the
ranks' agreement carry it as plain JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autofit.plans.plan import Plan
from autofit.plans import switches


def config_of(plan: Plan) -> tuple:
    """What a micro-batch size's memory depends on besides the size itself and the batch's rows.
    (A per-parameter step and FSDP2's settings are appended only when set, so keys cached before
    them stay the same.)"""
    key = (plan.precision,)
    for switch in switches.SWITCHES:  # each switch's own part of the key (plans/switches.py)
        key += switch.config(getattr(plan, switch.name))
    return key


EVERY = None  # a length not given: a record or a question about every length


class Unguided:
    """The upward search without estimates (`autofit.estimator.guide.Guide`'s interface): no guess,
    so `SizeLog.probe_up` bisects; nothing learned from a good attempt or a failed one."""

    measured = None
    calibration = 1.0

    def largest(self, plan: Plan, fit: int, ceiling: int, length=None) -> None:
        return None

    def observe(self, plan: Plan, peak: int, length, first: bool = False) -> None:
        pass

    def failed(self, plan: Plan, length, reached: int | None = None) -> None:
        pass


@dataclass
class SizeLog:
    """Micro-batch sizes seen to fit or fail, per configuration and per row length.

    Memory grows with the micro-batch and with the length of its rows (`batches.row_elements`:
    for token batches, a multiple of the sequence length), so a size that fitted at length L fits
    every shorter row, and a size that failed at length L fails at every longer one. The sizes
    proven for one length are therefore never taken for a longer one: a run that probed up on short
    batches goes back to the size proven for long ones when a long batch arrives.

    `length` is the row length of the global batch being trained (the controller sets it); the
    queries and records use it unless given another. A length of None stands for every length:
    a fit recorded without a length holds at every length, a failure fails at every length.
    """

    fits: dict = field(default_factory=dict)   # config -> {length: largest size that fitted at it}
    fails: dict = field(default_factory=dict)  # config -> {length: smallest size that failed at it}
    length: int | None = EVERY

    def record(self, plan: Plan, ok: bool, global_batch: int | None = None, length=None) -> None:
        key, size = config_of(plan), plan.micro_batch_size
        length = self.length if length is None else length
        if global_batch is not None:
            size = min(size, global_batch)
        if ok:
            at = math.inf if length is EVERY else length
            fits = self.fits.setdefault(key, {})
            fits[at] = max(fits.get(at, 0), size)
            return
        at = 0 if length is EVERY else length
        fails = self.fails.setdefault(key, {})
        fails[at] = min(fails.get(at, size), size)
        # What fitted at this length or longer with as many rows fitted before the optimizer state
        # existed (or not at all): not any more.
        fits = self.fits.get(key, {})
        for seen in [l for l, s in fits.items() if l >= at and s >= size]:
            del fits[seen]
        if not fits:
            self.fits.pop(key, None)

    def forget_fail(self, plan: Plan, length=EVERY) -> None:
        """Forget the failure of `plan`'s size at `length` (an expired failure), if still recorded."""
        at = 0 if length is EVERY else length
        fails = self.fails.get(config_of(plan), {})
        if fails.get(at) == plan.micro_batch_size:
            del fails[at]
            if not fails:
                self.fails.pop(config_of(plan), None)

    def settle(self, plan: Plan, length=None) -> None:
        """`plan`'s micro-batch is the largest that fits its configuration at `length`: no probe
        above it there (a cached or tuned plan)."""
        self.record(plan, True, length=length)
        self.record(plan.replace(micro_batch_size=plan.micro_batch_size + 1), False, length=length)

    def fit(self, plan: Plan, length=None) -> int | None:
        """The largest size known to fit `plan`'s configuration at `length` (fitted at it or longer)."""
        length = self.length if length is None else length
        at = math.inf if length is EVERY else length
        sizes = [s for l, s in self.fits.get(config_of(plan), {}).items() if l >= at]
        return max(sizes) if sizes else None

    def fail(self, plan: Plan, length=None) -> int | None:
        """The smallest size known to fail `plan`'s configuration at `length` (failed at it or
        shorter)."""
        length = self.length if length is None else length
        at = math.inf if length is EVERY else length
        sizes = [s for l, s in self.fails.get(config_of(plan), {}).items() if l <= at]
        return min(sizes) if sizes else None

    def longest_fit(self, plan: Plan) -> tuple[int | None, int] | None:
        """(length, size) proven at the longest length for `plan`'s configuration (length None: at
        every length), or None when nothing fitted."""
        fits = self.fits.get(config_of(plan))
        if not fits:
            return None
        longest = max(fits)
        return (EVERY if longest == math.inf else longest), fits[longest]

    def adopt(self, known: "SizeLog") -> None:
        """What `known` recorded (a cache entry, a state_dict, rank 0's agreement) in place of this
        log's, keeping the row length being trained."""
        self.fits, self.fails = known.fits, known.fails

    def settle_proven(self, plan: Plan) -> None:
        """Settle every size proven for `plan`'s configuration at the length it was proven at."""
        for length, size in list(self.fits.get(config_of(plan), {}).items()):
            self.settle(plan.replace(micro_batch_size=size), length=EVERY if length == math.inf else length)

    def known_to_fail(self, plan: Plan, length=None) -> bool:
        failed = self.fail(plan, length)
        return failed is not None and plan.micro_batch_size >= failed

    def probe_up(self, plan: Plan, global_batch: int, length=None, guess=None) -> Plan | None:
        """The next larger micro-batch worth trying for this configuration, or None when settled.

        `guess(plan, fit, ceiling, length) -> size | None`: the largest size in [fit, ceiling)
        predicted to fit (an `autofit.estimator.guide.Guide`'s `largest`); the probe goes there
        (none when it is `fit`). Without a guess (None), it bisects between the largest size that
        fitted and the smallest that failed, trying the whole batch first when none failed."""
        fit = self.fit(plan, length)
        if fit is None or fit != plan.micro_batch_size:
            return None
        ceiling = min(self.fail(plan, length) or global_batch + 1, global_batch + 1)
        if ceiling - fit <= 1:
            return None
        target = None if guess is None else guess(plan, fit, ceiling,
                                                  self.length if length is None else length)
        if target is not None:
            return plan.with_micro_batch(target, global_batch) if fit < target < ceiling else None
        size = (fit + ceiling) // 2 if ceiling <= global_batch else global_batch
        return plan.with_micro_batch(size, global_batch)

    def to_json(self) -> dict:
        """Plain JSON (lengths of every length as null), for agreeing across ranks and caching."""
        def rows(table, every):
            return [[list(key), [[None if l == every else l, s] for l, s in sorted(sizes.items())]]
                    for key, sizes in table.items()]
        return {"fits": rows(self.fits, math.inf), "fails": rows(self.fails, 0)}

    @classmethod
    def from_json(cls, data: dict) -> "SizeLog":
        def table(rows, every):
            return {tuple(key): {every if l is None else l: s for l, s in sizes} for key, sizes in rows}
        return cls(fits=table(data["fits"], math.inf), fails=table(data["fails"], 0))
