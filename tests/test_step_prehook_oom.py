"""An optimizer step that runs out of memory before writing anything is replayed at the same plan
(engine/atomic.Snapshot.unchanged), judged by value against the step's snapshot."""

import pytest
import torch
from torch import nn

import autofit
from autofit.engine.atomic import AtomicStep


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]


def loss_fn(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def one_off_oom_at(calls_that_fail):
    calls = []

    def hook(optimizer, args, kwargs):
        calls.append(1)
        if len(calls) in calls_that_fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    return hook


# A guarded step (a budget's first step, whose need is not known yet, or any step at risk) is
# judged by value against its snapshot; at the first step (no state yet) and at a later one.
@pytest.mark.parametrize("failing", [1, 2])
def test_a_step_pre_hook_oom_is_replayed_at_the_same_plan(failing, monkeypatch):
    monkeypatch.setattr(AtomicStep, "at_risk", lambda self, key: True)
    budget = "64MiB"
    model, opt = model_and_optimizer()
    opt.register_step_pre_hook(one_off_oom_at({failing}))
    with autofit.stepper(model, opt, loss_fn=loss_fn, precision="fp32", budget=budget, capacity_check=False,
                         cache=False) as step:
        for batch in data():
            step(batch)
        attempts = [(a.step, a.plan.describe(), a.outcome) for a in step.attempts]
    expected = [(s, "micro 8 x 1, fp32", "ok") for s in range(3)]
    expected.insert(failing - 1, (failing - 1, "micro 8 x 1, fp32", "oom"))
    assert attempts == expected
    plain, plain_opt = model_and_optimizer()
    for batch in data():
        loss_fn(plain, batch).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert torch.equal(mine, theirs)
    assert all(torch.equal(opt.state[p]["exp_avg"], plain_opt.state[q]["exp_avg"])
               for p, q in zip(model.parameters(), plain.parameters()))
