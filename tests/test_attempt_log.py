"""AttemptLog: every attempt read back as recorded, in memory that grows with what changed."""

import pytest
import torch

import autofit
from autofit.engine.attempt import Attempt
from autofit.engine.attempt_log import AttemptLog
from autofit.plans.plan import Plan
from reference import bert, cls_batches


def test_many_alike_steps_are_one_entry_and_read_back_exactly():
    plan = Plan.for_batch(8, 4)
    log = AttemptLog()
    log.append(Attempt(Plan(8), "oom", "start", 900, 0, "CUDA out of memory", "forward", {"params": 1}))
    for step in range(200_000):
        log.append(Attempt(plan, "ok", "stepped down", 512, step))
    assert len(log) == 200_001 and log.entries == 2
    assert log[0].outcome == "oom" and log[0].memory == {"params": 1}
    assert log[1] == Attempt(plan, "ok", "stepped down", 512, 0)
    assert log[-1] == Attempt(plan, "ok", "stepped down", 512, 199_999)
    assert log[100_000].step == 99_999
    assert [a.step for a in log[-3:]] == [199_997, 199_998, 199_999]
    with pytest.raises(IndexError, match="attempt index 200001 out of range for 200001 attempts"):
        log[200_001]


def test_changes_start_entries_and_peaks_that_differ_are_kept_per_step():
    a, b = Plan(8), Plan.for_batch(8, 4)
    recorded = [Attempt(a, "ok", "start", 100, 0), Attempt(a, "ok", "start", 100, 1),
                Attempt(a, "ok", "start", 130, 2),  # another row length: its own peak, same entry
                Attempt(a, "oom", "probe", 900, 3, "OOM", "backward"),
                Attempt(b, "ok", "stepped down", 50, 3), Attempt(b, "ok", "stepped down", 50, 4),
                Attempt(b, "ok", "kept", 50, 5),  # another reason
                Attempt(b, "ok", "kept", 50, 7)]  # not the next step
    log = AttemptLog(recorded)
    assert list(log) == recorded and log == recorded and log[2:5] == recorded[2:5]
    assert [len(log), log.entries] == [8, 5]
    assert log.of_step(3) == recorded[3:5] and log.of_step(7) == recorded[7:]
    with pytest.raises(TypeError, match="an AttemptLog holds Attempts, not dict"):
        log.append({"plan": a})


def test_a_run_keeps_its_steps_in_a_few_entries_and_reports_them_all():
    batches, model = cls_batches(6, rows=8), bert()
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)
        with autofit.stepper(model, torch.optim.SGD, precision="fp32", cache=False, capacity_check=False,
                             ladder=lambda p: p.replace(micro_batch_size=p.micro_batch_size // 2)
                             if p.micro_batch_size > 1 else None) as step:
            outs = [step(b) for b in batches]
    log = step.attempts
    assert isinstance(log, AttemptLog)
    assert [(a.step, a.plan.micro_batch_size, a.outcome) for a in log] == [
        (0, 8, "oom"), (0, 4, "ok"), (1, 6, "ok"), (2, 7, "ok"), (3, 7, "ok"), (4, 7, "ok"), (5, 7, "ok")]
    assert log.entries < len(log)
    assert [[a.step for a in o.attempts] for o in outs] == [[0, 0], [1], [2], [3], [4], [5]]
