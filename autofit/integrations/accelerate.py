"""What `accelerator.prepare` returns, made usable by autofit's stepper and `autofit.run`.

    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    with autofit.stepper(model, optimizer, scheduler=lr_scheduler) as step:   # passed as they are
        for batch in loader:
            step(batch)

The one module that knows accelerate's attribute names. `accelerate` is optional and never
imported here: an object can only be Accelerate's wrapper when accelerate's module is loaded, so
the check reads `sys.modules` and costs nothing to a user without it.

Decisions, with their reasons:
- The wrappers are removed, not stepped. `AcceleratedOptimizer.step`/`zero_grad` and
  `AcceleratedScheduler.step` skip their work when Accelerate's global gradient state says
  "accumulating"; autofit does its own accumulation, so it steps what they wrap
  (`.optimizer`, `.scheduler`), which is what they step when nothing is skipped.
- What the wrappers do that autofit would silently drop is refused with the fix: mixed precision
  (autocast on the prepared model's forward, the fp16 loss scaling of `accelerator.backward`) and
  Accelerate's gradient accumulation belong to autofit's plan; an `AcceleratedScheduler` that steps
  its scheduler once per process per optimizer step (several processes, `split_batches=False`)
  would run at another pace under autofit, which steps a scheduler once per global batch.
"""

from __future__ import annotations

import sys

# The setups whose prepared optimizer is the user's optimizer and whose model autofit can train:
# one process, or DDP over several. DeepSpeed, FSDP, XLA and Megatron step through engines of their own.
SUPPORTED_SETUPS = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                    "MULTI_XPU", "MULTI_HPU")


def _accelerate_class(module: str, name: str):
    """accelerate's class `name` when accelerate has been imported, else None."""
    return getattr(sys.modules.get(f"accelerate.{module}"), name, None)


def is_prepared_optimizer(obj) -> bool:
    cls = _accelerate_class("optimizer", "AcceleratedOptimizer")
    return cls is not None and isinstance(obj, cls)


def is_prepared_scheduler(obj) -> bool:
    cls = _accelerate_class("scheduler", "AcceleratedScheduler")
    return cls is not None and isinstance(obj, cls)


def unwrap(optimizer, scheduler):
    """(optimizer, scheduler) with Accelerate's wrappers removed; anything else is returned as given
    (and checked later, as any optimizer and scheduler are)."""
    if is_prepared_optimizer(optimizer):
        optimizer = _unwrap_optimizer(optimizer)
    if is_prepared_scheduler(scheduler):
        scheduler = _unwrap_scheduler(scheduler, optimizer)
    elif is_prepared_optimizer(getattr(scheduler, "optimizer", None)):
        raise ValueError(
            f"the scheduler ({type(scheduler).__name__}) is built on Accelerate's prepared optimizer "
            f"(AcceleratedOptimizer), whose step autofit does not call; build the scheduler on your "
            f"optimizer before accelerator.prepare (as Accelerate's examples do) and pass the optimizer "
            f"and scheduler that prepare returns.")
    return optimizer, scheduler


def _unwrap_optimizer(prepared):
    state = prepared.accelerator_state
    setup = getattr(state.distributed_type, "value", str(state.distributed_type))
    if setup not in SUPPORTED_SETUPS:
        raise ValueError(
            f"the optimizer was prepared by an Accelerator using {setup}, which steps it through its own "
            f"engine; autofit.stepper trains Accelerate's single-process and DDP setups (distributed_type "
            f"NO or MULTI_*). Launch without the {setup} plugin, or train this job with Accelerate alone.")
    mixed = state.mixed_precision
    if mixed != "no":
        raise ValueError(
            f"the optimizer was prepared by Accelerator(mixed_precision={mixed!r}), which wraps the model's "
            f"forward in autocast{' and scales the loss in accelerator.backward' if mixed == 'fp16' else ''}; "
            f"step(batch) runs the plan's precision instead. Create the Accelerator with "
            f"mixed_precision='no' and pass precision={mixed!r} (or 'auto') to autofit.stepper.")
    steps = prepared.gradient_state.num_steps
    if steps > 1:
        raise ValueError(
            f"the optimizer was prepared by Accelerator(gradient_accumulation_steps={steps}); autofit "
            f"chooses the accumulation itself and each step(batch) is one whole global batch. Create the "
            f"Accelerator without gradient_accumulation_steps, drop `with accelerator.accumulate(model)`, "
            f"and give step(batch) batches {steps} times the loader's batch size (the global batch).")
    return prepared.optimizer


