"""The estimator's "cuda" numerics on fake CPU tensors: CUDA's autocast lists (ATen/autocast_mode.h)
and CUDA dropout's bool mask, op by op; and an estimator's host memory stays bounded over many plans."""

import gc
import sys
import tracemalloc

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import BertConfig, BertForSequenceClassification

from autofit.estimator.cuda_numerics import POLICIES, _overload, numerics_as_on_cuda
from autofit.estimator.estimate import Estimator
from autofit.plans.plan import Plan

BF16, FP32 = torch.bfloat16, torch.float32

# (op, its CUDA policy, a call on a bf16 tensor x (4 x 8) and a fp32 tensor y (4 x 8),
#  the dtype CUDA autocast gives, the dtype CPU autocast gives)
CASES = [
    ("pow.Tensor_Scalar", "fp32", lambda x, y: x.pow(3), FP32, BF16),      # GPT-2's gelu_new
    ("pow.Tensor_Tensor", "fp32", lambda x, y: x.pow(x), FP32, BF16),
    ("pow.Scalar", "fp32", lambda x, y: torch.pow(2.0, x), FP32, BF16),
    ("exp", "fp32", lambda x, y: x.exp(), FP32, BF16),
    ("log1p", "fp32", lambda x, y: x.log1p(), FP32, BF16),
    ("rsqrt", "fp32", lambda x, y: x.rsqrt(), FP32, BF16),
    ("softplus", "fp32", lambda x, y: F.softplus(x), FP32, BF16),
    ("layer_norm", "fp32", lambda x, y: F.layer_norm(x, (8,)), FP32, BF16),
    ("group_norm", "fp32", lambda x, y: F.group_norm(x, 2), FP32, BF16),
    ("rms_norm", "fp32", lambda x, y: F.rms_norm(x, (8,)), FP32, BF16),
    ("logsumexp", "fp32", lambda x, y: x.logsumexp(-1), FP32, BF16),
    ("mse_loss", "fp32", lambda x, y: F.mse_loss(x, y), FP32, FP32),       # on both lists
    ("softmax.int", "fp32_set_opt_dtype", lambda x, y: x.softmax(-1), FP32, BF16),
    ("log_softmax.int", "fp32_set_opt_dtype", lambda x, y: x.log_softmax(-1), FP32, BF16),
    ("sum", "fp32_set_opt_dtype", lambda x, y: x.sum(), FP32, BF16),
    ("cumsum", "fp32_set_opt_dtype", lambda x, y: x.cumsum(0), FP32, BF16),
    ("softmax.int", "fp32_set_opt_dtype", lambda x, y: x.softmax(-1, dtype=BF16), BF16, BF16),
    ("mm", "lower_precision_fp", lambda x, y: y @ y.T, BF16, BF16),          # on both lists
    ("mv", "lower_precision_fp", lambda x, y: torch.mv(y, y[0]), BF16, FP32),
    ("addmv", "lower_precision_fp", lambda x, y: torch.addmv(y[0, :4], y[:, :4], y[0, :4]), BF16, FP32),
    ("addcmul", "promote", lambda x, y: torch.addcmul(x, x, y), FP32, FP32),
    ("atan2", "promote", lambda x, y: torch.atan2(x, y), FP32, FP32),
    ("dot", "promote", lambda x, y: torch.dot(x[0], y[0]), FP32, None),
]


def fakes(mode):
    with mode:
        return torch.empty(4, 8, dtype=BF16), torch.empty(4, 8)


