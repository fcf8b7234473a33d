"""autofit.integrations.transformers: a Hugging Face Trainer fitted to a budget keeps its effective
batch; an OOM in training resumes from the last checkpoint on the same samples and ends at the same
global step with the same parameters; an OOM in evaluation shrinks only the evaluation batch.

Everything runs on CPU under a simulated GPU; OOMs are injected at an exact step with
`gpu.fail_at`, so the sequences of plans asserted here are exact.
"""

from __future__ import annotations

import logging
import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

import autofit
from autofit.integrations.hf_trainer import raw_optimizer, smaller_divisor
from autofit.integrations.transformers import evaluate, fit_trainer, train
from models import bert_batch, gpt2_batch, tiny_bert, tiny_gpt2

ROWS, SEQ = 64, 16


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are too small to gain from intra-op threads, and two threads competing with
    another process for 2 cores made the file 3x slower; one thread, then as before."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Rows(torch.utils.data.Dataset):
    """Rows of a tiny BERT classification batch; `without` drops fields (a dataset with no labels)."""

    def __init__(self, n=ROWS, seed=0, without=()):
        batch = bert_batch(n, SEQ, seed=seed)
        self.rows = [{k: v[i] for k, v in batch.items() if k not in without} for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Seen:
    """A collator recording which samples each training batch held, by attempt."""

    def __init__(self, dataset):
        self.index = {tuple(r["input_ids"].tolist()): i for i, r in enumerate(dataset.rows)}
        self.attempts: list[list[int]] = []

    def __call__(self, features):
        if self.attempts:  # inside an attempt (OnTrainBegin opened it)
            self.attempts[-1].extend(self.index[tuple(f["input_ids"].tolist())] for f in features)
        return default_data_collator(features)


class OnTrainBegin(TrainerCallback):
    def __init__(self, fn):
        self.fn = fn

    def on_train_begin(self, args, state, control, **kwargs):
        self.fn()


class FailAt(TrainerCallback):
    """Inject one OOM a few allocations after the start (or end) of global step `step`."""

    def __init__(self, gpu, step, when="begin", once=True):
        self.gpu, self.step, self.when, self.once = gpu, step, when, once

    def _arm(self, state):
        if self.step is not None and state.global_step == self.step:
            self.gpu.fail_at(self.gpu.allocation_count + 3)
            if self.once:
                self.step = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.when == "begin":
            self._arm(state)

    def on_step_end(self, args, state, control, **kwargs):
        if self.when == "end":
            self._arm(state)


class StopAt(TrainerCallback):
    """End training after global step `step` (its checkpoint is written first)."""

    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def make(tmp_path, name, per=16, accum=2, save="steps", dataset=None, callbacks=(), collator=None,
         eval_dataset=None, **extra):
    args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=per,
                             gradient_accumulation_steps=accum, num_train_epochs=2, save_strategy=save,
                             save_steps=1, report_to=[], use_cpu=True, logging_strategy="no",
                             disable_tqdm=True, seed=0, **extra)
    return Trainer(model=tiny_bert(), args=args, train_dataset=dataset if dataset is not None else Rows(),
                   eval_dataset=eval_dataset, data_collator=collator, callbacks=list(callbacks))


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def shape(attempts):
    return [(a.plan.micro_batch_size, a.plan.accumulation_steps, a.plan.precision, a.plan.checkpointing,
             a.outcome, a.step) for a in attempts]


def reference(tmp_path, per, accum):
    """An uninterrupted plain Trainer run; the Trainer's loss scaling fixed as autofit fixes it
    (BERT's classification loss ignores num_items_in_batch, huggingface/transformers#47688)."""
    trainer = make(tmp_path, f"ref-{per}x{accum}", per=per, accum=accum, save="no")
    trainer.model_accepts_loss_kwargs = False
    return trainer, trainer.train()


# -- (a) fit ------------------------------------------------------------------------------------

