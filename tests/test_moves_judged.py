"""A precision or checkpointing move is judged by the peak it saves: one predicted to peak no lower
than the same micro-batch without it (bf16 on a recurrent LM whose vocabulary head's bf16 copy and
gradients cost more than its activations save) is withdrawn, and the ladder goes on without it, so
the run ends in fp32 at the micro-batch that fits instead of in bf16 at a smaller one."""

import pytest
import torch
import torch.nn.functional as F

import autofit
from autofit.plans.plan import Plan
from autofit.sizes import format_size

pytestmark = pytest.mark.usefixtures("frozen_heap")

MiB = 2**20
VOCAB, HIDDEN, ROWS, STEPS = 16384, 256, 64, 8


class RecurrentLM(torch.nn.Module):
    """An LSTM language model (gates as one Linear) whose vocabulary head dominates its weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.cell = torch.nn.Linear(2 * HIDDEN, 4 * HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        h = x.new_zeros(ids.shape[0], HIDDEN)
        c = torch.zeros_like(h)
        outs = []
        for t in range(ids.shape[1]):
            i, f, g, o = self.cell(torch.cat([x[:, t], h], -1)).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        return self.head(torch.stack(outs, 1))


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, STEPS + 1), generator=g) for _ in range(n)]


def peak(micro, precision):
    return autofit.estimate(RecurrentLM(), batches(1)[0], Plan.for_batch(ROWS, micro, precision=precision),
                            optimizer=sgd, loss_fn=loss_fn, device_type="cpu").peak_bytes


@pytest.mark.slow
def test_a_precision_move_that_saves_nothing_is_withdrawn_and_the_run_ends_in_fp32():
    # bf16 peaks higher than fp32 at every micro-batch; 32 rows fit in fp32 only.
    # bf16 peaks higher than fp32 at every micro-batch; 4 rows fit in fp32, none in bf16.
    budget = 87 * MiB
    assert peak(4, "fp32") <= budget < peak(8, "fp32")
    assert budget < min(peak(m, "bf16") for m in (4, 2, 1))
    model, data = RecurrentLM(), batches()
    with autofit.simulate_gpu(budget) as gpu:
        gpu.fail_at(gpu.allocation_count)  # the start plan's first attempt runs out of memory
        result = autofit.run(model, data, loss_fn=loss_fn, optimizer=sgd, precision="auto",
                             progress=False, cache=False)
    steps = [(a.step, a.plan.micro_batch_size, a.plan.precision, a.outcome) for a in result.attempts]
    # The start plan (the capacity check's 4 rows) fails; bf16 would peak higher, so it is withdrawn
    # and the ladder goes on in fp32: 2 rows, then the guided probe up to below the size that failed.
    # (With bf16 kept, its 4, 2 and 1 rows all ran out of memory and the run was refused.)
    assert steps == [(0, 4, "fp32", "oom"), (0, 2, "fp32", "ok"), (1, 3, "fp32", "ok"), (2, 3, "fp32", "ok")]
    assert (f"(SetField(precision='bf16') skipped: precision='bf16' was withdrawn: its peak is not lower: "
            f"{format_size(peak(4, 'bf16'))} predicted against {format_size(peak(4, 'fp32'))} for micro 4 x 16, "
            f"fp32)") in result.attempts[1].reason
    assert all(h["plan"].precision == "fp32" for h in result.history)
