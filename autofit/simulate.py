"""Simulated GPU: a memory budget enforced on CPU tensors by counting live storage bytes.

A TorchDispatchMode sees every op; each new storage an op returns is counted (rounded up to 512
bytes like the CUDA caching allocator) until its Python object dies, which a weak reference reports.
Going over the budget raises the real `torch.OutOfMemoryError` with CUDA's message shape, so code
under test takes exactly the path it would take on a card. Faults can also be injected at the k-th
allocation, which is how tests prove that every allocation of a step is survivable.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .sizes import format_size, parse_size

ROUNDING = 512

_active = threading.local()


def round_bytes(nbytes: int) -> int:
    return -(-nbytes // ROUNDING) * ROUNDING


def active_gpu() -> "SimulatedGPU | None":
    """The simulated GPU whose context this thread is in, if any."""
    return getattr(_active, "gpu", None)


class SimulatedGPU:
    """Live-bytes counter with an optional budget. Use through `simulate_gpu(...)`."""

    name = "simulated"

    def __init__(self, budget=None):
        self.budget = None if budget is None else parse_size(budget)
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._allocated = 0
        self._peak = 0
        self._allocations = 0
        self._fail_at: int | None = None
        self._counting = 0  # > 0 inside untracked(): host memory, not counted

    # -- the counters, named as torch.cuda's ---------------------------------------------------
    def memory_allocated(self) -> int:
        return self._allocated

    def max_memory_allocated(self) -> int:
        return self._peak

    def reset_peak_memory_stats(self) -> None:
        self._peak = self._allocated

    @property
    def allocation_count(self) -> int:
        """How many storages have been allocated on this GPU so far (fault injection counts these)."""
        return self._allocations

    def free_bytes(self) -> int | None:
        return None if self.budget is None else self.budget - self._allocated

    # -- fault injection ----------------------------------------------------------------------
    def fail_at(self, index: int | None) -> None:
        """Make the allocation with this `allocation_count` index raise OOM once (None disarms)."""
        if index is not None and index < 0:
            raise ValueError(f"fail_at index must be >= 0 but got {index}.")
        self._fail_at = index

    @property
    def fault_armed(self) -> bool:
        return self._fail_at is not None

    # -- what lives on the device --------------------------------------------------------------
    def track(self, tensors) -> None:
        """Count tensors made before the simulation started (the model after it is 'moved' here)."""
        self._account(list(tensors), check=False)

    def holds(self, tensor: torch.Tensor) -> bool:
        return id(tensor.untyped_storage()) in self._live

    def live_storages(self) -> list[tuple[torch.UntypedStorage, int]]:
        out = []
        for ref, nbytes in list(self._live.values()):
            storage = ref()
            if storage is not None:
                out.append((storage, nbytes))
        return out

    @contextlib.contextmanager
    def untracked(self):
        """Allocations inside are host memory: not counted, never failing."""
        self._counting += 1
        try:
            yield
        finally:
            self._counting -= 1

    # -- accounting ----------------------------------------------------------------------------
    def _forget(self, key: int, nbytes: int) -> None:
        if self._live.pop(key, None) is not None:
            self._allocated -= nbytes

    def _storage_bytes(self, storage) -> int:
        return storage.nbytes()

    def _account(self, tensors, check: bool = True, inputs=()) -> None:
        fresh = []
        given = None  # storages of the op's inputs: outputs that share one were not allocated by it
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            nbytes = round_bytes(self._storage_bytes(storage))
            known = self._live.get(key)
            if known is not None:
                if known[1] != nbytes:  # resized in place (out= ops, resize_)
                    fresh.append((storage, key, nbytes - known[1], nbytes))
                continue
            if inputs:
                if given is None:
                    given = {id(i.untyped_storage()) for i in inputs if isinstance(i, torch.Tensor)}
                if key in given:
                    continue  # a view of, or an in-place write to, memory made outside the simulation
            if all(key != f[1] for f in fresh):  # empty ones too: resize_ may grow them later
                fresh.append((storage, key, nbytes, nbytes))
        if not fresh:
            return
        if check:
            for storage, key, extra, nbytes in fresh:
                if extra == 0:
                    continue  # an empty storage allocates nothing
                if self._fail_at is not None and self._allocations == self._fail_at:
                    self._fail_at = None
                    self._allocations += 1
                    raise self._oom(extra, injected=True)
                self._allocations += 1
            need = sum(f[2] for f in fresh)
            if self.budget is not None and self._allocated + need > self.budget:
                raise self._oom(need)
        for storage, key, extra, nbytes in fresh:
            self._live[key] = (weakref.ref(storage, _forgetter(self, key, nbytes)), nbytes)
            self._allocated += extra
        self._peak = max(self._peak, self._allocated)

    def _oom(self, need: int, injected: bool = False) -> torch.OutOfMemoryError:
        budget = "unlimited" if self.budget is None else format_size(self.budget)
        free = "unlimited" if self.budget is None else format_size(max(self.budget - self._allocated, 0))
        why = " (injected fault)" if injected else ""
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(need)}. GPU 0 has a total capacity of "
            f"{budget} of which {free} is free. Of the allocated memory "
            f"{format_size(self._allocated)} is allocated by PyTorch (simulated GPU){why}.")


def _forgetter(gpu: SimulatedGPU, key: int, nbytes: int):
    gpu_ref = weakref.ref(gpu)

    def forget(_ref):
        g = gpu_ref()
        if g is not None:
            entry = g._live.get(key)
            if entry is not None and entry[0] is _ref:
                g._forget(key, entry[1])
    return forget


class _CountingMode(TorchDispatchMode):
    def __init__(self, gpu: SimulatedGPU):
        super().__init__()
        self.gpu = gpu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.gpu._counting:
            self.gpu._account(tree_leaves(out), inputs=tree_leaves((args, kwargs)))
        return out


@contextlib.contextmanager
def simulate_gpu(budget=None):
    """CPU tensors made inside count against `budget` bytes ("2GiB", an int, or None: no limit).

    >>> with simulate_gpu("2GiB") as gpu:
    ...     x = torch.zeros(1024)
    ...     gpu.memory_allocated()
    4096
    """
    if active_gpu() is not None:
        raise RuntimeError("simulate_gpu contexts cannot be nested; use the GPU you already have.")
    gpu = SimulatedGPU(budget)
    _active.gpu = gpu
    try:
        with _CountingMode(gpu):
            yield gpu
    finally:
        _active.gpu = None
