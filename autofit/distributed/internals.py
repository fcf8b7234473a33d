"""One place per outside library's private access, so every such name of
torch.distributed, each with the short function that reaches it, is here and nowhere else.

Every private name of torch.distributed that autofit uses, in this one module, and the check of
all of them (`missing`, `internals_missing`), so a torch that lacks one is refused up front with the
names instead of failing half-way through a step on every rank. Written against torch 2.13.

Public API comes first where torch has it: a failed attempt is dropped with FSDP2's documented
recovery call, `FSDPModule.reset_iter_state()`; what it leaves (the unsharded storages of a
gather that failed in its copy-out, gradients accumulated with sync off) and what torch has no
public API for (each parameter group's comms, its reduction and resharding settings, the default
group's timeout and store, DTensor's found-inf reduction) is reached here. A test reads this
module's source and requires every private name in it to be in CHECKED."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch

from autofit import torch_internals as ti

# What `internals_missing` checks, by the object it is read on. Every private name (`_x`) used in
# this module is here, and so is every public-looking name of a private object.
CHECKED = {
    "unit": ("_get_fsdp_state", "reset_iter_state", "set_gradient_divide_factor",
             "set_force_sum_reduction_for_comms", "set_requires_gradient_sync",
             "set_reshard_after_forward"),
    # `state_param_groups` reads the parameter groups as either torch lays them out: a list
    # `_fsdp_param_groups` (torch 2.13) or one `_fsdp_param_group` (before)
    "state": ("_auto_reshard_after_forward", "_is_root"),
    "state groups": ("_fsdp_param_groups", "_fsdp_param_group"),
    "param group": ("_all_gather_comm", "_reduce_scatter_comm", "post_forward_mesh_info",
                    "gradient_divide_factor", "force_sum_reduction_for_comms", "reduce_grads",
                    "all_reduce_grads", "fsdp_params", "mesh_info"),
    "parameter": ("free_unsharded_param", "unsharded_accumulated_grad", "unsharded_param"),
    "mesh": ("_rank_map",),
    # what DDP's setter writes on a module: the parameters and buffers a DDP leaves alone
    "ddp": ("torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
            "_ddp_params_and_buffers_to_ignore"),
    "fsdp module": ("torch.distributed.fsdp._fully_shard._fsdp_api.AllGather",
                    "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter"),
    # every run on more than one rank: its agreement group, the store that names a stalled rank
    "c10d": ("torch.distributed.distributed_c10d._get_default_store",
             "torch.distributed.distributed_c10d._world.pg_map",
             "torch.distributed.distributed_c10d._world.default_pg",
             "torch.distributed.ProcessGroup._get_backend",
             "torch.distributed.ProcessGroupGloo._Options._timeout"),
    # what fully_shard writes on a module it manages (the sharded estimate's unsharded copy drops it)
    "module marks": ("_is_fsdp_managed_module", "_fsdp_use_orig_params"),
    # the sharded estimate: a world of W fake ranks in this process, entered and left around it
    "fake world": ("torch.distributed.distributed_c10d._World",
                   "torch.distributed.distributed_c10d._world",
                   "torch.distributed.distributed_c10d._group_count",
                   "torch.testing._internal.distributed.fake_pg"),
    # a sharded run's grad scaler
    "dtensor": ("torch.distributed.tensor.DTensor._op_dispatcher._custom_op_handlers",
                "torch.ops.aten._amp_foreach_non_finite_check_and_unscale_"),
}


# -- torch.distributed's process groups ------------------------------------------------------------
def group_timeout(group) -> timedelta | None:
    """The timeout `group`'s collectives wait for (what init_process_group was given), or None."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - no CPU backend: the store was given the same timeout
        try:
            return torch.distributed.distributed_c10d._get_default_store().timeout
        except Exception:  # noqa: BLE001
            return None


