"""FSDP2 (`torch.distributed.fsdp.fully_shard`): telling a sharded model, finding its blocks, sharding.

A model is sharded when some parameter is a DTensor (fully_shard replaced it by this rank's shard).
`shard(model)` is what `shard=True` does for a user who has not sharded: fully_shard on each
transformer block (the model's own block classes: Hugging Face's `_no_split_modules`, else the
classes repeated in a ModuleList) and then on the root, the layout PyTorch's FSDP2 examples use.
The estimator reads the same blocks (`blocks`) to size the largest all-gathered unit.
"""

from __future__ import annotations

import torch


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


def block_classes(model: torch.nn.Module) -> set[type]:
    """The model's block classes: Hugging Face's `_no_split_modules` (the classes it never splits
    across devices: its layers, and e.g. BERT's embeddings), else the one class of the children of
    a ModuleList that repeats it."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    return found or {type(m[0]) for m in _repeating_lists(model)}


def _repeating_lists(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1
            and len({type(child) for child in m}) == 1]


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The block instances `shard` wraps, in module order: those of `_no_split_modules`' classes,
    else the children of repeating ModuleLists; a block inside a block is not one."""
    if getattr(model, "_no_split_modules", None):
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
    return model
