"""Each failure gets the move for its phase: the attempt records where it ran out of memory
(forward, backward, the first step's state creation, the optimizer update) and the ladder offers
the moves for that phase first."""

import pytest
import torch

import autofit
from autofit.diagnosis.fixes import fixes_for
from autofit.gpu.device import CpuDevice
from autofit.plans.applies import not_applicable, unavailable_changes
from autofit.plans.plan import Plan

BUDGET = 1_900_000  # bytes: forward/backward and a per-parameter AdamW step fit, a foreach step does not


def _mlp():
    """Equal-sized layers: a foreach step's temporaries are all the parameters at once, a
    per-parameter step's one layer's (with one dominant layer the two would be close)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 128)]
    for _ in range(6):
        layers += [torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 128)]
    return torch.nn.Sequential(*layers, torch.nn.GELU(), torch.nn.Linear(128, 4))


def _data(n=3, rows=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 16, generator=g), torch.randint(0, 4, (rows,), generator=g)) for _ in range(n)]


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def _run(model, rows=8, **options):
    options = {"loss_fn": _loss, "cache": False, "progress": False, "capacity_check": False, **options}
    return autofit.run(model, _data(rows=rows), **options)


def _sequence(result):
    return [(a.step, a.outcome, a.where, a.plan.describe()) for a in result.attempts]


def test_an_optimizer_step_oom_takes_a_per_parameter_step_not_bf16_or_checkpointing():
    model = _mlp()
    result = _run(model, budget=BUDGET, optimizer=lambda p: torch.optim.AdamW(p, foreach=True))
    assert _sequence(result) == [
        (0, "oom", "optimizer.step", "micro 8 x 1, fp32"),
        (0, "ok", "", "micro 8 x 1, fp32, per-parameter step"),
        (1, "ok", "", "micro 8 x 1, fp32, per-parameter step"),
        (2, "ok", "", "micro 8 x 1, fp32, per-parameter step")]
    assert result.attempts[1].reason.startswith("the optimizer updates one parameter at a time")
    # At the failure the first step had made AdamW's two moments and failed on its first temporary.
    memory = result.attempts[0].memory
    assert memory["step"] == 2 * memory["params"] and memory["optimizer"] == 0  # rolled back since
    assert memory["activations"] == 512  # the step's loss, kept for the report
    text = autofit.explain(result)
    assert "out of memory in optimizer.step." in text
    assert ("  - a per-parameter optimizer step (foreach=False): the optimizer step itself ran out of "
            "memory") in text and "[autofit did this next]" in text
    assert "gradient accumulation" not in text and "mixed precision" not in text
    assert result.attempts[0].unavailable == {} and "not offered" not in text  # every fix applies here
    assert [f.key for f in fixes_for(memory, result.attempts[0].plan, BUDGET, "optimizer.step")] == [
        "per-parameter-step", "offload"]


def test_a_step_already_per_parameter_goes_to_offload_and_says_why():
    """On a CPU tensor torch's default (foreach=None) already loops over parameters: that move does
    not apply, and offload is next."""
    model = _mlp()
    result = _run(model, budget=1_700_000)
    assert [(a.step, a.outcome, a.where, a.plan.describe()) for a in result.attempts] == [
        (0, "oom", "optimizer.step", "micro 8 x 1, fp32"),
        (0, "ok", "", "micro 8 x 1, fp32, offload"),
        (1, "ok", "", "micro 8 x 1, fp32, offload"),
        (2, "ok", "", "micro 8 x 1, fp32, offload")]
    assert result.attempts[1].reason == (
        "optimizer state moves to CPU memory (SetField(per_parameter_step=True) skipped: a "
        "per-parameter optimizer step does not apply: AdamW already updates one parameter at a time "
        "(foreach off))")
    # explain reads the same rule: it does not offer the move the ladder skipped, and says why
    skipped = ("a per-parameter optimizer step does not apply: AdamW already updates one parameter at a "
               "time (foreach off)")
    assert result.attempts[0].unavailable == {"per_parameter_step": skipped}
    text = autofit.explain(result)
    assert "  - a per-parameter optimizer step (foreach=False):" not in text
    assert f"  not offered: a per-parameter optimizer step (foreach=False) ({skipped}).\n" in text
    assert [f.key for f in fixes_for(result.attempts[0].memory, result.attempts[0].plan, 1_700_000,
                                     "optimizer.step", result.attempts[0].unavailable)] == ["lighter-model", "offload"]


def test_unavailable_changes_follow_the_applies_rule():
    """The plan changes a fix would make, judged by not_applicable as the ladder judges its moves."""
    class NoBf16(CpuDevice):
        def supports_bf16(self):
            return False

    flat = torch.nn.Linear(4, 4)  # no repeated blocks: checkpointing does not apply
    sgd = torch.optim.SGD(flat.parameters(), lr=0.1, foreach=True)  # a per-parameter step would help
    adamw = torch.optim.AdamW(flat.parameters())  # foreach=None on CPU: already one at a time
    device = CpuDevice()

    def applies(optimizer, on=device):
        return lambda plan: not_applicable(plan, flat, optimizer, on)

    checkpointing = ("activation checkpointing does not apply to Linear: it has no repeated blocks "
                     "(ModuleList/Sequential) and no Hugging Face switch")
    assert unavailable_changes(Plan(4), applies(sgd)) == {"checkpointing": checkpointing}
    assert unavailable_changes(Plan(4), applies(adamw, NoBf16())) == {
        "checkpointing": checkpointing,
        "per_parameter_step": "a per-parameter optimizer step does not apply: AdamW already updates one "
                              "parameter at a time (foreach off)"}  # fp16 still applies without bf16
    assert unavailable_changes(Plan(4, offload_optimizer=True), applies(adamw)) == {"checkpointing": checkpointing}
    assert unavailable_changes(Plan(4, precision="bf16"), applies(sgd, NoBf16())) == {}  # the plan itself cannot run
    assert unavailable_changes(Plan(4), None) == {}


def test_the_optimizer_groups_are_restored_when_the_run_ends():
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    result = _run(model, budget=BUDGET, optimizer=optimizer)
    assert result.plan.per_parameter_step
    assert [g["foreach"] for g in optimizer.param_groups] == [True]


class _FailIn:
    """Raise an injected OOM once, in the given phase of step 0's first attempt."""

    def __init__(self, model, phase):
        self.phase, self.done = phase, False
        if phase == "forward":
            model.register_forward_pre_hook(lambda m, a: self.fail())
        elif phase == "backward":
            model[-1].register_full_backward_pre_hook(lambda m, g: self.fail())

    def fail(self):
        if not self.done:
            self.done = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")

    def arm_next_allocation(self, after: int = 0):
        if not self.done:
            self.done = True
            gpu = autofit.gpu.simulate.active_gpu()
            gpu.fail_at(gpu.allocation_count + after)

    def optimizer(self, params):
        optimizer = torch.optim.AdamW(params, foreach=True)
        if self.phase == "optimizer.state":
            # the first allocation inside the first step: AdamW's first moment, being created
            optimizer.register_step_pre_hook(lambda o, a, k: self.arm_next_allocation())
        elif self.phase == "optimizer.step":
            # after step 0: the state exists, the update fails once it has written (an OOM before
            # it writes anything is replayed at the same plan: tests/test_step_prehook_oom.py)
            optimizer.register_step_post_hook(lambda o, a, k: setattr(self, "armed", True))
            optimizer.register_step_pre_hook(
                lambda o, a, k: self.arm_next_allocation(after=AFTER_WRITES) if getattr(self, "armed", 0) else None)
        return optimizer


