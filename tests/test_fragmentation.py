"""Fragmentation is a move (docs/simulated-gpu.md): an OOM that the caching allocator's holes caused
is replayed at the same plan after the cache is emptied, once per global batch, before the ladder
steps down; the replay's attempt says "fragmentation" and why."""

import pytest
import torch

import autofit
from autofit.engine.controller import Controller, Policy
from autofit.engine.step import StepRunner
from autofit.gpu import fragmentation
from autofit.gpu.device import open_device
from autofit import torch_internals as ti
from autofit.gpu.fragmentation import (AllocatorSettings, ExpandableSegments, Fragmentation, cuda_allocator_settings,
                                       requested, restored, with_expandable_segments)
from autofit.plans.ladder import default_ladder
from autofit.plans.sizelog import SizeLog
from autofit.plans.plan import Plan

MiB, GiB = 2**20, 2**30
ROWS, EVAL_ROWS = 2048, 1800


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.Dropout(0.1), torch.nn.GELU(),
                               torch.nn.Linear(512, 1536), torch.nn.GELU(), torch.nn.Linear(1536, 3))


def _batch(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 16, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def _train(budget, eval_rows=0, caps="reserved", segments=None):
    """One global batch of 2048 rows from micro 1024 x 2, on a simulated GPU whose cache an
    evaluation over a larger batch (`eval_rows`, no gradients) left behind; `segments`: the
    device's ExpandableSegments, as a CUDA device has them. -> (controller, loss)."""
    model = _mlp()
    with autofit.simulate_gpu(budget, caps=caps), open_device() as device, restored(device):
        device.segments = segments
        device.place_model(model)
        if eval_rows:
            model.eval()
            with torch.no_grad():
                model(_batch(eval_rows, 1)[0])  # its segments stay cached, wholly free
            model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        runner = StepRunner(model, optimizer, device, loss_fn=_loss)
        sizes = SizeLog()
        controller = Controller(runner, default_ladder(sizes, "fp32"), Plan(1024, 2), sizes=sizes,
                                policy=Policy(probe_up=False, quiet=True))
        loss = controller.train(_batch(ROWS, 2), 0)
        runner.close()
    return controller, loss


def _attempts(controller):
    return [(a.plan.micro_batch_size, a.plan.accumulation_steps, a.outcome) for a in controller.attempts]


def test_a_cache_fragmented_by_an_earlier_pass_is_emptied_and_the_same_plan_succeeds():
    controller, loss = _train(46 * MiB, EVAL_ROWS)
    assert _attempts(controller) == [(1024, 2, "oom"), (1024, 2, "ok")]
    failed, retried = controller.attempts
    assert failed.reason == "start: the whole global batch at once"
    assert retried.reason == ("fragmentation: 9.73 MiB of 34.00 MiB reserved was unallocated when a "
                              "20.00 MiB segment for 6.00 MiB could not be reserved; emptied the cache, "
                              "then the same plan again")
    assert not controller.sizes.known_to_fail(Plan(1024, 2))  # a failure the replay survived is no verdict
    # The replay trained exactly what an unconstrained step trains.
    free, free_loss = _train(None)
    assert _attempts(free) == [(1024, 2, "ok")] and loss == free_loss


def test_where_the_allocator_settings_can_be_written_segments_turn_expandable_and_come_back_after_the_run():
    written = ["max_split_size_mb:128"]  # the settings the run finds, then each one written
    segments = ExpandableSegments(AllocatorSettings(lambda: written[-1], written.append), environ={})
    controller, loss = _train(46 * MiB, EVAL_ROWS, segments=segments)
    assert _attempts(controller) == [(1024, 2, "oom"), (1024, 2, "ok")]
    assert controller.attempts[1].reason.endswith(
        "emptied the cache, switched on expandable segments, then the same plan again")
    assert written[1:] == ["max_split_size_mb:128,expandable_segments:True",
                       "max_split_size_mb:128,expandable_segments:False"]  # put back when the run ended
    assert loss == _train(None)[1]


def test_on_a_torch_that_cannot_read_the_allocator_settings_a_fragmented_oom_is_replayed_all_the_same(
        monkeypatch, caplog):
    """torch before 2.12 has no run-time getter of the allocator's settings: the switch is skipped
    (one line, when the device is opened), and the fragmented OOM is still emptied and replayed."""
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    ti.supported.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="autofit"):
            segments = ExpandableSegments(cuda_allocator_settings())
            controller, loss = _train(46 * MiB, EVAL_ROWS, segments=segments)
    finally:
        ti.supported.cache_clear()
    assert _attempts(controller) == [(1024, 2, "oom"), (1024, 2, "ok")]
    assert controller.attempts[1].reason.endswith("emptied the cache, then the same plan again")
    assert [r.getMessage().split(":")[1] for r in caplog.records] == [
        " expandable segments after fragmentation skipped"]
    assert loss == _train(None)[1]


