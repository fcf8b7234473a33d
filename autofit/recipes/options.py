"""The options of a training job, in one place: `autofit.run`, `autofit.stepper` and `Training` take
the same ones, so an option is one field here (its default, its check, its comment) and every entry
point has it. `run` and `stepper` take them as keyword arguments; their signatures are made from
these fields (`keywords`), so help() and editors show them.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from autofit.engine.interfaces import LossFn, OptimizerArg, SchedulerArg, Size
from autofit.plans import precision as precisions
from autofit.plans.ladder import Move


@dataclass(frozen=True)
class Options:
    """What a job is told besides its model and its data."""

    optimizer: OptimizerArg = None  # an Optimizer, or a factory params -> Optimizer (None: AdamW)
    scheduler: SchedulerArg = None  # built on that optimizer, or a factory optimizer -> scheduler
    loss_fn: LossFn | None = None  # (model, batch) -> scalar loss, or (loss, kept); None: the model's own
    budget: Size | None = None     # device bytes ("2GiB", an int) the job may use; None: the device's
    precision: str = "auto"        # "auto", "fp32", "bf16", "fp16"
    max_grad_norm: float | None = None  # clip the global batch's gradient to this norm
    ladder: Move | Sequence | Callable | None = None  # the moves to step down by (None: autofit's; plans.ladder.as_move)
    cache: bool = True             # remember the plan that worked per job and device
    progress: bool = True          # a progress bar and step-down logging (rank 0)
    capacity_check: bool = True    # estimate plans before training and start from one that fits
    allow_split: bool = True       # False: never split a global batch into micro-batches
    shard: bool = False            # apply FSDP2's fully_shard per block (torch.distributed)
    batch_dim: int | dict | None = None  # where the batches' rows are (engine/layout.py); None: dimension 0

    def __post_init__(self):
        precisions.check_policy(self.precision)
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be a callable (model, batch) -> scalar loss but got {self.loss_fn!r}.")
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                                 or not math.isfinite(norm) or norm <= 0):
            raise ValueError(f"max_grad_norm must be a positive number (or None: no clipping) but got "
                             f"{norm!r}.")
        for name in ("allow_split", "shard"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False but got {getattr(self, name)!r}.")
        if self.shard and isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError("shard=True replaces the model's parameters by their shards, so an optimizer "
                             "built on them would step tensors no longer trained; pass a factory (e.g. "
                             "torch.optim.AdamW or lambda params: ...) instead of an instance.")

    @classmethod
    def of(cls, what: str, options: dict, **fixed) -> "Options":
        """Options from `what`'s keyword arguments; an unknown name is refused by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"{what} got unknown option(s) {', '.join(map(repr, unknown))}; its options "
                            f"are {', '.join(sorted(names - set(fixed)))}.")
        return cls(**options, **fixed)


def keywords(function, *, leave_out=(), defaults=None):
    """`function` with a signature naming every option as a keyword (after its own parameters,
    less its **options), for help() and editors; `defaults` overrides an option's default."""
    own = [p for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
    taken = {p.name for p in own}
    defaults = defaults or {}
    types = typing.get_type_hints(Options)
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(f.name, f.default),
                               annotation=types[f.name])
             for f in dataclasses.fields(Options) if f.name not in taken and f.name not in leave_out]
    function.__signature__ = inspect.signature(function).replace(parameters=own + extra)
    return function


def check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module but got {type(model).__name__}.")
