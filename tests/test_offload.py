"""Optimizer offload keeps the user's optimizer: schedulers, checkpoints, param groups and the user's
own writes to parameters act as in a plain loop, bit for bit in fp32, and an interrupt at any op of
an offloaded step leaves parameters and optimizer state both before or both after the update."""

import copy
import functools
import io
import itertools
import signal
import sys

import pytest
import torch
from versions import adagrad_takes_a_group_added_later
from torch.utils._python_dispatch import TorchDispatchMode

import autofit
from autofit.engine.offload import Offload
from autofit.plans.ladder import offload_optimizer

pytestmark = pytest.mark.usefixtures("frozen_heap")  # many runs, each recovering from an OOM

STEPS = 5


class Net(torch.nn.Module):
    """Two trained layers and one frozen at first (for add_param_group); `bias=False` for Muon,
    which steps 2-D parameters only."""

    def __init__(self, bias=True):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 8, bias=bias), torch.nn.Linear(8, 3, bias=bias)
        self.extra = torch.nn.Linear(6, 3, bias=bias)
        self.extra.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.extra(x)

    def trained(self):
        return [p for p in self.parameters() if p.requires_grad]


class SparseNet(torch.nn.Module):
    """SparseAdam's model: every trained parameter has sparse gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Embedding(12, 3, sparse=True)
        self.extra = torch.nn.Embedding(12, 3, sparse=True)
        self.extra.requires_grad_(False)

    def forward(self, x):
        return self.a(x).mean(1) + self.extra(x).mean(1)

    def trained(self):
        return [p for p in self.parameters() if p.requires_grad]


def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def batches(sparse=False, n=STEPS, rows=8):
    g = torch.Generator().manual_seed(3)
    x = (lambda: torch.randint(0, 12, (rows, 4), generator=g)) if sparse else \
        (lambda: torch.randn(rows, 6, generator=g))
    return [{"x": x(), "y": torch.randint(0, 3, (rows,), generator=g)} for _ in range(n)]


class ClipSGD(torch.optim.SGD):
    """A subclass people write: its own constructor argument and a counter in param_groups."""

    def __init__(self, params, lr=0.1, max_norm=1.0):
        super().__init__(params, lr=lr, momentum=0.9, nesterov=True)
        self.max_norm = max_norm

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.clamp_(-self.max_norm, self.max_norm)
        return super().step()


def _hf_adafactor(params):
    from transformers.optimization import Adafactor
    return Adafactor(params, lr=0.01, scale_parameter=False, relative_step=False)


# Every torch.optim optimizer but LBFGS (its step needs a closure: refused, tests/test_same_math.py),
# transformers' Adafactor and a subclass with its own argument.
OPTIMIZERS = {  # name: factory params -> optimizer
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),  # foreach: what CUDA runs
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
    "SparseAdam": lambda p: torch.optim.SparseAdam(p, lr=0.01),
    "Muon": lambda p: torch.optim.Muon(p, lr=0.01),
    "hf-Adafactor": _hf_adafactor,
    "ClipSGD": lambda p: ClipSGD(p, lr=0.1, max_norm=0.05),
}


def _one_cycle(opt):
    cycles = "momentum" in opt.defaults or "betas" in opt.defaults
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 2, cycle_momentum=cycles)


def _cosine(opt):
    from transformers import get_cosine_schedule_with_warmup
    return get_cosine_schedule_with_warmup(opt, 2, STEPS + 2)


SCHEDULERS = {  # name: factory optimizer -> scheduler (None: no scheduler)
    "none": None,
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "OneCycleLR": _one_cycle,
    "cosine-warmup": _cosine,
}


# -- what the user's loop does between steps (the same in both loops) ------------------------------

class Checkpoint:
    """torch.save of model, optimizer and scheduler after step 1; loaded back after step 3."""

    def __init__(self):
        self.saved = None

    def __call__(self, i, model, opt, sched):
        if i == 1:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": None if sched is None else sched.state_dict()}, buffer)
            self.saved = buffer.getvalue()
        elif i == 3:
            saved = torch.load(io.BytesIO(self.saved), weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            if sched is not None:
                sched.load_state_dict(saved["scheduler"])


def add_group(i, model, opt, sched):
    """Unfreezing a layer after step 1: a new group with group 0's options (scheduler keys too)."""
    if i == 1:
        model.extra.requires_grad_(True)
        options = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        opt.add_param_group({**options, "params": list(model.extra.parameters())})
        if sched is not None:  # as a user extends a scheduler for a new group (LambdaLR insists)
            sched.base_lrs.append(options.get("initial_lr", options["lr"]))
            if hasattr(sched, "lr_lambdas"):
                sched.lr_lambdas.append(sched.lr_lambdas[0])


