"""CUDA's numerics for the estimator's fake CPU tensors: autocast's CUDA op lists and dropout's mask.

The estimator's fake tensors are on device `cpu` (fake `cuda` tensors abort a CPU-only build), so
without help they follow CPU's choices, which keep different bytes than a card:
- CPU autocast has its own op lists. CUDA's (`AT_FORALL_*` in ATen/autocast_mode.h, which this
  module restates) run `pow`, `layer_norm`, `softmax`, `exp`, `sum`, ... in fp32 where CPU leaves
  them in the low precision, and cast a few more matmul-like ops down. While an estimate runs, every
  op on those lists that CPU autocast lets through gets a kernel at the AutocastCPU dispatch key that
  applies CUDA's policy to the estimate's own fake tensors; any other tensor passes through
  unchanged, as CPU autocast would let it. Being in the dispatcher (not a Python mode), the policy
  also holds in backward, where checkpointing recomputes the forward.
- CPU dropout multiplies by a noise tensor in the input's dtype and saves it for backward; CUDA's
  fused kernel (`native_dropout`) saves a bool mask, a quarter of fp32's bytes. Dropout on the
  estimate's fake tensors is routed to `native_dropout`.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from autofit import torch_internals as ti
from autofit.estimator.cuda_attention import FunctionalPatch, attention_as_on_cuda

# CUDA's autocast policies (ATen/autocast_mode.h, torch 2.x), "op" or "op.overload".
LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa")
# fp32 through the op's own `dtype` argument when the caller left it unset
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList")
# the widest floating type of the inputs
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
           "index_put", "tensordot", "scatter_add")
POLICIES = {"lower_precision_fp": LOWER_PRECISION, "fp32": FP32,
            "fp32_set_opt_dtype": FP32_SET_OPT_DTYPE, "promote": PROMOTE}

_KERNELS: dict = {}  # op -> its kernel, made once (registering again reuses it)


def _overload(name: str):
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _ours(args) -> bool:
    """Whether the op's tensors are an estimate's fake tensors (else: leave them as CPU would)."""
    for a in args:
        if isinstance(a, (list, tuple)):
            if _ours(a):
                return True
        elif isinstance(a, torch.Tensor):
            return getattr(a, "fake_mode", None) in _estimates.modes
    return False


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(obj, dtype):
    if _eligible(obj):
        return obj.to(dtype)
    if isinstance(obj, (list, tuple)) and any(_eligible(x) for x in obj):
        return type(obj)(_cast(x, dtype) for x in obj)
    return obj


def _floats(obj):
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _floats(x)
    elif _eligible(obj):
        yield obj


def _kernel(op, policy: str):
    kernel = _KERNELS.get(op)
    if kernel is None:
        kernel = _KERNELS[op] = _make_kernel(op, policy)
    return kernel


def _make_kernel(op, policy: str):
    names = [a.name for a in ti.op_schema(op).arguments]
    dtype_at = names.index("dtype") if "dtype" in names else None

    def run(*args, **kwargs):
        if _ours(args):
            if policy == "lower_precision_fp":
                dtype = torch.get_autocast_dtype("cpu")
                args, kwargs = _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}
            elif policy == "fp32":
                args = _cast(args, torch.float32)
                kwargs = {k: _cast(v, torch.float32) for k, v in kwargs.items()}
            elif policy == "fp32_set_opt_dtype":
                positional = dtype_at is not None and len(args) > dtype_at
                given = args[dtype_at] if positional else kwargs.get("dtype")
                first = next(_floats(args), None)
                if given is None and first is not None and first.dtype != torch.float32:
                    if positional:
                        args = args[:dtype_at] + (torch.float32,) + args[dtype_at + 1:]
                    else:
                        kwargs = {**kwargs, "dtype": torch.float32}
            else:  # promote
                dtypes = [t.dtype for t in _floats((args, list(kwargs.values())))]
                if len(set(dtypes)) > 1:
                    widest = functools.reduce(torch.promote_types, dtypes)
                    args = _cast(args, widest)
                    kwargs = {k: _cast(v, widest) for k, v in kwargs.items()}
        with ti.exclude_dispatch_keys(ti.autocast_cpu_keys()):
            return op(*args, **kwargs)
    return run


def _register() -> torch.library.Library:
    """Kernels at AutocastCPU for the listed ops that CPU autocast lets through (it has its own
    kernel, with the same policy as CUDA's, for the others: mm, linear, the losses, ...)."""
    library = torch.library.Library("aten", "IMPL")
    for policy, names in POLICIES.items():
        for name in names:
            try:
                op = _overload(name)
            except AttributeError:  # an op this torch does not have
                continue
            if ti.has_kernel_for(op.name(), "AutocastCPU"):
                continue
            library.impl(op.name().split("::", 1)[1], _kernel(op, policy), "AutocastCPU")
    return library


def _dropout(input, p=0.5, training=True, inplace=False):
    if (training and not inplace and 0.0 < p < 1.0 and input.numel() > 0
            and getattr(input, "fake_mode", None) in _estimates.modes):
        return torch.ops.aten.native_dropout(input, p, True)[0]  # saves a bool mask, as on CUDA
    return _estimates.original(input, p, training, inplace)


_library = {"kernels": None}  # the AutocastCPU kernels, registered while any estimate is inside


def _register_kernels():
    _library["kernels"] = _register()


def _destroy_kernels():
    ti.destroy_library(_library["kernels"])
    _library["kernels"] = None


_estimates = FunctionalPatch("dropout", _dropout, on_first=_register_kernels, on_last=_destroy_kernels)


@contextlib.contextmanager
def numerics_as_on_cuda(mode):
    """While inside, this fake mode's tensors get CUDA's autocast policies, dropout and attention;
    every other tensor is untouched."""
    with _estimates.patch(mode), attention_as_on_cuda(mode):
        yield
