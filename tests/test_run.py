"""autofit.run: same mathematics after step-downs, exact plan sequences, every OOM survivable."""

import copy
import os

import pytest
import torch
import torch.optim.optimizer as torch_optimizer

import autofit
from autofit.plans.ladder import checkpointing, offload_optimizer
from autofit.plans.plan import Plan
from reference import bert, cls_batches, gpt2, lm_batches, max_diff, plain_loop
from reference import second_step_peak as reference_peak
from autofit.engine.checkpointing import hf_checkpointing_state

# Many runs, each ending (and recovering from an OOM) with a full gc.collect(): see frozen_heap.
pytestmark = pytest.mark.usefixtures("frozen_heap")


def second_step_peak(make_model, batch, plan):
    return reference_peak(make_model(), batch, plan)


def micro_sizes(result):
    return [h["plan"].micro_batch_size for h in result.history]


def sequence(result):
    return [(a.step, a.plan.micro_batch_size, a.outcome) for a in result.attempts]


@pytest.mark.slow
def test_micro_batch_stepdowns_keep_the_mathematics():
    batches = cls_batches(4, rows=16)
    p16 = second_step_peak(bert, batches[0], Plan(16))
    p4 = second_step_peak(bert, batches[0], Plan.for_batch(16, 4))
    budget = (p4 + p16) // 2
    model = bert()
    result = autofit.run(model, batches, budget=budget, precision="fp32", progress=False,
                         capacity_check=False)
    assert result.oom_attempts >= 1
    assert all(h["plan"].precision == "fp32" for h in result.history)
    assert [h["samples"] for h in result.history] == [16, 16, 16, 16]
    reference = plain_loop(bert(), batches, micro_sizes(result))
    assert max_diff(model, reference) <= 1e-6
    full = plain_loop(bert(), batches, [16] * 4)
    assert max_diff(model, full) <= 1e-4


def test_token_weighted_micro_batches_match_the_full_batch():
    batches = lm_batches(3, rows=8)
    model = gpt2()
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)  # the very first allocation: forces micro-batches
        result = autofit.run(model, batches, precision="fp32", progress=False,
                             ladder=lambda p: p.replace(micro_batch_size=3) if p.micro_batch_size > 3 else None)
    assert sequence(result)[:2] == [(0, 8, "oom"), (0, 3, "ok")]
    assert micro_sizes(result)[0] == 3
    reference = plain_loop(gpt2(), batches, micro_sizes(result), tokens=True)
    assert max_diff(model, reference) <= 1e-6
    full = plain_loop(gpt2(), batches, [8, 8, 8], tokens=True)
    assert max_diff(model, full) <= 1e-4


@pytest.mark.parametrize("move, field", [(checkpointing(), "checkpointing"),
                                         (offload_optimizer(), "offload_optimizer")])
def test_checkpointing_and_offload_stepdowns_keep_the_mathematics(move, field):
    batches = cls_batches(3, rows=8)
    model = bert()
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)
        result = autofit.run(model, batches, precision="fp32", progress=False, ladder=move)
    assert sequence(result) == [(0, 8, "oom"), (0, 8, "ok"), (1, 8, "ok"), (2, 8, "ok")]
    assert [getattr(h["plan"], field) for h in result.history] == [True, True, True]
    assert max_diff(model, plain_loop(bert(), batches, [8, 8, 8])) <= 1e-6
    assert not hf_checkpointing_state(model)  # the model is handed back as it came


