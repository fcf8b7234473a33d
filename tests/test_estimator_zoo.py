"""The estimator can fail; the run cannot: a model the estimator cannot follow trains as it would
without the capacity check (said in one line), data-dependent steps are estimated, and no
transformers model that trains in a plain loop fails in `run` because of the estimator."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import autofit
from autofit.estimator import capacity
from autofit.engine.token_loss import token_counter
from autofit.gpu.device import SimulatedDevice
from autofit.estimator.data_dependent import TORCH_LOGGERS
from autofit.estimator.estimate import estimate
from autofit.plans.plan import Plan
from autofit.gpu.simulate import simulate_gpu
from autofit.engine.step import StepRunner
from models import zoo

# -- helpers ------------------------------------------------------------------------------------


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(512, 4))


def mlp_data(steps: int = 2) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 64, generator=g), torch.randint(0, 4, (64,), generator=g)) for _ in range(steps)]


def xy_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def simulated_peak(model, batch, plan, loss_fn=None) -> int:
    """The simulated GPU's peak of the second of two real CPU steps under `plan`."""
    with simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        model.train()
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device, loss_fn=loss_fn,
                            count_tokens=token_counter(model) if loss_fn is None else None)
        runner.run(batch, plan)
        runner.run(batch, plan)
        peak = runner.attempt_peak()
        runner.close()
    return peak


def fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "autofit" and "cannot estimate" in r.getMessage()]


# -- an estimator that fails --------------------------------------------------------------------

def test_a_failing_estimator_is_said_once_and_the_run_is_as_without_the_check(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("the estimator broke\nwith a second line nobody needs")

    unchecked = autofit.run(mlp(), mlp_data(3), loss_fn=xy_loss, budget="900KiB", cache=False,
                            progress=False, capacity_check=False)
    monkeypatch.setattr(capacity.Estimator, "__init__", broken)
    with caplog.at_level(logging.INFO, logger="autofit"):
        checked = autofit.run(mlp(), mlp_data(3), loss_fn=xy_loss, budget="900KiB", cache=False,
                              progress=False)
    def trace(result):
        return [(a.plan, a.outcome, a.reason, a.peak_bytes) for a in result.attempts]
    assert "oom" in [a.outcome for a in unchecked.attempts]  # the ladder had work to do
    assert trace(checked) == trace(unchecked)
    assert [h["loss"] for h in checked.history] == [h["loss"] for h in unchecked.history]
    assert fallback_lines(caplog) == [
        "capacity check: cannot estimate Sequential (RuntimeError: the estimator broke); starting from "
        "the whole global batch; the ladder finds the plan"]


def test_does_not_fit_from_the_check_is_still_a_verdict():
    with pytest.raises(autofit.DoesNotFit, match="checked before training"):
        autofit.run(mlp(), mlp_data(1), loss_fn=xy_loss, budget="64KiB", cache=False, progress=False)


# A kernel whose meta function refuses what its CPU kernel runs: fake tensors cannot follow a model
# that calls it (torch logs the meta kernel's traceback), real rows can.
_REFUSING = torch.library.Library("autofit_test_zoo", "DEF")
_REFUSING.define("gate(Tensor x) -> Tensor")
_REFUSING.impl("gate", lambda x: (x > 0).to(x.dtype), "CPU")


def _refusing_meta(x):
    raise RuntimeError("this meta kernel refuses what the CPU kernel runs")


_REFUSING.impl("gate", _refusing_meta, "Meta")


class Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return (self.linear(x) * torch.ops.autofit_test_zoo.gate(x.detach())).pow(2).mean()


def test_torch_error_logs_are_silenced_during_estimation_and_levels_restored():
    """A fake kernel that fails makes torch log its traceback (~25 lines for one step)."""
    heard = []
    handler = logging.Handler()
    handler.emit = heard.append
    loggers = [logging.getLogger(n) for n in TORCH_LOGGERS]
    levels = [lg.level for lg in loggers]
    loggers[0].addHandler(handler)
    try:
        est = estimate(Gated(), torch.randn(8, 16), Plan(4), device_type="cpu")
    finally:
        loggers[0].removeHandler(handler)
    assert est.method == "sampled"  # the fake kernel failed (and torch logged it, unsilenced)
    assert heard == []
    assert [lg.level for lg in loggers] == levels


# -- data-dependent steps are estimated ---------------------------------------------------------

class Checked(torch.nn.Module):
    """Branches on its data (`if torch.isnan(x).any()`) and keeps the rows a mask selects."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 3)

    def forward(self, x, y):
        if torch.isnan(x).any():
            x = torch.nan_to_num(x)
        keep = y >= 0  # labelled rows only
        return F.cross_entropy(self.b(torch.relu(self.a(x)))[keep], y[keep])


def checked_batch():
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(8, 16, generator=g), "y": torch.randint(0, 3, (8,), generator=g)}


def item_loss(model, batch):
    loss = model(**batch).loss
    if loss.item() > 1e6:  # a user's sanity check reads the value
        raise ValueError("diverged")
    return loss


@pytest.mark.parametrize("case", ["branch-and-mask", "item-in-loss_fn", "deberta-v2"])
def test_data_dependent_steps_are_estimated_to_the_byte(case):
    if case == "branch-and-mask":
        build, batch, loss_fn = Checked, checked_batch(), None
    else:
        name = "bert" if case == "item-in-loss_fn" else case
        build = lambda: zoo()[name](0)[0]  # noqa: E731
        batch, loss_fn = zoo()[name](0)[1], item_loss if case == "item-in-loss_fn" else None
    plan = Plan(batch_size_of(batch))
    est = estimate(build(), batch, plan, loss_fn=loss_fn, device_type="cpu")
    assert est.peak_bytes == simulated_peak(build(), batch, plan, loss_fn)


def batch_size_of(batch) -> int:
    return next(iter(batch.values())).shape[0]


# -- the zoo: every family trains in `run` with the capacity check on ----------------------------

# Every family is followed on fake tensors (Mixtral's fp32 experts too: the grouped matmul's meta
# kernel's fp32 calls are answered by the estimator, autofit.estimator.meta_kernels); the sampled path is
# tested above with a kernel of the test's own.

@pytest.mark.parametrize("name", sorted(zoo()))
def test_no_family_fails_in_run_because_of_the_estimator(name, caplog):
    model, batch = zoo()[name](0)
    with caplog.at_level(logging.INFO, logger="autofit"):
        result = autofit.run(model, [batch], budget="1GiB", cache=False, progress=False)
    assert [a.outcome for a in result.attempts] == ["ok"]
    # A family with BatchNorm (resnet) starts from the ladder's first whole-batch plan that fits.
    coupled = bool(result.batch_coupled)
    assert result.attempts[0].reason.startswith(
        "estimated: the first whole-batch plan of the ladder predicted to fit" if coupled
        else "estimated: fastest plan predicted to fit")
    assert coupled == (name == "resnet")
    assert fallback_lines(caplog) == []
    sampled = [r.getMessage() for r in caplog.records if "fake tensors cannot follow" in r.getMessage()]
    assert sampled == []
