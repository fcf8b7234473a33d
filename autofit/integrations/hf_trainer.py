"""What autofit reads from and changes on a Hugging Face `Trainer`, one small function each.

`autofit.integrations.transformers` composes these (and `hf_loss`: the loss scaling under
accumulation; `hf_recovery`: freeing, restarting, resuming; `hf_eval`: evaluation retries) into
`fit_trainer`, `train` and `evaluate`. This module knows the
Trainer's internals (tested against transformers 5.x):

- the Trainer caches the train batch size at construction (`_train_batch_size`) and bakes mixed
  precision into its `Accelerator` (and the model's autocast wrapper) at construction and at the
  first `train()`, so a plan change updates the cache, and a precision change builds a new
  Accelerator the way the Trainer's own hyperparameter search does;
- resuming skips `global_step * gradient_accumulation_steps` batches of the *new* loader, which is
  `global_step` effective batches whatever the micro-batch, as long as the micro-batch divides the
  rows per optimizer step; the sampler's permutation depends only on the seed and the epoch, so a
  resumed attempt sees the same samples as an uninterrupted run.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from autofit.plans import precision as precisions
from autofit.estimator.capacity import Fit, Space, make_estimator, needs_message, rank
from autofit.engine.batches import tokens_per_row
from autofit.estimator.cost import plan_cost
from autofit.errors import DoesNotFit
from autofit.plans.ladder import Move
from autofit.plans.plan import Plan
from autofit.estimator.start import cannot_estimate, headroom
from autofit.engine.step import NoLossError
from autofit.integrations import accelerate as accelerate_internals
from autofit.integrations import transformers_internals as hf_internals
from autofit.integrations.hf_records import kept

SCAN = 1024  # samples read to find the longest rows for the estimate
# What the Trainer path offers instead of optimizer offload (it has none outside DeepSpeed, which
# autofit does not plan for).
NO_OFFLOAD = ("the Trainer has no optimizer offload outside DeepSpeed; TrainingArguments(optim="
              "'adafactor') keeps a factored second moment instead of AdamW's two full moments")


# -- reading the Trainer ------------------------------------------------------------------------

def rows_per_step(args) -> int:
    """Rows one device trains per optimizer step (what autofit calls its global batch)."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps


def devices(args) -> int:
    """Data-parallel replicas: processes times DataParallel GPUs per process."""
    return max(1, args.world_size) * max(1, getattr(args, "n_gpu", 1))


def checkpointing_on(trainer) -> bool:
    args, model = trainer.args, trainer.model
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"  # the 5.x name, else the older one (deprecated in 5.x)
    return bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)
                or getattr(model, name, False))


def can_checkpoint(trainer) -> bool:
    return bool(getattr(trainer.model, "supports_gradient_checkpointing", False))


def _elements(sample) -> int:
    if isinstance(sample, Mapping):
        return sum(_elements(v) for v in sample.values())
    if isinstance(sample, torch.Tensor):
        return sample.numel()
    if isinstance(sample, (list, tuple)):
        return len(sample)
    return 0


def sample_batch(trainer, rows: int):
    """`rows` training samples collated the way the Trainer collates them: the longest among the
    first SCAN samples (memory follows the longest rows), cycled when the dataset is smaller."""
    dataset = trainer.train_dataset
    if dataset is None:
        raise ValueError("trainer.train_dataset is None; give the Trainer a train_dataset, the data "
                         "whose batches autofit fits to the device.")
    collator = trainer.data_collator
    dataset, collator = hf_internals.training_columns(trainer, dataset, collator)
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        scan = list(itertools.islice(iter(dataset), rows))
    else:
        scan = [dataset[i] for i in range(min(len(dataset), SCAN))]
    if not scan:
        raise ValueError(f"trainer.train_dataset ({type(dataset).__name__}) is empty; give it at least "
                         f"one sample.")
    order = sorted(range(len(scan)), key=lambda i: -_elements(scan[i]))  # stable: ties keep their order
    return collator([scan[order[i % len(order)]] for i in range(rows)])


