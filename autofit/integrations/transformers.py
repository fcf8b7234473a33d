"""Hugging Face `transformers.Trainer` that fits its GPU, and keeps fitting it.

    from autofit.integrations.transformers import fit_trainer, train

    fitted = fit_trainer(trainer, budget="16GiB")  # sets the TrainingArguments; a TrainerPlan
    run = train(trainer)                           # fit, then train, stepping down on OOM
    run.output.global_step, run.attempts, run.eval_attempts

What autofit sets: `per_device_train_batch_size`, `gradient_accumulation_steps`, `bf16`/`fp16` and
activation checkpointing (`activation_checkpointing`, alias `gradient_checkpointing`). What it never
changes: the effective batch, `per_device_train_batch_size * gradient_accumulation_steps * world
size`, exactly as the TrainingArguments had it.

Decisions, with their reasons:
- Micro-batches divide the rows per step. The Trainer's accumulation is a count of equal loader
  batches, so a micro-batch that does not divide `per_device * accumulation` would change the
  effective batch. The fit takes the fastest plan the estimator predicts to fit (capacity.rank,
  the budget as start.headroom compares them) after rounding each fitting plan's micro-batch down to a
  divisor (a smaller micro-batch of the same configuration needs no more memory); the ladder
  halves to divisors too. A prime number of rows can only go to one row per micro-batch.
- The user's explicit choices stay: `bf16`/`fp16` already set in the arguments fix the precision
  (precision="auto" only adds bf16 to an fp32 run); checkpointing already on stays on. There is no
  optimizer offload (the Trainer has none outside DeepSpeed).
- On OOM in training: the failed attempt is freed (after its `except` block: the Trainer's own
  optimizer is dropped and rebuilt, a user's optimizer keeps its object and gets its state back),
  the plan steps down as autofit.plans.ladder.default_ladder does (per-device batch halved down to 8,
  then bf16 when precision="auto", then checkpointing, then per-device batch down to 1; an OOM
  the allocator cache's holes caused first replays the same plan once, after emptying it), and the
  run resumes from the newest checkpoint *this call saved* (`save_strategy` and `save_steps` are the
  user's; checkpoints of other runs already in output_dir are never used). The Trainer then skips
  `global_step * gradient_accumulation_steps` batches of the new loader, which is `global_step`
  effective batches, and its sampler's order depends only on the seed and epoch: the resumed run
  sees the same samples as an uninterrupted one and ends at the same global step.
- With no such checkpoint (none saved yet, `save_strategy="no"`, or `save_only_model=True`, whose
  checkpoints lack the optimizer state) the run restarts from where the call started: the user's
  `resume_from_checkpoint`, else the initial state, a host copy of the weights (as big as the
  model, in CPU memory), the user optimizer's and scheduler's state and the RNG states, taken
  before the first attempt. A `model_init` Trainer re-creates its model itself.
- output_dir: autofit deletes and moves nothing. Checkpoints of failed attempts stay (the resumed
  attempt rewrites those of the steps it redoes, as the Trainer does); `save_total_limit` is the
  Trainer's own rotation.
- Models whose forward takes **kwargs but whose loss ignores `num_items_in_batch` make the Trainer
  skip the division by the accumulation steps (huggingface/transformers#47688); autofit detects
  that with a two-row forward and sets `trainer.model_accepts_loss_kwargs = False`, so every split
  of the effective batch trains on the same gradient (`TrainerPlan.notes` says so).
- Evaluation: an OOM in `trainer.evaluate()`, inside training or not, halves only
  `per_device_eval_batch_size` and evaluates again from the random generators the first try found;
  the training batch never changes.
- Reports cover the whole run: after a resume, `output.training_loss` (and the log's "train_loss")
  average every step of the run (the Trainer's own covers the resumed attempt only);
  `Attempt.peak_bytes` is the training's peak, evaluations left out.
- Budget: as in autofit.run. On a machine without CUDA a budget runs the Trainer on a simulated GPU
  (the model's tensors are counted; so are the optimizer state and batches the Trainer makes, and
  the optimizer state a resume loads). `train` refuses world size > 1 (an OOM on one rank would
  leave the others waiting in a collective), hyperparameter search (`trial`), and
  `auto_find_batch_size` (it changes the effective batch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from autofit.plans import precision as precisions
from autofit.gpu.device import open_device
from autofit.plans.ladder import ladder_of
from autofit.plans.plan import Plan
from autofit.sizes import format_size
from autofit.estimator.start import tensor_budget
from autofit.integrations import transformers_internals as hf_internals
from autofit.integrations import hf_recovery as recovery
from autofit.integrations import hf_trainer as hf
from autofit.integrations.hf_eval import EvalGuard
from autofit.integrations.hf_loss import fix_loss_scaling

log = logging.getLogger("autofit")

__all__ = ["TrainerEval", "TrainerPlan", "TrainerRun", "evaluate", "fit_trainer", "train"]


@dataclass(frozen=True)
class TrainerPlan:
    """The Trainer's arguments as autofit set them, and why."""

    plan: Plan          # micro-batch = per_device_train_batch_size, accumulation, precision, checkpointing
    devices: int = 1    # data-parallel replicas (world size x DataParallel GPUs)
    reason: str = ""
    budget: int | None = None
    predicted_peak: int | None = None  # bytes, when the plan was estimated
    notes: tuple = ()   # other changes made to the Trainer, with their reasons

    @property
    def per_device_train_batch_size(self) -> int:
        return self.plan.micro_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.plan.accumulation_steps

    @property
    def effective_batch(self) -> int:
        return self.plan.micro_batch_size * self.plan.accumulation_steps * self.devices

    def describe(self) -> str:
        p = self.plan
        text = (f"per_device_train_batch_size={p.micro_batch_size}, gradient_accumulation_steps="
                f"{p.accumulation_steps}, {p.precision}, checkpointing {'on' if p.checkpointing else 'off'} "
                f"(effective batch {self.effective_batch})")
        return text + (f" [{self.reason}]" if self.reason else "")


