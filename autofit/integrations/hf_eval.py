"""Evaluation of a Hugging Face `Trainer` that survives an out-of-memory error: `EvalGuard` halves
`per_device_eval_batch_size` and evaluates again, each try an `engine.attempt` attempt (freed after
its `except` block, memory checked against the baseline); a failure the cache's holes caused is
first replayed once at the same size (gpu/fragmentation). Used by `autofit.integrations.transformers`."""

from __future__ import annotations

from dataclasses import dataclass

from autofit.engine.attempt import Attempter, outside, until_fits
from autofit.engine.replay import rng_state, set_rng_state
from autofit.errors import DoesNotFit
from autofit.integrations import transformers_internals as hf_internals
from autofit.integrations.hf_records import snapshot
from autofit.integrations.hf_trainer import raw_optimizer


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
    Trainer's records (hf_records: metrics a subclass's compute_loss collects, the log) and the
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
        self.tries = 0  # tries of the current evaluation
        self.size = 0   # its per_device_eval_batch_size
        self.evaluations = 0  # evaluations so far: a replay's key is (evaluation, size)
        # Nothing of the training is dropped (it goes on after the evaluation); what stays above
        # the baseline is named among the tensors that are neither the model's nor its optimizer's.
        self.attempter = Attempter(device, holders=self._holders)

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
        self.outside_peak = self.training_peak()
        rng = rng_state()  # every retry starts from it
        records = snapshot(self.trainer)  # and from the Trainer's records (hf_records)
        self.tries = 0
        self.evaluations += 1
        outcome = until_fits(lambda: self._attempt(rng, records, args, kwargs), self._after_oom)
        return outcome.value

    def _attempt(self, rng, records, args, kwargs):
        self.done = 0
        if self.tries:
            set_rng_state(rng)
            records.restore()
        self.tries += 1
        self.size = self.trainer.args.per_device_eval_batch_size
        self.device.reset_peak_memory_stats()
        outcome = self.attempter(lambda: self.original(*args, **kwargs), peak=self.device.max_memory_allocated)
        if outcome.ok:
            self.attempts.append(EvalAttempt(self.size, "ok", self.trainer.state.global_step, self.reason,
                                             peak_bytes=outcome.peak))
            self.reason = "kept: the evaluation batch that worked"
            self.device.reset_peak_memory_stats()  # the training after it counts from here
        return outcome

    def _after_oom(self, outcome) -> bool:
        size, step = self.size, self.trainer.state.global_step
        self.attempts.append(EvalAttempt(size, "oom", step, self.reason, outcome.error, self.done, outcome.peak))
        if why := self.attempter.empty_cache_for_replay(outcome, (self.evaluations, size)):  # as autofit.evaluate does
            self.reason = why
            return True
        if size <= 1:
            raise DoesNotFit(
                f"evaluation of one row per device ran out of memory at global step {step} on "
                f"{self.device.describe()}; the training batch was left as it is. Free memory held "
                f"outside the model, set eval_accumulation_steps so predictions leave the device, "
                f"or give a larger budget.", attempts=self.attempts, budget=self.device.budget)
        self.trainer.args.per_device_eval_batch_size = size // 2
        hf_internals.drop_eval_loaders(self.trainer)  # loaders kept with persistent workers
        self.reason = f"halved after an out-of-memory error at {size} rows; the training batch is unchanged"
        return True

    def _holders(self) -> list:
        trainer = self.trainer
        optimizer = raw_optimizer(trainer.optimizer) if trainer.optimizer is not None else None
        return outside(self.device, trainer.model, optimizer)()