def clamp(i, model, opt, sched):
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.3, 0.3)


class Rollback:
    """model.load_state_dict of the weights after step 1, once step 3 is done."""

    def __call__(self, i, model, opt, sched):
        if i == 1:
            self.earlier = copy.deepcopy(model.state_dict())
        elif i == 3:
            model.load_state_dict(self.earlier)


MUTATIONS = {"checkpoint": Checkpoint, "add_param_group": lambda: add_group, "clamp": lambda: clamp,
             "rollback": Rollback}


# -- the two loops -----------------------------------------------------------------------------

def _build(optimizer, scheduler):
    model = SparseNet() if optimizer == "SparseAdam" else Net(bias=optimizer != "Muon")
    opt = OPTIMIZERS[optimizer](model.trained())
    factory = SCHEDULERS[scheduler]
    return model, opt, None if factory is None else factory(opt)


def plain(optimizer, scheduler, mutation, data, max_norm=None, steps=None, interrupted=False):
    """The plain loop over `data[:steps]`; `interrupted`: its last step stops after optimizer.step()."""
    model, opt, sched = _build(optimizer, scheduler)
    mutate = MUTATIONS[mutation]() if mutation else None
    data = data[:steps]
    for i, batch in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        if interrupted and i == len(data) - 1:
            break
        if sched is not None:
            sched.step()
        if mutate is not None:
            mutate(i, model, opt, sched)
    return model, opt, sched, mutate


def offloaded(optimizer, scheduler, mutation, data, fault_step, max_norm=None):
    """The stepper with the ladder forced to offload by an OOM injected at the first allocation of
    global step `fault_step` (0: offloaded from the start; 1: after a step on the device)."""
    model, opt, sched = _build(optimizer, scheduler)
    mutate = MUTATIONS[mutation]() if mutation else None
    with autofit.simulate_gpu() as gpu:
        with autofit.stepper(model, opt, loss_fn=loss_fn, scheduler=sched, precision="fp32",
                             ladder=offload_optimizer(), cache=False, max_grad_norm=max_norm) as step:
            outs = []
            for i, batch in enumerate(data):
                if i == fault_step:
                    gpu.fail_at(gpu.allocation_count)
                outs.append(step(batch))
                if mutate is not None:
                    mutate(i, model, opt, sched)
            assert step.optimizer is opt and step.scheduler is sched
        on_device = [gpu.holds(v) for s in opt.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0]
    assert [o.plan.offload_optimizer for o in outs] == [i >= fault_step for i in range(len(data))]
    assert [o.plan.micro_batch_size for o in outs] == [len(b["y"]) for b in data]  # the same splits
    assert not any(on_device)  # after the block the state stays on the host
    return model, opt, sched, mutate


def assert_same_state(a: dict, b: dict):
    """Two optimizer state_dicts equal: every state tensor bit for bit, every group option."""
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), i
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            if torch.is_tensor(v):
                assert v.dtype == w.dtype and torch.equal(v, w), (i, k)
            else:
                assert v == w, (i, k)
    assert a["param_groups"] == b["param_groups"]


def assert_same_run(got, want):
    model, opt, sched, mutate = got
    ref_model, ref_opt, ref_sched, ref_mutate = want
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q), name
    assert len(opt.state_dict()["state"]) == len(ref_opt.state_dict()["state"]) > 0
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    if sched is not None:
        assert sched.last_epoch == ref_sched.last_epoch
        assert sched.get_last_lr() == ref_sched.get_last_lr()
    if isinstance(mutate, Checkpoint):  # what torch.save wrote inside the block
        saved = torch.load(io.BytesIO(mutate.saved), weights_only=False)
        ref_saved = torch.load(io.BytesIO(ref_mutate.saved), weights_only=False)
        assert_same_state(saved["optimizer"], ref_saved["optimizer"])


