"""Recovering a Hugging Face `Trainer` from an out-of-memory error: free what the failed attempt
held, restart from the initial state or resume from a checkpoint this call saved, and retry an
evaluation with a smaller evaluation batch. Used by `autofit.integrations.transformers`."""

from __future__ import annotations

import copy
import itertools
import os
from dataclasses import dataclass

import torch

from autofit.engine.controller import CUDA_BASELINE_SLACK
from autofit.engine.replay import rng_state, set_rng_state
from autofit.gpu.device import describe_tensors
from autofit.errors import DoesNotFit, MemoryNotReleased
from autofit.gpu.oom import is_oom, release, summarize
from autofit.integrations.hf_trainer import raw_optimizer


# -- the state an attempt starts from -----------------------------------------------------------

class Start:
    """What a run restarted from the start needs: the model's weights (a host copy, unless the
    Trainer re-creates the model with `model_init`), a user optimizer's and scheduler's state, and
    the random number generators, taken before the first attempt."""

    def __init__(self, trainer, device):
        self.trainer = trainer
        opt, sched = trainer.optimizer, trainer.lr_scheduler
        self.owns_optimizer = opt is None  # else the user's: kept, its state replaced on a retry
        with device.host():
            self.weights = None if trainer.model_init is not None else _host(trainer.model.state_dict())
            self.optimizer = None if opt is None else _host(raw_optimizer(opt).state_dict())
            self.scheduler = None if sched is None or self.owns_optimizer else _host(sched.state_dict())
        self.rng = rng_state()

    def restore(self) -> None:
        trainer = self.trainer
        if self.weights is not None:
            trainer.model.load_state_dict(self.weights)  # copies in place: no new device memory
        if self.optimizer is not None:
            raw_optimizer(trainer.optimizer).load_state_dict(_host(self.optimizer))
        if self.scheduler is not None:
            trainer.lr_scheduler.load_state_dict(_host(self.scheduler))
        set_rng_state(self.rng)


def _host(obj):
    """A deep copy with every tensor copied to host memory (load_state_dict puts them back)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _host(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host(v) for v in obj)
    return copy.deepcopy(obj)


def free_attempt(trainer, device, owns_optimizer: bool) -> None:
    """Drop what a failed `trainer.train()` held (called after its `except` block has exited): the
    optimizer's state (the Trainer's own optimizer entirely; a user's optimizer is kept and its
    state reloaded on the retry), gradients, the Accelerator's references, the autograd queue."""
    optimizer = raw_optimizer(trainer.optimizer) if trainer.optimizer is not None else None
    if owns_optimizer:
        trainer.optimizer = trainer.lr_scheduler = None
    elif optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()
        trainer.optimizer = optimizer
    handler = trainer.callback_handler
    handler.optimizer, handler.lr_scheduler = trainer.optimizer, trainer.lr_scheduler
    handler.train_dataloader = None
    trainer.model_wrapped = trainer.model
    trainer.accelerator.free_memory()  # its lists of prepared models, optimizers and loaders
    del optimizer
    release(device, model=trainer.model)


def check_freed(trainer, device, baseline: int) -> None:
    """MemoryNotReleased, naming the holders, when more than the pre-attempt baseline stays
    allocated after `free_attempt` (CUDA: beyond the workspaces its libraries keep cached)."""
    slack = CUDA_BASELINE_SLACK if device.type == "cuda" else 0
    extra = device.memory_allocated() - baseline
    if extra <= slack:
        return
    known = {id(t.untyped_storage()) for t in itertools.chain(trainer.model.parameters(), trainer.model.buffers())}
    if trainer.optimizer is not None:
        for entry in raw_optimizer(trainer.optimizer).state.values():
            known |= {id(v.untyped_storage()) for v in entry.values() if isinstance(v, torch.Tensor)}
    holders = [t for t in device.live_tensors() if id(t.untyped_storage()) not in known]
    raise MemoryNotReleased(extra, describe_tensors(holders) if holders else "no tensor Python can see")


def resumable_checkpoints(args) -> bool:
    """Whether the Trainer's checkpoints can resume a run with the same mathematics (they hold the
    optimizer, scheduler and RNG state only when `save_only_model` is off)."""
    return str(getattr(args.save_strategy, "value", args.save_strategy)) != "no" and not args.save_only_model


def _loss_so_far(trainer) -> float | None:
    """The sum of the step losses the current `trainer.train()` call has trained (the Trainer's
    own running total, as it divides it for `training_loss`); None when this Trainer keeps none."""
    total, pending = getattr(trainer, "_total_loss_scalar", None), getattr(trainer, "_tr_loss", None)
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

        def resume_from(self, checkpoint: str | None) -> None:
            """The next attempt starts from `checkpoint` (one this call saved), or from the start."""
            self.carried = self.losses.get(checkpoint) if checkpoint is not None else 0.0

        def on_save(self, args, state, control, **kwargs):
            path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            self.saved.append(path)
            own = _loss_so_far(trainer)
            self.losses[path] = None if own is None or self.carried is None else self.carried + own

        def whole_run_loss(self, output):
            """`output.training_loss` over every step of the run (the Trainer's own covers only
            the steps of the attempt that finished, which may have resumed from a checkpoint)."""
            own = getattr(trainer, "_total_loss_scalar", None)  # the finished call added its rest
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


