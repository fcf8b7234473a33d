"""A LightningModule made OOM-proof: Lightning's manual optimization with autofit's stepper inside.

    from autofit.integrations.lightning import Autofit, autofit_evaluate, autofit_step

    class Net(L.LightningModule):
        def loss(self, batch):                     # the loss of any part of a batch, a mean over its rows
            x, y = batch
            return F.cross_entropy(self(x), y)

        def training_step(self, batch, batch_idx):
            out = autofit_step(self, batch)        # one global batch: split, replayed on OOM, one step
            self.log("train_loss", out.loss)

        def validation_step(self, batch, batch_idx):  # optional: its own batch size and OOM ladder
            self.log("val_loss", autofit_evaluate(self, batch).loss)

    trainer = L.Trainer(callbacks=[Autofit(loss_fn=Net.loss)], max_steps=1000)

The one module that knows Lightning's names. Decisions, with their reasons:
- The module trains under Lightning's manual optimization, which Autofit switches on at `setup`
  (or finds on already): Lightning then calls `training_step` with each batch the loader yields and
  leaves forward, backward and the optimizer to it, which is what autofit's stepper does, on the raw
  optimizer `configure_optimizers` returned (`trainer.optimizers`; never the `LightningOptimizer`
  wrapper, whose every `step` call Lightning counts, and autofit's atomic step and capacity check
  call `step` on the optimizer they are given).
- `trainer.global_step` counts optimizer steps: Lightning's manual loop counts the wrapper's `step`
  calls, so after each global batch autofit counts its one step there (a private counter, below,
  checked at `setup`); `max_steps`, step-based checkpoints and loggers read it as in an automatic run.
- The stepper is opened in `on_train_start` (after Lightning has moved the module to its device and
  restored a checkpoint) and closed when training ends or fails; its plan and proven sizes are the
  callback's state in Lightning's checkpoints, so a resumed fit starts settled, with no OOM attempt.
- A scheduler of `configure_optimizers` is stepped by autofit once per global batch (interval
  "step"), or by this callback at the end of each training epoch (interval "epoch"), as Lightning's
  automatic loop would step it.
- What Lightning would do on top of autofit, silently changing the mathematics or the count, is
  refused with the fix: accumulation (`accumulate_grad_batches`; autofit chooses the split and each
  loader batch is a global batch), gradient clipping on the Trainer (autofit clips the accumulated
  gradient: `max_grad_norm`), a precision plugin other than 32-true (it would wrap autofit's plan
  in its own autocast and scaler: the plan owns precision), strategies other than one device, several
  optimizers, and schedulers stepped at another pace or with a metric.
"""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl

from autofit.recipes.evaluate import EvalSizer, evaluate
from autofit.recipes.stepper import stepper

# The Trainer precision (as Lightning normalises it) that leaves the step to autofit's plan.
NEUTRAL_PRECISION = "32-true"
# Lightning's mixed precisions -> the autofit precision that does the same (for the refusal's fix).
PLAN_PRECISION = {"bf16-mixed": "bf16", "16-mixed": "fp16"}


