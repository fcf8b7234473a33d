"""One global step under a plan: micro-batches, weighting, autocast, scaler, checkpointing, offload.
The runner and the switch hooks it calls before each attempt read and set the
same runner state; each switch's own mechanism lives in its module - checkpointing, offload, fsdp.

The optimizer, scheduler and grad scaler step once per global batch, and only for a batch whose
every micro-batch succeeded. Micro-batch losses are weighted by their share of the global batch
(rows, or label tokens for token-level losses), so the accumulated gradient is the full batch's.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from autofit.plans import precision as precisions
from autofit.plans import switches
from autofit.plans.applies import not_applicable
from autofit.engine.atomic import AtomicStep
from autofit.engine.batches import split, weights
from autofit.engine.checkpointing import Checkpointing
from autofit.engine.kept import detached, loss_and_kept
from autofit.errors import NoLossError
from autofit.plans.sizelog import config_of
from autofit.engine.offload import Offload, to_device
from autofit.engine.per_parameter import ForeachOff
from autofit.engine.token_loss import weightless

if TYPE_CHECKING:
    from autofit.engine.interfaces import Device
    from autofit.plans.plan import Plan


def compute_loss(model, batch, loss_fn=None, items=None, keep=None) -> torch.Tensor:
    """The scalar loss of one (micro-)batch: `loss_fn(model, batch)`, else the model's own; `items`
    ({"num_items_in_batch": n} or empty, see token_loss) is passed on to either. A loss_fn's kept
    outputs (`(loss, kept)`, see engine/kept.py) go to `keep`, detached; without `keep` they are
    dropped."""
    items = items or {}
    if loss_fn is not None:
        loss, kept = loss_and_kept(loss_fn(model, batch, **items))
        if kept is not None and keep is not None:
            keep(detached(kept))
        where = "loss_fn"
    else:
        if isinstance(batch, Mapping):
            out = model(**batch, **items)
        elif isinstance(batch, (list, tuple)):
            out = model(*batch)
        else:
            out = model(batch)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
            loss = out
        where = f"{type(model).__name__}'s output"
        if loss is None:
            raise NoLossError(
                f"{where} ({type(out).__name__}) carries no loss; pass labels in the batch (Hugging "
                f"Face models), return a scalar loss from forward, or give "
                f"loss_fn=lambda model, batch: ...")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise NoLossError(f"{where} gave a loss of shape {shape}; it must be a scalar tensor, the "
                          f"mean over the batch.")
    return loss


def per_parameter_hook(runner: StepRunner, plan: Plan) -> None:
    """The per-parameter step's switch (plans/switches.py): the groups' `foreach` off. An offloaded
    step runs on the host, where it changes nothing: it is on only without offload."""
    if plan.per_parameter_step and not plan.offload_optimizer:
        runner.foreach_off.on()
    else:
        runner.foreach_off.off()


def offload_hook(runner: StepRunner, plan: Plan) -> None:
    """Optimizer offload's switch (plans/switches.py)."""
    runner.set_offload(plan.offload_optimizer)


@dataclass(frozen=True)
class Update:
    """What a global batch's optimizer step does besides stepping: clip before it, schedule after."""

    scheduler: object = None              # an LR scheduler, stepped once per optimizer step
    max_grad_norm: float | None = None    # the accumulated gradient clipped to this norm (None: not)


