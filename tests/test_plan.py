import dataclasses
import re

import pytest

from autofit.plans.plan import Plan
from autofit.plans.precision import PRECISIONS


def test_defaults_and_fields():
    plan = Plan(micro_batch_size=8)
    assert (plan.micro_batch_size, plan.accumulation_steps, plan.precision, plan.checkpointing,
            plan.offload_optimizer, plan.per_parameter_step) == (8, 1, "fp32", False, False, False)
    assert [f.name for f in dataclasses.fields(Plan)] == [
        "micro_batch_size", "accumulation_steps", "precision", "checkpointing", "offload_optimizer",
        "per_parameter_step", "reshard_after_forward", "reduce_each_micro_batch"]
    assert PRECISIONS == ("fp32", "bf16", "fp16")


def test_plan_is_an_immutable_hashable_value():
    plan = Plan(micro_batch_size=8, accumulation_steps=4, precision="bf16", checkpointing=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.micro_batch_size = 4
    same = Plan(micro_batch_size=8, accumulation_steps=4, precision="bf16", checkpointing=True)
    assert plan == same and hash(plan) == hash(same)
    assert plan != same.replace(offload_optimizer=True)
    assert len({plan, same, Plan(8)}) == 2


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "8", None])
def test_bad_micro_batch_size_names_the_value(value):
    with pytest.raises(ValueError, match=re.escape(f"micro_batch_size must be a positive int but got {value!r}.")):
        Plan(micro_batch_size=value)


@pytest.mark.parametrize("value", [0, -3, True, 1.0, "2", None])
def test_bad_accumulation_steps_names_the_value(value):
    with pytest.raises(ValueError,
                       match=re.escape(f"accumulation_steps must be a positive int but got {value!r}.")):
        Plan(micro_batch_size=1, accumulation_steps=value)


@pytest.mark.parametrize("value", ["fp8", "FP16", "bfloat16", "auto", "", None])
def test_bad_precision_names_the_value_and_the_choices(value):
    with pytest.raises(ValueError, match=re.escape(f"precision must be one of fp32, bf16, fp16 but got {value!r}.")):
        Plan(micro_batch_size=1, precision=value)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_precision_is_accepted(precision):
    assert Plan(micro_batch_size=1, precision=precision).precision == precision


@pytest.mark.parametrize("args, expected", [
    ((10,), Plan(micro_batch_size=10, accumulation_steps=1)),
    ((10, 4), Plan(micro_batch_size=4, accumulation_steps=3)),
    ((10, 5), Plan(micro_batch_size=5, accumulation_steps=2)),
    ((10, 64), Plan(micro_batch_size=10, accumulation_steps=1)),   # capped at the global batch
    ((1, 1), Plan(micro_batch_size=1, accumulation_steps=1)),
    ((64, 1), Plan(micro_batch_size=1, accumulation_steps=64)),
    ((64, None), Plan(micro_batch_size=64, accumulation_steps=1)),
])
def test_for_batch(args, expected):
    assert Plan.for_batch(*args) == expected


def test_for_batch_passes_other_fields():
    assert Plan.for_batch(7, 2, precision="bf16", checkpointing=True, offload_optimizer=True) == Plan(
        micro_batch_size=2, accumulation_steps=4, precision="bf16", checkpointing=True, offload_optimizer=True)
    with pytest.raises(ValueError, match="'fp8'"):
        Plan.for_batch(7, 2, precision="fp8")


@pytest.mark.parametrize("make", [
    lambda: Plan.for_batch(0),
    lambda: Plan.for_batch(10, 0),
    lambda: Plan(micro_batch_size=4).with_micro_batch(0, 10),
], ids=["for_batch(0)", "for_batch(10, 0)", "with_micro_batch(0, 10)"])
def test_zero_sizes_are_refused_with_a_value_error(make):
    # BUG (autofit/plans/plan.py:41-42 and 53-54): for_batch(0) and with_micro_batch(0, 10) raise
    # ZeroDivisionError from math.ceil(global_batch / 0); for_batch(10, 0) silently treats 0 as
    # "no micro-batch given" (`micro_batch_size or global_batch`) and returns a 10 x 1 plan.
    with pytest.raises(ValueError, match=r"\b0\b"):
        make()