# The simulated GPU caps allocated bytes: the predicted peak against all of the budget (predicted:
# 8 x 4 0.92 MiB, 16 x 2 1.16 MiB, 32 x 1 1.87 MiB).
@pytest.mark.parametrize("budget, per, accum", [("1MiB", 8, 4), ("1.5MiB", 16, 2), ("2MiB", 32, 1)])
def test_fit_sets_batch_and_accumulation_keeping_the_effective_batch(tmp_path, budget, per, accum):
    trainer = make(tmp_path, "fit")  # 16 x 2: effective batch 32
    fitted = fit_trainer(trainer, budget=budget)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (per, accum)
    assert (fitted.per_device_train_batch_size, fitted.gradient_accumulation_steps) == (per, accum)
    assert trainer._train_batch_size == per  # the Trainer's cached copy follows
    assert fitted.effective_batch == 32 and fitted.plan.precision == "fp32" and not trainer.args.bf16
    assert fitted.predicted_peak <= autofit.parse_size(budget)


def test_fit_rounds_the_micro_batch_down_to_a_divisor(tmp_path):
    # 20 rows per step: the estimator's fastest fitting plan is 7 rows per micro-batch (3 micro-batches
    # cover 21 rows), which would make the effective batch 21; autofit takes 5 x 4, the largest divisor.
    trainer = make(tmp_path, "fit", per=10, accum=2)
    fitted = fit_trainer(trainer, budget="870KiB", precision="fp32")
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (5, 4)
    assert fitted.effective_batch == 20


def test_fit_without_a_budget_on_cpu_keeps_the_arguments(tmp_path):
    trainer = make(tmp_path, "fit")
    fitted = fit_trainer(trainer)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (16, 2)
    assert "no budget" in fitted.reason


def test_fit_with_an_estimator_that_fails_keeps_the_arguments_and_says_so(tmp_path, monkeypatch, caplog):
    from autofit.integrations import hf_trainer

    def broken(*args, **kwargs):
        raise RuntimeError("the estimator broke\nsecond line")
    monkeypatch.setattr(hf_trainer, "rank", broken)
    trainer = make(tmp_path, "fit")
    with caplog.at_level(logging.WARNING, logger="autofit"):
        fitted = fit_trainer(trainer, budget="1MiB")
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (16, 2)
    assert fitted.reason == "the estimator cannot follow the model: the TrainingArguments' batch kept"
    assert [r.getMessage() for r in caplog.records if "cannot estimate" in r.getMessage()] == [
        "capacity check: cannot estimate BertForSequenceClassification (RuntimeError: the estimator broke); "
        "the TrainingArguments' batch kept; the ladder steps down on an out-of-memory error"]


@pytest.mark.parametrize("rows, current, floor, expected", [
    (32, 32, 8, 16), (32, 16, 8, 8), (32, 8, 8, None),  # halving, down to the floor
    (24, 12, 8, 8),     # halving gives 6, below the floor: the floor, a divisor
    (30, 15, 8, 10),    # 15 // 2 < 8 and 8 does not divide 30: the smallest divisor above, 10
    (20, 10, 8, None),  # no divisor of 20 in [8, 10)
    (20, 10, 1, 5), (12, 3, 1, 1), (7, 7, 1, 1), (1, 1, 1, None),
])
def test_the_ladder_halves_to_divisors_of_the_rows_per_step(rows, current, floor, expected):
    assert smaller_divisor(rows, current, floor) == expected


# -- (b) OOM in training ------------------------------------------------------------------------

def test_oom_mid_training_resumes_from_the_last_checkpoint_on_the_same_samples(tmp_path):
    data = Rows()
    seen = Seen(data)
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "run", dataset=data, collator=seen,
                       callbacks=[FailAt(gpu, 2), OnTrainBegin(lambda: seen.attempts.append([]))])
        run = train(trainer)
    # Fitted to one micro-batch of 32; the OOM at global step 2 steps down to 16 x 2, resumed from
    # checkpoint-2 (saved by this call) and finished the 4 steps of 2 epochs.
    assert shape(run.attempts) == [(32, 1, "fp32", False, "oom", 2), (16, 2, "fp32", False, "ok", 4)]
    assert "checkpoint-2" in run.attempts[1].reason
    assert run.global_step == 4 and run.plan.effective_batch == 32
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (16, 2)

    # The same samples as an uninterrupted run: the resumed attempt starts at sample 2 x 32.
    plain_seen = Seen(data)
    plain = make(tmp_path, "plain", save="no", dataset=data, collator=plain_seen,
                 callbacks=[OnTrainBegin(lambda: plain_seen.attempts.append([]))])
    plain.model_accepts_loss_kwargs = False
    assert plain.train().global_step == 4
    uninterrupted = plain_seen.attempts[0]
    assert seen.attempts[1] == uninterrupted[2 * 32:]
    assert seen.attempts[0][:2 * 32] == uninterrupted[:2 * 32]

    # Parameters: those of an uninterrupted run of the step-down plan (and of the first plan). Steps 0-1
    # ran as one micro-batch of 32 instead of two of 16: only the fp32 summation order differs
    # (measured ~4e-9); 1e-6 is the design's bound for the same mathematics.
    ref, out = reference(tmp_path, 16, 2)
    assert out.global_step == 4
    assert max_diff(params(trainer), params(ref)) <= 1e-6
    assert max_diff(params(trainer), params(plain)) <= 1e-6


