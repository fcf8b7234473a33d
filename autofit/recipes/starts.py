"""Where a training job starts: an ordered tuple of small strategies, each answering a `Start` or
None, the first answer winning (`first_start`): a stepper's resumed state, a tuned plan, the plan
cache's, the capacity check's estimate, and the whole global batch, which always answers.

A strategy reads the job (`recipes.training.Training`, set up and agreed on the first batch) and
what the first batch asks (`FirstBatch`); the ones that know sizes already fill the job's SizeLog.
"""

from __future__ import annotations

from dataclasses import dataclass

from autofit.estimator.start import (SETTLE_WITHIN, TrainingStep, budget_caps, estimated_start, longest_batch,
                                     make_guide)
from autofit.plans import precision as precisions
from autofit.plans.applies import not_applicable
from autofit.plans.plan import Plan


@dataclass(frozen=True)
class FirstBatch:
    """The first global batch and what came with it."""

    given: object          # as the data gave it
    first: object          # row-first (engine/layout.py)
    rows: int              # the rows a plan covers: this rank's share, the same on every rank
    data: object = None    # for the longest batch the capacity check estimates
    tuned: object = None   # an autofit.TuneResult
    resume: tuple | None = None  # (plan, SizeLog) from a stepper's state_dict


@dataclass(frozen=True)
class Start:
    plan: Plan
    reason: str
    settle_within: float = 0.0  # the upward search's tolerance (0: settled, no upward probe)
    guide: object = None        # the estimate-guided upward search, when the estimate chose


def resumed(job, asked: FirstBatch) -> Start | None:
    """A resumed job starts settled, from the plan and sizes its state_dict proved."""
    if asked.resume is None:
        return None
    plan, known = asked.resume
    known.settle_proven(plan)
    job.sizes.adopt(known)
    return Start(plan.with_micro_batch(plan.micro_batch_size, asked.rows),
                 "resumed: the plan and sizes of a state_dict")


def tuned(job, asked: FirstBatch) -> Start | None:
    """The plan autofit.tune measured fastest, settled for every row length."""
    found = asked.tuned
    if found is None:
        return None
    job.sizes.settle(found.plan)
    return Start(found.plan.with_micro_batch(found.plan.micro_batch_size, asked.rows),
                 f"tuned: chosen of {len(found.space)} plan(s) measured "
                 f"({found.samples_per_second:.1f} samples/s, median of rounds)")


def cached(job, asked: FirstBatch) -> Start | None:
    """The plan that worked for this job on this device before, unless it cannot apply now."""
    recalled = job.memo.recall(job.sizes, not_applicable=lambda plan: not_applicable(
        plan, job.model, job.optimizer, job.device))
    if recalled is None:
        return None
    return Start(recalled[0], f"cached: worked for this job on {job.device.describe()}")


def estimated(job, asked: FirstBatch) -> Start | None:
    """The fastest plan the capacity check predicts to fit the longest batch (autofit's ladder only)."""
    if not job.capacity_check or job.user_ladder is not None:
        return None
    lockstep, device = job.lockstep, job.device
    longest = longest_batch(asked.data, asked.given) if asked.data is not None else asked.given
    batch = asked.first if longest is asked.given else job.layout.rows_first(longest)
    # The guide's probe is one rank's estimate: under torch.distributed the ranks' agreement steers
    # the search instead.
    guide = None if job.distributed else make_guide(device, job.memo.calibration(budget_caps(device)), job.model)
    step = TrainingStep(job.model, lockstep.local(batch), job.optimizer, job.loss_fn)
    found = estimated_start(step, lockstep.estimate_view(device), job.precision, job.sizes,
                            coupling=job.coupling, guide=guide)
    if found is None:
        return None
    plan, reason = found
    return Start(plan.with_micro_batch(plan.micro_batch_size, asked.rows), reason, SETTLE_WITHIN, guide)


def whole_batch(job, asked: FirstBatch) -> Start:
    """The whole global batch at once; the ladder finds the plan from there."""
    return Start(Plan.for_batch(asked.rows, precision=precisions.start_precision(job.precision)),
                 "start: the whole global batch at once")


STRATEGIES = (resumed, tuned, cached, estimated, whole_batch)


def first_start(job, asked: FirstBatch, strategies=STRATEGIES) -> Start:
    """The answer of the first strategy that has one (whole_batch always has)."""
    answers = (strategy(job, asked) for strategy in strategies)
    return next(start for start in answers if start is not None)
