"""The two user reports of shared/seeds/, at small size on the simulated GPU.

1. A language-model fine-tune in two phases on a 2 GiB card (pretrain with AdamW lr 1e-4, then
   train with a new AdamW lr 2e-6 and a warm-up schedule): the second phase must start from clean
   memory, so it makes no more OOM attempts than the same phase in a fresh process.
2. SciBERT, training then validation on a 15 GiB card, where the validation loop (autograd on,
   gradients of the last step still alive) ran out of memory: under `autofit.run(eval_data=...)`
   evaluation runs in inference mode with a larger batch than training, and never changes the
   training plan.
"""

import copy

import pytest
import torch
from torch.optim import AdamW
from transformers import get_linear_schedule_with_warmup

import autofit
from autofit.gpu.device import SimulatedDevice
from autofit.plans.plan import Plan
from reference import bert, cls_batches, max_diff, model_bytes, plain_loop, storage_bytes
from reference import second_step_peak as reference_peak


def small():
    return bert(layers=1, hidden=16)


def second_step_peak(batch, plan, make=small):
    return reference_peak(make(), batch, plan)


def sequence(result):
    return [(a.step, a.plan, a.outcome) for a in result.attempts]


# -- the 2 GiB report: two phases ------------------------------------------------------------------

TWO_PHASE = dict(precision="fp32", progress=False, cache=False, capacity_check=False)


def phase_two(model, data, budget):
    """The report's second phase: a new AdamW at lr 2e-6 with a linear warm-up schedule."""
    return autofit.run(model, data, optimizer=lambda p: AdamW(p, lr=2e-6),
                       scheduler=lambda o: get_linear_schedule_with_warmup(o, 1, len(data)),
                       budget=budget, **TWO_PHASE)


@pytest.fixture(scope="module")
def two_phase_budget():
    data = cls_batches(3, rows=16, seq=48)
    whole = second_step_peak(data[0], Plan(16))
    half = second_step_peak(data[0], Plan.for_batch(16, 8))
    return (whole + half) // 2  # half the global batch fits once AdamW's state exists, all of it not


def test_second_phase_starts_from_clean_memory_and_makes_no_more_ooms_than_a_fresh_process(
        two_phase_budget):
    data = cls_batches(3, rows=16, seq=48)
    model = small()
    with autofit.simulate_gpu(two_phase_budget) as gpu:
        first = autofit.run(model, data, optimizer=lambda p: AdamW(p, lr=1e-4), **TWO_PHASE)
        # Nothing of phase 1 is left: its optimizer state, gradients, graph and batches are gone.
        assert gpu.memory_allocated() == model_bytes(model)
        assert len(gpu.live_storages()) == len(list(model.parameters()) + list(model.buffers()))
        with gpu.untracked():
            weights = copy.deepcopy(model.state_dict())
        second = phase_two(model, data, None)
        assert gpu.memory_allocated() == model_bytes(model)
    assert first.oom_attempts >= 1  # the budget does bind
    fresh_model = small()
    fresh_model.load_state_dict(weights)
    with autofit.simulate_gpu(two_phase_budget):  # a fresh process: new GPU, phase 1's weights
        fresh = phase_two(fresh_model, data, None)
    assert second.oom_attempts <= fresh.oom_attempts
    assert sequence(second) == sequence(fresh)
    assert max_diff(model, fresh_model) == 0.0