def test_when_emptying_the_cache_does_not_help_the_ladder_steps_down():
    controller, _ = _train(40 * MiB)
    assert _attempts(controller) == [(1024, 2, "oom"), (1024, 2, "oom"), (512, 4, "ok")]
    assert controller.attempts[1].reason.startswith("fragmentation: ")
    assert controller.attempts[2].reason == "smaller micro-batch, more accumulation (not below 8)"
    assert controller.sizes.known_to_fail(Plan(1024, 2))


def test_holes_too_small_for_the_segment_step_down_at_once():
    # The same fragmented start with less memory: the 20 MiB segment does not fit even with the
    # holes given back, so there is nothing to retry.
    controller, _ = _train(44 * MiB, EVAL_ROWS)
    assert _attempts(controller) == [(1024, 2, "oom"), (512, 4, "ok")]


def test_a_budget_on_allocated_bytes_never_blames_the_cache():
    controller, _ = _train(27 * MiB, EVAL_ROWS, caps="allocated")  # peaks: 30.3 MiB at 1024, 18.3 at 512
    assert [a.reason.split(":")[0] for a in controller.attempts] == [
        "start", "smaller micro-batch, more accumulation (not below 8)"]
    assert _attempts(controller) == [(1024, 2, "oom"), (512, 4, "ok")]


@pytest.mark.parametrize("request_, free, unallocated, fragmented", [
    (120 * MiB, int(24.81 * MiB) + 768 * MiB, 768 * MiB, True),  # seed 004: 0.75 GiB held in holes
    (6 * MiB, 20 * MiB, 14 * MiB, True),       # a 20 MiB segment: 6 MiB free without the holes
    (4 * MiB, int(19.31 * MiB), int(1.31 * MiB), False),  # the segment lacks more than the holes hold
    (4 * MiB, 25 * MiB, 3 * MiB, False),       # room without the holes: not the cache's doing
    (12 * MiB, 12 * MiB, 12 * MiB, True),      # >= 10 MiB: a segment of the request rounded to 2 MiB
    (12 * MiB, 11 * MiB, 11 * MiB, False),
    (512, 2 * MiB, 2 * MiB, True),             # the small pool's 2 MiB segment
    (None, 20 * MiB, 14 * MiB, False),         # no request size in the message
])
def test_the_threshold_is_the_segment_the_request_needed(request_, free, unallocated, fragmented):
    assert Fragmentation(request_, 40 * MiB, unallocated, free).fragmented is fragmented