def test_oom_before_any_checkpoint_restarts_from_the_initial_weights(tmp_path):
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "run", save="no", callbacks=[FailAt(gpu, 2)])
        run = train(trainer)
    assert shape(run.attempts) == [(32, 1, "fp32", False, "oom", 2), (16, 2, "fp32", False, "ok", 4)]
    assert "restarted from the initial state" in run.attempts[1].reason
    ref, _ = reference(tmp_path, 16, 2)
    assert max_diff(params(trainer), params(ref)) <= 1e-6  # two steps were not applied twice


def test_the_trainers_ladder_is_given_the_rows_per_step_as_the_global_batch(tmp_path, monkeypatch):
    from autofit.integrations import transformers as integration
    given, real = [], integration._ladder

    class Recording(autofit.plans.ladder.Move):
        def __init__(self, inner):
            self.inner = inner

        def take(self, plan, global_batch=None):
            given.append((plan.micro_batch_size, plan.accumulation_steps, global_batch))
            return self.inner.take(plan, global_batch)

    monkeypatch.setattr(integration, "_ladder", lambda *args: Recording(real(*args)))
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "run", save="no", max_steps=2, callbacks=[FailAt(gpu, 1)])
        run = train(trainer)
    assert shape(run.attempts) == [(32, 1, "fp32", False, "oom", 1), (16, 2, "fp32", False, "ok", 2)]
    assert given == [(32, 1, 32)]


def test_ladder_goes_to_bf16_below_eight_rows_per_micro_batch(tmp_path):
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "run", per=8, accum=1, max_steps=3, callbacks=[FailAt(gpu, 1)])
        run = train(trainer)
    # 8 rows cannot be halved above the floor of 8: bf16 autocast comes first, as in the default ladder.
    assert shape(run.attempts) == [(8, 1, "fp32", False, "oom", 1), (8, 1, "bf16", False, "ok", 3)]
    assert trainer.args.bf16 and trainer.accelerator.native_amp  # a new Accelerator autocasts
    assert run.plan.effective_batch == 8


def warm_optimizer(trainer):
    """A user's AdamW that has already taken one step (a two-phase fine-tune's second phase)."""
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=5e-5)
    trainer.model(**bert_batch(4, SEQ, seed=2)).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    trainer.optimizer = optimizer
    return optimizer


def test_a_users_optimizer_restarts_with_its_own_state(tmp_path):
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "run", save="no", callbacks=[FailAt(gpu, 2)])
        optimizer = warm_optimizer(trainer)
        run = train(trainer)
    assert shape(run.attempts) == [(32, 1, "fp32", False, "oom", 2), (16, 2, "fp32", False, "ok", 4)]
    assert raw_optimizer(trainer.optimizer) is optimizer  # the same object, its state put back
    assert optimizer.state[next(trainer.model.parameters())]["step"].item() == 1 + 4
    ref = make(tmp_path, "ref", per=16, accum=2, save="no")
    warm_optimizer(ref)
    ref.model_accepts_loss_kwargs = False
    ref.train()
    assert max_diff(params(trainer), params(ref)) <= 1e-6


# -- (c) OOM in evaluation ----------------------------------------------------------------------