class StepRunner:
    """Executes global steps; owns the per-plan switches so a plan change is one call."""

    phase_steers_ladder = True  # the phase of a failure picks the first moves (see ladder.ByPhase)
    distributed = False  # one process: a move's error may be withdrawn, outside leaves are walked
    skip_empty = False  # skip a micro-batch whose share is 0 (no label token: its loss is 0/0)
    sharded = None  # distributed/fsdp.Sharded: a sharded model's FSDP2 switches, set by their hooks

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: Device, *,
                 update: Update = Update(), loss_fn: Callable | None = None, count_tokens: Callable | None = None,
                 weighting=None, sync: Callable | None = None):
        self.model, self.optimizer, self.device = model, optimizer, device
        # token_loss.LossWeighting: how micro losses add up (None: count_tokens' shares, else rows)
        self.weighting = weighting
        self.loss_fn, self.count_tokens = loss_fn, count_tokens
        self.scheduler, self.max_grad_norm = update.scheduler, update.max_grad_norm
        self.grad_norm: float | None = None  # the last step's gradient norm, before clipping
        # sync(i, last) -> context around micro-step i's forward and backward (DDP's no_sync).
        self.sync = sync or (lambda i, last: contextlib.nullcontext())
        self.checkpointing = Checkpointing(model)
        self.atomic = AtomicStep(optimizer, device)
        self.offloaded: Offload | None = None
        self._placed = False  # whether host state was checked once for a plan without offload
        self.scaler = None
        self._scaler_state = None
        self.peak = 0
        # Where the current attempt is (ladder.PHASES), set as each part of it starts and reset by
        # every attempt; read by the controller after an OOM (never parsed from the error's text).
        self.phase = ""
        self.foreach_off = ForeachOff(optimizer)  # the per-parameter step's switch
        self.kept: list = []  # the last attempt's kept outputs per micro-batch (engine/kept.py)

    # -- plan switches -------------------------------------------------------------------------
    def prepare(self, plan) -> None:
        """Every switch of `plan` set on the model and optimizer, each by its own hook
        (plans/switches.py `step`), and a grad scaler made for a precision that needs one."""
        for switch in switches.SWITCHES:
            switch.step_hook()(self, plan)
        if precisions.get(plan.precision).needs_scaler and self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device.type)

    def set_offload(self, on: bool) -> None:
        """Optimizer state offloaded for the coming steps, or back on the device."""
        if on and self.offloaded is None:
            self.offloaded = Offload(self.optimizer, self.device)
        elif not on and (self.offloaded is not None or not self._placed):
            if self.offloaded is not None:
                self.offloaded.close()
                self.offloaded = None
            to_device(self.optimizer, self.device)  # state left on the host by an earlier offload
        self._placed = True

    def not_applicable(self, plan) -> str | None:
        """Why `plan` cannot run for this model, optimizer and device (a move to skip), or None."""
        return not_applicable(plan, self.model, self.optimizer, self.device, self.checkpointing)

    def close(self) -> None:
        """Leave the model and optimizer as a plain loop would: own switches off. Offloaded state
        stays on the host, where the optimizer keeps it (offload.py)."""
        self.checkpointing.restore()
        self.atomic.close()
        if self.offloaded is not None:
            self.offloaded.close()
            self.offloaded = None
        self.foreach_off.off()

    def abandon(self) -> None:
        """Forget a failed attempt: gradients, kept outputs and scaler bookkeeping go back to before it."""
        self.optimizer.zero_grad(set_to_none=True)
        self.kept = []
        self.checkpointing.release()
        if self.scaler is not None and self._scaler_state is not None:
            scaler = torch.amp.GradScaler(self.device.type)
            scaler.load_state_dict(self._scaler_state)
            self.scaler = scaler

    # -- one global batch ----------------------------------------------------------------------
    def run(self, batch, plan: Plan, before_backward=None) -> float:
        """Train on one global batch under `plan`; returns its loss (the weighted mean).
        `before_backward(loss)`: called with each micro-batch's loss before its backward (the
        controller's start state keeps the entry gradients of the leaves it reaches)."""
        total = self._accumulate(batch, plan, before_backward)
        self._step(plan)
        return total.item()

    def _parts(self, batch, plan) -> list:
        """The micro-batches of `batch` under `plan`."""
        return split(batch, plan.micro_batch_size)

    def _shares(self, batch, parts) -> list[float]:
        if self.weighting is not None:
            return self.weighting.shares(batch, parts)
        return weights(batch, parts, self.count_tokens)

    def _items(self, batch) -> dict:
        """The keyword every micro-batch's loss gets: {} or {"num_items_in_batch": n}."""
        return self.weighting.items(batch) if self.weighting is not None else {}

    def _accumulate(self, batch, plan, before_backward=None) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the weighted loss (on the device)."""
        self.phase = "copy-in"  # a new attempt: nothing of the last one's phase is left
        self.prepare(plan)
        if self.scaler is not None:
            self._scaler_state = self.scaler.state_dict()
        self.device.reset_peak_memory_stats()
        self.peak = 0
        parts = self._parts(batch, plan)
        self.kept = []  # this attempt's kept outputs, one per micro-batch run (engine/kept.py)
        shares = self._shares(batch, parts)
        items = self._items(batch)
        total = None  # stays on the device: one synchronisation per global batch, not per micro-step
        autocast = precisions.get(plan.precision).mixed
        for i, (part, share) in enumerate(zip(parts, shares)):
            if share == 0:
                if self.skip_empty:
                    continue
                part = weightless(part)  # run, but with a finite loss: 0 * NaN would be NaN
            self.phase = "copy-in"
            part = self.device.to_device(part)
            # The forward is inside too: DDP decides in forward whether backward synchronises.
            with self.sync(i, i == len(parts) - 1):
                self.phase = "forward"
                with torch.autocast(self.device.type, dtype=precisions.get(plan.precision).autocast_dtype, enabled=autocast):
                    loss = compute_loss(self.model, part, self.loss_fn, items, keep=self.kept.append)
                scaled = loss * share
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                self.phase = "backward"
                if before_backward is not None:  # every micro-batch: each may reach other leaves
                    before_backward(scaled)
                scaled.backward()
            term = loss.detach().float() * share
            total = term if total is None else total + term
            del part, loss, scaled, term
        del parts
        return total if total is not None else torch.zeros(())

    def _phased(self, step):
        """`step` that sets the phase: "optimizer.step" around it (clipping included);
        "optimizer.state" from the moment the optimizer itself starts a step with state to create
        (its pre-hook) until that state is all made."""
        optimizer = self.optimizer

        def missing() -> bool:
            if self.offloaded is not None:
                return False
            params = list(itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))
            if all(map(optimizer.state.get, params)):
                return False  # every parameter has its state (a steady step): no Python loop over them
            return any(p.grad is not None and not optimizer.state.get(p) for p in params)

        def starting(*_):
            # The last pre-hook, right before the optimizer's own update: nothing written yet.
            if self.atomic.began is not None:  # (the atomic step watches: one process)
                self.atomic.began = True
            if missing():
                self.phase = "optimizer.state"

        def run():
            self.phase = "optimizer.step"
            hook = optimizer.register_step_pre_hook(starting)
            try:
                step()
            except BaseException:
                if self.phase == "optimizer.state" and not missing():
                    self.phase = "optimizer.step"  # the state was all made: the update failed
                raise
            finally:
                hook.remove()
        return run

    def attempt_peak(self) -> int:
        """The device peak of the current attempt (the step resets the counter to measure itself)."""
        return max(self.peak, self.device.max_memory_allocated())

    def _step(self, plan, guard: bool | None = None, wrap=None) -> None:
        """One optimizer step; `guard` overrides the atomic step's own choice (None: its own),
        `wrap(step) -> step` runs code around it inside the atomic step (the ranks' agreement)."""
        optimizer, offload = self.optimizer, self.offloaded
        self.grad_norm = None
        # Before the atomic step: nothing is applied yet, so an OOM here is the attempt's own
        # (the global batch is replayed; its gradients are made again).
        self._phased(lambda: self._prestep(optimizer))()

        def update():
            if self.scaler is not None:
                self.scaler.step(optimizer)
            else:
                optimizer.step()

        def step():
            if offload is None:
                update()
            else:  # the user's optimizer, stepped once, on the host (offload.py)
                offload.step(update)
        if wrap is not None:
            step = wrap(step)
        step = self._phased(step)
        key = config_of(plan)
        try:
            # An offloaded step is always guarded: its snapshot is host state only, and an
            # interrupt anywhere in it must leave no half-applied update.
            # Watched on one process (engine/atomic: where an unguarded step failed); ranks agree
            # on their steps' outcome instead.
            self.atomic.began = False if wrap is None else None
            self.atomic(step, key=key, guard=True if offload is not None else guard,
                        params=offload is None)
        finally:
            self.peak = max(self.atomic.outer_peak, self.device.max_memory_allocated())
        if offload is not None:
            offload.raise_interrupted()  # held while the update was written back: it is applied
        if self.scaler is not None:
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _prestep(self, optimizer) -> None:
        """What comes before the update and changes only the gradients, on the device: unscaling
        (the norm of the true gradient, not the scaled one; under offload here, where the scaler
        looks for infinities, before the gradients are staged to the host) and clipping."""
        if self.scaler is not None and (self.max_grad_norm is not None or self.offloaded is not None):
            self.scaler.unscale_(optimizer)
        if self.max_grad_norm is not None:
            self._clip(self.model.parameters())

    def _clip(self, params) -> None:
        """Clip the accumulated gradient of the whole global batch, as a plain loop would."""
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.grad_norm = norm.item()