@pytest.mark.parametrize("name, policy, call, on_cuda, on_cpu", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_op_takes_cudas_dtype_for_the_estimate_and_cpus_otherwise(name, policy, call, on_cuda, on_cpu):
    assert name in POLICIES[policy]  # the case is on the list it claims
    mode = FakeTensorMode()
    x, y = fakes(mode)
    with numerics_as_on_cuda(mode), mode, torch.autocast("cpu", dtype=BF16):
        assert call(x, y).dtype == on_cuda
    other = FakeTensorMode()  # another mode's tensors (a caller's own): CPU's lists, untouched
    x, y = fakes(other)
    with numerics_as_on_cuda(mode), other, torch.autocast("cpu", dtype=BF16):
        if on_cpu is None:
            with pytest.raises(RuntimeError):  # CPU autocast leaves mixed dtypes to the op
                call(x, y)
        else:
            assert call(x, y).dtype == on_cpu


def test_every_listed_op_exists_and_the_kernels_are_gone_afterwards():
    names = [n for names in POLICIES.values() for n in names]
    assert len(names) == len(set(names)) == 33 + 59 + 11 + 11  # as many as the header lists
    missing = [n for n in names if not _has_op(n)]
    assert missing == []
    pow_scalar = "aten::pow.Tensor_Scalar"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(pow_scalar, "AutocastCPU")
    with numerics_as_on_cuda(FakeTensorMode()):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(pow_scalar, "AutocastCPU")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(pow_scalar, "AutocastCPU")
    assert F.dropout.__module__ == "torch.nn.functional"


def _has_op(name):
    try:
        _overload(name)
        return True
    except AttributeError:
        return False


def saved(fn, *args):
    """[(dtype, bytes)] of what autograd saves for backward while fn runs."""
    out = []

    def pack(t):
        out.append((t.dtype, t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return out


def test_saved_tensors_are_cudas():
    mode = FakeTensorMode()
    with mode:
        h = torch.empty(4, 8, requires_grad=True)
        w = torch.empty(8, 8, requires_grad=True)
    ln = lambda: F.layer_norm(h @ w, (8,))  # noqa: E731
    drop = lambda: F.dropout(h, 0.1, True)  # noqa: E731
    with mode, torch.autocast("cpu", dtype=BF16):  # CPU: layer norm saves its bf16 input
        assert saved(ln)[2:3] == [(BF16, 64)]
    with numerics_as_on_cuda(mode), mode, torch.autocast("cpu", dtype=BF16):
        assert saved(ln)[2:3] == [(FP32, 128)]      # CUDA: the fp32 copy it normalizes
    with mode:                                       # CPU dropout: its fp32 noise (4 B a value)
        assert saved(drop) == [(FP32, 128)]
    with numerics_as_on_cuda(mode), mode:            # CUDA dropout: a bool mask (1 B a value)
        assert saved(drop) == [(torch.bool, 32)]
        assert F.dropout(h, 0.1, False) is h         # evaluation: no dropout at all
        assert saved(lambda: F.dropout(h, 0.0, True)) == []


def test_real_tensors_keep_cpus_numerics_while_an_estimate_runs():
    x = torch.randn(4, 8).bfloat16()
    with numerics_as_on_cuda(FakeTensorMode()), torch.autocast("cpu", dtype=BF16):
        assert (x.pow(2).dtype, F.layer_norm(x, (8,)).dtype, x.softmax(-1).dtype) == (BF16, BF16, BF16)
        torch.manual_seed(0)
        dropped = F.dropout(x.float(), 0.5, True)
    torch.manual_seed(0)
    assert torch.equal(dropped, F.dropout(x.float(), 0.5, True))  # the same CPU kernel, same RNG


@pytest.mark.slow
def test_one_estimator_measuring_many_plans_keeps_host_memory_bounded():
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, vocab_size=100, hidden_dropout_prob=0.1)
    model = BertForSequenceClassification(config)
    batch = {"input_ids": torch.randint(0, 100, (16, 16)), "labels": torch.randint(0, 2, (16,))}
    est = Estimator(model, batch)
    plans = [Plan(m, 16 // m, precision=p) for m in (2, 4, 8) for p in ("fp32", "bf16")]
    for plan in plans * 2:  # warm: torch's own one-time caches
        est.measure(plan)
    gc.collect()
    cached = len(FakeTensorMode.cache)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        table = sys.getsizeof(FakeTensorMode.cache)
        for plan in plans * 2:
            est.measure(plan)
            assert len(FakeTensorMode.cache) == cached  # each measure's dispatch entries dropped
        gc.collect()
        # A dict does not shrink when entries are popped, and now and then its table is rebuilt
        # larger (36 KiB once, in some orders of test files): that is not entries kept.
        grown = tracemalloc.get_traced_memory()[0] - before - (sys.getsizeof(FakeTensorMode.cache) - table)
    finally:
        tracemalloc.stop()
    # The cache was the growth (BERT-base: ~0.27 MiB a plan); what is left is torch's bookkeeping
    # (autograd, the dispatcher), measured here at 5-17 KiB a plan and falling with more plans.
    assert grown / len(plans * 2) < 32 * 1024
