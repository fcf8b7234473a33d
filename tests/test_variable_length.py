"""Variable-length data: the longest batch decides the plan; a longer batch arriving late is trained.

Short batches (16 rows x 8 tokens) fit whole under the budget; a long one (16 x 64) arriving third
does not at that plan, but does at half of it. The run must step down for it, replay it, train it
(nothing dropped) and keep the mathematics of a plain loop that splits each batch as the run did.
"""

import math

import pytest
import torch

import autofit
from autofit.plans.plan import Plan
from autofit.estimator.start import longest_batch
from reference import bert, cls_batches, max_diff
from reference import second_step_peak as reference_peak

ROWS, SHORT, LONG = 16, 8, 64


def small():
    return bert(layers=1, hidden=16)


def data():
    short = cls_batches(3, rows=ROWS, seq=SHORT, seed=1)
    [long] = cls_batches(1, rows=ROWS, seq=LONG, seed=2)
    return [short[0], short[1], long, short[2]]  # the long batch arrives third


def second_step_peak(batch, plan):
    return reference_peak(small(), batch, plan)


@pytest.fixture(scope="module")
def budget():
    batches = data()
    short_whole = second_step_peak(batches[0], Plan(ROWS))
    long_whole = second_step_peak(batches[2], Plan(ROWS))
    long_half = second_step_peak(batches[2], Plan.for_batch(ROWS, ROWS // 2))
    assert max(short_whole, long_half) < long_whole
    return (max(short_whole, long_half) + long_whole) // 2  # short whole fits, long whole does not


def plain_loop(batches, micro_sizes):
    """AdamW over each batch split by its micro size, micro losses weighted by rows; the losses."""
    model = small()
    optimizer = torch.optim.AdamW(model.parameters())
    losses = []
    for batch, micro in zip(batches, micro_sizes):
        total = 0.0
        for i in range(0, ROWS, micro):
            part = {k: v[i:i + micro] for k, v in batch.items()}
            loss = model(**part).loss * (len(part["labels"]) / ROWS)
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return model, losses


def check_trained_like_a_plain_loop(model, result, batches):
    assert [h["step"] for h in result.history] == [0, 1, 2, 3]       # every batch, in order
    assert [h["samples"] for h in result.history] == [ROWS] * 4
    micro = [h["plan"].micro_batch_size for h in result.history]
    reference, losses = plain_loop(batches, micro)
    assert all(math.isfinite(h["loss"]) for h in result.history)
    assert [round(h["loss"], 5) for h in result.history] == [round(x, 5) for x in losses]
    assert max_diff(model, reference) <= 1e-6
    return micro


def test_a_long_batch_arriving_late_is_stepped_down_for_and_trained(budget):
    batches = data()
    model = small()
    result = autofit.run(model, batches, budget=budget, precision="fp32", progress=False, cache=False,
                         capacity_check=False)
    attempts = [(a.step, a.plan.micro_batch_size, a.outcome) for a in result.attempts]
    assert attempts[:4] == [(0, 16, "ok"), (1, 16, "ok"), (2, 16, "oom"), (2, 8, "ok")]
    assert all(a.outcome == "ok" for a in result.attempts[4:])
    assert result.attempts[2].reason == "kept: fitted the previous global batch"
    assert result.attempts[3].reason.startswith("smaller micro-batch")
    micro = check_trained_like_a_plain_loop(model, result, batches)
    assert micro[:3] == [16, 16, 8]


def test_with_the_capacity_check_a_long_batch_the_estimate_never_saw_is_trained(budget):
    """A generator cannot be looked ahead: the estimate sees the first (short) batch only."""
    batches = data()
    model = small()
    result = autofit.run(model, (b for b in batches), budget=budget, precision="fp32", progress=False,
                         cache=False)
    assert result.attempts[0].reason.startswith("estimated: fastest plan predicted to fit")
    assert result.attempts[0].plan.micro_batch_size == ROWS  # the short batches fit whole
    long_step = [(a.plan.micro_batch_size, a.outcome) for a in result.attempts if a.step == 2]
    assert long_step[0] == (ROWS, "oom") and long_step[-1][1] == "ok"
    assert long_step[-1][0] <= ROWS // 2
    check_trained_like_a_plain_loop(model, result, batches)


@pytest.mark.slow
def test_with_the_capacity_check_a_list_is_planned_for_its_longest_batch(budget):
    batches = data()
    model = small()
    result = autofit.run(model, batches, budget=budget, precision="fp32", progress=False, cache=False)
    first = result.attempts[0]
    assert first.reason.startswith("estimated: fastest plan predicted to fit")
    # Sized for the long batch; the probe on a short batch finds 16, and the long batch goes back to
    # the size estimated for it and probes from there to the largest its estimate predicts to fit
    # (11; uncalibrated: no step at this length has been measured yet): no OOM at all.
    assert attempts_of(result) == [(0, 8, "ok"), (1, 16, "ok"), (2, 11, "ok"), (3, 16, "ok")]
    assert result.attempts[2].reason == "probe a larger micro-batch (8 fits, searching upward)"
    check_trained_like_a_plain_loop(model, result, batches)


# -- longest_batch ------------------------------------------------------------------------------------

def test_longest_batch_picks_the_batch_with_the_most_elements_of_a_list():
    batches = data()
    assert longest_batch(batches, batches[0]) is batches[2]
    assert longest_batch(tuple(batches), batches[0]) is batches[2]
    wide = {"input_ids": torch.zeros(ROWS, SHORT, dtype=torch.long), "labels": torch.zeros(ROWS, LONG + 1)}
    assert longest_batch(batches + [wide], batches[0]) is wide  # every tensor counts


def test_longest_batch_of_data_it_cannot_look_ahead_in_is_the_first():
    batches = data()
    assert longest_batch(iter(batches), batches[0]) is batches[0]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 3)), batch_size=4)
    first = next(iter(loader))
    assert longest_batch(loader, first) is first
    assert longest_batch("not batches", batches[0]) is batches[0]


