"""Recovering a Hugging Face `Trainer`'s training from an out-of-memory error: each `trainer.train()`
is an `engine.attempt` attempt; after one fails, what it held is freed (after its `except` block),
the plan steps down the Trainer's ladder (a failure the cache's holes caused first replays the
same plan once per global step, as training's controller does: gpu/fragmentation), and the next
attempt restarts from the initial state or
resumes from a checkpoint this call saved, with the Trainer's plain-data records (hf_records) as
they were at that start or at that save. Used by `autofit.integrations.transformers` (evaluation
retries are `hf_eval`'s)."""

from __future__ import annotations

import logging
import os

import torch

from autofit.engine.attempt import MAX_ATTEMPTS_PER_BATCH, Attempt, Attempter, next_down, until_fits
from autofit.engine.replay import RESTART, StartState
from autofit.errors import DoesNotFit
from autofit.gpu.memory import by_kind
from autofit.gpu.oom import is_oom
from autofit.integrations import accelerate as accelerate_internals
from autofit.integrations import transformers_internals as hf_internals
from autofit.integrations import hf_trainer as hf
from autofit.integrations.hf_records import snapshot
from autofit.integrations.hf_trainer import raw_optimizer

log = logging.getLogger("autofit")


# -- the state an attempt starts from -----------------------------------------------------------

def start_state(trainer, device) -> StartState:
    """What a run restarted from the start needs (replay.StartState, RESTART), taken now, before
    the first attempt: the model's weights (a host copy, unless the Trainer re-creates the model
    with `model_init`), a user optimizer's and scheduler's state (none when the Trainer makes its
    own optimizer), and the random number generators."""
    opt, sched = trainer.optimizer, trainer.lr_scheduler
    optimizer = None if opt is None else raw_optimizer(opt)  # else the user's: kept, its state replaced on a retry
    start = StartState(trainer.model, optimizer, device, mode=RESTART,
                       scheduler=None if sched is None or opt is None else sched,
                       weights=trainer.model_init is None)
    start.capture()
    return start


def free_attempt(trainer, owns_optimizer: bool) -> None:
    """Drop what a failed `trainer.train()` held (called after its `except` block has exited,
    before `oom.release` drops gradients and the autograd queue): the optimizer's state (the
    Trainer's own optimizer entirely; a user's optimizer is kept and its state reloaded on the
    retry), the Accelerator's references."""
    optimizer = raw_optimizer(trainer.optimizer) if trainer.optimizer is not None else None
    if owns_optimizer:
        trainer.optimizer = trainer.lr_scheduler = None
    elif optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()
        trainer.optimizer = optimizer
        if hf_internals.created_lr_scheduler(trainer):
            # The Trainer made this scheduler for the user's optimizer (its private flag says so): it
            # goes too, as the flag that would have made the next train() drop it is one of the
            # records hf_records puts back as the attempt found them.
            trainer.lr_scheduler = None
    handler = trainer.callback_handler
    handler.optimizer, handler.lr_scheduler = trainer.optimizer, trainer.lr_scheduler
    handler.train_dataloader = None
    trainer.model_wrapped = trainer.model
    # What Accelerator.free_memory() does outside DeepSpeed (refused by `train`): its lists of prepared
    # models, optimizers, schedulers and loaders emptied; without the full gc.collect() it ends
    # with (slow with transformers loaded): `oom.release` collects no further than needed.
    accelerator = trainer.accelerator
    accelerate_internals.forget_prepared(accelerator)
    accelerator.step = 0


def resumable_checkpoints(args) -> bool:
    """Whether the Trainer's checkpoints can resume a run with the same mathematics (they hold the
    optimizer, scheduler and RNG state only when `save_only_model` is off)."""
    return str(getattr(args.save_strategy, "value", args.save_strategy)) != "no" and not args.save_only_model


def _loss_so_far(trainer) -> float | None:
    """The sum of the step losses the current `trainer.train()` call has trained (the Trainer's
    own running total, as it divides it for `training_loss`); None when this Trainer keeps none."""
    total, pending = hf_internals.loss_so_far(trainer)
    if total is None or pending is None:
        return None
    return total + (pending.item() if isinstance(pending, torch.Tensor) else float(pending))