def test_oom_in_evaluation_during_training_halves_only_the_evaluation_batch(tmp_path):
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "run", eval_dataset=Rows(32, seed=1), eval_strategy="steps", eval_steps=2,
                       per_device_eval_batch_size=16, callbacks=[FailAt(gpu, 2, when="end")])
        run = train(trainer)
    assert shape(run.attempts) == [(32, 1, "fp32", False, "ok", 4)]
    assert [(e.per_device_eval_batch_size, e.outcome, e.global_step) for e in run.eval_attempts] == [
        (16, "oom", 2), (8, "ok", 2), (8, "ok", 4)]
    assert trainer.args.per_device_eval_batch_size == 8
    assert trainer.args.per_device_train_batch_size == 32  # the training batch never moved
    assert "evaluate" not in vars(trainer)  # the guard is gone
    assert "the training plan untouched" in autofit.explain(run)


def test_an_evaluation_that_fits_nowhere_stops_without_touching_the_training_batch(tmp_path):
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "run", eval_dataset=Rows(8, seed=1), eval_strategy="steps", eval_steps=2,
                       per_device_eval_batch_size=2)
        loader = trainer.get_eval_dataloader

        def failing_loader(*args, **kwargs):  # every evaluation runs out of memory
            gpu.fail_at(gpu.allocation_count + 3)
            return loader(*args, **kwargs)
        trainer.get_eval_dataloader = failing_loader
        with pytest.raises(autofit.DoesNotFit, match="evaluation of one row per device") as caught:
            train(trainer)
    assert [(e.per_device_eval_batch_size, e.outcome, e.global_step) for e in caught.value.attempts] == [
        (2, "oom", 2), (1, "oom", 2)]
    assert trainer.args.per_device_train_batch_size == 32 and trainer.state.global_step == 2
    assert "evaluation batch 0: 2 rows ran out of memory" in autofit.explain(caught.value)


def test_evaluate_alone_halves_the_evaluation_batch(tmp_path):
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "eval", eval_dataset=Rows(32, seed=1), per_device_eval_batch_size=32)
        gpu.fail_at(gpu.allocation_count + 3)
        result = evaluate(trainer)
    assert [(e.per_device_eval_batch_size, e.outcome) for e in result.attempts] == [(32, "oom"), (16, "ok")]
    assert trainer.args.per_device_eval_batch_size == 16 and trainer.args.per_device_train_batch_size == 16
    assert "eval_loss" in result.metrics


# -- (d) bad input ------------------------------------------------------------------------------

def test_a_model_without_loss_is_refused_with_what_to_do(tmp_path):
    trainer = make(tmp_path, "bad", dataset=Rows(without=("labels",)))
    with pytest.raises(ValueError, match=r"returns no loss .*\['attention_mask', 'input_ids'\].*"
                                         r"no \['labels'\].*label_names"):
        fit_trainer(trainer, budget="8MiB")


def test_a_budget_too_small_says_what_is_needed(tmp_path):
    trainer = make(tmp_path, "bad")
    with pytest.raises(autofit.DoesNotFit, match=r"no plan fits 32 rows .*effective batch 32.*"
                                                 r"parameters.* alone need .* of a 128.00 KiB budget"):
        fit_trainer(trainer, budget="128KiB")
    assert trainer.args.per_device_train_batch_size == 16  # nothing was changed


@pytest.mark.parametrize("call, error, match", [
    (lambda t: fit_trainer(t, precision="fp8"), ValueError, r"precision must be one of auto, fp32, bf16, fp16 but got 'fp8'"),
    (lambda t: fit_trainer(t.model), TypeError, r"must be a transformers.Trainer but got BertFor"),
    (lambda t: fit_trainer(t, budget="lots"), ValueError, r"lots"),
    (lambda t: train(t, trial={"lr": 1}), ValueError, r"trial"),
])
def test_bad_arguments(tmp_path, call, error, match):
    with pytest.raises(error, match=match):
        call(make(tmp_path, "bad"))


def test_auto_find_batch_size_is_refused(tmp_path):
    trainer = make(tmp_path, "bad", auto_find_batch_size=True)
    with pytest.raises(ValueError, match=r"auto_find_batch_size=True\).* effective batch"):
        train(trainer)


def test_an_exhausted_ladder_raises_does_not_fit_with_every_plan(tmp_path):
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "run", per=1, accum=1, callbacks=[FailAt(gpu, 0, once=False)])
        with pytest.raises(autofit.DoesNotFit, match="no plan of the ladder fits") as caught:
            train(trainer)
    assert shape(caught.value.attempts) == [(1, 1, "fp32", False, "oom", 0), (1, 1, "bf16", False, "oom", 0),
                                            (1, 1, "bf16", True, "oom", 0)]