def _case(optimizer, scheduler, mutation, fault_step):
    if (optimizer, mutation) == ("Adagrad", "add_param_group") and not adagrad_takes_a_group_added_later():
        pytest.skip(f"torch {torch.__version__}'s Adagrad fails on a group added later, in the plain loop too")
    data = batches(sparse=optimizer == "SparseAdam")
    assert_same_run(offloaded(optimizer, scheduler, mutation, data, fault_step),
                    plain(optimizer, scheduler, mutation, data))


# Every optimizer with every scheduler once, the mutations taking turns (a Latin square: every
# optimizer meets every mutation, and every scheduler every mutation).
SAMPLED = [(o, s, list(MUTATIONS)[(i + j) % len(MUTATIONS)], i % 2)
           for i, o in enumerate(OPTIMIZERS) for j, s in enumerate(SCHEDULERS)]


@pytest.mark.parametrize("optimizer, scheduler, mutation, fault_step", SAMPLED,
                         ids=["-".join(map(str, c)) for c in SAMPLED])
def test_offload_matches_the_plain_loop(optimizer, scheduler, mutation, fault_step):
    _case(optimizer, scheduler, mutation, fault_step)


FULL = [(o, s, m, f) for (o, s, m), f in itertools.product(
    itertools.product(OPTIMIZERS, SCHEDULERS, MUTATIONS), (0, 1)) if (o, s, m, f) not in SAMPLED]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, scheduler, mutation, fault_step", FULL,
                         ids=["-".join(map(str, c)) for c in FULL])
def test_offload_matches_the_plain_loop_everywhere(optimizer, scheduler, mutation, fault_step):
    _case(optimizer, scheduler, mutation, fault_step)


# -- what the user holds -----------------------------------------------------------------------

def test_a_run_hands_back_the_optimizer_it_trained_with_its_state():
    """autofit.run with a factory: RunResult.optimizer keeps its state (on the host), and a job
    resumed from its saved state_dict ends where an uninterrupted plain loop does."""
    data = batches(n=4)
    model = Net()
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)
        result = autofit.run(model, data[:2], loss_fn=loss_fn, optimizer=OPTIMIZERS["AdamW"],
                             precision="fp32", ladder=offload_optimizer(), cache=False, progress=False)
        assert not any(gpu.holds(v) for s in result.optimizer.state.values() for v in s.values())
    assert result.plan.offload_optimizer and len(result.optimizer.state) == 4
    buffer = io.BytesIO()
    torch.save(result.optimizer.state_dict(), buffer)
    resumed = OPTIMIZERS["AdamW"](model.parameters())
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    reference = Net()
    ref_opt = OPTIMIZERS["AdamW"](reference.parameters())
    for i, batch in enumerate(data):
        for m, opt in ((model, resumed), (reference, ref_opt)) if i >= 2 else ((reference, ref_opt),):
            opt.zero_grad()
            loss_fn(m, batch).backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert_same_state(resumed.state_dict(), ref_opt.state_dict())


def test_an_offloaded_step_allocates_nothing_on_the_device():
    """The device peak of an offloaded step is what the device held before it: parameters and
    gradients; the state and the update's temporaries are host memory."""
    model = Net()
    opt = OPTIMIZERS["AdamW"](model.trained())
    seen = []
    with autofit.simulate_gpu() as gpu:
        def before(*_):
            seen.append(gpu.memory_allocated())
            gpu.reset_peak_memory_stats()
        opt.register_step_pre_hook(before)
        opt.register_step_post_hook(lambda *_: seen.append(gpu.max_memory_allocated()))
        with autofit.stepper(model, opt, loss_fn=loss_fn, precision="fp32", ladder=offload_optimizer(),
                             cache=False) as step:
            data = batches(n=3)
            gpu.fail_at(gpu.allocation_count)
            for batch in data:
                step(batch)
    grads = sum(p.numel() * 4 for p in model.trained())
    assert seen[0::2] == seen[1::2] and len(seen) == 6
    assert all(held >= grads for held in seen)


