"""One rank's peak under FSDP2: a model sharded with `torch.distributed.fsdp.fully_shard` over W ranks.
The fake process group, the unsharded fake copy and FSDP2's hooks on it are set up
and torn down together; this docstring states what is counted and why.

The estimator's mechanism (fake tensors, the simulated GPU's counter, the real `StepRunner`) run
with FSDP2's own code: the fake copy of the model is sharded by `fully_shard` over a process group
of torch's "fake" backend with W ranks (its collectives move no data; the buffers FSDP2 allocates
for them are allocated all the same), and one step runs on it as rank 0. So what FSDP2 does to a
rank's memory is counted as it does it, not modelled beside it:
- parameters, gradients and optimizer state sharded 1/W, each parameter's shard padded on dim 0
  to ceil(rows / W) rows, as FSDP2 pads it;
- the all-gather buffer and the unsharded parameters of each unit while it runs, the next unit's
  prefetched in backward, and with `reshard_after_forward=False` every unit's kept from forward to
  backward (the root's always are: FSDP2 never reshards the root after forward);
- the unsharded gradients of a unit and its reduce-scatter buffers, then the sharded gradient;
- with a MixedPrecisionPolicy the gathered parameters in `param_dtype`, the fp32 shards beside;
- the activations of this rank's micro-batch.
Every rank holds the same: FSDP2 pads every shard to the same size, so rank 0 speaks for all.

The ladder moves FSDP has, and what prices each one here (`FSDP_MOVES`):
micro-batch (Plan.micro_batch_size), precision through MixedPrecisionPolicy
(`Sharding.param_dtype`), checkpointing per block (Plan.checkpointing), `reshard_after_forward`
(`Sharding.reshard_after_forward`, or the plan's own `Plan.reshard_after_forward` when set), and
how micro-batches accumulate (`Sharding.reduce_each_micro_batch` or the plan's
`Plan.reduce_each_micro_batch`: gradient sync off until the last, or a reduce-scatter each).
Not priced: CPUOffloadPolicy (on a CPU-only build its "device" and host are one memory, so the
shards it moves away cannot be told apart here).

The fake world is made by swapping torch.distributed's module-level world for a new one while an
estimate runs, so a job that has its own process group (the capacity check under torchrun) keeps
it untouched: nothing of it is used or changed, and no collective reaches it.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autofit import torch_internals as ti
from autofit.distributed import internals
from autofit.engine.batches import rows_of, slice_batch
from autofit.engine.step import StepRunner
from autofit.estimator.data_dependent import Hints
from autofit.estimator.walk import MemoryEstimate, Walker
from autofit.estimator.fakes import check_optimizer, fake_like, fake_model, fake_optimizer, warm
from autofit.gpu.device import _map_tensors
from autofit.gpu.memory import storage_bytes
from autofit.plans.plan import Plan
from autofit.plans import precision as precisions
from autofit.plans.precision import get as get_precision

# What a sharded plan can change, and which field prices it.
FSDP_MOVES = {
    "micro-batch": "Plan.micro_batch_size",
    "precision (MixedPrecisionPolicy)": "Sharding.param_dtype",
    "checkpointing per block": "Plan.checkpointing",
    "reshard_after_forward": "Sharding.reshard_after_forward / Plan.reshard_after_forward",
    "a reduce-scatter per micro-batch": "Sharding.reduce_each_micro_batch / Plan.reduce_each_micro_batch",
}


@dataclass(frozen=True)
class Sharding:
    """How a model is sharded: over `world_size` ranks, per unit (`units`: module names, "" the
    root, which is always one), resharding after forward or not, gathering parameters in
    `param_dtype` (a precision name; None: their own dtype) with gradients reduced in fp32."""

    world_size: int
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    units: tuple[str, ...] | None = None  # None: what `shard=True` wraps (distributed/fsdp.blocks)
    # Accumulation: False, gradient sync off on all but the last micro-batch (the unsharded
    # gradients of every unit are kept until it); True, a reduce-scatter per micro-batch into the
    # sharded gradient (less memory, W-1/W of the gradients sent per micro-batch).
    reduce_each_micro_batch: bool = False

    def __post_init__(self):
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) \
                or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int but got {self.world_size!r}.")
        for name in ("reshard_after_forward", "reduce_each_micro_batch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False but got {getattr(self, name)!r}.")
        if self.param_dtype is not None and self.param_dtype not in precisions.names():
            raise ValueError(f"param_dtype must be one of {', '.join(precisions.names())} or None but got "
                             f"{self.param_dtype!r}.")

    @classmethod
    def read(cls, model, world_size: int, *, reshard_after_forward: bool | None = None,
             param_dtype: str | None = None, units=None, reduce_each_micro_batch: bool = False) -> "Sharding":
        """How `model` is sharded (`sharding_of`: its units and settings, when `fully_shard` sharded
        it; else the defaults, its blocks and the root becoming units), over `world_size` ranks;
        `reshard_after_forward`, `param_dtype` and `units` given override what was read, and
        `reduce_each_micro_batch` says how micro-batches accumulate."""
        read = sharding_of(model)
        return cls(
            world_size,
            reshard_after_forward=(reshard_after_forward if reshard_after_forward is not None
                                   else read.reshard_after_forward if read else True),
            param_dtype=param_dtype if param_dtype is not None else read.param_dtype if read else None,
            units=tuple(units) if units is not None else read.units if read else None,
            reduce_each_micro_batch=reduce_each_micro_batch)

    def describe(self) -> str:
        parts = [f"FSDP2 over {self.world_size} ranks"]
        if not self.reshard_after_forward:
            parts.append("no reshard after forward")
        if self.param_dtype:
            parts.append(f"params gathered in {self.param_dtype}")
        if self.reduce_each_micro_batch:
            parts.append("a reduce-scatter per micro-batch")
        return ", ".join(parts)


def sharding_of(model: torch.nn.Module) -> Sharding | None:
    """How `model` was sharded by `fully_shard` (None when it was not): its units, world size, and
    a block's reshard_after_forward and parameter dtype (the root's reshard is FSDP2's own choice)."""
    if not dist.is_available():  # no FSDP2 in this build: nothing can be sharded
        return None
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:  # a torch without FSDP2's public API: nothing was sharded with it
        return None
    units, groups = [], []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            if name:
                units.append(name)
            group = internals.first_param_group(fully_shard.state(module))
            if group is not None:
                groups.append((name, group))
    if not groups:
        return None
    _, group = next(((n, g) for n, g in groups if n), groups[0])
    dtype = group.mp_policy.param_dtype
    return Sharding(group.mesh_info.mesh.size(),
                    reshard_after_forward=group.post_forward_mesh_info is not None,
                    param_dtype=None if dtype is None else _precision_of(dtype), units=tuple(units))


