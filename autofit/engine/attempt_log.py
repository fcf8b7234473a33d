"""Every attempt of a run, kept in memory that grows with what changed, not with the steps.

A long run makes one attempt per global batch, nearly all of them alike: "ok" under the same plan,
for the same reason, one step after the other. A list of `Attempt`s costs about 300 bytes per step
(305 MiB per million steps); `AttemptLog` keeps such a run of successes as one entry (the first
attempt and a count) and their peaks in an array of 8-byte integers (none at all while the peak
repeats, as it does for batches of one shape). Failures, withdrawals and every change of plan or
reason are entries of their own.

Reading it gives back exactly the attempts recorded: it is a `Sequence` (len, index, slice,
iteration) of `Attempt`s, equal field by field to what was appended.
"""

from __future__ import annotations

import bisect
import dataclasses
from array import array
from collections.abc import Sequence

from autofit.engine.attempt import Attempt


# What successes of one entry share: every field of an Attempt but its step and peak.
_ALIKE = tuple(f.name for f in dataclasses.fields(Attempt) if f.name not in ("step", "peak_bytes"))


class _Run:
    """Successes `first`, then `count - 1` more at the next steps, alike but for their peaks."""

    __slots__ = ("first", "count", "peaks")

    def __init__(self, first: Attempt):
        self.first, self.count, self.peaks = first, 1, None  # peaks: array once one differs

    def takes(self, attempt: Attempt) -> bool:
        first = self.first
        return (attempt.outcome == first.outcome == "ok" and attempt.step == first.step + self.count
                and all(getattr(attempt, name) == getattr(first, name) for name in _ALIKE))

    def add(self, attempt: Attempt) -> None:
        if self.peaks is None and attempt.peak_bytes != self.first.peak_bytes:
            self.peaks = array("q", [self.first.peak_bytes] * self.count)
        if self.peaks is not None:
            self.peaks.append(attempt.peak_bytes)
        self.count += 1

    def at(self, k: int) -> Attempt:
        if k == 0:
            return self.first
        peak = self.first.peak_bytes if self.peaks is None else self.peaks[k]
        return dataclasses.replace(self.first, step=self.first.step + k, peak_bytes=peak)


class AttemptLog(Sequence):
    """The attempts of a run in order (see the module's docstring)."""

    def __init__(self, attempts=()):
        self._runs: list[_Run] = []
        self._starts: list[int] = []  # index of each run's first attempt
        self._len = 0
        for attempt in attempts:
            self.append(attempt)

    def append(self, attempt: Attempt) -> None:
        if not isinstance(attempt, Attempt):
            raise TypeError(f"an AttemptLog holds Attempts, not {type(attempt).__name__}.")
        if self._runs and self._runs[-1].takes(attempt):
            self._runs[-1].add(attempt)
        else:
            self._runs.append(_Run(attempt))
            self._starts.append(self._len)
        self._len += 1

    @property
    def entries(self) -> int:
        """How many entries hold the attempts (what the memory grows with)."""
        return len(self._runs)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"attempt index {index} out of range for {self._len} attempts")
        run = bisect.bisect_right(self._starts, index) - 1
        return self._runs[run].at(index - self._starts[run])

    def __iter__(self):
        for run in self._runs:
            for k in range(run.count):
                yield run.at(k)

    def of_step(self, step: int) -> list[Attempt]:
        """The attempts of global step `step`, read from the end (steps only grow, and a step's
        attempts are the last ones while it runs)."""
        found = []
        for i in range(self._len - 1, -1, -1):
            attempt = self[i]
            if attempt.step < step:
                break
            if attempt.step == step:
                found.append(attempt)
        return found[::-1]

    def __eq__(self, other) -> bool:
        if isinstance(other, (AttemptLog, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"AttemptLog({self._len} attempts in {len(self._runs)} entries)"
