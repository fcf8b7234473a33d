"""The plan's switches come from one registry (plans/switches.py): a switch added there is worded,
keyed, priced, stepped to and suggested everywhere, with nothing else to change."""

import dataclasses

import pytest

from autofit.diagnosis.explain import _changes
from autofit.estimator.cost import plan_cost
from autofit.plans import switches
from autofit.plans.applies import unavailable_changes
from autofit.plans.ladder import SetField, switch_on
from autofit.plans.plan import Plan
from autofit.plans.sizelog import config_of


@dataclasses.dataclass(frozen=True)
class PinnedPlan(Plan):
    """A plan with one more switch, as a new field would be added to Plan."""
    pinned_memory: bool = False


PINNED = switches.Switch(
    "pinned_memory", "copies to the device go through pinned host memory", cost=1.25,
    turn_on=lambda plan: None if plan.pinned_memory else plan.replace(pinned_memory=True),
    label=lambda v: "pinned" if v else None, config=lambda v: ("pinned",) if v else (),
    change=lambda v: "pinned memory " + ("on" if v else "off"), fix="pinned")


@pytest.fixture
def pinned(monkeypatch):
    monkeypatch.setattr(switches, "SWITCHES", switches.SWITCHES + (PINNED,))
    monkeypatch.setitem(switches.BY_NAME, "pinned_memory", PINNED)


def test_a_switch_added_to_the_registry_is_used_everywhere(pinned):
    off, on = PinnedPlan(8, 2), PinnedPlan(8, 2, pinned_memory=True)
    assert on.describe() == "micro 8 x 2, fp32, pinned" and off.describe() == "micro 8 x 2, fp32"
    assert config_of(on) == ("fp32", False, False, "pinned") != config_of(off)
    assert plan_cost(on, 16) == pytest.approx(plan_cost(off, 16) * 1.25, rel=1e-15, abs=0)
    move = switch_on("pinned_memory")
    assert isinstance(move, SetField) and move.take(off) == (on, PINNED.why) and move(on) is None
    assert unavailable_changes(off, lambda p: "no pinned memory here" if p.pinned_memory else None) == {
        "pinned_memory": "no pinned memory here"}
    assert _changes(off, on) == (["pinned memory on"], {"pinned"})


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
    # two micro-batches of 4 rows cost as two of 8 (the busy floor): 2.0, then each switch on
    assert plan_cost(every, 8) == pytest.approx(2.0 * 4 / 3 * 3.0 * 1.0 * 1.08, rel=1e-12, abs=0)
    assert switch_on("reshard_after_forward")(Plan(4, reshard_after_forward=None)) is None  # the model's own
    assert switch_on("reduce_each_micro_batch")(Plan(8)) is None  # one micro-batch: nothing to change
    with pytest.raises(ValueError, match=r"no plan switch 'compile'; the switches are checkpointing, "):
        switches.get("compile")
