"""A refusal before training: every configuration is estimated down to one row per micro-batch (or
ruled out by what it holds whatever its rows), and the plan named is the leanest one estimated.

Where the budget caps reserved bytes, a small model's plans all reserve the same whole segment, so
the leanest is decided by the allocated peak, then the rows: before, the first plan estimated of
the tied ones was named (a BatchNorm CNN's refusal named 16 rows per micro-batch after estimating 1)."""

import pytest
import torch
import torch.nn.functional as F

import autofit
from autofit.estimator.estimate import Estimator

MiB = 2**20


def cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10))


class EncoderDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(500, 32)
        self.core = torch.nn.Transformer(32, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(32, 500)

    def forward(self, source, target):
        return self.head(self.core(self.embed(source), self.embed(target)))


def cnn_job():
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g))
    return cnn(), batch, lambda model, b: F.cross_entropy(model(b[0]), b[1])


def seq2seq_job():
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 500, (8, 24), generator=g), torch.randint(0, 500, (8, 12), generator=g))
    return EncoderDecoder(), batch, lambda model, b: F.cross_entropy(model(*b).flatten(0, 1), b[1].flatten())


def refused(job, monkeypatch):
    """The refusal of `job` on a simulated GPU of 1 MiB capping reserved bytes (one segment is 2 MiB:
    nothing fits), and the plans the capacity check estimated, in order, as (rows, precision,
    checkpointing, offload)."""
    model, batch, loss = job()
    estimated = []
    measure = Estimator.measure

    def recorded(self, plan, after=None, limit=None):
        estimated.append((plan.micro_batch_size, plan.precision, plan.checkpointing, plan.offload_optimizer))
        return measure(self, plan, after=after, limit=limit)
    monkeypatch.setattr(Estimator, "measure", recorded)
    with autofit.simulate_gpu(MiB, caps="reserved"), pytest.raises(autofit.DoesNotFit) as error:
        autofit.run(model, [batch], loss_fn=loss, progress=False, cache=False)
    return error.value, estimated


def test_a_batchnorm_cnn_is_estimated_down_to_one_row_with_every_move_and_the_leanest_named(monkeypatch):
    error, estimated = refused(cnn_job, monkeypatch)
    moves = [(p, c, o) for c in (False, True) for o in (False, True) for p in ("fp32", "bf16")]
    moves = sorted(moves, key=lambda m: (m[2], m[1]))  # the ladder's: checkpointing, then offload
    whole = [(16, p, c, o) for p, c, o in moves]       # batch-coupled: every whole-batch plan first
    searched = {("fp32", False, False): [16, 6, 2, 1], ("bf16", False, False): [16, 6, 2, 1],
                ("fp32", True, False): [16, 3, 1], ("bf16", True, False): [16, 6, 2, 1],
                ("fp32", False, True): [16, 6, 2, 1], ("bf16", False, True): [16, 6, 2, 1],
                ("fp32", True, True): [16, 3, 1], ("bf16", True, True): [16, 6, 2, 1]}
    assert estimated == whole + [(m, *config) for config, sizes in searched.items() for m in sizes]
    named = autofit.Plan(1, 16, precision="bf16", offload_optimizer=True)
    assert error.plan == named
    assert "the smallest plan tried (micro 1 x 16, bf16, offload) needs 2.00 MiB reserved of a 1.00 MiB budget" \
        in str(error)
    assert "estimated peak of the leanest plan (micro 1 x 16, bf16, offload): 96.50 KiB" in str(error)


def test_an_encoder_decoder_refusal_names_the_smallest_plan_estimated(monkeypatch):
    error, estimated = refused(seq2seq_job, monkeypatch)
    # nn.Transformer has no blocks autofit checkpoints: precision and offload are the moves.
    assert estimated == [(8, "fp32", False, False), (1, "fp32", False, False),
                         (8, "bf16", False, False), (1, "bf16", False, False),
                         (8, "fp32", False, True), (2, "fp32", False, True), (1, "fp32", False, True),
                         (8, "bf16", False, True), (2, "bf16", False, True), (1, "bf16", False, True)]
    assert error.plan == autofit.Plan(1, 8, precision="fp32", offload_optimizer=True)
    assert "the smallest plan tried (micro 1 x 8, fp32, offload) needs 2.00 MiB reserved" in str(error)
    assert "estimated peak of the leanest plan (micro 1 x 8, fp32, offload): 628.50 KiB" in str(error)
