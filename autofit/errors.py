"""Errors autofit raises on purpose, each saying what failed and what to do."""

from __future__ import annotations

import torch

from autofit.sizes import format_breakdown, format_size


def chain(error: BaseException | None):
    """`error`, then the errors it was raised from or during, as Python prints the chain:
    `__cause__`, else `__context__` unless the raise suppressed it (`raise X from None`)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        if error.__cause__ is not None:
            error = error.__cause__
        elif error.__suppress_context__:
            return
        else:
            error = error.__context__


def one_line(error: BaseException) -> str:
    """'Type: first line of the message' (torch's messages run to many lines)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class DoesNotFit(RuntimeError):
    """No plan of the ladder fits the budget. Carries every attempt and the last breakdown."""

    def __init__(self, message: str, attempts=(), breakdown: dict | None = None,
                 budget: int | None = None, plan=None, *, refusal: str = "", leaks=()):
        self._given = (message, attempts, breakdown, budget, plan)
        self.refusal = refusal    # why splitting was forbidden (plans/coupling), said first
        self.leaks = list(leaks)  # autofit.diagnosis.leaks findings: what the user's code kept on the device
        if refusal:
            message = f"{refusal}\n{message}"
        self.attempts = list(attempts)
        self.breakdown = dict(breakdown or {})
        self.budget = budget
        self.plan = plan if plan is not None else getattr(self.attempts[-1] if self.attempts else None,
                                                          "plan", None)
        lines = [message]
        if self.breakdown:
            label = "memory at the last failure" if self.attempts else \
                f"estimated peak of the leanest plan ({plan.describe()})" if plan else "estimated peak"
            lines.append(f"{label}: " + format_breakdown(self.breakdown, budget))
        if self.attempts:
            lines.append("plans tried:")
            for a in self.attempts:
                lines.append(f"  {a.describe()}")
        super().__init__("\n".join(lines))

    def explained(self, refusal: str, leaks) -> "DoesNotFit":
        """This error with why splitting was forbidden said first (once) and the leaks found; itself
        when that adds nothing."""
        refusal = self.refusal or refusal
        if refusal == self.refusal and list(leaks) == self.leaks:
            return self
        return DoesNotFit(*self._given, refusal=refusal, leaks=leaks)


class MissingInternal(RuntimeError):
    """This torch (or transformers, accelerate) lacks a private name an autofit feature needs
    (autofit.torch_internals and the other adapters name it, the version found and the feature)."""


class PartialUpdateError(RuntimeError):
    """The optimizer ran out of memory mid-update without a snapshot; retrying would corrupt it.
    Not an out-of-memory error to recover from (oom.is_oom says no), though its text quotes one."""


class MemoryNotReleased(RuntimeError):
    """After an OOM, memory did not return to what was allocated before the attempt."""

    def __init__(self, extra: int, holders: str, fix: str | None = None):
        fix = fix or ("something outside the step keeps tensors of the failed attempt alive (a loss or "
                      "output stored in a list, a global, a hook); keep Python numbers (loss.item()) instead.")
        super().__init__(
            f"after an out-of-memory attempt {format_size(extra)} stayed allocated above the "
            f"pre-attempt baseline, held by {holders}. {fix[0].upper()}{fix[1:]}")


class NoLossError(ValueError):
    """The model returned no loss and no loss_fn was given."""


class MetricError(RuntimeError):
    """A user's metric function failed on an evaluation batch."""


class ModelSpecError(ValueError):
    """A model spec that cannot be turned into a model and a batch; the message is one line."""


class AllocationFailed(Exception):
    """The limit leaves no room for the segment this request needs, even after releasing the cache."""

    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


class RankFailed(RuntimeError):
    """Another rank raised an error that is not an out-of-memory error; every rank stops."""

    def __init__(self, message: str, rank: int, error: str):
        super().__init__(message)
        self.rank, self.error = rank, error


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory in this attempt; this rank drops the attempt as well."""


class LockstepError(RuntimeError):
    """The ranks are not at the same point of the run (different data, or different plans)."""


class UsageError(Exception):
    """Bad command-line usage: printed as one "autofit: error:" line, exit status 2."""