AFTER_WRITES = 2  # foreach AdamW's third allocation of a step comes after it updated the step counters


@pytest.mark.parametrize("phase,first_move", [
    ("forward", "micro 8 x 2, fp32"),
    ("backward", "micro 8 x 2, fp32"),
    ("optimizer.state", "micro 16 x 1, fp32, offload"),
    ("optimizer.step", "micro 16 x 1, fp32, per-parameter step"),
])
def test_the_attempt_records_its_phase_and_the_ladder_answers_it(phase, first_move, monkeypatch):
    # Every step guarded, as when free memory is short: an injected OOM inside step() is undone.
    monkeypatch.setattr(autofit.engine.atomic.AtomicStep, "at_risk", lambda self, key: True)
    model = _mlp()
    fault = _FailIn(model, phase)
    result = _run(model, rows=16, optimizer=fault.optimizer, precision="fp32", budget="64MiB")
    [failed] = [a for a in result.attempts if a.outcome == "oom"]
    assert failed.where == phase
    after = result.attempts[result.attempts.index(failed) + 1]
    assert (after.step, after.outcome, after.plan.describe()) == (failed.step, "ok", first_move)


def test_an_oom_copying_the_first_micro_batch_of_a_later_step_is_read_as_copy_in():
    """The first step ends inside the optimizer's state creation; step 1's copy of its first
    micro-batch to the device then fails: the attempt says "copy-in" (not the last step's phase),
    and the ladder answers it as an activation failure (checkpointing first), not with offload."""
    model, data = _mlp(), _data()  # on the host: each micro-batch is copied to the device
    optimizer = torch.optim.AdamW(model.parameters())
    with autofit.simulate_gpu() as gpu:
        handle = optimizer.register_step_post_hook(
            lambda *_: gpu.fail_at(gpu.allocation_count) if not handle.fired else None)
        handle.fired = False

        def once(*_):
            handle.fired = True
        later = optimizer.register_step_post_hook(once)
        result = autofit.run(model, data, loss_fn=_loss, optimizer=optimizer, precision="fp32", cache=False,
                             progress=False)
        handle.remove()
        later.remove()
    assert [(a.step, a.outcome, a.where) for a in result.attempts][:3] == [
        (0, "ok", ""), (1, "oom", "copy-in"), (1, "ok", "")]
    assert result.attempts[2].plan.describe() == "micro 8 x 1, fp32, checkpointing"