def _precision_of(dtype: torch.dtype) -> str:
    for name in precisions.names():
        if get_precision(name).autocast_dtype == dtype:
            return name
    raise ValueError(f"a MixedPrecisionPolicy param_dtype of {dtype} has no autofit precision; "
                     f"use one of {', '.join(precisions.names())}.")


# -- the fake world ------------------------------------------------------------------------------

_FAKE_NAMES = itertools.count(1)


@contextlib.contextmanager
def _entered(world):
    """torch.distributed's world is `world` inside (the caller's, if any, is put back after).
    The count that names new process groups is module-global in c10d, not the world's: the fake
    world counts from a base of its own, far from the caller's, and the caller's count is put back,
    so a rank that estimated names its next group as the ranks that did not (else the others wait
    for it in `new_group` for ever) and no fake group's name is taken twice."""
    saved = internals.world_and_group_count()
    internals.set_world_and_group_count(
        world, getattr(world, "autofit_group_count", None) or next(_FAKE_NAMES) * 10**9)
    try:
        yield
    finally:
        world.autofit_group_count = internals.world_and_group_count()[1]
        internals.set_world_and_group_count(*saved)


def _fake_world(world_size: int):
    """A world of `world_size` ranks on the fake backend, this process rank 0; and its 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    world = internals.new_world()
    with _entered(world):
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
        # A named mesh, never equal to a job's: DTensor caches plans keyed by the mesh (its equality
        # ignores the rank and the group), and this world is rank 0 on every process, so a mesh
        # equal to the job's would hand rank r the fake rank 0's redistribution plans (measured: a
        # sharded run after an estimate on rank 1 ended with the ranks' parameters different).
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("autofit_estimate",))
    return world, mesh


# -- the copy, unsharded, then sharded as asked ---------------------------------------------------

class _Gone:
    """Stands in for FSDP2's state in a copy of a sharded model (then removed with its hooks)."""