def test_the_request_is_read_from_the_message_and_its_causes():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 MiB. GPU 0")
    assert requested(oom) == 6 * MiB
    assert requested(RuntimeError("Tried to allocate 512 bytes (GPU 0; ...)")) == 512
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB.")
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("wrapped") from oom
    except RuntimeError as wrapped:
        assert requested(wrapped) == int(1.5 * GiB)
    assert requested(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")) is None


def test_an_injected_fault_is_not_fragmentation():
    with autofit.simulate_gpu(64 * MiB, caps="reserved") as gpu, open_device() as device:
        keep = torch.zeros(256 * 1024)  # 1 MiB: a 2 MiB segment, half of it a hole
        gpu.fail_at(gpu.allocation_count)
        with pytest.raises(torch.OutOfMemoryError) as failure:
            torch.zeros(10)
        assert fragmentation.measure(device, failure.value) is None
        real = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        found = fragmentation.measure(device, real)
        assert (found.request, found.reserved, found.unallocated, found.free) == (
            2 * MiB, 2 * MiB, 1 * MiB, 63 * MiB)
        del keep


@pytest.mark.parametrize("settings, environ, expected", [
    ("", {}, "expandable_segments:True"),
    ("max_split_size_mb:128", {}, "max_split_size_mb:128,expandable_segments:True"),
    ("expandable_segments:False", {}, None),                          # the user's choice stands
    ("", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),
    ("", {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, None),   # already on
])
def test_expandable_segments_are_added_to_the_allocator_settings_unless_chosen(settings, environ, expected):
    assert with_expandable_segments(settings, environ) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_new_segments_are_expandable_after_the_switch_and_the_settings_come_back():
    import os
    if not ti.supported(ti.ALLOCATOR_SETTINGS):
        pytest.skip(f"torch {torch.__version__} cannot read the allocator's settings (torch >= 2.12 can)")
    before = ti.allocator_settings()
    if with_expandable_segments(before, os.environ) is None or torch.cuda.get_allocator_backend() != "native":
        pytest.skip("expandable segments already chosen, or not the native allocator")

    def expandable(tensor):
        for segment in torch.cuda.memory_snapshot():
            if segment["address"] <= tensor.data_ptr() < segment["address"] + segment["total_size"]:
                return segment.get("is_expandable", False)
        raise AssertionError("no segment holds the tensor")

    with open_device() as device:
        fixed = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
        assert fragmentation.free(device) == "emptied the cache, switched on expandable segments"
        grown = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
        assert (expandable(fixed), expandable(grown)) == (False, True)
        assert fragmentation.free(device) == "emptied the cache"  # on already: nothing to switch
        del fixed, grown
    assert ti.allocator_settings() == ",".join(
        s for s in (before, "expandable_segments:False") if s)
    torch.cuda.empty_cache()


def _evaluate(budget, prior_rows):
    """autofit.evaluate of one 2048-row batch on a simulated GPU whose cache a larger no-grad pass
    (`prior_rows`) left behind. -> the EvalResult."""
    model = _mlp().eval()
    with autofit.simulate_gpu(budget, caps="reserved"):
        if prior_rows:
            with torch.no_grad():
                model(_batch(prior_rows, 1)[0])
        return autofit.evaluate(model, [_batch(ROWS, 2)], loss_fn=_loss, batch_size=ROWS)


def test_evaluation_replays_a_batch_the_cache_holes_failed_at_the_same_size():
    result = _evaluate(40 * MiB, EVAL_ROWS)
    assert [(a.batch_size, a.outcome) for a in result.attempts] == [(2048, "oom"), (2048, "ok")]
    assert result.attempts[1].reason.startswith("fragmentation: 18.80 MiB of 34.00 MiB reserved")
    assert result.attempts[1].reason.endswith("emptied the cache, then the same plan again")
    free = _evaluate(None, 0)  # the same loss as an unconstrained evaluation, at the same size
    assert [(a.batch_size, a.outcome) for a in free.attempts] == [(2048, "ok")]
    assert result.loss == free.loss and result.batch_size == 2048


def test_evaluation_halves_when_emptying_the_cache_does_not_help():
    result = _evaluate(34 * MiB, EVAL_ROWS)
    assert [(a.batch_size, a.outcome) for a in result.attempts] == [(2048, "oom"), (2048, "oom"), (1024, "ok")]
    assert result.attempts[1].reason.startswith("fragmentation: ")
    assert result.attempts[2].reason == "halved after 2048 rows ran out of memory"
