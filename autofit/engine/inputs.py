"""Checks of what a user hands to run, stepper and tune, before any work: clear errors naming the value.

A low module (it imports no recipe), so every recipe can use it without importing another.
"""

from __future__ import annotations

import inspect

import torch

from autofit.engine.batches import dataset_batches, rows_of
from autofit.engine.optimizers import check_steppable, from_factory
from autofit.engine.reading import Epochs


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int but got {value!r}.")


def global_batches(data, batch_size, epochs: int):
    """(first batch, a function giving each epoch's iterator); checks the data before training.

    The data is read as a plain loop reads it: one iter() per epoch, the first batch taken from
    the first epoch's own iterator (reading.Epochs)."""
    if isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        if batch_size is None:
            raise ValueError(f"data is a {type(data).__name__} (a map-style Dataset); pass batch_size=N, "
                             f"the global batch one optimizer step sees.")
        check_positive_int("batch_size", batch_size)
        if len(data) == 0:
            raise ValueError(f"data is an empty {type(data).__name__}; give at least one sample.")
        epochs_of = Epochs(dataset_batches(data, batch_size), epochs)
        return epochs_of.first, epochs_of
    if batch_size is not None:
        raise ValueError(f"batch_size={batch_size!r} applies to a map-style Dataset, but data is a "
                         f"{type(data).__name__} that already yields batches; drop batch_size or pass "
                         f"the Dataset itself.")
    if isinstance(data, (torch.Tensor, dict)) or not hasattr(data, "__iter__"):
        raise TypeError(f"data must be a map-style Dataset or an iterable of batches (a DataLoader, a "
                        f"list of batches) but got {type(data).__name__}.")
    epochs_of = Epochs(data, epochs)  # the first batch comes from the first epoch's iterator
    return epochs_of.first, epochs_of


def check_splittable(first, data) -> None:
    """Raise when the first global batch cannot be split into rows, saying so for a DataLoader
    that yields single samples (batch_size=None)."""
    try:
        rows_of(first)
    except ValueError as error:
        raise ValueError(f"{error} {_unbatched(data)}".rstrip()) from None


def _unbatched(data) -> str:
    """What to say when `data` is a DataLoader that yields single samples (batch_size=None)."""
    if getattr(data, "batch_size", 0) is None and getattr(data, "batch_sampler", 0) is None:
        return ("data is a DataLoader with batch_size=None, which yields one sample at a time, not a "
                "global batch; give the DataLoader batch_size=<global batch>, or pass its dataset with "
                "batch_size=<global batch>.")
    return ""


def build_optimizer(optimizer, model):
    """(the optimizer, whether autofit built it): an instance as given, a factory called, None AdamW."""
    if optimizer is None:
        return torch.optim.AdamW(model.parameters()), True
    if isinstance(optimizer, torch.optim.Optimizer):
        check_steppable(optimizer)
        return optimizer, False
    if callable(optimizer):
        built = from_factory(optimizer, model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(built).__name__}; it must return a "
                            f"torch.optim.Optimizer built over the parameters it is given.")
        check_steppable(built)
        return built, True
    raise TypeError(f"optimizer must be a torch.optim.Optimizer, a factory params -> Optimizer, or None "
                    f"but got {type(optimizer).__name__}.")


def check_optimizer(optimizer) -> None:
    """Fail before any work on what build_optimizer would refuse later (no parameters needed)."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, a factory params -> Optimizer, or "
                        f"None but got {type(optimizer).__name__}.")


def build_scheduler(scheduler, optimizer):
    """An instance built on `optimizer` as given, a factory optimizer -> scheduler called, or None."""
    if scheduler is None:
        return None
    if hasattr(scheduler, "step") and hasattr(scheduler, "optimizer") and not isinstance(scheduler, type):
        if scheduler.optimizer is not optimizer:
            raise ValueError(f"the scheduler ({type(scheduler).__name__}) is built on another optimizer "
                             f"than the one training steps; build it on the optimizer you pass, or pass "
                             f"a factory optimizer -> scheduler.")
        return check_scheduler_steps(scheduler)
    if callable(scheduler):
        return check_scheduler_steps(scheduler(optimizer))
    raise TypeError(f"scheduler must be a learning-rate scheduler, a factory optimizer -> scheduler, or "
                    f"None but got {type(scheduler).__name__}.")


def check_scheduler_steps(scheduler):
    """`scheduler` when its `step()` runs without arguments (autofit calls it so, once per optimizer
    step); a scheduler whose step needs one (ReduceLROnPlateau's metric) is refused before training."""
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise TypeError(f"the scheduler ({type(scheduler).__name__}) has no step() to call once per "
                        f"optimizer step.")
    try:
        signature = inspect.signature(step)
    except (TypeError, ValueError):
        return scheduler  # a builtin: nothing to read; it is called as it is
    required = [p.name for p in signature.parameters.values()
                if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        name = type(scheduler).__name__
        raise ValueError(
            f"{name}.step needs {', '.join(required)}, but autofit steps the scheduler once per optimizer "
            f"step without arguments. Pass scheduler=None and step it yourself in the stepper loop, "
            f"outside step(batch): `with autofit.stepper(model, optimizer) as step: ... out = step(batch); "
            f"... scheduler.step({required[0]})`.")
    return scheduler
