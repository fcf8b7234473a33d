"""autofit.diagnosis.leaks: each leak pattern of the seeds is found, named (what holds it, shape, bytes) and fixed.

The patterns are driven the way a run drives them: a `StepRunner` trains global batches on the
simulated GPU and `LeakWatch.after_step` is called after each one. The last tests run them through
`autofit.run` (`RunResult.leaks`).
"""

import logging

import pytest
import torch

import autofit
from autofit.gpu.device import CpuDevice, SimulatedDevice
from autofit.diagnosis.explain import explain
from autofit.diagnosis.leak_kinds import (FIX_BATCH, FIX_GROWTH, FIX_LOSS, FIX_NODE, FIX_OPTIMIZER, FIX_OUTPUT,
                                         FIX_TENSOR)
from autofit.diagnosis.leaks import LeakWatch
from autofit.diagnosis.on_device import batch_on_device
from autofit.plans.plan import Plan
from autofit.recipes.run import RunResult
from autofit.engine.step import StepRunner
from reference import bert, cls_batches, storage_bytes

MODULE = __name__
PLAN = Plan(4)
STEPS = 5  # the leftover grows at steps 1, 2, 3: found after the 4th step (index 3)


def tiny():
    return bert(layers=1, hidden=16, vocab=50)


def batches(n=STEPS):
    return cls_batches(n, rows=4, seq=8, vocab=50)


def state_bytes(optimizer):
    return storage_bytes(v for s in optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)


def drive(loss_fn, data=None, *, before=None, plan=PLAN):
    """Train `data` with a StepRunner on a simulated GPU, calling the watch after each step.

    Returns (findings, scans, the leftover after each step: device bytes beyond parameters,
    gradients and optimizer state)."""
    model = tiny()
    data = batches() if data is None else data
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        extra = before(model) if before is not None else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runner = StepRunner(model, optimizer, device, loss_fn=loss_fn)
        watch = LeakWatch(runner)
        lefts = []
        for step, batch in enumerate(data):
            runner.run(batch, plan)
            watch.after_step(step, plan, batch)
            lefts.append(watch.leftover())
        del extra
        return watch.findings, watch.scans, lefts


# -- the loss kept with its graph ---------------------------------------------------------------------

LOSSES = []


def keep_the_loss(model, batch):
    loss = model(**batch).loss
    LOSSES.append(loss)  # the bug: LOSSES.append(loss.item())
    return loss


def test_loss_appended_without_item_is_named_with_its_list_shape_bytes_and_fix(caplog):
    LOSSES.clear()
    with caplog.at_level(logging.WARNING, logger="autofit"):
        findings, scans, lefts = drive(keep_the_loss)
    # one float32 scalar per step: backward freed the activations its graph saved
    assert lefts == [512, 1024, 1536, 2048, 2560]
    assert findings == [{  # as found after the 4th step: grown at the 2nd, 3rd and 4th
        "kind": "graph-kept",
        "culprit": f"the global `LOSSES` of module {MODULE}: a list of 4 tensors with "
                   f"grad_fn=<NllLossBackward0> (float32[] each); device memory after each step "
                   f"grew 3 steps in a row under the same plan (+1.50 KiB)",
        "bytes": 4 * 512,
        "fix": FIX_LOSS}]
    assert "append loss.item()" in FIX_LOSS
    assert scans == 2  # after the first step (something beyond training state), and at the growth
    messages = [r.getMessage() for r in caplog.records if r.name == "autofit.diagnosis.leaks"]
    assert [m.split(":")[0] for m in messages] == ["leak found (graph-kept)", "leak keeps growing (graph-kept)"]
    assert f"the global `LOSSES` of module {MODULE}: a list of 1 tensor with grad_fn=<NllLossBackward0> " \
        f"(float32[]), 512 bytes. Fix: append loss.item()" in messages[0]
    LOSSES.clear()


