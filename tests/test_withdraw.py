"""A move whose plan raises an error that the plan before it did not raise (a kernel without bf16)
is withdrawn: the state is restored, the move is skipped for the rest of the run, and the run goes
on as the plain loop with the same splits. An error the plans share is the user's: it propagates."""

import pytest
import torch
import torch.nn.functional as F

import autofit
from reference import device_copy

pytestmark = pytest.mark.usefixtures("frozen_heap")


class NoBf16Kernel(torch.nn.Linear):
    """As oneDNN's LSTM on a CPU without its bf16 kernel: a RuntimeError under bf16 autocast."""

    def forward(self, x):
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
            raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")
        return super().forward(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.Sequential(NoBf16Kernel(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


def batches(n=3, rows=8):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, 4, generator=g), "y": torch.randint(0, 3, (rows,), generator=g)}
            for _ in range(n)]


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_bf16_without_a_kernel_is_withdrawn_and_the_run_goes_on():
    model, data = Net(), batches()
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)  # the first attempt runs out of memory
        result = autofit.run(model, data, loss_fn=loss_fn, optimizer=sgd, precision="auto",
                             progress=False, cache=False)
    first = [(a.outcome, a.plan.precision, a.plan.checkpointing) for a in result.attempts[:3]]
    assert first == [("oom", "fp32", False), ("withdrawn", "bf16", False), ("ok", "fp32", True)]
    withdrawn = result.attempts[1]
    assert withdrawn.error == ("RuntimeError: could not create a primitive descriptor for the LSTM forward "
                               "propagation primitive") and withdrawn.where == "forward"
    assert all(h["plan"].precision == "fp32" for h in result.history)
    assert result.attempts[2].reason.endswith(
        "(SetField(precision='bf16') skipped: precision='bf16' was withdrawn: it raised RuntimeError: could not "
        "create a primitive descriptor for the LSTM forward propagation primitive)")
    reference = Net()
    opt = sgd(reference.parameters())
    for batch, h in zip(batches(), result.history):
        micro = h["plan"].micro_batch_size
        for i in range(0, 8, micro):
            part = device_copy({k: v[i:i + micro] for k, v in batch.items()})  # as the simulated GPU
            (loss_fn(reference, part) * (len(part["y"]) / 8)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)
    assert ("it raised RuntimeError: could not create a primitive descriptor for the LSTM forward propagation "
            "primitive, so that move was withdrawn for the rest of the run.") in autofit.explain(result)


def test_the_stepper_withdraws_the_move_too():
    model, data = Net(), batches()
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)
        with autofit.stepper(model, sgd, loss_fn=loss_fn, precision="auto", cache=False) as step:
            plans = [step(batch).plan for batch in data]
        outcomes = [a.outcome for a in step.attempts]
    assert outcomes[:3] == ["oom", "withdrawn", "ok"] and {p.precision for p in plans} == {"fp32"}


def test_an_error_the_plans_share_is_the_users_and_propagates_unchanged():
    """Step 1 raises in every plan: its first plan ran out of memory first, the next plan's error is
    taken for its move's, and the one after raises it again: the user's error ends the run."""
    calls = []

    def failing(model, batch):
        calls.append(len(batch["y"]))
        if len(calls) > 1:
            raise ValueError("labels out of range (the user's bug)")
        return loss_fn(model, batch)
    model, data = Net(), batches()
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)
        with pytest.raises(ValueError, match=r"^labels out of range \(the user's bug\)$"):
            autofit.run(model, data, loss_fn=failing, optimizer=sgd, precision="fp32", progress=False,
                        cache=False, capacity_check=False)


def test_an_error_without_a_move_before_it_propagates():
    def failing(model, batch):
        raise KeyError("no such field")
    with pytest.raises(KeyError, match="no such field"):
        autofit.run(Net(), batches(), loss_fn=failing, optimizer=sgd, precision="auto", progress=False,
                    cache=False, capacity_check=False)


def test_a_real_lstm_under_precision_auto_runs_to_the_end():
    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj, self.lstm, self.head = torch.nn.Linear(4, 8), torch.nn.LSTM(8, 16, batch_first=True), \
                torch.nn.Linear(16, 3)

        def forward(self, x):
            return self.head(self.lstm(self.proj(x))[0][:, -1])
    g = torch.Generator().manual_seed(2)
    data = [{"x": torch.randn(8, 5, 4, generator=g), "y": torch.randint(0, 3, (8,), generator=g)} for _ in range(3)]
    model = Tagger()
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)
        result = autofit.run(model, data, loss_fn=loss_fn, optimizer=sgd, precision="auto", progress=False,
                             cache=False)
    assert len(result.history) == 3
    assert [a.outcome for a in result.attempts][0] == "oom"


def test_an_upward_probe_that_raises_is_withdrawn_and_the_proven_plan_replays_the_batch():
    """A BatchNorm MLP proven at micro 6 x 2 (8 rows): the probe to 7 leaves a last micro-batch of
    one row, which BatchNorm refuses in training (a ValueError, not an OOM). The probe is withdrawn,
    the batch replayed at the proven size, and the search stops below it; the run ends as the
    plain loop with the same splits."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 3))

    def loss_fn(model, batch):
        if torch.is_grad_enabled() and len(batch["y"]) == 8:  # the whole batch does not fit
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (8 rows)")
        return F.cross_entropy(model(batch["x"]), batch["y"])
    data = batches(n=5)
    for b in data:
        b["x"] = torch.cat([b["x"], b["x"][:, :2]], dim=1)  # 6 features
    model = make()
    plan = autofit.Plan(micro_batch_size=6, accumulation_steps=2, precision="fp32")
    with autofit.stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                         precision="fp32", cache=False) as step:
        step.load_state_dict({"version": 1, "plan": plan.to_dict(), "sizes": {"fits": [], "fails": []}})
        outs = [step(b) for b in data]
    trace = [[(a.plan.micro_batch_size, a.outcome) for a in o.attempts] for o in outs]
    # 8 runs out of memory (the probe's first try), 7 leaves one row for the last micro-batch
    assert trace == [[(6, "ok")], [(8, "oom"), (6, "ok")], [(7, "withdrawn"), (6, "ok")], [(6, "ok")],
                     [(6, "ok")]]
    withdrawn = outs[2].attempts[0]
    assert withdrawn.error.startswith("ValueError: Expected more than 1 value per channel when training")
    splits = [o.plan.micro_batch_size for o in outs]
    reference = make()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for b, micro in zip(data, splits):
        for i in range(0, 8, micro):
            part = device_copy({k: v[i:i + micro] for k, v in b.items()})
            (loss_fn(reference, part) * (len(part["y"]) / 8)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
