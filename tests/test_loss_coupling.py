"""A loss that couples the rows of its batch is measured, said once and kept whole first
(engine/reduction.py, engine/token_loss.py, plans/coupling.py)."""

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autofit


class Towers(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.q = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self.k = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, a, b):
        return F.normalize(self.q(a), dim=-1), F.normalize(self.k(b), dim=-1)


def info_nce(model, batch):
    """In-batch negatives: every other row's key is a negative for a row's query."""
    q, k = model(batch["a"], batch["b"])
    return F.cross_entropy(q @ k.T / 0.1, torch.arange(len(q)))


def pairs(n=3, rows=64):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        a = torch.randn(rows, 32, generator=g)
        out.append({"a": a, "b": a + 0.1 * torch.randn(rows, 32, generator=g)})
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def whole_batch_loop(model, batches):
    opt = adamw(model.parameters())
    for batch in batches:
        info_nce(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def test_an_in_batch_negatives_loss_is_trained_whole_first(caplog):
    """At 200,000 B the whole batch fits in fp32 at the first step only (the optimizer state is
    made there); from the second, whole with offload fits. The loss is found coupled by measuring
    (row 0 alone and row 1 alone have no negative: loss 0 each; both: 0.417), so the ladder tries
    the whole batch under checkpointing, then offload, before any split, and the run ends as the
    whole-batch loop."""
    model = Towers()
    with caplog.at_level(logging.INFO, logger="autofit"):
        result = autofit.run(model, pairs(), loss_fn=info_nce, optimizer=adamw, budget=200_000, precision="fp32",
                             progress=False, cache=False, capacity_check=False)
    assert [(a.step, a.plan.micro_batch_size, a.plan.checkpointing, a.plan.offload_optimizer, a.outcome)
            for a in result.attempts] == [(0, 64, False, False, "ok"), (1, 64, False, False, "oom"),
                                          (1, 64, True, False, "oom"), (1, 64, False, True, "ok"),
                                          (2, 64, False, True, "ok")]
    reference = whole_batch_loop(Towers(), pairs())
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert (mine - theirs).abs().max().item() <= 1e-6
    said = [r for r in caplog.records if "couples the rows" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in said] == [(
        "WARNING", "the loss couples the rows of a batch: loss_fn (loss of row 0 0, of row 1 0, of both 0.417362; "
        "a mean over rows would give 0) is not the row- or token-weighted combination of each row's loss, so "
        "splitting a global batch into micro-batches changes it (in-batch negatives, a statistic over the batch). "
        "autofit tries every whole-batch plan first (precision as allowed, checkpointing, offload, alone and "
        "together) and splits only when none fits; allow_split=False forbids splitting.")]
    assert not [r for r in caplog.records if "matches no reduction" in r.getMessage()]
    assert result.batch_coupled == ["the loss"]


def test_a_row_mean_loss_is_not_called_coupled(caplog):
    def row_mean(model, batch):
        q, k = model(batch["a"], batch["b"])
        return (q - k).pow(2).sum(-1).mean()

    with caplog.at_level(logging.INFO, logger="autofit"):
        result = autofit.run(Towers(), pairs(n=1), loss_fn=row_mean, optimizer=adamw, precision="fp32",
                             progress=False, cache=False)
    assert result.batch_coupled == []
    assert not [r for r in caplog.records if "couples" in r.getMessage()]


class Tupled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x), x.sum()


def test_a_missing_loss_is_reported_as_missing_without_a_reduction_warning(caplog):
    batches = [torch.randn(8, 4)]
    with caplog.at_level(logging.INFO, logger="autofit"):
        with pytest.raises(autofit.errors.NoLossError):
            autofit.run(Tupled(), batches, progress=False, cache=False)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("entry", ["run", "tune"])
def test_a_loader_that_yields_single_samples_is_named(entry):
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with pytest.raises(ValueError, match=re.escape(
            "batch[1] is a 0-dimensional tensor and cannot be split along dimension 0; give every tensor of a "
            "batch a leading batch dimension. data is a DataLoader with batch_size=None, which yields one sample "
            "at a time, not a global batch; give the DataLoader batch_size=<global batch>, or pass its dataset "
            "with batch_size=<global batch>.")):
        options = {"progress": False} if entry == "run" else {"budget": "64MiB"}
        getattr(autofit, entry)(nn.Linear(4, 2), DataLoader(data, batch_size=None), cache=False,
                                loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), **options)
