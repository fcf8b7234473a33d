"""Evaluation and zero-label losses of an FSDP2-sharded model, two gloo ranks (one spawned scenario):
evaluation in lockstep with unequal per-rank rows and an OOM in one rank's evaluation forward, a
micro-batch whose labels are all -100, padded token losses through a user loss_fn with text fields,
and an error in one rank's evaluation."""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pytest
import torch

from spawn import max_diff, ranks_results, save_rank, timed

WORLD, PER_RANK = 2, 8
EVAL_ROWS = (7, 1, 5)       # rows of the evaluation batches: rank 0 gets 3, 0, 2; rank 1 gets 4, 1, 3
SLOWEST_ERROR_EXIT = 30.0   # seconds; the process group's timeout is 60 s, so a hang would show
PROCESS_TIMEOUT = 240

pytestmark = pytest.mark.slow  # every test here reads spawned gloo ranks' results


def _eval_batches():
    from reference import cls_batches
    return [cls_batches(1, rows=n, seed=20 + i)[0] for i, n in enumerate(EVAL_ROWS)]


def _accuracy(output, batch):
    return {"accuracy": (output.logits.argmax(-1) == batch["labels"]).float().mean()}


def _full(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _tagger():
    """A tiny BERT token classifier: its loss is the mean over the label tokens (no shift)."""
    from transformers import BertConfig, BertForTokenClassification
    torch.manual_seed(0)
    return BertForTokenClassification(BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=64, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _token_shares(rank):
    """Two global batches of 16 rows with padded per-token labels (-100 at the rows' ends, unevenly)
    and each rank's share of 8 rows, with a text field per row: rank 1's first share has a first
    micro-batch (4 rows) whose labels are all -100, its second share none at all."""
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 100, (2 * PER_RANK, 12), generator=g)
        labels = torch.randint(0, 5, (2 * PER_RANK, 12), generator=g)
        for r in range(2 * PER_RANK):
            labels[r, 12 - (r % 5) * 2:] = -100
        batches.append({"input_ids": ids, "labels": labels})
    batches[0]["labels"][PER_RANK:PER_RANK + 4] = -100
    batches[1]["labels"][PER_RANK:] = -100
    mine = [{k: v[rank * PER_RANK:(rank + 1) * PER_RANK].clone() for k, v in b.items()} for b in batches]
    for i, share in enumerate(mine):
        share["text"] = [f"row {rank}.{i}.{r}" for r in range(PER_RANK)]
    return batches, mine


def _token_loss(model, batch, num_items_in_batch):
    """A user's padded token loss: summed over the label tokens, divided by the global count
    autofit passes; checks the text field a real collator's batch carries."""
    assert len(batch["text"]) == len(batch["input_ids"])
    logits = model(input_ids=batch["input_ids"]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                             ignore_index=-100, reduction="sum") / num_items_in_batch


def test_the_stepper_evaluates_a_sharded_model_after_its_first_step(tmp_path):
    """In a group of one: before the first step the ranks have not met (no agreement yet), so
    step.evaluate says to step first, the same on every rank; after it, it evaluates as
    autofit.evaluate does the same weights unsharded."""
    import torch.distributed as dist
    import autofit
    from reference import bert, cls_batches
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        model = bert()
        with autofit.stepper(model, torch.optim.AdamW, shard=True, precision="fp32", cache=False) as step:
            with pytest.raises(ValueError, match=r"call step\(batch\) once before step.evaluate"):
                step.evaluate(_eval_batches())
            step(cls_batches(1, rows=4)[0])
            done = step.evaluate(_eval_batches(), metric_fn=_accuracy)
        weights = _full(model)
    finally:
        dist.destroy_process_group()
    plain = bert()
    plain.load_state_dict(weights)
    alone = autofit.evaluate(plain, _eval_batches(), metric_fn=_accuracy)
    assert done.samples == alone.samples == sum(EVAL_ROWS)
    assert abs(done.loss - alone.loss) <= 1e-6
    assert done.metrics == pytest.approx(alone.metrics, abs=1e-6)


def _worker(rank, init_file, out_dir):
    os.environ["AUTOFIT_CACHE_DIR"] = os.path.join(out_dir, f"cache-{rank}")
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    import autofit
    from reference import bert, cls_batches
    from spawn import Samples, sampler
    from torch.distributed.fsdp import fully_shard
    seen, saved = {}, {}

    def run(model, data, **kw):
        return autofit.run(model, data, **{"precision": "fp32", "progress": False, "capacity_check": False,
                                           "cache": False, **kw})

    def sharded(model, layers):
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    # 1. Training on a DistributedSampler's shares (dropout on), then evaluation of unequal shares
    # (rank 0: 5 rows in 2 batches, rank 1: 8 in 3) after 2 global batches of 8; rank 1's first evaluation forward runs out of
    # memory inside the second layer, after the first layer's gather.
    model = bert(dropout=0.1)
    sharded(model, model.bert.encoder.layer)
    forwards = []

    def count_forward(module, args):
        if not torch.is_grad_enabled():
            forwards.append(1)
    model.register_forward_pre_hook(count_forward)
    if rank == 1:
        def fail_eval(module, args):
            if not torch.is_grad_enabled() and len(forwards) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 MiB (injected)")
        model.bert.encoder.layer[1].register_forward_pre_hook(fail_eval)
    loader = torch.utils.data.DataLoader(Samples(PER_RANK), batch_size=PER_RANK // 2,
                                         sampler=sampler(PER_RANK, WORLD, rank, seed=3))
    result = run(model, loader, eval_data=_eval_batches(), metric_fn=_accuracy)
    seen["eval"] = {"history": result.eval_history, "forwards": len(forwards),
                    "attempts": [[a.batch_size, a.outcome, a.reason, a.batch, a.first_sample]
                                 for a in result.eval_attempts],
                    "train": [[a.step, a.plan.micro_batch_size, a.outcome] for a in result.attempts]}
    saved["eval"] = _full(model)

    # 2. A zero-label micro-batch under FSDP (the model's own loss, weighted by label tokens): an OOM
    # in rank 0's first forward splits the first global batch into micro-batches of 4, and rank 1's
    # first micro-batch has no label token; its second share has none at all.
    batches, mine = _token_shares(rank)
    model = _tagger()
    sharded(model, model.bert.encoder.layer)
    if rank == 0:
        calls = []

        def fail_once(module, args):
            if not torch.is_grad_enabled():
                return  # the probe of whether the loss shifts labels (it does not, here)
            calls.append(1)
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB (injected)")
        model.bert.encoder.layer[0].register_forward_pre_hook(fail_once)
    plain = [{k: v for k, v in share.items() if k != "text"} for share in mine]
    result = run(model, plain, ladder=lambda plan: plan.replace(micro_batch_size=plan.micro_batch_size // 2)
                 if plan.micro_batch_size > 1 else None)
    seen["zero_labels"] = {"losses": [h["loss"] for h in result.history],
                           "attempts": [[a.step, a.plan.micro_batch_size, a.outcome] for a in result.attempts]}
    saved["zero_labels"] = _full(model)

    # 2b. A causal LM's own loss, sharded: its labels are shifted (asked of the model on every rank at
    # once), so the micro-batches weigh their shifted label tokens; rank 1's first share has none.
    from reference import gpt2, lm_batches
    lm = lm_batches(2, rows=2 * PER_RANK)
    lm[0]["labels"][PER_RANK:] = -100
    model = gpt2()
    sharded(model, model.transformer.h)
    result = run(model, [{k: v[rank * PER_RANK:(rank + 1) * PER_RANK] for k, v in b.items()} for b in lm])
    seen["causal"] = {"losses": [h["loss"] for h in result.history]}
    saved["causal"] = _full(model)

    # 3. The same shares, text field included, through a user loss_fn that takes num_items_in_batch.
    model = _tagger()
    sharded(model, model.bert.encoder.layer)
    result = run(model, mine, loss_fn=_token_loss)
    seen["loss_fn"] = {"losses": [h["loss"] for h in result.history]}
    saved["loss_fn"] = _full(model)

    # 4. A ValueError in rank 1's evaluation loss: rank 0 is stopped at its next agreement.
    def loss_fn(model, batch):
        if rank == 1 and not torch.is_grad_enabled():
            raise ValueError("rank 1 cannot evaluate this batch")
        return model(**batch).loss
    model = bert()
    sharded(model, model.bert.encoder.layer)
    seen["error"] = timed(lambda: run(model, cls_batches(1, rows=2 * PER_RANK), eval_data=_eval_batches(),
                                      loss_fn=loss_fn))

    save_rank(out_dir, rank, seen, saved)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return ranks_results(_worker, tmp_path_factory.mktemp("fsdp_eval"), WORLD, PROCESS_TIMEOUT)


def test_ranks_with_unequal_rows_evaluate_in_lockstep_and_step_down_together(ranks):
    import autofit
    from reference import bert
    (r0, r1), (p0, p1) = ranks
    assert r0["eval"]["train"] == r1["eval"]["train"] == [[0, 4, "ok"], [1, 4, "ok"]]
    # Both ranks: 4 rows (rank 1's first batch) ran out of memory on rank 1, then 2 rows fitted.
    halved = "halved after 4 rows ran out of memory"
    assert r0["eval"]["attempts"] == [[4, "oom", "start: start_batch_size=16", 0, 0], [2, "ok", halved, 0, 0]]
    assert r1["eval"]["attempts"] == [[4, "oom", "start: start_batch_size=16", 0, 0], [2, "ok", halved, 0, 0]]
    # Forwards at 2 rows: rank 0 runs 2+1, 2 and then two fillers; rank 1 runs 2+2, 1, 2+1 (and
    # the failed one before them): the same count on both.
    assert r0["eval"]["forwards"] == r1["eval"]["forwards"] == 1 + 5
    assert r0["eval"]["history"] == r1["eval"]["history"]
    assert max_diff(p0["eval"], p1["eval"]) == 0
    model = bert(dropout=0.1)
    model.load_state_dict(p0["eval"])
    whole = autofit.evaluate(model, _eval_batches(), metric_fn=_accuracy)
    (record,) = r0["eval"]["history"]
    assert record["samples"] == whole.samples == sum(EVAL_ROWS)
    assert abs(record["loss"] - whole.loss) <= 1e-6
    assert abs(record["accuracy"] - whole.metrics["accuracy"]) <= 1e-6
    assert record["batch_size"] == 2


def _token_loop(batches, micro_sizes):
    """One process: each global batch's rank shares (rank 0's rows, then rank 1's) cut into
    micro-batches of the given size, each weighted by its label tokens over the global batch's,
    zero-token ones skipped."""
    model = _tagger()
    opt = torch.optim.AdamW(model.parameters())
    count = lambda b: int((b["labels"] != -100).sum())  # noqa: E731
    for batch, micro in zip(batches, micro_sizes):
        total = count(batch)
        for start in range(0, 2 * PER_RANK, PER_RANK):
            for i in range(start, start + PER_RANK, micro):
                part = {k: v[i:min(i + micro, start + PER_RANK)] for k, v in batch.items()}
                if count(part):
                    (model(**part).loss * (count(part) / total)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def test_a_micro_batch_without_label_tokens_contributes_exactly_nothing(ranks):
    (r0, r1), (p0, p1) = ranks
    for seen in (r0, r1):
        # After the OOM the ladder probes up: the second global batch runs in micro-batches of 6.
        assert seen["zero_labels"]["attempts"] == [[0, 8, "oom"], [0, 4, "ok"], [1, 6, "ok"]]
        assert all(math.isfinite(loss) for loss in seen["zero_labels"]["losses"])
    assert r0["zero_labels"]["losses"] == r1["zero_labels"]["losses"]
    assert max_diff(p0["zero_labels"], p1["zero_labels"]) == 0
    batches, _ = _token_shares(0)
    assert max_diff(p0["zero_labels"], _token_loop(batches, [4, 6])) <= 1e-5


def test_a_sharded_causal_lm_weighs_its_shifted_label_tokens(ranks):
    from reference import gpt2, lm_batches
    (r0, r1), (p0, p1) = ranks
    assert r0["causal"]["losses"] == r1["causal"]["losses"]
    assert all(math.isfinite(loss) for loss in r0["causal"]["losses"])
    assert max_diff(p0["causal"], p1["causal"]) == 0
    batches = lm_batches(2, rows=2 * PER_RANK)
    batches[0]["labels"][PER_RANK:] = -100
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters())
    count = lambda b: int((b["labels"][:, 1:] != -100).sum())  # noqa: E731
    for batch in batches:
        for start in (0, PER_RANK):
            part = {k: v[start:start + PER_RANK] for k, v in batch.items()}
            if count(part):
                (model(**part).loss * (count(part) / count(batch))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert max_diff(p0["causal"], model.state_dict()) <= 1e-5


def test_a_user_token_loss_with_text_fields_equals_the_token_weighted_loop(ranks):
    (r0, r1), (p0, p1) = ranks
    assert r0["loss_fn"]["losses"] == r1["loss_fn"]["losses"]
    assert all(math.isfinite(loss) for loss in r0["loss_fn"]["losses"])
    assert max_diff(p0["loss_fn"], p1["loss_fn"]) == 0
    batches, _ = _token_shares(0)
    assert max_diff(p0["loss_fn"], _token_loop(batches, [PER_RANK, PER_RANK])) <= 1e-5


def test_an_error_in_one_ranks_evaluation_ends_both_promptly(ranks):
    (r0, r1), _ = ranks
    assert (r1["error"]["error"], r1["error"]["message"]) == ("ValueError", "rank 1 cannot evaluate this batch")
    assert r0["error"]["error"] == "RankFailed"
    assert r0["error"]["message"].startswith("rank 1 failed with ValueError: rank 1 cannot evaluate this "
                                             "batch (at global step 0, in evaluation)")
    assert max(r0["error"]["seconds"], r1["error"]["seconds"]) < SLOWEST_ERROR_EXIT