class Autofit(pl.Callback):
    """Trains each batch of a LightningModule's `training_step` with autofit's stepper (call
    `autofit_step(self, batch)` there). `loss_fn(module, batch) -> scalar`, a mean over the batch's
    rows (an unbound method such as `Net.loss` fits); without it the module's output must be the
    loss or carry `.loss`. `budget`, `precision`, `max_grad_norm`, `ladder`, `cache`,
    `capacity_check` and `allow_split` mean what they mean for `autofit.stepper`."""

    def __init__(self, loss_fn=None, *, budget=None, precision="auto", max_grad_norm=None, ladder=None,
                 cache=True, capacity_check=True, allow_split=True):
        self.options = dict(loss_fn=loss_fn, budget=budget, precision=precision, max_grad_norm=max_grad_norm,
                            ladder=ladder, cache=cache, capacity_check=capacity_check, allow_split=allow_split)
        self.step = None        # the open stepper's `step`, between on_train_start and the end
        self._stack = None
        self._trainer = None
        self._epoch_scheduler = None
        self._saved = None      # the stepper's state_dict: restored from a checkpoint, or kept at the end
        self._attempts = []     # every attempt of the last fit, kept when its stepper closed
        self._sizer = EvalSizer()  # the evaluation batch size of evaluations outside the stepper

    # -- before anything is built: what Lightning would add on top of autofit ---------------------
    def setup(self, trainer, pl_module, stage):
        if stage != "fit":
            return
        check_trainer(trainer)
        step_progress(trainer)  # before any training: a Lightning without the counter is refused
        # Lightning reads this switch at each batch; set before the optimizers are configured, so
        # they are configured as manual optimization's are (no step by Lightning).
        pl_module.automatic_optimization = False

    # -- the stepper's lifetime ---------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module):
        optimizer, scheduler, epoch_scheduler = optimizer_and_scheduler(trainer)
        carry_automatic_steps(trainer)  # a checkpoint of Lightning's own (automatic) run keeps its step
        stack = contextlib.ExitStack()
        step = stack.enter_context(stepper(pl_module, optimizer, scheduler=scheduler, **self.options))
        try:
            if self._saved is not None:
                step.load_state_dict(self._saved)
        except BaseException:
            stack.close()
            raise
        # Set once the stepper is open: on_exception closes only a stepper that opened.
        self._stack, self.step, self._trainer, self._epoch_scheduler = stack, step, trainer, epoch_scheduler

    @property
    def attempts(self) -> list:
        """Every attempt of this fit so far (of the last fit once it has ended)."""
        return list(self.step.attempts) if self.step is not None else self._attempts

    def train(self, batch):
        """One global batch through the stepper, counted as Lightning's one optimizer step."""
        if self.step is None:
            raise RuntimeError("autofit_step(self, batch) trains only inside training_step, while the Trainer "
                               "fits with the Autofit callback (between on_train_start and on_train_end).")
        out = self.step(batch)
        count_optimizer_step(self._trainer)
        return out

    def evaluate(self, module, batch, metric_fn=None):
        """One validation batch through autofit's evaluation: inference mode, its own batch size and
        OOM ladder, never the training plan; the stepper's while it is open, else `autofit.evaluate`
        (Lightning's sanity check runs before on_train_start; `trainer.validate` has no stepper)."""
        if self.step is not None:
            return self.step.evaluate([batch], metric_fn=metric_fn)
        return evaluate(module, [batch], loss_fn=self.options["loss_fn"], budget=self.options["budget"],
                        metric_fn=metric_fn, sizer=self._sizer)

    def on_train_epoch_end(self, trainer, pl_module):
        if self._epoch_scheduler is not None:
            self._epoch_scheduler.step()  # Lightning's automatic loop steps interval="epoch" here too

    def on_train_end(self, trainer, pl_module):
        self._close(None, None, None)

    def on_exception(self, trainer, pl_module, exception):
        if self._stack is not None:
            self._close(type(exception), exception, exception.__traceback__)

    def _close(self, kind, error, traceback):
        step, stack = self.step, self._stack
        self._saved, self._attempts = step.state_dict(), list(step.attempts)
        self.step = self._stack = self._trainer = self._epoch_scheduler = None
        stack.__exit__(kind, error, traceback)

    # -- Lightning's checkpoints hold the plan ------------------------------------------------------
    def state_dict(self):
        return (self.step.state_dict() if self.step is not None else self._saved) or {}

    def load_state_dict(self, state_dict):
        self._saved = state_dict or None


def autofit_step(module, batch):
    """Train one global batch of `module`'s training_step with the trainer's Autofit callback;
    returns autofit's StepOutput (.loss as a float, .plan, .attempts, .grad_norm)."""
    return _callback(module, "autofit_step").train(batch)


def autofit_evaluate(module, batch, metric_fn=None):
    """The loss (and `metric_fn(output, batch)` metrics) of one validation batch in `module`'s
    validation_step, OOM-proof; returns autofit's EvalResult (.loss, .metrics, .batch_size, .attempts)."""
    return _callback(module, "autofit_evaluate").evaluate(module, batch, metric_fn)


def _callback(module, caller) -> "Autofit":
    found = [c for c in module.trainer.callbacks if isinstance(c, Autofit)]
    if len(found) != 1:
        raise RuntimeError(f"{caller} needs one Autofit callback on the Trainer but found {len(found)}; "
                           f"create it with L.Trainer(callbacks=[Autofit(loss_fn=...)], ...).")
    return found[0]


