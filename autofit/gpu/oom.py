"""The one place that recognises an out-of-memory error and frees what a failed attempt held."""

from __future__ import annotations

import gc

import torch

from autofit.errors import PartialUpdateError, chain

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
    for link in chain(error):
        if isinstance(link, PartialUpdateError):
            return False  # an update half applied: replaying would apply part of it twice
        if isinstance(link, torch.OutOfMemoryError):
            return True
        if isinstance(link, RuntimeError) and any(m in str(link) for m in OOM_MESSAGES):
            return True
    return False


def summarize(error: BaseException) -> str:
    """The first line of an OOM message: the text an attempt keeps instead of the exception."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def release(device, *, model=None, optimizer=None, settled=None) -> None:
    """Free what a failed attempt held; the caller has already left its `except` block.

    Gradients are dropped (the global batch is replayed from scratch), cycles that pin frames are
    collected (`collect`, as far as `settled() -> bool` needs: memory back at the pre-attempt
    baseline), and the device's cache is emptied so the next plan sees the memory.
    """
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if model is not None:
        for p in model.parameters():
            p.grad = None
    _drain_autograd(device)
    collect(settled)
    device.empty_cache()


def collect(settled=None) -> int:
    """Collect the reference cycles that may still hold device memory, no further than needed;
    returns the oldest generation collected (-1: none).

    A full `gc.collect()` walks every object alive (~400k with torch and transformers loaded:
    0.2-0.9 s measured here), though the cycles a failed attempt leaves (its frames, their
    traceback, the exception) were all made during the attempt and sit in the young generations.
    With `settled() -> bool` (memory is back where it must be, read on a device that counts its
    bytes): nothing when it already is, then the young generations (milliseconds), and the full
    collection only when memory is still held after that; so what a full collection would free is
    freed whenever it is needed, and a caller's check after this sees the same memory as before.
    Without `settled` (nothing to read), the full collection.
    """
    if settled is None:
        gc.collect()
        return 2
    collected = -1
    for generation in (1, 2):  # gc.collect(1): generations 0 and 1
        if settled():
            break
        gc.collect(generation)
        collected = generation
    return collected


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
