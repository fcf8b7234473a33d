"""Transient and lasting failures are told apart (docs/ladder.md, "The ladder"): a size this run proved at
this row length is retried once after an OOM before the failure counts; failures the run records
expire after a number of good steps, so it probes above them again; nothing is cached from a
failure that a retry survived."""

import pytest
import torch

import autofit
from autofit.cache.store import PlanCache
from autofit.gpu.simulate import active_gpu


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.GELU(),
                               torch.nn.Linear(32, 3))


def _batches(n, rows):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def _faults_at(model, calls):
    """Arm one injected OOM in each of these forward calls (1-based), a few allocations in."""
    seen = [0]

    def hook(module, args):
        seen[0] += 1
        if seen[0] in calls:
            gpu = active_gpu()
            gpu.fail_at(gpu.allocation_count + 2)
    return model.register_forward_pre_hook(hook)


def _run(model, data, **options):
    options = {"loss_fn": _loss, "budget": "64MiB", "capacity_check": False, "progress": False,
               **options}
    return autofit.run(model, data, **options)


def _entry():
    [row] = PlanCache().entries()
    entry = dict(row["entry"])
    for volatile in ("when", "throughput"):  # wall-clock facts, not what was proven
        entry.pop(volatile)
    return entry


def test_one_transient_fault_leaves_the_plan_and_the_cache_of_a_fault_free_run(tmp_path, monkeypatch):
    data = _batches(4, 8)
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "clean"))
    clean_model = _mlp()
    clean = _run(clean_model, data)
    clean_entry = _entry()

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "faulty"))
    model = _mlp()
    _faults_at(model, {3})  # step 2's forward
    faulty = _run(model, data)

    assert [(a.step, a.outcome, a.plan.describe()) for a in faulty.attempts] == [
        (0, "ok", "micro 8 x 1, fp32"), (1, "ok", "micro 8 x 1, fp32"),
        (2, "oom", "micro 8 x 1, fp32"), (2, "ok", "micro 8 x 1, fp32"), (3, "ok", "micro 8 x 1, fp32")]
    assert faulty.attempts[3].reason.startswith("retry: this micro-batch trained rows this long before")
    # precision="auto" with a global batch at the busy floor: a counted failure would go to bf16.
    assert faulty.plan == clean.plan == autofit.Plan(8)
    assert _entry() == clean_entry
    assert clean_entry["smallest_failing_micro_batch"] is None


def test_a_failure_that_survives_its_retry_counts_then_expires(monkeypatch):
    monkeypatch.setattr(autofit.engine.controller, "EXPIRE_AFTER", 2)
    model = _mlp()
    _faults_at(model, {3, 4})  # step 2 and its retry

    def halve(plan):
        if plan.micro_batch_size == 1:
            return None
        return plan.replace(micro_batch_size=plan.micro_batch_size // 2,
                            accumulation_steps=plan.accumulation_steps * 2)
    result = _run(model, _batches(6, 4), precision="fp32", ladder=halve, cache=False)
    assert [(a.step, a.outcome, a.plan.micro_batch_size) for a in result.attempts] == [
        (0, "ok", 4), (1, "ok", 4),
        (2, "oom", 4), (2, "oom", 4),   # proven at step 1: retried once, then it counts
        (2, "ok", 2),
        (3, "ok", 3),                   # the search probes between 2 (fits) and 4 (failed)
        (4, "ok", 4),                   # two good steps later the failure has expired: probe again
        (5, "ok", 4)]
    assert result.plan.micro_batch_size == 4


def test_a_size_not_proven_after_the_first_step_is_not_retried():
    """The first step runs before the optimizer state exists: fitting there proves less."""
    model = _mlp()
    _faults_at(model, {2})  # step 1: 4 rows fitted only on step 0
    result = _run(model, _batches(2, 4), precision="fp32", cache=False,
                  ladder=lambda p: p.replace(micro_batch_size=2, accumulation_steps=2)
                  if p.micro_batch_size > 2 else None)
    assert [(a.step, a.outcome, a.plan.micro_batch_size) for a in result.attempts] == [
        (0, "ok", 4), (1, "oom", 4), (1, "ok", 2)]  # counted at once