@dataclass
class TrainerRun:
    output: object                 # the transformers.TrainOutput of the attempt that finished
    plan: TrainerPlan              # the plan it finished with
    attempts: list = field(default_factory=list)       # list[autofit.Attempt], step = global step
    eval_attempts: list = field(default_factory=list)  # list[hf_eval.EvalAttempt]

    @property
    def global_step(self) -> int:
        return self.output.global_step


@dataclass
class TrainerEval:
    metrics: dict
    attempts: list = field(default_factory=list)  # list[hf_eval.EvalAttempt]


# -- checks -------------------------------------------------------------------------------------

def _check(trainer, precision: str, training: bool = False, train_kwargs=None) -> None:
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer but got {type(trainer).__name__}.")
    hf_internals.require(hf_internals.TRAINER, trainer)  # before anything runs: a refusal changes nothing
    precisions.check_policy(precision)
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError("the Trainer runs DeepSpeed or FSDP, which shard the model across devices; autofit "
                         "plans one full copy per device. Drop deepspeed/fsdp from the TrainingArguments or "
                         "leave the batch to them.")
    if args.auto_find_batch_size:
        raise ValueError("TrainingArguments(auto_find_batch_size=True) multiplies per_device_train_batch_size "
                         "by 0.9 after each out-of-memory error (Accelerate's find_executable_batch_size) and "
                         "keeps gradient_accumulation_steps, so it changes the effective batch; set "
                         "auto_find_batch_size=False and let autofit keep it.")
    if training:
        if args.world_size > 1:
            raise ValueError(f"train() runs one process, but world_size is {args.world_size}: an OOM on one "
                             f"rank would leave the others waiting. Call fit_trainer(trainer, budget=...) on "
                             f"every rank with the same explicit budget (same data and budget give the same "
                             f"plan) and trainer.train() yourself.")
        if (train_kwargs or {}).get("trial") is not None:
            raise ValueError("train() does not run hyperparameter search trials (trial=...); call "
                             "trainer.hyperparameter_search yourself.")


def _policy(args, precision: str) -> str:
    """The precision policy: the user's bf16/fp16 stay as they are unless a precision is given."""
    flagged = precisions.from_hf_flags(args)
    return flagged if precision == precisions.AUTO and flagged else precision


# -- fit ----------------------------------------------------------------------------------------

def fit_trainer(trainer, budget=None, precision: str = "auto") -> TrainerPlan:
    """Set the Trainer's batch, accumulation, precision and checkpointing to the fastest plan that
    fits `budget` (None: what the CUDA card has free; on a machine without CUDA, no limit and the
    arguments stay as they are), keeping the effective batch exactly. Raises autofit.DoesNotFit,
    saying what is needed, when no plan fits."""
    _check(trainer, precision)
    with open_device(budget) as device:
        device.place_model(trainer.model)
        return _fit(trainer, device, precision)