def check_trainer(trainer) -> None:
    """Refuse, with the fix, what Lightning would do on top of autofit's step."""
    if trainer.accumulate_grad_batches != 1:
        k = trainer.accumulate_grad_batches
        raise ValueError(
            f"Trainer(accumulate_grad_batches={k}) accumulates in Lightning's loop; autofit chooses the "
            f"accumulation itself and each batch of the loader is one global batch. Create the Trainer "
            f"without accumulate_grad_batches and give the DataLoader batch_size {k} times larger (the "
            f"global batch of the accumulated run).")
    if trainer.gradient_clip_val:
        raise ValueError(
            f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips in Lightning's optimizer step, "
            f"which autofit replaces; create the Trainer without it and pass "
            f"Autofit(max_grad_norm={trainer.gradient_clip_val}) (autofit clips the norm of the whole "
            f"accumulated gradient; clipping by value is not offered).")
    precision = str(trainer.precision)
    if precision != NEUTRAL_PRECISION:
        plan = PLAN_PRECISION.get(precision)
        hint = (f" and pass Autofit(precision={plan!r}) (or 'auto')" if plan else
                " (autofit's plans train fp32 parameters, with bf16 or fp16 autocast when they choose it)")
        raise ValueError(
            f"Trainer(precision={precision!r}) wraps training_step in Lightning's own precision plugin, "
            f"around autofit's plan, which owns autocast and the fp16 grad scaler. Create the Trainer "
            f"with precision='32-true'{hint}.")
    # SingleDeviceStrategy is public; autofit trains one device per process here (Lightning's DDP
    # wraps the module and its forward, which autofit's own lockstep does not go through).
    if not isinstance(trainer.strategy, pl.strategies.SingleDeviceStrategy):
        raise ValueError(
            f"the Trainer's strategy is {type(trainer.strategy).__name__}; the Autofit callback trains on "
            f"one device (strategy='auto' with devices=1, or SingleDeviceStrategy). For several GPUs use "
            f"autofit.stepper under torchrun in a plain loop.")


def optimizer_and_scheduler(trainer):
    """(optimizer, scheduler autofit steps per global batch, scheduler stepped per epoch)."""
    optimizers = trainer.optimizers  # the raw torch optimizers, not the LightningOptimizer wrappers
    if len(optimizers) != 1:
        raise ValueError(f"configure_optimizers returned {len(optimizers)} optimizers; the Autofit callback "
                         f"steps exactly one (the stepper's one optimizer step per global batch).")
    configs = trainer.lr_scheduler_configs
    if not configs:
        return optimizers[0], None, None
    if len(configs) > 1:
        raise ValueError(f"configure_optimizers returned {len(configs)} schedulers; the Autofit callback "
                         f"steps at most one. Combine them (torch.optim.lr_scheduler.SequentialLR or "
                         f"ChainedScheduler).")
    config = configs[0]
    name = type(config.scheduler).__name__
    if config.frequency != 1 or config.interval not in ("step", "epoch"):
        raise ValueError(f"the {name} is configured with interval={config.interval!r}, "
                         f"frequency={config.frequency}; the Autofit callback steps a scheduler every "
                         f"optimizer step (interval='step') or every epoch (interval='epoch'), frequency 1.")
    if config.interval == "step":
        return optimizers[0], config.scheduler, None
    if "ReduceLROnPlateau" in name:
        raise ValueError(f"the {name} steps on a metric; step it yourself in on_validation_epoch_end "
                         f"(self.lr_schedulers().step(metric)) and return it from configure_optimizers "
                         f"without the scheduler.")
    return optimizers[0], None, config.scheduler


# Lightning's internals this module uses (lightning 2.6): the progress of the manual-optimization
# loop, which `trainer.global_step` reads under manual optimization; its increments are what the
# LightningOptimizer's `_on_before_step`/`_on_after_step` hooks do for each `step` call.
STEP_PROGRESS = "fit_loop.epoch_loop.manual_optimization.optim_step_progress"


def step_progress(trainer):
    """Lightning's manual-optimization step counter, or a refusal naming what this Lightning lacks."""
    found = trainer
    for name in STEP_PROGRESS.split("."):
        found = getattr(found, name, None)
    if not (hasattr(found, "increment_ready") and hasattr(found, "increment_completed")):
        raise RuntimeError(
            f"this Lightning ({pl.__version__}) has no trainer.{STEP_PROGRESS} with increment_ready/"
            f"increment_completed, where the Autofit callback counts its optimizer steps for "
            f"trainer.global_step; install a lightning the integration knows (2.4-2.6: pip install "
            f"'autofit[lightning]').")
    return found


# Where an automatic run counts its optimizer steps (what its checkpoints restore):
# fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer_steps (lightning 2.6).
AUTOMATIC_STEPS = "fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer_steps"


def carry_automatic_steps(trainer) -> None:
    """A fit resumed from a checkpoint of an automatic-optimization run has its steps in the
    automatic counter and none in the manual one, which trainer.global_step reads here: carry them
    over once, so max_steps and step-based checkpoints go on from the checkpoint's step."""
    done = trainer
    for name in AUTOMATIC_STEPS.split("."):
        done = getattr(done, name, 0)
    progress = step_progress(trainer)
    if isinstance(done, int) and done > 0 and progress.total.completed == 0:
        progress.total.ready += done
        progress.total.completed += done


def count_optimizer_step(trainer) -> None:
    """One optimizer step, counted where Lightning's manual loop counts a LightningOptimizer.step."""
    progress = step_progress(trainer)
    progress.increment_ready()
    progress.increment_completed()


__all__ = ["Autofit", "autofit_evaluate", "autofit_step"]
