import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertModel, GPT2Config, GPT2LMHeadModel

import autofit
from autofit.gpu.device import open_device
from autofit.errors import DoesNotFit
from autofit.recipes.eval_data import check_eval_data
from autofit.recipes.evaluate import EvalResult, MetricError, evaluate
from autofit.recipes.eval_sizer import EvalAttempt, EvalSizer
from autofit.plans.plan import Plan
from autofit.engine.step import NoLossError, StepRunner

BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
            vocab_size=100, max_position_embeddings=64, hidden_dropout_prob=0,
            attention_probs_dropout_prob=0)


def tiny_bert(cls=BertForSequenceClassification):
    torch.manual_seed(0)
    return cls(BertConfig(**BERT))


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0,
                                      eos_token_id=0))


def bert_batch(n, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 100, (n, seq), generator=g),
            "attention_mask": torch.ones(n, seq, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,), generator=g)}


class Rows(torch.utils.data.Dataset):
    """A map-style dataset over the rows of one batch dict."""

    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return len(next(iter(self.batch.values())))

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


class Picky(torch.nn.Module):
    """Runs its inner model, but 'runs out of memory' above `limit` tokens (rows x sequence length)."""

    def __init__(self, inner, limit, fail_calls=()):
        super().__init__()
        self.inner, self.limit, self.fail_calls, self.seen = inner, limit, set(fail_calls), []

    def forward(self, **batch):
        rows, seq = batch["input_ids"].shape
        self.seen.append(rows)
        if rows * seq > self.limit or len(self.seen) - 1 in self.fail_calls:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({rows} rows)")
        return self.inner(**batch)


def plain_loss(model, batch):
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(**batch).loss.item()
    model.train(was)
    return out


def accuracy(output, batch):
    return {"accuracy": (output.logits.argmax(-1) == batch["labels"]).float().mean()}


def sizes(attempts):
    return [(a.batch_size, a.outcome, a.batch) for a in attempts]


# -- same mathematics -----------------------------------------------------------------------------

def test_loss_and_metric_equal_a_plain_loop_with_an_uneven_last_batch():
    model = tiny_bert()
    full = bert_batch(23)
    expected = plain_loss(model, full)
    with torch.no_grad():
        model.eval()
        expected_acc = (model(**full).logits.argmax(-1) == full["labels"]).float().mean().item()
        model.train()
    result = evaluate(model, Rows(full), batch_size=5, metric_fn=accuracy)  # 5, 5, 5, 5, 3 rows
    assert abs(result.loss - expected) <= 1e-6
    assert result.samples == 23 and result.batch_size == 5
    assert sizes(result.attempts) == [(5, "ok", 0)]
    assert result.attempts[0].reason == "start: batch_size=5"
    assert set(result.metrics) == {"accuracy"}
    assert abs(result.metrics["accuracy"] - expected_acc) <= 1e-7
    assert round(result.metrics["accuracy"] * 23) == 12  # 12 of 23 right


def test_token_level_loss_is_weighted_by_label_tokens():
    model = tiny_gpt2()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 100, (11, 8), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1] = -100          # a row without any label token
    labels[4, 5:] = -100
    labels[9, 2:] = -100      # only its first label (never counted: shifted out) is left
    expected = plain_loss(model, {"input_ids": ids, "labels": labels})
    batches = [{"input_ids": ids[i:i + 4], "labels": labels[i:i + 4]} for i in range(0, 11, 4)]  # 4, 4, 3
    result = evaluate(model, batches, batch_size=2)  # micro-batches 2,2 | 2,2 | 2,1
    assert abs(result.loss - expected) <= 1e-6
    assert result.samples == 11 and result.batch_size == 2
    assert sizes(result.attempts) == [(2, "ok", 0)]
    # the micro-batch holding only row 1 (no label token, a NaN loss) weighs nothing
    single = evaluate(model, batches, batch_size=1)
    assert abs(single.loss - expected) <= 1e-6


