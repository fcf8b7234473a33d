"""One interface over a CUDA card, the simulated GPU and a plain CPU, so the runner never branches.
The interface and its three implementations read best side by side.

`open_device(budget)` picks:
- a CUDA card when one is present (a budget is enforced with `set_per_process_memory_fraction`,
  restored on exit);
- the simulated GPU of an enclosing `simulate_gpu(...)` block, or a new one when a budget is given
  on a machine without CUDA;
- else the plain CPU, where nothing is counted and nothing can run out of memory in our sense.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Mapping

import torch

from autofit.gpu.fragmentation import ExpandableSegments, cuda_allocator_settings, restored
from autofit.gpu.peaks import restore_peak
from autofit.gpu.simulate import active_gpu, round_bytes, simulate_gpu
from autofit.sizes import format_size, parse_size


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict) or hasattr(obj, "items"):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _map_tensors(obj, fn):
    """`obj` in new containers, each tensor leaf passed through `fn`, other leaves kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping) or (hasattr(obj, "data") and hasattr(obj, "items")
                                    and isinstance(getattr(obj, "data"), dict)):
        # transformers' BatchEncoding is a dict-like that keeps its encodings.
        return type(obj)({k: _map_tensors(v, fn) for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


class Device:
    """What the runner needs from the memory it runs in."""

    name = "cpu"
    type = "cpu"
    budget: int | None = None
    counts = False  # whether memory_allocated() means anything
    caps_reserved = False  # whether the budget caps reserved bytes (then the cache's layout can OOM)
    segments = None  # fragmentation.ExpandableSegments where the allocator can switch them (CUDA)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type)

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def memory_reserved(self) -> int:
        """Bytes the caching allocator holds (allocated + cached free blocks); 0 where none runs."""
        return 0

    def max_memory_reserved(self) -> int:
        return 0

    def reset_peak_memory_stats(self) -> None:
        pass

    _peaks = (0, 0)  # (allocated, reserved) maxima of the windows before the last reset

    def run_peaks(self) -> tuple[int, int]:
        """(allocated, reserved) peaks since the device was opened, through every reset autofit
        made to measure its own windows (gpu/peaks)."""
        return max(self._peaks[0], self.max_memory_allocated()), max(self._peaks[1], self.max_memory_reserved())

    def keep_peak(self, peak: int) -> None:
        """The allocated-peak counter raised back to `peak` when it reads less (gpu/peaks)."""
        restore_peak(self, peak)

    def start_run_peaks(self) -> int:
        """The run's peaks counted from now (the counters reset, the maxima before forgotten);
        returns the allocated peak read before, to put back at the end (gpu/peaks)."""
        before = self.max_memory_allocated()
        self.reset_peak_memory_stats()
        self._peaks = (0, 0)
        return before

    def _fold_peaks(self) -> None:
        """Called by a reset, before it: the window's peaks go into the run's."""
        self._peaks = self.run_peaks()

    def empty_cache(self) -> None:
        pass

    def free_bytes(self) -> int | None:
        """Bytes that may still be allocated under the budget (None: no limit known)."""
        return None

    @property
    def fault_armed(self) -> bool:
        return False

    def supports_bf16(self) -> bool:
        return True

    def place_model(self, model: torch.nn.Module) -> None:
        pass

    def place_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count the state an optimizer already holds (a warm optimizer handed over). On CUDA the
        state is where the user put it."""

    def to_device(self, batch):
        return batch

    def shares(self, tensor: torch.Tensor) -> bool:
        """Whether `to_device` hands this tensor on as it is (no copy): a loss may then write to it."""
        return True

    def host(self):
        """A context whose allocations are host memory (snapshots, offloaded optimizer state)."""
        return contextlib.nullcontext()

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is in device memory, apart from the host's (none is on the plain CPU)."""
        return False

    def host_empty(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor shaped and strided like `like` (pinned on CUDA: copies to
        and from it need no staging)."""
        return torch.empty_strided(like.size(), like.stride(), dtype=like.dtype, device="cpu")

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is host memory the device copies to without the host waiting (pinned:
        what `host_empty` makes on CUDA)."""
        return False

    def live_tensors(self) -> list[torch.Tensor]:
        """Tensors reachable from Python that hold device memory, largest first (for diagnostics)."""
        return []

    def describe(self) -> str:
        return self.name


class CpuDevice(Device):
    pass


# id -> host tensor a simulated device's host_empty made (pinned on a card), for every device
# object over any simulated GPU: a run's own and a test's see the same
_SIMULATED_PINNED = weakref.WeakValueDictionary()


class SimulatedDevice(Device):
    counts = True
    type = "cpu"

    def __init__(self, gpu):
        self.gpu = gpu
        self.budget = gpu.budget
        self.name = "simulated"
        self.caps_reserved = gpu.caps == "reserved"

    def memory_allocated(self):
        return self.gpu.memory_allocated()

    def max_memory_allocated(self):
        return self.gpu.max_memory_allocated()

    def memory_reserved(self):
        return self.gpu.memory_reserved()

    def max_memory_reserved(self):
        return self.gpu.max_memory_reserved()

    def reset_peak_memory_stats(self):
        self._fold_peaks()
        self.gpu.reset_peak_memory_stats()

    def keep_peak(self, peak: int) -> None:
        self.gpu.raise_peak(peak)

    def empty_cache(self):
        self.gpu.empty_cache()

    def free_bytes(self):
        return self.gpu.free_bytes()

    @property
    def fault_armed(self):
        return self.gpu.fault_armed

    def place_model(self, model):
        self.gpu.track(list(model.parameters()) + list(model.buffers()))

    def place_optimizer(self, optimizer):
        # State made before the simulation (outside `simulate_gpu`) lives on the card too; step
        # counters (0-dimensional) are host values on CUDA and are not counted.
        self.gpu.track(v for state in optimizer.state.values() for v in state.values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0 and not self.gpu.holds(v))

    def to_device(self, batch):
        # A copy, as a host-to-device copy would be: it is counted, and freed when the step drops it.
        return _map_tensors(batch, lambda t: t if self.gpu.holds(t) else t.clone())

    def shares(self, tensor):
        return self.gpu.holds(tensor)

    def host(self):
        return self.gpu.untracked()

    def host_empty(self, like):
        # Host memory as CUDA's would be pinned: marked so, so that a copy into it is counted as
        # one the host does not wait for (diagnosis/syncs).
        host = super().host_empty(like)
        _SIMULATED_PINNED[id(host)] = host
        return host

    def is_pinned(self, tensor):
        return _SIMULATED_PINNED.get(id(tensor)) is tensor

    def on_device(self, tensor):
        return self.gpu.holds(tensor)

    def live_tensors(self):
        live = {id(s) for s, _ in self.gpu.live_storages()}
        return _live_python_tensors(lambda t: id(t.untyped_storage()) in live)

    def describe(self):
        limit = "no limit" if self.budget is None else format_size(self.budget)
        return f"simulated GPU ({limit})"


class CudaDevice(Device):
    counts = True
    caps_reserved = True
    type = "cuda"

    def __init__(self, index: int = 0, budget=None):
        self.index = index
        # decided here, when the run is set up, never inside a recovery
        self.segments = ExpandableSegments(cuda_allocator_settings())
        self.name = torch.cuda.get_device_name(index)
        self.total_bytes = torch.cuda.get_device_properties(index).total_memory
        self.budget = None if budget is None else parse_size(budget)

    @property
    def torch_device(self):
        return torch.device("cuda", self.index)

    def capability(self) -> tuple[int, int]:
        """The card's compute capability (its library workspaces depend on it)."""
        return torch.cuda.get_device_capability(self.index)

    def memory_allocated(self):
        return torch.cuda.memory_allocated(self.index)

    def max_memory_allocated(self):
        return torch.cuda.max_memory_allocated(self.index)

    def memory_reserved(self):
        return torch.cuda.memory_reserved(self.index)

    def max_memory_reserved(self):
        return torch.cuda.max_memory_reserved(self.index)

    def reset_peak_memory_stats(self):
        self._fold_peaks()
        torch.cuda.reset_peak_memory_stats(self.index)

    def _fold_peaks(self) -> None:
        # Both peaks from one read of the allocator's statistics (torch's max_memory_allocated and
        # max_memory_reserved would each build them): a reset comes with every attempt.
        stats = torch.cuda.memory_stats(self.index)
        self._peaks = (max(self._peaks[0], stats.get("allocated_bytes.all.peak", 0)),
                       max(self._peaks[1], stats.get("reserved_bytes.all.peak", 0)))

    def empty_cache(self):
        torch.cuda.empty_cache()

    def free_bytes(self):
        free, _total = torch.cuda.mem_get_info(self.index)
        cached = torch.cuda.memory_reserved(self.index) - torch.cuda.memory_allocated(self.index)
        free += cached
        if self.budget is not None:
            free = min(free, self.budget - torch.cuda.memory_allocated(self.index))
        return free

    def supports_bf16(self):
        return torch.cuda.is_bf16_supported()

    def place_model(self, model):
        model.to(self.torch_device)

    def to_device(self, batch):
        return _map_tensors(batch, lambda t: t.to(self.torch_device, non_blocking=True))

    def shares(self, tensor):
        return tensor.device == self.torch_device

    def on_device(self, tensor):
        return tensor.device.type == "cuda"

    def host_empty(self, like):
        return torch.empty_strided(like.size(), like.stride(), dtype=like.dtype, device="cpu",
                                   pin_memory=True)

    def is_pinned(self, tensor):
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def live_tensors(self):
        return _live_python_tensors(lambda t: t.is_cuda)

    def describe(self):
        limit = "" if self.budget is None else f", budget {format_size(self.budget)}"
        return f"{self.name} ({format_size(self.total_bytes)}{limit})"


def _live_python_tensors(holds) -> list[torch.Tensor]:
    found = {}
    with warnings.catch_warnings():  # isinstance on some torch.distributed objects warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        found = _pick_tensors(objects, holds)
    return sorted(found.values(), key=lambda t: -t.untyped_storage().nbytes())


def _pick_tensors(objects, holds) -> dict:
    found = {}
    for obj in objects:
        try:
            if isinstance(obj, torch.Tensor) and holds(obj):
                found.setdefault(id(obj.untyped_storage()), obj)
        except Exception:  # objects that fail isinstance checks or have no storage
            continue
    return found


def describe_tensors(tensors, limit: int = 5) -> str:
    """'3 tensor(s), 12.00 MiB: float32[8, 128, 768], ...' for error messages."""
    tensors = list(tensors)
    total = sum(round_bytes(t.untyped_storage().nbytes()) for t in tensors)
    shown = ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in tensors[:limit])
    more = f" and {len(tensors) - limit} more" if len(tensors) > limit else ""
    return f"{len(tensors)} tensor(s), {format_size(total)}: {shown}{more}"


@contextlib.contextmanager
def _peak_kept(device):
    """`device`, whose allocated-peak counter reads the run's maximum again on exit (gpu/peaks)."""
    before = device.start_run_peaks()
    try:
        yield device
    finally:
        device.keep_peak(max(before, device.run_peaks()[0]))


@contextlib.contextmanager
def open_device(budget=None):
    """The device a run uses; restores whatever it changed on exit."""
    gpu = active_gpu()
    if gpu is not None:
        if budget is not None and parse_size(budget) != gpu.budget:
            raise ValueError(
                f"budget={budget!r} was given inside simulate_gpu({gpu.budget}); pass one or the other.")
        with _peak_kept(SimulatedDevice(gpu)) as device:  # the user's simulate_gpu: they read its peak
            yield device
        return
    if torch.cuda.is_available():
        device = CudaDevice(torch.cuda.current_device(), budget)
        if device.budget is None:
            with restored(device), _peak_kept(device):
                yield device
            return
        fraction = min(device.budget / device.total_bytes, 1.0)
        previous = torch.cuda.get_per_process_memory_fraction(device.index)
        torch.cuda.set_per_process_memory_fraction(fraction, device.index)
        try:
            with restored(device), _peak_kept(device):
                yield device
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, device.index)
        return
    if budget is None:
        yield CpuDevice()
        return
    with simulate_gpu(budget) as gpu:
        yield SimulatedDevice(gpu)
