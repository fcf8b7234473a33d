"""Fake-tensor estimator: the peak device memory of one training step under a plan, without a GPU.
Why this module is long: the meter, the fake device and the estimator are one mechanism and
change together.

The real step runs — `StepRunner` with the plan's micro-batches, autocast, checkpointing and offload,
the user's optimizer class and loss — on a copy of the model made of fake tensors
(`FakeTensorMode`): every op computes shapes, dtypes and strides, and no byte of data is allocated.
A counter (the simulated GPU's: live storages, 512-byte rounding, freed when their Python object
dies) sees every op and keeps the total by kind, so the breakdown at the moment of the peak costs
nothing extra. On CPU this reproduces the simulated GPU's measured peak of the same real step to the
byte (tests/test_estimate.py).

What is measured is a *second* step: before it, the optimizer takes one step on zero gradients, so
its state (AdamW: two moments per parameter) exists, as it does from the second step of a real run.
With accumulation, every micro-batch after the first holds what the first held plus all the
gradients and the running loss total, and they are alike; so one micro-batch is run on existing
gradients (and a carried total), which gives the peak of all of them at the cost of one.
`Estimator` makes the fake copies once and measures many plans (`autofit.estimator.capacity.rank`).

`device_type="cuda"` predicts a CUDA card rather than this CPU: `scaled_dot_product_attention` is
routed to the kernels CUDA runs (flash attention for fp16/bf16 without a mask, else memory-efficient
attention: O(T) memory, where CPU's math path — taken with attention dropout, as in training —
keeps the T x T attention matrix), autocast follows CUDA's op lists and dropout saves a bool mask
(`cuda_numerics.py`), and the optimizer uses the multi-tensor (`foreach`) implementation CUDA picks
by default. `device_type="cpu"` keeps CPU's choices, so an estimate can be
checked against the simulated GPU running the same step on real CPU tensors. In both, AdamW's scalar
`step` counters are host memory (CUDA keeps them on the CPU unless capturable or fused).

All fake tensors are on device `cpu` (fake `cuda` tensors abort the process in autograd on a CPU-only
build); the user's model, optimizer and batch are read, never changed, and their data is never
copied: parameters of a model on `meta`, `cpu` or `cuda` all work.

Where the step reads values that fake tensors lack (a mask's rows, `.item()`, a branch on `.any()`),
`autofit.estimator.data_dependent` gives hints; where fake tensors cannot follow the step at all (`.numpy()`,
a fake kernel stricter than the real one), `Estimator` measures it on real rows instead
(`autofit.estimator.sampled`, said once in the log) and its estimates have `method="sampled"`.

The meter is the simulated GPU's counter, so every storage of the step also takes a block from its
model of CUDA's caching allocator (`autofit.gpu.allocator`): besides the allocated peak
(`peak_bytes`), an estimate carries the peak the allocator *reserves* (`reserved_bytes`: segments,
cached free blocks, split remainders), which is what a card's memory limit caps.

A card's allocator that reaches its limit releases its cached segments and tries again before it
fails, so a step whose unbounded reserved peak is over the limit may still run under it. The walk
records every call of the allocator model (or, for repeated blocks, the tiled trace holds them), and
`capped(plan, limit)` / `measure(plan, limit=...)` replay that record through the model capped at
`limit` (`autofit.gpu.allocator.replay_capped`): the reserved peak the capped step reaches, or one over
the limit where it fails. The walk itself is never capped, so no part of the step (the optimizer's
update, offloaded state handed back) can fail in it: over the limit is an answer, not an error.

Known differences from a card, all small or covered by `rank`'s workspace reserve and calibration:
- the CUDA context and cuBLAS/cuDNN workspaces are not tensors and not counted; the allocator model
  replays this one step from a fresh cache, where a card's cache also holds what earlier steps left
  (`measure(plan, after=...)` replays the step before it: what `autofit.estimator.guide` asks
  where the budget caps reserved bytes);
- an attention mask is always built: Hugging Face skips an all-ones mask only when it can read
  the values, which fake tensors do not have (slightly high for unpadded batches);
- fp16 plans are measured as bf16 (same sizes) plus GradScaler's two scalars: the scaler's
  found-inf check needs real values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from dataclasses import dataclass, field

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autofit import torch_internals as ti
from autofit.engine.batches import rows_of, slice_batch
from autofit.estimator.cuda_numerics import numerics_as_on_cuda
from autofit.estimator.memoized import emptied_after, memoized_of
from autofit.estimator.meta_kernels import substitute
from autofit.estimator.eager_only import EagerOnly, eager_only
from autofit.estimator.data_dependent import Hints, silenced_torch_logs, upper_bound
from autofit.gpu.device import SimulatedDevice, _map_tensors
from autofit.estimator.fakes import (
    check_optimizer,
    fake_like,
    fake_model,
    fake_optimizer,
    on_device_state,
    warm,
)
from autofit.gpu.allocator import round_size, segment_size
from autofit.gpu.recorded import RecordingAllocator, replay_capped
from autofit.estimator.replayed import Walk, first_then
from autofit.gpu.memory import KINDS, storage_bytes
from autofit.sizes import format_breakdown
from autofit.gpu.workspaces import Workspaces
from autofit.plans import precision as precisions
from autofit.plans import switches
from autofit.plans.plan import Plan
from autofit.gpu.simulate import SimulatedGPU, _count, _CountingMode, _skipped_by_dynamo, inner_tensors, round_bytes
from autofit.engine.atomic import AtomicStep
from autofit.engine.step import StepRunner

log = logging.getLogger("autofit")

DEVICE_TYPES = ("cuda", "cpu")
SCALER_BYTES = 2 * 512  # GradScaler's scale and growth tracker, which an fp16 plan adds
@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak device memory of one training step under `plan`.

    `breakdown` is the memory by kind at the moment of the peak and sums to `peak_bytes`:
    params (and buffers), grads, optimizer (state), activations (what forward and backward keep
    and make), other (the micro-batch on the device, optimizer temporaries, the rest).
    """

    plan: Plan
    peak_bytes: int
    breakdown: dict = field(compare=False)
    device_type: str = "cuda"
    # What the model's training holds besides activations, whatever the batch and plan:
    # {"params" (and buffers), "grads", "optimizer" (state)}. An offloaded plan keeps the state on
    # the host (its breakdown shows 0), but it is listed here: it is what offload moved.
    resident: dict = field(default_factory=dict, compare=False)
    optimizer: str = "AdamW"  # the optimizer's class name, for messages
    # The peak while optimizer.step() ran on the device: parameters, gradients, state and the
    # update's temporaries, the same for every plan that does not offload (None when it did).
    step_bytes: int | None = field(default=None, compare=False)
    # "fake": a step on fake tensors; "sampled": measured on one and two real rows and
    # extrapolated, for a model fake tensors cannot follow (autofit.estimator.sampled).
    method: str = field(default="fake", compare=False)
    # The peak CUDA's caching allocator reserves for the step (allocated + cached + fragmentation),
    # replayed through autofit.gpu.allocator; None for an estimate made before it was known.
    reserved_bytes: int | None = field(default=None, compare=False)
    # CUDA's own bytes counted in the peaks (cuBLAS/cuBLASLt workspaces, autofit.gpu.workspaces):
    # 0 for an estimate of tensors only.
    workspace_bytes: int = field(default=0, compare=False)

    def peak(self, caps: str = "allocated") -> int:
        """The peak a budget capping `caps` ("allocated" or "reserved") is compared with."""
        if caps == "reserved" and self.reserved_bytes is not None:
            return self.reserved_bytes
        if caps not in ("allocated", "reserved"):
            raise ValueError(f"caps must be 'allocated' or 'reserved' but got {caps!r}.")
        return self.peak_bytes

    def describe(self, budget: int | None = None) -> str:
        """'1.23 GiB of a 2.00 GiB budget (params ..., grads ..., ...)'."""
        return format_breakdown(self.breakdown, budget)


