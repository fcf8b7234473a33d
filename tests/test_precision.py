"""The precision registry: every fact about a precision, in one place."""

import pytest
import torch

import autofit.estimator.capacity
import autofit.plans.plan
from autofit.plans import precision
from autofit.estimator.capacity import plan_cost
from autofit.plans.ladder import mixed_precision
from autofit.plans.plan import Plan


def test_registry_facts():
    rows = [(p.name, p.autocast_dtype, p.mixed, p.needs_scaler, p.cost, p.hf_flag, p.accelerate)
            for p in precision.REGISTRY.values()]
    assert rows == [("fp32", None, False, False, 1.0, None, "no"),
                    ("bf16", torch.bfloat16, True, False, 1.15, "bf16", "bf16"),
                    ("fp16", torch.float16, True, True, 1.15, "fp16", "fp16")]
    assert precision.PRECISIONS == ("fp32", "bf16", "fp16") == autofit.plans.plan.PRECISIONS
    assert precision.MIXED == ("bf16", "fp16")


def test_bf16_falls_back_to_fp16():
    assert [precision.mixed_for(True), precision.mixed_for(False)] == ["bf16", "fp16"]


def test_unknown_precision_names_the_value():
    with pytest.raises(ValueError, match=r"^precision must be one of fp32, bf16, fp16 but got 'fp8'\.$"):
        precision.get("fp8")
    with pytest.raises(ValueError, match=r"^mixed precision is 'bf16' or 'fp16' but got 'fp32'\.$"):
        mixed_precision("fp32")


def test_capacity_reads_the_cost_from_the_registry(monkeypatch):
    monkeypatch.setitem(precision.REGISTRY, "bf16",
                        precision.Precision("bf16", torch.bfloat16, False, 2.0, "bf16", "bf16"))
    assert plan_cost(Plan(32, precision="bf16"), 32) == 2.0
    assert plan_cost(Plan(32, precision="fp16"), 32) == autofit.estimator.capacity.MIXED_PRECISION_COST == 1.15
