"""Fragmentation is a move for the Hugging Face Trainer too (autofit.integrations.transformers): an OOM
that the caching allocator's holes caused replays the same plan once, after the cache is emptied,
before the Trainer's ladder steps down; its evaluation retries do the same before halving. Same
reason text as training's controller (tests/test_fragmentation.py), same MLP.

The budgets were found by measurement on `simulate_gpu(caps="reserved")`: an unconstrained run at
per_device_train_batch_size=1024 x 2 peaks at 42 MiB reserved; a no-grad pass over 1800 rows before
training leaves 34 MiB of segments cached, and at 46 MiB the first attempt fails in them.
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import Trainer, TrainingArguments

import autofit
from autofit.integrations.transformers import train

MiB = 2**20
ROWS, PRIOR_ROWS = 2048, 1800
HALVE = ("halve per_device_train_batch_size and double gradient_accumulation_steps (a divisor of 2048, "
         "not below 8); no checkpoint to resume from: restarted from the initial state")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class MLP(torch.nn.Module):
    """tests/test_fragmentation.py's MLP, answering as a Hugging Face model does (a dict with the loss)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.Dropout(0.1), torch.nn.GELU(),
                                       torch.nn.Linear(512, 1536), torch.nn.GELU(), torch.nn.Linear(1536, 3))

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits, labels)
        return out


class Rows(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x, self.labels = torch.randn(n, 16, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


def _run(tmp_path, budget=None, prior=False, model_first=False, eval_rows=0):
    """One epoch of one global batch (2048 rows, per-device 1024 x 2, SGD with momentum, shuffled) by
    `train` on a simulated GPU capping reserved bytes; `prior`: a no-grad pass over 1800 rows first
    leaves its segments cached; `model_first`: the model is made before the simulated GPU, so its
    weights are placed in those segments; `eval_rows`: an evaluation of that many rows, in one batch,
    after the step. -> (TrainerRun, parameters, eval losses)."""
    kwargs = dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=eval_rows) if eval_rows else {}
    args = TrainingArguments(output_dir=str(tmp_path / f"run-{budget}"), per_device_train_batch_size=1024,
                             gradient_accumulation_steps=2, num_train_epochs=1, save_strategy="no", report_to=[],
                             use_cpu=True, logging_strategy="no", disable_tqdm=True, seed=0, **kwargs)
    data, evaluation, before = Rows(ROWS, 2), Rows(eval_rows, 3) if eval_rows else None, Rows(PRIOR_ROWS, 1)
    model = MLP() if model_first else None
    with autofit.simulate_gpu(budget, caps="reserved"):
        model = model or MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=evaluation,
                          optimizers=(optimizer, None))
        if prior:
            model.eval()
            with torch.no_grad():
                model(before.x)
            model.train()
        run = train(trainer, precision="fp32")
    losses = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    return run, {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _shape(attempts):
    return [(a.plan.micro_batch_size, a.plan.accumulation_steps, a.outcome) for a in attempts]


def test_the_trainer_replays_the_plan_the_cache_holes_failed_and_trains_as_an_unconstrained_run(tmp_path):
    run, weights, losses = _run(tmp_path, 46 * MiB, prior=True, eval_rows=2048)
    assert _shape(run.attempts) == [(1024, 2, "oom"), (1024, 2, "ok")]
    assert run.attempts[1].reason == (
        "fragmentation: 9.73 MiB of 34.00 MiB reserved was unallocated when a 20.00 MiB segment for "
        "6.00 MiB could not be reserved; emptied the cache, then the same plan again; no checkpoint to "
        "resume from: restarted from the initial state")
    # The evaluation after the step: the training's segments left holes its 12 MiB activation could
    # not use; emptied, the same size fits.
    assert [(a.batch_size, a.outcome) for a in run.eval_attempts] == [(2048, "oom"), (2048, "ok")]
    assert run.eval_attempts[1].reason == (
        "fragmentation: 23.60 MiB of 42.00 MiB reserved was unallocated when a 12.00 MiB segment for "
        "12.00 MiB could not be reserved; emptied the cache, then the same plan again")
    assert (run.plan.per_device_train_batch_size, run.plan.gradient_accumulation_steps) == (1024, 2)
    free, free_weights, free_losses = _run(tmp_path, None, eval_rows=2048)
    assert _shape(free.attempts) == [(1024, 2, "ok")]
    assert [(a.batch_size, a.outcome) for a in free.eval_attempts] == [(2048, "ok")]
    assert all(torch.equal(weights[n], free_weights[n]) for n in weights)
    assert run.output.training_loss == free.output.training_loss
    assert losses == free_losses and len(losses) == 1


class FullCollections:
    """Counts full garbage collections (generation 2) while open; automatic collection off."""

    def __enter__(self):
        self.count, self.was_enabled = 0, gc.isenabled()
        gc.disable()
        gc.callbacks.append(self._seen)
        return self

    def _seen(self, phase, info):
        self.count += phase == "start" and info["generation"] == 2

    def __exit__(self, *exc):
        gc.callbacks.remove(self._seen)
        if self.was_enabled:
            gc.enable()


def test_when_the_weights_sit_in_the_holes_the_replay_fails_and_the_trainer_steps_down(tmp_path):
    # The weights were placed in the earlier pass's segments: emptying the cache cannot give those
    # back, so the replay fails the same way and the ladder steps down.
    with FullCollections() as full:
        run, _, _ = _run(tmp_path, 46 * MiB, prior=True, model_first=True)
    assert _shape(run.attempts) == [(1024, 2, "oom"), (1024, 2, "oom"), (512, 4, "ok")]
    # One full collection per trainer.train() (the Trainer's own, through Accelerator.free_memory at
    # the start of its loop); the recoveries add none (gpu.oom.collect; free_attempt empties the
    # Accelerator's lists without free_memory's collection).
    assert full.count == 3
    assert run.attempts[1].reason.startswith("fragmentation: 9.73 MiB of 34.00 MiB reserved was unallocated")
    assert run.attempts[2].reason == HALVE


def test_the_trainer_evaluation_halves_when_emptying_the_cache_does_not_help(tmp_path):
    run, _, _ = _run(tmp_path, 46 * MiB, eval_rows=3072)
    assert _shape(run.attempts) == [(1024, 2, "ok")]
    assert [(a.batch_size, a.outcome) for a in run.eval_attempts] == [(3072, "oom"), (3072, "oom"), (1536, "ok")]
    assert run.eval_attempts[1].reason == (
        "fragmentation: 29.53 MiB of 42.00 MiB reserved was unallocated when a 18.00 MiB segment for "
        "18.00 MiB could not be reserved; emptied the cache, then the same plan again")
    assert run.eval_attempts[2].reason == "halved after an out-of-memory error at 3072 rows; the training batch is unchanged"
