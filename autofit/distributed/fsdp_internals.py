"""What autofit reads and sets inside FSDP2 (torch.distributed.fsdp._fully_shard, private), listed
once, so a torch whose FSDP2 lacks any of it is refused up front with the names (Sharded) instead of
failing half-way through a step on every rank."""

from __future__ import annotations

# The guards wrap each parameter group's comms; a failed attempt resets the states FSDP keeps per
# iteration. Written against torch 2.13.
_INTERNALS = {
    "unit": ("_get_fsdp_state", "set_gradient_divide_factor", "set_force_sum_reduction_for_comms",
             "set_requires_gradient_sync", "set_reshard_after_forward"),
    "state": ("_fsdp_param_groups", "_comm_ctx", "_state_ctx", "_modules_to_run_forward",
              "_training_state", "_auto_reshard_after_forward"),
    "param group": ("_all_gather_comm", "_reduce_scatter_comm", "_post_forward_indices",
                    "_all_gather_result", "_training_state", "post_forward_mesh_info", "reshard",
                    "gradient_divide_factor", "force_sum_reduction_for_comms", "reduce_grads",
                    "all_reduce_grads"),
    "parameter": ("free_unsharded_param", "unsharded_accumulated_grad"),
}


def internals_missing(units) -> list[str]:
    """The FSDP2 internals autofit relies on that `units` (fully_shard modules) lack, as
    'kind.name'; [] when all are there."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: F401
        missing = []
    except ImportError:
        missing = ["_fsdp_api.AllGather", "_fsdp_api.ReduceScatter"]
    for unit in units:
        missing += [f"unit.{n}" for n in _INTERNALS["unit"] if not hasattr(unit, n)]
        if "unit._get_fsdp_state" in missing:
            break
        state = unit._get_fsdp_state()
        missing += [f"state.{n}" for n in _INTERNALS["state"] if not hasattr(state, n)]
        for group in getattr(state, "_fsdp_param_groups", []) or []:
            missing += [f"param group.{n}" for n in _INTERNALS["param group"] if not hasattr(group, n)]
            for fp in group.fsdp_params[:1]:
                missing += [f"parameter.{n}" for n in _INTERNALS["parameter"] if not hasattr(fp, n)]
    return list(dict.fromkeys(missing))
