"""Meta kernels stricter than the kernels they stand for, widened while an estimate runs.

The estimator runs a step on fake tensors, whose shapes come from torch's meta kernels. A meta kernel
that refuses what the real kernels run makes a model that trains on a card impossible to estimate:
- `aten::_grouped_mm`, the grouped matmul of transformers' mixture-of-experts layers (Qwen2-MoE,
  Mixtral, OLMoE, ... with `experts_implementation="grouped_mm"`, their default). torch 2.13's meta
  kernel accepts bf16 only, as CUDA's first grouped kernel did; CUDA's kernel now falls back to a
  loop of mm for other dtypes (into one output it allocates as the fast kernel does), and CPU's
  runs any float dtype. So a fp32 MoE failed its estimate ("Expected inputs of BF16 type") while it
  trains. While an estimate runs, a bf16 call goes to torch's own meta kernel and an fp32 or fp16
  one gets its output from the same shape rule; nothing else is allocated, as in CUDA's fallback.

The kernels are registered at the Meta key only while at least one estimate's walk is inside
`widened()` (on any device type: the meta kernel is stricter than CPU's kernel too) and unregistered
when the last one leaves, so torch's own meta kernels are back for anything else.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch

from autofit import torch_internals as ti

WIDENED = (torch.float32, torch.float16)  # what the real grouped kernels run beyond bf16


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


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """`aten::_grouped_mm` at the Meta key: torch's kernel for bf16, the real kernels' rule for
    fp32 and fp16 (both operands one dtype; a 2D operand needs `offs`, as on every device)."""
    if not (mat_a.dtype in WIDENED and mat_b.dtype == mat_a.dtype):
        return ti.grouped_mm_meta(mat_a, mat_b, offs, bias, out_dtype)
    torch._check(offs is not None or (mat_a.dim() == 3 and mat_b.dim() == 3),
                 lambda: "a 2D operand of a grouped matmul needs offs")
    shape = _grouped_mm_output_shape(mat_a, mat_b, offs)
    dtype = out_dtype or mat_a.dtype
    # CUDA pads the output's rows to 16 bytes (GroupedMMUtils' create_grouped_gemm_output_tensor)
    align = 16 // dtype.itemsize
    padded = -(-shape[-1] // align) * align
    stride = [shape[1] * padded, padded, 1] if len(shape) == 3 else [padded, 1]
    return torch.empty_strided(shape, stride, dtype=dtype, device=mat_a.device)


def _register() -> torch.library.Library:
    """The widened kernels, registered at the Meta key over torch's own (ti.destroy_library puts
    torch's back). torch warns once that a kernel is overridden: here that is the intent."""
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
        if ti.present(ti.GROUPED_MM_META):  # a torch without it has no grouped matmul to widen
            library.impl("_grouped_mm", grouped_mm, "Meta")
    return library


_state = {"users": 0, "library": None}
_lock = threading.Lock()


@contextlib.contextmanager
def widened():
    """While inside (nested and from several threads alike), the widened meta kernels are torch's."""
    with _lock:
        if _state["users"] == 0:
            _state["library"] = _register()
        _state["users"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["users"] -= 1
            if _state["users"] == 0:
                ti.destroy_library(_state["library"])
                _state["library"] = None
