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

from autofit.plans import switches
from autofit.plans import precision as precisions


def not_applicable(plan, model, optimizer, device, checkpointing=None) -> str | None:
    """Why `plan` cannot run for this model, optimizer and device, or None when it can: its
    precision, then each switch by its `applies` hook (plans/switches.py; each hook lives with the
    switch's mechanism: engine/checkpointing, engine/offload, engine/per_parameter, distributed/fsdp),
    in the registry's order (a hook two switches share, FSDP2's, is asked once). `checkpointing`:
    the runner's engine.checkpointing.Checkpointing, when it has one."""
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