def test_exact_sequence_of_plans_for_a_budget():
    batches = cls_batches(6, rows=16, seq=64)  # long rows: activations dominate the peak
    p8 = second_step_peak(bert, batches[0], Plan.for_batch(16, 8))
    p9 = second_step_peak(bert, batches[0], Plan.for_batch(16, 9))
    assert p9 > p8 + 1024
    result = autofit.run(bert(), batches, budget=p8 + 1024, precision="fp32", progress=False,
                         capacity_check=False)
    assert sequence(result) == [
        (0, 16, "oom"), (0, 8, "ok"),      # whole batch fails; halving lands on 8
        (1, 12, "oom"), (1, 8, "ok"),      # search upward between 8 (fits) and 16 (fails)
        (2, 10, "oom"), (2, 8, "ok"),
        (3, 9, "oom"), (3, 8, "ok"),       # 9 fails: 8 is the largest that fits
        (4, 8, "ok"), (5, 8, "ok"),        # settled: no more probes
    ]
    assert result.plan == Plan(micro_batch_size=8, accumulation_steps=2)
    reasons = [a.reason for a in result.attempts[:3]]
    assert reasons[0].startswith("start")
    assert reasons[1].startswith("smaller micro-batch")
    assert reasons[2].startswith("probe a larger micro-batch")


def test_default_ladder_reaches_bf16_then_checkpointing():
    batches = cls_batches(2, rows=8)
    model = bert()
    fails = iter(range(3))

    def oom_three_times(model_, batch):
        # training calls only: the reduction probe calls the loss_fn under no_grad before the run
        if torch.is_grad_enabled() and next(fails, None) is not None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (test)")
        return model_(**batch).loss

    result = autofit.run(model, batches, loss_fn=oom_three_times, progress=False)
    assert [(a.plan.micro_batch_size, a.plan.precision, a.plan.checkpointing, a.outcome)
            for a in result.attempts] == [
        (8, "fp32", False, "oom"), (8, "bf16", False, "oom"), (8, "bf16", True, "oom"),
        (4, "bf16", True, "ok"),
        (6, "bf16", True, "ok")]  # the next batch searches upward between 4 (fits) and 8 (failed)


def test_fixed_precision_never_changes():
    batches = cls_batches(1, rows=8)
    calls = iter(range(1))

    def oom_once(model_, batch):
        if torch.is_grad_enabled() and next(calls, None) is not None:  # not the reduction probe
            raise torch.OutOfMemoryError("CUDA out of memory. (test)")
        return model_(**batch).loss

    result = autofit.run(bert(), batches, loss_fn=oom_once, precision="fp32", progress=False)
    assert [(a.plan.precision, a.plan.checkpointing, a.outcome) for a in result.attempts] == [
        ("fp32", False, "oom"), ("fp32", True, "ok")]


def tiny():
    return bert(layers=1, hidden=16, vocab=50)


