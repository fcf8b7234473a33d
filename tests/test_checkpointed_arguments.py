"""A failed attempt under checkpointing leaves nothing held: neither through the arguments torch's
checkpoint keeps for the recompute (engine/checkpointing._Call) nor through a replay that puts back
half of transformers' switch (engine/model_state.switch_writes)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.engine.checkpointing import Checkpointing
from autofit.engine.model_state import Attributes
from reference import device_copy


class Block(nn.Module):
    """Appends its activation to a list it is given (a deep-supervision loss reads them): the list
    holds tensors whose graph the checkpoint's frame, which keeps the list, is reached from."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, states):
        h = torch.tanh(self.lin(x))
        states.append(h)
        return x + h


class Deep(nn.Module):
    def __init__(self, keyword, d=64, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.keyword = keyword
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        states = []
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, states=states) if self.keyword else block(h, states)
        return self.head(h), states[:len(self.blocks)]  # (a recompute appends again)


def deep_loss(model, batch):
    out, states = model(batch["x"])
    return F.cross_entropy(out, batch["y"]) + 0.01 * sum(s.pow(2).mean() for s in states)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("keyword", [False, True])
def test_a_block_that_writes_into_an_argument_leaves_nothing_after_a_failed_attempt(keyword):
    """At 150,000 B micro-batches of 8 fail with and without checkpointing; the checkpointed one
    failed with the list holding its blocks' activations (before: MemoryNotReleased, 12.50 KiB in
    float32[8, 64] tensors). The run ends as the plain loop with the same splits."""
    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(64, 16, generator=g), "y": torch.randint(0, 4, (64,), generator=g)}
            for _ in range(3)]
    model = Deep(keyword)
    result = autofit.run(model, data, loss_fn=deep_loss, optimizer=sgd, budget=150_000, precision="fp32",
                         progress=False, cache=False, capacity_check=False)
    assert [(a.step, a.plan.micro_batch_size, a.plan.checkpointing, a.outcome) for a in result.attempts] == [
        (0, 64, False, "oom"), (0, 32, False, "oom"), (0, 16, False, "oom"), (0, 8, False, "oom"),
        (0, 8, True, "oom"), (0, 4, True, "ok"), (1, 6, True, "oom"), (1, 4, True, "ok"),
        (2, 5, True, "oom"), (2, 4, True, "ok")]
    plain = Deep(keyword)
    opt = sgd(plain.parameters())
    for batch in data:
        for i in range(0, 64, 4):
            (deep_loss(plain, device_copy({k: v[i:i + 4] for k, v in batch.items()})) * (4 / 64)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert torch.equal(mine, theirs)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64))


def hf_flags(model) -> list:
    return [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")]


def test_a_replay_leaves_transformers_checkpointing_as_the_plan_switched_it():
    """The start state is captured before the ladder turns checkpointing on; putting back the
    model's flag (not its layers', which the switch added) would leave GPT-2 half switched: its
    model passing the key/value cache to checkpointed layers that recompute into it."""
    model = gpt2()
    attributes = Attributes(model)
    attributes.capture()
    Checkpointing(model).set(True)
    attributes.restore()
    assert hf_flags(model) == [True, True, True]


def test_a_bf16_gpt2_that_needs_checkpointing_ends_as_the_plain_loop():
    """Without a capacity check the ladder walks fp32, bf16, then bf16 with checkpointing, and
    replays (before: MemoryNotReleased, 483.50 KiB held through the cache GPT-2 then made). Dropout
    on: the plain loop with the same splits (bf16 autocast around the forward, transformers'
    checkpointing) gives the same parameters, bit for bit."""
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(2):
        ids = torch.randint(0, 500, (8, 64), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    model = gpt2()
    torch.manual_seed(5)
    with autofit.simulate_gpu("4MiB"):
        result = autofit.run(model, data, progress=False, cache=False, capacity_check=False)
    assert [(a.step, a.plan.micro_batch_size, a.plan.precision, a.plan.checkpointing, a.outcome)
            for a in result.attempts] == [
        (0, 8, "fp32", False, "oom"), (0, 8, "bf16", False, "oom"), (0, 8, "bf16", True, "oom"),
        (0, 4, "bf16", True, "ok"), (1, 6, "bf16", True, "oom"), (1, 4, "bf16", True, "oom"),
        (1, 2, "bf16", True, "ok")]
    plain = gpt2()
    Checkpointing(plain).set(True)
    opt = torch.optim.AdamW(plain.parameters())
    torch.manual_seed(5)
    for batch, micro in zip(data, [4, 2]):
        for i in range(0, 8, micro):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = plain(**device_copy({k: v[i:i + micro] for k, v in batch.items()})).loss
            (loss * (micro / 8)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert torch.equal(mine, theirs)
