"""Batch-coupled layers are never silent (autofit/plans/coupling.py)."""

import logging
import re

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import autofit
from autofit.plans.coupling import Coupling, coupled_modules
from autofit.plans.sizelog import SizeLog
from autofit.plans.plan import Plan


def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU()),
        nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(4 * 6 * 6, 3)))


def images(n=3, rows=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows, 3, 6, 6, generator=g), "y": torch.randint(0, 3, (rows,), generator=g)}
            for _ in range(n)]


def loss_fn(model, batch):
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def fits_rows(model, limit):
    """Every training forward of more than `limit` rows runs out of memory, before anything runs."""
    def hook(module, args):
        if module.training and args[0].shape[0] > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 MiB ({args[0].shape[0]} rows)")
    return model.register_forward_pre_hook(hook)


def plain_loop(model, batches, micro_sizes):
    torch.manual_seed(1234)
    opt = sgd(model.parameters())
    model.train()
    for batch, micro in zip(batches, micro_sizes):
        n = len(batch["y"])
        for i in range(0, n, micro):
            part = {k: v[i:i + micro] for k, v in batch.items()}
            (loss_fn(model, part) * (len(part["y"]) / n)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert different == []


def attempts(result):
    return [(a.step, a.plan.micro_batch_size, a.plan.checkpointing, a.plan.offload_optimizer, a.outcome)
            for a in result.attempts]


def test_a_split_cnn_with_batchnorm_equals_the_plain_loop_with_its_final_splits(caplog):
    batches = images()
    model = cnn()
    fits_rows(model, 8)
    torch.manual_seed(1234)
    with caplog.at_level(logging.INFO, logger="autofit"):
        result = autofit.run(model, batches, loss_fn=loss_fn, optimizer=sgd, precision="fp32", progress=False)
    # Every whole-batch plan first (checkpointing, offload, both; cheapest first), then the split.
    assert attempts(result)[:5] == [(0, 16, False, False, "oom"), (0, 16, True, False, "oom"),
                                    (0, 16, False, True, "oom"), (0, 16, True, True, "oom"),
                                    (0, 8, True, True, "ok")]
    finals = [h["plan"].micro_batch_size for h in result.history]
    assert finals[0] == 8 and all(h["plan"].checkpointing for h in result.history)
    # Parameters and buffers (running statistics, num_batches_tracked) as a plain loop without
    # checkpointing computes them: the recompute in backward did not update them a second time.
    assert_same_state(model, plain_loop(cnn(), batches, finals))
    warned = [r for r in caplog.records if "batch-coupled" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in warned] == [(
        "WARNING", "Sequential has batch-coupled layers (0.1, 1.1): splitting a global batch into micro-batches "
        "changes what they compute (statistics over each micro-batch). autofit keeps the batch whole first "
        "(precision as allowed, checkpointing, offload) and splits only when nothing whole fits; "
        "allow_split=False forbids splitting.")]
    assert result.batch_coupled == ["0.1", "1.1"]
    assert "batch-coupled layers (0.1, 1.1): global batches were split into micro-batches of 8 rows" in \
        autofit.explain(result)
    assert not any(vars(m).get("_forward_pre_hooks") for m in model.modules() if isinstance(m, nn.BatchNorm2d))


def test_forbidding_splits_keeps_batches_whole_or_says_why_not():
    batches = images(n=2)
    model = cnn()
    handle = fits_rows(model, 8)
    with pytest.raises(autofit.DoesNotFit, match=re.escape(
            "splitting the global batch is forbidden (allow_split=False) and no whole-batch plan fits")) as error:
        autofit.run(model, batches, loss_fn=loss_fn, optimizer=sgd, precision="fp32", progress=False,
                    allow_split=False)
    assert [(a.plan.micro_batch_size, a.plan.checkpointing, a.plan.offload_optimizer) for a in error.value.attempts] \
        == [(16, False, False), (16, True, False), (16, False, True), (16, True, True)]
    handle.remove()
    fits_rows(model, 16)
    result = autofit.run(model, batches, loss_fn=loss_fn, optimizer=sgd, precision="fp32", progress=False,
                         allow_split=False, ladder=lambda p: p.with_micro_batch(4, p.global_batch))
    assert [h["plan"].micro_batch_size for h in result.history] == [16, 16]
    with pytest.raises(TypeError, match=re.escape("allow_split must be True or False but got 'no'.")):
        autofit.run(model, batches, loss_fn=loss_fn, allow_split="no")


def test_the_stepper_forbids_splits_as_run_does():
    batches = images(n=2)
    model = cnn()
    handle = fits_rows(model, 8)
    with autofit.stepper(model, sgd, loss_fn=loss_fn, precision="fp32", allow_split=False) as step:
        with pytest.raises(autofit.DoesNotFit, match=re.escape(
                "splitting the global batch is forbidden (allow_split=False) and no whole-batch plan fits")) as error:
            step(batches[0])
    assert [(a.plan.micro_batch_size, a.plan.checkpointing, a.plan.offload_optimizer) for a in error.value.attempts] \
        == [(16, False, False), (16, True, False), (16, False, True), (16, True, True)]
    handle.remove()
    fits_rows(model, 16)
    with autofit.stepper(model, sgd, loss_fn=loss_fn, precision="fp32", allow_split=False,
                         ladder=lambda p: p.with_micro_batch(4, p.global_batch)) as step:
        step.load_state_dict({"version": 1, "plan": Plan.for_batch(16, 4).to_dict(), "sizes": SizeLog().to_json()})
        assert [step(b).plan.micro_batch_size for b in batches] == [16, 16]  # the resumed split made whole
        step.load_state_dict({"version": 1, "plan": Plan.for_batch(16, 8).to_dict(), "sizes": SizeLog().to_json()})
        assert step(batches[0]).plan.micro_batch_size == 16
    with pytest.raises(TypeError, match=re.escape("allow_split must be True or False but got 'no'.")):
        with autofit.stepper(model, sgd, loss_fn=loss_fn, allow_split="no"):
            pass


def wide_cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(8 * 12 * 12, 3)))