def test_loss_item_appended_is_no_leak_and_costs_no_search():
    kept = []

    def keep_numbers(model, batch):
        loss = model(**batch).loss
        kept.append(loss.item())
        return loss

    findings, scans, lefts = drive(keep_numbers)
    assert (findings, scans, lefts) == ([], 0, [0] * STEPS)


def test_steady_steps_walk_training_state_once_and_growth_walks_it_at_every_step():
    """What training holds is summed by walking its tensors; a steady step (the same bytes
    allocated as after the last walk) walks nothing, a step after which memory moved walks again."""
    walks = {}
    for name, loss_fn in (("steady", lambda model, batch: model(**batch).loss), ("growing", keep_the_loss)):
        LOSSES.clear()
        model, data = tiny(), batches()
        with autofit.simulate_gpu() as gpu:
            device = SimulatedDevice(gpu)
            device.place_model(model)
            runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device, loss_fn=loss_fn)
            watch = LeakWatch(runner, quiet=True)
            for step, batch in enumerate(data):
                runner.run(batch, PLAN)
                watch.after_step(step, PLAN, batch)
                watch.leftover()  # read again at the same allocated bytes: no walk
            walks[name] = watch.walks
        LOSSES.clear()
    assert walks == {"steady": 1, "growing": STEPS}


def test_the_watch_keeps_no_reference_to_what_it_found():
    LOSSES.clear()
    model, data = tiny(), batches()
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        optimizer = torch.optim.AdamW(model.parameters())
        runner = StepRunner(model, optimizer, device, loss_fn=keep_the_loss)
        watch = LeakWatch(runner)
        for step, batch in enumerate(data):
            runner.run(batch, PLAN)
            watch.after_step(step, PLAN, batch)
        assert watch.findings and watch.leftover() == STEPS * 512
        LOSSES.clear()
        assert watch.leftover() == 0
        held = storage_bytes(list(model.parameters()) + list(model.buffers())) + state_bytes(optimizer)
        assert gpu.memory_allocated() == held


class Keeper:
    """A loss function object that keeps every loss in the list it was given."""

    def __init__(self, into):
        self.into = into

    def __call__(self, model, batch):
        loss = model(**batch).loss
        self.into.append(loss)
        return loss


def test_a_list_held_by_a_callers_local_variable_is_named_and_not_kept_alive_by_the_search():
    model, data = tiny(), batches()
    kept = []
    keeper = Keeper(kept)
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        optimizer = torch.optim.AdamW(model.parameters())
        runner = StepRunner(model, optimizer, device, loss_fn=keeper)
        watch = LeakWatch(runner)
        for step, batch in enumerate(data):
            runner.run(batch, PLAN)
            watch.after_step(step, PLAN, batch)
        [finding] = watch.findings
        assert finding["culprit"].startswith(
            "the local variable `kept` of test_a_list_held_by_a_callers_local_variable_is_named_and_not_"
            "kept_alive_by_the_search(): a list of 4 tensors with grad_fn=<NllLossBackward0>")
        del keeper, runner, watch, kept  # reading this frame's variables left no copy of them behind
        held = storage_bytes(list(model.parameters()) + list(model.buffers())) + state_bytes(optimizer)
        assert gpu.memory_allocated() == held


# -- outputs kept outside the step --------------------------------------------------------------------

class Recorder:
    pass


RECORDER = Recorder()


def keep_the_output(model, batch):
    out = model(**batch)
    RECORDER.last = out  # the bug: keep out.logits.detach()
    return out.loss


def test_an_output_kept_outside_the_step_is_named_by_its_attribute():
    findings, scans, lefts = drive(keep_the_output)
    assert findings == [{
        "kind": "graph-kept",
        "culprit": f"the global `RECORDER` of module {MODULE}, at .last: a SequenceClassifierOutput "
                   f"holding 2 tensors with grad_fn=<AddmmBackward0>, <NllLossBackward0> "
                   f"(float32[4, 3], float32[])",
        "bytes": 2 * 512,
        "fix": FIX_OUTPUT}]
    assert lefts == [2 * 512] * STEPS and scans == 1  # the same every step: no growth, one search
    del RECORDER.last


