"""Token-level losses are exact however the loss is given (autofit/engine/token_loss.py)."""

import logging
import re

import pytest
import torch

import autofit
from autofit.gpu.device import CpuDevice
from autofit.engine.token_loss import forward_takes_items, loss_fn_takes_items, loss_weighting, unwrap
from reference import device_copy, gpt2, lm_batches, max_diff, plain_loop
from models import bert_batch, gpt2_batch, tiny_bert, tiny_gpt2

THREE = lambda p: p.replace(micro_batch_size=3) if p.micro_batch_size > 3 else None  # noqa: E731


def with_ids(batches):
    return [dict(b, ids=[f"step{s}-row{r}" for r in range(len(b["input_ids"]))]) for s, b in enumerate(batches)]


def sgd(params):
    # Not AdamW: its normalised first steps turn float rounding in near-zero gradients into ~1e-6
    # differences of the weights, which would hide the weighting this file checks.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def run_split(model, batches, loss_fn):
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)  # the first attempt runs out of memory: 8 rows go as 3+3+2
        return autofit.run(model, batches, loss_fn=loss_fn, precision="fp32", progress=False, ladder=THREE,
                           optimizer=sgd)


def full_batch_loop(batches):
    model = gpt2()
    return plain_loop(model, batches, [8] * len(batches), tokens=True, optimizer=sgd(model.parameters()))


def test_gpt2_padded_labels_through_loss_fn_equal_the_full_batch_loop():
    batches = with_ids(lm_batches(3, rows=8))
    seen = []

    def loss_fn(model, batch, num_items_in_batch):
        seen.append((batch["ids"], num_items_in_batch))
        tensors = {k: v for k, v in batch.items() if k != "ids"}
        return model(**tensors, num_items_in_batch=num_items_in_batch).loss

    model = gpt2()
    result = run_split(model, batches, loss_fn)
    assert [(a.step, a.plan.micro_batch_size, a.outcome) for a in result.attempts][:2] == [(0, 8, "oom"), (0, 3, "ok")]
    shifted = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    ids, m = batches[1]["ids"], result.history[1]["plan"].micro_batch_size
    assert m < 8  # split, with per-row strings split alongside
    assert [s for s in seen if s[0][0].startswith("step1")] == [(ids[i:i + m], shifted[1]) for i in range(0, 8, m)]
    assert max_diff(model, full_batch_loop(lm_batches(3, rows=8))) <= 1e-6