def _unsharded_fake(model: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """A fake copy of `model` with plain full-size parameters, whether or not it was sharded."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        return fake_model(model)
    gone = _Gone()
    memo: dict = {}
    fakes: dict = {}
    for m in fsdp:
        state = fully_shard.state(m)
        memo[id(state)] = gone
        for group in internals.state_param_groups(state):
            memo[id(group)] = gone
    for m in model.modules():  # hooks of the training machinery (autofit's agreements): not copied
        for hooks in vars(m).values():
            if isinstance(hooks, dict) and not isinstance(hooks, torch.nn.Module):
                for owner in (getattr(h, "__self__", None) for h in hooks.values()):
                    if type(owner).__module__.startswith(("torch.distributed", "autofit.")):
                        memo[id(owner)] = gone
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in fakes:
            fakes[id(t)] = memo[id(t)] = fake_like(t)  # a DTensor's fake is its global shape
    # FSDP2's classes refuse deepcopy: each sharded module is copied as its original class, by hand
    shells = {}
    for m in fsdp:
        original = next(b for b in type(m).__bases__ if not issubclass(b, FSDPModule))
        shells[id(m)] = memo[id(m)] = object.__new__(original)
    for m in fsdp:
        vars(shells[id(m)]).update(copy.deepcopy(vars(m), memo))
    copied = shells[id(model)] if id(model) in shells else copy.deepcopy(model, memo)
    for m in copied.modules():
        for key in [k for k in vars(m) if internals.is_fsdp_mark(k)]:
            del m.__dict__[key]
        for hooks in vars(m).values():
            if isinstance(hooks, dict) and not isinstance(hooks, torch.nn.Module):
                for k in [k for k, h in hooks.items() if _bound_to(h, gone)]:
                    del hooks[k]
    return copied, fakes


def _bound_to(hook, gone) -> bool:
    while hook is not None:
        if getattr(hook, "__self__", None) is gone:
            return True
        hook = getattr(hook, "func", None)  # functools.partial
    return False


def _shard(model: torch.nn.Module, sharding: Sharding, mesh) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from autofit.distributed.fsdp import blocks  # the units shard=True makes
    modules = dict(model.named_modules())
    if sharding.units is None:
        chosen = {id(b) for b in blocks(model)}
        units = [name for name, m in modules.items() if id(m) in chosen]
    else:
        units = sharding.units
    missing = [u for u in units if u not in modules]
    if missing:
        raise ValueError(f"units {missing} are not modules of {type(model).__name__}; give module "
                         f"names as model.named_modules() gives them.")
    kw = {"mesh": mesh, "reshard_after_forward": sharding.reshard_after_forward}
    if sharding.param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=get_precision(sharding.param_dtype).autocast_dtype,
                                               reduce_dtype=torch.float32)
    # Innermost first, as fully_shard needs: a unit's parameters are those no inner unit took.
    for name in sorted((u for u in units if u), key=lambda n: -n.count(".")):
        fully_shard(modules[name], **kw)
    fully_shard(model, **kw)


# -- the estimate -----------------------------------------------------------------------------------

class ShardedEstimator(Walker):
    """`Estimator` for one rank of a model sharded with FSDP2 as `sharding` says; `batch` is this
    rank's batch (its share of the global batch). Fake copies made once, `measure(plan)` per plan."""

    def __init__(self, model, batch, sharding: Sharding, optimizer=None, loss_fn=None, *,
                 device_type: str = "cuda"):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module but got {type(model).__name__}.")
        if not isinstance(sharding, Sharding):
            raise TypeError(f"sharding must be an autofit Sharding but got {type(sharding).__name__}.")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be a callable (model, batch) -> scalar loss but got "
                            f"{loss_fn!r}.")
        check_optimizer(optimizer, model)
        self.rows = rows_of(batch)
        self.device_type, self.loss_fn, self.sharding = device_type, loss_fn, sharding
        self.estimates, self._sampled = 0, None
        shape_env = ShapeEnv()
        shape_env.real_tensor_prop_unbacked_vals = Hints(shape_env)
        self.mode = ti.fake_tensor_mode_class()(shape_env=shape_env, static_shapes=True)
        self.world, mesh = _fake_world(sharding.world_size)
        with self._quiet(), self.mode, _entered(self.world):
            self.model, fakes = _unsharded_fake(model)
            self.model.train()
            names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
            _shard(self.model, sharding, mesh)
            # FSDP2's switches as autofit trains a sharded model (sum reduction; sync on the last)
            from autofit.distributed.fsdp import Sharded
            self.switches = Sharded(self.model)
            self._meter = None  # the measure's meter (see _device)
            self._tag_kinds()
            sharded = dict(self.model.named_parameters(remove_duplicate=False))
            # the user's parameters -> this copy's sharded ones (fully_shard replaced them)
            fakes = {k: sharded[names[id(f)]] for k, f in fakes.items() if id(f) in names}
            self.optimizer = fake_optimizer(optimizer, model, fakes, device_type)
            self.optimizer.state.clear()  # a sharded parameter's state is sharded: made by warm()
            warm(self.optimizer)
            self.batch = _map_tensors(batch, fake_like)
        self.optimizer_name = type(self.optimizer).__name__
        self.resident = self._resident()
        self.reshard_choices = _reshard_choices(model, sharding)  # the capacity check's to price

    def _tag_kinds(self) -> None:
        """What FSDP2 allocates is counted by kind, in the breakdown: a unit's all-gather and its
        unsharded parameters as params, its reduce-scatter and sharded gradients as grads (this
        copy's own parameter groups are wrapped; the user's model is never touched)."""
        from torch.distributed.fsdp import FSDPModule
        for unit in self.model.modules():
            if not isinstance(unit, FSDPModule):
                continue
            for group in internals.param_groups(unit):
                for name, kind in (("unshard", "params"), ("wait_for_unshard", "params"),
                                   ("post_backward", "grads")):
                    setattr(group, name, self._as_kind(getattr(group, name), kind))

    def _as_kind(self, method, kind: str):
        def counted(*args, **kwargs):
            if self._meter is None:
                return method(*args, **kwargs)
            with self._meter.as_kind(kind):
                return method(*args, **kwargs)
        return counted

    def _device(self, meter):
        self._meter = meter
        return super()._device(meter)

    def _sample(self, error: Exception) -> None:
        # Real rows cannot stand in for W ranks: say what fake tensors could not follow.
        error.add_note(f"estimating {type(self.model).__name__} sharded ({self.sharding.describe()}) "
                       f"needs fake tensors to follow its step.")
        raise error

    def _resident(self) -> dict:
        params = list(self.model.parameters()) + list(self.model.buffers())
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return {"params": storage_bytes(params),
                "grads": storage_bytes(trainable),  # a sharded gradient is its parameter's size
                "optimizer": storage_bytes(self._state())}

    def _reduce_each(self, plan: Plan) -> bool:
        return reduce_each_measured(self, plan)

    def _measured(self, plan: Plan):
        if self.rows <= plan.micro_batch_size or self._reduce_each(plan):
            return super()._measured(plan)
        # Sync off: each micro-batch adds to the unsharded gradients, the last one also
        # reduce-scatters them; two micro-batches (the second full-size when the batch has it)
        # measure the peak of all of them.
        return slice_batch(self.batch, 0, min(self.rows, 2 * plan.micro_batch_size)), False

    def _runner(self, device) -> StepRunner:
        return StepRunner(self.model, self.optimizer, device, loss_fn=self.loss_fn, sync=self._sync)

    def _sync(self, i: int, last: bool):
        return self.switches.sync(i, last)

    def measure(self, plan: Plan) -> MemoryEstimate:
        if plan.offload_optimizer:
            raise ValueError("offload_optimizer is not a plan for a sharded model: FSDP2 offloads "
                             "with CPUOffloadPolicy; use a plan with offload_optimizer=False.")
        # The plan's FSDP settings (Plan fields override the Sharding's: the switches' `estimate`
        # hooks), applied to this copy as a run applies them to the live model (distributed/fsdp).
        self.switches.prepare(self.measured_plan(plan))
        with _entered(self.world):
            return super().measure(plan)


