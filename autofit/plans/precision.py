"""The precisions a plan can run in: one registry that every module reads (dtype, grad scaler, the
capacity ranking's cost, the Hugging Face flag, and the bf16 -> fp16 fallback)."""

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

    @property
    def mixed(self) -> bool:
        return self.autocast_dtype is not None


# Mixed precision costs 1.15x in the ranking: it runs faster but changes the math, so an exact plan
# wins unless mixed precision saves more than that (see capacity's module docstring).
MIXED_PRECISION_COST = 1.15

# Order matters: it breaks ties in the capacity ranking (exact first).
REGISTRY: dict[str, Precision] = {
    "fp32": Precision("fp32", None, False, 1.0, None, "no"),
    "bf16": Precision("bf16", torch.bfloat16, False, MIXED_PRECISION_COST, "bf16", "bf16"),
    "fp16": Precision("fp16", torch.float16, True, MIXED_PRECISION_COST, "fp16", "fp16"),
}
PRECISIONS = tuple(REGISTRY)
MIXED = tuple(name for name, p in REGISTRY.items() if p.mixed)


def get(name: str) -> Precision:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} but got {name!r}.") from None


def mixed_for(bf16_supported: bool) -> str:
    """The mixed precision to use: bf16 where the device supports it, else fp16."""
    return "bf16" if bf16_supported else "fp16"
