"""Device memory by kind: parameters, gradients, optimizer state, and the rest (activations, other)."""

from __future__ import annotations

import torch

from autofit import torch_internals as ti
from autofit.gpu.simulate import inner_tensors, round_bytes

KINDS = ("params", "grads", "optimizer", "activations", "other")


def on_device_predicate(device):
    """A function tensor -> bool: whether its memory is on `device` (an autofit Device)."""
    if device.type == "cuda":
        return lambda t: t.is_cuda
    gpu = getattr(device, "gpu", None)
    if gpu is not None:
        return gpu.holds
    return lambda t: False


def storage_key(storage: torch.UntypedStorage) -> int:
    """One key per storage, for real and fake tensors alike (a fake tensor has no data pointer)."""
    return ti.storage_key(storage)


def storage_bytes(tensors, seen: set | None = None, on_device=None) -> int:
    """Bytes of the distinct storages behind `tensors` (512-byte rounding); non-tensors and, with
    `on_device`, tensors it rejects are skipped; `seen` carries storages already counted."""
    seen = set() if seen is None else seen
    total = 0
    for t in inner_tensors(tensors):
        if not isinstance(t, torch.Tensor) or (on_device is not None and not on_device(t)):
            continue
        storage = t.untyped_storage()
        key = storage_key(storage)
        if key in seen:
            continue
        seen.add(key)
        total += round_bytes(storage.nbytes())
    return total


def by_kind(device, model, optimizer=None, batch_bytes: int = 0) -> dict:
    """Bytes by kind now. `other` holds batches on the device; `activations` is what is left."""
    if device.type == "cuda":
        def on_device(t):
            return t.is_cuda
    else:
        gpu = getattr(device, "gpu", None)

        def on_device(t):
            return gpu is None or gpu.holds(t)
    seen: set = set()
    params = list(model.parameters()) + list(model.buffers())
    out = {"params": storage_bytes(params, seen, on_device)}
    out["grads"] = storage_bytes([p.grad for p in model.parameters()], seen, on_device)
    state = []
    if optimizer is not None:
        for entry in optimizer.state.values():
            state.extend(v for v in entry.values() if isinstance(v, torch.Tensor))
    out["optimizer"] = storage_bytes(state, seen, on_device)
    out["other"] = batch_bytes
    allocated = device.memory_allocated()
    out["activations"] = max(allocated - sum(out.values()), 0)
    return {k: out[k] for k in KINDS}