def test_outputs_collected_by_a_closure_are_named_by_the_captured_variable():
    def make_loss_fn():
        kept = []

        def loss_fn(model, batch):
            out = model(**batch)
            kept.append(out.logits)  # the bug: kept.append(out.logits.detach().cpu())
            return out.loss
        return loss_fn

    findings, _, lefts = drive(make_loss_fn())
    [finding] = findings
    assert finding["kind"] == "graph-kept" and finding["fix"] == FIX_OUTPUT
    assert finding["bytes"] == lefts[3] == 4 * 512
    assert finding["culprit"].startswith(
        "the variable `kept` captured by test_outputs_collected_by_a_closure_are_named_by_the_captured_"
        "variable.<locals>.make_loss_fn.<locals>.loss_fn(): a list of 4 tensors with "
        "grad_fn=<AddmmBackward0> (float32[4, 3] each); device memory after each step grew 3 steps")


NODES = []


def keep_a_forward_never_backwarded(model, batch):
    extra = model(**batch).logits  # e.g. a metric computed with autograd on
    NODES.append(extra.grad_fn)
    return model(**batch).loss


def test_a_graph_never_backwarded_counts_its_saved_activations():
    NODES.clear()
    findings, _, lefts = drive(keep_a_forward_never_backwarded)
    [finding] = findings
    assert finding["kind"] == "graph-kept" and finding["fix"] == FIX_NODE
    assert finding["culprit"].startswith(
        f"the global `NODES` of module {MODULE}: a list of 4 autograd nodes <AddmmBackward0>, keeping ")
    # every byte left behind is the activations these graphs saved for a backward that never ran
    assert finding["bytes"] == lefts[3] == 4 * lefts[0] > 4 * 10_000
    NODES.clear()


def test_tensors_without_a_graph_that_pile_up_are_named():
    kept = []

    def keep_inputs(model, batch):
        kept.append(batch["input_ids"] * 1)  # a device copy, kept
        return model(**batch).loss

    findings, scans, lefts = drive(keep_inputs)
    [finding] = findings
    assert finding == {
        "kind": "tensor-kept",
        "culprit": "the variable `kept` captured by test_tensors_without_a_graph_that_pile_up_are_named"
                   ".<locals>.keep_inputs(): a list of 4 tensors (int64[4, 8] each); device memory "
                   "after each step grew 3 steps in a row under the same plan (+1.50 KiB)",
        "bytes": lefts[3], "fix": FIX_TENSOR}
    assert lefts[3] == 4 * 512 and scans == 2


def test_a_constant_tensor_without_a_graph_is_not_a_leak():
    cache = {}

    def before(model):
        cache["table"] = torch.zeros(64, 64)  # made on the device once, never grows
        return cache

    findings, scans, lefts = drive(None, before=before)
    assert lefts == [64 * 64 * 4] * STEPS and scans == 1 and findings == []


# -- an earlier phase's optimizer ---------------------------------------------------------------------

def test_the_optimizer_of_an_earlier_phase_is_named_with_its_bytes():
    def pretrain(model):
        pretraining = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(**batches(1)[0]).loss.backward()
        pretraining.step()
        pretraining.zero_grad(set_to_none=True)
        return pretraining

    findings, scans, lefts = drive(None, before=pretrain)
    [finding] = findings
    assert finding["kind"] == "previous-optimizer" and finding["fix"] == FIX_OPTIMIZER
    parameters = list(tiny().parameters())
    assert finding["culprit"].startswith(
        f"the state of another AdamW (lr=0.0001), held by the local variable `extra` of drive(): "
        f"{2 * len(parameters)} tensor(s) (")  # exp_avg and exp_avg_sq of each parameter
    assert finding["bytes"] == lefts[0] == 2 * storage_bytes(parameters)
    assert scans == 1