def test_loss_scaling_is_fixed_only_for_heads_that_ignore_the_item_count(tmp_path):
    bert = make(tmp_path, "bert")
    assert fit_trainer(bert).notes and bert.model_accepts_loss_kwargs is False  # huggingface/transformers#47688
    batch = gpt2_batch(16, SEQ)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path / "gpt2"), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, report_to=[], use_cpu=True)
    gpt2 = Trainer(model=tiny_gpt2(), args=args, train_dataset=rows)
    # GPT-2's loss divides by num_items_in_batch: the Trainer's own scaling is right and kept.
    assert fit_trainer(gpt2).notes == () and gpt2.model_accepts_loss_kwargs is True


def test_the_trainers_own_clipping_still_acts_after_a_step_down(tmp_path, monkeypatch):
    from accelerate import Accelerator
    clip = Accelerator.clip_grad_norm_  # what the Trainer calls (accelerate >= 1.16 no longer goes
    clipped = []  # through torch.nn.utils.clip_grad_norm_); (max_norm, norm before clipping) of each

    def recording(self, parameters, max_norm, *args, **kwargs):
        norm = clip(self, parameters, max_norm, *args, **kwargs)
        clipped.append((max_norm, norm.item()))
        return norm
    monkeypatch.setattr(Accelerator, "clip_grad_norm_", recording)
    with autofit.simulate_gpu("8MiB") as gpu:
        trainer = make(tmp_path, "run", callbacks=[FailAt(gpu, 2)], max_grad_norm=0.01)
        run = train(trainer)
    assert shape(run.attempts) == [(32, 1, "fp32", False, "oom", 2), (16, 2, "fp32", False, "ok", 4)]
    # Steps 0-1 under 32 x 1; the OOM at step 2 resumed steps 2-3 under 16 x 2: each step clipped
    # to the Trainer's 0.01 (the norms are above it, so every clip acted).
    assert [m for m, _ in clipped] == [0.01] * 4 and min(n for _, n in clipped) > 0.01
    # The plain Trainer with the same splits: 32 x 1 for steps 0-1 (stopped after its checkpoint at
    # step 2), resumed from that checkpoint under 16 x 2. It computes what the recovered run computes,
    # so its clips and parameters are equal bit for bit on any CPU.
    first = make(tmp_path, "same", per=32, accum=1, max_grad_norm=0.01, callbacks=[StopAt(2)])
    first.model_accepts_loss_kwargs = False
    first.train()
    same = make(tmp_path, "same", per=16, accum=2, max_grad_norm=0.01)
    same.model_accepts_loss_kwargs = False
    same.train(resume_from_checkpoint=str(tmp_path / "same" / "checkpoint-2"))
    assert clipped[4:8] == clipped[0:4]
    assert max_diff(params(trainer), params(same)) == 0.0
    # An uninterrupted 16 x 2 run split steps 0-1 differently: the guarantee's tolerance, not bits
    # (its steps 0-1 sum the gradient in another order, and the clips after differ in the last ulp).
    ref = make(tmp_path, "ref", per=16, accum=2, save="no", max_grad_norm=0.01)
    ref.model_accepts_loss_kwargs = False
    ref.train()
    assert [n for _, n in clipped[10:12]] == pytest.approx([n for _, n in clipped[2:4]], rel=1e-6)
    assert max_diff(params(trainer), params(ref)) <= 1e-6


# -- (e) reports are what happened ---------------------------------------------------------------

def with_dropout(trainer, p=0.1):
    for module in trainer.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
    return trainer


