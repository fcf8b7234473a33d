"""Fingerprints: what a cached plan depends on (model, batch layout, optimizer, device, versions).

Everything here is plain JSON data hashed with SHA-256, so a cache key can be recomputed and
explained; nothing is pickled.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from autofit.plans.precision import policies


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _type_name(obj) -> str:
    cls = type(obj)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _digest(data) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def model_fingerprint(model: torch.nn.Module) -> dict:
    """{"class", "params", "n_params"}: the class path, a SHA-256 of the names, shapes, dtypes and
    trainability of parameters and buffers, and the number of parameter elements.

    `requires_grad` is part of it because a frozen parameter has no gradient or optimizer state,
    so a plan found with a frozen encoder must not be reused once it is unfrozen.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module but got {type(model).__name__} {model!r:.80}.")
    layout = []
    n_params = 0
    for name, p in model.named_parameters():
        layout.append(["param", name, list(p.shape), _dtype_name(p.dtype), bool(p.requires_grad)])
        n_params += p.numel()
    for name, b in model.named_buffers():
        layout.append(["buffer", name, list(b.shape), _dtype_name(b.dtype)])
    return {"class": _type_name(model), "params": _digest(layout), "n_params": n_params}


def batch_signature(batch) -> dict | list | str:
    """The structure of a batch without its size: a tensor gives {"shape": shape[1:], "dtype"};
    a mapping (BatchEncoding included) maps its keys, sorted; a tuple/list maps by position; any
    other value gives its type name. A 0-dim tensor, which has no batch dimension, is marked
    "scalar" so it differs from a 1-dim tensor.
    """
    if isinstance(batch, torch.Tensor):
        sig = {"shape": list(batch.shape[1:]), "dtype": _dtype_name(batch.dtype)}
        if batch.dim() == 0:
            sig["scalar"] = True
        return sig
    if isinstance(batch, Mapping) or (hasattr(batch, "items") and hasattr(batch, "keys")):
        # BatchEncoding is a UserDict; the hasattr test covers other dict-likes too.
        return {str(k): batch_signature(batch[k]) for k in sorted(batch.keys(), key=str)}
    if isinstance(batch, (tuple, list)):
        return [batch_signature(v) for v in batch]
    return _type_name(batch)


def autofit_version() -> str:
    """autofit.__version__, else the installed distribution's version, else "0+unknown"."""
    try:
        version = getattr(importlib.import_module(__package__ or "autofit"), "__version__", None)
    except ImportError:
        version = None
    if isinstance(version, str) and version:
        return version
    try:
        return importlib.metadata.version("autofit")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _check_text(name: str, value, hint: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string but got {type(value).__name__} {value!r}; {hint}.")
    if not value.strip():
        raise ValueError(f"{name} must be a non-empty string but got {value!r}; {hint}.")
    return value


def _check_int(name: str, value, *, allow_none: bool, minimum: int, hint: str) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {kind} but got {type(value).__name__} {value!r}; {hint}.")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum} but got {value!r}; {hint}.")
    return value


_BYTES_HINT = "pass bytes, e.g. autofit.parse_size('2GiB')"


@dataclass(frozen=True)
class DeviceKey:
    """Where a job runs, as its cache key names it; checked when made."""

    device_name: str                 # the GPU name, or "simulated"
    device_total: int | None = None  # its total bytes; None when unknown
    budget: int | None = None        # the bytes allowed; None: no budget
    # Under torch.distributed: {"world": ranks, "sharding": "replicated" | "fsdp2", "units": [...]},
    # so a plan of one world size or sharding is not read by another; a single process has none.
    parallel: dict | None = None

    def __post_init__(self):
        _check_text("device_name", self.device_name, "pass the GPU name or 'simulated'")
        _check_int("device_total", self.device_total, allow_none=True, minimum=0,
                   hint=_BYTES_HINT + ", or None when unknown")
        _check_int("budget", self.budget, allow_none=True, minimum=1, hint=_BYTES_HINT + ", or None for no budget")
        parallel = self.parallel
        if parallel is not None and (not isinstance(parallel, dict) or not isinstance(parallel.get("world"), int)):
            raise TypeError(f"parallel must be a dict with an int 'world' but got {parallel!r}; pass "
                            f"None for a single process.")


def job_key(*, model, batch, optimizer_name: str, global_batch: int, precision: str,
            device: DeviceKey) -> tuple[str, dict]:
    """(SHA-256 hex key, the JSON-serializable fields it hashes) for one training job on one device.
    Versions of torch and autofit are included so an upgrade never reuses a plan measured under
    other code."""
    fields = {
        "model": model_fingerprint(model),
        "batch": batch_signature(batch),
        "optimizer": _check_text("optimizer_name", optimizer_name,
                                 "pass the optimizer class name, e.g. 'AdamW'"),
        "global_batch": _check_int("global_batch", global_batch, allow_none=False, minimum=1,
                                   hint="pass the samples per optimizer step"),
        "precision": _check_text("precision", precision, "pass the policy, one of " + ", ".join(policies())),
        "device": {"name": device.device_name, "total": device.device_total},
        "budget": device.budget,
        "torch": str(torch.__version__),
        "autofit": autofit_version(),
    }
    if device.parallel is not None:
        fields["parallel"] = device.parallel
    return _digest(fields), fields