def test_the_capacity_check_starts_whole_when_a_whole_batch_move_fits():
    """Estimated peaks (fp32, 16 rows, the capacity check's estimator): whole 593.5 KiB, whole with
    checkpointing 448 KiB (the simulated GPU measures the same step at 448 KiB), against a budget of 546.9
    KiB. The fastest fitting plan splits (micro 8 x 2, before: the start, then a probe to 12 x 2);
    the ladder would reach whole-batch checkpointing first, so the run starts there and never
    splits."""
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(16, 3, 12, 12, generator=g), "y": torch.randint(0, 3, (16,), generator=g)}
               for _ in range(2)]
    model = wide_cnn()
    torch.manual_seed(1234)
    result = autofit.run(model, batches, loss_fn=loss_fn, optimizer=sgd, budget=560_000, precision="fp32",
                         progress=False, cache=False)
    assert attempts(result) == [(0, 16, True, False, "ok"), (1, 16, True, False, "ok")]
    assert result.attempts[0].reason == (
        "estimated: the first whole-batch plan of the ladder predicted to fit (peak 448.00 KiB of "
        "546.88 KiB); batch-coupled layers keep the batch whole first")
    assert_same_state(model, plain_loop(wide_cnn(), batches, [16, 16]))
    coupling = Coupling(wide_cnn())
    assert [(p.micro_batch_size, p.precision, p.checkpointing, p.offload_optimizer)
            for p in coupling.whole_plans(16, "auto", True)] == [
        (16, "fp32", False, False), (16, "bf16", False, False), (16, "fp32", True, False), (16, "bf16", True, False),
        (16, "fp32", False, True), (16, "bf16", False, True), (16, "fp32", True, True), (16, "bf16", True, True)]
    assert Coupling(nn.Linear(2, 2)).whole_plans(16, "fp32", True) == []
    assert len(Coupling(nn.Linear(2, 2), allow_split=False).whole_plans(16, "fp32", True)) == 4


def walk(ladder, plan):
    seen = [plan]
    while (plan := ladder(plan)) is not None:
        seen.append(plan)
    return [(p.micro_batch_size, p.precision, p.checkpointing, p.offload_optimizer) for p in seen]


def test_the_whole_batch_first_ladder_is_an_exact_sequence():
    coupling = Coupling(cnn())
    assert walk(coupling.ladder(SizeLog(), "auto", True), Plan.for_batch(16)) == [
        (16, "fp32", False, False), (16, "bf16", False, False), (16, "fp32", True, False), (16, "bf16", True, False),
        (16, "fp32", False, True), (16, "bf16", False, True), (16, "fp32", True, True), (16, "bf16", True, True),
        (8, "bf16", True, True), (4, "bf16", True, True), (2, "bf16", True, True), (1, "bf16", True, True)]
    assert walk(Coupling(cnn(), allow_split=False).ladder(SizeLog(), "fp32", True), Plan.for_batch(16)) == [
        (16, "fp32", False, False), (16, "fp32", True, False), (16, "fp32", False, True), (16, "fp32", True, True)]
    plain = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # nothing coupled: the default ladder splits first
    assert walk(Coupling(plain).ladder(SizeLog(), "fp32", True), Plan.for_batch(16))[1] == (8, "fp32", False, False)