# -- evaluation ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalAttempt:
    """One evaluation under one `per_device_eval_batch_size` (autofit.explain reads it as it reads
    autofit.evaluate's attempts: `batch_size`, `batch`, `first_sample`)."""

    per_device_eval_batch_size: int
    outcome: str       # "ok" | "oom"
    global_step: int   # the training step it evaluated
    reason: str
    error: str = ""
    batch: int = 0     # for "oom": the evaluation batch that failed (how many had completed)
    peak_bytes: int = 0

    @property
    def batch_size(self) -> int:
        return self.per_device_eval_batch_size

    @property
    def first_sample(self) -> int:
        return self.batch * self.per_device_eval_batch_size

    def describe(self) -> str:
        text = (f"evaluation at step {self.global_step}: per_device_eval_batch_size="
                f"{self.per_device_eval_batch_size} -> {self.outcome}")
        if self.outcome == "oom":
            text += f" at evaluation batch {self.batch}: {self.error}"
        return text + f" [{self.reason}]"


class EvalGuard:
    """Replaces `trainer.evaluate` (on the instance, until `remove()`) by one that halves only
    `per_device_eval_batch_size` after an out-of-memory error and evaluates again; the training
    batch is never touched. Works for evaluations inside `trainer.train()` too (they call
    `self.evaluate`).

    What a retry leaves behind is what one evaluation would have: each retry starts from the
    global random generators as the first try found them (the evaluation DataLoader's iterator
    draws its seed from torch's), so the training after it draws the same dropout masks as a run
    without the OOM. The device's peak counter is reset for each evaluation (its own peak); the
    peak of the training around the evaluations is kept in `training_peak()`."""

    def __init__(self, trainer, device, attempts: list):
        from transformers import TrainerCallback

        self.trainer, self.device, self.attempts = trainer, device, attempts
        self.previous = trainer.__dict__.get("evaluate")
        self.original = trainer.evaluate
        self.reason = "as the TrainingArguments give it"
        self.done = 0  # evaluation batches completed in the current attempt
        self.outside_peak = 0  # the training's peak before the evaluations of this training attempt

        guard = self

        class _Count(TrainerCallback):
            def on_prediction_step(self, args, state, control, **kwargs):
                guard.done += 1
        self.counter = _Count()
        trainer.add_callback(self.counter)
        trainer.evaluate = self.evaluate

    def remove(self) -> None:
        self.trainer.remove_callback(self.counter)
        if self.previous is None:
            self.trainer.__dict__.pop("evaluate", None)
        else:
            self.trainer.evaluate = self.previous

    def begin_training(self) -> None:
        """A training attempt starts: its peak is counted from now (the caller reset the device's)."""
        self.outside_peak = 0

    def training_peak(self) -> int:
        """The training attempt's peak so far, evaluations left out."""
        return max(self.outside_peak, self.device.max_memory_allocated())

    def evaluate(self, *args, **kwargs):
        targs = self.trainer.args
        self.outside_peak = self.training_peak()
        rng = rng_state()  # every retry starts from it
        tries = 0
        while True:
            size, failure = targs.per_device_eval_batch_size, None
            self.done = 0
            if tries:
                set_rng_state(rng)
            tries += 1
            self.device.reset_peak_memory_stats()
            try:
                metrics = self.original(*args, **kwargs)
            except Exception as error:
                if not is_oom(error):
                    raise
                failure = summarize(error)
            step, peak = self.trainer.state.global_step, self.device.max_memory_allocated()
            if failure is None:
                self.attempts.append(EvalAttempt(size, "ok", step, self.reason, peak_bytes=peak))
                self.reason = "kept: the evaluation batch that worked"
                self.device.reset_peak_memory_stats()  # the training after it counts from here
                return metrics
            # Out of the except block: the evaluation's frames and tensors are gone.
            self.attempts.append(EvalAttempt(size, "oom", step, self.reason, failure, self.done, peak))
            release(self.device)
            if size <= 1:
                raise DoesNotFit(
                    f"evaluation of one row per device ran out of memory at global step {step} on "
                    f"{self.device.describe()}; the training batch was left as it is. Free memory held "
                    f"outside the model, set eval_accumulation_steps so predictions leave the device, "
                    f"or give a larger budget.", attempts=self.attempts, budget=self.device.budget)
            targs.per_device_eval_batch_size = size // 2
            getattr(self.trainer, "_eval_dataloaders", {}).clear()  # loaders kept with persistent workers
            self.reason = f"halved after an out-of-memory error at {size} rows; the training batch is unchanged"
