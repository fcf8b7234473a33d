"""Fragmentation as a move: an OOM that the cache's layout caused is retried at the same plan once
the cache is freed, before the plan steps down.

On a card an OOM is a reservation the caching allocator cannot make. Before it raises, the allocator
has already released every cached segment that is wholly free, so what it still holds unallocated
(`reserved - allocated`) are holes in segments that live tensors share: a request can fail although
the budget has room for it, in pieces. Such a failure says little about the plan. Once the failed
attempt's tensors are gone those segments are wholly free, `empty_cache()` gives them back, and the
same plan replayed from an empty cache gets segments cut to its own requests. On CUDA, expandable
segments (one segment per pool that grows page by page) also stop the holes from coming back.

The threshold (`fragmented`): freeing the holes would have made room for the segment the failed
request needed. A request takes a new segment of `allocator.segment_size` (2 MiB for requests up
to 1 MiB, 20 MiB under 10 MiB, else the request rounded up to 2 MiB), so the failure is the cache's
doing when that segment fits in the budget's free bytes counting the holes as free
(`device.free_bytes()`), and not without them. Then a replay from an empty cache can succeed; when
the holes are smaller than what the segment lacks, no freeing can (seed 004's card: 0.75 GiB of
14.59 GiB reserved unallocated and 24.81 MiB free, for a 120 MiB request, passes). A failure
without a request size in its message (cuBLAS, plain `CUDA error: out of memory`) is not treated as
fragmentation. The replay is tried once per global batch and plan, so a wrong guess costs one
attempt.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Callable

import torch

from autofit import torch_internals as ti
from autofit.errors import chain
from autofit.gpu.allocator import round_size, segment_size
from autofit.gpu.simulate import INJECTED
from autofit.sizes import format_size

_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) ?(bytes|KiB|MiB|GiB|TiB)")
_SCALE = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_EXPANDABLE = "expandable_segments"
_OFF = f"{_EXPANDABLE}:False"
# Settings strings a run put back, in this process (the allocator is the process's): their explicit
# False is autofit's, not the user's choice, when a later run reads them.
_RESTORED: set = set()


@dataclass(frozen=True)
class Fragmentation:
    """What the allocator held at a failure: `unallocated` = reserved - allocated bytes."""

    request: int | None   # bytes the failed allocation asked for (from the message)
    reserved: int
    unallocated: int
    free: int | None      # bytes the budget still had for tensors, cached holes included

    @property
    def segment(self) -> int | None:
        """The new segment the failed request needed."""
        return None if self.request is None else segment_size(round_size(self.request))

    @property
    def fragmented(self) -> bool:
        if self.segment is None or self.free is None:
            return False
        return self.free - self.unallocated < self.segment <= self.free

    def describe(self) -> str:
        return (f"{format_size(self.unallocated)} of {format_size(self.reserved)} reserved was "
                f"unallocated when a {format_size(self.segment or 0)} segment for "
                f"{format_size(self.request or 0)} could not be reserved")


def measure(device, error: BaseException) -> Fragmentation | None:
    """The allocator's figures at a failure; call it inside the `except` block, while the failed
    attempt's tensors still hold their blocks. None where the budget does not cap reserved bytes
    (the plain CPU, a simulated GPU capping allocated bytes): there the cache never causes an OOM;
    None for a fault injected on the simulated GPU."""
    if not getattr(device, "caps_reserved", False) or INJECTED in str(error):
        return None  # an injected fault is not the cache's doing
    reserved, allocated = device.memory_reserved(), device.memory_allocated()
    return Fragmentation(requested(error), reserved, max(reserved - allocated, 0), device.free_bytes())


def requested(error: BaseException | None) -> int | None:
    """The bytes an OOM message says were asked for ("Tried to allocate 20.00 MiB"), following the
    chain of causes as `oom.is_oom` does (`errors.chain`); None when no message says."""
    for link in chain(error):
        match = _REQUEST.search(str(link))
        if match:
            return int(float(match.group(1)) * _SCALE[match.group(2)])
    return None


def free(device) -> str:
    """Free what fragments the device; returns what was done, for the attempt's reason."""
    done = []
    if device.segments is not None and device.segments.switch_on():
        done.append("switched on expandable segments")
    device.empty_cache()
    return ", ".join(["emptied the cache"] + done)


# -- CUDA: expandable segments, switched on while running -------------------------------------------

@dataclass(frozen=True)
class AllocatorSettings:
    """Run-time access to the caching allocator's settings string (PYTORCH_ALLOC_CONF's syntax)."""

    read: Callable[[], str]
    write: Callable[[str], None]


def cuda_allocator_settings() -> AllocatorSettings | None:
    """This process's access to CUDA's allocator settings, or None where switching is not
    possible: a torch without a run-time getter (before 2.12: said once per process by
    `torch_internals.supported`, when the device is opened), or the cudaMallocAsync backend."""
    if not ti.supported(ti.ALLOCATOR_SETTINGS) or torch.cuda.get_allocator_backend() != "native":
        return None
    return AllocatorSettings(ti.allocator_settings, ti.set_allocator_settings)


class ExpandableSegments:
    """Expandable segments switched on after fragmentation, for the rest of a run, and the settings
    the run found put back when it ends. One per opened CUDA device.

    PyTorch reads the option each time it makes a new segment (CUDACachingAllocator.cpp,
    `alloc_block`: `CUDAAllocatorConfig::expandable_segments()`), so it can be switched after the
    first allocation; segments made before stay fixed until `empty_cache()` releases them. It does
    nothing for private pools (CUDA graphs, MemPool), and is left alone when the user chose a value
    (in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF or at run time). Settings are parsed as a whole
    (options left out return to their defaults), so the current string is extended.
    """

    def __init__(self, settings: AllocatorSettings | None, environ=os.environ):
        self.settings = settings
        self.environ = environ
        self.before: str | None = None  # the settings found, once this switched them

    def switch_on(self) -> bool:
        """Turn expandable segments on for the segments made from now on; False when not allowed."""
        if self.settings is None:
            return False
        current = self.settings.read()
        if current in _RESTORED:  # what a previous run put back: the default, not a choice
            current = current[:-len(_OFF)].rstrip(",")
        new = with_expandable_segments(current, self.environ)
        if new is None:
            return False
        self.settings.write(new)
        if self.before is None:
            self.before = current
        return True

    def restore(self) -> None:
        """Put back the settings `switch_on` changed (nothing when it changed none)."""
        if self.before is None:
            return
        # Off again explicitly: an empty string may leave the parsed options as they are.
        back = ",".join(s for s in (self.before, _OFF) if s)
        _RESTORED.add(back)
        self.settings.write(back)
        self.before = None


def with_expandable_segments(settings: str, environ) -> str | None:
    """`settings` with expandable segments on; None when the user already chose a value."""
    chosen = [settings] + [environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")]
    if any(_EXPANDABLE in s for s in chosen):
        return None
    return ",".join(s for s in (settings.strip(), f"{_EXPANDABLE}:True") if s)


@contextlib.contextmanager
def restored(device):
    """Put back the allocator settings the device's run switched, on exit."""
    try:
        yield device
    finally:
        if device.segments is not None:
            device.segments.restore()


def retry_reason(device, found: Fragmentation | None) -> str | None:
    """When `found` is fragmentation: free the device's cache (see `free`) and return the reason
    for replaying the same plan; else None (the ladder steps down)."""
    if found is None or not found.fragmented:
        return None
    return f"fragmentation: {found.describe()}; {free(device)}, then the same plan again"