# -- the counter, with a kind per storage ------------------------------------------------------

class _Meter(SimulatedGPU):
    """The simulated GPU's counter keeping running totals by kind and the breakdown at its peak.

    The peak kept here (`top`) is reset only by `start()`, not by the step's own
    `reset_peak_memory_stats()` calls, so it is the whole step's peak.
    """

    name = "estimator"

    def __init__(self, record: bool = True, whole_blocks: bool = False):
        super().__init__(None)
        self.whole_blocks = whole_blocks  # a card's accounting: blocks handed out whole count whole
        if record:  # every call of the allocator model, for replays under a cap
            self.allocator = RecordingAllocator()
        self.kind = "activations"        # the kind new storages get
        self._kinds: dict[int, str] = {}  # storage key -> kind
        self._sizes: dict[int, int] = {}  # storage key -> bytes counted for it
        self.totals = dict.fromkeys(KINDS, 0)
        self.top = 0
        self.top_breakdown = dict(self.totals)
        self.in_step = False   # inside optimizer.step()
        self.step_top = None   # the peak while it ran
        self.carried = None    # the earlier micro-batches' loss total, until the step
        self.outer_top, self.outer_breakdown = 0, dict(self.totals)  # the peak outside the step

    def tracked(self) -> None:
        """What was there before the step (parameters, state) is counted; the rest is allocated."""

    def laid(self) -> int:
        """How many allocator calls are recorded so far (0 without a record)."""
        return len(self.allocator.events) if isinstance(self.allocator, RecordingAllocator) else 0

    def finish(self) -> None:
        """The step's figures have been read: records stop here."""
        if isinstance(self.allocator, RecordingAllocator):
            self.allocator.recording = False

    def start(self) -> None:
        if isinstance(self.allocator, RecordingAllocator):
            self.allocator.begin()
        else:
            self.allocator.reset_peak()
        self.top = self.outer_top = self._allocated
        self.top_breakdown = dict(self.totals)
        self.outer_breakdown = dict(self.totals)

    def step_begins(self, *_) -> None:
        if isinstance(self.allocator, RecordingAllocator):
            self.allocator.mark_step()
        self.carried = None  # the step's own total has replaced it
        self.kind, self.in_step = "other", True  # the update's temporaries
        self.step_top = max(self.step_top or 0, self._allocated)

    def step_ends(self, *_) -> None:
        self.kind, self.in_step = "activations", False

    @contextlib.contextmanager
    def as_kind(self, kind: str):
        previous, self.kind = self.kind, kind
        try:
            yield
        finally:
            self.kind = previous

    def _storage_bytes(self, storage) -> int:
        return upper_bound(storage.nbytes())

    def _account(self, tensors, check: bool = True, inputs=()) -> None:
        tensors = [t for t in inner_tensors(tensors) if isinstance(t, torch.Tensor)]
        super()._account(tensors, check, inputs)
        self._tag([id(t.untyped_storage()) for t in tensors])

    def _resized(self, storage) -> None:
        super()._resized(storage)
        self._tag([id(storage)])

    def _tag(self, keys) -> None:
        """Give new storages the current kind, move resized ones' totals, and keep the peaks."""
        for key in keys:
            entry = self._live.get(key)
            if entry is None:
                continue
            kind = self._kinds.get(key)
            if kind is None:
                self._kinds[key] = kind = self.kind
                charged = self._charge(entry[1], entry[2])
                self.totals[kind] += charged
                self._sizes[key] = charged
            elif self._sizes[key] != self._charge(entry[1], entry[2]):  # resized in place
                charged = self._charge(entry[1], entry[2])
                self.totals[kind] += charged - self._sizes[key]
                self._sizes[key] = charged
        if self._allocated > self.top:
            self.top = self._allocated
            self.top_breakdown = dict(self.totals)
        if self.in_step and self._allocated > self.step_top:
            self.step_top = self._allocated
        elif not self.in_step and self._allocated > self.outer_top:
            self.outer_top, self.outer_breakdown = self._allocated, dict(self.totals)

    def _forget(self, key: int, nbytes: int) -> None:
        if key in self._live:
            kind = self._kinds.pop(key, None)
            size = self._sizes.pop(key, nbytes)
            if kind is not None:
                self.totals[kind] -= size
        super()._forget(key, nbytes)

    def retag(self, tensors, kind: str) -> None:
        """Count these tensors' storages as `kind` from now on (a gradient made in backward)."""
        for t in inner_tensors(tensors):
            if not isinstance(t, torch.Tensor):
                continue
            key = id(t.untyped_storage())
            old = self._kinds.get(key)
            if old is not None and old != kind and key in self._live:
                size = self._sizes[key]
                self.totals[old] -= size
                self.totals[kind] += size
                self._kinds[key] = kind


