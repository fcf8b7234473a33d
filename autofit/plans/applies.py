"""Whether a plan applies to this job: moves are offers, and a plan this model, optimizer or device
cannot run is skipped with its reason instead of raising in the middle of a run.

`not_applicable(plan, ...)` names the first part of `plan` that cannot run here, or None:
- activation checkpointing on a model with no repeated blocks and no Hugging Face switch;
- a precision the device does not support (bf16 without bf16 support: Precision.supported_on);
- optimizer offload of an optimizer whose step needs a closure (see offload.py);
- a per-parameter step for an optimizer without a `foreach` option, a fused one, or one that
  already updates one parameter at a time;
- FSDP2's settings (reshard_after_forward, a reduce-scatter per micro-batch) on a model that is not
  sharded, and keeping gathered parameters when the user sharded with reshard_after_forward=True
  (autofit.distributed.fsdp.plan_problem).

`unavailable_changes(plan, applies)` applies the same rule to the changes a diagnosis may suggest
after a failure, so autofit.explain never offers a fix the ladder would skip.
"""

from __future__ import annotations

from autofit.distributed.fsdp import plan_problem as fsdp_problem
from autofit.engine.checkpointing import Checkpointing
from autofit.engine.offload import offload_problem
from autofit.plans import switches
from autofit.plans import precision as precisions


def not_applicable(plan, model, optimizer, device, checkpointing: Checkpointing | None = None) -> str | None:
    """Why `plan` cannot run for this model, optimizer and device, or None when it can: its
    precision, then each switch by its `applies` hook (plans/switches.py), in the registry's order
    (a hook two switches share, FSDP2's, is asked once)."""
    if not precisions.get(plan.precision).supported_on(device):
        return f"{plan.precision} is not supported on {device.describe()}"
    asked = set()
    for switch in switches.SWITCHES:
        if switch.applies is None or switch.applies in asked:
            continue
        asked.add(switch.applies)
        problem = switch.applies_hook()(plan, model, optimizer, device, checkpointing)
        if problem:
            return problem
    return None


def checkpointing_applies(plan, model, optimizer, device, checkpointing: Checkpointing | None) -> str | None:
    """Checkpointing's `applies` (plans/switches.py): the model has blocks or a Hugging Face switch."""
    if plan.checkpointing:
        checkpointing = checkpointing or Checkpointing(model)
        if not checkpointing.available and not checkpointing.initial:
            return (f"activation checkpointing does not apply to {type(model).__name__}: it has no "
                    f"repeated blocks (ModuleList/Sequential) and no Hugging Face switch")
    return None


def offload_applies(plan, model, optimizer, device, checkpointing) -> str | None:
    """Optimizer offload's `applies` (plans/switches.py): see engine/offload.offload_problem."""
    if plan.offload_optimizer:
        problem = offload_problem(optimizer)
        if problem:
            return f"optimizer offload does not apply: {problem}"
    return None


def per_parameter_applies(plan, model, optimizer, device, checkpointing) -> str | None:
    """The per-parameter step's `applies` (plans/switches.py); with offload the host step runs, so
    it is not asked."""
    if plan.per_parameter_step and not plan.offload_optimizer:
        problem = per_parameter_problem(optimizer, device)
        if problem:
            return f"a per-parameter optimizer step does not apply: {problem}"
    return None


def fsdp_applies(plan, model, optimizer, device, checkpointing) -> str | None:
    """FSDP2's two settings' `applies` (plans/switches.py): autofit.distributed.fsdp.plan_problem."""
    return fsdp_problem(plan, model)


def per_parameter_problem(optimizer, device) -> str | None:
    """Why switching the optimizer's groups to `foreach=False` would change nothing, or None."""
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    if not groups or any("foreach" not in g for g in groups):
        return f"{name} has no foreach option"
    if any(g.get("fused") for g in groups):
        return f"{name} is fused (one kernel per step, no foreach temporaries)"
    # torch picks foreach for foreach=None only on CUDA.
    if all(g["foreach"] is False or (g["foreach"] is None and device.type != "cuda") for g in groups):
        return f"{name} already updates one parameter at a time (foreach off)"
    return None


def unavailable_changes(plan, why_not) -> dict[str, str]:
    """{plan field: why turning it on cannot run for this job} for the changes a diagnosis may
    suggest after a failure under `plan`: mixed precision (none of the registry's applies),
    checkpointing, optimizer offload, a per-parameter step. `why_not` is `not_applicable` bound to
    the job (a plan -> reason or None); None, or a plan that does not apply itself: nothing known."""
    if why_not is None or why_not(plan) is not None:
        return {}
    changes = {"precision": [] if precisions.get(plan.precision).mixed else
               [plan.replace(precision=name) for name in precisions.mixed_names()]}
    for switch in switches.SWITCHES:  # each switch turned on as its move would (plans/switches.py)
        if switch.sharded_only and plan.reshard_after_forward is None:
            continue  # FSDP2's changes, for a plan of a sharded model only
        on = switch.turn_on(plan)
        changes[switch.name] = [] if on is None else [on]
    out = {}
    for name, plans in changes.items():
        reasons = [why_not(p) for p in plans]
        if reasons and all(reasons):
            out[name] = reasons[0]
    return out
