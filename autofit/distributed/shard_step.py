"""Whether an optimizer can step FSDP2's sharded parameters, found by trying before training.

Some torch optimizers cannot step DTensors (torch.optim.Adafactor raises on every rank at its first
step: its factored second moment needs a placement change in place). Rather than keep a list, every
rank steps a fresh optimizer of the same torch class and options on a tiny sharded parameter of the
model's own mesh and placements (one per number of dimensions the model's shards have), and the
ranks agree on the outcome before the first training step, so an optimizer that cannot step shards
is refused on every rank with its name and torch's reason, the model untouched.

The class tried is the nearest torch.optim class of the optimizer (a subclass's own `step`, which
may count or log, is not run); an optimizer that is not built on one is tried as it is.
"""

from __future__ import annotations

import logging

import torch

from autofit.distributed.fsdp import is_dtensor

log = logging.getLogger("autofit")


def _trial_class(optimizer) -> type:
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls is not torch.optim.Optimizer:
            return cls
    return type(optimizer)


def _name(cls) -> str:
    module = cls.__module__
    if module.startswith("torch.optim"):
        module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def _tiny_like(param, value: float):
    """A DTensor with the placements and mesh of `param`, two local elements per dimension."""
    from torch.distributed.tensor import DTensor
    mesh = param.device_mesh
    local = torch.full((2,) * param.ndim, value, dtype=param.dtype, device=mesh.device_type)
    return DTensor.from_local(local, mesh, param.placements, run_check=False)


def sharded_step_problem(optimizer, model) -> str | None:
    """Why `optimizer`'s class cannot step the shards of `model`, or None (also when it cannot be
    tried: a constructor that does not take its own defaults)."""
    samples = {}
    for p in model.parameters():
        if is_dtensor(p) and p.ndim > 0:
            samples.setdefault((p.ndim, p.dtype), p)
    if not samples:
        return None
    cls = _trial_class(optimizer)
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    with torch.random.fork_rng(devices=[]):
        for sample in samples.values():
            param = torch.nn.Parameter(_tiny_like(sample, 0.5))
            param.grad = _tiny_like(sample, 0.1)
            try:
                trial = cls([{"params": [param], **group}], **optimizer.defaults)
            except Exception as error:  # noqa: BLE001 - cannot be tried: training will tell
                log.info("could not try %s on a sharded parameter (%s: %s)", _name(cls),
                         type(error).__name__, error)
                return None
            try:
                trial.step()
            except Exception as error:  # noqa: BLE001 - its reason is the refusal's
                reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
                return (f"{_name(cls)} cannot step FSDP2's sharded parameters (DTensors): a step on a "
                        f"tiny sharded parameter ({sample.ndim}-D, {sample.placements}) raised "
                        f"{type(error).__name__}: {reason}. Choose an optimizer whose step works on "
                        f"DTensors (torch.optim.AdamW does), or train the model unsharded.")
    return None
