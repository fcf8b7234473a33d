"""The ladder's reach: every plan the capacity check would consider, tried before a run gives up.

A ladder is a path through plans; a path misses plans beside it. Checkpointing before offload misses
offload alone (on a model whose checkpointing costs more than it saves), and a batch-coupled model's
whole-batch rungs added one after another miss offload without checkpointing. `configurations` lists
every setting of the ladder's switches (mixed precision, checkpointing, optimizer offload), cheapest
in step time first (the capacity check's cost factors); `Reach` is the move that walks them, for
each configuration the largest micro-batch not known to fail first, down to one row (or the whole
batch only, where splitting is forbidden or not yet allowed).

`Reach` is a move like any other, so the controller's rules hold for what it proposes: a plan that
does not apply to the job is passed over (`walks`: `ladder.step_down` asks it again from there), a
size known to fail is never proposed, and its end is the ladder's end.
"""

from __future__ import annotations

import itertools

from autofit.plans import precision as precisions
from autofit.plans import switches
from autofit.plans.ladder import Move
from autofit.plans.plan import Plan

SWITCHED = ("checkpointing", "offload_optimizer")  # the switches a run's ladder turns on for memory


def configurations(precision: str, bf16_supported: bool = True, *, checkpoint: bool = True,
                   offload: bool = True) -> list[dict]:
    """Every {precision, checkpointing, offload_optimizer} the ladder may use, cheapest first (the
    product of the capacity check's cost factors; ties keep the ladder's order). Mixed precision
    only with precision="auto"; a fixed precision never changes."""
    names = [precisions.start_precision(precision)]
    if precision == precisions.AUTO:
        names.append(precisions.mixed_for(bf16_supported))
    allowed = {"checkpointing": checkpoint, "offload_optimizer": offload}
    values = [(False, True) if allowed[name] else (False,) for name in SWITCHED]
    found = [{"precision": p, **dict(zip(SWITCHED, on))} for on in itertools.product(*values) for p in names]
    return sorted(found, key=_cost)  # sorted() is stable: equal costs keep the order above


def _cost(config: dict) -> float:
    cost = precisions.get(config["precision"]).cost
    for name in SWITCHED:
        cost *= switches.get(name).cost if config[name] else 1.0
    return cost


def sizes_down(global_batch: int) -> list[int]:
    """The micro-batches tried for one configuration: the whole batch, then halvings down to 1."""
    found, size = [], global_batch
    while size >= 1:
        found.append(size)
        size //= 2
    return found  # halvings of a size of at least 1 end at 1


class Reach(Move):
    """The next plan of `configurations` x `sizes_down` after `plan` (None when `plan` is not one of
    them; from the first, with `restart`) that `sizes` does not know to fail; `whole` keeps the
    global batch whole. As a rung of a ladder it walks on (`restart=False`); as the controller's
    last resort (`restart=True`) it proposes the first plan not known to fail, so a plan the
    ladder's path jumped past is still reached."""

    walks = True  # ladder.step_down asks again past a plan that does not apply to the job

    def __init__(self, sizes, configs: list[dict], whole: bool = False, restart: bool = False):
        self.sizes, self.configs, self.whole, self.restart = sizes, list(configs), whole, restart
        self.why = ("the whole batch under another configuration" if whole else
                    "a plan the ladder's path passed by (another configuration or micro-batch)")

    def plans(self, plan: Plan, global_batch: int) -> list[Plan]:
        micro = [global_batch] if self.whole else sizes_down(global_batch)
        return [plan.replace(**config).with_micro_batch(m, global_batch) for config in self.configs for m in micro]

    def take(self, plan, global_batch=None, passed=None):
        """(plan, why) or None; `passed`: a plan this move proposed that does not apply (go on after it)."""
        global_batch = plan.global_batch if global_batch is None else global_batch
        plan = plan.with_micro_batch(plan.micro_batch_size, global_batch)
        candidates = self.plans(plan, global_batch)
        after = passed if passed is not None else None if self.restart else plan
        if after is not None and after not in candidates:
            return None  # a rung steps on from its own plans only: a split plan never goes back to whole
        if after is not None:
            candidates = candidates[candidates.index(after) + 1:]
        new = next((c for c in candidates if c != plan and not self.sizes.known_to_fail(c)), None)
        return None if new is None else (new, self.why)

    def step(self, plan, global_batch=None):
        taken = self.take(plan, global_batch)
        return None if taken is None else taken[0]

    def __repr__(self):
        return f"Reach({'whole' if self.whole else 'every micro-batch'}{', from the start' if self.restart else ''})"


def advice(plans) -> str:
    """What a refusal advises, from the plans tried: the switches none of them turned on, or only
    the budget and the batch when every one was tried."""
    untried = [switches.get(name).label(True) for name in SWITCHED if not any(getattr(p, name) for p in plans)]
    if untried:
        return f"Lower the global batch, give a larger budget, or allow {' and '.join(untried)} in the ladder."
    return ("Lower the global batch or give a larger budget: checkpointing and offload were tried, alone and "
            "with smaller micro-batches (the attempts below).")