# -- changing the Trainer -----------------------------------------------------------------------

def apply_plan(trainer, plan: Plan) -> None:
    """Set the TrainingArguments (and the Trainer's cached batch size) to `plan`."""
    args = trainer.args
    args.per_device_train_batch_size = plan.micro_batch_size
    args.gradient_accumulation_steps = plan.accumulation_steps
    hf_internals.set_train_batch_size(trainer, args.train_batch_size)  # cached by Trainer.__init__
    for name in ("activation_checkpointing", "gradient_checkpointing"):  # 5.x name, and its alias
        if hasattr(args, name):
            setattr(args, name, plan.checkpointing)
    set_precision(trainer, plan.precision)


def set_precision(trainer, precision: str) -> None:
    """bf16/fp16 in the arguments and, when that changes the mixed precision, a new Accelerator."""
    args = trainer.args
    chosen = precisions.get(precision)
    for flag in (p.hf_flag for p in precisions.REGISTRY.values() if p.hf_flag):
        setattr(args, flag, flag == chosen.hf_flag)
    wanted = chosen.accelerate
    if getattr(args, "mixed_precision", wanted) == wanted:
        return
    args.mixed_precision = wanted

    model = trainer.model
    accelerate_internals.unwrap_autocast(model)
    accelerate_internals.forget_prepared_mark(model)  # else the new Accelerator would skip it
    trainer.model_wrapped = model
    if trainer.optimizer is not None:
        trainer.optimizer = raw_optimizer(trainer.optimizer)
    accelerate_internals.reset_state()  # as Trainer._hp_search_setup does before a new Accelerator
    trainer.create_accelerator_and_postprocess()


def raw_optimizer(optimizer):
    """The torch optimizer inside Accelerate's AcceleratedOptimizer wrappers."""
    while type(optimizer).__name__ == "AcceleratedOptimizer" and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


# -- estimating ---------------------------------------------------------------------------------

