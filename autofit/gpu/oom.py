"""The one place that recognises an out-of-memory error and frees what a failed attempt held."""

from __future__ import annotations

import gc

import torch

from autofit.errors import PartialUpdateError

# Allocator messages that mean "out of memory" on the backends PyTorch ships, for errors that are
# raised as plain RuntimeError (cuBLAS workspaces, HIP, XPU, the CPU allocator, older builds).
OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "HIP out of memory",
    "hipErrorOutOfMemory",
    "XPU out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def is_oom(error: BaseException | None) -> bool:
    """True when `error`, or an error it was raised from or during, is an out-of-memory error.

    The chain is followed as Python prints it: `__cause__`, else `__context__` unless the raise
    suppressed it (`raise X from None` inside an OOM handler is a deliberate new error, not an OOM).
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, PartialUpdateError):
            return False  # an update half applied: replaying would apply part of it twice
        if isinstance(error, torch.OutOfMemoryError):
            return True
        if isinstance(error, RuntimeError) and any(m in str(error) for m in OOM_MESSAGES):
            return True
        if error.__cause__ is not None:
            error = error.__cause__
        elif error.__suppress_context__:
            return False
        else:
            error = error.__context__
    return False


def summarize(error: BaseException) -> str:
    """The first line of an OOM message: the text an attempt keeps instead of the exception."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def release(device, *, model=None, optimizer=None) -> None:
    """Free what a failed attempt held; the caller has already left its `except` block.

    Gradients are dropped (the global batch is replayed from scratch), cycles that pin frames are
    collected, and the device's cache is emptied so the next plan sees the memory.
    """
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if model is not None:
        for p in model.parameters():
            p.grad = None
    _drain_autograd(device)
    gc.collect()
    device.empty_cache()


def _drain_autograd(device) -> None:
    """Run one trivial backward so the autograd engine drops what a failed backward left queued.

    Measured on torch 2.13: after an OOM inside backward, nodes still queued for the failed graph
    (with the activations they saved) stay referenced by the engine's ready queue until the next
    backward runs on that device. A scalar backward is the cheapest way to make it let go.
    """
    with torch.enable_grad(), device.host():
        x = torch.zeros((), requires_grad=True)
        (x * 1.0).backward()
    if device.type == "cuda":
        with torch.enable_grad():
            y = torch.zeros((), device=device.torch_device, requires_grad=True)
            (y * 1.0).backward()
