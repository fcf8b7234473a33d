"""An Accelerate loop converted to autofit.stepper: what `accelerator.prepare` returns is passed as it
is, and the converted loop ends with the plain Accelerate loop's parameters and learning rate at the
same splits; what autofit cannot honour is refused with the fix."""

import json
import socket
import subprocess
import sys

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import get_linear_schedule_with_warmup  # noqa: E402

import autofit  # noqa: E402
from autofit.integrations import accelerate as integration  # noqa: E402
import accelerate_ranks  # noqa: E402
import stepper_ranks  # noqa: E402
from reference import bert, cls_batches, max_diff  # noqa: E402
from spawn import spawn_ranks  # noqa: E402

ROWS = 8  # the loader's batch: one global batch per step(batch)


@pytest.fixture(autouse=True)
def fresh_accelerator():
    """Accelerator's state is a process-wide singleton: reset it around each test, as accelerate's own
    AccelerateTestCase does (these resets are private to accelerate; only this test file calls them)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def halve(plan):
    return plan.replace(micro_batch_size=plan.micro_batch_size // 2) if plan.micro_batch_size > 1 else None


def rows():
    """The dataset a DataLoader batches: 3 global batches of ROWS rows."""
    return [{k: v[i] for k, v in batch.items()} for batch in cls_batches(3, rows=ROWS) for i in range(ROWS)]


def prepared(**accelerator_options):
    """run_glue_no_trainer's setup at tiny size: AdamW, a linear warm-up built before prepare (for twice
    the steps trained, so that the last learning rate is not 0)."""
    accelerator = accelerate.Accelerator(cpu=True, **accelerator_options)
    model = bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(rows(), batch_size=ROWS, shuffle=False)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=2 * len(loader))
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def plain_accelerate_loop(splits):
    """The plain Accelerate loop, each global batch split as autofit's attempt that succeeded split it
    (micro-batches weighted by rows, one accelerator.backward each), then one step of each object."""
    accelerator, model, optimizer, loader, scheduler = prepared()
    model.train()
    for batch, micro in zip(loader, splits):
        for i in range(0, ROWS, micro):
            part = {k: v[i:i + micro] for k, v in batch.items()}
            accelerator.backward(model(**part).loss * (len(part["labels"]) / ROWS))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, scheduler.get_last_lr()


@pytest.mark.parametrize("which", ["prepared", "inner"])
def test_a_converted_accelerate_loop_recovers_from_an_oom_and_equals_the_plain_loop(which):
    accelerator, model, optimizer, loader, lr_scheduler = prepared()
    scheduler = lr_scheduler if which == "prepared" else lr_scheduler.scheduler
    outs = []
    with autofit.simulate_gpu() as gpu:
        with autofit.stepper(model, optimizer, scheduler=scheduler, precision="fp32", ladder=halve) as step:
            for batch in loader:  # the prepared loader, read inside the block as the plain loop reads it
                if not outs:      # the first allocation of the first step (the loader's own come before)
                    gpu.fail_at(gpu.allocation_count)
                outs.append(step(batch))
            assert step.optimizer is optimizer.optimizer and step.scheduler is lr_scheduler.scheduler  # unwrapped
    assert [[(a.plan.micro_batch_size, a.outcome) for a in o.attempts] for o in outs] == [
        [(8, "oom"), (4, "ok")], [(6, "ok")], [(7, "ok")]]
    assert lr_scheduler.scheduler.last_epoch == 3  # once per global batch, never for the failed attempt
    reference, last_lr = plain_accelerate_loop([o.plan.micro_batch_size for o in outs])
    assert max_diff(model, reference) == 0.0 < max_diff(model, bert())  # trained, and as the plain loop
    assert lr_scheduler.get_last_lr() == last_lr == [1e-3 * 0.6]  # warm-up of 1 step, then 3 of 5 left
    assert optimizer.param_groups[0]["lr"] == 1e-3 * 0.6


def test_run_takes_the_prepared_objects_too():
    accelerator, model, optimizer, loader, lr_scheduler = prepared()
    result = autofit.run(model, loader, optimizer=optimizer, scheduler=lr_scheduler, precision="fp32",
                         progress=False)
    assert [(a.plan.micro_batch_size, a.outcome) for a in result.attempts] == [(8, "ok")] * 3
    reference, last_lr = plain_accelerate_loop([8, 8, 8])
    assert max_diff(model, reference) == 0.0
    assert lr_scheduler.get_last_lr() == last_lr == [1e-3 * 0.6]


def test_a_prepared_scheduler_built_on_another_optimizer_is_refused():
    accelerator = accelerate.Accelerator(cpu=True)
    model = bert()
    optimizer = torch.optim.AdamW(model.parameters())
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer,
                                                      get_linear_schedule_with_warmup(other, 1, 3))
    with pytest.raises(ValueError) as info:
        with autofit.stepper(model, optimizer, scheduler=scheduler):
            pass
    assert str(info.value) == (
        "the AcceleratedScheduler wraps a LambdaLR built on another optimizer than the one training steps "
        "(AdamW); pass the optimizer and the scheduler that the same accelerator.prepare(...) returned.")


def test_a_scheduler_built_on_the_prepared_optimizer_is_refused():
    accelerator = accelerate.Accelerator(cpu=True)
    model = bert()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match=r"^the scheduler \(LambdaLR\) is built on Accelerate's prepared "
                                         r"optimizer .* build the scheduler on your optimizer before "
                                         r"accelerator.prepare"):
        with autofit.stepper(model, optimizer, scheduler=get_linear_schedule_with_warmup(optimizer, 1, 3)):
            pass


@pytest.mark.parametrize("options, text", [
    ({"mixed_precision": "bf16"}, "the optimizer was prepared by Accelerator(mixed_precision='bf16'), which "
     "wraps the model's forward in autocast; step(batch) runs the plan's precision instead. Create the "
     "Accelerator with mixed_precision='no' and pass precision='bf16' (or 'auto') to autofit.stepper."),
    ({"gradient_accumulation_steps": 4}, "the optimizer was prepared by Accelerator(gradient_accumulation_"
     "steps=4); autofit chooses the accumulation itself and each step(batch) is one whole global batch. "
     "Create the Accelerator without gradient_accumulation_steps, drop `with accelerator.accumulate(model)`, "
     "and give step(batch) batches 4 times the loader's batch size (the global batch)."),
])
def test_what_the_stepper_would_silently_drop_is_refused_with_the_fix(options, text):
    _, model, optimizer, _, scheduler = prepared(**options)
    with pytest.raises(ValueError) as info:
        with autofit.stepper(model, optimizer, scheduler=scheduler):
            pass
    assert str(info.value) == text


def test_a_scheduler_stepped_once_per_process_is_refused(monkeypatch):
    """Several processes without split_batches: AcceleratedScheduler steps its scheduler once per process."""
    _, model, optimizer, _, scheduler = prepared()

    class TwoProcesses:
        num_processes = 2

    monkeypatch.setattr(integration, "_accelerator_state", TwoProcesses)
    with pytest.raises(ValueError, match=r"^the AcceleratedScheduler steps its LambdaLR 2 times per optimizer "
                                         r"step \(2 processes, split_batches=False\); .*divided by 2\), or "
                                         r"create the Accelerator with dataloader_config="
                                         r"DataLoaderConfiguration\(split_batches=True\)\.$"):
        with autofit.stepper(model, optimizer, scheduler=scheduler):
            pass
    split = accelerate.scheduler.AcceleratedScheduler(scheduler.scheduler, [optimizer], split_batches=True)
    assert integration.unwrap(optimizer, split) == (optimizer.optimizer, scheduler.scheduler)


@pytest.mark.slow
def test_two_processes_with_split_batches_train_as_one_process_and_a_per_process_scheduler_is_refused(tmp_path):
    """Accelerate's MULTI_CPU on two gloo ranks, the model DDP-wrapped by prepare: each rank's share of
    every global batch trained in lockstep, equal to one process doing the same splits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    codes, killed = spawn_ranks(accelerate_ranks.worker, lambda r: (r, port, str(tmp_path)), 2, 180)
    assert codes == [0, 0] and not killed
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1]
    assert seen[0]["setup"] == "MULTI_CPU" and seen[0]["model"] == "DistributedDataParallel"
    assert seen[0]["rows"] == [4, 4]  # split_batches: each global batch of 8 shared out
    assert seen[0]["refused"].startswith("the AcceleratedScheduler steps its StepLR 2 times per optimizer "
                                         "step (2 processes, split_batches=False)")
    assert seen[0]["attempts"] == [[0, 4, "oom"], [0, 2, "ok"], [1, 3, "ok"]]
    expected, norms = stepper_ranks.split_loop([2, 3], scheduler=stepper_ranks.decay)
    assert seen[0]["norms"] == norms
    assert seen[0]["last_lr"] == [1e-3 * 0.5 * 0.5]
    for r in range(2):
        state = torch.load(tmp_path / f"rank{r}.pt")
        assert all(torch.equal(state[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_autofit_never_imports_accelerate():
    """accelerate is optional: the stepper recognises its objects without importing it."""
    code = ("import sys, torch, autofit\n"
            "m = torch.nn.Linear(2, 1)\n"
            "with autofit.stepper(m, torch.optim.SGD(m.parameters(), lr=0.1), precision='fp32',\n"
            "                     loss_fn=lambda m, b: m(b).pow(2).mean(), cache=False) as step:\n"
            "    step(torch.randn(4, 2))\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] == 'accelerate'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == "[]\n"


@pytest.mark.slow
def test_the_converted_run_glue_example_trains_under_a_budget_the_plain_loop_exceeds_and_equals_it():
    import test_examples
    glue = test_examples.example("accelerate_glue")
    train_rows, eval_rows = glue.random_rows(24), glue.random_rows(16, seed=2)

    def plain(splits):
        """The script's loop with each global batch split as autofit split it (rows weighted)."""
        accelerator, model, optimizer, train_dl, eval_dl, scheduler = glue.setup(train_rows, eval_rows)
        accuracies = []
        for epoch in range(2):
            model.train()
            for batch, micro in zip(train_dl, splits[epoch * len(train_dl):]):
                for i in range(0, len(batch["labels"]), micro):
                    part = {k: v[i:i + micro] for k, v in batch.items()}
                    accelerator.backward(model(**part).loss * (len(part["labels"]) / len(batch["labels"])))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            model.eval()
            with torch.no_grad():
                hits = [(model(**b).logits.argmax(-1) == b["labels"]) for b in eval_dl]
            accuracies.append(float(torch.cat(hits).float().mean()))
        return model, accuracies

    with autofit.simulate_gpu() as gpu:
        glue.train_plain(*glue.setup(train_rows, eval_rows))
        whole = gpu.max_memory_allocated()
    with autofit.simulate_gpu(int(whole * 0.6)):
        with pytest.raises(torch.OutOfMemoryError):
            glue.train_plain(*glue.setup(train_rows, eval_rows))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    objects = glue.setup(train_rows, eval_rows)
    with autofit.simulate_gpu(int(whole * 0.6)):
        accuracies, splits = glue.train_autofit(*objects, precision="fp32", cache=False)
    assert len(splits) == 6 and splits[0] < 8
    reference, plain_accuracies = plain(splits)
    assert max_diff(objects[1], reference) == 0.0
    assert accuracies == pytest.approx(plain_accuracies, abs=1e-12)
