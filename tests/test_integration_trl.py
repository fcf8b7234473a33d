"""TRL's SFTTrainer through autofit.integrations.transformers: it trains, saves checkpoints and resumes,
and ends with the parameters and the log of TRL's own run at the same splits, exactly. SFTTrainer's
compute_loss keeps records (a token count, entropy and token accuracy waiting to be logged); the
capacity check's estimate and a replayed attempt leave no trace on them (hf_records).

Tiny random-init GPT-2, a tiny in-memory `datasets.Dataset` of token ids and a word-level tokenizer
built here: nothing is downloaded. OOMs are injected at an exact step on a simulated GPU.
"""

from __future__ import annotations

import json
import math

import pytest

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402

import autofit  # noqa: E402
from autofit.integrations.transformers import fit_trainer, train  # noqa: E402
from test_integration_transformers import StopAt  # noqa: E402

VOCAB, SEQ, ROWS = 100, 8, 32
BUDGET = "64MiB"  # the estimator's fastest plan is the whole batch of 16
TIMING = ("_runtime", "_per_second")


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token=f"t{VOCAB - 2}",
                                   eos_token=f"t{VOCAB - 1}")


def dataset():
    ids = torch.randint(1, VOCAB - 3, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=16,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=VOCAB - 1,
                                      eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2))


def sft(tmp_path, name, per=16, accum=1, steps=4, save_steps=2, callbacks=(), **extra):
    options = dict(bf16=False, gradient_checkpointing=False)  # SFTConfig's defaults are True: see docs/trainer.md
    options.update(extra)
    args = trl.SFTConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=per,
                         gradient_accumulation_steps=accum, max_steps=steps, save_strategy="steps",
                         save_steps=save_steps, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                         seed=0, **options)
    return trl.SFTTrainer(model=model(), args=args, train_dataset=dataset(), processing_class=tokenizer(),
                          callbacks=list(callbacks))


class FailAt(TrainerCallback):
    """One OOM a few allocations after global step `step` begins, or (`late`) in its backward pass,
    after compute_loss has recorded its tokens and metrics (armed when the last block's gradient is made)."""

    def __init__(self, gpu, step, late=False):
        self.gpu, self.step, self.late, self.armed, self.hooked = gpu, step, late, False, False

    def _fail(self, *_):
        if self.armed:
            self.armed = False
            self.gpu.fail_at(self.gpu.allocation_count + 1)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.late and not self.hooked:
            model.transformer.h[-1].mlp.c_proj.weight.register_hook(self._fail)
            self.hooked = True

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.step, self.armed = None, True
            if not self.late:
                self._fail()


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def log(trainer):
    """The log without its timings, checked to hold plain numbers only (JSON, as a checkpoint writes it)."""
    entries = [{k: v for k, v in e.items() if not k.endswith(TIMING)} for e in trainer.state.log_history]
    assert all(type(v) in (int, float) and math.isfinite(v) for e in entries for v in e.values()), entries
    json.dumps(entries)
    return entries


def shape(attempts):
    return [(a.plan.micro_batch_size, a.plan.accumulation_steps, a.plan.precision, a.outcome, a.step)
            for a in attempts]


def test_the_estimate_leaves_sft_trainers_records_as_they_were(tmp_path):
    trainer = sft(tmp_path, "fit")
    fitted = fit_trainer(trainer, budget=BUDGET, precision="fp32")
    assert (fitted.per_device_train_batch_size, fitted.gradient_accumulation_steps) == (16, 1)
    # Before: the token count became a symbol (SymInt) and five 0.0 joined entropy and token accuracy.
    assert trainer._total_train_tokens == 0 and type(trainer._total_train_tokens) is int
    assert all(not values for values in trainer._metrics["train"].values())
    assert trainer.state.log_history == []


