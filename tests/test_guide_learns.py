"""The guide learns from an out-of-memory attempt: a lower bound on its calibration, so the step-down
and the next probes land below what failed instead of repeating the failure."""

import pytest
import torch

import autofit
from autofit.estimator.estimate import MemoryEstimate
from autofit.estimator.guide import Guide
from autofit.gpu.simulate import SimulatedGPU, active_gpu
from autofit.gpu.device import SimulatedDevice
from autofit.plans.plan import Plan
from autofit.plans.sizelog import SizeLog

from reference import plain_loop_fn

ROWS, FEATURES = 32, 8
MiB = 2**20


class Workspace(torch.autograd.Function):
    """As a fused kernel whose C++ side allocates a per-row workspace it keeps for backward (an
    auxiliary buffer): on the device only; its fake implementation returns the output alone, so
    the estimator's fake-tensor walk never sees the workspace. The values are untouched."""

    @staticmethod
    def forward(ctx, x, width):
        gpu = active_gpu()
        on_device = gpu is not None and gpu.holds(x)  # a fake tensor is no device memory
        ctx.save_for_backward(x.new_empty(x.shape[0], width) if on_device else x.new_empty(0))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Net(torch.nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.width = width
        self.a, self.b = torch.nn.Linear(FEATURES, hidden), torch.nn.Linear(hidden, 3)

    def forward(self, x):
        return self.b(Workspace.apply(torch.tanh(self.a(x)), self.width))


def net(hidden, width):
    torch.manual_seed(0)
    return Net(hidden, width)


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(ROWS, FEATURES, generator=g), "labels": torch.randint(0, 3, (ROWS,), generator=g)}
            for _ in range(n)]


def loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])


def adamw(params):
    return torch.optim.AdamW(params)


def sequence(result):
    """The attempts as benchmarks/calibrate.py prints them: step:micro, x for an OOM."""
    return " ".join(f"{a.step}:{a.plan.micro_batch_size}{'x' if a.outcome == 'oom' else ''}"
                    for a in result.attempts)


def train(hidden, width, budget, caps, n, learns=True, monkeypatch=None):
    if not learns:  # the guide as it was: nothing learned from an out-of-memory attempt
        monkeypatch.setattr(Guide, "failed", lambda self, plan, length, reached=None: None)
    model, data = net(hidden, width), batches(n)  # on the host, as a DataLoader gives them
    with autofit.simulate_gpu(budget, caps=caps):
        result = autofit.run(model, data, loss_fn=loss, optimizer=adamw, precision="fp32",
                             progress=False, cache=False)
    monkeypatch.undo() if monkeypatch is not None else None
    return model, result


def same_as_plain_loop(model, result, hidden, width, n):
    reference = net(hidden, width)
    splits = [h["plan"].micro_batch_size for h in result.history]
    plain_loop_fn(reference, batches(n), splits, loss, adamw(reference.parameters()))
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_where_the_budget_caps_allocated_bytes_one_oom_teaches_the_rest(monkeypatch):
    # Per row: 2 KiB of workspace the estimate misses, on ~4 KiB of activations it sees.
    hidden, width, budget, n = 256, 512, 150_000, 4
    _, blind = train(hidden, width, budget, "allocated", n, learns=False, monkeypatch=monkeypatch)
    # Without the bound: the start (32, predicted to fit) fails, then each probe goes where the
    # uncalibrated, then the too-low measured, estimate says, failing twice more.
    assert sequence(blind) == "0:32x 0:16 1:29x 1:16 2:22x 2:16 3:19"
    model, result = train(hidden, width, budget, "allocated", n)
    # With it: the start's failure (what it held plus the workspace it asked for, over the estimate
    # of 32 rows) puts the next probe at 19, which fits; then the measured factor takes over.
    assert sequence(result) == "0:32x 0:16 1:19 2:20 3:20"
    same_as_plain_loop(model, result, hidden, width, n)


