"""Guarantee 2: an optimizer step is applied whole or not at all."""

import collections
import copy
import signal

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autofit
from autofit.engine.atomic import AtomicStep, PartialUpdateError
from autofit.engine.step import StepRunner
from autofit.gpu.device import CpuDevice, SimulatedDevice
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
            with pytest.raises(torch.OutOfMemoryError, match="update rolled back|before it wrote anything"):
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


class SigintAt(TorchDispatchMode):
    """Sends SIGINT (Ctrl-C) to this process at the `index`-th aten op; Python's handler raises
    KeyboardInterrupt at the next bytecode, as for a real Ctrl-C."""

    def __init__(self, index):
        super().__init__()
        self.index, self.seen = index, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen += 1
        if self.seen - 1 == self.index:
            signal.raise_signal(signal.SIGINT)
        return func(*args, **(kwargs or {}))


def test_ctrl_c_inside_a_step_without_a_snapshot_is_held_until_the_update_is_whole():
    """A step known to fit runs without a snapshot; Ctrl-C at any op of foreach AdamW (which
    updates exp_avg and the step counter before the parameters) used to leave a mixed state. It is
    held until the step ends, then raised: parameters and state both after, as one clean step."""
    handler = signal.getsignal(signal.SIGINT)
    with autofit.simulate_gpu() as gpu:
        model, optimizer, device = _setup(gpu, 1)
        twin = _twin(model, optimizer)
        twin[1].step()
        after = _in_order(*twin)
        ops = SigintAt(10 ** 9)
        with ops:
            optimizer.step()
    assert ops.seen > 10
    for index in range(ops.seen):
        with autofit.simulate_gpu() as gpu:
            model, optimizer, device = _setup(gpu, 1)
            atomic = AtomicStep(optimizer, device)
            with pytest.raises(KeyboardInterrupt):
                with SigintAt(index):
                    atomic(optimizer.step, guard=False)
            assert atomic.snapshots == 0
            assert _in_order(model, optimizer) == after, index
    assert signal.getsignal(signal.SIGINT) is handler  # the handler before is back


def test_the_sigint_handler_is_installed_once_per_run_and_the_one_before_is_back_at_its_end():
    """Every unguarded step holds Ctrl-C, but the handler is installed at the first one only (a
    system call per step would be paid by steps that never fail); closing the runner puts the
    handler from before back."""
    handler = signal.getsignal(signal.SIGINT)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    runner = StepRunner(model, torch.optim.AdamW(model.parameters()), CpuDevice(),
                        loss_fn=lambda m, b: m(b).square().mean())
    plan = autofit.Plan(micro_batch_size=4, accumulation_steps=1)
    for _ in range(3):
        runner.run(torch.randn(4, 4), plan)
        assert signal.getsignal(signal.SIGINT) is not handler  # held between steps too: installed
    runner.close()
    assert (runner.atomic.snapshots, runner.atomic.sigint.installs) == (0, 1)
    assert signal.getsignal(signal.SIGINT) is handler


def _in_order(model, optimizer):
    """The parameters' values and their state's, in the model's order (comparable across copies)."""
    return [(p.tolist(), sorted((k, v.tolist() if torch.is_tensor(v) else v)
                                for k, v in optimizer.state.get(p, {}).items()))
            for p in model.parameters()]


class HistorySGD(torch.optim.SGD):
    """Keeps a list of tensors and a dict holding a tensor in its state (mutated in place), and
    runs out of memory once, after changing them, when `fail` is set."""

    fail = False

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state.setdefault("history", []).append(p.grad.norm())
                state.setdefault("seen", {"n": torch.zeros(())})["n"].add_(1.0)
        if HistorySGD.fail:
            HistorySGD.fail = False
            raise torch.OutOfMemoryError("CUDA out of memory (injected after a partial update)")
        return super().step()