def _fit(trainer, device, precision: str) -> TrainerPlan:
    args = trainer.args
    rows, policy, replicas = hf.rows_per_step(args), _policy(args, precision), hf.devices(args)
    budget = tensor_budget(device)
    keep_checkpointing = hf.checkpointing_on(trainer)
    notes = tuple(n for n in [fix_loss_scaling(trainer, device)] if n)
    peak = None
    estimated = None if budget is None else hf.estimate_plan(trainer, device, budget, rows, policy)
    if estimated is None:
        plan = Plan(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                    precision=precisions.start_precision(policy), checkpointing=keep_checkpointing)
        reason = (f"no budget on {device.describe()}: the TrainingArguments' batch kept" if budget is None
                  else "the estimator cannot follow the model: the TrainingArguments' batch kept")
    else:
        plan, peak, count = estimated
        if keep_checkpointing and not plan.checkpointing:
            plan = plan.replace(checkpointing=True)  # the user's; it only lowers the peak
        reason = (f"estimated: fastest plan predicted to fit, micro-batch dividing {rows} rows (peak "
                  f"{format_size(peak)} of {format_size(budget)}, {count} plan(s) estimated)")
    hf.apply_plan(trainer, plan)
    log.info("fit_trainer: %s", reason)
    return TrainerPlan(plan, replicas, reason, budget, peak, notes)


# -- train --------------------------------------------------------------------------------------

def _ladder(trainer, rows: int, policy: str, bf16_supported: bool):
    """The ladder's rungs (autofit.plans.ladder.RUNGS) with micro-batches that divide the rows per
    step, checkpointing where the model can, and without offload."""
    return ladder_of(policy, bf16_supported, split=lambda floor: hf.DivisorMicroBatch(rows, floor),
                     checkpoint=hf.can_checkpoint(trainer), offload=False)


def train(trainer, budget=None, precision: str = "auto", **train_kwargs) -> TrainerRun:
    """`fit_trainer`, then `trainer.train(**train_kwargs)`, stepping down and resuming from the last
    checkpoint this call saved after every out-of-memory error (see the module docstring), and
    retrying evaluations with a halved evaluation batch. Raises autofit.DoesNotFit when the
    ladder has no step left."""
    _check(trainer, precision, training=True, train_kwargs=train_kwargs)
    origin = train_kwargs.pop("resume_from_checkpoint", None)
    if origin is True:
        from transformers.trainer_utils import get_last_checkpoint
        origin = get_last_checkpoint(trainer.args.output_dir)
        if origin is None:
            raise ValueError(f"resume_from_checkpoint=True but {trainer.args.output_dir!r} holds no "
                             f"checkpoint; pass a path or leave it out.")
    origin = origin or None
    with open_device(budget) as device:
        device.place_model(trainer.model)
        fitted = _fit(trainer, device, precision)
        rows, policy = hf.rows_per_step(trainer.args), _policy(trainer.args, precision)
        ladder = _ladder(trainer, rows, policy, device.supports_bf16())
        start = recovery.start_state(trainer, device) if origin is None else None
        saves = recovery.tracker(device, trainer)
        trainer.add_callback(saves)
        eval_attempts: list = []
        guard = EvalGuard(trainer, device, eval_attempts)
        try:
            output, plan, attempts = recovery.TrainAttempts(trainer, device, fitted, ladder, start, saves,
                                                            origin, train_kwargs).run(guard)
        finally:
            guard.remove()
            trainer.remove_callback(saves)
    final = TrainerPlan(plan, fitted.devices, attempts[-1].reason, fitted.budget, fitted.predicted_peak,
                        fitted.notes)
    return TrainerRun(_whole_run(trainer, output, saves), final, attempts, eval_attempts)


def _whole_run(trainer, output, saves):
    """The TrainOutput (and the log's last "train_loss") with the loss averaged over every step of
    the run, not only those of the attempt that finished after a resume."""
    loss = saves.whole_run_loss(output)
    if loss == output.training_loss:
        return output
    for entry in reversed(trainer.state.log_history):
        if "train_loss" in entry:
            entry["train_loss"] = loss
            break
    return output._replace(training_loss=loss, metrics={**output.metrics, "train_loss": loss})


# -- evaluate -----------------------------------------------------------------------------------

def evaluate(trainer, budget=None, **evaluate_kwargs) -> TrainerEval:
    """`trainer.evaluate(**evaluate_kwargs)`, halving `per_device_eval_batch_size` after each
    out-of-memory error and evaluating again (the training arguments are never changed)."""
    _check(trainer, precisions.AUTO)
    attempts: list = []
    with open_device(budget) as device:
        device.place_model(trainer.model)
        guard = EvalGuard(trainer, device, attempts)
        try:
            metrics = trainer.evaluate(**evaluate_kwargs)
        finally:
            guard.remove()
    return TrainerEval(metrics, attempts)
