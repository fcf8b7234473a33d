"""A job's own rules for the controller, besides its ladder: which plans it refuses whatever path
proposes them (`refuses(plan) -> reason | None`: a split where allow_split=False forbids it), the
last resort it walks when the ladder has no step left (`reach`, a move: plans/reach.py), and what
its own hooks kept of an attempt, dropped when the attempt fails (`forget()`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Rules:
    refuse: Callable | None = None  # plan -> why it may not run, or None
    reach: object | None = None     # a Move, or None: the ladder's end is the end
    forget: Callable | None = None  # drops what the job's hooks kept of a failed attempt

    def refuses(self, plan) -> str | None:
        return None if self.refuse is None else self.refuse(plan)

    def failed(self) -> None:
        if self.forget is not None:
            self.forget()