class Declared(nn.Module):
    batch_coupled = True  # e.g. an in-batch contrastive loss head

    def forward(self, x):
        return x - x.mean(0)


def test_detection_covers_every_batchnorm_and_declared_modules():
    frozen = nn.BatchNorm1d(3)
    frozen.batch_coupled = False
    model = nn.Sequential(nn.BatchNorm1d(3), nn.SyncBatchNorm(3), nn.LazyBatchNorm1d(), nn.BatchNorm3d(3),
                          Declared(), frozen, nn.LayerNorm(3), nn.GroupNorm(1, 3), nn.InstanceNorm1d(3))
    assert [name for name, _ in coupled_modules(model)] == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recompute_in_backward_leaves_running_statistics_alone(reentrant):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Tracking())
    x = torch.randn(8, 4)
    plain = make()
    plain(x).sum().backward()
    model = make()
    coupling = Coupling(model)
    coupling.guard()
    checkpoint(model, x.requires_grad_(), use_reentrant=reentrant).sum().backward()
    assert_same_state(model, plain)
    assert int(model[1].num_batches_tracked) == 1 and int(model[2].calls) == 1
    coupling.close()
    checkpoint(model, x, use_reentrant=reentrant).sum().backward()  # unguarded: counted twice
    assert int(model[1].num_batches_tracked) == 3


class Tracking(nn.Module):
    """A declared module with its own buffer written in forward."""
    batch_coupled = True

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return x


def test_phase_first_moves_stay_and_keep_the_batch_whole():
    from autofit.plans.ladder import offers
    ladder = Coupling(cnn()).ladder(SizeLog(), "fp32", True)
    plan = Plan.for_batch(16)
    assert [m(plan).per_parameter_step or m(plan).offload_optimizer for m in offers(ladder, "optimizer.step")[:2]] \
        == [True, True]
    forbidden = Coupling(cnn(), allow_split=False).ladder(SizeLog(), "fp32", True, user=Coupling(cnn()).ladder(
        SizeLog(), "fp32", True))
    assert walk(forbidden, plan) == [(16, "fp32", False, False), (16, "fp32", True, False), (16, "fp32", False, True),
                                     (16, "fp32", True, True)]
    assert [m(plan).micro_batch_size for m in offers(forbidden, "optimizer.step")[:2]] == [16, 16]