def test_global_batch_is_micro_times_accumulation():
    assert Plan(micro_batch_size=4, accumulation_steps=3).global_batch == 12
    assert Plan.for_batch(10, 4).global_batch == 12  # the largest batch it covers, not the batch itself
    assert Plan(micro_batch_size=7).global_batch == 7


def test_replace_returns_a_new_value_and_validates():
    plan = Plan(micro_batch_size=8, accumulation_steps=2)
    new = plan.replace(precision="bf16", checkpointing=True)
    assert new == Plan(micro_batch_size=8, accumulation_steps=2, precision="bf16", checkpointing=True)
    assert plan == Plan(micro_batch_size=8, accumulation_steps=2)
    with pytest.raises(ValueError, match="got 0"):
        plan.replace(micro_batch_size=0)


@pytest.mark.parametrize("micro, global_batch, expected", [
    (3, 10, (3, 4)),
    (5, 10, (5, 2)),
    (50, 10, (10, 1)),
    (1, 10, (1, 10)),
    (16, 64, (16, 4)),
])
def test_with_micro_batch_keeps_the_other_fields(micro, global_batch, expected):
    plan = Plan(micro_batch_size=64, accumulation_steps=1, precision="bf16", checkpointing=True,
                offload_optimizer=True)
    got = plan.with_micro_batch(micro, global_batch)
    assert got == Plan(micro_batch_size=expected[0], accumulation_steps=expected[1], precision="bf16",
                       checkpointing=True, offload_optimizer=True)


def test_dict_round_trip():
    plan = Plan(micro_batch_size=8, accumulation_steps=4, precision="fp16", offload_optimizer=True)
    data = plan.to_dict()
    assert data == {"micro_batch_size": 8, "accumulation_steps": 4, "precision": "fp16",
                    "checkpointing": False, "offload_optimizer": True, "per_parameter_step": False,
                    "reshard_after_forward": None, "reduce_each_micro_batch": False}
    assert Plan.from_dict(data) == plan
    assert Plan.from_dict({"micro_batch_size": 2}) == Plan(micro_batch_size=2)


def test_from_dict_refuses_unknown_fields_and_bad_values():
    with pytest.raises(ValueError, match=re.escape(
            "unknown Plan fields ['extra', 'micro']; expected ['accumulation_steps', 'checkpointing', "
            "'micro_batch_size', 'offload_optimizer', 'per_parameter_step', 'precision', "
            "'reduce_each_micro_batch', 'reshard_after_forward'].")):
        Plan.from_dict({"micro": 8, "extra": 1, "precision": "fp32"})
    with pytest.raises(ValueError, match="'fp8'"):
        Plan.from_dict({"micro_batch_size": 8, "precision": "fp8"})
    with pytest.raises(ValueError, match="got '8'"):
        Plan.from_dict({"micro_batch_size": "8"})


@pytest.mark.parametrize("plan, text", [
    (Plan(micro_batch_size=8), "micro 8 x 1, fp32"),
    (Plan(micro_batch_size=8, accumulation_steps=4, precision="bf16"), "micro 8 x 4, bf16"),
    (Plan(micro_batch_size=2, accumulation_steps=32, precision="bf16", checkpointing=True),
     "micro 2 x 32, bf16, checkpointing"),
    (Plan(micro_batch_size=1, accumulation_steps=64, precision="fp16", checkpointing=True,
          offload_optimizer=True), "micro 1 x 64, fp16, checkpointing, offload"),
    (Plan(micro_batch_size=4, offload_optimizer=True), "micro 4 x 1, fp32, offload"),
])
def test_describe(plan, text):
    assert plan.describe() == text


def test_a_per_parameter_step_is_shown_and_older_rows_without_it_still_load():
    plan = Plan(8, 2, per_parameter_step=True)
    assert plan.describe() == "micro 8 x 2, fp32, per-parameter step"
    assert plan.to_dict()["per_parameter_step"] is True
    assert Plan.from_dict(plan.to_dict()) == plan
    older = {"micro_batch_size": 8, "accumulation_steps": 2, "precision": "bf16", "checkpointing": True,
             "offload_optimizer": False}  # a cache row written before the field existed
    assert Plan.from_dict(older) == Plan(8, 2, "bf16", True)