def test_evaluation_batch_three_times_the_training_micro_batch_fits_where_training_barely_fits():
    model = tiny_bert()
    train, held_out = bert_batch(8, seq=32, seed=3), bert_batch(24, seq=32, seed=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**train).loss.backward()
    optimizer.step()                     # the optimizer state exists, as after a first training step
    optimizer.zero_grad(set_to_none=True)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]

    def training_step_peak(gpu, device):
        gpu.track(state)
        device.place_model(model)
        runner = StepRunner(model, optimizer, device)
        runner.run(train, Plan(8))
        return runner, runner.attempt_peak()

    with autofit.simulate_gpu() as gpu, open_device() as device:   # measure a training step of 8
        peak = training_step_peak(gpu, device)[1]
    budget = peak + 4096
    with autofit.simulate_gpu(budget) as gpu, open_device() as device:
        runner, again = training_step_peak(gpu, device)   # training micro-batch 8 fits, 4 KiB to spare
        assert again == peak
        before = gpu.memory_allocated()
        result = evaluate(model, [held_out], device=device, start_batch_size=3 * 8)
        assert gpu.memory_allocated() == before
        assert sizes(result.attempts) == [(24, "ok", 0)]
        assert result.batch_size == 24 and result.attempts[0].peak_bytes <= budget
    assert abs(result.loss - plain_loss(model, held_out)) <= 1e-6
    with autofit.simulate_gpu(budget) as gpu, open_device() as device:
        runner = training_step_peak(gpu, device)[0]
        with pytest.raises(torch.OutOfMemoryError):   # while training on 24 rows does not fit,
            runner.run(held_out, Plan(24))
        runner.abandon()
        with pytest.raises(torch.OutOfMemoryError):   # nor does the report's validation with autograd on
            model(**device.to_device(held_out))


# -- the evaluation ladder ------------------------------------------------------------------------

def test_oom_halves_the_evaluation_batch_with_exact_sizes_and_the_same_result():
    inner = tiny_bert()
    data = Rows(bert_batch(24))
    whole = evaluate(inner, data, batch_size=24).loss
    expected = evaluate(inner, data, batch_size=3).loss
    assert abs(whole - expected) <= 1e-6
    model = Picky(inner, limit=5 * 16)
    sizer = EvalSizer()
    result = evaluate(model, data, batch_size=24, sizer=sizer)
    assert sizes(result.attempts) == [(24, "oom", 0), (12, "oom", 0), (6, "oom", 0), (3, "ok", 0)]
    assert [a.reason for a in result.attempts] == [
        "start: batch_size=24", "halved after 24 rows ran out of memory",
        "halved after 12 rows ran out of memory", "halved after 6 rows ran out of memory"]
    assert result.attempts[0].error == "CUDA out of memory. Tried to allocate 2.00 GiB (24 rows)"
    assert model.seen == [24, 12, 6] + [3] * 8
    assert result.loss == expected
    assert (result.samples, result.batch_size) == (24, 3)
    assert (sizer.size, sizer.fits, sizer.fails) == (3, 3, 6)
    # the next call (the next epoch) starts where this one settled and never tries 24 again
    model.seen.clear()
    again = evaluate(model, data, batch_size=24, start_batch_size=24, sizer=sizer)
    assert sizes(again.attempts) == [(3, "ok", 0)]
    assert again.attempts[0].reason == ("kept: 3 rows, the evaluation batch of an earlier evaluation "
                                        "(below 6 rows, known to fail)")
    assert model.seen == [3] * 8 and again.loss == expected


def test_a_size_known_to_fail_is_never_tried():
    inner = tiny_bert()
    model = Picky(inner, limit=10_000)
    result = evaluate(model, Rows(bert_batch(12)), start_batch_size=8, sizer=EvalSizer(fails=6))
    assert sizes(result.attempts) == [(5, "ok", 0)]
    assert model.seen == [5, 5, 2]


def test_oom_in_a_later_batch_replays_only_its_rows():
    inner = tiny_bert()
    short, long = bert_batch(10, seq=8, seed=5), bert_batch(10, seq=16, seed=6)
    expected = (plain_loss(inner, short) * 10 + plain_loss(inner, long) * 10) / 20
    model = Picky(inner, limit=100)          # 10 x 8 fits, 10 x 16 does not, 5 x 16 does
    result = evaluate(model, [short, long])  # each batch as the data yields it
    assert sizes(result.attempts) == [(10, "ok", 0), (10, "oom", 1), (5, "ok", 1)]
    assert result.attempts[0].reason == "start: each batch as the data yields it"
    assert [a.first_sample for a in result.attempts] == [0, 10, 10]
    assert model.seen == [10, 10, 5, 5]
    assert abs(result.loss - expected) <= 1e-6
    assert (result.samples, result.batch_size) == (20, 5)


