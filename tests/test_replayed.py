"""A step after the step before it, laid out from one walk per plan (autofit.estimator.replayed):
the same allocator calls as walking both steps, each plan walked once."""

import pytest
from models import gpt2_batch, tiny_bert, bert_batch, tiny_gpt2

from autofit.estimator import estimate as estimate_module
from autofit.estimator.estimate import Estimator
from autofit.estimator.replayed import Walk, first_then
from autofit.gpu.recorded import replay_capped
from autofit.gpu.workspaces import Workspaces
from autofit.plans.plan import Plan

ROWS = 12


def named_in_order(events):
    """`events` with each block named by the order of its allocation: two lists of the same calls
    made by different walks compare equal."""
    names, out = {}, []
    for i, e in enumerate(events):
        if e[0] == "m":
            names[e[3]] = i
            out.append(e[:3] + (i,))
        elif e[0] == "f":
            out.append(("f", names.pop(e[1])))
        else:
            out.append(e)
    return out


def walked(estimator, plan, after):
    """The allocator calls and estimate of walking both steps (the walk `_replayed` replaces)."""
    estimate = estimator._measure(plan, after)
    return estimator.last_meter.allocator.events, estimate


def plan(m, precision="fp32", **switches):
    return Plan.for_batch(ROWS, m, precision=precision, **switches)


@pytest.mark.parametrize("build, batch, workspaces", [
    (tiny_gpt2, gpt2_batch(ROWS), None),
    (tiny_bert, bert_batch(ROWS), Workspaces.of_capability((9, 0))),
])
def test_a_step_after_another_makes_the_calls_of_walking_both(build, batch, workspaces):
    estimator = Estimator(build(), batch, device_type="cpu", workspaces=workspaces)
    pairs = [(plan(5), plan(5)), (plan(5), plan(4)), (plan(4), plan(12)), (plan(6, "bf16"), plan(6, "bf16")),
             (plan(3, offload_optimizer=True), plan(3, offload_optimizer=True)),
             (plan(4, checkpointing=True), plan(6))]
    for then, first in pairs:
        events, walk = walked(estimator, then, first)
        laid = first_then(estimator._walk(first), estimator._walk(then))
        assert named_in_order(laid) == named_in_order(events), (then, first)
        replayed = estimator.measure(then, after=first)
        assert (replayed.peak_bytes, replayed.step_bytes, replayed.breakdown) == \
            (walk.peak_bytes + replayed.workspace_bytes, walk.step_bytes + replayed.workspace_bytes,
             {**walk.breakdown, "other": walk.breakdown["other"] + replayed.workspace_bytes})
        assert replayed.reserved_bytes - estimate_module.own_reserved(workspaces) == walk.reserved_bytes
        for cap in (walk.reserved_bytes - 2**20, walk.reserved_bytes // 2):  # and under a cap
            assert replay_capped(laid, cap) == replay_capped(events, cap)


def _counted_walks(monkeypatch) -> list:
    """The walks the estimator makes from now on: (micro-batch, after, whole) each."""
    walks = []
    measure = Estimator._measure

    def counted(self, p, after=None, whole=False):
        walks.append((p.micro_batch_size, after, whole))
        return measure(self, p, after, whole)
    monkeypatch.setattr(Estimator, "_measure", counted)
    return walks


def test_each_plan_is_walked_once_whatever_it_follows(monkeypatch):
    estimator = Estimator(tiny_gpt2(), gpt2_batch(ROWS), device_type="cpu")
    walks = _counted_walks(monkeypatch)
    for then, first in ((6, 6), (4, 6), (6, 4), (4, 4), (6, 6)):
        estimator.measure(plan(then), after=plan(first))
    assert walks == [(6, None, True), (4, None, True)]


def test_a_step_that_frees_a_block_made_before_it_is_walked_instead():
    params = [("m", 512, True, "p")]
    state = [("m", 1024, True, "s")]
    own = [("m", 2048, True, "a"), ("s",), ("f", "a")]
    frees_param = [("m", 2048, True, "a"), ("s",), ("f", "p"), ("f", "a")]
    walk = Walk(None, params + state + [("r",)] + own, 1, 2)
    freeing = Walk(None, params + state + [("r",)] + frees_param, 1, 2)
    assert first_then(walk, walk) == params + [
        ("m", 2048, True, (1, 0)), ("s",), ("m", 1024, True, "s"), ("f", (1, 0)), ("r",),
        ("m", 2048, True, (2, 0)), ("s",), ("f", (2, 0))]
    # The step measured may free its own walk's blocks; the step before it, from another walk, not.
    assert first_then(walk, freeing)[-2:] == [("f", "p"), ("f", (2, 0))]
    assert first_then(freeing, walk) is None


def test_a_step_whose_walk_has_no_record_is_walked_whole(monkeypatch):
    estimator = Estimator(tiny_gpt2(), gpt2_batch(ROWS), device_type="cpu")
    monkeypatch.setattr(Estimator, "_walk", lambda self, p: None)
    events, walk = walked(estimator, plan(5), plan(4))
    assert estimator.measure(plan(5), after=plan(4)).reserved_bytes == walk.reserved_bytes


def test_a_plan_asked_again_is_answered_from_its_first_walk(monkeypatch):
    from test_calibrate import LM_ROWS, gpt2, lm_batches  # MiB-sized blocks: a cap changes the replay
    estimator = Estimator(gpt2(), lm_batches(1)[0], device_type="cpu")
    walks = _counted_walks(monkeypatch)
    sixteen, eight = Plan.for_batch(LM_ROWS, 16, precision="fp32"), Plan.for_batch(LM_ROWS, 8, precision="fp32")
    first, other, again = (estimator.measure(p) for p in (sixteen, eight, sixteen))
    assert walks == [(16, None, False), (8, None, False)]
    assert again is first and other.peak_bytes != first.peak_bytes and estimator.estimates == 3
    # Its record of allocations comes back with it: a cap replays this plan's step, not the last walked.
    assert (first.reserved_bytes, estimator.capped(sixteen, 25 * 2**20).reserved_bytes) == (30 * 2**20, 28 * 2**20)
    assert walks == [(16, None, False), (8, None, False)]
