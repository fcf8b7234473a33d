"""Guarantee 2: an optimizer step is applied whole or not at all."""

import copy

import pytest
import torch

import autofit
from autofit.atomic import AtomicStep, PartialUpdateError
from autofit.device import SimulatedDevice
from autofit.offload import Offloaded


def _setup(gpu, steps_before: int, model=None):
    """A model with gradients ready and `steps_before` AdamW steps already taken (foreach, as CUDA
    would run it: it mutates exp_avg and step before its sqrt allocates). The default is a small
    MLP: the optimizer's mechanics are the same for any model, and every allocation is tried."""
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    device = SimulatedDevice(gpu)
    device.place_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    for i in range(steps_before + 1):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if i < steps_before:
            optimizer.step()
    return model, optimizer, device


def _snapshot(model, optimizer):
    return ([p.detach().clone() for p in model.parameters()],
            {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for p, s in optimizer.state.items()})


def _assert_same(model, optimizer, saved):
    params, state = saved
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    assert {id(p) for p in optimizer.state} == set(state)
    for p, s in optimizer.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())


def _twin(model, optimizer):
    """An independent copy of the model, its gradients and the optimizer with its state."""
    model2 = copy.deepcopy(model)
    for p2, p in zip(model2.parameters(), model.parameters()):
        p2.grad = None if p.grad is None else p.grad.clone()
    optimizer2 = torch.optim.AdamW(model2.parameters(), foreach=True)
    optimizer2.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return model2, optimizer2


def _step_allocations(steps_before):
    with autofit.simulate_gpu() as gpu:
        model, optimizer, device = _setup(gpu, steps_before)
        start = gpu.allocation_count
        optimizer.step()
        return gpu.allocation_count - start


@pytest.mark.parametrize("steps_before", [0, 1], ids=["first step (state created)", "later step"])
def test_an_oom_at_any_allocation_of_the_step_is_rolled_back(steps_before):
    count = _step_allocations(steps_before)
    assert count >= 4
    for index in range(count):
        with autofit.simulate_gpu() as gpu:
            model, optimizer, device = _setup(gpu, steps_before)
            saved = _snapshot(model, optimizer)
            before = gpu.memory_allocated()
            atomic = AtomicStep(optimizer, device)
            gpu.fail_at(gpu.allocation_count + index)
            with pytest.raises(torch.OutOfMemoryError, match="update rolled back"):
                atomic(optimizer.step)
            _assert_same(model, optimizer, saved)
            assert gpu.memory_allocated() == before, index
            # The retry is applied exactly once: it equals one clean step from the same state.
            twin = _twin(model, optimizer)
            atomic(optimizer.step)
            twin[1].step()
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin[0].parameters()))


def test_a_step_that_is_not_guarded_refuses_to_be_retried():
    with autofit.simulate_gpu() as gpu:
        model, optimizer, device = _setup(gpu, 1)
        gpu.fail_at(gpu.allocation_count + 3)
        with pytest.raises(PartialUpdateError, match="cannot be undone"):
            AtomicStep(optimizer, device)(optimizer.step, guard=False)


def test_steps_known_to_fit_skip_the_snapshot():
    with autofit.simulate_gpu("64MiB") as gpu:
        model, optimizer, device = _setup(gpu, 0)
        atomic = AtomicStep(optimizer, device)
        atomic(optimizer.step, key="plan")       # unknown need: guarded
        atomic(optimizer.step, key="plan")       # measured need fits the free memory: not guarded
        assert atomic.snapshots == 1
        assert atomic.need["plan"] > 0


def test_offloaded_state_lives_on_the_host_and_comes_back():
    with autofit.simulate_gpu() as gpu:
        model, optimizer, device = _setup(gpu, 1)
        reference = _twin(model, optimizer)
        with_state = gpu.memory_allocated()
        offloaded = Offloaded(optimizer, device)
        state_bytes = with_state - gpu.memory_allocated()
        assert state_bytes >= 2 * sum(p.numel() * 4 for p in model.parameters())
        assert len(optimizer.state) == 0
        offloaded.step()
        reference[1].step()
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference[0].parameters()))
        assert diff <= 1e-6
        offloaded.give_back()
        assert gpu.memory_allocated() == with_state
        assert optimizer.param_groups[0]["foreach"] is True
        assert int(optimizer.state[next(iter(model.parameters()))]["step"]) == 2