def flat_cnn(seed=0):
    """One Sequential of single layers: each BatchNorm is itself a checkpointed block."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


@pytest.mark.parametrize("make", [cnn, flat_cnn], ids=["blocks", "layers"])
def test_checkpointing_moves_running_statistics_once_at_every_granularity(make):
    """Checkpointing on and the batch split in two (more than 8 rows run out of memory): the
    running statistics (num_batches_tracked too) are the plain loop's with the same splits."""
    def ladder(plan):
        if plan.checkpointing:
            return None
        return plan.replace(checkpointing=True, micro_batch_size=plan.micro_batch_size // 2)
    model = make()
    hook = fits_rows(model, 8)
    torch.manual_seed(1234)
    result = autofit.run(model, images(), loss_fn=loss_fn, optimizer=sgd, precision="fp32", progress=False,
                         cache=False, ladder=ladder)
    hook.remove()
    splits = [h["plan"].micro_batch_size for h in result.history]
    assert [a.plan.checkpointing for a in result.attempts if a.outcome == "ok"] == [True] * 3
    assert splits == [8, 8, 8]  # the probes above 8 rows ran out of memory
    reference = plain_loop(make(), images(), splits)
    assert_same_state(model, reference)
    tracked = [int(m.num_batches_tracked) for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert tracked == [6, 6]  # three steps of two micro-batches


def swiftformer(seed=0):
    """A Hugging Face model with BatchNorm in the layers its own checkpointing switch recomputes."""
    import transformers
    config = transformers.SwiftFormerConfig(depths=[1, 1, 1, 1], embed_dims=[8, 8, 16, 16], num_labels=3,
                                            image_size=32)
    torch.manual_seed(seed)
    return transformers.SwiftFormerForImageClassification(config)


def test_the_models_own_checkpointing_switch_moves_running_statistics_once():
    g = torch.Generator().manual_seed(1)
    batches = [{"pixel_values": torch.randn(4, 3, 32, 32, generator=g), "labels": torch.randint(0, 3, (4,), generator=g)}
               for _ in range(2)]

    def ladder(plan):
        return None if plan.checkpointing else plan.replace(checkpointing=True, micro_batch_size=2)
    model = swiftformer()

    def two_rows(module, args, kwargs):
        if kwargs["pixel_values"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
    hook = model.register_forward_pre_hook(two_rows, with_kwargs=True)
    result = autofit.run(model, batches, optimizer=sgd, precision="fp32", progress=False, cache=False,
                         ladder=ladder)
    hook.remove()
    assert [h["plan"].micro_batch_size for h in result.history] == [2, 2]
    assert result.plan.checkpointing and not model.is_gradient_checkpointing  # switched back off
    reference = swiftformer()
    opt = sgd(reference.parameters())
    for batch in batches:
        for i in (0, 2):
            (reference(**{k: v[i:i + 2] for k, v in batch.items()}).loss * 0.5).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tracked = {int(b) for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}
    assert tracked == {4}
    sa, sb = model.state_dict(), reference.state_dict()
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []


def wide_images(n=2):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(16, 3, 12, 12, generator=g), "y": torch.randint(0, 3, (16,), generator=g)}
            for _ in range(n)]


EVERY_WHOLE_PLAN = [(0, 16, False, False, "oom"), (0, 16, True, False, "oom"), (0, 16, False, True, "oom"),
                    (0, 16, True, True, "oom")]


@pytest.mark.parametrize("capacity_check", [True, False])
def test_forbidding_splits_holds_on_every_path(capacity_check, tmp_path, monkeypatch):
    """At 300,000 B no whole-batch plan of wide_cnn fits (the capacity check predicts micro 8 with
    checkpointing): with allow_split=False neither the capacity check's sizes, nor a cached split
    plan, nor the ladder split the batch; each whole plan is tried once, then DoesNotFit."""
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    batches = wide_images()
    common = dict(loss_fn=loss_fn, optimizer=sgd, budget=300_000, precision="fp32", progress=False,
                  capacity_check=capacity_check)
    split = autofit.run(wide_cnn(), batches, **common)  # allowed: it splits, and the cache keeps the split
    assert split.plan.micro_batch_size == 8
    for cache in (False, True):
        with pytest.raises(autofit.DoesNotFit, match=re.escape("allow_split=False")) as error:
            autofit.run(wide_cnn(), batches, **common, cache=cache, allow_split=False)
        tried = [(a.step, a.plan.micro_batch_size, a.plan.checkpointing, a.plan.offload_optimizer, a.outcome)
                 for a in error.value.attempts]
        # The cache's plan (the split run's last) is made whole and tried first, the ladder's whole
        # plans after it next, and those before it last (the ladder's reach).
        cached = (0, 16, split.plan.checkpointing, split.plan.offload_optimizer, "oom")
        at = EVERY_WHOLE_PLAN.index(cached) if cache else 0
        assert tried == EVERY_WHOLE_PLAN[at:] + EVERY_WHOLE_PLAN[:at]
        with autofit.stepper(wide_cnn(), sgd, loss_fn=loss_fn, budget=300_000, precision="fp32", cache=cache,
                             capacity_check=capacity_check, allow_split=False) as step:
            with pytest.raises(autofit.DoesNotFit) as error:
                step(batches[0])
        assert [a.plan.micro_batch_size for a in error.value.attempts] == [16, 16, 16, 16]


def test_a_coupled_model_tries_every_whole_plan_then_splits_as_the_plain_loop_does():
    batches = wide_images()
    model = wide_cnn()
    torch.manual_seed(1234)
    result = autofit.run(model, batches, loss_fn=loss_fn, optimizer=sgd, budget=300_000, precision="fp32",
                         progress=False, cache=False, capacity_check=False)
    assert attempts(result) == EVERY_WHOLE_PLAN + [(0, 8, True, True, "ok"), (1, 12, True, True, "oom"),
                                                   (1, 8, True, True, "ok")]
    assert "MemoryNotReleased" not in str(result.attempts)
    assert_same_state(model, plain_loop(wide_cnn(), batches, [8, 8]))
