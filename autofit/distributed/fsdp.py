"""FSDP2 (`torch.distributed.fsdp.fully_shard`): telling a sharded model, finding its blocks, sharding.

A model is sharded when some parameter is a DTensor (fully_shard replaced it by this rank's shard).
`shard(model)` is what `shard=True` does for a user who has not sharded: fully_shard on each
transformer block (the model's own block classes: Hugging Face's `_no_split_modules`, else the
classes repeated in a ModuleList) and then on the root, the layout PyTorch's FSDP2 examples use.
The estimator reads the same blocks (`blocks`) to size the largest all-gathered unit.

A plan's FSDP settings (`Plan.reshard_after_forward`, `Plan.reduce_each_micro_batch`) are applied
to the live model by `Sharded.prepare` before each attempt. `reshard_after_forward` never goes below
the user's own choice: a model the user sharded with True is never made to keep its gathered
parameters; one that autofit sharded (`shard=True`) may (`reshard_choices`).
"""

from __future__ import annotations

import weakref

import torch

from autofit.integrations import transformers_internals as hf_internals
from autofit.distributed import internals
from autofit.distributed.internals import internals_missing

_OWN = weakref.WeakSet()                 # models autofit sharded itself (shard=True)
_USER = weakref.WeakKeyDictionary()      # model -> its own reshard_after_forward while a run holds it


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch.distributed not built
        return None
    return DTensor


