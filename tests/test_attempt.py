"""engine/attempt: the one attempt primitive (catch only OOM, leave the except block, free, check the
baseline) and the walk down (until_fits, next_down) that training, evaluation and the Trainer use."""

import gc
import logging
import sys
import weakref

import pytest
import torch

import autofit.engine.attempt as attempt_module
from autofit.engine import attempt as attempt_module
from autofit.engine.attempt import Attempter, Outcome, next_down, until_fits
from autofit.errors import DoesNotFit, MemoryNotReleased
from autofit.gpu.device import SimulatedDevice
from autofit.gpu.simulate import simulate_gpu
from autofit.plans.ladder import Either, ShrinkMicroBatch, checkpointing, mixed_precision
from autofit.plans.sizelog import SizeLog
from autofit.plans.plan import Plan

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _quick_gc():
    """release() runs gc.collect(); with everything made before the test frozen it takes ms."""
    with simulate_gpu():
        torch.ones(1, requires_grad=True).sum().backward()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def device():
    with simulate_gpu("6MiB") as gpu:
        yield SimulatedDevice(gpu)


def mib(n: int) -> torch.Tensor:
    return torch.empty(n * MiB // 4)  # float32: n MiB


def test_attempts_halve_until_one_fits_with_exact_outcomes(device):
    sizes, outcomes = [16], []

    def once():
        size = sizes[-1]
        outcome = Attempter(device)(lambda: mib(size).numel() * 4 // MiB, peak=device.max_memory_allocated)
        outcomes.append((size, outcome.ok, outcome.value, outcome.error.split(". ")[1:2]))
        return outcome

    def after_oom(outcome):
        assert device.memory_allocated() == outcome.baseline == 0  # freed before it is recorded
        sizes.append(sizes[-1] // 2)
        return True

    last = until_fits(once, after_oom)
    assert outcomes == [(16, False, None, ["Tried to allocate 16.00 MiB"]),
                        (8, False, None, ["Tried to allocate 8.00 MiB"]),
                        (4, True, 4, [])]
    assert (last.ok, last.value) == (True, 4)


@pytest.mark.parametrize("mib_per_row, tried, fits", [
    (2, [Plan(8), Plan(4, 2), Plan(2, 4)], True),                # 16, 8 MiB fail; 4 MiB fits in 6
    (8, [Plan(8), Plan(4, 2), Plan(2, 4), Plan(1, 8)], False),  # even one row fails: the ladder ends
])
def test_a_walk_down_the_ladder_tries_exact_plans(device, mib_per_row, tried, fits):
    ladder, plans = ShrinkMicroBatch(SizeLog(), floor=1), [Plan(8)]

    def once():
        return Attempter(device)(lambda: mib(mib_per_row * plans[-1].micro_batch_size))

    def after_oom(outcome):
        taken = next_down(ladder, plans[-1], 8)
        if taken is not None:
            plans.append(taken[0])
        return taken is not None

    assert until_fits(once, after_oom).ok is fits
    assert plans == tried


def test_the_walk_ends_when_nothing_is_left_or_after_max_attempts(device):
    tries = []

    def once():
        tries.append(len(tries))
        return Attempter(device)(lambda: mib(16))

    last = until_fits(once, lambda outcome: len(tries) < 3)
    assert tries == [0, 1, 2] and last.ok is False and last.error.startswith("CUDA out of memory. Tried to allocate 16.00 MiB")
    tries.clear()
    last = until_fits(once, lambda outcome: True, max_attempts=5)
    assert tries == [0, 1, 2, 3, 4] and last.ok is False


def test_tenacity_is_entered_only_after_a_first_failure(monkeypatch):
    """A global batch that fits costs one call: tenacity's Retrying is built and entered only once
    an attempt has failed; the attempts and their count are the same either way."""
    entered = []

    class Counted(attempt_module.Retrying):
        def __call__(self, *args, **kwargs):
            entered.append(1)
            return super().__call__(*args, **kwargs)
    monkeypatch.setattr(attempt_module, "Retrying", Counted)
    results = iter([Outcome(False), Outcome(False), Outcome(True, value=3)])
    seen = []
    assert until_fits(lambda: Outcome(True, value=1), seen.append).value == 1
    assert entered == [] and seen == []
    last = until_fits(lambda: next(results), lambda outcome: seen.append(outcome) or True, max_attempts=5)
    assert (last.ok, last.value, len(seen), entered) == (True, 3, 2, [1])
    tries = []
    last = until_fits(lambda: tries.append(1) or Outcome(False), lambda outcome: True, max_attempts=2)
    assert (last.ok, len(tries), entered) == (False, 2, [1, 1])


def test_the_walk_passes_the_search_state_from_each_step_down_to_the_next_attempt():
    """`walk` attempts each state the step-down returned, in order, and returns the state it would
    attempt next: None when the step-down left nothing, the untried one when the cap ended it."""
    attempted = []

    def once(state):
        attempted.append(state)
        return Outcome(state == 2, value=state)
    outcome, state = attempt_module.walk(once, lambda state, outcome: state // 2, 8)
    assert (attempted, outcome.value, state) == ([8, 4, 2], 2, 2)
    attempted.clear()
    outcome, state = attempt_module.walk(once, lambda state, outcome: state - 2 if state > 4 else None, 9)
    assert (attempted, outcome.ok, state) == ([9, 7, 5, 3], False, None)
    attempted.clear()
    outcome, state = attempt_module.walk(once, lambda state, outcome: state + 2, 1, max_attempts=3)
    assert (attempted, outcome.ok, state) == ([1, 3, 5], False, 7)


def test_only_oom_is_caught_and_nothing_is_released_for_other_errors(device, monkeypatch):
    released = []
    monkeypatch.setattr(attempt_module, "release", lambda *a, **k: released.append(a))
    with pytest.raises(ValueError, match="not an OOM"):
        Attempter(device)(lambda: (_ for _ in ()).throw(ValueError("not an OOM")))
    refused = Attempter(device, catches=lambda error: not isinstance(error, DoesNotFit))
    with pytest.raises(DoesNotFit):
        refused(lambda: (_ for _ in ()).throw(DoesNotFit("ladder exhausted elsewhere")))
    assert released == []


class Marker:
    """An object only the failed attempt's frame refers to."""


def test_release_runs_after_the_except_block_with_the_attempt_frames_gone(device, monkeypatch):
    seen = []
    real_release = attempt_module.release

    def recording_release(dev, **kwargs):
        # No exception is being handled (so none of its traceback frames is alive), and the
        # marker that only the failed frame held is gone already.
        seen.append((sys.exc_info(), marker_ref(), dev.memory_allocated()))
        real_release(dev, **kwargs)

    monkeypatch.setattr(attempt_module, "release", recording_release)

    def work():
        marker, activation = Marker(), mib(2)  # noqa: F841 (held by this frame only)
        refs.append(weakref.ref(marker))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    refs = []

    def marker_ref():
        return refs[0]()

    outcome = Attempter(device)(work)
    assert seen == [((None, None, None), None, 0)]
    assert (outcome.ok, outcome.error) == (False, "CUDA out of memory. Tried to allocate 2.00 MiB")


def test_a_tensor_kept_past_the_attempt_fails_the_baseline_check_naming_its_bytes(device):
    kept = []

    def work(keep):
        if keep:
            kept.append(mib(1))  # a loss stored in a list, outliving the attempt
        mib(16)

    model = torch.nn.Linear(4, 4)
    device.place_model(model)
    with pytest.raises(MemoryNotReleased) as raised:
        Attempter(device, lambda: (model, None))(lambda: work(True))
    message = str(raised.value)
    assert message.startswith("after an out-of-memory attempt 1.00 MiB stayed allocated above the "
                              "pre-attempt baseline, held by ")
    assert "[262144]" in message and "[4, 4]" not in message  # the kept tensor, not the weights
    kept.clear()
    assert Attempter(device, lambda: (model, None))(lambda: work(False)).ok is False  # nothing kept


def test_bytes_the_model_gains_during_an_attempt_are_its_own_with_grows(device):
    def registers_a_buffer(model):
        def work():
            model.register_buffer(f"lazy{len(model._buffers)}", mib(1))
            mib(16)
        return work

    model = torch.nn.Linear(4, 4)
    device.place_model(model)
    assert Attempter(device, lambda: (model, None), grows=True)(registers_a_buffer(model)).ok is False
    with pytest.raises(MemoryNotReleased, match="1.00 MiB stayed allocated"):
        Attempter(device, lambda: (model, None))(registers_a_buffer(model))


def test_free_runs_before_release_and_holders_name_what_stays(device):
    order, kept = [], []
    att = Attempter(device, free=lambda: order.append("free"),
                    holders=lambda: order.append("holders") or [])
    with pytest.raises(MemoryNotReleased, match="held by no tensor Python can see"):
        att(lambda: kept.append(mib(1)) or mib(16))
    assert order == ["free", "holders"]


def test_inspect_reads_the_failure_inside_the_except_block(device):
    def inspect(error):
        return type(error).__name__, device.memory_allocated()

    def work():
        held = mib(3)  # noqa: F841
        mib(16)

    outcome = Attempter(device)(work, inspect=inspect, peak=device.max_memory_allocated)
    assert outcome.found == ("OutOfMemoryError", 3 * MiB)  # read while the attempt held its 3 MiB
    assert (outcome.peak, outcome.baseline, device.memory_allocated()) == (3 * MiB, 0, 0)


# -- next_down --------------------------------------------------------------------------------

def test_next_down_gives_the_moves_the_true_global_batch():
    ladder = ShrinkMicroBatch(SizeLog(), floor=1)
    assert next_down(ladder, Plan.for_batch(9, 8), 9) == (Plan(4, 3), ladder.why)
    walk, plan = [], Plan.for_batch(9, 9)
    while (taken := next_down(ladder, plan, 9)) is not None:
        plan = taken[0]
        walk.append((plan.micro_batch_size, plan.accumulation_steps))
    assert walk == [(4, 3), (2, 5), (1, 9)]


def test_next_down_hands_each_move_the_global_batch_it_was_given():
    seen = []

    class Recording(ShrinkMicroBatch):
        def step(self, plan, global_batch=None):
            seen.append(global_batch)
            return super().step(plan, global_batch)

    ladder = Either(Recording(SizeLog(), floor=1))
    assert next_down(ladder, Plan(8, 2), 9, failed={Plan(4, 3)}.__contains__) == (Plan(2, 5), ladder.moves[0].why)
    assert seen == [9, 9]


def test_next_down_walks_past_plans_known_to_fail_and_stops_on_circles():
    sizes = SizeLog()
    ladder = Either(ShrinkMicroBatch(sizes, floor=1))
    failed = {Plan(4, 2), Plan(2, 4)}
    assert next_down(ladder, Plan(8), 8, failed=failed.__contains__) == (Plan(1, 8), ladder.moves[0].why)
    assert next_down(ladder, Plan(1, 8), 8) is None

    class Back:  # a move that goes round in circles: 8 -> 4 -> 8
        def take(self, plan, global_batch=None):
            return (plan.replace(micro_batch_size={8: 4, 4: 8}[plan.micro_batch_size]), "flip")
    assert next_down(Either(Back()), Plan(8, 1), 8, failed={Plan(4, 2)}.__contains__) is None


def test_next_down_skips_moves_that_do_not_apply_saying_why_once(caplog):
    ladder = Either(mixed_precision("bf16"), checkpointing())
    said: set = set()

    def applies(plan):
        return "no bf16 on this device" if plan.precision == "bf16" else None

    with caplog.at_level(logging.WARNING, logger="autofit"):
        first = next_down(ladder, Plan(8), 8, not_applicable=applies, said=said)
        again = next_down(ladder, Plan(8), 8, not_applicable=applies, said=said)
    assert first == (Plan(8, checkpointing=True),
                     f"{ladder.moves[1].why} ({ladder.moves[0]!r} skipped: no bf16 on this device)")
    assert again == (Plan(8, checkpointing=True), ladder.moves[1].why)
    assert [r.getMessage() for r in caplog.records] == ["no bf16 on this device; the ladder goes on without it"]
