"""Which plan `autofit.tune` crowns: each plan's median and spread over the rounds of a
measurement, the rule that a lead must be larger than the spread, and the result with its table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from autofit.errors import DoesNotFit
from autofit.plans.plan import Plan
from autofit.diagnosis.report import table
from autofit.tuning.study import TuneTrial

# A plan replaces the default one only when its median is more than 3% above the default's (and
# its lead exceeds both spreads), so a near-tie keeps the plan the cost model and the ladder agree on.
MIN_GAIN = 0.03
ROUNDS = 5  # rounds per measurement: a median of 5 ignores up to 2 stalled rounds



@dataclass(frozen=True)
class PlanStats:
    """A plan's rounds in one measurement: `median` samples/s and `spread` (the median absolute
    deviation of its rounds, samples/s); `outcome` "oom" when any round ran out of memory."""

    plan: Plan
    outcome: str
    rounds: tuple = ()         # samples/s of its completed rounds, in round order
    median: float | None = None
    spread: float | None = None

    @property
    def relative_spread(self) -> float | None:
        return None if not self.median else self.spread / self.median


def plan_stats(trials, space) -> list[PlanStats]:
    """Per plan of `space` that has trials, in space order: its rounds, median and spread."""
    stats = []
    for plan in space:
        mine = sorted((t for t in trials if t.plan == plan), key=lambda t: (t.round, t.number))
        if not mine:
            continue
        if any(t.outcome != "ok" for t in mine):
            stats.append(PlanStats(plan, "oom" if any(t.outcome == "oom" for t in mine) else "error"))
            continue
        values = tuple(t.samples_per_second for t in mine)
        median = statistics.median(values)
        stats.append(PlanStats(plan, "ok", values, median,
                               statistics.median(abs(v - median) for v in values)))
    return stats


@dataclass
class TuneResult:
    plan: Plan                                   # the winner, cached for autofit.run
    samples_per_second: float                    # its median over the rounds
    default_plan: Plan                           # where autofit.run starts without tuning
    default_samples_per_second: float | None     # None: it ran out of memory, or is not measured yet
    trials: list[TuneTrial] = field(default_factory=list)   # the finished trials of the measurement
    space: list[Plan] = field(default_factory=list)         # the plans, in the order of round 0
    measured: int = 0                            # trials this call ran
    study_name: str = ""
    storage: str = ""
    key: str = ""                                # the plan-cache key (fingerprint.job_key)
    cached: bool = False                         # whether the winner is in the plan cache
    stats: list[PlanStats] = field(default_factory=list)    # per plan: rounds, median, spread
    reason: str = ""                             # why this plan won (or the default stayed)
    measurement: int = 0                         # which measurement of the study (retune: +1)

    @property
    def speedup(self) -> float | None:
        """Median samples per second of the winner over the default plan's (None when unknown)."""
        if not self.default_samples_per_second:
            return None
        return self.samples_per_second / self.default_samples_per_second

    @property
    def spread(self) -> float | None:
        """The winner's spread (median absolute deviation of its rounds, samples/s)."""
        return next((s.spread for s in self.stats if s.plan == self.plan), None)

    def describe(self) -> str:
        rows = []
        for s in self.stats:
            ok = s.outcome == "ok"
            rows.append(["*" if s.plan == self.plan else "", s.plan.describe(), s.outcome, len(s.rounds),
                         f"{s.median:.1f}" if ok else None,
                         f"{s.relative_spread:.1%}" if ok else None,
                         f"{min(s.rounds):.1f}-{max(s.rounds):.1f}" if ok else None,
                         "yes" if s.plan == self.default_plan else ""])
        speedup = "unknown" if self.speedup is None else f"{self.speedup:.2f}x"
        spread = self.spread
        spread = "" if spread is None or not self.samples_per_second else \
            f" +/- {spread / self.samples_per_second:.1%}"
        return (table(["", "plan", "outcome", "rounds ok", "median samples/s", "spread", "range", "default"],
                      rows) +
                f"\nchosen: {self.plan.describe()}, {self.samples_per_second:.1f} samples/s{spread} "
                f"(median of rounds), {speedup} the default plan's ({self.default_plan.describe()}); "
                f"{self.reason}")


def verdict(trials, default, space, measured, study_name, where, key) -> TuneResult:
    """The first plan of the space (the default, then the cost model's order) whose median is
    within the noise of the highest median (`plan_stats`): a lead counts only when it is larger
    than the spread of both plans and than MIN_GAIN, so the default plan stays unless another
    clearly beats it, and between plans the noise cannot tell apart the cost model's order decides
    (the same plan every time, not the luckier one). A plan that ran out of memory (or failed) in
    any round is not eligible."""
    stats = plan_stats(trials, space)
    of = {s.plan: s for s in stats}
    eligible = [s for s in stats if s.outcome == "ok"]
    if not eligible:
        left = [p for p in space if p not in of]
        tried = ", ".join(f"{s.plan.describe()} -> {s.outcome}" for s in stats) or "none"
        raise DoesNotFit(f"no plan of this job completed a trial in study {study_name!r} (trials: "
                         f"{tried}); " + (f"{len(left)} plan(s) are not measured yet: run tune again "
                                          f"or with a larger n_trials." if left else
                                          "give a larger budget or a smaller global batch."))
    best = max(eligible, key=lambda s: (s.median, -eligible.index(s)))

    def within_noise(s: PlanStats) -> bool:  # the best's lead over `s` is inside a spread, or small
        return best.median - s.median <= max(best.spread, s.spread, MIN_GAIN * s.median)

    def lead_words(over: PlanStats) -> str:
        lead, noise = best.median - over.median, max(best.spread, over.spread)
        return (f"{best.plan.describe()} leads by {lead / over.median:.1%}, the larger spread of the "
                f"two is {noise / over.median:.1%}")

    chosen = next(s for s in eligible if within_noise(s))  # space order; `best` itself qualifies
    base = of.get(default)
    if chosen is base:
        reason = ("the default plan has the highest median" if chosen is best else
                  f"kept the default plan: {lead_words(base)}, within the noise (or under {MIN_GAIN:.0%})")
    elif chosen is not best:
        reason = (f"{chosen.plan.describe()} comes first in the cost model's order and "
                  f"{lead_words(chosen)}, within the noise (or under {MIN_GAIN:.0%})")
    elif base is not None and base.outcome == "ok":
        reason = f"{lead_words(base)}: a lead larger than the spread"
    else:
        reason = ("the default plan ran out of memory" if base is not None else
                  "the default plan is not measured yet") + ": the highest median wins"
    best = chosen
    return TuneResult(plan=best.plan, samples_per_second=best.median, default_plan=default,
                      default_samples_per_second=base.median if base is not None else None,
                      trials=trials, space=list(space), measured=measured, study_name=study_name,
                      storage=where, key=key, stats=stats, reason=reason)


__all__ = ["MIN_GAIN", "ROUNDS", "PlanStats", "TuneResult", "plan_stats", "verdict"]
