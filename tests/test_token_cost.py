"""The cost model weighs a token batch's micro-batches by their tokens (estimator/cost.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autofit.engine.batches import tokens_per_row
from autofit.estimator.capacity import choose, make_estimator, rank
from autofit.estimator.cost import BUSY_TOKENS, candidate_plans, plan_cost
from autofit.estimator.estimate import estimate
from autofit.plans.plan import Plan
from test_estimate import gpt2, gpt2_batch


def test_tokens_per_row_is_the_longest_integer_field_with_positions():
    ids = torch.zeros(4, 1024, dtype=torch.long)
    assert tokens_per_row({"input_ids": ids, "attention_mask": torch.ones(4, 1024, dtype=torch.long),
                           "labels": torch.zeros(4, dtype=torch.long)}) == 1024
    # seq2seq: the decoder's positions are the longer field
    assert tokens_per_row({"input_ids": torch.zeros(2, 100, dtype=torch.long),
                           "decoder_input_ids": torch.zeros(2, 300, dtype=torch.int32)}) == 300
    assert tokens_per_row((np.zeros((3, 7), dtype=np.int64), np.zeros(3))) == 7
    assert tokens_per_row(torch.zeros(2, 4, 5, dtype=torch.long)) == 20  # positions of any shape


@pytest.mark.parametrize("batch", [
    (torch.zeros(4, 3, 32, 32), torch.zeros(4, dtype=torch.long)),        # images, class labels
    {"input_features": torch.zeros(2, 80, 300)},                           # audio features
    {"mask": torch.ones(4, 16, dtype=torch.bool), "x": torch.zeros(4, 16)},  # a bool mask is no token
])
def test_batches_without_tokens_are_weighed_by_rows(batch):
    assert tokens_per_row(batch) is None


def test_long_rows_are_busy_before_eight_rows():
    def cost(micro, tokens, **fields):
        return plan_cost(Plan.for_batch(8, micro, **fields), 8, tokens)
    # 8 rows of 1024 tokens: the GPU is busy with 2 rows (2048 tokens); each micro-batch pays 256.
    assert [cost(m, 1024) for m in (8, 4, 3, 2, 1)] == [
        1.0, 2 * 4352 / 8448, (3072 + 3072 + 2048 + 3 * 256) / 8448, 4 * 2304 / 8448, 8 * 2304 / 8448]
    assert cost(3, 1024) < cost(8, 1024, precision="bf16") < cost(8, 1024, checkpointing=True)
    # the row rule would rank the same split after both
    assert cost(3, None) == 3.0 > cost(8, None, checkpointing=True) > cost(8, None, precision="bf16")


@pytest.mark.parametrize("tokens", [None, 1, 16, 256])
def test_rows_of_256_tokens_or_fewer_keep_the_row_rule(tokens):
    for global_batch in (8, 9, 32, 96):
        for micro in (1, 2, 3, 5, 8, 16, 32):
            plan = Plan.for_batch(global_batch, min(micro, global_batch))
            assert plan_cost(plan, global_batch, tokens) == plan_cost(plan, global_batch)


def test_candidates_come_in_token_cost_order():
    plans = candidate_plans(8, "auto", allow_offload=False, checkpointing=False, tokens_per_row=1024)
    firsts = [(p.micro_batch_size, p.precision) for p in plans[:6]]
    assert firsts == [(8, "fp32"), (4, "fp32"), (3, "fp32"), (2, "fp32"), (8, "bf16"), (4, "bf16")]
    assert 8 * 256 == BUSY_TOKENS


@pytest.mark.slow
def test_rank_keeps_exact_math_by_accumulating_long_rows():
    """8 rows of 512 tokens where the whole batch does not fit in fp32 but half of it and the whole
    in bf16 do: by tokens, 4 x 2 in fp32 (1.06) is faster than bf16 (1.15); by rows it was 2.0."""
    model, batch = gpt2(), gpt2_batch(8, seq=512)
    peaks = {(m, p): estimate(model, batch, Plan.for_batch(8, m, precision=p), device_type="cpu").peak_bytes
             for m, p in ((8, "fp32"), (4, "fp32"), (8, "bf16"))}
    budget = max(peaks[4, "fp32"], peaks[8, "bf16"])
    assert budget < peaks[8, "fp32"]
    chosen = choose(rank(make_estimator(model, batch, device_type="cpu"), batch, budget)).plan
    assert (chosen.micro_batch_size, chosen.accumulation_steps, chosen.precision) == (4, 2, "fp32")
