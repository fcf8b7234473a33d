"""An optimizer step that runs out of memory before writing anything is replayed at the same plan:
judged by value against the step's snapshot (engine/atomic.Snapshot.unchanged), or, without one, by
whether the optimizer's own update had begun (engine/atomic.AtomicStep.began)."""

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


OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-foreach-off": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2, foreach=True),
    "sgd-foreach-off": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2, foreach=False),
}


def _model(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, OPTIMIZERS[kind](model.parameters())


def _plain(kind):
    model, opt = _model(kind)
    for batch in data():
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


# A step without a snapshot (its plan's last step fitted with room, or no budget on a CPU) is
# judged by where it failed: before the optimizer's own update began nothing was written, whatever
# the kernels (foreach writes move no `_version` under the simulated GPU's dispatch mode).
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("budget", [None, "64MiB"], ids=["plain-cpu", "simulated-not-at-risk"])
def test_an_unguarded_step_pre_hook_oom_is_replayed_at_the_same_plan(kind, budget, monkeypatch):
    monkeypatch.setattr(AtomicStep, "at_risk", lambda self, key: False)
    model, opt = _model(kind)
    opt.register_step_pre_hook(one_off_oom_at({2}))
    with autofit.stepper(model, opt, loss_fn=loss_fn, precision="fp32", budget=budget, capacity_check=False,
                         cache=False) as step:
        for batch in data():
            step(batch)
        attempts = [(a.step, a.outcome) for a in step.attempts]
    assert attempts == [(0, "ok"), (1, "oom"), (1, "ok"), (2, "ok")]
    plain, plain_opt = _plain(kind)
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert torch.equal(mine, theirs)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert opt.state[p].keys() == plain_opt.state[q].keys()
        assert all(torch.equal(opt.state[p][k], plain_opt.state[q][k]) for k in opt.state[p])


def _sqrt_oom_at(monkeypatch, kind, call):
    """An OOM at the `call`-th square root AdamW takes inside its update, after it wrote its step
    counters, parameters (weight decay) and moments: foreach's `_foreach_sqrt`, or a parameter's
    `sqrt()` in the per-parameter loop (the first parameter written whole, the rest not)."""
    calls = []
    if kind == "adamw-foreach":
        real = torch._foreach_sqrt

        def fake(tensors):
            calls.append(1)
            if len(calls) == call:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            return real(tensors)
        monkeypatch.setattr(torch, "_foreach_sqrt", fake)
    else:
        real = torch.Tensor.sqrt

        def fake(self):
            if self.dim() > 0:  # a moment, not the bias correction's scalar
                calls.append(1)
                if len(calls) == call:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            return real(self)
        monkeypatch.setattr(torch.Tensor, "sqrt", fake)


@pytest.mark.parametrize("kind, call, counters", [("adamw-foreach", 2, [2, 2, 2, 2]),
                                                  ("adamw-foreach-off", 6, [2, 2, 1, 1])])
def test_an_unguarded_step_that_fails_inside_the_update_stops_naming_what_may_be_applied(kind, call, counters,
                                                                                        monkeypatch):
    """Step 1's update fails at a square root (the foreach call for all four parameters, or the
    second parameter's in the per-parameter loop, after the first was updated whole): parameters
    and moments are written in part, so the run stops, never calling the step again."""
    monkeypatch.setattr(AtomicStep, "at_risk", lambda self, key: False)
    model, opt = _model(kind)
    _sqrt_oom_at(monkeypatch, kind, call)
    name = "AdamW" if kind == "adamw-foreach" else "AdamW (foreach off)"
    with pytest.raises(autofit.errors.PartialUpdateError) as caught:
        with autofit.stepper(model, opt, loss_fn=loss_fn, precision="fp32", capacity_check=False,
                             cache=False) as step:
            for batch in data():
                step(batch)
    assert str(caught.value) == (
        "the optimizer step ran out of memory part-way (CUDA out of memory. Tried to allocate 2.00 MiB) "
        "although the last step of this plan fitted with room to spare; " + name + "'s own update had "
        "started, so any of its parameters and state may hold it in part, and it cannot be undone, so the "
        "run stops here instead of applying it twice. Lower the budget or set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to reduce fragmentation.")
    assert [(a.step, a.outcome) for a in step.attempts] == [(0, "ok")]  # no replay
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == counters  # what was applied


def test_foreach_writes_move_no_version_under_a_dispatch_mode():
    """Why a step is never judged by write counters: torch's foreach kernels have no
    ADInplaceOrView kernel, so under any dispatch mode (and, by the same table, on CUDA's
    multi-tensor kernels) their in-place writes leave `_version` where it was; a per-tensor write
    moves it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    tensors = [torch.zeros(3), torch.zeros(3)]
    with torch.no_grad(), Passing():
        torch._foreach_add_(tensors, 1.0)
        assert [t._version for t in tensors] == [0, 0] and tensors[0].tolist() == [1.0, 1.0, 1.0]
        tensors[0].add_(1.0)
        assert [t._version for t in tensors] == [1, 0]
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_foreach_add_.Scalar", "ADInplaceOrView")