@pytest.mark.slow
def test_where_the_budget_caps_reserved_bytes_one_oom_teaches_the_rest(monkeypatch):
    # MiB-sized tensors, so the caching allocator's segments matter: 1.5 MiB of workspace per row.
    hidden, width, budget, n = 16384, 393216, 40 * MiB, 4
    _, blind = train(hidden, width, budget, "reserved", n, learns=False, monkeypatch=monkeypatch)
    # Without the bound every probe fails, twice each (the second a fragmentation replay).
    assert sequence(blind) == "0:32x 0:16 1:24x 1:24x 1:16 2:20x 2:20x 2:16 3:18x 3:18x 3:16"
    model, result = train(hidden, width, budget, "reserved", n)
    # With it: 16 rows (the step-down) is the largest that fits (18 and 20 do not, above): no
    # probe the bound says fits.
    assert sequence(result) == "0:32x 0:16 1:16 2:16 3:16"
    same_as_plain_loop(model, result, hidden, width, n)


class Peaks:
    """A stand-in estimator: allocated peak 10 MiB + 1 MiB per row."""

    rows, resident = 16, {"params": 1, "grads": 1, "optimizer": 1}
    model = torch.nn.Linear(2, 2)

    def measure(self, plan):
        return MemoryEstimate(plan, (10 + plan.micro_batch_size) * MiB, {})

    def forget_source(self):
        pass


def plan(m):
    return Plan.for_batch(16, m)


def test_the_bound_its_margin_and_what_replaces_it():
    guide = Guide(SimulatedDevice(SimulatedGPU()), "allocated", 21 * MiB)
    guide.attach(Peaks(), [], 16)
    # 11 rows are predicted to take 21 MiB, all of the usable budget: predicted to fit.
    assert guide.largest(plan(4), 4, 16, length=16) == 11
    guide.guessed.clear()  # (that guess was a question, not a probe the run made)
    assert guide.bound is None and guide.measured is None
    # It failed, nothing said of how far over: the real peak was at least one byte over the budget,
    # enough that 11 is ruled out, not 10.
    guide.failed(plan(11), 16)
    assert guide.bound == (21 * MiB + 1) / (21 * MiB) and guide.calibration == guide.bound
    assert guide.largest(plan(4), 4, 12, length=16) == 8  # 10 fits; the midpoint of 4..12 caps it
    assert guide.largest(plan(10), 10, 12, length=16) == 10  # 11 does not: no probe above 10
    # A failure at another row length says nothing of these estimates.
    guide.failed(plan(8), 32, reached=100 * MiB)
    assert guide.bound == (21 * MiB + 1) / (21 * MiB)
    # What it held at the failure plus the request: 28 MiB at least, so factor > 28/21: the largest
    # size under it is 5 (4/3 * 15 = 20 MiB), below the midpoint of 4..11 (7).
    guide.failed(plan(11), 16, reached=28 * MiB)
    assert guide.bound == 28 / 21
    sizes = SizeLog(length=16)
    sizes.record(plan(4), True)
    sizes.record(plan(11), False)
    assert sizes.probe_up(plan(4), 16, guess=guide.largest) == plan(5)
    # A weak bound leaves the guess no higher than the blind search's midpoint.
    weak = Guide(None, "allocated", 21 * MiB)
    weak.attach(Peaks(), [], 16)
    weak.failed(plan(11), 16)
    assert sizes.probe_up(plan(4), 16, guess=weak.largest) == plan(7)
    # The bound is what the cache would keep (nothing measured since), above a cached factor...
    assert guide.measured == 28 / 21
    assert Guide(None, "allocated", 21 * MiB, calibration=1.5).measured is None
    cached = Guide(None, "allocated", 21 * MiB, calibration=1.1)
    cached.attach(Peaks(), [], 16)
    cached.failed(plan(11), 16, reached=28 * MiB)
    assert cached.measured == cached.calibration == 28 / 21
    # ... and a good measurement that becomes the applied factor replaces it.
    guide.observe(plan(5), 18 * MiB, 16)
    assert guide.bound is None and guide.measured == guide.calibration == 18 / 15