def is_dtensor(tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(tensor, cls)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_sharded(model) -> bool:
    """Whether `model` holds FSDP2-sharded parameters (DTensors), e.g. after `fully_shard`."""
    return isinstance(model, torch.nn.Module) and any(is_dtensor(p) for p in model.parameters())


def fsdp_units(model) -> list:
    """The modules fully_shard was applied to (each all-gathers its parameters as one unit), root
    last when it is one."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return []
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return sorted(units, key=lambda m: m is model)


def sharding(model) -> dict:
    """How `model` is spread over the ranks, for the cache key: {"sharding": "fsdp2", "units": the
    names of the modules fully_shard was applied to} or {"sharding": "replicated"}."""
    if not is_sharded(model):
        return {"sharding": "replicated"}
    units = {id(m) for m in fsdp_units(model)}
    return {"sharding": "fsdp2", "units": [name for name, m in model.named_modules() if id(m) in units]}


def block_classes(model: torch.nn.Module) -> set[type]:
    """The model's block classes: Hugging Face's `_no_split_modules` (the classes it never splits
    across devices: its layers, and e.g. BERT's embeddings), else the one class of the children of
    a ModuleList that repeats it."""
    names = set(hf_internals.no_split_modules(model))
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    return found or {type(m[0]) for m in _repeating_lists(model)}


def _repeating_lists(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1
            and len({type(child) for child in m}) == 1]


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The block instances `shard` wraps, in module order: those of `_no_split_modules`' classes,
    else the children of repeating ModuleLists; a block inside a block is not one."""
    if hf_internals.no_split_modules(model):
        classes = block_classes(model)
        chosen = {id(m) for m in model.modules() if type(m) in classes and m is not model}
    else:
        chosen = {id(child) for m in _repeating_lists(model) for child in m}
    out, inside = [], []
    for name, m in model.named_modules():
        if id(m) in chosen and not any(name.startswith(p + ".") for p in inside):
            out.append(m)
            inside.append(name)
    return out


def shard(model: torch.nn.Module, **options) -> torch.nn.Module:
    """fully_shard each block of `model` and then the root, in place; `options` go to fully_shard
    (mesh, reshard_after_forward, mp_policy, offload_policy). Returns the model."""
    from torch.distributed.fsdp import fully_shard
    if is_sharded(model):
        raise ValueError(f"{type(model).__name__} is sharded already (its parameters are DTensors); "
                         f"pass shard=False to train it as it is.")
    found = blocks(model)
    if not found:
        raise ValueError(f"shard=True found no transformer blocks in {type(model).__name__} (no "
                         f"_no_split_modules, no ModuleList of one repeated class); apply "
                         f"torch.distributed.fsdp.fully_shard yourself and pass the sharded model.")
    for block in found:
        fully_shard(block, **options)
    fully_shard(model, **options)
    _OWN.add(model)
    return model


def user_reshard_after_forward(model) -> bool:
    """The model's own reshard_after_forward (what it was sharded with, before any plan changed it):
    a block's, or the root's when it is the only unit."""
    if model in _USER:
        return _USER[model]
    units = fsdp_units(model)
    blocks_ = [u for u in units if u is not model and internals.param_groups(u)]
    return any(internals.reshards(u) for u in (blocks_ or units))


def reshard_choices(model) -> tuple[bool, ...]:
    """The reshard_after_forward values a plan may use for `model`, cheapest in memory last:
    (False, True) when autofit sharded it or the user chose False, else (True,) (never more
    memory than the user chose)."""
    if model in _OWN or not user_reshard_after_forward(model):
        return (False, True)
    return (True,)


def plan_problem(plan, model) -> str | None:
    """Why `plan`'s FSDP settings cannot run on `model`, or None."""
    if plan.reshard_after_forward is None and not plan.reduce_each_micro_batch:
        return None
    if not is_sharded(model):
        what = "a reduce-scatter per micro-batch" if plan.reduce_each_micro_batch else \
            f"reshard_after_forward={plan.reshard_after_forward}"
        return (f"{what} is FSDP2's, and {type(model).__name__} is not sharded with fully_shard "
                f"(shard=True or your own fully_shard)")
    if plan.reshard_after_forward is False and False not in reshard_choices(model):
        return (f"{type(model).__name__} was sharded with reshard_after_forward=True; autofit never "
                f"keeps more gathered than you chose (shard it with False to allow it)")
    return None


class Sharded:
    """FSDP2's switches for one run of a sharded model, handed back as they were by `close`.

    Gradients are summed over the ranks (divide factor 1: autofit weights every micro-batch by its
    share of the global batch, as it does under DDP); every micro-batch but a global batch's last
    runs with gradient sync off, so the reduce-scatter runs once per global batch; a failed attempt
    reshards every unit, so the replay starts from the sharded state the step began with."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.units = fsdp_units(model)
        missing = internals_missing(self.units)
        if missing:
            raise RuntimeError(
                f"autofit trains FSDP2 models through FSDP2's internal state as torch 2.13 has it, and "
                f"this torch {torch.__version__} lacks {', '.join(missing[:6])}"
                f"{f' and {len(missing) - 6} more' if len(missing) > 6 else ''}: install torch 2.13, "
                f"or train this sharded model without autofit")
        self.guards = None  # fsdp_guard.Guards once `guard` is called (a lockstep's run)
        self._saved = [(g, internals.reduction(g)) for u in self.units for g in internals.param_groups(u)]
        # reshard_after_forward as the model has it, for plans that keep it and for close
        self._reshard = [(u, internals.reshard_setting(u)) for u in self.units]
        self.own_reshard = user_reshard_after_forward(model)
        _USER[model] = self.own_reshard
        self.reduce_each = False  # the plan's: a reduce-scatter after every micro-batch
        for unit in self.units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM

    def guard(self, check) -> None:
        """Hold `check(collective)`, the lockstep's agreement, inside each of FSDP's collectives (after its
        buffers are allocated, before it runs) while armed (autofit.distributed.fsdp_guard)."""
        from autofit.distributed.fsdp_guard import Guards
        self.guards = Guards(self.model, self.units, check)

    def held(self) -> list[torch.Tensor]:
        """What FSDP keeps for the run besides the parameters: each unit's device mesh's rank map,
        made where the model was sharded (host memory on CUDA; on a simulated GPU counted if that
        was inside it). Units with equal meshes share one in their parameters' specs, so the
        units' own meshes are read."""
        return internals.rank_maps(self.units)

    def arm(self, on: bool) -> None:
        """Guards on for a training attempt (never for evaluation or anything else)."""
        self.guards.armed = on

    def prepare(self, plan) -> None:
        """The plan's FSDP settings on the live model, before an attempt (every unit is sharded
        and idle then: between steps, or after `abandon`). The root keeps its own setting (FSDP2
        keeps the root gathered after forward: backward starts with it)."""
        self.set_reduce_each(plan.reduce_each_micro_batch)
        self.set_reshard(plan.reshard_after_forward)

    def set_reduce_each(self, on: bool) -> None:
        """A reduce-scatter after every micro-batch (on), or after a global batch's last only."""
        self.reduce_each = on

    def set_reshard(self, wanted: bool | None) -> None:
        """Every unit but the root resharded after forward or not (None: as the model was sharded)."""
        self._restore_reshard()
        if wanted is not None and wanted != self.own_reshard:
            for unit in self.units:
                if unit is not self.model:
                    unit.set_reshard_after_forward(wanted, recurse=False)

    def _restore_reshard(self) -> None:
        for unit, saved in self._reshard:
            internals.set_reshard_setting(unit, saved)

    def sync(self, i: int, last: bool):
        """The context around micro-batch `i`'s forward and backward (StepRunner's `sync`): the
        gradients are reduce-scattered after the last micro-batch, or after each one when the plan
        says so."""
        reduce = last or self.reduce_each
        for unit in self.units:
            unit.set_requires_gradient_sync(reduce, recurse=False)
        return _NULL

    def abandon(self) -> None:
        """After a failed attempt: every unit back to sharded and idle, whatever phase the failure
        interrupted (FSDP itself expects each forward to finish: its state says where it stopped),
        and nothing of the attempt's gathers or of its unsharded gradients kept. The order units
        finished forward in, which FSDP's backward prefetch follows, is cleared too: the failed
        attempt's would differ between ranks (each stopped elsewhere)."""
        internals.drop_attempt(self.model, self.units)

    def close(self) -> None:
        if self.guards is not None:
            self.guards.remove()
        self._restore_reshard()
        _USER.pop(self.model, None)
        for g, saved in self._saved:
            internals.set_reduction(g, saved)


def reshard_hook(runner, plan) -> None:
    """reshard_after_forward's switch (plans/switches.py), set on `runner`'s sharded model (a
    StepRunner's `sharded`; nothing to set when the model is not sharded)."""
    if runner.sharded is not None:
        runner.sharded.set_reshard(plan.reshard_after_forward)


def reduce_each_hook(runner, plan) -> None:
    """reduce_each_micro_batch's switch (plans/switches.py), as `reshard_hook`."""
    if runner.sharded is not None:
        runner.sharded.set_reduce_each(plan.reduce_each_micro_batch)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()


def fsdp_applies(plan, model, optimizer, device, checkpointing) -> str | None:
    """FSDP2's two settings' `applies` (plans/switches.py): plan_problem."""
    return plan_problem(plan, model)
