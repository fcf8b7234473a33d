"""autofit.stepper: one OOM-proof global step inside the user's own training loop.

    with autofit.stepper(model, optimizer, scheduler=scheduler, budget="2GiB") as step:
        for batch in loader:          # the user's loop: logging, checkpoints, validation stay theirs
            out = step(batch)         # one global batch: split, replayed on OOM, one optimizer step

The setup is `autofit.run`'s (autofit.recipes.training): the first batch decides the start plan (the cache,
else the capacity check), every batch runs under the retry controller, and leaving the block hands
the model, optimizer and device back as a plain loop would leave them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from autofit.engine.controller import Attempt
from autofit.engine.interfaces import OptimizerArg
from autofit.errors import DoesNotFit
from autofit.plans.sizelog import SizeLog
from autofit.plans.plan import Plan
from autofit.recipes.crossing import Crossing
from autofit.recipes.options import Options, keywords
from autofit.recipes.training import Training

STATE_VERSION = 1


@dataclass(frozen=True)
class StepOutput:
    """What one global batch did."""

    loss: float                     # the batch's loss (the weighted mean over its micro-batches)
    plan: Plan                      # the plan it succeeded under
    attempts: list[Attempt] = field(default_factory=list)  # this batch's attempts, in order
    grad_norm: float | None = None  # the gradient's norm before clipping (None without max_grad_norm)
    # What the loss_fn returned beside its loss, `(loss, kept)`, joined over the micro-batches in row
    # order, from the attempt that succeeded (engine/kept.py); None when it returned a loss alone.
    kept: object = None


class Step:
    """The callable `with autofit.stepper(...) as step` yields."""

    def __init__(self, training: Training):
        self._training = training
        self._resume = None
        self._crossing = Crossing(training.model)  # another stepper's gradients on this one's model

    def __call__(self, batch) -> StepOutput:
        training = self._training
        if training.closed:
            raise RuntimeError("this stepper's block has ended; open a new `with autofit.stepper(...)` "
                               "to train more.")
        index = len(training.attempts)
        try:
            if training.controller is None:  # the first batch: the cache and the capacity check use it
                training.start(batch, resume=self._resume)
            self._crossing.before()
            loss = training.train(batch)
            self._crossing.after()
        except DoesNotFit as error:  # caught inside the block too: the same message as autofit.run's
            explained = training.explained(error)
            if explained is error:
                raise
            raise explained.with_traceback(error.__traceback__) from None
        return StepOutput(loss=loss, plan=training.plan, attempts=training.attempts[index:],
                          grad_norm=training.runner.grad_norm, kept=training.kept)

    def evaluate(self, data, *, metric_fn=None, progress=False):
        """Validation inside the block: `autofit.evaluate` with this stepper's loss and device, in
        inference mode, its batch size starting from the training micro-batch's and kept between
        calls; it never trains and never changes the training plan."""
        if self._training.closed:
            raise RuntimeError("this stepper's block has ended; call autofit.evaluate(model, data, ...) "
                               "instead.")
        return self._training.evaluate(data, metric_fn=metric_fn, progress=progress)

    @property
    def plan(self) -> Plan | None:
        """The plan the next batch starts from (None before the first batch, unless resumed)."""
        if self._training.controller is None and self._resume is not None:
            return self._resume[0]
        return self._training.plan

    @property
    def attempts(self) -> list[Attempt]:
        """Every attempt of every batch so far."""
        return self._training.attempts

    @property
    def optimizer(self):
        """The optimizer stepped (the one a factory built)."""
        return self._training.optimizer

    @property
    def scheduler(self):
        """The scheduler stepped (the one a factory built; None without one), during the block and
        after it: its state_dict() resumes the schedule."""
        return self._training.scheduler

    def state_dict(self) -> dict:
        """The plan and the micro-batch sizes proven (plain JSON types), for a checkpoint: a job
        resumed with `load_state_dict` starts from them without an OOM attempt."""
        plan = self.plan
        sizes = self._resume[1] if self._training.controller is None and self._resume else self._training.sizes
        return {"version": STATE_VERSION, "plan": None if plan is None else plan.to_dict(),
                "sizes": sizes.to_json()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "sizes" not in state:
            raise ValueError(f"not a stepper state_dict (version {STATE_VERSION}): {state!r:.200}; pass "
                             f"what step.state_dict() returned.")
        try:
            sizes = SizeLog.from_json(state["sizes"])
            plan = None if state.get("plan") is None else Plan.from_dict(state["plan"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"the stepper state_dict is unreadable ({error}); pass what "
                             f"step.state_dict() returned.") from error
        if plan is None:
            return  # saved before any batch: nothing was proven
        sizes.settle_proven(plan)
        training = self._training
        if training.controller is None:
            self._resume = (plan, sizes)
            return
        training.sizes.adopt(sizes)
        controller = training.controller
        controller.resume(*training.coupling.start(plan, "resumed: the plan and sizes of a state_dict",
                                                   controller.plan.global_batch))


@contextlib.contextmanager
def _stepper(model: torch.nn.Module, optimizer: OptimizerArg = None, **options: object) -> Iterator[Step]:
    """A context manager yielding `step`; `step(batch)` trains one global batch and returns a
    `StepOutput` (.loss, .plan, .attempts, .grad_norm, .kept).

    The options are `autofit.recipes.options.Options`' fields, as keywords. `optimizer`: an instance
    or a factory params -> Optimizer (None: AdamW). `scheduler`: an
    instance built on that optimizer, or a factory optimizer -> scheduler; stepped once per global
    batch, never for a failed attempt; Accelerate's prepared optimizer and scheduler are taken as they
    are (autofit.integrations.accelerate unwraps them). `loss_fn`, `budget`, `precision`, `ladder`,
    `cache` mean what they mean for `autofit.run`. `max_grad_norm` clips the gradient of the whole global batch.
    `allow_split=False` never splits a global batch into micro-batches (what a model with
    batch-coupled layers may need), as for `autofit.run`; a resumed plan that splits is made whole.
    Each step-down is logged on the "autofit" logger (`progress=False`: not). Under torch.distributed every rank opens the stepper and calls
    `step` with its own share of each global batch (as a DistributedSampler gives it; call its
    set_epoch yourself) or with the same global batches, as with `autofit.run`; `shard` as there.
    `batch_dim`: where the batches' rows are when not along dimension 0 (1 for time-first batches;
    autofit.engine.layout). A `loss_fn` returning `(loss, kept)` gets `kept` back joined over the
    micro-batches as `out.kept` (a recurrent state carried to the next batch: engine/kept.py).
    """
    training = Training(model, Options.of("autofit.stepper", options, optimizer=optimizer))
    with training:
        yield Step(training)


stepper = keywords(_stepper)
stepper.__name__ = stepper.__qualname__ = "stepper"