def default_store():
    """The default group's store (every rank's), or None."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None


def store_host() -> int | None:
    """The rank whose process serves the default store: rank 0 for the TCPStore that
    init_process_group made (tcp:// or env://), unless torchrun's agent serves it; None for a
    FileStore or an agent's store (it outlives any rank)."""
    import os
    store = default_store()
    while isinstance(store, torch.distributed.PrefixStore):
        store = store.underlying_store
    if isinstance(store, torch.distributed.TCPStore) and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return 0
    return None


def default_group_key() -> int:
    """Tells this default process group from a later one (id of torch's default group)."""
    return id(torch.distributed.distributed_c10d._world.default_pg)


def group_alive(group) -> bool:
    """Whether `group` still belongs to the current world (destroy_process_group forgets it)."""
    return group in torch.distributed.distributed_c10d._world.pg_map


def ddp_ignored(module) -> set[str]:
    """The names of the parameters and buffers DDP is told to leave alone on `module`."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


# -- the sharded estimate's fake world ---------------------------------------------------------
def new_world():
    """A fresh c10d world (its default group, group map, names), with the fake backend registered:
    the sharded estimate makes W fake ranks in it without touching the job's own world."""
    refuse_missing_for_estimate()
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    return torch.distributed.distributed_c10d._World()


def world_and_group_count() -> tuple:
    """c10d's current world and its module-global count that names new process groups."""
    c10d = torch.distributed.distributed_c10d
    return c10d._world, c10d._group_count


def set_world_and_group_count(world, count) -> None:
    c10d = torch.distributed.distributed_c10d
    c10d._world, c10d._group_count = world, count


def first_param_group(state):
    """A fully_shard module's state's own parameter group (None when it has no parameters)."""
    groups = state_param_groups(state)
    return groups[0] if groups else None


def is_fsdp_mark(key: str) -> bool:
    """Whether `key` (of a module's __dict__) is a mark fully_shard leaves on a module it manages:
    a copy made unsharded drops them (else FSDP's hooks treat it as managed)."""
    return key.startswith("__composable_api_state_key") or key in CHECKED["module marks"]


def state_param_groups(state) -> list:
    """A fully_shard state's parameter groups, in either of torch's layouts (`CHECKED["state
    groups"]`: several per module in torch 2.13, at most one before)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def refuse_missing_for_estimate() -> None:
    """Raise before a sharded estimate when this torch lacks the fake world's internals."""
    lacking = [p for p in CHECKED["fake world"] if not _has(p)]
    if lacking:
        raise RuntimeError(f"autofit's sharded estimate (a fake world of W ranks) uses "
                           f"torch.distributed internals as torch 2.13 has them, and this torch "
                           f"{torch.__version__} lacks {', '.join(lacking)}: install torch 2.13, "
                           f"or estimate without sharding")


# -- DTensor -----------------------------------------------------------------------------------
@contextlib.contextmanager
def local_found_inf(found: list):
    """The grad scaler's non-finite check on DTensor gradients without DTensor's all-reduce of
    found-inf: each rank checks its own shards, its found-inf tensors are appended to `found`,
    and the caller combines them behind an agreement."""
    from torch.distributed.tensor import DTensor
    handlers = DTensor._op_dispatcher._custom_op_handlers
    op = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
    saved = handlers.get(op)

    def local_only(op_call, args, kwargs):
        grads, flag, inv_scale = args
        op_call([g.to_local() for g in grads], flag, inv_scale, **kwargs)
        found.append(flag)
    handlers[op] = local_only
    try:
        yield found
    finally:
        if saved is None:
            handlers.pop(op, None)
        else:
            handlers[op] = saved


# -- FSDP2 -------------------------------------------------------------------------------------
def comm_classes():
    """FSDP2's comm interfaces (`AllGather`, `ReduceScatter`), which autofit's guards implement."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    return AllGather, ReduceScatter


def param_groups(unit) -> list:
    return state_param_groups(unit._get_fsdp_state())


def comms(group) -> tuple:
    return group._all_gather_comm, group._reduce_scatter_comm


def set_comms(group, gather, reduce) -> None:
    group._all_gather_comm, group._reduce_scatter_comm = gather, reduce


def reduction(group) -> tuple:
    """A group's reduction settings, for `set_reduction` to hand back."""
    return (group.gradient_divide_factor, group.force_sum_reduction_for_comms, group.reduce_grads,
            group.all_reduce_grads)


def set_reduction(group, saved: tuple) -> None:
    (group.gradient_divide_factor, group.force_sum_reduction_for_comms, group.reduce_grads,
     group.all_reduce_grads) = saved


def reshards(unit) -> bool:
    """Whether `unit` reshards its parameters after forward."""
    return any(g.post_forward_mesh_info is not None for g in param_groups(unit))


def reshard_setting(unit) -> tuple:
    """`unit`'s reshard_after_forward as FSDP holds it, for `set_reshard_setting`."""
    return unit._get_fsdp_state()._auto_reshard_after_forward, \
        [(g, g.post_forward_mesh_info) for g in param_groups(unit)]


def set_reshard_setting(unit, saved: tuple) -> None:
    auto, groups = saved
    state = unit._get_fsdp_state()
    state._auto_reshard_after_forward = auto
    # FSDP's lazy init (the root's first forward) stops a root on the automatic setting
    # resharding after forward. The settings were read before it, so a root restored after it
    # keeps what lazy init gave: else a rank whose lazy init ran in an attempt that another rank
    # failed reshards its root in the replay and the others do not, and their backward gathers
    # differ (gloo aborts on the mismatch).
    lazy_root = auto and state._is_root
    for group, info in groups:
        group.post_forward_mesh_info = None if lazy_root else info


def rank_maps(units) -> list[torch.Tensor]:
    """Each unit's device mesh's rank map (units with equal meshes share one in their parameters'
    specs, so the units' own meshes are read)."""
    meshes = {id(g.mesh_info.mesh): g.mesh_info.mesh for u in units for g in param_groups(u)}
    maps = (getattr(mesh, "_rank_map", None) for mesh in meshes.values())  # `mesh` makes a new one
    return [m for m in maps if isinstance(m, torch.Tensor)]


def drop_attempt(model, units) -> None:
    """Every unit back to sharded and idle after a failed forward or backward, nothing of the
    attempt kept: FSDP2's `reset_iter_state` on each root, then what it leaves."""
    inner = {id(m) for u in units for m in u.modules() if m is not u}
    for unit in units:
        # a root (the outermost units: the model when it is one) whose lazy init ran (the first
        # forward: before it there is no iteration state, and the reset would fail on its absence)
        if id(unit) not in inner and unit._get_fsdp_state()._is_root is not None:
            unit.reset_iter_state()
    for unit in units:
        for group in param_groups(unit):
            for fp in group.fsdp_params:
                # A gather that failed in its copy-out left the parameters before the failure
                # unsharded (their storages allocated) while the group says sharded, and the
                # reset frees only a group it sees unsharded.
                fp.free_unsharded_param()
                fp.unsharded_accumulated_grad = None  # accumulated with sync off: not the replay's
                unsharded = getattr(fp, "unsharded_param", None)  # made at FSDP's lazy init
                if unsharded is not None:
                    unsharded.grad = None


# -- the check ---------------------------------------------------------------------------------
def _has(path: str) -> bool:
    return ti.present(path)


def missing(sharded: bool = False) -> list[str]:
    """What this torch lacks of the internals a run on several ranks uses (`sharded`: and those of
    a sharded run besides FSDP2's own, see `internals_missing`); [] when all are there."""
    out = [p for p in CHECKED["c10d"] if not _has(p)]
    setter, written = CHECKED["ddp"]
    if not _has(setter):
        out.append(setter)
    else:
        probe = torch.nn.Module()
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(probe, [])
        if not hasattr(probe, written):
            out.append(f"module.{written}")
    if sharded:
        out += [p for p in CHECKED["dtensor"] if not _has(p)]
        if not out:
            from torch.distributed.tensor import DTensor
            if torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default not in \
                    DTensor._op_dispatcher._custom_op_handlers:
                out.append("DTensor's found-inf handler")
    return out


def refuse_missing(sharded: bool = False) -> None:
    """Raise before the run when this torch lacks what `missing` checks."""
    lacking = missing(sharded)
    if lacking:
        raise RuntimeError(f"autofit runs on several ranks through torch.distributed internals as "
                           f"torch 2.13 has them, and this torch {torch.__version__} lacks "
                           f"{', '.join(lacking)}: install torch 2.13, or run without autofit")


def internals_missing(units) -> list[str]:
    """The FSDP2 internals autofit relies on that `units` (fully_shard modules) lack, as
    'kind.name'; [] when all are there."""
    found = [p.rsplit(".", 1)[-1] for p in CHECKED["fsdp module"] if not _has(p)]
    out = [f"_fsdp_api.{n}" for n in found]
    for unit in units:
        out += [f"unit.{n}" for n in CHECKED["unit"] if not hasattr(unit, n)]
        if "unit._get_fsdp_state" in out:
            break
        state = unit._get_fsdp_state()
        out += [f"state.{n}" for n in CHECKED["state"] if not hasattr(state, n)]
        if not any(hasattr(state, n) for n in CHECKED["state groups"]):
            out.append(f"state.{' or '.join(CHECKED['state groups'])}")
        for group in state_param_groups(state):
            out += [f"param group.{n}" for n in CHECKED["param group"] if not hasattr(group, n)]
            mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
            if mesh is not None:
                out += [f"mesh.{n}" for n in CHECKED["mesh"] if not hasattr(mesh, n)]
            for fp in getattr(group, "fsdp_params", [])[:1]:
                # on the class: `unsharded_param` (a property) is made at FSDP's lazy init
                out += [f"parameter.{n}" for n in CHECKED["parameter"]
                        if not (hasattr(fp, n) or hasattr(type(fp), n))]
    return list(dict.fromkeys(out))
