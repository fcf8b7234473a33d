"""How the probe's model is fine-tuned: the optimizer, the part trained, the weights' dtype.

Small cards are where people fine-tune a part of a model or train it with a lighter optimizer, and
each changes what a step holds: AdamW keeps two fp32 moments per trained parameter (8 B), SGD with
momentum one (4 B), plain SGD none, Adafactor factored second moments, bitsandbytes' 8-bit AdamW
two uint8 moments plus an fp32 absmax per 256-value block (2.03 B; fp32 moments, 8 B, for a tensor
under 4096 values, as bitsandbytes' Optimizer2State.init_state allocates them); a frozen base trains
only the task head; LoRA (peft, when installed) trains rank-r adapters on every linear layer; bf16
weights halve the parameters and their gradients (the step then runs in bf16 whatever the plan's
autocast).
"""

from __future__ import annotations

import functools
import logging

import torch

from autofit.errors import UsageError

OPTIMIZERS = ("adamw", "sgd", "sgd-momentum", "adafactor", "adamw8bit")
OPTIMIZER_NAMES = {"adamw": "AdamW", "sgd": "SGD", "sgd-momentum": "SGD with momentum", "adafactor": "Adafactor",
                   "adamw8bit": "8-bit AdamW"}
TRAINABLE = ("full", "frozen-base", "lora")
WEIGHTS = ("fp32", "bf16")


def optimizer_factory(name: str):
    """params -> Optimizer for `--optimizer` (the learning rate does not change memory)."""
    if name == "adamw":
        return torch.optim.AdamW
    if name == "sgd":
        return functools.partial(torch.optim.SGD, lr=1e-3)
    if name == "sgd-momentum":
        return functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9)
    if name == "adafactor":
        from transformers.optimization import Adafactor
        return functools.partial(Adafactor, lr=1e-3, relative_step=False, scale_parameter=False)
    if name == "adamw8bit":
        return _bitsandbytes().optim.AdamW8bit
    raise UsageError(f"--optimizer must be one of {', '.join(OPTIMIZERS)} but got {name!r}.")


def _bitsandbytes():
    """bitsandbytes, imported without its CPU backend's warning about 4-bit kernels (the 8-bit
    optimizers do not use them, and the warning would land in the probe's output)."""
    quiet = logging.getLogger("bitsandbytes")
    before = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        raise UsageError("--optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes.") from None
    finally:
        quiet.setLevel(before)
    return bitsandbytes


def prepare(model: torch.nn.Module, *, trainable: str, lora_rank: int, weights: str) -> torch.nn.Module:
    """`model` as the fine-tune trains it (a new wrapper for LoRA, else the same model changed)."""
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    if trainable == "frozen-base":
        base = getattr(model, "base_model", None)
        if base is None or base is model:
            raise UsageError(f"--trainable frozen-base needs a model with a base model and a head "
                             f"({type(model).__name__} has no base_model); use --trainable lora or full.")
        base.requires_grad_(False)
        if not any(p.requires_grad for p in model.parameters()):
            raise UsageError(f"--trainable frozen-base leaves nothing to train in {type(model).__name__} "
                             f"(its head shares the base's weights); use --trainable lora or full.")
    elif trainable == "lora":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise UsageError("--trainable lora needs peft: pip install peft.") from None
        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules="all-linear"))
    elif trainable != "full":
        raise UsageError(f"--trainable must be one of {', '.join(TRAINABLE)} but got {trainable!r}.")
    return model


def batch_for(batch, *, weights: str):
    """The sample batch as the fine-tune feeds it: float inputs (pixels, audio features) in the
    weights' dtype, since a model's first layer takes its input in its own dtype; ids stay int64.
    fp32 weights, or a batch that is not a dict: the batch as given."""
    if weights != "bf16" or not isinstance(batch, dict):
        return batch
    return {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in batch.items()}


def trained_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
