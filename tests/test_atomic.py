"""Guarantee 2: an optimizer step is applied whole or not at all."""

import copy

import pytest
import torch

import autofit
from autofit.engine.atomic import AtomicStep, PartialUpdateError
from autofit.gpu.device import SimulatedDevice
from autofit.engine.offload import Offload, to_device


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


def test_offloaded_state_lives_on_the_host_in_the_users_optimizer_and_comes_back():
    """The state moves to the host inside the same optimizer (same dicts, same keys); a step there
    allocates nothing on the device and equals the device step bit for bit; to_device brings it back."""
    with autofit.simulate_gpu() as gpu:
        model, optimizer, device = _setup(gpu, 1)
        reference = _twin(model, optimizer)
        with_state = gpu.memory_allocated()
        offload = Offload(optimizer, device)
        state_bytes = with_state - gpu.memory_allocated()
        assert state_bytes >= 2 * sum(p.numel() * 4 for p in model.parameters())
        assert len(optimizer.state) == 4 and not any(
            gpu.holds(v) for s in optimizer.state.values() for v in s.values())
        before = gpu.memory_allocated()
        gpu.reset_peak_memory_stats()
        offload.step(optimizer.step)
        assert gpu.max_memory_allocated() == before  # the update allocated nothing on the device
        assert offload.bytes_moved == 3 * sum(p.numel() * 4 for p in model.parameters())
        assert all(gpu.holds(p) and gpu.holds(p.grad) for p in model.parameters())
        reference[1].step()
        for p, q in zip(model.parameters(), reference[0].parameters()):
            assert torch.equal(p, q)
            assert optimizer.state[p].keys() == reference[1].state[q].keys()
            assert all(torch.equal(v, reference[1].state[q][k]) for k, v in optimizer.state[p].items())
        offload.close()
        to_device(optimizer, device)
        assert gpu.memory_allocated() == with_state
        assert optimizer.param_groups[0]["foreach"] is True
        assert int(optimizer.state[next(iter(model.parameters()))]["step"]) == 2


# -- a fault at every allocation of a step inside a run: rolled back, or the run stops ------------

class _FaultyAdamW(torch.optim.AdamW):
    """foreach AdamW (as CUDA runs it) that can arm a fault at the `index`-th allocation (or op, on
    the plain CPU) of its `call`-th step; `calls` counts how often step() ran."""

    def __init__(self, params, call=None, index=None, counter=None):
        super().__init__(params, foreach=True)
        self.call, self.index, self.counter, self.calls = call, index, counter, 0

    def step(self, closure=None):
        self.calls += 1
        try:
            if self.calls - 1 != self.call or self.counter is None:
                return super().step(closure)
            with self.counter(self.index):
                return super().step(closure)
        finally:  # the counters as this call left them (the run clears the state of its own optimizer)
            self.steps = sorted({int(s["step"]) for s in self.state.values()})


def _simulated_fault(index):
    gpu = autofit.gpu.simulate.active_gpu()
    gpu.fail_at(None if index is None else gpu.allocation_count + index)
    return _Counting(lambda: gpu.allocation_count)


class _Counting:
    """Context that records how many allocations happened inside it (`last`)."""
    last = 0

    def __init__(self, read):
        self.read = read

    def __enter__(self):
        self.start = self.read()

    def __exit__(self, *exc):
        _Counting.last = self.read() - self.start


from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _CpuFault(TorchDispatchMode):
    """The plain CPU path: the `at`-th op inside that allocates (an output not aliasing an input)
    raises the CPU allocator's OOM before it runs."""
    last = 0

    def __init__(self, at):
        super().__init__()
        self.at, self.count = at, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if all(r.alias_info is not None for r in func._schema.returns):
            return func(*args, **(kwargs or {}))  # in place or a view: allocates nothing
        if self.count == self.at:
            self.count += 1
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                               "4096 bytes. Error code 12 (Cannot allocate memory)")
        self.count += 1
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        _CpuFault.last = self.count
        return super().__exit__(*exc)


def _fault_run(path, call, index):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    counter = _simulated_fault if path == "simulated" else _CpuFault
    made = []

    def factory(params):
        made.append(_FaultyAdamW(params, call, index, counter))
        return made[-1]

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    def go():
        return autofit.run(model, data, loss_fn=loss_fn, optimizer=factory, cache=False, progress=False,
                           capacity_check=False)
    if path == "simulated":
        with autofit.simulate_gpu():
            return model, made[0] if made else None, _call(go), made
    return model, None, _call(go), made


def _call(go):
    try:
        return go()
    except Exception as error:  # noqa: BLE001 - returned to the test to assert on
        return error


@pytest.mark.parametrize("path,guarded", [("simulated", True), ("simulated", False), ("plain", False)],
                         ids=["simulated-guarded", "simulated-unguarded", "plain-cpu-unguarded"])
def test_a_fault_at_every_allocation_of_a_step_in_a_run_never_replays_a_partial_update(
        path, guarded, monkeypatch, frozen_heap):
    """Step 2 of 3 fails at each of its allocations in turn. Guarded, the update is rolled back
    and replayed once (AdamW's counters end at 3, parameters as without the fault); unguarded
    (a step whose measured need fitted, or the plain CPU, which cannot tell), the run stops with
    PartialUpdateError and the step is never called again on top of its partial update."""
    from autofit.gpu.oom import is_oom
    clean_model, _, result, made = _fault_run(path, call=2, index=None if path == "simulated" else -1)
    assert isinstance(result, autofit.RunResult) and made[0].calls == 3
    count = _Counting.last if path == "simulated" else _CpuFault.last
    assert count >= 4
    monkeypatch.setattr(AtomicStep, "at_risk", lambda self, key: guarded)
    for index in range(count):
        model, _, outcome, made = _fault_run(path, call=2, index=index)
        optimizer = made[0]
        steps = optimizer.steps
        if guarded:
            assert isinstance(outcome, autofit.RunResult), (index, outcome)
            assert [(a.step, a.outcome, a.plan.micro_batch_size) for a in outcome.attempts] == \
                [(0, "ok", 4), (1, "ok", 4), (2, "oom", 4), (2, "ok", 4)], index
            assert optimizer.calls == 4 and steps == [3], index
            # The retry kept the plan (the size had fitted): the same update as without the fault.
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), clean_model.parameters()))
        else:
            assert isinstance(outcome, PartialUpdateError), (index, outcome)
            assert not is_oom(outcome)
            assert optimizer.calls == 3, index       # never called again on top of itself
            assert set(steps) <= {2, 3}, index       # the failed step applied at most once
