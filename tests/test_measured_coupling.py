"""A layer of the user's that couples the rows of a batch is found by measuring the training
forward on two rows (engine/reduction.couples_in_training), where that forward draws nothing at
random; one that keeps its rows apart is not."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit


class Centre(nn.Module):
    """Subtracts the batch's mean in training and keeps a running mean for evaluation."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x):
        if not self.training:
            return x - self.mean
        m = x.mean(0)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * m)
        return x - m


class RowNorm(nn.Module):
    """Normalises each row by its own statistics, and counts its calls in a buffer."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5)


class Net(nn.Module):
    def __init__(self, layer, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = nn.Linear(8, 32), layer(32), nn.Linear(32, 3)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.norm(self.a(x)))))


def loss_fn(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)) for _ in range(3)]


def run(model, caplog, budget=16_000):
    with caplog.at_level(logging.INFO, logger="autofit"):
        return autofit.run(model, data(), loss_fn=loss_fn, optimizer=sgd, budget=budget, precision="fp32",
                           progress=False, cache=False, capacity_check=False)


def test_a_layer_that_centres_on_the_batch_mean_is_measured_coupled_and_kept_whole_first(caplog):
    model = Net(Centre)
    result = run(model, caplog)
    assert result.batch_coupled == ["the loss"]
    said = [r.getMessage() for r in caplog.records if "couples the rows" in r.getMessage()]
    assert said == [
        "the loss couples the rows of a batch: loss_fn in training mode (loss of row 0 1.11714, of row 1 "
        "1.11714, of both 1.21595; a mean over rows would give 1.11714) is not the row- or token-weighted "
        "combination of each row's loss, so splitting a global batch into micro-batches changes it (in-batch "
        "negatives, a statistic over the batch). autofit tries every whole-batch plan first (precision as "
        "allowed, checkpointing, offload, alone and together) and splits only when none fits; "
        "allow_split=False forbids splitting."]
    # The whole batch with offload before any split (no repeated blocks: nothing to checkpoint).
    assert [(a.step, a.plan.micro_batch_size, a.plan.offload_optimizer, a.outcome) for a in result.attempts] == [
        (0, 64, False, "oom"), (0, 64, True, "oom"), (0, 32, True, "oom"), (0, 16, True, "ok"),
        (1, 24, True, "oom"), (1, 16, True, "ok"), (2, 20, True, "oom"), (2, 16, True, "ok")]
    plain = Net(Centre)
    opt = sgd(plain.parameters())
    for x, y in data():
        for i in range(0, 64, 16):
            (loss_fn(plain, (x[i:i + 16].clone(), y[i:i + 16].clone())) * (16 / 64)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mine, theirs = model.state_dict(), plain.state_dict()
    assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) <= 1e-6


@pytest.mark.parametrize("layer", [RowNorm, lambda d: nn.GroupNorm(4, d)], ids=["row-norm", "group-norm"])
def test_a_layer_that_keeps_rows_apart_is_not_coupled(layer, caplog):
    result = run(Net(layer), caplog)
    assert result.batch_coupled == []
    assert not [r for r in caplog.records if "couples the rows" in r.getMessage()]


def test_a_training_forward_that_draws_at_random_is_not_judged(caplog):
    """With dropout the loss of two rows moves with the seed: the probe cannot tell coupling from
    randomness, so it says nothing (BatchNorm is found by class; other layers can be declared with
    `batch_coupled = True`)."""
    result = run(Net(Centre, dropout=0.1), caplog)
    assert result.batch_coupled == []
    assert not [r for r in caplog.records if "couples the rows" in r.getMessage()]


def test_a_layer_declared_not_coupled_is_trusted(caplog):
    model = Net(Centre)
    model.norm.batch_coupled = False
    result = run(model, caplog)
    assert result.batch_coupled == []
    assert not [r for r in caplog.records if "couples the rows" in r.getMessage()]