def test_an_evaluation_retry_leaves_the_training_as_a_run_without_the_oom(tmp_path):
    runs = {}
    for name, fail in (("oom", True), ("plain", False)):
        with autofit.simulate_gpu("8MiB") as gpu:
            trainer = with_dropout(make(tmp_path, name, save="no", eval_dataset=Rows(32, seed=1),
                                        eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=16,
                                        callbacks=[FailAt(gpu, 2, when="end")] if fail else []))
            runs[name] = (train(trainer), params(trainer))
    assert [(e.per_device_eval_batch_size, e.outcome, e.global_step) for e in runs["oom"][0].eval_attempts] == [
        (16, "oom", 2), (8, "ok", 2), (8, "ok", 4)]
    # The retry's evaluation loader drew its seed from torch's generator as the first try did: steps 3
    # and 4 draw the same dropout masks as without the OOM (before: 1.18e-3 apart).
    assert max_diff(runs["oom"][1], runs["plain"][1]) == 0.0
    assert runs["oom"][0].output.training_loss == runs["plain"][0].output.training_loss


def test_the_training_peak_is_reported_whether_evaluation_runs_or_not(tmp_path):
    peaks = {}
    for name, extra in (("eval", dict(eval_dataset=Rows(8, seed=1), eval_strategy="steps", eval_steps=1,
                                      per_device_eval_batch_size=2)), ("none", {})):
        with autofit.simulate_gpu("8MiB"):
            run = train(make(tmp_path, name, save="no", **extra))
        peaks[name] = (run.attempts[0].peak_bytes, [e.peak_bytes for e in run.eval_attempts])
    training, evaluations = peaks["eval"]
    assert len(evaluations) == 4 and max(evaluations) < training  # each evaluation its own peak
    assert training == peaks["none"][0]


def test_after_a_resume_the_loss_and_the_log_cover_the_whole_run(tmp_path):
    runs = {}
    for name, fail in (("oom", True), ("plain", False)):
        with autofit.simulate_gpu("8MiB") as gpu:
            trainer = make(tmp_path, name, eval_dataset=Rows(16, seed=1), eval_strategy="steps", eval_steps=1,
                           per_device_eval_batch_size=16, callbacks=[FailAt(gpu, 3)] if fail else [])
            runs[name] = (train(trainer), trainer.state.log_history)
    run, log = runs["oom"]
    plain, plain_log = runs["plain"]
    assert shape(run.attempts) == [(32, 1, "fp32", False, "oom", 3), (16, 2, "fp32", False, "ok", 4)]
    assert "checkpoint-3" in run.attempts[1].reason
    # The mean over all 4 steps, not over step 4 alone (the attempt that resumed trained only it):
    # the two runs differ only in the fp32 summation order of step 4's micro-batches.
    assert run.output.training_loss == pytest.approx(plain.output.training_loss, abs=1e-6)
    assert run.output.metrics["train_loss"] == run.output.training_loss
    assert [(e["step"], sorted(k for k in e if k.endswith("loss"))) for e in log] == \
        [(e["step"], sorted(k for k in e if k.endswith("loss"))) for e in plain_log] == \
        [(1, ["eval_loss"]), (2, ["eval_loss"]), (3, ["eval_loss"]), (4, ["eval_loss"]), (4, ["train_loss"])]
    assert [e["eval_loss"] for e in log[:4]] == pytest.approx([e["eval_loss"] for e in plain_log[:4]], abs=1e-6)
    assert log[-1]["train_loss"] == run.output.training_loss


def test_does_not_fit_from_the_trainer_says_what_applies_to_the_trainer(tmp_path):
    trainer = make(tmp_path, "bad")
    with pytest.raises(autofit.DoesNotFit) as caught:
        fit_trainer(trainer, budget="300KiB")  # parameters and gradients fit, AdamW's state does not
    message = str(caught.value)
    assert "parameters, gradients and AdamW state alone need 379.50 KiB of a 300.00 KiB budget" in message
    assert ("use a smaller model or an optimizer with less state (the Trainer has no optimizer offload outside "
            "DeepSpeed; TrainingArguments(optim='adafactor') keeps a factored second moment") in message
    assert "offload the optimizer" not in message


def test_the_refusal_of_auto_find_batch_size_says_what_the_trainer_does(tmp_path):
    with pytest.raises(ValueError) as caught:
        train(make(tmp_path, "bad", auto_find_batch_size=True))
    assert str(caught.value) == (
        "TrainingArguments(auto_find_batch_size=True) multiplies per_device_train_batch_size by 0.9 after "
        "each out-of-memory error (Accelerate's find_executable_batch_size) and keeps "
        "gradient_accumulation_steps, so it changes the effective batch; set auto_find_batch_size=False and "
        "let autofit keep it.")
