"""replay.StartState, reading.Epochs/rng_untouched and optimizers.needs_closure, unit by unit."""

import random

import numpy as np
import pytest
import torch

from autofit.gpu.device import CpuDevice, SimulatedDevice
from autofit.engine.optimizers import needs_closure
from autofit.engine.reading import Epochs, rng_untouched
from autofit.engine.replay import StartState, fresh


class WithBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(3)
        self.register_buffer("ids", torch.arange(5))

    def forward(self, x):
        return self.bn(x)


def test_a_replay_draws_the_same_random_numbers_and_sees_the_same_buffers_and_groups():
    model = WithBuffers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["count"] = 1
    start = StartState(model, opt, CpuDevice())
    start.capture(torch.zeros(2))
    start.begin()
    first = (torch.rand(3), random.random(), np.random.rand(2))
    model(torch.randn(4, 3))
    opt.param_groups[0]["count"] += 1
    opt.param_groups[0]["extra"] = True
    assert model.bn.num_batches_tracked.item() == 1
    start.begin()  # a replay
    assert torch.equal(torch.rand(3), first[0])
    assert random.random() == first[1] and np.array_equal(np.random.rand(2), first[2])
    assert torch.equal(model.bn.running_mean, torch.zeros(3))  # written without a _version bump
    assert model.bn.num_batches_tracked.item() == 0
    assert opt.param_groups[0]["count"] == 1 and "extra" not in opt.param_groups[0]


def test_every_buffer_is_copied_at_every_capture_and_a_write_through_data_is_undone():
    model = WithBuffers()
    start = StartState(model, torch.optim.SGD(model.parameters(), lr=0.1), CpuDevice())
    start.capture(torch.zeros(2))
    assert start.buffers.copies == 4  # running_mean, running_var, num_batches_tracked, ids
    start.capture(torch.zeros(2))
    assert start.buffers.copies == 8
    model.bn.num_batches_tracked.data.fill_(7)  # through .data: no _version bump
    model.ids.data[0] = 9
    start.capture(torch.zeros(2))  # what the last step left is the start now
    model.bn.num_batches_tracked.data.fill_(8)
    model.ids.data[0] = 10
    start.begin()
    start.begin()  # a replay: the flag and the ids are put back
    assert model.bn.num_batches_tracked.item() == 7 and model.ids[0].item() == 9


def test_the_batch_comes_back_as_given():
    model = WithBuffers()
    start = StartState(model, torch.optim.SGD(model.parameters(), lr=0.1), CpuDevice())
    batch = {"x": torch.ones(4, 2), "ids": ["a", "b", "c", "d"]}
    start.capture(batch)
    got = start.begin()
    got.pop("x")[:2].mul_(5)  # a loss_fn that pops a field and writes to a slice in place
    got["ids"].append("e")
    assert torch.equal(batch["x"][:, 0], torch.tensor([5.0, 5.0, 1.0, 1.0]))
    again = start.begin()
    assert torch.equal(again["x"], torch.ones(4, 2)) and again["ids"] == ["a", "b", "c", "d"]
    assert again is not batch and again["ids"] is not batch["ids"]


def test_on_the_simulated_gpu_only_tensors_already_on_it_are_kept():
    import autofit
    host = torch.ones(3)
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        on_card = torch.zeros(3)
        start = StartState(torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=1), device)
        before = gpu.memory_allocated()
        start.capture((host, on_card))
        assert list(start.kept) == [id(on_card)]
        assert gpu.memory_allocated() == before  # the copies are host memory
        start.begin()
        host.add_(1)  # reached the loss as a copy: written by something else, nothing to restore
        with pytest.raises(RuntimeError, match=r"a tensor of the batch \(\[3\], torch.float32\) was written"):
            start.begin()


def test_fresh_rebuilds_every_container():
    from collections import namedtuple
    Pair = namedtuple("Pair", "a b")
    t = torch.zeros(1)
    batch = {"p": Pair(t, [1, 2]), "q": (t,)}
    got = fresh(batch)
    assert got == batch and got is not batch and got["p"] is not batch["p"]
    assert got["p"].b is not batch["p"].b and got["p"].a is t


class CountingIterable:
    def __init__(self):
        self.iters = 0

    def __iter__(self):
        self.iters += 1
        return iter([torch.zeros(2), torch.ones(2)])


