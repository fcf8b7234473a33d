"""A quantized frozen base, priced from bitsandbytes' formats without bitsandbytes.

QLoRA fine-tunes adapters on a base whose linear layers are stored in 4 bits; LLM.int8 stores them
in 8. What a card holds per quantized layer (bitsandbytes' `Linear4bit` / `Linear8bitLt`):
- "nf4" (QLoRA's layout: NF4 in blocks of 64 values, double quantization): the weight packed two
  values a byte (numel / 2 B), one uint8 absmax per block of 64 (numel / 64 B), the absmax's own
  fp32 absmax per 256 blocks and its 256-entry fp32 code: ~0.52 B per parameter;
- "int8" (LLM.int8): the int8 weight (numel B) and an fp32 scale per output row.
Each forward dequantizes the weight into the input's dtype for its matrix product and drops it;
backward dequantizes it again for the input's gradient (bitsandbytes' MatMul4Bit saves the packed
weight, not the dequantized one), so a dequantized weight lives only inside one layer's kernel.

`quantize(model, kind)` replaces every frozen `nn.Linear` but the output layer (which QLoRA keeps
unquantized) with a `QuantizedLinear` holding those buffers: a stand-in for pricing on fake tensors,
whose products use zeros for the weight's values.
"""

from __future__ import annotations

import torch

KINDS = ("nf4", "int8")
BLOCK = 64            # values per absmax block (bitsandbytes' 4-bit default)
NESTED_BLOCK = 256    # absmax values per block of the double quantization
CODE = 256            # entries of a quantization code (fp32)


class _Dequantized(torch.autograd.Function):
    """x @ W.t() with W dequantized in forward and again in backward, never saved."""

    @staticmethod
    def forward(ctx, x, packed, layer):
        ctx.layer = layer
        return x @ layer.dequantized(packed, x.dtype).t()

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.layer.dequantized(ctx.layer.packed, grad.dtype), None, None


class QuantizedLinear(torch.nn.Module):
    """A frozen linear layer stored as bitsandbytes stores `kind` ("nf4" or "int8")."""

    def __init__(self, linear: torch.nn.Module, kind: str):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)} but got {kind!r}.")
        self.kind = kind
        self.in_features, self.out_features = features(linear)
        self.weight_numel = linear.weight.numel()  # the parameters it stands for
        device, numel = linear.weight.device, linear.weight.numel()
        if kind == "nf4":
            blocks = -(-numel // BLOCK)
            self.register_buffer("packed", torch.zeros(-(-numel // 2), dtype=torch.uint8, device=device))
            self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8, device=device))
            self.register_buffer("nested_absmax", torch.zeros(-(-blocks // NESTED_BLOCK), device=device))
            self.register_buffer("code", torch.zeros(CODE, device=device))
        else:
            self.register_buffer("packed", torch.zeros(numel, dtype=torch.int8, device=device))
            self.register_buffer("absmax", torch.zeros(self.out_features, device=device))
        self.bias = linear.bias  # bitsandbytes keeps the bias as it was

    def dequantized(self, packed, dtype) -> torch.Tensor:
        """The weight as one kernel makes it from `packed`: out_features x in_features of `dtype`."""
        return packed.new_zeros((self.out_features, self.in_features), dtype=dtype)

    def forward(self, x):
        out = _Dequantized.apply(x, self.packed, self)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def features(layer: torch.nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear layer: `nn.Linear`'s weight is out x in, the Conv1D of GPT-2's
    family stores it in x out (bitsandbytes' integration quantizes both)."""
    if isinstance(layer, torch.nn.Linear):
        return layer.in_features, layer.out_features
    return tuple(layer.weight.shape)


def is_linear(module: torch.nn.Module) -> bool:
    """An `nn.Linear`, or transformers' Conv1D (a linear layer with its weight transposed)."""
    return type(module) is torch.nn.Linear or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def quantize(model: torch.nn.Module, kind: str) -> int:
    """Replace `model`'s frozen linear layers but its output layer with `QuantizedLinear`s of `kind`;
    the number replaced."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(name, module) for name, module in model.named_modules()
               if is_linear(module) and module is not output and not module.weight.requires_grad]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinear(module, kind))
    return len(targets)


def parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters, a quantized layer's weight counted as the parameters it stores."""
    return sum(p.numel() for p in model.parameters()) + sum(
        m.weight_numel for m in model.modules() if isinstance(m, QuantizedLinear))
