"""The precision registry: every fact about a precision, in one place."""

from types import SimpleNamespace

import pytest
import torch

import autofit.estimator.capacity
import autofit.plans.plan
from autofit import cli
from autofit.cache.fingerprint import DeviceKey, job_key
from autofit.recipes.options import Options
from autofit.plans import precision
from autofit.estimator.cost import candidate_plans, plan_cost
from autofit.plans.ladder import mixed_precision
from autofit.plans.plan import Plan


def test_registry_facts():
    rows = [(p.name, p.autocast_dtype, p.mixed, p.needs_scaler, p.cost, p.hf_flag, p.accelerate)
            for p in precision.REGISTRY.values()]
    assert rows == [("fp32", None, False, False, 1.0, None, "no"),
                    ("bf16", torch.bfloat16, True, False, 1.15, "bf16", "bf16"),
                    ("fp16", torch.float16, True, True, 1.15, "fp16", "fp16")]
    assert precision.PRECISIONS == ("fp32", "bf16", "fp16")
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
    assert plan_cost(Plan(32, precision="fp16"), 32) == autofit.plans.precision.MIXED_PRECISION_COST == 1.15


def test_policy_and_fallback_lookups():
    assert precision.names() == ("fp32", "bf16", "fp16")
    assert precision.mixed_names() == ("bf16", "fp16")
    assert precision.policies() == ("auto", "fp32", "bf16", "fp16")
    assert (precision.EXACT, precision.AUTO) == ("fp32", "auto")
    assert [precision.start_precision(p) for p in precision.policies()] == ["fp32", "fp32", "bf16", "fp16"]
    assert precision.allowed("auto", True) == ("fp32", "bf16")
    assert precision.allowed("auto", False) == ("fp32", "fp16")
    assert precision.allowed("fp16", True) == ("fp16",)
    assert precision.autocast_dtypes() == frozenset({torch.bfloat16, torch.float16})
    assert [(p.measured_as, p.slow_on) for p in precision.REGISTRY.values()] == [
        (None, ()), (None, ()), ("bf16", ("cpu",))]
    with pytest.raises(ValueError, match=r"^precision must be one of auto, fp32, bf16, fp16 but got 'int8'\.$"):
        precision.check_policy("int8")
    with pytest.raises(ValueError, match=r"^precision must be one of fp32, bf16, fp16 but got \['bf16'\]\.$"):
        Plan(4, precision=["bf16"])


def test_device_support_and_hugging_face_flags():
    class Device:
        def __init__(self, bf16):
            self.bf16 = bf16

        def supports_bf16(self):
            return self.bf16

    supported = {name: [p.supported_on(Device(True)), p.supported_on(Device(False))]
                 for name, p in precision.REGISTRY.items()}
    assert supported == {"fp32": [True, True], "bf16": [True, False], "fp16": [True, True]}
    flags = [precision.from_hf_flags(SimpleNamespace(bf16=b, fp16=f))
             for b, f in [(False, False), (True, False), (False, True), (True, True)]]
    assert flags == [None, "bf16", "fp16", "bf16"]


FP8 = precision.Precision("fp8", torch.float8_e4m3fn, True, 1.3, None, "fp8")


def test_a_precision_added_to_the_registry_is_offered_everywhere(monkeypatch):
    monkeypatch.setitem(precision.REGISTRY, "fp8", FP8)
    assert precision.policies() == ("auto", "fp32", "bf16", "fp16", "fp8")
    assert precision.autocast_dtypes() == frozenset({torch.bfloat16, torch.float16, torch.float8_e4m3fn})
    # the CLI's choices
    probe = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["probe"]._actions
                 if a.dest == "precision")
    assert probe.choices == ("auto", "fp32", "bf16", "fp16", "fp8")
    assert cli.build_parser().parse_args(["probe", "--gpu-mem", "2GiB", "--precision", "fp8"]).precision == "fp8"
    # every check of a user's precision=, and the plans and moves built from it
    Options(precision="fp8")
    assert Plan(4, precision="fp8").precision == "fp8"
    assert [p.precision for p in candidate_plans(2, "fp8", allow_offload=False, checkpointing=False)] == ["fp8", "fp8"]
    assert mixed_precision("fp8").step(Plan(4)) == Plan(4, precision="fp8")
    assert mixed_precision("bf16").step(Plan(4, precision="fp8")) is None  # only from an exact plan
    assert plan_cost(Plan(4, precision="fp8"), 4) == 1.3
    with pytest.raises(ValueError, match=r"^precision must be one of auto, fp32, bf16, fp16, fp8 but got 'fp4'\.$"):
        Options(precision="fp4")
    with pytest.raises(TypeError, match=r"pass the policy, one of auto, fp32, bf16, fp16, fp8\.$"):
        job_key(model=torch.nn.Linear(2, 2), batch=torch.zeros(2, 2), optimizer_name="AdamW", global_batch=2,
                precision=None, device=DeviceKey("simulated"))
