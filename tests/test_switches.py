"""The plan's switches come from one registry (plans/switches.py): a switch added there is worded,
keyed, priced, stepped to, suggested, tried by the capacity check, set by the step through its hook
and read by the estimator through its own, everywhere, with nothing else to change."""

import ast
import dataclasses
import inspect

import pytest
import torch

from autofit.diagnosis.explain import _changes
from autofit.engine.step import StepRunner
from autofit.estimator import cost
from autofit.estimator.cost import candidate_plans, plan_cost
from autofit.estimator.estimate import Estimator
from autofit.gpu.device import CpuDevice
from autofit.plans import switches
from autofit.plans.applies import unavailable_changes
from autofit.plans.ladder import SetField, switch_on
from autofit.plans.plan import Plan
from autofit.plans.sizelog import config_of


@dataclasses.dataclass(frozen=True)
class PinnedPlan(Plan):
    """A plan with one more switch, as a new field would be added to Plan."""
    pinned_memory: bool = False


STEPPED = []  # (runner, value) for every call of the dummy switch's step hook


def pin_hook(runner, plan):
    STEPPED.append((runner, plan.pinned_memory))


def pin_applies(plan, model, optimizer, device, checkpointing):
    return f"no pinned memory on {device.type}" if plan.pinned_memory and device.type == "cpu" else None


def pin_measured(estimator, plan):
    return not plan.pinned_memory  # the estimate runs the opposite, to be seen


PINNED = switches.Switch(
    "pinned_memory", "copies to the device go through pinned host memory", cost=1.25,
    turn_on=lambda plan: None if plan.pinned_memory else plan.replace(pinned_memory=True),
    label=lambda v: "pinned" if v else None, config=lambda v: ("pinned",) if v else (),
    change=lambda v: "pinned memory " + ("on" if v else "off"), fix="pinned",
    step=f"{__name__}:pin_hook", tries=lambda trial: (False, True), applies=f"{__name__}:pin_applies",
    estimate=f"{__name__}:pin_measured")


@pytest.fixture
def pinned(monkeypatch):
    monkeypatch.setattr(switches, "SWITCHES", switches.SWITCHES + (PINNED,))
    monkeypatch.setitem(switches.BY_NAME, "pinned_memory", PINNED)
    monkeypatch.setattr(cost, "Plan", PinnedPlan)  # the Plan with the new field, as candidate_plans builds
    STEPPED.clear()


def test_a_switch_added_to_the_registry_is_used_everywhere(pinned):
    off, on = PinnedPlan(8, 2), PinnedPlan(8, 2, pinned_memory=True)
    assert on.describe() == "micro 8 x 2, fp32, pinned" and off.describe() == "micro 8 x 2, fp32"
    assert config_of(on) == ("fp32", False, False, "pinned") != config_of(off)
    assert on.replace(precision="bf16").plain() == off  # nothing a step-down turns on
    assert plan_cost(on, 16) == pytest.approx(plan_cost(off, 16) * 1.25, rel=1e-15, abs=0)
    move = switch_on("pinned_memory")
    assert isinstance(move, SetField) and move.take(off) == (on, PINNED.why) and move(on) is None
    assert unavailable_changes(off, lambda p: "no pinned memory here" if p.pinned_memory else None) == {
        "pinned_memory": "no pinned memory here"}
    assert _changes(off, on) == (["pinned memory on"], {"pinned"})
    # the capacity check tries it off and on, priced and ordered as the others
    assert [(p.micro_batch_size, p.pinned_memory) for p in
            candidate_plans(2, "fp32", allow_offload=False, checkpointing=False)] == [
        (2, False), (2, True), (1, False), (1, True)]


def test_a_switch_added_to_the_registry_is_set_by_the_step_and_read_by_the_estimator(pinned):
    model = torch.nn.Linear(2, 1)
    runner = StepRunner(model, torch.optim.SGD(model.parameters(), lr=0.1), CpuDevice(),
                        loss_fn=lambda m, b: m(b).pow(2).mean())
    runner.run(torch.ones(4, 2), PinnedPlan(2, 2, pinned_memory=True))
    runner.run(torch.ones(4, 2), PinnedPlan(4))
    assert runner.not_applicable(PinnedPlan(4, pinned_memory=True)) == "no pinned memory on cpu"
    assert runner.not_applicable(PinnedPlan(4)) is None
    assert STEPPED == [(runner, True), (runner, False)]  # once per attempt, through its hook
    runner.close()
    estimator = Estimator(model, torch.ones(4, 2), torch.optim.SGD, lambda m, b: m(b).pow(2).mean(),
                          device_type="cpu")
    assert estimator.measured_plan(PinnedPlan(4)) == PinnedPlan(4, pinned_memory=True)


def test_every_switch_names_hooks_that_exist_and_the_registry_imports_none_of_them():
    for switch in switches.SWITCHES:
        assert list(inspect.signature(switch.step_hook()).parameters) == ["runner", "plan"], switch.name
        assert list(inspect.signature(switch.applies_hook()).parameters) == [
            "plan", "model", "optimizer", "device", "checkpointing"], switch.name
        hook = switch.estimate_hook()
        assert hook is None or list(inspect.signature(hook).parameters) == ["estimator", "plan"], switch.name
    assert [s.name for s in switches.SWITCHES if s.estimate] == [
        "offload_optimizer", "reshard_after_forward", "reduce_each_micro_batch"]
    tree = ast.parse(inspect.getsource(switches))  # plans/ sits below engine/ and estimator/
    imported = [n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names]
    assert [m for m in imported if m.startswith("autofit")] == []
    with pytest.raises(ValueError, match=r"the plan switch hook 'autofit.engine.step:no_such_hook' names "
                                         r"nothing importable .*\"package.module:function\""):
        switches.resolve("autofit.engine.step:no_such_hook")


def test_the_registered_switches_keep_their_words_keys_and_costs():
    assert [s.name for s in switches.SWITCHES] == [
        "checkpointing", "offload_optimizer", "per_parameter_step", "reshard_after_forward", "reduce_each_micro_batch"]
    assert [f.name for f in dataclasses.fields(Plan)][3:] == [s.name for s in switches.SWITCHES]  # each a Plan field
    every = Plan(4, 2, checkpointing=True, offload_optimizer=True, per_parameter_step=True,
                 reshard_after_forward=False, reduce_each_micro_batch=True)
    assert every.describe() == ("micro 4 x 2, fp32, checkpointing, offload, per-parameter step, "
                                "gathered params kept for backward, reduce-scatter per micro-batch")
    assert config_of(every) == ("fp32", True, True, "per-parameter step", "kept gathered",
                                "reduce-scatter per micro-batch")
    assert config_of(Plan(4)) == ("fp32", False, False)  # keys cached before the later switches
    # FSDP2's settings say how the model is sharded: the plain plan keeps them
    assert every.replace(precision="bf16").plain() == Plan(4, 2, reshard_after_forward=False,
                                                           reduce_each_micro_batch=True)
    # two micro-batches of 4 rows cost as two of 8 (the busy floor): 2.0, then each switch on
    assert plan_cost(every, 8) == pytest.approx(2.0 * 4 / 3 * 3.0 * 1.0 * 1.08, rel=1e-12, abs=0)
    assert switch_on("reshard_after_forward")(Plan(4, reshard_after_forward=None)) is None  # the model's own
    assert switch_on("reduce_each_micro_batch")(Plan(8)) is None  # one micro-batch: nothing to change
    with pytest.raises(ValueError, match=r"no plan switch 'compile'; the switches are checkpointing, "):
        switches.get("compile")