def halve(plan):
    return plan.replace(micro_batch_size=plan.micro_batch_size // 2) if plan.micro_batch_size > 1 else None


def _allocation_marks(model, batches):
    """Allocation indices where each optimizer step starts and ends, and where the run ends."""
    marks = []
    with autofit.simulate_gpu() as gpu:
        def mark(*_):
            marks.append(gpu.allocation_count)
        handles = [torch_optimizer.register_optimizer_step_pre_hook(mark),
                   torch_optimizer.register_optimizer_step_post_hook(mark)]
        try:
            autofit.run(model, batches, precision="fp32", progress=False)
        finally:
            for h in handles:
                h.remove()
        return marks, gpu.allocation_count


@pytest.mark.slow
def test_an_oom_at_every_allocation_is_survived_with_the_same_result(frozen_heap):
    """Every allocation of the first global step (forward, backward, the AdamW step that creates
    the state) and of the second step's AdamW update: the run replays and ends bit-identical."""
    batches = cls_batches(2, rows=4, seq=6, vocab=50)
    pristine = tiny()
    _allocation_marks(copy.deepcopy(pristine), batches)  # first-use caches (masks, constants)
    (first_step, first_done, second_step, second_done), end = _allocation_marks(
        copy.deepcopy(pristine), batches)
    assert first_step > 50 and second_done - second_step > 20
    # Every allocation of both AdamW steps; forward/backward with a stride (AUTOFIT_FAULT_STRIDE=1
    # for all of them: that full sweep is slow on 2 cores and was run before this test was written).
    stride = int(os.environ.get("AUTOFIT_FAULT_STRIDE", "5"))
    steps = set(range(first_step, first_done)) | set(range(second_step, second_done))
    indices = sorted(steps | set(range(0, first_step, stride)))
    references = {}
    for index in indices:
        model = copy.deepcopy(pristine)
        with autofit.simulate_gpu() as gpu:
            gpu.fail_at(gpu.allocation_count + index)
            result = autofit.run(model, batches, precision="fp32", progress=False, ladder=halve,
                                 cache=False)
            held = gpu.memory_allocated()
        assert result.oom_attempts == 1, index
        sizes = tuple(micro_sizes(result))
        if sizes not in references:
            references[sizes] = plain_loop(copy.deepcopy(pristine), batches, sizes)
        assert max_diff(model, references[sizes]) == 0.0, index
        # What stays on the device is the model: the state of the optimizer autofit built went to
        # the host with result.optimizer, to be saved.
        assert held == _model_bytes(model), index
        assert _state_bytes(result.optimizer) > 0 and not any(
            gpu.holds(v) for s in result.optimizer.state.values() for v in s.values()), index
    # A failure in step 0 halves to 2 (and step 1 probes 3); one in step 1 keeps 4 for step 0.
    assert sorted(references) == [(2, 3), (4, 2)]


def _state_bytes(optimizer):
    tensors = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    return sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in tensors)


def _model_bytes(model):
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in tensors)


def test_after_run_the_device_holds_only_the_model():
    model = bert()
    with autofit.simulate_gpu() as gpu:
        autofit.run(model, cls_batches(2, rows=8), progress=False)
        held = gpu.memory_allocated()
        live = len(gpu.live_storages())
    tensors = list(model.parameters()) + list(model.buffers())
    assert live == len({id(t.untyped_storage()) for t in tensors})
    assert held == _model_bytes(model)


def test_two_phases_do_not_carry_memory_over():
    model = bert()
    with autofit.simulate_gpu() as gpu:
        autofit.run(model, cls_batches(2, rows=8), progress=False)
        after_first = gpu.memory_allocated()
        autofit.run(model, cls_batches(2, rows=8, seed=5),
                    optimizer=lambda params: torch.optim.AdamW(params, lr=2e-6), progress=False)
        assert gpu.memory_allocated() == after_first


def test_does_not_fit_leaves_the_model_as_before_that_batch():
    batches = cls_batches(3, rows=8)
    p_first = second_step_peak(bert, batches[0], Plan(8))
    model = bert()
    with pytest.raises(autofit.DoesNotFit) as info:
        # Enough for the first step (no AdamW state yet), not for the second.
        autofit.run(model, batches, budget=p_first - 4096, progress=False, ladder=lambda p: None)
    error = info.value
    assert [(a.step, a.outcome) for a in error.attempts] == [(0, "ok"), (1, "oom")]
    assert set(error.breakdown) == {"params", "grads", "optimizer", "activations", "other"}
    assert "no plan of the ladder fits global batch 8 at step 1" in str(error)
    assert max_diff(model, plain_loop(bert(), batches[:1], [8])) == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_non_oom_errors_propagate_unchanged():
    boom = RuntimeError("CUDA error: device-side assert triggered")

    def loss_fn(model, batch):
        raise boom

    with pytest.raises(RuntimeError) as info:
        autofit.run(bert(), cls_batches(1), loss_fn=loss_fn, progress=False)
    assert info.value is boom