def _unwrap_scheduler(prepared, optimizer):
    inner = prepared.scheduler
    if prepared.step_with_optimizer and not prepared.split_batches:
        processes = _accelerator_state().num_processes
        if processes > 1:
            raise ValueError(
                f"the AcceleratedScheduler steps its {type(inner).__name__} {processes} times per optimizer "
                f"step ({processes} processes, split_batches=False); autofit steps a scheduler once per "
                f"global batch. Pass scheduler=lr_scheduler.scheduler built with num_training_steps and "
                f"num_warmup_steps counted in global batches (divided by {processes}), or create the "
                f"Accelerator with dataloader_config=DataLoaderConfiguration(split_batches=True).")
    if getattr(inner, "optimizer", None) is not optimizer:
        given = ("None (AdamW)" if optimizer is None else type(optimizer).__name__ if hasattr(optimizer, "step")
                 else "a factory")
        raise ValueError(
            f"the AcceleratedScheduler wraps a {type(inner).__name__} built on another optimizer than the "
            f"one training steps ({given}); pass the optimizer and the scheduler that the same "
            f"accelerator.prepare(...) returned.")
    return inner


def _accelerator_state():
    from accelerate.state import AcceleratorState  # loaded already: a prepared scheduler exists
    return AcceleratorState()


# -- accelerate's private names (every one autofit uses) ---------------------------------------
# Besides PRIVATE, two marks `accelerator.prepare` leaves on a model are read where present (a
# model not prepared has neither, so they cannot be checked ahead): `_original_forward` (the forward
# under its autocast wrapper) and `_is_accelerate_prepared`.
# Read when the Trainer callback changes the Trainer's Accelerator (a new precision, an attempt
# dropped), never at import: accelerate is optional. Written against accelerate 1.16.
PRIVATE = {
    "AcceleratorState._reset_state": "a new Accelerator after the precision changes",
    "Accelerator._models": "dropping what a failed attempt prepared",
    "Accelerator._optimizers": "dropping what a failed attempt prepared",
    "Accelerator._schedulers": "dropping what a failed attempt prepared",
    "Accelerator._dataloaders": "dropping what a failed attempt prepared",
}


def private_missing(accelerator=None) -> list[str]:
    """What this accelerate lacks of PRIVATE; [] when all are there. `accelerator`: an instance,
    for the lists its __init__ makes (skipped without one)."""
    from accelerate.state import AcceleratorState
    out = [] if hasattr(AcceleratorState, "_reset_state") else ["AcceleratorState._reset_state"]
    if accelerator is not None:
        out += [n for n in PRIVATE if n.startswith("Accelerator.")
                and not hasattr(accelerator, n.split(".", 1)[1])]
    return out


def _require_private(name: str, accelerator=None) -> None:
    lacking = [n for n in private_missing(accelerator) if n == name]
    if lacking:
        import accelerate
        raise RuntimeError(f"autofit's Trainer callback uses {name} of accelerate 1.16 for "
                           f"{PRIVATE[name]}, and this accelerate {accelerate.__version__} lacks "
                           f"it: install accelerate 1.16")


def reset_state() -> None:
    """Forget Accelerate's process-wide state, so the next Accelerator is built with the new mixed
    precision (what Trainer._hp_search_setup does before it makes a new one)."""
    _require_private("AcceleratorState._reset_state")
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state()


def forget_prepared(accelerator) -> None:
    """What Accelerator.free_memory() does outside DeepSpeed, without its full gc.collect(): its
    lists of prepared models, optimizers, schedulers and loaders emptied."""
    for name in ("_models", "_optimizers", "_schedulers", "_dataloaders"):
        _require_private(f"Accelerator.{name}", accelerator)
        setattr(accelerator, name, [])


def unwrap_autocast(model) -> None:
    """Undo Accelerate's autocast wrapper of `model.forward` (prepare keeps the original beside it,
    as `_original_forward`), so the new plan's precision owns autocast."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    if getattr(original, "__func__", None) is type(model).forward and getattr(original, "__self__", None) is model:
        model.__dict__.pop("forward", None)  # the class's own forward again
    else:
        model.forward = original


def forget_prepared_mark(model) -> None:
    """Drop the mark `accelerator.prepare` leaves on a model, so a new Accelerator prepares it."""
    model.__dict__.pop("_is_accelerate_prepared", None)
