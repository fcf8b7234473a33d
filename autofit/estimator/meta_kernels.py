"""Meta kernels stricter than the kernels they stand for, answered in their place while an estimate runs.

The estimator runs a step on fake tensors, whose shapes come from torch's meta kernels. A meta kernel
that refuses what the real kernels run makes a model that trains on a card impossible to estimate:
- `aten::_grouped_mm`, the grouped matmul of transformers' mixture-of-experts layers (Qwen2-MoE,
  Mixtral, OLMoE, ... with `experts_implementation="grouped_mm"`, their default). Its meta kernel
  accepts bf16 only, as CUDA's first grouped kernel did; CUDA's kernel now falls back to a loop of mm
  for other dtypes (into one output it allocates as the fast kernel does), and CPU's runs any float
  dtype. So a fp32 MoE would fail its estimate ("Expected inputs of BF16 type") while it trains.
  An fp32 or fp16 call gets its output from the same shape rule; nothing else is allocated, as in
  CUDA's fallback. A bf16 call, and any call this rule does not cover, goes to torch's own kernel.

Nothing is registered with torch's dispatcher: the estimator's counting mode, which sees every op
before the fake mode does, asks `substitute` for the call it should make instead. torch 2.10-2.12
refuse a second Python kernel for an op (unless `allow_override=True`, a keyword torch 2.4 lacks),
and a kernel registered process-wide would also be seen by the user's own code: a dispatch-time
answer needs neither and works on every torch.
"""

from __future__ import annotations

import torch

from autofit import torch_internals as ti

WIDENED = (torch.float32, torch.float16)  # what the real grouped kernels run beyond bf16
GROUPED_MM = ti.aten_op("_grouped_mm")  # None on a torch without the grouped matmul
_EMPTY_STRIDED = torch.ops.aten.empty_strided.default


def _grouped_mm_output_shape(mat_a, mat_b, offs) -> list:
    """The output's shape, by the rule of CUDA's and the meta kernel's output tensor."""
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                 lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={mat_a.dim()} and "
                         f"mat_b.dim()={mat_b.dim()}")
    torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "contraction dimension of mat_a and mat_b must match")
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return [offs.size(0), mat_a.size(0), mat_b.size(1)]
    if mat_a.dim() == 2:
        return [mat_a.size(0), mat_b.size(-1)]
    if mat_b.dim() == 2:
        return [mat_a.size(1), mat_b.size(1)]
    return [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]


def _grouped_mm_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The allocation of `aten::_grouped_mm`'s fp32/fp16 kernels, as (op, args, kwargs); None for
    the calls torch's own meta kernel answers (bf16, mixed operands)."""
    if not (mat_a.dtype in WIDENED and mat_b.dtype == mat_a.dtype):
        return None
    torch._check(offs is not None or (mat_a.dim() == 3 and mat_b.dim() == 3),
                 lambda: "a 2D operand of a grouped matmul needs offs")
    shape = _grouped_mm_output_shape(mat_a, mat_b, offs)
    dtype = out_dtype or mat_a.dtype
    # CUDA pads the output's rows to 16 bytes (GroupedMMUtils' create_grouped_gemm_output_tensor)
    align = 16 // dtype.itemsize
    padded = -(-shape[-1] // align) * align
    stride = [shape[1] * padded, padded, 1] if len(shape) == 3 else [padded, 1]
    return _EMPTY_STRIDED, (shape, stride), {"dtype": dtype, "device": mat_a.device}


def substitute(func, args, kwargs):
    """The call to make instead of `func(*args, **kwargs)` where torch's meta kernel is stricter
    than the real kernels, as (op, args, kwargs); None (run `func` itself) for every other call.
    One identity test per op: the counting modes call it on every op."""
    if func is not GROUPED_MM:  # (None on a torch without the op: no op is None)
        return None
    return _grouped_mm_output(*args, **(kwargs or {}))

