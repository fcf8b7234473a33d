"""Meta kernels stricter than the real ones, answered in the estimator's dispatch: a fp32 mixture-of-experts
model (transformers' grouped_mm experts) is estimated on fake tensors, exactly, and torch's own meta
kernel is back afterwards."""

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from autofit.estimator import meta_kernels
from autofit.estimator.estimate import estimate
from autofit.plans.plan import Plan
from test_estimate import simulated_peak

VOCAB = 200


def moe():
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, vocab_size=VOCAB))


def moe_batch():
    ids = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


class Substituted(TorchDispatchMode):
    """Ops on meta tensors answered as the estimator's counting dispatch answers them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        swapped = meta_kernels.substitute(func, args, kwargs)
        if swapped is not None:
            func, args, kwargs = swapped
        return func(*args, **(kwargs or {}))


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_the_experts_run_through_the_grouped_matmul():
    # what the widening is for: transformers' default experts call aten::_grouped_mm, whose meta
    # kernel refuses fp32 though CPU's kernel runs it
    assert moe().config._experts_implementation == "grouped_mm"
    offs = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        torch._grouped_mm(meta(5, 8), meta(2, 8, 4), offs=offs.to("meta"))
    assert torch._grouped_mm(torch.ones(5, 8), torch.ones(2, 8, 4), offs=offs).shape == (5, 4)


@pytest.mark.parametrize("plan", [Plan(8), Plan(2, 4), Plan(8, precision="bf16")], ids=str)
def test_a_fp32_mixture_of_experts_is_estimated_on_fake_tensors_exactly(plan):
    batch = moe_batch()
    got = estimate(moe(), batch, plan, device_type="cpu")
    # before, the meta kernel's refusal sent it to real rows, 7% low at micro 8
    assert got.method == "fake"
    assert got.peak_bytes == simulated_peak(moe(), batch, plan)


def test_torchs_meta_kernel_is_back_after_an_estimate():
    estimate(moe(), moe_batch(), Plan(8), device_type="cpu")
    with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        torch._grouped_mm(meta(5, 8), meta(2, 8, 4), offs=torch.tensor([3, 5], dtype=torch.int32, device="meta"))


@pytest.mark.parametrize("a, b, offs, shape, fp32_stride, fp16_stride", [
    ((10, 8), (3, 8, 6), 3, (10, 6), (8, 1), (8, 1)),  # experts: tokens by group x a weight per group
    ((8, 10), (10, 6), 4, (4, 8, 6), (64, 8, 1), (64, 8, 1)),  # a weight-gradient: one product per group
    ((3, 10, 8), (8, 12), 3, (10, 12), (12, 1), (16, 1)),
    ((3, 10, 8), (3, 8, 12), None, (3, 10, 12), (120, 12, 1), (160, 16, 1)),  # a batched matmul
])
def test_the_widened_kernel_follows_the_real_kernels_shapes(a, b, offs, shape, fp32_stride, fp16_stride):
    offs = None if offs is None else meta(offs, dtype=torch.int32)
    # rows padded to 16 bytes, as CUDA allocates them: 4 fp32 or 8 fp16 columns at a time
    for dtype, stride in ((torch.float32, fp32_stride), (torch.float16, fp16_stride)):
        with Substituted():
            out = torch._grouped_mm(meta(*a, dtype=dtype), meta(*b, dtype=dtype), offs=offs)
        assert (tuple(out.shape), out.dtype, out.stride()) == (shape, dtype, stride)


def test_bf16_is_torchs_own_kernel_inside_as_outside():
    a, b, offs = meta(16, 8, dtype=torch.bfloat16), meta(2, 8, 16, dtype=torch.bfloat16), meta(2, dtype=torch.int32)
    with Substituted():
        inside = torch._grouped_mm(a, b, offs=offs)
        # and torch's checks with it: bf16 rows must be 16-byte aligned for the fast kernel
        with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
            torch._grouped_mm(meta(16, 6, dtype=torch.bfloat16), meta(2, 6, 16, dtype=torch.bfloat16), offs=offs)
    outside = torch._grouped_mm(a, b, offs=offs)
    assert (inside.shape, inside.dtype, inside.stride()) == (outside.shape, outside.dtype, outside.stride())
    assert (tuple(inside.shape), inside.dtype) == ((16, 16), torch.bfloat16)


def test_mixed_operands_are_still_refused():
    with Substituted(), pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        torch._grouped_mm(meta(5, 8), meta(2, 8, 4, dtype=torch.float16), offs=meta(2, dtype=torch.int32))


def test_an_estimate_registers_no_kernel_with_torchs_dispatcher(monkeypatch):
    """torch 2.10-2.12 refuse a second Python kernel for an op (`allow_override`, absent in 2.4):
    with every registration refused as those torches refuse it, a fp32 MoE is still estimated on
    fake tensors, exactly, and so is a dense model."""
    def refuse(self, *args, **kwargs):
        raise RuntimeError("This is not allowed since there's already a kernel registered from python "
                           "overriding _grouped_mm's behavior for Meta dispatch key and aten namespace.")
    monkeypatch.setattr(torch.library.Library, "impl", refuse)
    batch = moe_batch()
    got = estimate(moe(), batch, Plan(8), device_type="cpu")
    assert (got.method, got.peak_bytes) == ("fake", simulated_peak(moe(), batch, Plan(8)))


def test_the_substitute_answers_only_the_calls_torchs_meta_kernel_refuses():
    offs = meta(2, dtype=torch.int32)
    with Substituted():
        out = torch._grouped_mm(meta(10, 8), meta(2, 8, 6), offs=offs)
    assert (tuple(out.shape), out.dtype, out.stride(), out.device.type) == ((10, 6), torch.float32, (8, 1), "meta")
    assert meta_kernels.substitute(torch.ops.aten.mm.default, (meta(2, 2), meta(2, 2)), {}) is None