def estimate_plan(trainer, device, budget: int, rows: int, policy: str):
    """(plan, predicted peak, plans estimated): the fastest plan predicted to fit `budget` (compared
    as `start.headroom` says) after rounding each fitting plan's micro-batch down to a divisor of
    `rows`; None when the estimator cannot follow the model (said once in the log)."""
    batch = sample_batch(trainer, rows)
    try:
        # The estimate runs the Trainer's own compute_loss, whose records (a subclass's token count,
        # metrics waiting to be logged) would keep its fake values: kept as they were.
        with kept(trainer):
            room = headroom(device)
            estimator = make_estimator(trainer.model, batch, _optimizer(trainer), _loss_fn(trainer),
                                       device_type="cuda" if device.type == "cuda" else "cpu",
                                       workspaces=room["workspaces"])
            candidates = rank(estimator, batch, budget, fit=Fit(**room),
                              space=Space(policy, bf16_supported=device.supports_bf16(), allow_offload=False))
    except Exception as error:
        if isinstance(error, NoLossError) or "did not return a loss" in str(error):
            raise _no_loss(trainer, batch) from error
        # The check is optional: an estimator failure never stops training.
        cannot_estimate(trainer.model, error, "the TrainingArguments' batch kept; the ladder steps "
                                              "down on an out-of-memory error")
        return None
    best = None
    tokens = tokens_per_row(batch)  # weighed as the capacity check weighs them (estimator/cost)
    for c in candidates:
        if c.fits:  # round down to a divisor: the same configuration with fewer rows fits too
            micro = max(d for d in range(1, c.plan.micro_batch_size + 1) if rows % d == 0)
            plan = c.plan.replace(micro_batch_size=micro, accumulation_steps=rows // micro)
            if best is None or plan_cost(plan, rows, tokens) < plan_cost(best[0], rows, tokens):
                best = (plan, c.estimate.peak_bytes)
    if best is None:
        args = trainer.args
        raise DoesNotFit(
            f"no plan fits {rows} rows per device per optimizer step (per_device_train_batch_size="
            f"{args.per_device_train_batch_size} x gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}, effective batch {rows * devices(args)}) on "
            f"{device.describe()}, checked before training: "
            f"{needs_message(candidates, budget, no_offload=NO_OFFLOAD, **headroom(device))} "
            f"autofit keeps the effective batch: lower it in the TrainingArguments, or give a larger budget.",
            budget=budget, breakdown=_leanest(candidates).estimate.breakdown if candidates else None,
            plan=_leanest(candidates).plan if candidates else None)
    return best[0], best[1], len(candidates)


def _leanest(candidates):
    return min(candidates, key=lambda c: c.estimate.peak_bytes)


def _optimizer(trainer):
    """What the estimator should build: the user's optimizer, else the Trainer's choice (torch
    optimizers only; others are estimated as AdamW, an upper bound for most)."""
    if trainer.optimizer is not None:
        return raw_optimizer(trainer.optimizer)
    cls_kwargs = trainer.optimizer_cls_and_kwargs or type(trainer).get_optimizer_cls_and_kwargs(
        trainer.args, trainer.model)
    cls, kwargs = cls_kwargs
    if not getattr(cls, "__module__", "").startswith("torch.optim"):
        return None
    return lambda params: cls(params, **kwargs)


def _loss_fn(trainer):
    """None (the model's own loss, the estimator's default) unless the Trainer computes its own."""
    if type(trainer).compute_loss is trainer_class().compute_loss and trainer.compute_loss_func is None \
            and trainer.label_smoother is None:
        return None
    return lambda model, batch: trainer.compute_loss(model, dict(batch))


def _no_loss(trainer, batch) -> ValueError:
    keys = sorted(batch) if hasattr(batch, "keys") else type(batch).__name__
    labels = list(getattr(trainer, "label_names", None) or ["labels"])
    missing = [k for k in labels if not hasattr(batch, "keys") or k not in batch]
    return ValueError(
        f"trainer.model ({type(trainer.model).__name__}) returns no loss on a training batch with fields "
        f"{keys}" + (f" (no {missing})" if missing else "") + ": the Trainer trains on the model's loss. "
        "Give train_dataset a 'labels' field, set TrainingArguments(label_names=[...]) to the field that "
        "holds the labels, or pass Trainer(compute_loss_func=...).")


def trainer_class():
    from transformers import Trainer
    return Trainer


# -- the ladder's micro-batch move --------------------------------------------------------------

def smaller_divisor(rows: int, current: int, floor: int) -> int | None:
    """The next micro-batch below `current` that divides `rows`, not below `floor`: the largest
    divisor at or under max(floor, current // 2) (halving, when current is even), else the smallest
    divisor between that and current; None when there is none."""
    target = min(max(floor, current // 2), current - 1)
    below = [d for d in range(floor, target + 1) if rows % d == 0]
    if below:
        return below[-1]
    between = [d for d in range(target + 1, current) if rows % d == 0]
    return between[0] if between else None


class DivisorMicroBatch(Move):
    """Halve the per-device batch and double the accumulation, keeping micro-batch x accumulation
    equal to the rows per step exactly (micro-batches that divide it), not below `floor`."""

    def __init__(self, rows: int, floor: int = 1):
        self.rows, self.floor = rows, floor
        self.why = (f"halve per_device_train_batch_size and double gradient_accumulation_steps (a "
                    f"divisor of {rows}, not below {floor})")

    def step(self, plan, global_batch=None):
        size = smaller_divisor(self.rows, plan.micro_batch_size, self.floor)
        return None if size is None else plan.replace(micro_batch_size=size,
                                                      accumulation_steps=self.rows // size)

    def __repr__(self):
        return f"DivisorMicroBatch(rows={self.rows}, floor={self.floor})"
