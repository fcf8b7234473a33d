"""A start plan is a plan for the steady state: a plan is cached only once it ran a step with the
optimizer state resident (the run's first step makes that state), and a cached plan that runs out
of memory is replaced in the cache by the plan the run went on with, so the next run starts there."""

import torch
import torch.nn.functional as F

import autofit
from autofit.cache.store import PlanCache

ROWS = 64
MiB = 2**20


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 4))


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 64, generator=g), torch.randint(0, 4, (ROWS,), generator=g)) for _ in range(n)]


def loss_fn(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def run(n, budget, **kwargs):
    data = batches(n)
    return autofit.run(mlp(), data, loss_fn=loss_fn, budget=budget, precision="fp32", progress=False, **kwargs)


def steps(result):
    return [(a.step, a.plan.micro_batch_size, a.outcome) for a in result.attempts]


def cached():
    return [(row["entry"]["plan"]["micro_batch_size"]) for row in PlanCache().entries()]


def test_a_plan_that_ran_only_the_first_step_is_not_cached():
    first = run(1, "64MiB")
    assert steps(first) == [(0, 64, "ok")]
    assert cached() == []  # the optimizer state never was resident under it
    second = run(2, "64MiB")
    assert steps(second) == [(0, 64, "ok"), (1, 64, "ok")]
    assert cached() == [64]


def test_a_cached_plan_that_runs_out_of_memory_is_replaced_by_the_one_that_ran():
    run(2, "64MiB")
    assert cached() == [64]
    data, model = batches(3), mlp()
    with autofit.simulate_gpu("64MiB") as gpu:
        gpu.fail_at(gpu.allocation_count)  # the cached plan's first attempt runs out of memory
        demoted = autofit.run(model, data, loss_fn=loss_fn, precision="fp32", progress=False)
    # Down to 32, then up to below the size that failed (64 is known to fail in this run).
    assert steps(demoted) == [(0, 64, "oom"), (0, 32, "ok"), (1, 48, "ok"), (2, 56, "ok")]
    assert demoted.attempts[0].reason.startswith("cached: worked for this job")
    assert cached() == [56]  # demoted: the next run starts from what ran, not from what failed
    model = mlp()
    with autofit.simulate_gpu("64MiB"):
        warm = autofit.run(model, data, loss_fn=loss_fn, precision="fp32", progress=False)
    assert steps(warm) == [(0, 56, "ok"), (1, 56, "ok"), (2, 56, "ok")]