@pytest.mark.parametrize("kwargs, data, error, text", [
    ({}, [], ValueError, "yielded no batch"),
    ({}, [{"input_ids": torch.zeros(4, 3, dtype=torch.long), "labels": torch.zeros(5, dtype=torch.long)}],
     ValueError, "batch['input_ids'] has 4, batch['labels'] has 5"),
    ({"precision": "fp8"}, None, ValueError, "'fp8'"),
    ({"epochs": 0}, None, ValueError, "epochs must be a positive int but got 0"),
    ({"budget": "banana"}, None, ValueError, "'banana'"),
    ({"budget": "-1GiB"}, None, ValueError, "'-1GiB'"),
    ({"batch_size": 4}, None, ValueError, "batch_size=4 applies to a map-style Dataset"),
    ({"optimizer": 3}, None, TypeError, "got int"),
])
def test_bad_input_is_refused_before_training(kwargs, data, error, text):
    model = bert()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=None) as info:
        autofit.run(model, cls_batches(1) if data is None else data, progress=False, **kwargs)
    assert text in str(info.value)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_dataset_needs_a_positive_batch_size():
    dataset = torch.utils.data.TensorDataset(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="pass batch_size=N"):
        autofit.run(bert(), dataset, progress=False)
    with pytest.raises(ValueError, match="batch_size must be a positive int but got -2"):
        autofit.run(bert(), dataset, batch_size=-2, progress=False)


def test_model_without_a_loss_is_named():
    class NoLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(ValueError, match="NoLoss's output .* carries no loss|gave a loss of shape"):
        autofit.run(NoLoss(), [torch.zeros(4, 3)], progress=False)


def test_dataset_is_batched_by_the_global_batch():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(10, 3, generator=g), torch.randn(10, 1, generator=g)
    model = torch.nn.Linear(3, 1)
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    result = autofit.run(model, torch.utils.data.TensorDataset(x, y), batch_size=4, loss_fn=loss_fn,
                         progress=False)
    assert [h["samples"] for h in result.history] == [4, 4, 2]


def test_second_run_of_the_same_job_starts_from_the_cached_plan():
    batches = cls_batches(3, rows=16, seq=64)
    p8 = second_step_peak(bert, batches[0], Plan.for_batch(16, 8))
    job = dict(budget=p8 + 1024, precision="fp32", progress=False, capacity_check=False)
    first = autofit.run(bert(), batches, **job)
    assert first.oom_attempts >= 2
    second = autofit.run(bert(), batches, **job)
    assert sequence(second) == [(0, 8, "ok"), (1, 8, "ok"), (2, 8, "ok")]
    assert second.attempts[0].reason.startswith("cached: worked for this job")
    other_budget = autofit.run(bert(), batches, **{**job, "budget": p8 * 4})
    assert other_budget.attempts[0].reason.startswith("start")  # the budget is part of the key
    fresh = autofit.run(bert(), batches, **job, cache=False)
    assert fresh.oom_attempts == first.oom_attempts


def test_capacity_check_starts_near_the_largest_plan_that_fits():
    batches = cls_batches(4, rows=32, seq=64)
    peaks = {m: second_step_peak(bert, batches[0], Plan.for_batch(32, m)) for m in (11, 12, 16)}
    budget = (peaks[11] + peaks[16]) // 2        # 11 fits, 16 does not
    model = bert()
    result = autofit.run(model, batches, budget=budget, precision="fp32", progress=False)
    assert result.oom_attempts <= 2
    assert result.attempts[0].reason.startswith("estimated: fastest plan predicted to fit")
    largest = 12 if peaks[12] <= budget else 11
    assert result.plan.micro_batch_size >= 0.9 * largest
    assert max_diff(model, plain_loop(bert(), batches, micro_sizes(result))) <= 1e-6


def test_capacity_check_refuses_before_training_when_nothing_can_fit():
    batches = cls_batches(2, rows=8)
    model = bert()
    params = sum(p.numel() * 4 for p in model.parameters())
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(autofit.DoesNotFit) as info:
        autofit.run(model, batches, budget=params, progress=False)
    assert "checked before training" in str(info.value)
    assert info.value.attempts == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
