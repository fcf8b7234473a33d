"""The ladder's reach: every plan the capacity check would consider is tried before DoesNotFit
(plans/reach.py)."""

import re

import pytest
import torch
from torch import nn

import autofit
from autofit.plans.plan import Plan
from autofit.plans.reach import Reach, configurations
from autofit.plans.sizelog import SizeLog


def net(rows_that_fit=4):
    """Checkpointing costs more than it saves here (every checkpointed forward runs out of memory),
    and a forward of more than `rows_that_fit` rows runs out of memory too."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(4)], nn.Linear(128, 2))

    def costly(module, args):
        if getattr(module[0].forward, "__autofit_checkpoint__", False) or args[0].shape[0] > rows_that_fit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    model.register_forward_pre_hook(costly)
    return model


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 128, generator=g), torch.randint(0, 2, (16,), generator=g)) for _ in range(2)]


def loss_fn(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def tried(attempts):
    return [(a.step, a.plan.micro_batch_size, a.plan.checkpointing, a.plan.offload_optimizer, a.outcome)
            for a in attempts]


def test_the_ladder_reaches_offload_without_checkpointing_before_giving_up():
    """At 700,000 B with capacity_check=False (the path of every model the estimator cannot
    estimate) the ladder's path ends at micro 1 with checkpointing and offload, which fails; the
    plans it passed by come next, cheapest first, and micro 4 with offload alone trains. Before the
    reach the run ended DoesNotFit after the first seven attempts."""
    model = net()
    result = autofit.run(model, data(), loss_fn=loss_fn, optimizer=adamw, budget=700_000, precision="fp32",
                         progress=False, cache=False, capacity_check=False)
    assert tried(result.attempts) == [
        (0, 16, False, False, "oom"), (0, 8, False, False, "oom"), (0, 8, True, False, "oom"),
        (0, 4, True, False, "oom"), (0, 2, True, False, "oom"), (0, 1, True, False, "oom"),
        (0, 1, True, True, "oom"),
        (0, 4, False, False, "oom"),  # the reach: plain at 4 rows; its optimizer state does not fit
        (0, 4, False, True, "ok"),    # the optimizer-state phase's move: offload alone
        (1, 16, False, True, "oom"), (1, 4, False, True, "ok")]
    plain = net(rows_that_fit=16)
    opt = adamw(plain.parameters())
    for x, y in data():
        for i in range(0, 16, 4):
            (loss_fn(plain, (x[i:i + 4], y[i:i + 4])) * 0.25).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert (mine - theirs).abs().max().item() <= 1e-6


def test_the_refusal_says_what_was_tried():
    with pytest.raises(autofit.DoesNotFit, match=re.escape(
            "Lower the global batch or give a larger budget: checkpointing and offload were tried, alone and "
            "with smaller micro-batches (the attempts below).")) as error:
        autofit.run(net(rows_that_fit=0), data(), loss_fn=loss_fn, optimizer=adamw, budget=700_000,
                    precision="fp32", progress=False, cache=False, capacity_check=False)
    plans = [(a.plan.micro_batch_size, a.plan.checkpointing, a.plan.offload_optimizer) for a in error.value.attempts]
    # each plan once; every configuration down to one row (larger sizes of a configuration whose
    # smaller size failed are known to fail without an attempt)
    assert len(plans) == len(set(plans))
    assert {(c, o) for m, c, o in plans if m == 1} == {(False, False), (True, False), (False, True), (True, True)}


def test_configurations_are_ordered_by_cost_and_reach_walks_past_what_does_not_apply():
    assert [(c["precision"], c["checkpointing"], c["offload_optimizer"]) for c in configurations("auto")] == [
        ("fp32", False, False), ("bf16", False, False), ("fp32", True, False), ("bf16", True, False),
        ("fp32", False, True), ("bf16", False, True), ("fp32", True, True), ("bf16", True, True)]
    assert configurations("fp32", checkpoint=False) == [
        {"precision": "fp32", "checkpointing": False, "offload_optimizer": False},
        {"precision": "fp32", "checkpointing": False, "offload_optimizer": True}]
    sizes = SizeLog()
    sizes.record(Plan(16), False, 16)  # plain fails from 16 rows up
    reach = Reach(sizes, configurations("fp32"), restart=True)
    assert reach(Plan(16)) == Plan(8, 2)
    whole = Reach(sizes, configurations("fp32"), whole=True)
    assert whole(Plan(16)) == Plan(16, checkpointing=True)
    assert whole(Plan(8, 2)) is None  # a rung of whole plans never takes a split plan back to whole
    from autofit.plans.ladder import step_down
    no_checkpointing = lambda p: "no blocks" if p.checkpointing else None  # noqa: E731
    assert step_down(whole, Plan(16), not_applicable=no_checkpointing)[0] == Plan(16, offload_optimizer=True)


def test_weights_above_the_budget_end_the_run_after_one_attempt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))  # 259.50 KiB of weights
    batches = [(torch.randn(16, 256), torch.randint(0, 2, (16,)))]
    with pytest.raises(autofit.DoesNotFit, match=re.escape(
            "global batch 16 at step 0 on simulated GPU (97.66 KiB): the weights and what the device held before "
            "the step (259.50 KiB) already fill the budget (97.66 KiB), so no plan can fit: use a smaller model, "
            "freeze part of it, or give a larger budget.")) as error:
        autofit.run(model, batches, loss_fn=loss_fn, budget=100_000, progress=False, cache=False,
                    capacity_check=False)
    assert [(a.plan.micro_batch_size, a.where, a.outcome) for a in error.value.attempts] == [(16, "copy-in", "oom")]
