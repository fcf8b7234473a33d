"""The plan's switches, one entry each: what turning one on means everywhere autofit words, weighs,
tries, applies or estimates it.

A switch is a Plan field a step-down turns on (checkpointing, offload, a per-parameter optimizer
step, FSDP2's two settings); precision has its own registry (plans/precision.py) and the
micro-batch is the ladder's split. Each entry says, in one place:
- `turn_on(plan)`: the plan with it on, or None when it cannot be turned on from `plan` (already on,
  or a setting it only changes from a given value). The ladder's move and the diagnosis's "what
  else could have helped" are both this function.
- `why`: the move's reason in the log; `cost`: the step-time factor when on (estimator/cost.py);
- `label(value)`: the words of Plan.describe (None: nothing said);
- `config(value)`: its part of the size log's configuration key (plans/sizelog.py; kept as it was
  for each switch, so keys cached before stay the same);
- `change(value)`: how explain words the switch turned to `value`, and `fix`: the key of the fix it
  applies (diagnosis/fixes.py), when it is one;
- `tries(trial)`: the values the capacity check prices (estimator/cost.candidate_plans, through
  `tried`), given the option it was handed for this switch (`Trial`); `per_micro_batch` when they
  depend on the micro-batch.
Its behaviours are named by "module:function" and imported on use (plans/ sits below the engine and
the estimator, which import it; `resolve`):
- `step`: hook(runner, plan), how a step sets it before every attempt (StepRunner.prepare calls each
  switch's; engine/ for its own, distributed/fsdp for FSDP2's, on the runner's `sharded`);
- `applies`: hook(plan, model, optimizer, device, checkpointing) -> why it cannot run here, or None
  (plans/applies.not_applicable asks each, once per hook);
- `estimate`: hook(estimator, plan) -> the value an estimate runs it with (Estimator.measured_plan);
  None: the plan's own, which the estimator's step sets through `step`.
What is left elsewhere reads a switch for what only it does, and says so where it does: the
diagnosis's fixes (each one's own memory rule), the capacity check's most frugal plan (ordered by
each one's saving), the fake-tensor estimate's optimizer state under offload, the Trainer's and
the probe's own words.

Adding a switch: a Plan field with its default, and one entry here (tests/test_switches.py adds one
and follows it everywhere).
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass
from typing import Callable, NamedTuple


@dataclass(frozen=True)
class Switch:
    name: str
    why: str
    cost: float
    turn_on: Callable
    label: Callable
    config: Callable
    change: Callable
    step: str
    tries: Callable
    applies: str | None = None
    estimate: str | None = None
    fix: str | None = None
    sharded_only: bool = False  # FSDP2's: applies only to a model sharded with fully_shard
    charged: Callable | None = None  # plan -> whether `cost` applies (None: whenever it is on)
    per_micro_batch: bool = False  # `tries` depends on the micro-batch (Trial.micro_batch is set)

    def on(self, plan) -> bool:
        return bool(getattr(plan, self.name))

    def step_hook(self) -> Callable:
        """`step` resolved: hook(runner, plan), which sets the switch on a StepRunner."""
        return resolve(self.step)

    def applies_hook(self) -> Callable | None:
        """`applies` resolved: hook(plan, model, optimizer, device, checkpointing) -> why not, or None."""
        return None if self.applies is None else resolve(self.applies)

    def estimate_hook(self) -> Callable | None:
        """`estimate` resolved: hook(estimator, plan) -> the value the estimate runs with."""
        return None if self.estimate is None else resolve(self.estimate)

    def cost_of(self, plan) -> float:
        """The step-time factor this switch adds to `plan`."""
        charged = self.charged(plan) if self.charged is not None else self.on(plan)
        return self.cost if charged else 1.0


class Trial(NamedTuple):
    """What `Switch.tries` sees when candidate_plans builds its plans: the option the capacity check
    was given for this switch (None when it takes none), the global batch, whether the model is
    sharded, and the micro-batch (for a `per_micro_batch` switch; None for the others)."""
    option: object
    global_batch: int
    sharded: bool
    micro_batch: int | None = None


def resolve(reference: str) -> Callable:
    """The function a "module:function" reference names, imported on use: plans/ sits below the
    engine and the estimator, so it names their hooks rather than importing them."""
    module, _, name = reference.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"the plan switch hook {reference!r} names nothing importable ({error}); a "
                         f"hook is \"package.module:function\".") from None


def _off_or_both(trial: Trial) -> tuple:
    """Off, and on too when the capacity check's option allows it."""
    return (False, True) if trial.option else (False,)


def _simple(name):
    """turn_on for a switch that is off or on: on, unless it is on already."""
    return lambda plan: None if getattr(plan, name) else plan.replace(**{name: True})


def _reshard_on(plan):
    # Only from an explicit False: None is the model's own setting, never made more expensive.
    return plan.replace(reshard_after_forward=True) if plan.reshard_after_forward is False else None


def _reduce_each_on(plan):
    # With one micro-batch, sync off until the last and a reduce-scatter each are the same step.
    if plan.reduce_each_micro_batch or plan.accumulation_steps == 1:
        return None
    return plan.replace(reduce_each_micro_batch=True)