class _FakeDevice(SimulatedDevice):
    """The device StepRunner runs on during an estimate: the simulated GPU's, with the meter as its
    counter (no budget) and the batch copies counted as "other"."""

    def __init__(self, meter: _Meter):
        super().__init__(meter)
        self.name = "estimator"
        self._hosted = 0  # > 0 inside host()

    def to_device(self, batch):
        with self.gpu.as_kind("other"):
            return _map_tensors(batch, lambda t: t.clone())

    @contextlib.contextmanager
    def host(self):
        self._hosted += 1
        try:
            with self.gpu.untracked():
                yield
        finally:
            self._hosted -= 1

    def on_device(self, tensor):
        # Every tensor of the estimated step stands for device memory, the optimizer state too,
        # though it is counted only once the step begins (`_first_step`): the runner must never
        # take it for host state left by an offload and "bring it back" (a second copy). Where
        # host memory is made (`host()`: an offload taking the state to the host, staging the
        # parameters and gradients there for its update), none is: those copies are host memory
        # (counted nowhere), the device tensors they copy stay alive and counted through the
        # update, and in-place writes back allocate nothing, so moving them would change nothing
        # counted and cost a fake op per tensor.
        return not self._hosted


@contextlib.contextmanager
def _step_hooks(optimizer, device: _FakeDevice, before: list, after: list):
    """Call `before` and `after` (functions of no argument) around every step of the estimator's
    fake optimizer. A step called inside the device's `host()` (an offloaded plan's update, which runs
    on the host) is not run: all it would allocate is host memory, counted nowhere, and all it writes
    is values, which fake tensors do not hold; its fake ops are a third of an offloaded walk."""
    real = optimizer.step

    def step(*args, **kwargs):
        for hook in list(before):
            hook()
        try:
            return None if device._hosted else real(*args, **kwargs)
        finally:
            for hook in after:
                hook()
    optimizer.step = step  # the estimator's own copy, for this walk
    try:
        yield
    finally:
        del optimizer.step