def test_gpt2_own_loss_gets_the_global_count_and_equals_the_full_batch_loop():
    batches = lm_batches(3, rows=8)
    model = gpt2()
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs.get("num_items_in_batch")),
                                    with_kwargs=True)
    result = run_split(model, batches, None)
    parts = [-(-8 // h["plan"].micro_batch_size) for h in result.history]
    assert parts[0] == 3
    shifted = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    assert calls[-(parts[1] + parts[2]):] == [shifted[1]] * parts[1] + [shifted[2]] * parts[2]
    assert max_diff(model, full_batch_loop(batches)) <= 1e-6
    assert abs(result.history[0]["loss"] - full_loss(batches[0])) <= 1e-6


def full_loss(batch):
    with torch.no_grad():
        return gpt2()(**batch).loss.item()


def test_a_loss_fn_without_the_keyword_is_asked_and_equals_the_full_batch_loop(caplog):
    """The most common way to write it: the micro-batch's mean over its shifted label tokens,
    weighted by its share of the global batch's label tokens, which the probe found."""
    batches = lm_batches(3, rows=8)
    model = gpt2()
    with caplog.at_level(logging.INFO, logger="autofit"):
        result = run_split(model, batches, lambda m, b: m(**b).loss)
    assert result.history[0]["plan"].micro_batch_size == 3
    said = [r.getMessage() for r in caplog.records if "asked with two rows" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        "loss_fn is a mean over label tokens (not -100, shifted) (asked with two rows: loss of row 0 ")
    assert max_diff(model, full_batch_loop(batches)) <= 1e-6  # fp32: another summation order


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x).squeeze(-1)


def regression_batches(n=2, rows=8):
    g = torch.Generator().manual_seed(5)
    return [{"x": torch.randn(rows, 4, generator=g), "y": torch.randn(rows, generator=g)} for _ in range(n)]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_sum_adds_its_micro_losses_and_a_mean_weighs_rows(reduction, caplog):
    def loss_fn(m, b):
        return torch.nn.functional.mse_loss(m(b["x"]), b["y"], reduction=reduction)
    model = Regression()
    with caplog.at_level(logging.INFO, logger="autofit"):
        result = run_split(model, regression_batches(), loss_fn)
    splits = [h["plan"].micro_batch_size for h in result.history]
    assert splits[0] == 3
    found = {"sum": "a sum over its rows: micro-batch losses add, each weighs 1", "mean": "a mean over rows"}
    assert any(r.getMessage().startswith(f"loss_fn is {found[reduction]} (asked") for r in caplog.records)
    reference = Regression()
    opt = sgd(reference.parameters())
    for batch, micro in zip(regression_batches(), splits):
        for i in range(0, 8, micro):
            part = device_copy({k: v[i:i + micro] for k, v in batch.items()})  # as the simulated GPU
            weight = 1.0 if reduction == "sum" else len(part["y"]) / 8
            (loss_fn(reference, part) * weight).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    if reduction == "sum":  # the step's loss is the whole batch's sum
        with torch.no_grad():
            whole = loss_fn(Regression(), regression_batches()[0]).item()
        assert abs(result.history[0]["loss"] - whole) <= 1e-5 * abs(whole)


def test_a_loss_matching_no_reduction_is_weighted_by_rows_and_called_coupled(caplog):
    def loss_fn(m, b):  # the square of a mean: neither a mean nor a sum of per-row terms
        return torch.nn.functional.mse_loss(m(b["x"]), b["y"]) ** 2
    with caplog.at_level(logging.INFO, logger="autofit"):
        weighting = loss_weighting(Regression(), regression_batches()[0], loss_fn, CpuDevice())
    assert (weighting.count, weighting.pass_items, weighting.summed) == (None, False, False)
    # The rows are coupled: the job says so once (plans/coupling.Coupling.loss_couples), not here.
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == []
    assert re.fullmatch(r"loss_fn \(loss of row 0 [0-9.e-]+, of row 1 [0-9.e-]+, of both [0-9.e-]+; a mean over "
                        r"rows would give [0-9.e-]+\)", weighting.coupled)


def test_bert_classification_head_is_found_to_ignore_num_items_in_batch(caplog):
    model = tiny_bert()
    assert forward_takes_items(model)  # its forward takes **kwargs ...
    with caplog.at_level(logging.INFO, logger="autofit"):
        weighting = loss_weighting(model, bert_batch(rows=4, seq=8), None, CpuDevice())
    assert (weighting.count, weighting.pass_items) == (None, False)  # ... but its loss drops it: rows
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and re.fullmatch(
        r"BertForSequenceClassification's loss is a mean over rows \(asked with two rows: loss of row 0 "
        r"[0-9.]+, of row 1 [0-9.]+, of both [0-9.]+\); micro-batches are weighted by it", said[0])
    assert model.training  # the probe gives the model back in training mode


def test_the_probe_counts_as_the_model_does_and_leaves_the_rng_alone():
    batch = gpt2_batch(rows=4, seq=8)
    batch["labels"] = batch["input_ids"].clone()
    batch["labels"][:, -2:] = -100
    model = tiny_gpt2()
    state = torch.get_rng_state()
    weighting = loss_weighting(model, batch, None, CpuDevice())
    assert torch.equal(torch.get_rng_state(), state)
    assert weighting.pass_items and weighting.count(batch) == 4 * 5  # 7 shifted labels, 2 padded
    assert weighting.items(batch) == {"num_items_in_batch": 20}
    assert weighting.shares(batch, [batch, batch]) == [1.0, 1.0]


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


class Compiled(torch.nn.Module):
    """Set up as torch.compile's OptimizedModule is: the real module in `_orig_mod`, (*args, **kwargs)."""
    def __init__(self, inner):
        super().__init__()
        self._orig_mod = inner

    def forward(self, *args, **kwargs):
        return self._orig_mod(*args, **kwargs)


def test_wrappers_are_unwrapped_before_reading_the_signature():
    plain = Plain()
    assert unwrap(Compiled(plain)) is plain and not forward_takes_items(Compiled(plain))
    ddp_like = torch.nn.DataParallel(Compiled(plain))
    assert unwrap(ddp_like) is plain
    assert loss_fn_takes_items(lambda m, b, num_items_in_batch: 0)
    assert not loss_fn_takes_items(lambda m, b, **kw: 0)


def test_a_compiled_gpt2_counts_shifted_labels():
    # Wrapped as torch.compile wraps (a real torch.compile spends a minute tracing GPT-2 on this CPU):
    # the wrapper's forward takes (*args, **kwargs) and its class name says nothing.
    batch = gpt2_batch(rows=4, seq=8)
    batch["labels"] = batch["input_ids"].clone()
    compiled = Compiled(tiny_gpt2())
    assert type(unwrap(compiled)).__name__ == "GPT2LMHeadModel"
    weighting = loss_weighting(compiled, batch, None, CpuDevice())
    assert weighting.pass_items and weighting.count(batch) == 4 * 7


def test_a_loss_fn_over_a_plain_model_counts_labels_or_rows():
    tokens = {"x": torch.zeros(4, 3), "labels": torch.tensor([[1, -100], [1, 1], [-100, -100], [0, 1]])}
    weighting = loss_weighting(Plain(), tokens, lambda m, b, num_items_in_batch: 0, CpuDevice())
    assert weighting.items(tokens) == {"num_items_in_batch": 5}
    rows = {"x": torch.zeros(4, 3)}
    weighting = loss_weighting(Plain(), rows, lambda m, b, num_items_in_batch: 0, CpuDevice())
    assert weighting.items(rows) == {"num_items_in_batch": 4}


def test_evaluation_counts_the_labels_of_a_wrapped_causal_lm_shifted():
    from autofit.engine.token_loss import token_counter
    batch = gpt2_batch(rows=4, seq=8)
    batch["labels"] = batch["input_ids"].clone()
    assert token_counter(Compiled(tiny_gpt2()))(batch) == 4 * 7
    assert token_counter(torch.nn.DataParallel(tiny_gpt2()))(batch) == 4 * 7


def test_a_micro_batch_without_label_tokens_runs_with_a_finite_loss_and_adds_nothing():
    """A micro-batch whose labels are all -100 weighs 0; where it cannot be skipped (FSDP) it runs,
    and a mean over no token is NaN (0 x NaN = NaN): it runs with its last label set to 0 in a copy,
    so the step's loss is finite and the gradients are those of the other micro-batches alone."""
    from autofit.engine.step import StepRunner
    from autofit.engine.token_loss import label_tokens, weightless
    from transformers import BertConfig, BertForTokenClassification

    def tagger():
        torch.manual_seed(0)
        return BertForTokenClassification(BertConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            vocab_size=100, max_position_embeddings=32, num_labels=5, hidden_dropout_prob=0.1))
    g = torch.Generator().manual_seed(3)
    batch = {"input_ids": torch.randint(0, 100, (8, 10), generator=g),
             "labels": torch.randint(0, 5, (8, 10), generator=g), "text": [f"row {r}" for r in range(8)]}
    batch["labels"][:4] = -100          # the first micro-batch of 4 counts no token
    batch["labels"][6, 7:] = -100
    stand_in = weightless({k: v[:4] for k, v in batch.items()})
    assert stand_in["labels"].view(-1).tolist() == [-100] * 39 + [0]
    assert bool((batch["labels"][:4] == -100).all())  # the user's batch untouched
    assert weightless({"x": batch["input_ids"]}) == {"x": batch["input_ids"]}

    model = tagger()
    runner = StepRunner(model, torch.optim.SGD(model.parameters(), lr=0.1), CpuDevice(),
                        count_tokens=label_tokens(False), loss_fn=lambda m, b: m(input_ids=b["input_ids"],
                                                                                  labels=b["labels"]).loss)
    torch.manual_seed(1)
    loss = runner.run(batch, autofit.Plan(micro_batch_size=4, accumulation_steps=2))
    plain = tagger()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    torch.manual_seed(1)
    plain(input_ids=batch["input_ids"][:4])  # the same dropout draws as the stand-in's forward
    part = {k: v[4:] for k, v in batch.items() if k != "text"}
    out = plain(**part)
    out.loss.backward()
    opt.step()
    assert loss == pytest.approx(out.loss.item(), abs=1e-6)
    assert max_diff(model, plain) <= 1e-6


def test_the_reduction_probe_tells_every_reduction_apart():
    """classify on the probe's rows (T = 6 tokens: row 0 counts 6 unshifted / 5 shifted, row 1 two /
    one): each reduction's prediction of both rows' loss matches that reduction only."""
    from autofit.engine.reduction import classify, probe_rows
    rows = probe_rows({"input_ids": torch.zeros(3, 6, dtype=torch.long), "labels": torch.ones(3, 6, dtype=torch.long)})
    assert rows[2]["labels"].tolist() == [[0] * 6, [0, -100, -100, -100, -100, 0]]
    a, b = 2.0, 5.0
    cases = {"rows": (a + b) / 2, "sum": a + b, "unshifted": (6 * a + 2 * b) / 8, "shifted": (5 * a + 1 * b) / 6}
    assert {kind: classify(a, b, ab, rows).kind for kind, ab in cases.items()} == {k: k for k in cases}
    alike = classify(3.0, 3.0, 3.0, rows)  # equal rows: every mean matches, none is told apart
    assert (alike.kind, alike.ambiguous) == (None, True)
    assert classify(a, b, 0.5, rows).kind is None and not classify(a, b, 0.5, rows).ambiguous
