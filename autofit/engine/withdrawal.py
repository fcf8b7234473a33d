"""Moves withdrawn for a run: a plan a move made whose first attempt raised an error that is not
out-of-memory, which the plan before it (out of memory on the same global batch) did not raise; and
a precision or checkpointing move whose peak is not lower than the plan's without it (bf16 on a
model whose weight copies cost more than its activations save), which only costs speed or exactness.

The move cannot run for this job (bf16 on a CPU whose oneDNN has no bf16 LSTM kernel), so every
plan with the value it set is skipped for the rest of the run, with the error as the reason. An
error a withdrawn move raised already is the job's own (the plans share it), as is one from the
optimizer step (its partial update only an out-of-memory rollback undoes): those propagate.
"""

from __future__ import annotations

import logging

from autofit.gpu.oom import summarize
from autofit.plans.plan import Plan
from autofit.sizes import format_size

log = logging.getLogger("autofit")

SIZES = ("micro_batch_size", "accumulation_steps")
MOVES = ("precision", "checkpointing")  # the moves judged by the peak they save


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {summarize(error)}"


class Withdrawals:
    """{(plan field, value): the error} of a run's withdrawn moves."""

    def __init__(self):
        self.withdrawn: dict[tuple, str] = {}

    def takes(self, phase: str):
        """`Attempter`'s `also`: whether an error, raised in the phase `phase()` reads, is a move's."""
        def take(error) -> bool:
            return error_text(error) not in self.withdrawn.values() and not phase().startswith("optimizer")
        return take

    def withdraw(self, plan: Plan, before: Plan, error: str) -> None:
        """The values `plan` changed from `before` (its micro-batch when nothing else changed)."""
        changed = [(f, getattr(plan, f)) for f in Plan.__dataclass_fields__
                   if f not in SIZES and getattr(plan, f) != getattr(before, f)]
        for key in changed or [("micro_batch_size", plan.micro_batch_size)]:
            self.withdrawn[key] = error
        log.warning("%s raised %s, which %s did not; that move is withdrawn for the rest of the run and the "
                    "ladder goes on without it", plan.describe(), error, before.describe())

    def withdraw_costlier(self, plan: Plan, without: Plan, peak: int, other: int) -> str:
        """`plan`'s move is predicted to peak at `peak` bytes, not lower than `other` for `without`
        (the same sizes without the move): withdrawn, and the reason said."""
        why = (f"its peak is not lower: {format_size(peak)} predicted against {format_size(other)} for "
               f"{without.describe()}")
        changed = [(f, getattr(plan, f)) for f in MOVES if getattr(plan, f) != getattr(without, f)]
        for key in changed:
            self.withdrawn[key] = why
        log.warning("%s: %s; that move is withdrawn for the rest of the run and the ladder goes on "
                    "without it", plan.describe(), why)
        return why

    def reason(self, plan: Plan) -> str | None:
        """Why `plan` may not run (a value a withdrawn move set), or None."""
        for (field, value), error in self.withdrawn.items():
            if getattr(plan, field) == value:
                said = error if error.startswith("its peak") else f"it raised {error}"
                return f"{field}={value!r} was withdrawn: {said}"
        return None