def _device_query(func, args):
    """A fake tensor's `prim.device` (asked of every tensor the autograd engine touches; no tensor
    made) answered as the fake mode answers it, without its dispatch; None for any other op."""
    return ti.fake_device(args) if func is ti.PRIM_DEVICE else None


def _estimate_count(self, func, types, args=(), kwargs=None):
    """The counting mode's dispatch, device queries answered first (`_device_query`), and a
    call whose meta kernel is stricter than the real kernels made as the real kernel allocates
    (`meta_kernels.substitute`)."""
    device = _device_query(func, args)
    if device is not None:
        return device
    return _count(self, *as_run(func, types, args, kwargs))


def as_run(func, types, args, kwargs) -> tuple:
    """(func, types, args, kwargs) as the estimate runs the op: `meta_kernels.substitute`'s call
    where it has one, else the op itself."""
    swapped = substitute(func, args, kwargs)
    return (func, types, args, kwargs) if swapped is None else (swapped[0], types, *swapped[1:])


_SKIPPED = _skipped_by_dynamo(_estimate_count)


class _EstimateMode(_CountingMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not _SKIPPED

    __torch_dispatch__ = _estimate_count


class _Unguarded(AtomicStep):
    """The estimated step's optimizer step, never guarded by a host snapshot: the walk cannot run
    out of memory (its allocator model has no limit; caps are replayed afterwards), so there is
    nothing to roll back, and a snapshot is a fake copy of every state tensor counted nowhere."""

    def __call__(self, step_fn, key=None, guard: bool | None = None, params: bool = True) -> None:
        super().__call__(step_fn, key=key, guard=False, params=params)


# -- the estimate -------------------------------------------------------------------------------

class Walker:
    """Fake copies of a model, its optimizer (with state) and a batch, made once; `measure(plan)`
    runs one step per plan. `estimate()` is one plan; `autofit.estimator.capacity.rank` measures many."""

    sharding = None  # estimator/sharded.Sharding: how a sharded estimate's copy is sharded

    def __init__(self, model, batch, optimizer=None, loss_fn=None, *, device_type: str = "cuda",
                 derive_repeated: bool = True, workspaces: Workspaces | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module but got {type(model).__name__}.")
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type must be one of {', '.join(DEVICE_TYPES)} but got "
                             f"{device_type!r}.")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be a callable (model, batch) -> scalar loss but got "
                            f"{loss_fn!r}.")
        self.rows = rows_of(batch)  # raises on a batch that cannot be split
        self.device_type, self.loss_fn = device_type, loss_fn
        self.workspaces = workspaces  # the device's own bytes, added to every estimate (None: none)
        self.estimates = 0  # how many plans were measured
        # A shape environment so that values read from data (`loss.item()`, a mask's row count)
        # are symbols, and a branch on one takes its hint (`_Hints`) instead of failing.
        shape_env = ShapeEnv()
        shape_env.real_tensor_prop_unbacked_vals = Hints(shape_env)
        self.mode = ti.fake_tensor_mode_class()(shape_env=shape_env, static_shapes=True)
        check_optimizer(optimizer, model)  # a wrong argument is said as such, never sampled around
        self._source, self._sampled = (model, batch, optimizer), None
        if (why := eager_only(model)) is not None:  # fake tensors would estimate it low
            try:
                self._sample(EagerOnly(why))
                return
            except EagerOnly:  # no real rows to run (a model on meta): fake tensors, said
                log.info("estimator: %s; it cannot be measured on real rows, so its estimate may be low",
                         why)
        try:
            with self._quiet(), self.mode:
                self.model, fakes = fake_model(model)
                self.model.train()
                self.optimizer = fake_optimizer(optimizer, model, fakes, device_type)
                warm(self.optimizer)
                self.batch = _map_tensors(batch, fake_like)
        except Exception as error:
            self._sample(error)
            return
        self.optimizer_name = type(self.optimizer).__name__
        self.resident = self._resident()
        # Alike blocks walked through 3 of them (autofit.estimator.tiling): None until looked for.
        self._repeated = None if derive_repeated else False

    def forget_source(self) -> None:
        """Drop the caller's model, batch and optimizer, kept only to measure on real rows: an
        estimator kept through a run must hold no batch of the user's (nor run real steps); a plan
        fake tensors cannot follow then raises its error."""
        self._source = None

    def _sample(self, error: Exception) -> None:
        """Fake tensors cannot follow this model: the walk's error, as it is (autofit.estimator.
        estimate's Estimator measures on real rows instead)."""
        raise error

    def _memoized(self) -> list:
        """The memoized functions of the model's code (estimator/memoized), found once."""
        if getattr(self, "_memoized_functions", None) is None:
            self._memoized_functions = memoized_of(self.model)
        return self._memoized_functions

    def _quiet(self):
        """No mode of the caller's (a simulated GPU, say) sees the fake tensors; autograd is on;
        tensors made without a device are CPU tensors, whatever default device the caller set."""
        stack = contextlib.ExitStack()
        stack.enter_context(ti.disable_current_modes())
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        if torch.get_default_device().type != "cpu":
            # Only where needed: a device context is a torch-function mode, which every torch call
            # of the walk then goes through (tensors made without a device are CPU's anyway).
            stack.enter_context(torch.device("cpu"))
        stack.enter_context(silenced_torch_logs())
        return stack

    def _state(self) -> list[torch.Tensor]:
        return on_device_state(self.optimizer)

    def _resident(self) -> dict:
        """Bytes that every plan keeps on the device at its optimizer step, whatever the batch."""
        params = list(self.model.parameters()) + list(self.model.buffers())
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return {"params": storage_bytes(params),
                "grads": sum(round_bytes(p.numel() * p.element_size()) for p in _unique(trainable)),
                "optimizer": storage_bytes(self._state())}

    def measured_plan(self, plan: Plan) -> Plan:
        """`plan` as this estimate runs it: each switch with an `estimate` hook (plans/switches.py)
        set to the value the hook gives; the others are the plan's, applied by the step's hooks."""
        return plan.replace(**{s.name: hook(self, plan) for s in switches.SWITCHES
                               if (hook := s.estimate_hook()) is not None})

    def measure(self, plan: Plan, after: Plan | None = None, limit: int | None = None) -> MemoryEstimate:
        """The estimate of `plan`'s step. With `after` (the plan of the step before it), that step
        is replayed first through the allocator model, making the optimizer state as a run's first
        step makes it, and the reserved peak is that of `plan`'s step on the cache it left
        (`after=plan`: a run that starts with `plan`); without it, from a fresh cache. With `limit`,
        the reserved peak is that of the allocator model capped at that many bytes, releasing its
        cached segments when it reaches the cap as a capped card's allocator does (`capped`)."""
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be an autofit.Plan but got {type(plan).__name__}.")
        estimate = self._bare(plan, after)
        return with_workspaces(estimate if limit is None else self._capped(estimate, limit - self._own_reserved()),
                               self._own())

    def _own(self) -> Workspaces | None:
        return getattr(self, "workspaces", None)

    def _own_reserved(self) -> int:
        return own_reserved(self._own())

    def _bare(self, plan: Plan, after: Plan | None = None) -> MemoryEstimate:
        """`measure` of the step's tensors only, uncapped (the device's own bytes not added). A plan
        asked again from a fresh cache is answered from its first walk (the fake copies never
        change): the capacity check's whole-batch plans, its search and the guide ask of the same
        plans."""
        self._recorded = None
        answered = getattr(self, "_answered", None)
        if after is None and answered is not None and plan in answered and self._sampled is None:
            estimate, self._recorded = answered[plan]
            self.estimates += 1
            return estimate
        if self._sampled is None:
            cached = len(ti.fake_tensor_mode_class().cache) if self._forgets_dispatch() else None
            try:
                # A fake tensor cached by the model's memoized code would outlive the walk.
                with self._quiet(), emptied_after(self._memoized()):
                    estimate = self._derived(plan) if after is None else self._replayed(plan, after)
                    if estimate is None:
                        estimate = self._measure(plan, after)
            except Exception as error:
                self._sample(error)
            finally:
                if cached is not None:
                    _forget_cached_dispatch(cached)
        if self._sampled is not None:
            estimate = self._sampled.measure(plan)
        elif after is None:
            if answered is None:
                answered = self._answered = {}
            answered[plan] = (estimate, self._recorded)
        self.estimates += 1
        return estimate

    _sharing = 0  # inside sharing_dispatch_cache()

    def _forgets_dispatch(self) -> bool:
        """Whether a measure drops what it added to FakeTensorMode's dispatch cache when it ends."""
        return not self._sharing

    @contextlib.contextmanager
    def sharing_dispatch_cache(self):
        """The measures made inside keep what they add to FakeTensorMode's dispatch cache, and
        it is dropped when the block ends: plans measured together share most of their ops'
        shapes (the parameters', a micro-batch's), and a hit costs a fraction of a miss (torch's
        meta kernels, in Python). The estimates are the same: the cache only saves recomputing."""
        cached = len(ti.fake_tensor_mode_class().cache) if not self._sharing else None
        self._sharing += 1
        try:
            yield self
        finally:
            self._sharing -= 1
            if cached is not None:
                _forget_cached_dispatch(cached)

    def capped(self, plan: Plan, limit: int) -> MemoryEstimate:
        """`plan`'s estimate (from a fresh cache) with the reserved peak of the allocator model capped
        at `limit` bytes: the step's record of allocations replayed under the cap (the last
        `measure(plan)`'s, else `plan` is measured first). Over `limit` when the capped replay fails;
        an estimate measured on real rows (`method="sampled"`) has no record and stays as it is."""
        recorded = getattr(self, "_recorded", None)
        if recorded is None or recorded[0] != plan:
            estimate = self._bare(plan)
        else:
            estimate = recorded[1]
        return with_workspaces(self._capped(estimate, limit - self._own_reserved()), self._own())

    def _capped(self, estimate: MemoryEstimate, limit: int) -> MemoryEstimate:
        reserved, allocated = estimate.reserved_bytes, estimate.peak_bytes
        recorded = getattr(self, "_recorded", None)
        if reserved is None or reserved <= limit or allocated > limit or recorded is None \
                or recorded[1] is not estimate:
            # Under the cap unbounded: the capped allocator never reaches it, the same replay. Live
            # bytes over it: no cache to release helps.
            return estimate
        _, _, replay, extra = recorded
        capped, _ = replay(limit)
        return dataclasses.replace(estimate, reserved_bytes=capped + extra)

    def _record(self, plan: Plan, estimate: MemoryEstimate, replay, extra: int) -> None:
        """Keep how to replay `estimate`'s allocations under a cap: `replay(limit) -> (reserved
        peak, fitted)`, to which an estimate adds `extra` (GradScaler's scalars)."""
        self._recorded = (plan, estimate, replay, extra)

    def _derived(self, plan: Plan) -> MemoryEstimate | None:
        """`plan`'s estimate derived without walking the whole model, or None: walk it (autofit.
        estimator.estimate's Estimator derives models of alike blocks from 3 of them)."""
        return None

    def _replayed(self, plan: Plan, after: Plan) -> MemoryEstimate | None:
        """`plan`'s step after a step of `after`, from one walk of each plan's whole step (kept for
        the estimator's life: the guide asks of the same plans again) laid out as a run makes them
        (autofit.estimator.replayed); None where they cannot be (then both steps are walked). The
        reserved peak is the two-step walk's; the allocated figures are those of `plan`'s step with
        its state resident, which a step after the first has."""
        then, first = self._walk(plan), self._walk(after)
        events = None if then is None or first is None else first_then(first, then)
        if events is None:
            return None
        extra = scaler_bytes(plan)
        estimate = dataclasses.replace(then.estimate, reserved_bytes=replay_capped(events, None)[0] + extra)
        self._record((plan, after), estimate, lambda limit: replay_capped(events, limit), extra)
        return estimate

    def _walk(self, plan: Plan) -> Walk | None:
        """The walk of `plan`'s whole global step with its state laid out first (made once), or
        None where the meter keeps no record of its allocator's calls."""
        if getattr(self, "_walks", None) is None:
            self._walks = {}
        if plan not in self._walks:
            estimate = self._measure(plan, whole=True)
            meter = self.last_meter
            self._walks[plan] = Walk(estimate, meter.allocator.events, *meter.laid_out) \
                if isinstance(meter.allocator, RecordingAllocator) else None
        return self._walks[plan]

    def _new_meter(self) -> "_Meter":
        return _Meter(whole_blocks=self._own() is not None)

    def _counting_mode(self, meter) -> _CountingMode:
        return _EstimateMode(meter)

    def _first_step(self, meter, device, plan: Plan, state) -> None:
        """Replay a run's first step under `plan` through `meter`'s allocator: the optimizer state
        takes its blocks when the step begins, after the backward pass freed the activations, as
        the optimizer's lazy initialisation does."""
        made = []

        def make_state():
            if not made:
                made.append(True)
                with meter.as_kind("optimizer"):
                    meter.track(state)
        self._before_step.append(make_state)
        numerics = precisions.get(plan.precision)
        runner = self._runner(device)
        try:
            runner.run(self.batch, plan.replace(precision=numerics.measured_as) if numerics.measured_as else plan)
        finally:
            self._before_step.remove(make_state)
            runner.close()
            self.optimizer.zero_grad(set_to_none=True)
        if not made:  # a plan whose step never ran the optimizer: the state is made now
            make_state()

    def _device(self, meter):
        return _FakeDevice(meter)

    def _measured(self, plan: Plan):
        """The rows a plan is measured on, and whether they stand for a later micro-batch (run on
        gradients made beforehand)."""
        if self.rows > plan.micro_batch_size:
            return slice_batch(self.batch, 0, plan.micro_batch_size), True
        return self.batch, False

    def _runner(self, device) -> StepRunner:
        runner = StepRunner(self.model, self.optimizer, device, loss_fn=self.loss_fn)
        runner.atomic = _Unguarded(self.optimizer, device)
        return runner

    def _measure(self, plan: Plan, after: Plan | None = None, whole: bool = False) -> MemoryEstimate:
        """The walk of `plan`'s step (`measure`'s); `whole`: of every micro-batch of the global
        batch, where a walk without `after` runs one micro-batch on gradients made beforehand."""
        meter = self._new_meter()
        device = self._device(meter)
        # With accumulation, every micro-batch after the first holds what the first held plus all
        # the gradients (and the loss total so far), and they are alike: one full micro-batch run
        # on existing gradients measures the peak of them all.
        batch, accumulates = self._measured(plan) if after is None and not whole else (self.batch, False)
        # Offload's own reading (not the registry's): the offloaded step keeps its state on the host.
        state = [] if plan.offload_optimizer else self._state()
        hooks = [p.register_post_accumulate_grad_hook(lambda p: meter.retag([p.grad], "grads"))
                 for p in _unique(self.model.parameters()) if p.requires_grad]
        self._before_step = [meter.step_begins]
        attention = (numerics_as_on_cuda(self.mode) if self.device_type == "cuda"
                     else contextlib.nullcontext())
        try:
            with self.mode, attention, self._counting_mode(meter), \
                    _step_hooks(self.optimizer, device, self._before_step, [meter.step_ends]):
                self._lay_out(meter, device, state, after)
                if accumulates:
                    self._accumulated(meter)
                estimate = self._run(meter, device, plan, batch)
        finally:
            for h in hooks:
                h.remove()
            self.optimizer.zero_grad(set_to_none=True)
        estimate = _with_scaler(estimate)
        if isinstance(meter.allocator, RecordingAllocator):
            events = meter.allocator.events
            self._record(plan if after is None else (plan, after), estimate,
                         lambda limit: replay_capped(events, limit), scaler_bytes(plan))
        return estimate

    def _lay_out(self, meter, device, state, after: Plan | None) -> None:
        """What the step finds on the device, through `meter`: the parameters (and buffers), then
        the optimizer `state`, made by a first step of `after` where given (`meter.laid_out`: the
        blocks laid out before and after the state)."""
        params = list(self.model.parameters()) + list(self.model.buffers())
        with meter.as_kind("params"):
            meter.track(params)
        laid = meter.laid()
        if after is None:
            with meter.as_kind("optimizer"):
                meter.track(state)
        else:
            self._first_step(meter, device, after, state)
        meter.laid_out = (laid, meter.laid())
        meter.tracked()

    def _accumulated(self, meter) -> None:
        """What a micro-batch after the first finds: every gradient, and the loss total so far."""
        with meter.as_kind("grads"), torch.no_grad():
            for p in _unique(self.model.parameters()):
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        with meter.as_kind("other"):
            meter.carried = torch.zeros((), device="cpu")  # the loss total so far

    def _run(self, meter, device, plan: Plan, batch) -> MemoryEstimate:
        """`plan`'s step on `batch` through `meter`: its peaks, without GradScaler's scalars."""
        numerics = precisions.get(plan.precision)  # fp16 runs as bf16: see Precision.measured_as
        run_plan = plan.replace(precision=numerics.measured_as) if numerics.measured_as else plan
        runner = self._runner(device)
        meter.start()
        try:
            runner.run(batch, run_plan)
            # Read before close(): bringing offloaded state back is the end of a run.
            estimate = MemoryEstimate(plan=plan, peak_bytes=meter.top, breakdown=dict(meter.top_breakdown),
                                      device_type=self.device_type, resident=dict(self.resident),
                                      step_bytes=meter.step_top,
                                      reserved_bytes=meter.allocator.max_reserved,
                                      optimizer=self.optimizer_name)
            meter.finish()
            self.last_meter = meter  # what autofit.estimator.sampled extrapolates
        finally:
            runner.close()
        return estimate