class Metric:
    """A scheduler of the user's whose step needs a value."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, value):
        for group in self.optimizer.param_groups:
            group["lr"] *= value


@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
    lambda opt: Metric(opt)], ids=["ReduceLROnPlateau", "subclass"])
def test_a_scheduler_whose_step_needs_an_argument_is_refused_before_training(make):
    model = Net()
    opt = torch.optim.SGD(model.trained(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    name = type(make(opt)).__name__
    with pytest.raises(ValueError, match=rf"^{name}\.step needs (metrics|value), .* step it yourself in "
                                         rf"the stepper loop, outside step\(batch\)"):
        with autofit.stepper(model, opt, loss_fn=loss_fn, scheduler=make(opt)):
            pass
    with pytest.raises(ValueError, match=rf"^{name}\.step needs"):
        autofit.run(model, batches(n=1), loss_fn=loss_fn, optimizer=lambda p: opt, scheduler=make,
                    progress=False, cache=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state


def test_reduce_lr_on_plateau_stepped_in_the_users_loop_matches_the_plain_loop():
    data = batches()
    model = Net()
    opt = torch.optim.SGD(model.trained(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    with autofit.simulate_gpu() as gpu:
        with autofit.stepper(model, opt, loss_fn=loss_fn, precision="fp32", ladder=offload_optimizer(),
                             cache=False) as step:
            gpu.fail_at(gpu.allocation_count)
            losses = [step(b).loss for b in data if plateau.step(1.0) or True]
    ref = Net()
    ref_opt = torch.optim.SGD(ref.trained(), lr=0.1)
    ref_plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, patience=0, factor=0.5)
    ref_losses = []
    for b in data:
        ref_plateau.step(1.0)
        ref_opt.zero_grad()
        loss = loss_fn(ref, b)
        ref_losses.append(loss.item())
        loss.backward()
        ref_opt.step()
    assert losses == ref_losses and opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < 0.1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


# -- an interrupt at every op of an offloaded step -----------------------------------------------

class FaultAt(TorchDispatchMode):
    """Raises `error()` at the `index`-th aten op (every allocation and host/device copy is one).
    A new exception each time: one kept here would keep its traceback's frames, and their tensors."""

    def __init__(self, index, error):
        super().__init__()
        self.index, self.error, self.seen = index, error, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen += 1
        if self.seen - 1 == self.index:
            raise self.error()
        return func(*args, **(kwargs or {}))


OOM = functools.partial(torch.OutOfMemoryError, "CUDA out of memory (injected)")


def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _equal(snapshot, model, opt) -> bool:
    params, state = snapshot
    try:
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        assert_same_state(opt.state_dict(), state)
    except AssertionError:
        return False
    return True


def _faulted_run(monkeypatch, fault_step, call, index, error):
    """AdamW (foreach) with clipping and StepLR, offloaded from global step `fault_step`; `error` at
    op `index` of the `call`-th offloaded step (0-based). Returns the model, optimizer, the
    snapshot before that step, how many ops the step ran, and the error that left the block
    (`error`: an exception class or factory)."""
    data = batches(n=4)
    model, opt, sched = _build("AdamW", "StepLR")
    original, calls, faults = Offload.step, [], []

    def step_with_fault(self, run):
        calls.append(1)
        if len(calls) - 1 != call:
            return original(self, run)
        faults.append(FaultAt(index, error))
        with faults[-1]:
            return original(self, run)
    monkeypatch.setattr(Offload, "step", step_with_fault)
    before, raised = None, None
    with autofit.simulate_gpu() as gpu:
        try:
            with autofit.stepper(model, opt, loss_fn=loss_fn, scheduler=sched, precision="fp32",
                                 ladder=offload_optimizer(), cache=False, max_grad_norm=0.5) as step:
                for i, batch in enumerate(data):
                    if i == fault_step + call:  # the global step of that offloaded step
                        with gpu.untracked():
                            before = _snapshot(model, opt)
                    if i == fault_step:
                        gpu.fail_at(gpu.allocation_count)
                    step(batch)
        except BaseException as e:  # what the user's loop would see
            raised = e
    monkeypatch.setattr(Offload, "step", original)
    return model, opt, before, faults[0].seen, raised


