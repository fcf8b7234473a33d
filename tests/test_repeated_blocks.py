"""Alike blocks walked through 3 of them and tiled: the same estimate as the walk of the whole model."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from autofit import torch_internals as ti
from autofit.estimator.estimate import Estimator
from autofit.estimator.repeated import alike, repeated_blocks
from autofit.estimator.tiling import Repeated
from autofit.plans.plan import Plan

VOCAB = 64
LAYERS = 6


def bert(layers: int = LAYERS) -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, num_labels=3))


def gpt2(layers: int = LAYERS) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=layers, n_head=2, vocab_size=VOCAB,
                                      n_positions=64, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))


def bert_batch(rows: int = 4, seq: int = 16) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, VOCAB, (rows, seq), generator=g),
            "attention_mask": torch.ones(rows, seq, dtype=torch.long),
            "labels": torch.randint(0, 3, (rows,), generator=g)}


def gpt2_batch(rows: int = 4, seq: int = 16) -> dict:
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


FAMILIES = {"bert": (bert, bert_batch), "gpt2": (gpt2, gpt2_batch)}
# Before torch 2.13 a checkpointed step's first, middle and last blocks allocate differently (its
# non-reentrant checkpoint), so the estimate of a checkpointed plan walks the whole model: as exact,
# only slower.
CHECKPOINTED_BLOCKS_ALIKE = ti.TORCH_VERSION >= (2, 13)


def expected_derivation(plan) -> tuple:
    """(why the derivation fell back, per kind of plan; whether the kind was derived)."""
    if not plan.checkpointing or CHECKPOINTED_BLOCKS_ALIKE:
        return {}, [True]
    kind = (plan.replace(micro_batch_size=1, accumulation_steps=1), False)
    return {kind: "Untileable: the first, middle and last blocks allocate differently"}, [False]


PLANS = [Plan(4), Plan(4, precision="bf16"), Plan(4, checkpointing=True), Plan(2, 2),
         Plan(4, offload_optimizer=True)]


def _same(derived, full) -> None:
    assert derived.peak_bytes == full.peak_bytes
    assert derived.breakdown == full.breakdown
    assert derived.reserved_bytes == full.reserved_bytes  # the replayed allocator: exact
    assert derived.step_bytes == full.step_bytes
    assert derived.resident == full.resident


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe().replace(" ", ""))
def test_derived_estimates_equal_the_walk_of_the_whole_model(family, plan):
    build, make_batch = FAMILIES[family]
    model, batch = build(), make_batch()
    derived = Estimator(model, batch)  # device_type="cuda": CUDA's numerics, foreach AdamW
    full = Estimator(model, batch, derive_repeated=False)
    _same(derived.measure(plan), full.measure(plan))
    # A second plan of the same kind is derived from the walk of 3 alone, exact too.
    larger = plan.replace(micro_batch_size=plan.micro_batch_size + 1)
    _same(derived.measure(larger), full.measure(larger))
    repeated = derived._repeated
    assert isinstance(repeated, Repeated) and repeated.blocks == LAYERS
    # Both were derived (none fell back); the kind of plan was checked once against 4 blocks.
    assert (repeated.why, list(repeated.checked.values())) == expected_derivation(plan)


def test_a_cpu_step_with_the_single_tensor_optimizer_is_derived_too():
    model, batch = gpt2(), gpt2_batch()
    derived = Estimator(model, batch, device_type="cpu")
    full = Estimator(model, batch, device_type="cpu", derive_repeated=False)
    for plan in (Plan(2, 2, precision="bf16"), Plan(4, checkpointing=True)):
        _same(derived.measure(plan), full.measure(plan))
        assert (derived._repeated.why, [derived._repeated.checked[k] for k in derived._repeated.checked
                                        if k[0] == plan.replace(micro_batch_size=1, accumulation_steps=1)]) \
            == expected_derivation(plan)


def test_the_cut_copy_is_fake_and_the_model_is_untouched():
    model, batch = bert(), bert_batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    est = Estimator(model, batch)
    est.measure(Plan(4))
    cut = est._repeated.cuts[3]
    assert len(cut.model.bert.encoder.layer) == 3 and len(model.bert.encoder.layer) == LAYERS
    assert all(isinstance(p, FakeTensor) for p in cut.model.parameters())
    assert all(not isinstance(p, FakeTensor) and torch.equal(p, before[n])
               for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


class Block(torch.nn.Module):
    def __init__(self, width: int, scale: float = 1.0):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.scale = scale

    def forward(self, x):
        return torch.relu(self.linear(x)) * self.scale


class Stack(torch.nn.Module):
    """Blocks of `widths` between an input and an output layer; `by_count` runs them by a count
    kept at construction (what a cut copy breaks), `stacked` keeps every block's output."""

    def __init__(self, widths, by_count: bool = False, stacked: bool = False, scales=None):
        super().__init__()
        self.inp = torch.nn.Linear(8, widths[0])
        self.blocks = torch.nn.ModuleList(Block(w, s) for w, s in zip(widths, scales or [1.0] * len(widths)))
        self.out = torch.nn.Linear(widths[-1], 1)
        self.count, self.by_count, self.stacked = len(widths), by_count, stacked

    def forward(self, x):
        h = self.inp(x)
        outputs = []
        for i in range(self.count if self.by_count else len(self.blocks)):
            h = self.blocks[i](h)
            outputs.append(h)
        if self.stacked:  # memory that grows with the number of blocks outside them
            h = h + torch.stack(outputs).sum(0)
        return self.out(h).square().mean()