# -- memory that grows with nothing to name -----------------------------------------------------------

def watch_with_numbers(steps=3, tolerance=0):
    model = torch.nn.Linear(4, 4)
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        runner = StepRunner(model, torch.optim.SGD(model.parameters(), lr=0.1), device)
        base = storage_bytes(list(model.parameters()))
        return LeakWatch(runner, steps=steps, tolerance=tolerance), base


def test_growth_nothing_python_can_see_holds_is_reported_as_memory_growth():
    watch, base = watch_with_numbers()
    plans = [PLAN] * 6
    for step, (plan, extra) in enumerate(zip(plans, [0, 0, 4096, 8192, 12288, 16384])):
        found = watch.after_step(step, plan, allocated=base + extra)
        assert bool(found) == (step == 4), step  # grew at steps 2, 3, 4: the third growth in a row
    assert watch.findings == [{
        "kind": "memory-growth",
        "culprit": "device memory left after each step grew 3 steps in a row under the same plan "
                   "(+12.00 KiB, now 12.00 KiB beyond parameters, gradients and optimizer state)",
        "bytes": 12288, "fix": FIX_GROWTH}]


@pytest.mark.parametrize("extras, plans, tolerance, found", [
    ([0, 512, 1024, 1536], [PLAN] * 4, 0, True),                          # three growths in a row
    ([0, 512, 1024, 1024, 1536], [PLAN] * 5, 0, False),                   # a pause restarts the count
    ([0, 512, 1024, 1536], [PLAN, PLAN, Plan(2, 2), Plan(2, 2)], 0, False),  # a new plan restarts it
    ([0, 512, 1024, 1536], [PLAN] * 4, 512, False),                       # within the tolerance
    ([0, 1024, 2048, 3072], [PLAN] * 4, 512, True),
])
def test_growth_needs_consecutive_steps_under_one_plan_beyond_the_tolerance(extras, plans, tolerance,
                                                                            found):
    watch, base = watch_with_numbers(tolerance=tolerance)
    for step, (plan, extra) in enumerate(zip(plans, extras)):
        watch.after_step(step, plan, allocated=base + extra)
    assert bool(watch.findings) == found


def test_a_long_leak_is_searched_for_again_after_twice_as_many_steps():
    watch, base = watch_with_numbers()
    for step in range(14):
        watch.after_step(step, PLAN, allocated=base + 512 * step)
    assert watch.scans == 3  # the first step (memory beyond training state) is not it: 0 then
    # growth of 3 (step 3), then 6 (step 6), then 12 (step 12)
    assert watch.findings[0]["bytes"] == 512 * 12


def test_bad_arguments_are_refused():
    watch, _ = watch_with_numbers()
    with pytest.raises(ValueError, match="steps must be a positive int but got 0"):
        LeakWatch(watch.runner, steps=0)
    with pytest.raises(ValueError, match=r"tolerance must be a non-negative int \(bytes\) but got -1"):
        LeakWatch(watch.runner, tolerance=-1)


# -- batches handed over on the device ----------------------------------------------------------------

def test_a_batch_already_on_the_device_is_named_with_its_fields_and_fix():
    host = batches(1)[0]
    with autofit.simulate_gpu("1GiB") as gpu:
        device = SimulatedDevice(gpu)
        on_device = {"input_ids": host["input_ids"].clone(), "labels": host["labels"]}
        assert batch_on_device(host, device) is None
        assert batch_on_device(on_device, device) == (
            "the batch arrives already on simulated GPU (1.00 GiB): batch['input_ids'] int64[4, 8] "
            f"(512 bytes), 512 bytes. Fix: {FIX_BATCH}.")
    assert batch_on_device(on_device, CpuDevice()) is None  # a plain CPU has no device memory
    assert "autofit moves each micro-batch" in FIX_BATCH and "pin_memory" in FIX_BATCH