SWEEPS = [pytest.param(1, 0, 1, id="first-offloaded-step", marks=pytest.mark.slow),
          pytest.param(0, 2, 1, id="later-step", marks=pytest.mark.slow),
          pytest.param(0, 2, 7, id="later-step-sampled")]  # every 7th op and the write-back's


@pytest.mark.parametrize("fault_step, call, stride", SWEEPS)
def test_an_interrupt_or_oom_at_every_op_of_an_offloaded_step_leaves_no_half_update(monkeypatch, fault_step,
                                                                                  call, stride):
    """A KeyboardInterrupt at each op: it propagates, and parameters and state are both as before
    the step or both as after it. An OOM at each op: the step is replayed, and the run ends equal to
    the plain loop (nothing applied twice). `first-offloaded-step` is the one that moves the state
    from the device to the host."""
    data = batches(n=4)
    step_index = fault_step + call
    ref_before = plain("AdamW", "StepLR", None, data, max_norm=0.5, steps=step_index)
    ref_after = plain("AdamW", "StepLR", None, data, max_norm=0.5, steps=step_index + 1, interrupted=True)
    ref_end = plain("AdamW", "StepLR", None, data, max_norm=0.5)
    after = _snapshot(ref_after[0], ref_after[1])
    *_, ops, raised = _faulted_run(monkeypatch, fault_step, call, 10 ** 9, KeyboardInterrupt)
    assert raised is None and ops > 40
    outcomes = []
    indices = sorted(set(range(0, ops, stride)) | set(range(max(ops - 8, 0), ops)))
    for index in indices:
        model, opt, before, _, raised = _faulted_run(monkeypatch, fault_step, call, index, KeyboardInterrupt)
        assert isinstance(raised, KeyboardInterrupt), index
        assert _equal(before, ref_before[0], ref_before[1]), index
        if _equal(before, model, opt):
            outcomes.append("before")
        else:
            assert _equal(after, model, opt), index
            outcomes.append("after")
        model, opt, before, _, raised = _faulted_run(monkeypatch, fault_step, call, index, OOM)
        if call == 0 and isinstance(raised, autofit.DoesNotFit):
            # The offloaded plan was not proven yet, and the ladder has nothing after it: the run
            # stops with the model and state as they were before the batch.
            assert _equal(before, model, opt), index
            continue
        assert raised is None, index  # a plan proven before: the step is replayed once
        assert_same_run((model, opt, None, None), ref_end[:2] + (None, None)), index
    # Interrupts during the write-back are held until it ends: the step is then applied whole.
    assert outcomes[0] == "before" and outcomes[-1] == "after"
    assert outcomes == sorted(outcomes, key=["before", "after"].index)


def test_fp16_with_a_grad_scaler_under_offload_matches_the_plain_loop():
    """The scaler unscales on the device (where it looks for infinities), then steps the user's
    optimizer on the host."""
    data = batches(n=3)
    model = Net()
    opt = OPTIMIZERS["AdamW"](model.trained())
    with autofit.simulate_gpu() as gpu:
        with autofit.stepper(model, opt, loss_fn=loss_fn, precision="fp16", ladder=offload_optimizer(),
                             cache=False) as step:
            gpu.fail_at(gpu.allocation_count)
            outs = [step(b) for b in data]
    assert [o.plan.offload_optimizer for o in outs] == [True] * 3
    ref = Net()
    ref_opt = OPTIMIZERS["AdamW"](ref.trained())
    scaler = torch.amp.GradScaler("cpu")
    for b in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(ref, b)
        scaler.scale(loss * 1.0).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


class InterruptAtLine:
    """Sends SIGINT (Ctrl-C) to this process at the `index`-th line the offloaded step's own Python
    code runs (Offload's step, write-back and copy): the places no aten op marks (the swap back,
    the group options put back). Python's handler raises KeyboardInterrupt at the next bytecode
    it checks for signals, as it does for a real Ctrl-C."""

    CODES = {f.__code__ for f in (Offload.step, Offload._finish, Offload._copy_back)}

    def __init__(self, index):
        self.index, self.seen = index, 0

    def __call__(self, frame, event, arg):
        if frame.f_code not in self.CODES:
            return None
        return self.local

    def local(self, frame, event, arg):
        if event == "line":
            self.seen += 1
            if self.seen - 1 == self.index:
                signal.raise_signal(signal.SIGINT)
        return self.local