def tracker(device, trainer):
    """A TrainerCallback recording the checkpoints this call saved (`latest()`) with the sum of the
    step losses trained up to each (`whole_run_loss()` reports the run across resumes) and, on a
    simulated GPU, counting the tensors a resume loads from disk (torch.load is no dispatched op)."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class _Tracker(TrainerCallback):
        def __init__(self):
            self.saved: list[str] = []
            self.losses: dict[str, float | None] = {}  # checkpoint -> loss sum of the run up to it
            self.carried: float | None = 0.0  # loss sum of the run before the current attempt's start
            self.first_step = None             # the global step the run started from
            self.records: dict = {}  # checkpoint -> the Trainer's records when it was saved (hf_records)

        def resume_from(self, checkpoint: str | None) -> None:
            """The next attempt starts from `checkpoint` (one this call saved), or from the start."""
            self.carried = self.losses.get(checkpoint) if checkpoint is not None else 0.0

        def on_save(self, args, state, control, **kwargs):
            path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            self.saved.append(path)
            own = _loss_so_far(trainer)
            self.losses[path] = None if own is None or self.carried is None else self.carried + own
            self.records[path] = snapshot(trainer)  # a resume from it starts from these

        def whole_run_loss(self, output):
            """`output.training_loss` over every step of the run (the Trainer's own covers only
            the steps of the attempt that finished, which may have resumed from a checkpoint)."""
            own = hf_internals.loss_so_far(trainer)[0]  # the finished call added its rest
            steps = output.global_step - (self.first_step or 0)
            if own is None or self.carried is None or steps <= 0:
                return output.training_loss
            return (self.carried + own) / steps

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if self.first_step is None:
                self.first_step = state.global_step
            gpu = getattr(device, "gpu", None)
            if gpu is None:
                return
            tensors = list(model.parameters()) + list(model.buffers()) if model is not None else []
            if optimizer is not None:
                for entry in raw_optimizer(optimizer).state.values():
                    tensors.extend(v for v in entry.values() if isinstance(v, torch.Tensor))
            gpu.track(tensors)  # storages already counted are skipped

        def latest(self) -> str | None:
            for path in reversed(self.saved):
                if os.path.isfile(os.path.join(path, "trainer_state.json")):
                    return path
            return None
    return _Tracker()


# -- the attempts -------------------------------------------------------------------------------

def _optimizer(trainer):
    return raw_optimizer(trainer.optimizer) if trainer.optimizer is not None else None


class TrainAttempts:
    """`trainer.train()` under `plan`, stepping down `ladder` after each out-of-memory error until
    an attempt finishes (`run()`). `start`: the initial state (None when the call resumes from
    `origin`, the user's checkpoint); `saves`: the `tracker` of the checkpoints this call saved."""

    def __init__(self, trainer, device, fitted, ladder, start, saves, origin, train_kwargs):
        self.trainer, self.device, self.fitted, self.ladder = trainer, device, fitted, ladder
        self.start, self.saves, self.origin, self.train_kwargs = start, saves, origin, train_kwargs
        self.plan, self.reason, self.checkpoint = fitted.plan, fitted.reason, origin
        self.rows = hf.rows_per_step(trainer.args)  # the true global batch of the ladder's moves
        self.owns_optimizer = start.optimizer is None if start is not None else trainer.optimizer is None
        self.resumable = resumable_checkpoints(trainer.args)
        self.attempts: list = []
        self.records = snapshot(trainer)  # what a restart puts back (hf_records)
        self.seen = {self.plan}
        self.attempter = Attempter(device, lambda: (trainer.model, _optimizer(trainer)),
                                   free=lambda: free_attempt(trainer, self.owns_optimizer),
                                   # DoesNotFit: an evaluation that fits nowhere, not a training OOM
                                   catches=lambda error: not isinstance(error, DoesNotFit) and is_oom(error))

    def run(self, guard):
        """(TrainOutput, the plan it finished with, the attempts); `guard`: the EvalGuard, whose
        `training_peak()` leaves the evaluations out of each attempt's peak."""
        self.guard = guard
        output = until_fits(self._attempt, self._after_oom).value
        return output, self.plan, self.attempts

    def _attempt(self):
        trainer = self.trainer
        self.device.reset_peak_memory_stats()
        self.guard.begin_training()
        outcome = self.attempter(
            lambda: trainer.train(resume_from_checkpoint=self.checkpoint, **self.train_kwargs),
            inspect=lambda error: by_kind(self.device, trainer.model, _optimizer(trainer)),
            peak=self.guard.training_peak)
        if outcome.ok:
            self.attempts.append(Attempt(self.plan, "ok", self.reason, outcome.peak, trainer.state.global_step))
        return outcome

    def _after_oom(self, outcome) -> bool:
        trainer, device, memory = self.trainer, self.device, outcome.found
        step, text = trainer.state.global_step, outcome.error
        self.attempts.append(Attempt(self.plan, "oom", self.reason, outcome.peak, step, text, "trainer.train",
                                     memory))
        # As in training's controller: the cache's holes (freed first) replay the same plan once
        # per global step before the ladder steps down.
        replay = self.attempter.empty_cache_for_replay(outcome, (step, self.plan))
        taken = (self.plan, replay) if replay else next_down(self.ladder, self.plan, self.rows,
                                                             failed=self.seen.__contains__)
        if taken is None:
            raise DoesNotFit(
                f"no plan of the ladder fits the Trainer's batch at global step {step} on "
                f"{device.describe()} (effective batch {self.fitted.effective_batch} kept); lower the effective "
                f"batch in the TrainingArguments or give a larger budget.", attempts=self.attempts,
                breakdown=memory, budget=device.budget)
        plan, why = taken
        tried = sum(a.step == step for a in self.attempts)
        if tried >= MAX_ATTEMPTS_PER_BATCH:
            raise DoesNotFit(f"stopped after {tried} attempts at global step {step} on {device.describe()}: "
                             f"autofit's safety cap of {MAX_ATTEMPTS_PER_BATCH} attempts per global step (the "
                             f"ladder still had {plan.describe()} to try); memory this unsteady needs looking at: "
                             f"autofit.explain(error) lists the attempts.",
                             attempts=self.attempts, breakdown=memory, budget=device.budget)
        self.seen.add(plan)
        checkpoint = self.saves.latest() if self.resumable else None
        self.saves.resume_from(checkpoint)
        # The Trainer's records as the next attempt's starting point left them: the failed attempt
        # leaves no trace on them, and the steps it redoes are recorded once.
        self.saves.records.get(checkpoint, self.records).restore()
        if checkpoint is not None:
            where = f"resumed from {checkpoint}"
        elif self.origin is not None:
            checkpoint, where = self.origin, f"no checkpoint saved yet: restarted from {self.origin}"
        else:
            self.start.restore()
            where = "no checkpoint to resume from: restarted from the initial state"
        log.warning("out of memory in trainer.train at global step %d under %s (%s); %s", step,
                    self.plan.describe(), text, replay or f"stepping down to {plan.describe()}")
        self.plan, self.reason, self.checkpoint = plan, f"{why}; {where}", checkpoint
        hf.apply_plan(trainer, plan)
        return True
