"""How the probe's model is fine-tuned: the optimizer, the part trained, the weights' dtype.

Small cards are where people fine-tune a part of a model or train it with a lighter optimizer, and
each changes what a step holds: AdamW keeps two fp32 moments per trained parameter (8 B), SGD with
momentum one (4 B), plain SGD none, Adafactor factored second moments, bitsandbytes' 8-bit AdamW
two uint8 moments plus an fp32 absmax per 256-value block (2.03 B; fp32 moments, 8 B, for a tensor
under 4096 values, as bitsandbytes' Optimizer2State.init_state allocates them); a frozen base trains
only the task head; LoRA (peft, when installed) trains rank-r adapters on every linear layer; bf16
weights halve the parameters and their gradients (the step then runs in bf16 whatever the plan's
autocast), fp16 weights likewise; "nf4" and "int8" store the frozen base's linear layers as
bitsandbytes' 4-bit (QLoRA) and 8-bit (LLM.int8) formats do (`autofit.commands.quantized`), for
--trainable lora or frozen-base.

What a plan computes in is the weights' dtype and the plan's autocast together: `compute_dtype` and
`precision_text` say it ("bf16 weights" for a plan without autocast on bf16 weights, "bf16 weights,
bf16 autocast" with it), and `plan_text` is `Plan.describe` in those words.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import warnings

import torch

from autofit.commands.quantized import KINDS
from autofit.errors import UsageError

OPTIMIZERS = ("adamw", "sgd", "sgd-momentum", "adafactor", "adamw8bit")
OPTIMIZER_NAMES = {"adamw": "AdamW", "sgd": "SGD", "sgd-momentum": "SGD with momentum", "adafactor": "Adafactor",
                   "adamw8bit": "8-bit AdamW"}
TRAINABLE = ("full", "frozen-base", "lora")
WEIGHTS = ("fp32", "bf16", "fp16", "nf4", "int8")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # weights cast whole
QUANTIZED = KINDS  # a frozen base's linear layers quantized, the rest as built
# The options that need a package autofit does not depend on: (flag, value) -> the package.
NEEDS = {("--optimizer", "adamw8bit"): "bitsandbytes", ("--trainable", "lora"): "peft"}


def installed(package: str) -> bool:
    """Whether `package` can be imported, without importing it (the probe's verdict asks for each
    option it suggests; importing bitsandbytes or peft would cost seconds)."""
    return importlib.util.find_spec(package) is not None


def needs_text(flag: str, value: str) -> str:
    """'--trainable lora needs peft: pip install peft.' for an option in NEEDS."""
    package = NEEDS[(flag, value)]
    return f"{flag} {value} needs {package}: pip install {package}."


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


@contextlib.contextmanager
def _quiet_bitsandbytes():
    """bitsandbytes' CPU backend warns at import about 4-bit kernels, which neither the 8-bit
    optimizers nor LoRA use: the warning would land in the probe's output."""
    quiet = logging.getLogger("bitsandbytes")
    before = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        quiet.setLevel(before)


def _bitsandbytes():
    try:
        with _quiet_bitsandbytes():
            import bitsandbytes
    except ImportError:
        raise UsageError(needs_text("--optimizer", "adamw8bit")) from None
    return bitsandbytes


def _lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """peft's LoRA on every linear layer, without the notes peft makes on the way (it imports
    bitsandbytes where installed; it reads transformers' deprecated `is_gradient_checkpointing`; it
    sets fan_in_fan_out itself for GPT-2's Conv1D layers and warns that it did)."""
    try:
        with _quiet_bitsandbytes():
            from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UsageError(needs_text("--trainable", "lora")) from None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False", category=UserWarning)
        try:
            return get_peft_model(model, LoraConfig(r=rank, target_modules="all-linear"))
        except ValueError as refusal:
            # peft refuses some layers for some architectures (Mamba's out_proj and conv1d): that is
            # the model's limit, not a fault in the probe, so it is said as a usage error.
            raise UsageError(f"--trainable lora: peft cannot put LoRA on every linear layer of "
                             f"{type(model).__name__}: {refusal} Use --trainable frozen-base or full, or "
                             f"build the LoRA model yourself and pass it as --model module:function.") from None


def prepare(model: torch.nn.Module, *, trainable: str, lora_rank: int, weights: str) -> torch.nn.Module:
    """`model` as the fine-tune trains it (a new wrapper for LoRA, else the same model changed)."""
    if weights in QUANTIZED and trainable == "full":
        raise UsageError(f"--weights {weights} quantizes the base, which cannot then be trained whole; use "
                         f"--trainable lora (QLoRA) or frozen-base.")
    if weights in HALF:
        model = model.to(HALF[weights])
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
        model = _lora(model, lora_rank)
    elif trainable != "full":
        raise UsageError(f"--trainable must be one of {', '.join(TRAINABLE)} but got {trainable!r}.")
    if weights in QUANTIZED:
        from autofit.commands.quantized import quantize
        quantize(model, weights)
    return model


def batch_for(batch, *, weights: str):
    """The sample batch as the fine-tune feeds it: float inputs (pixels, audio features) in the
    weights' dtype, since a model's first layer takes its input in its own dtype; ids stay int64.
    fp32 weights, or a batch that is not a dict: the batch as given."""
    if weights not in HALF or not isinstance(batch, dict):
        return batch
    return {k: v.to(HALF[weights]) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in batch.items()}


def trained_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def compute_dtype(precision: str, weights: str) -> str:
    """The dtype a plan's step computes its matmuls in: the autocast's for a mixed `precision`,
    else the weights' (fp32 on a quantized base: its layers dequantize into their inputs' dtype)."""
    from autofit.plans import precision as precisions
    if precisions.get(precision).mixed:
        return precision
    return "fp32" if weights in QUANTIZED else weights


def precision_text(precision: str, weights: str) -> str:
    """A plan's precision as it runs on these weights: the plan's own name on fp32 weights ("fp32",
    "bf16" autocast); on bf16 weights "bf16 weights", with ", bf16 autocast" for a mixed plan."""
    if weights == "fp32":
        return precision
    from autofit.plans import precision as precisions
    mixed = precisions.get(precision).mixed
    return f"{weights} weights, {precision} autocast" if mixed else f"{weights} weights"


def plan_text(plan, weights: str) -> str:
    """`plan.describe()` with its precision as `precision_text` says it."""
    from autofit.plans import switches
    parts = [f"micro {plan.micro_batch_size} x {plan.accumulation_steps}",
             precision_text(plan.precision, weights)]
    parts += [w for s in switches.SWITCHES if (w := s.label(getattr(plan, s.name))) is not None]
    return ", ".join(parts)