def _interrupted_at_line(index, data):
    model, opt, sched = _build("AdamW", "StepLR")
    tracer, raised, before = InterruptAtLine(index), None, None
    with autofit.simulate_gpu() as gpu:
        try:
            with autofit.stepper(model, opt, loss_fn=loss_fn, scheduler=sched, precision="fp32",
                                 ladder=offload_optimizer(), cache=False, max_grad_norm=0.5) as step:
                for i, batch in enumerate(data):
                    if i == 0:
                        gpu.fail_at(gpu.allocation_count)  # the first step offloads
                    if i == 2:
                        with gpu.untracked():
                            before = _snapshot(model, opt)
                        sys.settrace(tracer)
                    try:
                        step(batch)
                    finally:
                        sys.settrace(None)
        except KeyboardInterrupt as e:
            raised = e
        on_device = all(gpu.holds(p) for p in model.parameters())
    return model, opt, before, tracer.seen, raised, on_device


def test_an_interrupt_at_every_line_of_an_offloaded_step_leaves_it_whole_and_on_the_device():
    data = batches(n=3)
    ref_before = plain("AdamW", "StepLR", None, data, max_norm=0.5, steps=2)
    ref_after = plain("AdamW", "StepLR", None, data, max_norm=0.5, steps=3, interrupted=True)
    before, after = _snapshot(*ref_before[:2]), _snapshot(*ref_after[:2])
    handler = signal.getsignal(signal.SIGINT)
    *_, lines, raised, _ = _interrupted_at_line(10 ** 9, data)
    assert raised is None and lines > 30
    outcomes = []
    for index in range(lines):
        model, opt, _, _, raised, on_device = _interrupted_at_line(index, data)
        assert isinstance(raised, KeyboardInterrupt), index
        assert on_device, index  # never left swapped to the host buffers
        assert signal.getsignal(signal.SIGINT) is handler, index  # autofit's handler never left behind
        outcomes.append("before" if _equal(before, model, opt) else "after" if _equal(after, model, opt)
                        else "mixed")
    assert "mixed" not in outcomes
    assert outcomes[0] == "before" and outcomes[-1] == "after"
    assert outcomes == sorted(outcomes, key=["before", "after"].index)


def test_a_transient_oom_in_the_second_offloaded_step_is_retried(monkeypatch):
    """The first offloaded step makes the state in host memory: it proves the device memory as any
    later step does, so a one-off OOM in the next step is retried, not a verdict (the ladder has
    nothing below offload here)."""
    data = batches(n=4)
    model, opt, sched = _build("AdamW", "StepLR")
    original, calls = Offload.step, []

    def step_with_fault(self, run):
        calls.append(1)
        if len(calls) != 2:
            return original(self, run)
        with FaultAt(0, OOM):
            return original(self, run)
    monkeypatch.setattr(Offload, "step", step_with_fault)
    plan = autofit.Plan(micro_batch_size=8, accumulation_steps=1, offload_optimizer=True)
    with autofit.simulate_gpu():
        with autofit.stepper(model, opt, loss_fn=loss_fn, scheduler=sched, precision="fp32",
                             ladder=offload_optimizer(), cache=False) as step:
            step.load_state_dict({"version": 1, "plan": plan.to_dict(), "sizes": {"fits": [], "fails": []}})
            outs = [step(b) for b in data]
    assert [[a.outcome for a in o.attempts] for o in outs] == [["ok"], ["oom", "ok"], ["ok"], ["ok"]]
    # The fault came at the step's first op, before it wrote anything: replayed as such.
    assert outs[1].attempts[1].reason.startswith("the optimizer step ran out of memory before it wrote anything")
    assert_same_run((model, opt, None, None), plain("AdamW", "StepLR", None, data)[:2] + (None, None))
