"""Where a tensor lives: on the device autofit trains on or not, and what of a batch arrives there
already (the `batch-on-device` leak, judged before autofit moves the batch)."""

from __future__ import annotations

import torch

from autofit.diagnosis.graphs import _nbytes
from autofit.diagnosis.leak_kinds import FIX_BATCH, shape_of
from autofit.engine.batches import _fields
from autofit.gpu.memory import on_device_predicate, storage_bytes
from autofit.sizes import format_size


def device_fields(batch, on_device) -> list[tuple[str, torch.Tensor]]:
    return [(path, v) for path, v in _fields(batch)
            if isinstance(v, torch.Tensor) and on_device(v)]


def batch_on_device(batch, device) -> str | None:
    """What of `batch` is already on the device, with the fix; None when nothing is.

    On CUDA a field is on the device when it is a CUDA tensor; on the simulated GPU when the GPU
    already holds its storage (made inside `simulate_gpu`, before autofit copied it). Call it on a
    batch as the data handed it over, before autofit moves it.
    """
    fields = device_fields(batch, on_device_predicate(device))
    if not fields:
        return None
    shown = ", ".join(f"{path} {shape_of(t)} ({format_size(_nbytes(t))})" for path, t in fields[:4])
    more = f" and {len(fields) - 4} more" if len(fields) > 4 else ""
    total = storage_bytes(t for _, t in fields)
    return (f"the batch arrives already on {device.describe()}: {shown}{more}, "
            f"{format_size(total)}. Fix: {FIX_BATCH}.")

