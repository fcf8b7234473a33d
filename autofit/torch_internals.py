"""Every private name of torch (outside torch.distributed, whose are in
`autofit.distributed.internals`) that autofit uses, in this one module. Each is a small named
function or constant saying what it is and why autofit needs it; `FEATURES` lists them by the autofit
feature that needs them. A feature is either required (`require(feature)`, called before the first
step that needs it: a torch that lacks one of its names is refused, naming it, the torch found and
the oldest torch that has it) or optional (`supported(feature)`, asked once per process when the run
is set up: a torch that lacks one gets one log line saying what is skipped, and the plain behaviour).
Written against torch 2.13; the versions CI runs are in README's "Supported versions". Imports
nothing of autofit but its exceptions: every layer may use it."""

from __future__ import annotations

import functools
import importlib
import logging

import torch
# The base of the simulated GPU's counter (a class to subclass, so named at import: torch has had
# it since 2.0, and autofit needs torch).
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

TESTED_WITH = "2.13"
log = logging.getLogger("autofit")


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.11.0+cu130" -> (2, 11)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_VERSION = version_tuple(torch.__version__)  # the feature flags below are decided from it once


from autofit.errors import MissingInternal  # noqa: E402  (errors imports nothing of autofit)


def _resolve(path: str):
    """The object at dotted `path` (a module prefix, then attributes); AttributeError if absent."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise AttributeError(path)


def present(path: str) -> bool:
    """Whether the object at dotted `path` exists in this torch (or library)."""
    try:
        _resolve(path)
        return True
    except (AttributeError, ImportError, RuntimeError):
        return False


def _module_has(name: str) -> bool:
    # nn.Module's per-instance dicts are made in __init__: looked for on a fresh module
    return name in vars(torch.nn.Module())


SIMULATED = "the simulated GPU and the estimator's memory counter"
REPLAY = "replaying a global batch from the same state"
ALLOCATOR_SETTINGS = "expandable segments after fragmentation"

# What each autofit feature reads of torch's private names: dotted paths, or ("nn.Module", name)
# for the attributes nn.Module.__init__ makes on each instance.
FEATURES = {
    SIMULATED: (
        "torch.utils._python_dispatch.TorchDispatchMode",
        "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
        "torch._C.StorageBase.resize_",
        "torch.UntypedStorage._cdata",
        "torch.Tensor._indices", "torch.Tensor._values",
        "torch.ops.aten.add.default._schema"),
    "the fake-tensor estimator": (
        "torch._subclasses.fake_tensor.FakeTensorMode",
        "torch._subclasses.fake_tensor.FakeTensor",
        "torch.utils._python_dispatch._disable_current_modes",
        "torch.ops.aten._scaled_dot_product_flash_attention",
        "torch.ops.aten._scaled_dot_product_efficient_attention"),
    "CUDA's autocast policies in the estimator": (
        "torch._C.DispatchKey", "torch._C.DispatchKeySet", "torch._C._ExcludeDispatchKeyGuard",
        "torch._C._dispatch_has_kernel_for_dispatch_key", "torch.library.Library._destroy"),
    REPLAY: (
        "torch.Tensor._version", ("nn.Module", "_parameters"), ("nn.Module", "_buffers")),
    ALLOCATOR_SETTINGS: (
        "torch._C._accelerator_getAllocatorSettings", "torch._C._accelerator_setAllocatorSettings"),
    "batch-coupled layers under activation checkpointing": (
        "torch.nn.modules.batchnorm._BatchNorm", "torch._C._current_graph_task_id",
        "torch.autograd.Variable._execution_engine"),
}

# The oldest torch that has each feature's names, for the refusal's advice (None: every torch
# autofit supports has them).
SINCE = {ALLOCATOR_SETTINGS: "2.12"}

# What a run does instead when an optional feature's names are missing (said in its one line).
OPTIONAL = {
    ALLOCATOR_SETTINGS: "after a fragmented OOM the cache is emptied and the plan replayed without "
                        "switching segments to expandable; set PYTORCH_CUDA_ALLOC_CONF="
                        "expandable_segments:True before the run to have them",
}

_checked: set[str] = set()


def missing(feature: str) -> list[str]:
    """What this torch lacks of `feature`'s private names; [] when all are there."""
    out = []
    for entry in FEATURES[feature]:
        if isinstance(entry, tuple):
            if not _module_has(entry[1]):
                out.append(f"torch.nn.Module().{entry[1]}")
        elif not present(entry):
            out.append(entry)
    return out