def test_sft_trainer_after_an_oom_ends_as_trls_own_run_at_the_final_split(tmp_path):
    with autofit.simulate_gpu(BUDGET) as gpu:
        trainer = sft(tmp_path, "oom", steps=2, callbacks=[FailAt(gpu, 1)])
        run = train(trainer, precision="fp32")
    # No checkpoint before step 2: the restart from the initial state trains every step as 8 x 2,
    # and its checkpoint-2 is written (before: a SymFloat in the log made save_to_json fail).
    assert shape(run.attempts) == [(16, 1, "fp32", "oom", 1), (8, 2, "fp32", "ok", 2)]
    assert "restarted from the initial state" in run.attempts[1].reason
    assert (tmp_path / "oom" / "checkpoint-2" / "trainer_state.json").is_file()
    plain = sft(tmp_path, "plain", per=8, accum=2, steps=2)
    plain.train()
    assert same(params(trainer), params(plain))
    assert log(trainer) == log(plain)  # loss, grad_norm, entropy, token accuracy, num_tokens, exactly
    assert [e.get("num_tokens") for e in log(trainer)] == [16.0 * SEQ, 32.0 * SEQ, None]
    assert trainer._total_train_tokens == plain._total_train_tokens == 2 * 16 * SEQ


def test_sft_trainer_resumed_from_a_checkpoint_ends_as_trls_own_resume(tmp_path):
    # TRL's own run to checkpoint-2 (a resumed run saves every save_steps of the checkpoint's state)
    first = sft(tmp_path, "first", save_steps=1, callbacks=[StopAt(2)])
    first.train()
    origin = str(tmp_path / "first" / "checkpoint-2")
    with autofit.simulate_gpu(BUDGET) as gpu:
        trainer = sft(tmp_path, "resumed", save_steps=1, callbacks=[FailAt(gpu, 3, late=True)])
        run = train(trainer, precision="fp32", resume_from_checkpoint=origin)
    # Step 3 under 16 x 1 (from the user's checkpoint-2); the OOM in step 4's backward (its tokens
    # and metrics already recorded) resumed from this call's checkpoint-3 as 8 x 2.
    assert shape(run.attempts) == [(16, 1, "fp32", "oom", 3), (8, 2, "fp32", "ok", 4)]
    assert "checkpoint-3" in run.attempts[1].reason
    # TRL's own: one trainer resumed from checkpoint-2 to step 3, then from its checkpoint-3 as 8 x 2.
    plain = sft(tmp_path, "plain", save_steps=1, callbacks=[StopAt(3)])
    plain.train(resume_from_checkpoint=origin)
    plain.args.per_device_train_batch_size, plain.args.gradient_accumulation_steps = 8, 2
    plain._train_batch_size = 8  # the Trainer's cached copy of the batch size, set at construction
    plain.remove_callback(StopAt)
    plain.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-3"))
    assert same(params(trainer), params(plain))
    ours, theirs = log(trainer), log(plain)
    # autofit's summary averages every step the call trained (3 and 4); TRL's resumed call, step 4 only.
    summary, _ = ours[-1].pop("train_loss"), theirs[-1].pop("train_loss")
    assert ours == theirs and [e["step"] for e in ours] == [1, 2, 3, 4, 4]
    assert summary == pytest.approx((ours[2]["loss"] + ours[3]["loss"]) / 2, rel=1e-6)
    assert trainer._total_train_tokens == plain._total_train_tokens == 2 * 16 * SEQ  # steps 3 and 4


def test_sft_configs_bf16_and_checkpointing_are_read_as_the_users(tmp_path):
    # SFTConfig turns both on by default; autofit cannot tell a default from a choice and keeps them,
    # as it keeps any TrainingArguments' flags. precision= or the flags themselves say otherwise.
    trainer = sft(tmp_path, "defaults", bf16=None, gradient_checkpointing=True)
    assert trainer.args.bf16 and trainer.args.gradient_checkpointing
    fitted = fit_trainer(trainer, budget=BUDGET)
    assert (fitted.plan.precision, fitted.plan.checkpointing) == ("bf16", True)
    fitted = fit_trainer(sft(tmp_path, "fp32", bf16=None, gradient_checkpointing=True), budget=BUDGET,
                         precision="fp32")
    assert (fitted.plan.precision, fitted.plan.checkpointing) == ("fp32", True)
