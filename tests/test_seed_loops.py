"""The loops of the two user reports (shared/seeds), made OOM-proof with autofit.stepper by changing
at most 3 lines, at small size under simulated budgets scaled down like the reports' cards.

000: a fine-tune in two phases on a 2 GiB card (AdamW lr 1e-4 with a linear warm-up, then a new
AdamW lr 2e-6 and its own schedule); the second iteration ran out of memory.
004: SciBERT, train then validate each epoch on a 15 GiB card, batches of (x, y), padded tokens; the
validation loop ran out of memory.
Each converted loop ends with the parameters of the plain loop using the same splits.
"""

from statistics import mean

import pytest
import torch
from torch.optim import AdamW
from transformers import get_linear_schedule_with_warmup

import autofit
from autofit.gpu.device import SimulatedDevice
from autofit.plans.plan import Plan
from autofit.engine.step import StepRunner
from reference import bert, cls_batches, max_diff

# Many runs, each ending (and recovering from an OOM) with a full gc.collect(): see frozen_heap.
pytestmark = pytest.mark.usefixtures("frozen_heap")


def peak(model, batch, plan, loss_fn=None):
    """Peak bytes of a global step once AdamW's state exists, on the simulated GPU."""
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        runner = StepRunner(model, AdamW(model.parameters()), device, loss_fn=loss_fn)
        runner.run(batch, plan)
        runner.run(batch, plan)
        return runner.attempt_peak()


def accumulate(model, batch, micro, loss_fn):
    """A plain loop's split of one global batch: micro-batches weighted by rows, gradients summed."""
    rows = len(batch[0]) if isinstance(batch, tuple) else len(batch["labels"])
    for i in range(0, rows, micro):
        part = tuple(t[i:i + micro] for t in batch) if isinstance(batch, tuple) else \
            {k: v[i:i + micro] for k, v in batch.items()}
        (loss_fn(model, part) * (len(part[0] if isinstance(part, tuple) else part["labels"]) / rows)).backward()


# -- seed 000: two phases on a 2 GiB card -----------------------------------------------------------

def small():
    return bert(layers=1, hidden=16)


def seed_000_phase(model, train_iter, optimizer, scheduler, num_epochs, outs):
    """The report's pretrain()/train(), converted: the `with` line and the step line are the change
    (the plain loop's forward, backward, optimizer.step, scheduler.step and zero_grad are `step`)."""
    with autofit.stepper(model, optimizer, scheduler=scheduler) as step:     # changed
        for epoch in range(num_epochs):
            model.train()
            for batch in train_iter:
                outs.append(step(batch))                                    # changed


def seed_000_plain_phase(model, train_iter, optimizer, scheduler, num_epochs, splits):
    for epoch in range(num_epochs):
        model.train()
        for batch in train_iter:
            accumulate(model, batch, next(splits), lambda m, b: m(**b).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def seed_000_program(model, train_iter, phase, extra):
    """The report's top level, scaled down: 1 pretraining epoch, then 2 training epochs."""
    steps_per_epoch, NUM_EPOCHS = len(train_iter), 1
    optimizer = AdamW(model.parameters(), lr=1e-4)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=steps_per_epoch * 1,
                                                num_training_steps=steps_per_epoch * NUM_EPOCHS)
    phase(model, train_iter, optimizer, scheduler, NUM_EPOCHS, extra)
    NUM_EPOCHS = 2
    optimizer = AdamW(model.parameters(), lr=2e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=steps_per_epoch * 1,
                                                num_training_steps=steps_per_epoch * NUM_EPOCHS)
    phase(model, train_iter, optimizer, scheduler, NUM_EPOCHS, extra)


def test_seed_000_two_phase_loop_converted_by_two_lines():
    train_iter = cls_batches(2, rows=16, seq=24)
    whole = peak(small(), train_iter[0], Plan(16))
    half = peak(small(), train_iter[0], Plan.for_batch(16, 8))
    card = (whole + half) // 2  # "2 GiB": half a batch fits once AdamW's state exists, all of it not
    model = small()
    outs = []
    with autofit.simulate_gpu(card):
        seed_000_program(model, train_iter, seed_000_phase, outs)
    splits = [o.plan.micro_batch_size for o in outs]
    assert len(outs) == 6 and all(s < 16 for s in splits)  # the capacity check or an OOM split it
    # The plain loop on the same card runs out of memory, as the report's did.
    plain = small()
    with autofit.simulate_gpu(card) as gpu, pytest.raises(torch.OutOfMemoryError):
        SimulatedDevice(gpu).place_model(plain)
        seed_000_program(plain, train_iter, seed_000_plain_phase, iter([16] * 6))
    reference = small()
    seed_000_program(reference, train_iter, seed_000_plain_phase, iter(splits))
    assert max_diff(model, reference) == 0.0


# -- seed 004: SciBERT, train and validate each epoch -----------------------------------------------

def apply_attention_mask(x):
    return (x != 0).long()  # 0 pads


def load_data(x, y, batch_size):
    for i in range(0, len(x), batch_size):
        yield x[i:i + batch_size], y[i:i + batch_size]


def rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 100, (n, 20), generator=g)
    for i in range(n):
        x[i, 20 - 2 * (i % 7):] = 0  # padded to the longest row
    return x, torch.randint(0, 3, (n,), generator=g)


def seed_004_loop(model, data, epochs):
    """The report's loop, converted by three lines; returns (the stepper, validation losses)."""
    (x_train, y_train), (x_validation, y_validation) = data
    optim = AdamW(model.parameters(), lr=2e-5, eps=1e-8)
    validations = []
    with autofit.stepper(model, optim, loss_fn=lambda m, b: m(b[0], attention_mask=apply_attention_mask(b[0]), labels=b[1]).loss) as step:  # changed
        for epoch in range(epochs):
            epoch_losses = []
            validation_loss = []
            for x, y in load_data(x_train, y_train, batch_size=10):
                epoch_losses.append(step((x, y)).loss)                                   # changed
            validation_loss.append(step.evaluate(load_data(x_validation, y_validation, batch_size=10)).loss)  # changed
            print(f"epoch {epoch + 1} loss: {mean(epoch_losses)}")
            validations.append(mean(validation_loss))
    return step, validations


@pytest.mark.slow
def test_seed_004_train_and_validate_loop_converted_by_three_lines():
    data = (rows(30, 1), rows(20, 2))
    loss_fn = lambda m, b: m(b[0], attention_mask=apply_attention_mask(b[0]), labels=b[1]).loss
    first = tuple(t[:10] for t in data[0])
    whole = peak(small(), first, Plan(10), loss_fn)
    half = peak(small(), first, Plan.for_batch(10, 5), loss_fn)
    card = (whole + half) // 2  # "15 GiB": the batch of 10 does not fit whole once AdamW's state exists
    model = small()
    with autofit.simulate_gpu(card):
        step, validations = seed_004_loop(model, data, epochs=2)
    splits = [a.plan.micro_batch_size for a in step.attempts if a.outcome == "ok"]
    assert len(splits) == 6 and all(s < 10 for s in splits)  # the capacity check or an OOM split it
    # The plain loop with the same splits, validating under no_grad: the same parameters and losses.
    reference = small()
    optim = AdamW(reference.parameters(), lr=2e-5, eps=1e-8)
    splits_left, expected = iter(splits), []
    for epoch in range(2):
        for x, y in load_data(*data[0], batch_size=10):
            reference.train()
            accumulate(reference, (x, y), next(splits_left), loss_fn)
            optim.step()
            optim.zero_grad()
        reference.eval()
        with torch.no_grad():
            expected.append(sum(loss_fn(reference, b).item() for b in load_data(*data[1], batch_size=10)) / 2)
    assert max_diff(model, reference) == 0.0
    assert all(abs(a - b) <= 1e-6 for a, b in zip(validations, expected))


# -- both reports on a card where only optimizer offload fits --------------------------------------

def heavy():
    """A model whose weights dominate its memory (a large vocabulary), as BERT-base's do on a 2 GiB
    card: the capacity check must move the optimizer state to the host."""
    return bert(layers=1, hidden=16, vocab=20000)


def offload_card(batch, rows, loss_fn=None):
    offloaded = peak(heavy(), batch, Plan(rows, offload_optimizer=True), loss_fn)
    on_device = peak(heavy(), batch, Plan.for_batch(rows, 1), loss_fn)  # the least without offload
    assert offloaded < on_device
    return (offloaded + on_device) // 2


def test_seed_000_where_only_offload_fits_keeps_its_schedules():
    train_iter = cls_batches(2, rows=16, seq=24)
    card = offload_card(train_iter[0], 16)
    model = heavy()
    outs = []
    with autofit.simulate_gpu(card):
        seed_000_program(model, train_iter, seed_000_phase, outs)
    assert len(outs) == 6 and all(o.plan.offload_optimizer for o in outs)
    assert all(o.attempts[-1].outcome == "ok" for o in outs)
    reference = heavy()
    seed_000_program(reference, train_iter, seed_000_plain_phase, iter(o.plan.micro_batch_size for o in outs))
    assert max_diff(model, reference) == 0.0


def test_seed_004_where_only_offload_fits_matches_the_plain_loop():
    data = (rows(30, 1), rows(20, 2))
    loss_fn = lambda m, b: m(b[0], attention_mask=apply_attention_mask(b[0]), labels=b[1]).loss
    card = offload_card(tuple(t[:10] for t in data[0]), 10, loss_fn)
    model = heavy()
    with autofit.simulate_gpu(card):
        step, validations = seed_004_loop(model, data, epochs=2)
    done = [a for a in step.attempts if a.outcome == "ok"]
    assert len(done) == 6 and all(a.plan.offload_optimizer for a in done)
    reference = heavy()
    optim = AdamW(reference.parameters(), lr=2e-5, eps=1e-8)
    for epoch in range(2):
        for x, y in load_data(*data[0], batch_size=10):
            accumulate(reference, (x, y), done.pop(0).plan.micro_batch_size, loss_fn)
            optim.step()
            optim.zero_grad()
    assert max_diff(model, reference) == 0.0
    # The optimizer the user holds kept its state (on the host): a checkpoint has all of it.
    assert len(step.optimizer.state_dict()["state"]) == len(list(model.parameters()))
