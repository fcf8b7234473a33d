"""autofit.integrations.hf_records: a Trainer subclass whose compute_loss keeps records (the rows of
every call, a token count, a metric it adds to the log) ends with the records of a run without the
OOM at the same final split, exactly; the capacity check's estimate, which runs that compute_loss on
fake tensors, leaves them as they were; an evaluation retry leaves no trace on them either.

CPU only, on a simulated GPU; OOMs are injected at an exact step (`gpu.fail_at`), so every list is exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import autofit
from autofit.integrations import hf_records
from autofit.integrations.transformers import fit_trainer, train
from models import bert_batch, tiny_bert
from test_integration_transformers import StopAt  # noqa: E402

ROWS, SEQ = 64, 16
CALLS: list = []  # every compute_loss call, kept outside the Trainer: the estimate's calls show here
TIMING = ("_runtime", "_per_second")  # log keys that measure time (train_runtime, eval_samples_per_second)


class Recording(Trainer):
    """compute_loss records as TRL's trainers do: the rows of each call, a running token count (a
    tensor's .item(), symbolic on fake tensors), and the losses it averages into the next log."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows_seen: list = []
        self.tokens = 0
        self.pending: dict = {"train": [], "eval": []}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        CALLS.append(mode)
        self.rows_seen.append((mode, len(inputs["input_ids"])))
        if mode == "train":
            self.tokens += inputs["attention_mask"].sum().item()
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.pending[mode].append((out[0] if return_outputs else out).detach().item())
        return out

    def log(self, logs, start_time=None):
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        if self.pending[mode]:
            logs[f"{mode}_micro_loss_mean"] = sum(self.pending[mode]) / len(self.pending[mode])
            self.pending[mode].clear()
        super().log(logs, start_time)


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=ROWS, seed=0):
        batch = bert_batch(n, SEQ, seed=seed)
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class FailAt(TrainerCallback):
    """One OOM a few allocations after the start (or end) of global step `step`."""

    def __init__(self, gpu, step, when="begin"):
        self.gpu, self.step, self.when = gpu, step, when

    def _arm(self, state, when):
        if when == self.when and state.global_step == self.step:
            self.gpu.fail_at(self.gpu.allocation_count + 3)
            self.step = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._arm(state, "begin")

    def on_step_end(self, args, state, control, **kwargs):
        self._arm(state, "end")


class FailInEvaluation(TrainerCallback):
    """One OOM just after the first evaluation batch at global step `step` (its records are kept)."""

    def __init__(self, gpu, step):
        self.gpu, self.step = gpu, step

    def on_prediction_step(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.gpu.fail_at(self.gpu.allocation_count + 3)
            self.step = None


def make(tmp_path, name, per=16, accum=2, save="no", callbacks=(), eval_dataset=None, **extra):
    args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=per,
                             gradient_accumulation_steps=accum, num_train_epochs=2, save_strategy=save,
                             save_steps=1, report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True,
                             seed=0, **extra)
    trainer = Recording(model=tiny_bert(), args=args, train_dataset=Rows(), eval_dataset=eval_dataset,
                        callbacks=list(callbacks))
    # BERT's classification loss ignores num_items_in_batch: what autofit's fit sets (huggingface/
    # transformers#47688), so a plain run trains on the same gradient.
    trainer.model_accepts_loss_kwargs = False
    return trainer


def records(trainer):
    log = [{k: v for k, v in entry.items() if not k.endswith(TIMING)} for entry in trainer.state.log_history]
    return trainer.rows_seen, trainer.tokens, trainer.pending, log


def shape(attempts):
    return [(a.plan.micro_batch_size, a.plan.accumulation_steps, a.outcome, a.step) for a in attempts]


def test_the_estimate_leaves_the_records_as_they_were(tmp_path):
    trainer = make(tmp_path, "fit")
    trainer.rows_seen.append(("train", 3))  # records from before: kept, not emptied
    trainer.state.log_history.append({"loss": 1.5, "step": 0})
    before = copy.deepcopy(records(trainer))
    CALLS.clear()
    fitted = fit_trainer(trainer, budget="1.5MiB")
    assert (fitted.per_device_train_batch_size, fitted.gradient_accumulation_steps) == (16, 2)
    assert CALLS and set(CALLS) == {"train"}  # the estimate ran this compute_loss ...
    assert records(trainer) == before  # ... and left no trace (before: a symbolic token count)
    assert type(trainer.tokens) is int


