"""A run's step after the step before it, laid out from one walk per plan.

Where the budget caps reserved bytes, the guide asks for the reserved peak of a plan's step on the
cache the step before it left (`Estimator.measure(plan, after=...)`). Walking both steps costs two
steps of fake dispatch per question, and the guide asks several (its start's search, then one per
good step it learns from). The two steps' allocator calls are known without a second walk:

- a whole global step of a plan, walked once with the optimizer state laid out before it (`Walk`),
  makes the same allocator calls in the same order as a run's second step of that plan: the walk's
  ops do not depend on what the meter counts, only the state's blocks differ, and they were
  made before the step in both;
- a run's first step makes those calls too, with the state's blocks taken where the optimizer's
  lazy initialisation takes them: when its update begins (the meter's `("s",)` mark), or at the
  step's end where the step never ran the optimizer.

So `first_then(first, then)` lays out the parameters, `first`'s step with the state made at its
mark, the peak reset, and `then`'s step, each step's blocks named apart; replaying that list
through the allocator model (`autofit.gpu.recorded.replay_capped`) gives the reserved peak the
two-step walk gives, to the byte (`tests/test_replayed.py`). A step that frees a block it did not
make (one the walk's own parameters or state hold) cannot be laid after another walk's: None, and
the estimator walks both steps.
"""

from __future__ import annotations

from dataclasses import dataclass

STEP_MARK = ("s",)   # the optimizer's update begins (the meter's step_begins)
PEAK_RESET = ("r",)  # the measured step begins: a replay's peak counts from here


@dataclass(frozen=True)
class Walk:
    """One walk of a plan's whole global step with its state laid out first: its estimate and the
    allocator's calls, `events[:params]` the parameters' blocks, `events[params:state]` the state's,
    then the peak reset and the step's own calls."""

    estimate: object  # MemoryEstimate
    events: list
    params: int
    state: int

    @property
    def step(self) -> list:
        return self.events[self.state + 1:]  # past the peak reset


def first_then(first: Walk, then: Walk) -> list | None:
    """The allocator calls of a run whose first step is `first`'s plan and whose next step is
    `then`'s (the state's blocks are `then`'s: the plan measured decides where the state lives),
    or None when a step frees a block made outside it."""
    state = then.events[then.params:then.state]
    one = _named_apart(first.step, 1, outside=set())
    two = _named_apart(then.step, 2, outside={e[3] for e in then.events[:then.state] if e[0] == "m"})
    if one is None or two is None:
        return None
    at = one.index(STEP_MARK) + 1 if STEP_MARK in one else len(one)
    return then.events[:then.params] + one[:at] + state + one[at:] + [PEAK_RESET] + two


def _named_apart(step: list, copy: int, outside: set) -> list | None:
    """`step`'s calls with the blocks it makes named `(copy, n)`, so two steps replayed one after
    the other never share a name; a free of a block in `outside` keeps its name (it was made
    before the step, in the same walk); None for a free of a block made nowhere in view."""
    names: dict = {}
    out = []
    for e in step:
        if e[0] == "m":
            names[e[3]] = (copy, len(out))
            out.append(e[:3] + (names[e[3]],))
        elif e[0] == "f":
            if e[1] in names:
                out.append(("f", names.pop(e[1])))
            elif e[1] in outside:
                out.append(e)
            else:
                return None
        else:
            out.append(e)
    return out