def loss_fn(model, batch):
    return model(batch)


@pytest.mark.parametrize("case", ["widths", "attributes", "truncation", "stacked"])
def test_models_the_cut_cannot_stand_for_are_walked_whole(case):
    model = {"widths": lambda: Stack([16] * 6),
             "attributes": lambda: Stack([16] * 6, scales=[1.0, 1.0, 0.5, 1.0, 1.0, 1.0]),
             "truncation": lambda: Stack([16] * 6, by_count=True),
             "stacked": lambda: Stack([16] * 6, stacked=True)}[case]()
    if case == "widths":
        model.blocks[3].linear = torch.nn.Linear(16, 16, bias=False)  # one block unlike the others
    batch = torch.randn(4, 8)
    derived = Estimator(model, batch, loss_fn=loss_fn)
    full = Estimator(model, batch, loss_fn=loss_fn, derive_repeated=False)
    for plan in (Plan(4), Plan(2, 2)):
        _same(derived.measure(plan), full.measure(plan))
    if case in ("widths", "attributes"):
        assert repeated_blocks(model) is None and derived._repeated is False
    else:  # alike blocks, but the cut copy fails (IndexError) or its trace does not tile
        assert repeated_blocks(model) == ("blocks", 6)
        assert not any(derived._repeated.checked.values())
        why = " ".join(derived._repeated.why.values())
        assert ("IndexError" in why) if case == "truncation" else why.startswith("Untileable")


def test_alike_allows_only_the_blocks_own_index_to_differ():
    class Indexed(Block):
        def __init__(self, index):
            super().__init__(8)
            self.layer_idx = index
    assert alike(torch.nn.ModuleList(Indexed(i) for i in range(5)))
    assert not alike(torch.nn.ModuleList(Indexed(i if i != 3 else 7) for i in range(5)))
    shared = Block(8)
    assert not alike(torch.nn.ModuleList([shared] * 5))  # one module, its parameters shared
    assert repeated_blocks(Stack([16] * 4)) is None  # too few blocks for the cut to be cheaper


def test_a_tiled_estimate_counts_blocks_handed_out_whole_as_the_walk_of_the_whole_model_does():
    """With a card's workspaces the meter counts a block c10 hands out whole (a large-pool remainder
    of at most 1 MiB left unsplit) as allocated; the tiled trace's replay counts it so too."""
    from autofit.gpu.workspaces import Workspaces

    def wide():
        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(
            hidden_size=192, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=768,
            vocab_size=VOCAB, max_position_embeddings=256, num_labels=3))
    batch, hopper = bert_batch(rows=8, seq=256), Workspaces.of_capability((9, 0))
    derived = Estimator(wide(), batch, device_type="cpu", workspaces=hopper)
    whole = Estimator(wide(), batch, device_type="cpu", derive_repeated=False, workspaces=hopper)
    requests = Estimator(wide(), batch, device_type="cpu", derive_repeated=False)  # no card's accounting
    d, w, r = (e.measure(Plan(8)) for e in (derived, whole, requests))
    assert derived._repeated.checked == {(Plan(1), False): True}  # 3 of the 6 layers walked, tiled
    # 5.5 MiB of blocks handed out whole at the peak, beyond the requests and the workspaces:
    assert w.peak_bytes - r.peak_bytes - hopper.resident == 5.5 * 2**20
    assert (d.peak_bytes, d.breakdown, d.step_bytes, d.reserved_bytes) == \
        (w.peak_bytes, w.breakdown, w.step_bytes, w.reserved_bytes)
