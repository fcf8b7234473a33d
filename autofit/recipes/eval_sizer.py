"""Evaluation's own small ladder: the evaluation batch size (halved after an out-of-memory error,
never tried again at a size known to fail, remembered between evaluations) and the record of the
sizes tried."""

from __future__ import annotations

from dataclasses import dataclass

from autofit.sizes import format_size


@dataclass(frozen=True)
class EvalAttempt:
    """One evaluation batch size tried: the first at each size, and every one that ran out of memory."""

    batch_size: int        # rows put through one forward pass
    outcome: str           # "ok" | "oom"
    reason: str            # why this size was tried
    batch: int = 0         # index of the data's batch (or of the Dataset chunk) being evaluated
    first_sample: int = 0  # index of the first sample of the attempt in the evaluation data
    peak_bytes: int = 0
    error: str = ""        # the OOM message, for outcome "oom"

    def describe(self) -> str:
        text = f"evaluation batch {self.batch}: {self.batch_size} rows -> {self.outcome}"
        if self.peak_bytes:
            text += f" (peak {format_size(self.peak_bytes)})"
        if self.outcome == "oom":
            text += f": {self.error}"
        return text + f" [{self.reason}]"


@dataclass
class EvalSizer:
    """The evaluation batch size, remembered across calls (autofit.run keeps one per run).

    `size`: rows per forward pass now (None: each batch as the data yields it); `fits`: the most
    rows that ran; `fails`: the fewest rows that ran out of memory, never tried again.
    """

    size: int | None = None
    fits: int = 0
    fails: int | None = None

    def rows(self, remaining: int, ceiling: int | None = None) -> int:
        """Rows to evaluate next out of `remaining`; 0 when even one row is known to fail."""
        size = remaining if self.size is None else self.size
        if ceiling is not None:
            size = min(size, ceiling)
        if self.fails is not None:
            size = min(size, self.fails - 1)
        return max(min(size, remaining), 0)

    def ok(self, rows: int) -> None:
        self.fits = max(self.fits, rows)

    def oom(self, rows: int) -> int | None:
        """Record a failure at `rows`; the next size (halved), or None when one row failed."""
        self.fails = rows if self.fails is None else min(self.fails, rows)
        if self.fits >= rows:
            self.fits = 0  # it fitted when more memory was free; not any more
        if rows <= 1:
            return None
        self.size = rows // 2
        return self.size
