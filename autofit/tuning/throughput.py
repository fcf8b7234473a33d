"""What `autofit.tune` measures and how: the plans worth a trial, and one plan's throughput over a
few real steps, with the model left exactly as it was.

`search_space` lists the plans (`autofit.tune`'s docstring says why these). `measure` is one trial:
real global batches under one plan, run by the runner's own machinery (StepRunner for the step,
Controller for the attempt, its OOM detection and its release), so it measures what `autofit.run`
would do. The controller gets a ladder with no step: a plan that runs out of memory is not stepped
down but reported as "oom", after the controller has freed what the attempt held.

`Pristine` keeps host copies of everything a trial changes (parameters, buffers, gradients, the
optimizer's state and options, the train/eval flag; `tune.kept_rng` keeps the RNG) and writes them
back in place after each trial, so tuning leaves the user's model and optimizer bit-identical and
costs no device memory beyond what one trial needs (a copy of the model on the device would double
it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from autofit.plans import precision as precisions
from autofit.plans import switches
from autofit.engine.batches import rows_of, tokens_per_row
from autofit.engine.token_loss import token_counter
from autofit.estimator.capacity import Fit, Space, make_estimator, rank
from autofit.estimator.cost import micro_batch_sizes, plan_cost
from autofit.engine.controller import Controller, Policy
from autofit.errors import DoesNotFit
from autofit.gpu.oom import collect
from autofit.plans.ladder import Move
from autofit.plans.sizelog import SizeLog, config_of
from autofit.plans.plan import Plan
from autofit.estimator.start import TrainingStep, estimated_start, headroom, tensor_budget
from autofit.engine.step import StepRunner

HALVINGS = 2  # smaller micro-batches per configuration: about 1/2 and 1/4 of the largest that fits


@dataclass(frozen=True)
class Measurement:
    """What one trial of a plan gave. `samples_per_second` is None for an "oom" outcome."""

    plan: Plan
    outcome: str                        # "ok" | "oom"
    samples_per_second: float | None
    peak_bytes: int                     # the largest device peak of the trial's attempts
    samples: int = 0                    # rows of the timed global batches
    seconds: float = 0.0                # their time on `clock`
    error: str = ""                     # the OOM message, for outcome "oom"


class Stay(Move):
    """The ladder of a trial: no step down. An OOM ends the trial; tuning reports the plan as "oom"."""

    why = "tuning measures one plan as it is"

    def step(self, plan, global_batch=None):
        return None


def _host_copy(value):
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class Pristine:
    """Host copies of what a trial changes; `restore()` writes them back in place after each trial,
    `finish()` once at the end (it also gives back the gradients and the train/eval flag)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.training = model.training
        with torch.no_grad(), device.host():  # host memory: not counted on a simulated GPU
            self.tensors = [(t, t.detach().to("cpu", copy=True))
                            for t in list(model.parameters()) + list(model.buffers())]
            self.grads = [(p, p.grad.detach().to("cpu", copy=True))
                          for p in model.parameters() if p.grad is not None]
            state = optimizer.state_dict()
            self.optimizer_state = {"state": {k: {n: _host_copy(v) for n, v in s.items()}
                                              for k, s in state["state"].items()},
                                    "param_groups": copy.deepcopy(state["param_groups"])}
        self.groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                       for g in optimizer.param_groups]
        for p in model.parameters():
            p.grad = None  # a trial must not accumulate into the user's gradients
        self.baseline = device.memory_allocated()

    def restore(self) -> None:
        """Parameters, buffers, optimizer state and options as they were before tuning."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.model.parameters():
            p.grad = None
        self.optimizer.state.clear()  # frees the trial's state before anything is copied back
        with torch.no_grad():
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
        if self.optimizer_state["state"]:
            # A copy: load_state_dict keeps some tensors as given (AdamW's host `step`), and the
            # next trial would count on in the saved one.
            saved = self.optimizer_state
            self.optimizer.load_state_dict({"state": {k: {n: _host_copy(v) for n, v in s.items()}
                                                      for k, s in saved["state"].items()},
                                            "param_groups": copy.deepcopy(saved["param_groups"])})
        for group, saved in zip(self.optimizer.param_groups, self.groups):
            group.update(copy.deepcopy(saved))
        # Cycles that still hold device memory, collected no further than needed (gpu.oom.collect).
        collect(lambda: self.device.memory_allocated() <= self.baseline)
        self.device.empty_cache()

    def finish(self) -> None:
        self.restore()
        for p, saved in self.grads:
            p.grad = saved.to(p.device)
        self.model.train(self.training)


def measure(model, optimizer, device, plan: Plan, batches: list, *, warmup: int, loss_fn=None,
            clock) -> Measurement:
    """Train `batches` (host global batches) under `plan`; time all but the first `warmup` of them.

    `clock()` is read exactly twice when the trial completes: after the warm-up steps and after the
    last step (each step ends with the loss's `.item()`, which waits for the device). Samples per
    second are the rows of the timed batches over that interval. The caller restores the model.
    """
    model.train()
    runner = StepRunner(model, optimizer, device, loss_fn=loss_fn,
                        count_tokens=token_counter(model, device) if loss_fn is None else None)
    controller = Controller(runner, Stay(), plan, reason="tune: measure this plan",
                            policy=Policy(probe_up=False, quiet=True))
    start = end = None
    oom = False
    try:
        for step, batch in enumerate(batches):
            if step == warmup:
                start = clock()
            controller.train(batch, step)
        end = clock()
    except DoesNotFit:
        oom = True  # the controller has released what the attempt held
    finally:
        runner.close()
    attempts = controller.attempts
    del controller, runner
    peak = max([a.peak_bytes for a in attempts if a.outcome == "ok"], default=0)
    if oom:
        failed = attempts[-1]
        return Measurement(plan, "oom", None, max(peak, failed.peak_bytes), error=failed.error)
    samples = sum(rows_of(b) for b in batches[warmup:])
    seconds = end - start
    if not seconds > 0:
        raise ValueError(f"the clock gave {seconds!r} seconds for {len(batches) - warmup} step(s); "
                         f"pass a clock that advances, e.g. time.perf_counter.")
    return Measurement(plan, "ok", samples / seconds, peak, samples, seconds)


def search_space(model, batch, optimizer, loss_fn, device, precision, global_batch) -> tuple[Plan, list[Plan]]:
    """(default plan, the plans to measure in order): the plan `autofit.run` would start from
    (`estimated_start`), the fitting plans of the other precision when the policy is "auto", and
    for each configuration its largest fitting micro-batch with about 1/2 and 1/4 of it. The
    default comes first, then the others by `cost.plan_cost`, fastest first."""
    started = estimated_start(TrainingStep(model, batch, optimizer, loss_fn), device, precision, SizeLog())
    if started is None:  # nothing to check against, or the estimator cannot follow the model
        default = Plan.for_batch(global_batch, precision=precisions.start_precision(precision))
    else:
        default = started[0].with_micro_batch(started[0].micro_batch_size, global_batch)
    fitting = [default]
    if precision == precisions.AUTO and started is not None:
        allowed = precisions.allowed(precision, device.supports_bf16())
        room = headroom(device)
        for other in [p for p in allowed if p != default.precision]:
            estimator = make_estimator(model, batch, optimizer, loss_fn, workspaces=room["workspaces"],
                                       device_type="cuda" if device.type == "cuda" else "cpu")
            fitting += [c.plan for c in rank(estimator, batch, tensor_budget(device), fit=Fit(**room),
                                             space=Space(other, bf16_supported=device.supports_bf16()))
                        if c.fits]
    largest: dict[tuple, Plan] = {}  # per configuration (precision and switches), its largest fitting plan
    for plan in fitting:
        top = largest.get(config_of(plan))
        if top is None or plan.micro_batch_size > top.micro_batch_size:
            largest[config_of(plan)] = plan
    sizes = micro_batch_sizes(global_batch)
    space = [default]
    for top in largest.values():
        for divisor in [2 ** i for i in range(HALVINGS + 1)]:
            size = max(s for s in sizes if s <= max(min(top.micro_batch_size, global_batch) // divisor, 1))
            plan = top.with_micro_batch(size, global_batch)
            if plan not in space:
                space.append(plan)
    order = {p: i for i, p in enumerate(precisions.names())}
    tokens = tokens_per_row(batch)  # weighed as the capacity check weighs them
    rest = sorted(space[1:], key=lambda p: (plan_cost(p, global_batch, tokens), order[p.precision],
                                            *(bool(getattr(p, s.name)) for s in switches.SWITCHES),
                                            -p.micro_batch_size))
    return default, [default] + rest