def test_an_optimizer_instance_that_holds_state_is_used_as_it_is(two_phase_budget):
    data = cls_batches(3, rows=16, seq=48)
    model = small()
    with autofit.simulate_gpu(two_phase_budget) as gpu:
        optimizer = AdamW(model.parameters(), lr=1e-4)
        first = {k: v[:4] for k, v in data[0].items()}
        model(**first).loss.backward()  # the user's own first step: the state exists on the device
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with gpu.untracked():
            reference_model = copy.deepcopy(model)
            reference_optimizer = AdamW(reference_model.parameters(), lr=1e-4)
            reference_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        state = storage_bytes(v for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
        result = autofit.run(model, data[1:], optimizer=optimizer, **TWO_PHASE)
        assert result.oom_attempts >= 1  # its state counts against the budget: the run stepped down
        # The user's optimizer keeps its state (autofit frees only what it built).
        assert gpu.memory_allocated() == model_bytes(model) + state
    steps = {int(s["step"]) for s in optimizer.state.values()}
    assert steps == {3}  # 1 before the run, 2 in it: the same state carried on
    micro = [h["plan"].micro_batch_size for h in result.history]
    plain_loop(reference_model, data[1:], micro, optimizer=reference_optimizer)
    assert max_diff(model, reference_model) <= 1e-6


def warm_optimizer(model, batch):
    """The user's own first step, outside autofit: AdamW's moments exist."""
    optimizer = AdamW(model.parameters(), lr=1e-4)
    model(**{k: v[:4] for k, v in batch.items()}).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def test_a_warm_optimizer_made_before_the_simulated_gpu_counts_against_its_budget():
    data = cls_batches(3, rows=16, seq=48)
    model = small()
    optimizer = warm_optimizer(model, data[0])  # made on the host, before any simulated GPU
    state = storage_bytes(v for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    # The whole batch fits only if the state is not counted.
    budget = second_step_peak(data[0], Plan(16)) - state // 2
    outside = autofit.run(model, data[1:], optimizer=optimizer, budget=budget, **TWO_PHASE)
    inside_model = small()
    with autofit.simulate_gpu(budget):
        inside = autofit.run(inside_model, data[1:], optimizer=warm_optimizer(inside_model, data[0]),
                             **TWO_PHASE)
    assert [(a.step, a.plan.micro_batch_size, a.outcome) for a in outside.attempts][:2] == [
        (0, 16, "oom"), (0, 8, "ok")]
    assert sequence(outside) == sequence(inside)
    assert max_diff(model, inside_model) == 0.0


# -- the SciBERT report: validation after training -------------------------------------------------

class Rows(torch.utils.data.Dataset):
    """The validation set as a map-style Dataset: autofit chooses the evaluation batch itself."""

    def __init__(self, batches):
        self.batches = batches
        self.rows = [(b, i) for b in batches for i in range(len(b["labels"]))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        batch, i = self.rows[index]
        return {k: v[i] for k, v in batch.items()}


ROWS = 10  # the report's batch_size=10


@pytest.fixture(scope="module")
def scibert():
    train = cls_batches(3, rows=ROWS, seq=64, seed=1)
    validation = cls_batches(3, rows=ROWS, seq=64, seed=2)
    budget = second_step_peak(train[0], Plan(ROWS)) + 4096  # the training step barely fits
    return train, validation, budget


def test_the_reports_validation_loop_runs_out_of_memory_under_that_budget(scibert):
    """The user's code: gradients of the last step still alive, validation with autograd on."""
    train, validation, budget = scibert
    model = small()
    with autofit.simulate_gpu(budget) as gpu:
        SimulatedDevice(gpu).place_model(model)
        optim = AdamW(model.parameters(), lr=2e-5, eps=1e-8)
        for batch in train:
            model.zero_grad()
            out = model(**batch)
            out.loss.backward()
            optim.step()
        del out
        validation_loss = []
        with pytest.raises(torch.OutOfMemoryError):
            for batch in validation:
                validation_output = model(**batch)
                validation_loss.append(validation_output.loss.item())
    assert len(validation_loss) < len(validation)


def test_evaluation_runs_in_inference_mode_with_a_larger_batch_and_leaves_the_training_plan_alone(
        scibert):
    train, validation, budget = scibert
    seen = []

    def modes(model):
        def metric_fn(output, batch):
            seen.append((torch.is_inference_mode_enabled(), model.training, output.logits.requires_grad))
            return {"accuracy": (output.logits.argmax(-1) == batch["labels"]).float().mean()}
        return metric_fn

    job = dict(budget=budget, precision="fp32", progress=False, cache=False, capacity_check=False,
               epochs=2)  # evaluation after epoch 1 comes before epoch 2's training
    model = small()
    result = autofit.run(model, train, eval_data=Rows(validation), metric_fn=modes(model), **job)
    alone = small()
    without = autofit.run(alone, train, **job)
    assert sequence(result) == sequence(without)            # the same plans, in the same order
    assert all(a.plan == Plan(ROWS) for a in result.attempts)  # the whole batch fits, barely
    assert max_diff(model, alone) == 0.0                      # evaluation trained nothing
    assert [r["epoch"] for r in result.eval_history] == [0, 1]
    record = result.eval_history[-1]
    assert all(r["samples"] == 3 * ROWS for r in result.eval_history)
    assert all(r["batch_size"] > ROWS for r in result.eval_history)  # larger than training's batch
    assert seen and all(s == (True, False, False) for s in seen)
    assert model.training                                     # back in train mode afterwards
    with torch.no_grad():                                     # the loss of a plain no_grad loop
        model.eval()
        everything = {k: torch.cat([b[k] for b in validation]) for k in validation[0]}
        expected = model(**everything).loss.item()
        model.train()
    assert abs(record["loss"] - expected) <= 1e-6