class Wrapper(torch.optim.Optimizer):
    """An optimizer that wraps another (Lookahead's layout): the inner one's moments live in its own
    state, the wrapper's slow weights in the wrapper's, the param_groups are shared."""

    def __init__(self, base):
        self.base_optimizer = base
        self.param_groups, self.defaults = base.param_groups, base.defaults
        self.state = collections.defaultdict(dict)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
            setattr(self, name, collections.OrderedDict())
        for group in self.param_groups:
            group.setdefault("slow_steps", 0)

    @torch.no_grad()
    def step(self, closure=None):
        self.base_optimizer.step()
        for group in self.param_groups:
            group["slow_steps"] += 1
            for p in group["params"]:
                slow = self.state[p].setdefault("slow", p.detach().clone())
                slow.add_(p - slow, alpha=0.5)
        if HistorySGD.fail:
            HistorySGD.fail = False
            raise torch.OutOfMemoryError("CUDA out of memory (injected after a partial update)")


def _state_of(optimizer):
    """Every tensor value of the optimizer's state and of the one it wraps, in order, and the groups."""
    from autofit.engine.optimizer_state import holders, tensors
    out = [[t.clone() for entry in h.state.values() for v in entry.values() for t in tensors(v)]
           for h in holders(optimizer)]
    return out, [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


@pytest.mark.parametrize("make", [lambda ps: HistorySGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: Wrapper(torch.optim.AdamW(ps, foreach=False))],
                         ids=["lists-and-dicts-in-state", "wrapped-optimizer"])
@pytest.mark.parametrize("params", [True, False], ids=["on-device", "offloaded-snapshot"])
def test_state_in_containers_and_in_a_wrapped_optimizer_is_rolled_back(make, params):
    """The rollback copies what a step can change at any depth: a list appended to, a dict's tensor
    changed in place, the wrapped optimizer's moments and step counters; the retry then equals one
    clean step (nothing applied twice)."""
    def build(device=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
        if device is not None:
            device.place_model(model)
        optimizer = make(model.parameters())
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
        for i in range(3):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if i < 2:
                optimizer.step()
        return model, optimizer

    twin = build()
    twin[1].step()
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        model, optimizer = build(device)
        params_before = [p.detach().clone() for p in model.parameters()]
        state_before = _state_of(optimizer)
        atomic = AtomicStep(optimizer, device)
        HistorySGD.fail = True
        with pytest.raises(torch.OutOfMemoryError, match="update rolled back"):
            atomic(optimizer.step, guard=True, params=params)
        if params:
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params_before))
        state_after_rollback = _state_of(optimizer)
        assert len(state_after_rollback[0]) == len(state_before[0])
        assert all(len(a) == len(b) and all(torch.equal(s, t) for s, t in zip(a, b))
                   for a, b in zip(state_after_rollback[0], state_before[0]))
        assert state_after_rollback[1] == state_before[1]
        if not params:  # the offloaded step writes the parameters only once applied: put them back
            with torch.no_grad():
                for p, saved in zip(model.parameters(), params_before):
                    p.copy_(saved)
        atomic(optimizer.step, guard=True, params=params)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin[0].parameters()))
    got, want = _state_of(optimizer), _state_of(twin[1])
    assert all(len(a) == len(b) and all(torch.equal(s, t) for s, t in zip(a, b))
               for a, b in zip(got[0], want[0]))
    assert got[1] == want[1]


def test_two_runs_whose_steps_alternate_hand_ctrl_c_to_the_handler_from_before_once():
    """A GAN's two steppers install their handlers in turn, each over the other's; a Ctrl-C
    between steps reaches the handler from before the runs once (it used to go round the two
    holds until the recursion limit), and each run's end leaves that handler in place."""
    from autofit.engine.interrupts import SigintHold
    before = signal.getsignal(signal.SIGINT)
    calls = []

    def users(signum, frame):
        calls.append(signum)
    signal.signal(signal.SIGINT, users)
    try:
        d, g = SigintHold(), SigintHold()
        for hold in (d, g, d, g):  # each step installs its run's handler, over the other's
            hold.install()
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # a Ctrl-C between steps
        assert calls == [signal.SIGINT]
        d.uninstall()
        g.uninstall()
        assert signal.getsignal(signal.SIGINT) is users
    finally:
        signal.signal(signal.SIGINT, before)