def reshard_measured(estimator, plan: Plan):
    """reshard_after_forward in an estimate (plans/switches.py `estimate`): the plan's, else (None)
    the Sharding's a sharded estimate's copy was sharded with."""
    if estimator.sharding is None or plan.reshard_after_forward is not None:
        return plan.reshard_after_forward
    return estimator.sharding.reshard_after_forward


def _reshard_choices(model, sharding: Sharding) -> tuple[bool, ...]:
    """FSDP2's reshard_after_forward values to price: those a run may use on `model` when it is
    sharded (autofit.distributed.fsdp.reshard_choices: never more than the user chose), else
    keeping gathered parameters only when `sharding` says so."""
    from autofit.distributed.fsdp import is_sharded, reshard_choices
    if is_sharded(model):
        return reshard_choices(model)
    return (False, True) if not sharding.reshard_after_forward else (True,)


def reduce_each_measured(estimator, plan: Plan) -> bool:
    """reduce_each_micro_batch in an estimate (plans/switches.py `estimate`): on when the plan or
    the Sharding says so."""
    sharding = estimator.sharding
    return plan.reduce_each_micro_batch or (sharding is not None and sharding.reduce_each_micro_batch)


def estimate_sharded(model, sharding: Sharding | int, plan: Plan, batch, *, optimizer=None, loss_fn=None,
                     device_type: str = "cuda") -> MemoryEstimate:
    """Predict one rank's peak device memory for a training step of `model` sharded with FSDP2 as
    `sharding` says, on this rank's `batch` under `plan`.

    `sharding`: a `Sharding`, or the world size, the settings then read from `model`
    (`Sharding.read`: from a model sharded already with `fully_shard`, else its blocks and the root
    become units); `optimizer` and `loss_fn` as in `autofit.estimate`. Nothing of the caller's is
    changed, its process group (if any) included.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autofit.Plan but got {type(plan).__name__}.")
    if not isinstance(sharding, Sharding):
        sharding = Sharding.read(model, sharding)
    return ShardedEstimator(model, batch, sharding, optimizer, loss_fn,
                            device_type=device_type).measure(plan)