@pytest.mark.parametrize("save", ["no", "steps"])
def test_an_oom_and_its_replay_leave_the_records_of_a_run_without_it(tmp_path, save):
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "oom", save=save, callbacks=[FailAt(gpu, 2)])
        run = train(trainer)
    assert shape(run.attempts) == [(32, 1, "oom", 2), (16, 2, "ok", 4)]
    if save == "no":  # restarted from the initial state: 16 x 2 for every step
        assert "restarted from the initial state" in run.attempts[1].reason
        plain = make(tmp_path, "plain")
        plain.train()
        expected_rows = [("train", 16)] * 8
    else:  # resumed from checkpoint-2: steps 0-1 under 32 x 1, steps 2-3 under 16 x 2
        assert "checkpoint-2" in run.attempts[1].reason
        plain = make(tmp_path, "plain", per=32, accum=1, save="steps", callbacks=[StopAt(2)])
        plain.train()
        plain.args.per_device_train_batch_size, plain.args.gradient_accumulation_steps = 16, 2
        plain._train_batch_size = 16  # the Trainer's cached copy (set at construction)
        plain.remove_callback(StopAt)
        plain.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))
        expected_rows = [("train", 32)] * 2 + [("train", 16)] * 4
    rows, tokens, pending, log = records(trainer)
    assert rows == expected_rows and tokens == 4 * 32 * SEQ and pending == {"train": [], "eval": []}
    # The log too: every loss, metric and step, exactly; the summary's train_loss is autofit's mean
    # over the whole run, where a plain resumed Trainer averages the resumed steps only.
    plain_log = records(plain)[3]
    summary, plain_summary = log[-1].pop("train_loss"), plain_log[-1].pop("train_loss")
    assert (rows, tokens, pending, log) == (*records(plain)[:3], plain_log)
    assert [e["step"] for e in log] == [1, 2, 3, 4, 4]
    assert all("train_micro_loss_mean" in e for e in log[:4])
    assert summary == pytest.approx(sum(e["loss"] for e in log[:4]) / 4, rel=1e-6)
    if save == "no":
        assert summary == plain_summary


def test_an_evaluation_retry_leaves_the_records_of_an_evaluation_without_it(tmp_path):
    runs = {}
    for name, fail, eval_batch in (("oom", True, 16), ("plain", False, 8)):
        with autofit.simulate_gpu("8MiB") as gpu:
            trainer = make(tmp_path, name, eval_dataset=Rows(32, seed=1), eval_strategy="steps", eval_steps=2,
                           per_device_eval_batch_size=eval_batch,
                           callbacks=[FailInEvaluation(gpu, 2)] if fail else [])
            run = train(trainer)
        runs[name] = (run, records(trainer))
    assert [(e.per_device_eval_batch_size, e.outcome, e.global_step) for e in runs["oom"][0].eval_attempts] == [
        (16, "oom", 2), (8, "ok", 2), (8, "ok", 4)]
    rows = runs["oom"][1][0]
    # The failed try's first batch of 16 is no record; two evaluations of 4 batches of 8 are.
    assert rows.count(("eval", 16)) == 0 and rows.count(("eval", 8)) == 8
    assert runs["oom"][1] == runs["plain"][1]


def test_records_are_found_by_kind_and_put_back_in_place():
    class Holder:
        pass
    trainer = Holder()
    trainer.state, trainer.control = Holder(), Holder()
    trainer.counts = {"a": [1, 2]}
    trainer.model = torch.nn.Linear(1, 1)  # an object: never a record
    trainer.state.log_history = [{"loss": 1.0}]
    alias = trainer.counts
    saved = hf_records.snapshot(trainer)
    trainer.counts["a"].append(3)
    trainer.counts["b"] = [0]  # a key the attempt added
    trainer.started = 7  # a record the attempt started
    trainer.model = torch.nn.Linear(2, 2)
    trainer.state.log_history.append({"loss": 2.0})
    saved.restore()
    assert trainer.counts == {"a": [1, 2]} and trainer.counts is alias
    assert not hasattr(trainer, "started")
    assert isinstance(trainer.model, torch.nn.Linear) and trainer.model.in_features == 2  # left as it is
    assert trainer.state.log_history == [{"loss": 1.0}]
    saved.restore()  # as often as needed
    assert trainer.counts == {"a": [1, 2]}
