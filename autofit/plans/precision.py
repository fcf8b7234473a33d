"""The precisions a plan can run in: one registry that every module reads (dtype, grad scaler, the
capacity ranking's cost, the Hugging Face flag, device support, the bf16 -> fp16 fallback, and the
precision policies a user may ask for)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    name: str                       # the Plan.precision value
    autocast_dtype: torch.dtype | None  # None: no autocast, full fp32
    needs_scaler: bool              # fp16 gradients underflow without a GradScaler
    cost: float                     # factor on plan_cost: the exactness premium of mixed precision
    hf_flag: str | None             # the TrainingArguments boolean that turns it on (None: neither)
    accelerate: str                 # accelerate's mixed_precision value
    # The precision whose fake-tensor run gives this one's sizes (None: its own). fp16 is measured
    # as bf16: same byte sizes, and GradScaler's found-inf check needs real values.
    measured_as: str | None = None
    slow_on: tuple[str, ...] = ()   # device types where its autocast is far slower than the others

    @property
    def mixed(self) -> bool:
        return self.autocast_dtype is not None

    def supported_on(self, device) -> bool:
        """Whether `device` (an autofit.gpu.device.Device) can run it: bf16 needs bf16 support."""
        return self.autocast_dtype is not torch.bfloat16 or device.supports_bf16()


# Mixed precision costs 1.15x in the ranking: it runs faster but changes the math, so an exact plan
# wins unless mixed precision saves more than that (see capacity's module docstring).
MIXED_PRECISION_COST = 1.15

# Order matters: it breaks ties in the capacity ranking (exact first) and orders every list of names.
REGISTRY: dict[str, Precision] = {
    "fp32": Precision("fp32", None, False, 1.0, None, "no"),
    "bf16": Precision("bf16", torch.bfloat16, False, MIXED_PRECISION_COST, "bf16", "bf16"),
    "fp16": Precision("fp16", torch.float16, True, MIXED_PRECISION_COST, "fp16", "fp16",
                      measured_as="bf16", slow_on=("cpu",)),  # ~40x slower than bf16 on CPU
}
EXACT = "fp32"  # the exact default: a plan's precision unless it is asked for another
AUTO = "auto"   # the policy that starts exact and may step down to mixed precision


def names() -> tuple[str, ...]:
    """Every precision a plan can run in, in registry order."""
    return tuple(REGISTRY)


def mixed_names() -> tuple[str, ...]:
    return tuple(name for name, p in REGISTRY.items() if p.mixed)


def policies() -> tuple[str, ...]:
    """What a user may pass as precision=: "auto" or one precision."""
    return (AUTO,) + names()


# The names as built in; code that must see a registry extended at run time calls names().
PRECISIONS = names()
MIXED = mixed_names()


def get(name: str) -> Precision:
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):  # TypeError: an unhashable value
        raise ValueError(f"precision must be one of {', '.join(names())} but got {name!r}.") from None


def check_policy(policy) -> None:
    if policy not in policies():
        raise ValueError(f"precision must be one of {', '.join(policies())} but got {policy!r}.")


def start_precision(policy: str) -> str:
    """The precision a job under `policy` starts in: the exact default for "auto"."""
    return EXACT if policy == AUTO else policy


def allowed(policy: str, bf16_supported: bool) -> tuple[str, ...]:
    """The precisions a plan may have under `policy`: "auto" gives the exact default and the mixed
    precision of `mixed_for`; a fixed precision gives only itself."""
    check_policy(policy)
    return (EXACT, mixed_for(bf16_supported)) if policy == AUTO else (policy,)


def mixed_for(bf16_supported: bool) -> str:
    """The mixed precision to use: the first one the device supports (bf16 where it is, else fp16)."""
    for p in REGISTRY.values():
        if p.mixed and (bf16_supported or p.autocast_dtype is not torch.bfloat16):
            return p.name
    raise ValueError(f"no mixed precision in the registry runs without bf16 support ({', '.join(names())}).")


def autocast_dtypes() -> frozenset:
    """The low-precision dtypes mixed precision computes in."""
    return frozenset(p.autocast_dtype for p in REGISTRY.values() if p.mixed)


def from_hf_flags(args) -> str | None:
    """The precision a Hugging Face TrainingArguments' bf16/fp16 flags turn on, or None (fp32)."""
    return next((p.name for p in REGISTRY.values() if p.hf_flag and getattr(args, p.hf_flag, False)), None)