def test_oom_inside_a_batch_resumes_at_the_rows_that_failed():
    inner = tiny_bert()
    batch = bert_batch(10, seed=10)
    model = Picky(inner, limit=10_000, fail_calls={1})  # the second forward (rows 4-7) fails once
    result = evaluate(model, [batch], batch_size=4)
    assert sizes(result.attempts) == [(4, "ok", 0), (4, "oom", 0), (2, "ok", 0)]
    assert [a.first_sample for a in result.attempts] == [0, 4, 4]
    assert model.seen == [4, 4, 2, 2, 2]   # rows 0-3 are not evaluated twice
    assert (result.samples, result.batch_size) == (10, 2)
    assert abs(result.loss - plain_loss(inner, batch)) <= 1e-6


def test_a_real_simulated_oom_is_released_and_the_result_is_the_same():
    model = tiny_bert()
    data = [bert_batch(24, seq=32, seed=7)]
    expected = evaluate(model, data).loss
    with autofit.simulate_gpu() as gpu, open_device() as device:
        device.place_model(model)
        at_12 = evaluate(model, data, device=device, start_batch_size=12).attempts[0].peak_bytes
        at_24 = evaluate(model, data, device=device).attempts[0].peak_bytes
    assert at_12 < at_24
    with autofit.simulate_gpu((at_12 + at_24) // 2) as gpu, open_device() as device:
        device.place_model(model)
        before = gpu.memory_allocated()
        result = evaluate(model, data, device=device)
        assert gpu.memory_allocated() == before
    assert sizes(result.attempts) == [(24, "oom", 0), (12, "ok", 0)]
    assert result.attempts[0].error.startswith("CUDA out of memory. Tried to allocate")
    assert abs(result.loss - expected) <= 1e-6


def test_one_row_that_does_not_fit_raises_does_not_fit_and_restores_the_mode():
    model = Picky(tiny_bert(), limit=0)
    model.train()
    with pytest.raises(DoesNotFit, match=r"evaluation ran out of memory with a batch of 1 row \(batch 0, "
                                         r"sample 0\)") as info:
        evaluate(model, Rows(bert_batch(4)), batch_size=4)
    assert [(a.batch_size, a.outcome) for a in info.value.attempts] == [(4, "oom"), (2, "oom"), (1, "oom")]
    assert model.training and model.inner.training


# -- evaluation never trains ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["train", "eval"])
def test_mode_restored_parameters_unchanged_no_gradients(mode):
    model = tiny_bert()
    getattr(model, mode)()
    model.bert.embeddings.train(mode == "eval")  # a submodule in the other mode stays so
    modes = {name: m.training for name, m in model.named_modules()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = []

    def watch(output, batch):
        seen.append((torch.is_inference_mode_enabled(), model.training, output.logits.requires_grad))
        return accuracy(output, batch)

    evaluate(model, Rows(bert_batch(9)), batch_size=4, metric_fn=watch)
    assert seen == [(True, False, False)] * 3
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_existing_gradients_untouched_even_after_an_oom():
    inner = tiny_bert()
    inner(**bert_batch(2)).loss.backward()
    grads = {n: p.grad.clone() for n, p in inner.named_parameters()}
    result = evaluate(Picky(inner, limit=3 * 16), Rows(bert_batch(8)), batch_size=8)
    assert [a.outcome for a in result.attempts] == ["oom", "oom", "ok"]
    assert all(torch.equal(p.grad, grads[n]) for n, p in inner.named_parameters())


def test_a_buffer_made_during_evaluation_can_be_trained_with_afterwards():
    class LazyScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 1)
            self.register_buffer("scale", None)

        def forward(self, x, y):
            if self.scale is None:
                self.scale = torch.full((3,), 2.0)  # a cache made on first use
            return torch.nn.functional.mse_loss(self.linear(x * self.scale).squeeze(-1), y)

    model = LazyScale()
    x, y = torch.randn(6, 3), torch.randn(6)
    evaluate(model, [(x, y)])
    assert not model.scale.is_inference()
    model(x, y).backward()  # an inference tensor would refuse to be saved for backward
    assert model.linear.weight.grad is not None


# -- errors ---------------------------------------------------------------------------------------

def test_structure_mismatch_names_the_field():
    model = tiny_bert()
    first = bert_batch(4)
    missing = {k: v for k, v in bert_batch(4).items() if k != "labels"}
    with pytest.raises(ValueError, match=r"evaluation batch 0 does not match the training data: the field "
                                         r"batch\['labels'\] is missing, which the training batches have"):
        evaluate(model, [missing], expect_like=first)
    extra = {**bert_batch(4), "token_type_ids": torch.zeros(4, 16, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"the field batch\['token_type_ids'\] is extra"):
        evaluate(model, Rows(extra), expect_like=first)
    with pytest.raises(ValueError, match=r"the field batch\[2\] is missing: the evaluation batch has 2 "
                                         r"fields, the training batches 3"):
        check_eval_data([(torch.zeros(2, 3), torch.zeros(2))], expect_like=(torch.zeros(2, 3),) * 3)
    assert model.training


def test_check_eval_data_before_training():
    with pytest.raises(ValueError, match=r"one-shot iterator \(generator\) but epochs=2"):
        check_eval_data((b for b in [bert_batch(2)]), epochs=2)
    gen = (b for b in [bert_batch(2, seed=8), bert_batch(3, seed=9)])
    checked = check_eval_data(gen, expect_like=bert_batch(1), epochs=1)
    assert [len(b["labels"]) for b in checked] == [2, 3]  # the peeked batch is not lost
    with pytest.raises(TypeError, match=r"wrap a single batch in a list: \[batch\]"):
        check_eval_data(bert_batch(2))


def test_metric_fn_that_raises_names_the_batch_and_the_function():
    model = tiny_bert()
    model.train()

    def flaky_metric(output, batch):
        if batch["labels"].shape[0] == 3:
            raise KeyError("f1")
        return {"accuracy": 1.0}

    with pytest.raises(MetricError, match=r"metric_fn .*flaky_metric failed on evaluation batch 2 "
                                          r"\(samples 10-12\): KeyError: 'f1'") as info:
        evaluate(model, [bert_batch(5), bert_batch(5), bert_batch(3)], metric_fn=flaky_metric)
    assert isinstance(info.value.__cause__, KeyError)
    assert model.training


def test_model_without_a_loss_names_the_model_class():
    model = tiny_bert(BertModel)
    with pytest.raises(NoLossError, match=r"cannot evaluate BertModel: BertModel's output \(BaseModel"
                                          r"OutputWithPoolingAndCrossAttentions\) carries no loss"):
        evaluate(model, [{k: v for k, v in bert_batch(2).items() if k != "labels"}])
    assert model.training


def test_other_errors_propagate_untouched():
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("shape mismatch in layer 3")

    model = Broken()
    with pytest.raises(RuntimeError, match="^shape mismatch in layer 3$"):
        evaluate(model, [torch.zeros(4, 2)])
    assert model.training


def test_record_is_the_eval_history_entry():
    result = EvalResult(loss=0.5, samples=10, batch_size=4,
                        attempts=[EvalAttempt(4, "ok", "start")], metrics={"accuracy": 0.75})
    assert result.record(2) == {"epoch": 2, "loss": 0.5, "samples": 10, "batch_size": 4, "accuracy": 0.75}


def test_an_output_kept_past_a_failed_evaluation_batch_is_named_with_its_bytes():
    # The evaluation's attempts go through engine.attempt: after the release, memory must be back at
    # the baseline; what stays is named among the inference tensors (the training state is not).
    kept = []

    def keeping_loss(model, batch):
        out = model(**batch)
        kept.append(out.logits)  # an output stored in a list, outliving its batch
        if len(batch["labels"]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return out.loss

    model = tiny_bert()
    with autofit.simulate_gpu() as gpu, open_device() as device:
        device.place_model(model)
        with pytest.raises(autofit.MemoryNotReleased) as info:
            evaluate(model, [bert_batch(4)], device=device, loss_fn=keeping_loss)
        assert str(info.value).startswith("after an out-of-memory attempt 512 bytes stayed allocated above the "
                                          "pre-attempt baseline, held by 1 tensor(s), 512 bytes: float32[4, 2]")
        kept.clear()
        result = evaluate(model, [bert_batch(4)], device=device, loss_fn=lambda m, b: m(**b).loss)
    assert sizes(result.attempts) == [(4, "ok", 0)]
