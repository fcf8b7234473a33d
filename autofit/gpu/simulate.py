"""Simulated GPU: a memory budget enforced on CPU tensors, allocated as CUDA's caching allocator does.
The budget object, the dispatch mode that counts and the storage-death and resize
watches are one mechanism whose bookkeeping must agree; the allocator rules are in `allocator`.

A TorchDispatchMode sees every op; each new storage an op returns is counted (rounded up to 512
bytes like the CUDA caching allocator) until its Python object dies, which a weak reference reports.
Each storage also takes a block from a model of the caching allocator (`allocator.py`), so the
simulated GPU knows what a card would *reserve* (segments, cached free blocks, fragmentation).
With `caps="reserved"` the budget caps reserved bytes as `set_per_process_memory_fraction` does,
and a reservation that cannot be made, even after the cache is released, is the OOM. The default,
`caps="allocated"`, caps live bytes, which is what budgets of tiny test models are sized by (a
budget under one 2 MiB segment means nothing to a caching allocator). Either way an OOM raises the
real `torch.OutOfMemoryError` with CUDA's message shape, so code under test takes exactly the path
it would take on a card. Faults can also be injected at the k-th allocation, which
is how tests prove that every allocation of a step is survivable.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
import weakref

import torch

from autofit import torch_internals as ti
from autofit.gpu.allocator import AllocationFailed, CachingAllocator
from autofit.gpu.workspaces import BLAS_OPS, KERNEL_THREADS, Workspaces
from autofit.sizes import format_size, parse_size

ROUNDING = 512
CAPS = ("allocated", "reserved")  # what a simulated GPU's budget limits
INJECTED = "(injected fault)"  # in the message of an OOM that fail_at() caused

_active = threading.local()


def round_bytes(nbytes: int) -> int:
    return -(-nbytes // ROUNDING) * ROUNDING


def inner_tensors(tensors) -> list:
    """`tensors` with each wrapper subclass (DTensor: a sharded parameter, its gradient and its
    optimizer state) replaced by the tensors it wraps: a wrapper's own storage is a placeholder of
    the global shape, the memory is its local shard's. A sparse COO tensor (an Embedding's sparse
    gradient) is replaced by its indices and values."""
    if not isinstance(tensors, (list, tuple)):
        tensors = list(tensors)  # a generator (memory.by_kind's walk) must be read once only
    if all(type(t) is torch.Tensor and t.layout is torch.strided for t in tensors):
        return tensors  # what ops return almost always: nothing to unwrap
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout is torch.sparse_coo:
            out.extend(ti.sparse_parts(t))  # a sparse tensor's memory is these two
        elif type(t) is not torch.Tensor and ti.is_wrapper_subclass(t):
            inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
            out.extend(inner_tensors([i for i in inner if isinstance(i, torch.Tensor)]))
        else:
            out.append(t)
    return out


def active_gpu() -> "SimulatedGPU | None":
    """The simulated GPU whose context this thread is in, if any."""
    return getattr(_active, "gpu", None)


class SimulatedGPU:
    """Live-bytes counter and caching-allocator model with an optional budget on reserved bytes.
    Use through `simulate_gpu(...)`."""

    name = "simulated"

    def __init__(self, budget=None, expandable_segments: bool = False, caps: str = "allocated",
                 workspaces: Workspaces | None = None):
        ti.require(ti.SIMULATED)
        if caps not in CAPS:
            raise ValueError(f"caps must be one of {', '.join(CAPS)} but got {caps!r}.")
        self.budget = None if budget is None else parse_size(budget)
        self.caps = caps
        self.allocator = CachingAllocator(self.budget if caps == "reserved" else None,
                                          expandable=expandable_segments)
        # storage key -> (weak reference, counted bytes, the allocator's block)
        self._live: dict[int, tuple[weakref.ref, int, object]] = {}
        self._allocated = 0
        self._peak = 0
        self._allocations = 0
        self._fail_at: int | None = None
        self._counting = 0  # > 0 inside untracked(): host memory, not counted
        self._ref_keys: dict[int, int] = {}  # id(weak reference) -> storage key
        self._dead = _death_callback(weakref.ref(self))  # one callback for every storage
        # A card's own bytes (gpu/workspaces): each kernel thread's first cuBLAS kernel takes its
        # workspace, kept to the end; and c10's count of a block handed out whole as allocated.
        self.workspaces = workspaces
        self.whole_blocks = workspaces is not None
        self._threads_pending = set(KERNEL_THREADS) if workspaces is not None else set()
        self._workspace_blocks: list = []

    # -- the counters, named as torch.cuda's ---------------------------------------------------
    def memory_allocated(self) -> int:
        return self._allocated

    def max_memory_allocated(self) -> int:
        return self._peak

    def memory_reserved(self) -> int:
        """Bytes the caching allocator holds: allocated blocks, cached free blocks, split remainders."""
        return self.allocator.reserved

    def max_memory_reserved(self) -> int:
        return self.allocator.max_reserved

    def empty_cache(self) -> None:
        """Release every cached segment that is wholly free, as torch.cuda.empty_cache() does."""
        self.allocator.release_cached()

    def reset_peak_memory_stats(self) -> None:
        self._peak = self._allocated
        self.allocator.reset_peak()

    def raise_peak(self, peak: int) -> None:
        """The allocated-peak counter reads at least `peak` (a run's maximum, put back after autofit's
        own resets: gpu/peaks). Set, not allocated: the counter is this object's own, and an
        allocation would be one more for fault injection to count, which training never made."""
        self._peak = max(self._peak, peak)

    @property
    def allocation_count(self) -> int:
        """How many storages have been allocated on this GPU so far (fault injection counts these)."""
        return self._allocations

    def free_bytes(self) -> int | None:
        """Bytes that may still be allocated: the budget less what live tensors hold (cached free
        blocks count as free, as on CUDA, where they are released before an OOM)."""
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
        if tensor.layout is torch.sparse_coo:
            tensor = ti.sparse_values(tensor)
        return id(tensor.untyped_storage()) in self._live

    def live_storages(self) -> list[tuple[torch.UntypedStorage, int]]:
        out = []
        for ref, nbytes, _block in list(self._live.values()):
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
    def _charge(self, nbytes: int, block) -> int:
        """The allocated bytes a storage of `nbytes` in `block` counts: on a card (`whole_blocks`)
        the block's, which c10 hands out whole when splitting would leave too little (a large-pool
        remainder of at most 1 MiB); else the rounded request."""
        return block.size if self.whole_blocks and block is not None else nbytes

    def _forget(self, key: int, nbytes: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._allocated -= self._charge(nbytes, entry[2])
            if entry[2] is not None:
                self.allocator.free(entry[2])

    def kernel_ran(self) -> None:
        """A cuBLAS kernel ran: the first on its thread (backward runs on autograd's device thread)
        takes that thread's workspaces, as a card's handle pool does."""
        thread = KERNEL_THREADS[1] if ti.graph_task_id() != -1 else KERNEL_THREADS[0]
        if thread in self._threads_pending:
            self._threads_pending.discard(thread)
            for nbytes in self.workspaces.first(thread):
                self._take_workspace(nbytes)

    def take_workspaces(self) -> None:
        """Every kernel thread's workspaces, as they are from a run's first backward on."""
        for thread in KERNEL_THREADS:
            if thread in self._threads_pending:
                self._threads_pending.discard(thread)
                for nbytes in self.workspaces.first(thread):
                    self._take_workspace(nbytes)

    def _take_workspace(self, nbytes: int) -> None:
        if self.caps == "allocated" and self.budget is not None and self._allocated + nbytes > self.budget:
            raise self._oom(nbytes)
        try:
            block = self.allocator.malloc(nbytes)
        except AllocationFailed:
            raise self._oom(nbytes) from None
        self._workspace_blocks.append(block)
        charged = self._charge(nbytes, block)
        self._allocated += charged
        self._peak = max(self._peak, self._allocated)
        self._workspace_taken(charged)

    def _workspace_taken(self, nbytes: int) -> None:
        """Hook: `nbytes` of workspace were counted as allocated."""

    def _storage_bytes(self, storage) -> int:
        return storage.nbytes()

    def _account(self, tensors, check: bool = True, inputs=()) -> None:
        fresh = []
        given = None  # storages of the op's inputs: outputs that share one were not allocated by it
        live = self._live
        for t in inner_tensors(tensors):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            nbytes = -(-self._storage_bytes(storage) // ROUNDING) * ROUNDING
            known = live.get(key)
            if known is not None:
                if known[1] != nbytes:  # resized in place (out= ops, resize_)
                    fresh.append((storage, key, nbytes - known[1], nbytes))
                continue
            if inputs:
                if given is None:
                    given = {id(i.untyped_storage()) for i in inner_tensors(_tensors(inputs))}
                if key in given:
                    continue  # a view of, or an in-place write to, memory made outside the simulation
            if not fresh or all(key != f[1] for f in fresh):  # empty ones too: resize_ may grow them
                fresh.append((storage, key, nbytes, nbytes))
        if fresh:
            self._commit(fresh, check)

    def _resized(self, storage) -> None:
        """`storage.resize_(n)` was called: no op reaches the dispatcher, so it is said here (FSDP2
        frees each all-gathered parameter so after use and refills it at the next all-gather)."""
        key = id(storage)
        nbytes = -(-self._storage_bytes(storage) // ROUNDING) * ROUNDING
        known = self._live.get(key)
        if known is None and nbytes:
            self._commit([(storage, key, nbytes, nbytes)], True)
        elif known is not None and known[1] != nbytes:
            self._commit([(storage, key, nbytes - known[1], nbytes)], True)

    def _commit(self, fresh, check: bool) -> None:
        """Count new or resized storages: (storage, key, bytes added, bytes now) each."""
        live = self._live
        if check:
            for storage, key, extra, nbytes in fresh:
                if extra <= 0:
                    continue  # an empty or shrunk storage allocates nothing
                if self._fail_at is not None and self._allocations == self._fail_at:
                    self._fail_at = None
                    self._allocations += 1
                    raise self._oom(extra, injected=True)
                self._allocations += 1
            if self.caps == "allocated" and self.budget is not None:
                need = sum(f[2] for f in fresh)
                if self._allocated + need > self.budget:
                    raise self._oom(need)
        blocks, malloc = [], self.allocator.malloc
        try:
            for storage, key, extra, nbytes in fresh:
                # A storage grown in place (resize_) gets a new block; its old one is freed below.
                blocks.append(malloc(nbytes, check) if nbytes else None)
        except AllocationFailed:
            for block in blocks:
                if block is not None:
                    self.allocator.free(block)
            raise self._oom(sum(f[2] for f in fresh)) from None
        for (storage, key, extra, nbytes), block in zip(fresh, blocks):
            old = live.get(key)
            if old is None:
                ref = weakref.ref(storage, self._dead)
                self._ref_keys[id(ref)] = key
                before = 0
            else:  # resized in place: its old block goes back, its weak reference stays
                before = self._charge(old[1], old[2])
                if old[2] is not None:
                    self.allocator.free(old[2])
                ref = old[0]
            live[key] = (ref, nbytes, block)
            self._allocated += self._charge(nbytes, block) - before
        if self._allocated > self._peak:
            self._peak = self._allocated

    def _oom(self, need: int, injected: bool = False) -> torch.OutOfMemoryError:
        budget = "unlimited" if self.budget is None else format_size(self.budget)
        reserved = self.allocator.reserved
        used = reserved if self.caps == "reserved" else self._allocated
        free = "unlimited" if self.budget is None else format_size(max(self.budget - used, 0))
        why = f" {INJECTED}" if injected else ""
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(need)}. GPU 0 has a total capacity of "
            f"{budget} of which {free} is free. Of the allocated memory "
            f"{format_size(self._allocated)} is allocated by PyTorch (simulated GPU){why}, and "
            f"{format_size(max(reserved - self._allocated, 0))} is reserved by PyTorch but unallocated.")


def _tensors(obj) -> list:
    """The tensors in an op's arguments or results (tensors, lists, tuples, dicts), in order: a
    plain walk, several times cheaper per op than pytree's."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    out = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return out


def _death_callback(gpu_ref):
    """What a storage's weak reference calls when the storage dies (the GPU held weakly: storages
    may outlive the simulation)."""
    def dead(ref):
        g = gpu_ref()
        if g is not None:
            key = g._ref_keys.pop(id(ref), None)
            entry = g._live.get(key)
            if entry is not None and entry[0] is ref:
                g._forget(key, entry[1])
    return dead


_counters = threading.local()  # .stack: the counters this thread is in, innermost last
_resize_lock = threading.Lock()
_resize_users = 0
_storage_resize = ti.storage_resize()


def _counted_resize(storage, nbytes):
    """UntypedStorage.resize_ while a counter runs: resized as asked, then told to the innermost
    counter of this thread (its mode never sees it: a storage method, not an op)."""
    out = _storage_resize(storage, nbytes)
    stack = getattr(_counters, "stack", None)
    if stack and not stack[-1]._counting:
        stack[-1]._resized(storage)
    return out


def _watch_resizes(on: bool) -> None:
    """Route UntypedStorage.resize_ through `_counted_resize` while any counter runs (any thread)."""
    global _resize_users
    with _resize_lock:
        _resize_users += 1 if on else -1
        if on and _resize_users == 1:
            torch.storage.UntypedStorage.resize_ = _counted_resize
        elif not on and _resize_users == 0:
            del torch.storage.UntypedStorage.resize_


def _count(self, func, types, args=(), kwargs=None):
    """`_CountingMode.__torch_dispatch__`: run the op, then count the storages it made."""
    out = func(*args, **(kwargs or {}))
    if not self.gpu._counting:
        allocates = _ALLOCATES.get(func)
        if allocates is None:
            allocates = _ALLOCATES[func] = _may_allocate(func)
        if allocates:
            # inputs are looked at only where an output may share their storage (ALIASES)
            self.gpu._account(_tensors(out), inputs=(args, kwargs) if allocates is ALIASES else ())
        if self.gpu._threads_pending and getattr(func, "overloadpacket", None) in _BLAS:
            self.gpu.kernel_ran()
    return out


def _skipped_by_dynamo(fn) -> bool:
    """Mark `fn` so that torch.compile's frame evaluation runs it, and the frames it calls, as they
    are (what torch._disable_dynamo ensures with a wrapper around every op).
    False where this torch has no such switch."""
    return ti.skip_dynamo(fn)


_SKIPPED = _skipped_by_dynamo(_count)


class _CountingMode(ti.TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not _SKIPPED  # torch's own wrapper only where the code could not be marked

    def __init__(self, gpu: SimulatedGPU):
        super().__init__()
        self.gpu = gpu

    def __enter__(self):
        out = super().__enter__()
        if not hasattr(_counters, "stack"):
            _counters.stack = []
        _counters.stack.append(self.gpu)
        _watch_resizes(True)
        return out

    def __exit__(self, *exc):
        _watch_resizes(False)
        _counters.stack.pop()
        return super().__exit__(*exc)

    __torch_dispatch__ = _count


_ALLOCATES: dict = {}  # op -> False, FRESH or ALIASES (see _may_allocate)
_BLAS = {getattr(torch.ops.aten, name) for name in BLAS_OPS if hasattr(torch.ops.aten, name)}
_RESIZING = {"resize_", "resize_as_", "set_", "_resize_output_"}
FRESH, ALIASES = "fresh", "aliases"


def _may_allocate(func):
    """False for ops whose every result aliases an input without resizing it: views (view,
    transpose, expand, detach, ...) and in-place ops other than resizing ones and out= variants.
    Skipping them is most of what keeps the counter cheap per op. FRESH for ops whose schema says
    every result is a new tensor (their inputs need no look), ALIASES for the others: results that
    may be an input's storage, resized, and the `unsafe` ops whose schema does not say they alias
    (`_unsafe_view`, `unsafe_split`: the exceptions PyTorch's own SchemaCheckMode allows)."""
    schema = ti.op_schema(func)
    if schema is None or not schema.returns:
        return ALIASES if schema is None else False
    name = schema.name.split("::")[-1]
    if name in _RESIZING or "unsafe_" in name:
        return ALIASES
    if all(r.alias_info is None for r in schema.returns):
        return FRESH
    if any(r.alias_info is None for r in schema.returns):
        return ALIASES  # a new tensor beside an aliased one
    # every result aliases an input: a view, an in-place op, or an out= variant (which may resize)
    return ALIASES if not name.endswith("_") and any(r.alias_info.is_write for r in schema.returns) else False


@contextlib.contextmanager
def simulate_gpu(budget: int | float | str | None = None, *, caps: str = "allocated",
                 expandable_segments: bool = False,
                 capability: tuple[int, int] | None = None) -> Iterator[SimulatedGPU]:
    """CPU tensors made inside count against `budget` bytes ("2GiB", an int, or None: no limit).

    `caps="allocated"` limits live tensor bytes; `caps="reserved"` limits what the modelled caching
    allocator reserves, as on a card. `expandable_segments=True` models
    `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`. `capability` (a card's compute capability,
    `(9, 0)` for Hopper) makes it hold what such a card's own libraries allocate: the cuBLAS and
    cuBLASLt workspaces from each kernel thread's first matrix product on, and blocks handed out
    whole counted whole (`autofit.gpu.workspaces`); without it, only tensors are counted.

    >>> with simulate_gpu("2GiB") as gpu:
    ...     x = torch.zeros(1024)
    ...     gpu.memory_allocated(), gpu.memory_reserved()
    (4096, 2097152)
    """
    if active_gpu() is not None:
        raise RuntimeError("simulate_gpu contexts cannot be nested; use the GPU you already have.")
    if not isinstance(expandable_segments, bool):
        raise TypeError(f"expandable_segments must be True or False but got {expandable_segments!r}.")
    workspaces = None if capability is None else Workspaces.of_capability(capability)
    gpu = SimulatedGPU(budget, expandable_segments, caps, workspaces)
    _active.gpu = gpu
    try:
        with _CountingMode(gpu):
            yield gpu
    finally:
        _active.gpu = None