def scaler_bytes(plan: Plan) -> int:
    """The bytes GradScaler's scalars add to `plan`'s step (SCALER_BYTES where it has one)."""
    return SCALER_BYTES if precisions.get(plan.precision).needs_scaler else 0


def _with_scaler(estimate: MemoryEstimate) -> MemoryEstimate:
    """`estimate` with GradScaler's scalars where its plan has one: two small-pool blocks; at most
    one more 2 MiB segment."""
    extra = scaler_bytes(estimate.plan)
    breakdown = dict(estimate.breakdown, other=estimate.breakdown["other"] + extra)
    return dataclasses.replace(estimate, peak_bytes=estimate.peak_bytes + extra, breakdown=breakdown,
                               reserved_bytes=estimate.reserved_bytes + extra)


def own_reserved(workspaces: Workspaces | None) -> int:
    """The reserved bytes `workspaces` take: each workspace's segment (an upper bound where a
    remainder of it is shared with tensors' blocks)."""
    if workspaces is None:
        return 0
    sizes = [workspaces.cublas] * 2 + [workspaces.cublaslt]
    return sum(segment_size(round_size(n)) for n in sizes if n)


def with_workspaces(estimate: MemoryEstimate, workspaces: Workspaces | None) -> MemoryEstimate:
    """`estimate` with a card's own bytes added: in a steady-state step both kernel threads'
    workspaces are allocated throughout, so they add to every peak and count as "other"."""
    if workspaces is None or not workspaces.resident:
        return estimate
    own = workspaces.resident
    breakdown = dict(estimate.breakdown)
    breakdown["other"] = breakdown.get("other", 0) + own
    reserved = None if estimate.reserved_bytes is None else estimate.reserved_bytes + own_reserved(workspaces)
    step = None if estimate.step_bytes is None else estimate.step_bytes + own
    return dataclasses.replace(estimate, peak_bytes=estimate.peak_bytes + own, breakdown=breakdown,
                               reserved_bytes=reserved, step_bytes=step,
                               workspace_bytes=estimate.workspace_bytes + own)


def _forget_cached_dispatch(keep: int) -> None:
    """Drop what a measure (or a search's measures: `Estimator.sharing_dispatch_cache`) added to
    FakeTensorMode's dispatch cache (shared by every fake mode, never trimmed by torch): one
    estimator measuring plans through a run would otherwise grow host memory with every plan. Its
    keys are ops and their tensors' metadata: a later walk of the same shapes hits them (a plan's
    walk of 4 blocks after its walk of 3 is all hits), a micro-batch of another size mostly not."""
    cache = ti.fake_tensor_mode_class().cache
    for key in list(itertools.islice(cache, keep, None)):
        cache.pop(key, None)


def _unique(tensors):
    seen = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            yield t
