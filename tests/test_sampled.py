"""A model fake tensors cannot follow is measured on real rows, and left exactly as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autofit.estimator.estimate import estimate
from autofit.plans.plan import Plan
from models import zoo
from test_estimator_zoo import simulated_peak


def host_reading_loss(model, batch):
    loss = model(**batch).loss if isinstance(batch, dict) else F.cross_entropy(model(batch[0]), batch[1])
    loss.detach().numpy()  # a value read on the host: fake tensors have none
    return loss


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                               torch.nn.Dropout(0.3), torch.nn.Linear(32, 3))


def net_batch(rows: int = 6):
    g = torch.Generator().manual_seed(3)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


def snapshot(model, optimizer):
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "state": {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for p, s in optimizer.state.items()},
        "state_objects": {id(p): (id(s), {k: id(v) for k, v in s.items()}) for p, s in optimizer.state.items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "modes": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
        "next": None,
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("optimizer_kind", ["sgd-with-state", "adamw-fresh"])
@pytest.mark.parametrize("plan", [Plan(6), Plan(2, 3), Plan(3, 2, precision="bf16", offload_optimizer=True)],
                         ids=["whole", "accumulate", "bf16-offload"])
def test_sampling_leaves_model_optimizer_and_rng_exactly_as_they_were(optimizer_kind, plan):
    model, batch = net(), net_batch()
    if optimizer_kind == "sgd-with-state":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        host_reading_loss(model, batch).backward()
        optimizer.step()  # momentum buffers exist; the grads stay, as a user's loop may leave them
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.eval()  # a mode of the user's, which the sample must not keep changed
    torch.manual_seed(123)
    before = snapshot(model, optimizer)
    est = estimate(model, batch, plan, optimizer=optimizer, loss_fn=host_reading_loss, device_type="cpu")
    after = snapshot(model, optimizer)
    assert est.method == "sampled"
    for key in ("tensors", "grads", "state", "state_objects", "groups", "modes", "rng"):
        assert same(before[key], after[key]), key
    assert torch.rand(3).tolist() == (torch.manual_seed(123), torch.rand(3))[1].tolist()


@pytest.mark.parametrize("plan", [Plan(4), Plan(2, 2)], ids=["whole", "accumulate"])
def test_a_sampled_estimate_matches_the_measured_step(plan):
    """Tiny BERT at 4 rows in fp32: the peak is linear in the rows through 1 and 2 (or in the
    optimizer step), so the extrapolation is exact to the byte. (Its bf16 and checkpointed steps are
    not: tensors under 512 bytes per row round up, and the estimate is 0.4% low.)"""
    model, batch = zoo()["bert"](0)
    est = estimate(model, batch, plan, loss_fn=host_reading_loss, device_type="cpu")
    assert est.method == "sampled"
    assert est.peak_bytes == simulated_peak(zoo()["bert"](0)[0], batch, plan, host_reading_loss)
    assert sum(est.breakdown.values()) == est.peak_bytes


def wide():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(512, 256))


@pytest.mark.parametrize("precision", ["bf16"])
def test_a_sampled_estimate_extrapolates_activations_to_many_rows(precision):
    """Rows of 1 KiB and more (no allocator rounding in the slope): 16 rows predicted from 1 and 2."""
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 256, generator=g), torch.randn(16, 256, generator=g))

    def loss_fn(model, batch):
        loss = F.mse_loss(model(batch[0]), batch[1])
        loss.detach().numpy()
        return loss
    plan = Plan(16, precision=precision)
    est = estimate(wide(), batch, plan, loss_fn=loss_fn, device_type="cpu")
    assert est.method == "sampled"
    assert est.peak_bytes == simulated_peak(wide(), batch, plan, loss_fn)


def test_a_model_on_meta_cannot_be_sampled_and_the_first_error_is_raised():
    with torch.device("meta"):
        model = net()
    with pytest.raises(RuntimeError, match=r"\.numpy\(\) is not supported") as caught:
        estimate(model, net_batch(), Plan(6), loss_fn=host_reading_loss)
    assert caught.value.__notes__ == ["measuring it on real rows failed too: ValueError: the model's tensors "
                                      "are on meta: there are no values to run a real sample through."]


def test_a_run_whose_start_was_sampled_trains_as_one_without_the_check(caplog):
    """Dropout and BatchNorm: the sample's steps drew random numbers and moved running statistics;
    the run must not see any of it."""
    import logging

    import autofit
    data = [net_batch(6), net_batch(6)]
    results, weights = [], []
    for check in (True, False):
        model = net()
        torch.manual_seed(7)
        with caplog.at_level(logging.INFO, logger="autofit"):
            results.append(autofit.run(model, data, loss_fn=host_reading_loss, budget="1GiB", cache=False,
                                       progress=False, capacity_check=check,
                                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)))
        weights.append(model.state_dict())
    sampled, unchecked = results
    # BatchNorm: the ladder's first whole-batch plan that fits, the whole batch fits as it is
    assert sampled.attempts[0].reason.startswith("estimated: the first whole-batch plan of the ladder predicted to fit")
    assert any("measuring it on a few real rows" in r.getMessage() for r in caplog.records)
    assert [a.plan for a in sampled.attempts] == [a.plan for a in unchecked.attempts] == [Plan(6)] * 2
    assert [h["loss"] for h in sampled.history] == [h["loss"] for h in unchecked.history]
    assert same(weights[0], weights[1])