def test_epochs_read_the_data_once_each_and_the_first_batch_from_the_first_epoch():
    data = CountingIterable()
    epochs = Epochs(data, 2)
    assert data.iters == 1 and torch.equal(epochs.first, torch.zeros(2))
    assert [b.sum().item() for b in epochs()] == [0.0, 2.0]
    assert data.iters == 1
    assert [b.sum().item() for b in epochs()] == [0.0, 2.0]
    assert data.iters == 2


def test_a_one_shot_iterator_is_refused_for_several_epochs_without_reading_it():
    gen = (torch.zeros(1) for _ in range(2))
    with pytest.raises(ValueError, match=r"^data is a one-shot iterator \(generator\) but epochs=2"):
        Epochs(gen, 2)
    assert len(list(gen)) == 2
    with pytest.raises(ValueError, match="yielded no batch"):
        Epochs([], 1)


def test_rng_untouched_restores_the_global_rng_and_the_loaders_generators():
    g = torch.Generator().manual_seed(7)
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=5, shuffle=True, generator=g)
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    expected = (torch.rand(2), random.random(), np.random.rand(2))
    expected_order = next(iter(torch.utils.data.DataLoader(
        list(range(10)), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(7))))
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    with rng_untouched(loader):
        next(iter(loader))
        torch.rand(5), random.random(), np.random.rand(5)
    assert torch.equal(torch.rand(2), expected[0])
    assert random.random() == expected[1] and np.array_equal(np.random.rand(2), expected[2])
    assert torch.equal(next(iter(loader)), expected_order)


class NeedsClosure(torch.optim.SGD):
    def step(self, closure):
        return super().step(closure)


@pytest.mark.parametrize("cls, expected", [(torch.optim.LBFGS, True), (NeedsClosure, True),
                                           (torch.optim.SGD, False), (torch.optim.AdamW, False)])
def test_needs_closure(cls, expected):
    assert needs_closure(cls([torch.zeros(1, requires_grad=True)], lr=0.1)) is expected


def _train(model, opt, sched=None):
    model(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()
    if sched is not None:
        sched.step()


def test_a_restart_loads_the_model_optimizer_and_scheduler_back_each_time():
    from autofit.engine.replay import RESTART
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    _train(model, opt, sched)  # momentum buffers to keep
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    momenta = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    start = StartState(model, opt, CpuDevice(), mode=RESTART, scheduler=sched)
    start.capture()
    drawn = torch.rand(2)
    for _ in range(2):  # the second restore sees the first's loaded state stepped in place
        _train(model, opt, sched)
        start.restore()
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
        assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momenta))
        assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.05
        assert torch.equal(torch.rand(2), drawn)
    kept = StartState(model, None, CpuDevice(), mode=RESTART, weights=False)  # the Trainer re-creates both
    kept.capture()
    _train(model, opt)
    moved = [p.clone() for p in model.parameters()]
    kept.restore()
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), moved))


def test_a_trial_puts_every_tensor_gradient_mode_state_and_group_back():
    from autofit.engine.replay import TRIAL
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt)
    model.eval()
    grads = [p.grad for p in model.parameters()]
    values = [t.clone() for t in list(model.parameters()) + list(model.buffers())]
    state = {p: (s, {k: v.clone() for k, v in s.items()}) for p, s in opt.state.items()}
    with StartState(model, opt, None, mode=TRIAL).held():
        drawn = torch.rand(2)
        model.train()
        opt.zero_grad(set_to_none=True)
        _train(model, opt)
        opt.param_groups[0]["extra"] = True
        opt.param_groups[0]["lr"] = 1.0
    assert all(torch.equal(t, v) for t, v in zip(list(model.parameters()) + list(model.buffers()), values))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert not any(m.training for m in model.modules())
    assert all(opt.state[p] is s and all(torch.equal(s[k], v) for k, v in held.items())
               for p, (s, held) in state.items())
    assert opt.param_groups[0]["lr"] == 0.1 and "extra" not in opt.param_groups[0]
    assert torch.equal(torch.rand(2), drawn)
    with pytest.raises(ValueError, match=r"mode must be one of 'replay', 'restart', 'trial' but got 'again'"):
        StartState(model, opt, None, mode="again")