# -- the plan remembers the row length it was proven for ----------------------------------------------

def attempts_of(result):
    return [(a.step, a.plan.micro_batch_size, a.outcome) for a in result.attempts]


def test_each_length_gets_back_the_micro_batch_proven_for_it(budget):
    """After a long batch forced 8, short batches go back to 16; a later long batch starts from 8
    (and probes up from there) instead of trying the short batches' 16 again."""
    short = cls_batches(3, rows=ROWS, seq=SHORT, seed=1)
    longs = cls_batches(2, rows=ROWS, seq=LONG, seed=2)
    batches = [short[0], longs[0], short[1], short[2], longs[1]]
    model = small()
    result = autofit.run(model, (b for b in batches), budget=budget, precision="fp32", progress=False,
                         cache=False, capacity_check=False)
    assert attempts_of(result) == [(0, 16, "ok"), (1, 16, "oom"), (1, 8, "ok"), (2, 16, "ok"),
                                   (3, 16, "ok"), (4, 12, "ok")]
    assert result.attempts[3].reason == f"the micro-batch proven for rows this long ({SHORT + 1} elements per row)"
    assert result.attempts[5].reason == "probe a larger micro-batch (8 fits, searching upward)"
    assert [h["plan"].micro_batch_size for h in result.history] == [16, 8, 16, 16, 12]


def test_a_batch_longer_than_any_trained_starts_from_the_size_proven_for_the_longest(budget):
    short = cls_batches(2, rows=ROWS, seq=SHORT, seed=1)
    [middle] = cls_batches(1, rows=ROWS, seq=LONG // 2, seed=3)
    [long] = cls_batches(1, rows=ROWS, seq=LONG, seed=2)
    sizes = autofit.plans.sizelog.SizeLog()
    from autofit.engine.controller import Controller, Policy
    from autofit.gpu.device import open_device
    from autofit.engine.step import StepRunner
    model = small()
    with open_device(budget) as device:
        device.place_model(model)
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device)
        sizes.record(Plan(16), True, length=SHORT + 1)      # proven for short rows
        sizes.record(Plan(6), True, length=LONG // 2 + 1)   # and for the middle length
        controller = Controller(runner, autofit.plans.ladder.default_ladder(sizes, "fp32"), Plan(16),
                                sizes=sizes, policy=Policy(probe_up=False))
        controller.train(short[0], 0)
        controller.train(long, 1)      # longer than anything proven: the longest proof's size, 6
        controller.train(middle, 2)
        controller.train(short[1], 3)
        runner.close()
    assert attempts_of(controller) == [(0, 16, "ok"), (1, 6, "ok"), (2, 6, "ok"), (3, 16, "ok")]
    assert controller.attempts[1].reason == (
        f"rows of {LONG + 1} elements, longer than any trained so far: the micro-batch proven for the "
        f"longest ({LONG // 2 + 1})")


@pytest.mark.slow
def test_the_cache_keeps_the_plan_of_the_longest_rows_and_the_sizes_of_each_length(budget):
    from autofit.engine.batches import row_elements
    from autofit.cache.store import PlanCache
    batches = data() + cls_batches(1, rows=ROWS, seq=SHORT, seed=4)   # ends on a short batch
    first = autofit.run(small(), batches, budget=budget, precision="fp32", progress=False)
    assert [h["plan"].micro_batch_size for h in first.history] == [8, 16, 11, 16, 16]
    [row] = PlanCache().entries()
    entry = row["entry"]
    assert entry["plan"] == Plan(11, 2).to_dict()          # proven on the long batch, not the last one
    assert entry["proven_row_elements"] == row_elements(batches[2]) == LONG + 1
    assert entry["sizes"]["fits"] == [[["fp32", False, False], [[SHORT + 1, 16], [LONG + 1, 11]]]]
    again = autofit.run(small(), batches, budget=budget, precision="fp32", progress=False)
    assert attempts_of(again) == [(0, 16, "ok"), (1, 16, "ok"), (2, 11, "ok"), (3, 16, "ok"), (4, 16, "ok")]
    assert again.attempts[0].reason == f"the micro-batch proven for rows this long ({SHORT + 1} elements per row)"