def test_a_list_of_batches_on_the_device_is_counted_whole_and_not_taken_for_a_leak():
    model = tiny()
    with autofit.simulate_gpu() as gpu:
        data = batches()  # made on the device
        device = SimulatedDevice(gpu)
        device.place_model(model)
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device)
        watch = LeakWatch(runner)
        finding = watch.check_batch(data[0], data)
        assert finding == {
            "kind": "batch-on-device",
            "culprit": "the first batch arrives on simulated GPU (no limit): batch['input_ids'] "
                       "int64[4, 8], batch['labels'] int64[4]; the data holds 5 batches on the device, "
                       "5.00 KiB in all",
            "bytes": 5 * 1024, "fix": FIX_BATCH}
        for step, batch in enumerate(data):
            runner.run(batch, PLAN)
            watch.after_step(step, PLAN, batch)
        assert watch.findings == [finding] and watch.scans == 0 and watch.leftover() == 0
        # A DataLoader or generator makes its batches as it is read: not judged on the simulated GPU.
        assert LeakWatch(runner).check_batch(data[0], iter(data)) is None


# -- what explain says ----------------------------------------------------------------------------------

def test_explain_lists_the_leaks_with_their_fixes():
    leak = {"kind": "graph-kept", "culprit": "the global `LOSSES` of module train: a list of 3 tensors "
            "with grad_fn=<NllLossBackward0> (float32[] each)", "bytes": 1536, "fix": FIX_LOSS}
    result = RunResult(plan=PLAN)
    assert explain(result).splitlines()[-1] == "No attempt ran out of memory; nothing to fix."
    holder = type("Result", (), {"attempts": [], "plan": PLAN, "leaks": [leak]})()
    assert explain(holder).splitlines()[1:] == [
        "leaks: 1 found, memory your code keeps on the device (autofit cannot free it):",
        "  - graph-kept: the global `LOSSES` of module train: a list of 3 tensors with "
        "grad_fn=<NllLossBackward0> (float32[] each) (1.50 KiB).",
        f"    fix: {FIX_LOSS}.",
        "No attempt ran out of memory yet; the leaks above hold device memory that a longer run or a "
        "larger batch will run out of."]


# -- through autofit.run ----------------------------------------------------------------------------

def test_run_reports_the_loss_kept_across_steps():
    LOSSES.clear()
    model, data = tiny(), batches()
    with autofit.simulate_gpu():
        result = autofit.run(model, data, loss_fn=keep_the_loss, progress=False, cache=False)
    [leak] = result.leaks
    assert leak["kind"] == "graph-kept" and leak["fix"] == FIX_LOSS and leak["bytes"] == 4 * 512
    assert leak["culprit"].startswith(f"the global `LOSSES` of module {MODULE}: a list of 4 tensors with "
                                      f"grad_fn=<NllLossBackward0>")
    assert "leaks: 1 found" in explain(result)
    LOSSES.clear()


def test_run_reports_batches_handed_over_on_the_device_and_nothing_else():
    with autofit.simulate_gpu():
        data = batches()
        result = autofit.run(tiny(), data, progress=False, cache=False)
    assert [leak["kind"] for leak in result.leaks] == ["batch-on-device"]
    clean = autofit.run(tiny(), batches(), budget="1GiB", progress=False, cache=False)
    assert clean.leaks == []


def test_a_run_that_does_not_fit_carries_the_leaks_it_found_in_its_error():
    with autofit.simulate_gpu("40KiB"), pytest.raises(autofit.DoesNotFit) as raised:
        data = batches(2)
        autofit.run(tiny(), data, progress=False, cache=False, capacity_check=False)
    assert [leak["kind"] for leak in raised.value.leaks] == ["batch-on-device"]
    assert "leaks: 1 found" in explain(raised.value)