SWITCHES = (
    Switch("checkpointing", "activation checkpointing recomputes activations in backward",
           cost=4 / 3,  # one more forward (forward is about a third of a step)
           turn_on=_simple("checkpointing"),
           label=lambda v: "checkpointing" if v else None,
           config=lambda v: (v,),
           change=lambda v: "activation checkpointing " + ("on" if v else "off"),
           step="autofit.engine.checkpointing:step_hook",
           applies="autofit.engine.checkpointing:checkpointing_applies",
           tries=_off_or_both,  # option: the model has blocks to checkpoint
           fix="checkpointing"),
    Switch("offload_optimizer", "optimizer state moves to CPU memory",
           cost=3.0,  # the update runs on the host; parameters and gradients copied each step
           turn_on=_simple("offload_optimizer"),
           label=lambda v: "offload" if v else None,
           config=lambda v: (v,),
           change=lambda v: "optimizer state " + ("to CPU memory" if v else "back on the device"),
           step="autofit.engine.step:offload_hook",
           applies="autofit.engine.offload:offload_applies",
           tries=_off_or_both,  # option: allow_offload
           estimate="autofit.estimator.sampled:offload_measured",
           fix="offload"),
    Switch("per_parameter_step", "the optimizer updates one parameter at a time (a for-loop instead "
           "of foreach), so the step's temporaries are one parameter's",
           cost=1.0,  # the same work, one parameter after another
           turn_on=_simple("per_parameter_step"),
           label=lambda v: "per-parameter step" if v else None,
           config=lambda v: ("per-parameter step",) if v else (),
           change=lambda v: "per-parameter optimizer step " + ("on" if v else "off"),
           step="autofit.engine.step:per_parameter_hook",
           applies="autofit.engine.per_parameter:per_parameter_applies",
           # never priced: it only helps a step that ran out of memory, a move of the ladder's
           tries=lambda trial: (False,),
           fix="per-parameter-step"),
    Switch("reshard_after_forward", "FSDP2 frees each unit's gathered parameters after forward and "
           "gathers them again in backward",
           cost=1.05,  # one more all-gather per unit and micro-batch, mostly overlapped
           turn_on=_reshard_on,
           label=lambda v: None if v is None else
           ("reshard after forward" if v else "gathered params kept for backward"),
           # what a unit holds: its gathered parameters kept or not
           config=lambda v: () if v is None else ("reshard after forward" if v else "kept gathered",),
           change=lambda v: None if v is None else
           "FSDP2 " + ("reshards after forward" if v else "keeps gathered parameters for backward"),
           step="autofit.distributed.fsdp:reshard_hook",
           applies="autofit.distributed.fsdp:fsdp_applies",
           tries=lambda trial: tuple(trial.option),  # option: the values the model may use, (None,) unsharded
           estimate="autofit.estimator.sharded:reshard_measured",
           sharded_only=True),
    Switch("reduce_each_micro_batch", "FSDP2 reduce-scatters each micro-batch's gradients into the "
           "shards instead of keeping them unsharded until the last",
           cost=1.08,  # a reduce-scatter per extra micro-batch, at the end of its backward
           turn_on=_reduce_each_on,
           label=lambda v: "reduce-scatter per micro-batch" if v else None,
           config=lambda v: ("reduce-scatter per micro-batch",) if v else (),
           change=lambda v: "FSDP2 " + ("reduce-scatters each micro-batch" if v
                                        else "syncs gradients on the last micro-batch only"),
           step="autofit.distributed.fsdp:reduce_each_hook",
           applies="autofit.distributed.fsdp:fsdp_applies",
           # with one micro-batch both are the same step
           tries=lambda trial: (False, True) if trial.sharded and trial.micro_batch < trial.global_batch else (False,),
           estimate="autofit.estimator.sharded:reduce_each_measured",
           sharded_only=True, per_micro_batch=True,
           charged=lambda plan: plan.reduce_each_micro_batch and plan.accumulation_steps > 1),
)
BY_NAME = {s.name: s for s in SWITCHES}


def tried(options: dict, global_batch: int, sharded: bool, micro_batches) -> list[tuple[int, dict]]:
    """(micro-batch, {switch: value}) for every combination the capacity check prices: each
    switch's `tries` given its option (`options[name]`, None when absent), the switches that do not
    depend on the micro-batch looped outside it, in the registry's order, the others inside it."""
    outer = [s for s in SWITCHES if not s.per_micro_batch]
    inner = [s for s in SWITCHES if s.per_micro_batch]

    def values(switch, m=None):
        return switch.tries(Trial(options.get(switch.name), global_batch, sharded, m))

    return [(m, {**dict(zip([s.name for s in outer], out)), **dict(zip([s.name for s in inner], into))})
            for out in itertools.product(*(values(s) for s in outer))
            for m in micro_batches
            for into in itertools.product(*(values(s, m) for s in inner))]


def get(name: str) -> Switch:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"no plan switch {name!r}; the switches are {', '.join(BY_NAME)}.") from None