def _lacks(feature: str, lacking: list[str]) -> str:
    since = SINCE.get(feature)
    has_it = f"torch >= {since} has {'it' if len(lacking) == 1 else 'them'}" if since else \
        f"torch {TESTED_WITH} has {'it' if len(lacking) == 1 else 'them'}"
    return f"this torch {torch.__version__} lacks {', '.join(lacking)} ({has_it})"


def require(feature: str) -> None:
    """Refuse `feature` on a torch that lacks one of its private names (checked once)."""
    if feature in _checked:
        return
    lacking = missing(feature)
    if lacking:
        raise MissingInternal(f"autofit's {feature} needs torch internals: {_lacks(feature, lacking)}; "
                              f"install torch {SINCE.get(feature) or TESTED_WITH} or newer")
    _checked.add(feature)


@functools.cache
def supported(feature: str) -> bool:
    """Whether this torch has the names of optional `feature`; decided once per process (ask it
    when a run is set up, never inside a recovery). Where it has not, one log line says what is
    skipped and what the run does instead."""
    lacking = missing(feature)
    if lacking:
        log.warning("autofit: %s skipped: %s; %s.", feature, _lacks(feature, lacking), OPTIONAL[feature])
    return not lacking


# -- the simulated GPU: a dispatch mode that counts every op's tensors ---------------------------
def is_wrapper_subclass(tensor) -> bool:
    """Whether `tensor` is a traceable wrapper subclass (DTensor, ...): its memory is its inner
    tensors'."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    return is_traceable_wrapper_subclass(tensor)


def storage_resize():
    """UntypedStorage.resize_ as torch defines it (on StorageBase): the counter wraps it, since a
    storage resize (FSDP's free and re-allocation) is no op a dispatch mode sees."""
    return torch._C.StorageBase.resize_


def storage_key(storage) -> int:
    """One key per storage, real or fake (a fake tensor has no data pointer): its C handle."""
    return storage._cdata


def sparse_parts(tensor) -> tuple:
    """A sparse COO tensor's memory: its indices and values."""
    return tensor._indices(), tensor._values()


def sparse_values(tensor):
    return tensor._values()


def op_schema(func):
    """An op overload's schema (what it returns, whether it aliases), or None."""
    return getattr(func, "_schema", None)


def skip_dynamo(fn) -> bool:
    """Mark `fn` so torch.compile's frame evaluation runs it, and the frames it calls, as they are
    (what torch._disable_dynamo does with a wrapper around every op). False where this
    torch has no such switch (then the counter is only slower under torch.compile)."""
    try:
        from torch._C._dynamo import eval_frame
        skip = eval_frame._FrameAction.SKIP
        eval_frame.set_code_exec_strategy(fn.__code__, eval_frame._FrameExecStrategy(skip, skip))
        return True
    except (ImportError, AttributeError, TypeError):
        return False


# -- the estimator: fake tensors -----------------------------------------------------------------
def fake_tensor_mode_class():
    """FakeTensorMode: the estimator runs the step on tensors with shapes and no data."""
    require("the fake-tensor estimator")
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode


@functools.cache
def _fake_tensor_class():
    from torch._subclasses.fake_tensor import FakeTensor
    return FakeTensor


def fake_device(args):
    """What `prim.device` returns for `args` (one fake tensor), as FakeTensorMode's own handler
    answers it (its `_device_handler`: the tensor's fake device, meta inside a kernel), or None
    for other arguments. The autograd engine asks every tensor it touches for its device: two of
    every three ops a walk dispatches, each otherwise through the fake mode's whole dispatch."""
    if len(args) == 1 and type(args[0]) is _fake_tensor_class():
        tensor = args[0]
        if not tensor.fake_mode.in_kernel_invocation:
            return tensor.fake_device
    return None


PRIM_DEVICE = torch.ops.prim.device.default  # the op `fake_device` answers


def disable_current_modes():
    """A context leaving every active dispatch mode (the estimator makes real tensors inside)."""
    require("the fake-tensor estimator")
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


def aten_op(name: str):
    """The default overload of aten's op `name` (a private op such as `_grouped_mm`), or None on a
    torch that has no such op."""
    try:
        return getattr(getattr(torch.ops.aten, name), "default")
    except (AttributeError, RuntimeError):
        return None


def flash_attention(*args, **kwargs):
    """aten's flash SDPA kernel: what a CUDA card runs for SDPA in low precision (its memory)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(*args, **kwargs)


def efficient_attention(*args, **kwargs):
    """aten's memory-efficient SDPA kernel: what a CUDA card runs otherwise."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(*args, **kwargs)


# -- CUDA's autocast in the estimator: kernels at the AutocastCPU key ----------------------------
@functools.cache
def autocast_cpu_keys():
    """The AutocastCPU dispatch key set: the estimator's autocast kernels run with it excluded."""
    require("CUDA's autocast policies in the estimator")
    return torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def exclude_dispatch_keys(keys):
    """A context in which `keys` (a DispatchKeySet) are not dispatched to."""
    return torch._C._ExcludeDispatchKeyGuard(keys)


def has_kernel_for(op_name: str, key: str) -> bool:
    """Whether torch registers its own kernel for `op_name` at dispatch key `key`."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, key)


def destroy_library(library) -> None:
    """Unregister every kernel `library` registered (torch.library has no public call for it)."""
    library._destroy()


# -- replay: what an attempt wrote ---------------------------------------------------------------
def version(tensor) -> int:
    """The tensor's in-place write counter: tells a batch or buffer an attempt wrote to."""
    return tensor._version


def own_parameters(module) -> dict:
    """`module`'s own parameter slots (not its children's), to read and put back in place."""
    return module._parameters


def own_buffers(module) -> dict:
    """`module`'s own buffer slots (not its children's), to read and put back in place."""
    return module._buffers


# -- the allocator ---------------------------------------------------------------------------------
def allocator_settings() -> str:
    """The caching allocator's settings as a string (PYTORCH_ALLOC_CONF's syntax). Optional: ask
    `supported(ALLOCATOR_SETTINGS)` first (the getter exists from torch 2.12)."""
    return torch._C._accelerator_getAllocatorSettings()


def set_allocator_settings(settings: str) -> None:
    """Set the caching allocator's settings at run time (expandable segments on, and back off)."""
    torch._C._accelerator_setAllocatorSettings(settings)


# -- autograd: batch-coupled layers recomputed by checkpointing ----------------------------------
def batch_norm_base():
    """_BatchNorm: the base of every BatchNorm kind (1d/2d/3d, lazy, sync)."""
    require("batch-coupled layers under activation checkpointing")
    from torch.nn.modules.batchnorm import _BatchNorm
    return _BatchNorm


def graph_task_id() -> int:
    """The id of the backward running now, -1 outside one (a forward recomputed by checkpointing
    runs inside a backward)."""
    return torch._C._current_graph_task_id()


def after_backward(callback) -> None:
    """Run `callback` when the backward running now ends."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def compiled_original(model):
    """The module torch.compile wrapped (an OptimizedModule's `_orig_mod`), or None."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None
