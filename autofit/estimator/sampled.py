"""Measured on a small real sample: the estimate of a model that fake tensors cannot follow.

Fake tensors have shapes but no values, so a step that needs values the fake-tensor estimator cannot
hint (`.numpy()`, a custom kernel without a meta function, a meta kernel stricter than this
machine's) cannot be estimated on them. Then the real step runs on one and two real rows of the
batch (two and three when one row does not run, as BatchNorm's), counted by the estimator's own meter (the simulated GPU's live-bytes counter), and the peak is
extrapolated linearly in the micro-batch size: activations grow with the rows, the rest does not.
An offloaded plan is the same plan on the device less the optimizer state it moves to the host.

The model, its optimizer and torch's RNG are left exactly as they were: parameters, buffers,
gradients, optimizer state (the same tensor objects, their values copied back), param_groups,
train/eval modes and the global RNG state are restored after every measurement. A model on `meta`
has no values to run, and cannot be sampled.
"""

from __future__ import annotations

import contextlib

import torch

from autofit.engine.batches import slice_batch
from autofit.engine.replay import TRIAL, StartState
from autofit.gpu.device import _map_tensors
from autofit.estimator.walk import MemoryEstimate, Walker, _FakeDevice
from autofit.estimator.fakes import warm
from autofit.plans.plan import Plan

# Micro-batch sizes measured, the first two that run (BatchNorm refuses one row in training);
# the peak is a line through them.
SAMPLE_ROWS = (1, 2, 3, 4)


class SampledEstimator(Walker):
    """`measure(plan)` like the fake-tensor Estimator's, measured on real rows of the batch."""

    method = "sampled"

    def __init__(self, model, batch, optimizer=None, loss_fn=None, *, device_type: str = "cuda",
                 widest: bool = False):
        tensors = list(model.parameters()) + list(model.buffers())
        if any(t.is_meta for t in tensors):
            raise ValueError("the model's tensors are on meta: there are no values to run a real sample "
                             "through.")
        self.device_type, self.loss_fn, self.estimates = "cpu", loss_fn, 0  # real kernels run
        self.asked_device_type = device_type
        # widest: the line through the first sample that runs and the largest (SAMPLE_ROWS[-1]):
        # kernels whose small-row costs are uneven (a GRU's: +51 KB from 1 to 2 rows, +117 KB from
        # 2 to 3) are extrapolated from the span, not from two neighbouring sizes.
        self.widest = widest
        self.full_batch, self.mode, self.model = batch, contextlib.nullcontext(), model
        from autofit.engine.batches import rows_of
        self.full_rows = rows_of(batch)
        self.target = tensors[0].device if tensors else torch.device("cpu")
        if isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer = optimizer
        elif optimizer is None:
            self.optimizer = torch.optim.AdamW(model.parameters())
        else:
            self.optimizer = optimizer(list(model.parameters()))
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TypeError(f"the optimizer factory returned {type(self.optimizer).__name__}; it "
                                f"must return a torch.optim.Optimizer.")
        self.optimizer_name = type(self.optimizer).__name__
        with self._quiet(), StartState(model, self.optimizer, None, mode=TRIAL).held():
            warm(self.optimizer)  # the state a second step holds
            self.resident = self._resident()

    def _device(self, meter):
        return _SampleDevice(meter, self.target)

    def measure(self, plan: Plan) -> MemoryEstimate:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be an autofit.Plan but got {type(plan).__name__}.")
        on_device = self.measured_plan(plan)  # offload's samples run on the device (offload_measured)
        accumulation = 2 if self.full_rows > plan.micro_batch_size else 1
        points, first_error = [], None
        with self._quiet(), StartState(self.model, self.optimizer, None, mode=TRIAL).held():
            self.model.train()  # a training step, whatever mode the caller left the model in
            warm(self.optimizer)
            for rows in SAMPLE_ROWS:
                if len(points) == 2 or rows * accumulation > self.full_rows:
                    break
                if self.widest and points and rows != SAMPLE_ROWS[-1] \
                        and SAMPLE_ROWS[-1] * accumulation <= self.full_rows:
                    continue  # straight to the largest sample
                self.batch = slice_batch(self.full_batch, 0, rows * accumulation)
                self.rows = rows * accumulation
                try:
                    estimate = self._measure(on_device.replace(micro_batch_size=rows,
                                                               accumulation_steps=accumulation))
                except Exception as error:  # e.g. BatchNorm refuses one row: try more rows
                    if points:
                        raise
                    first_error = first_error or error
                    continue
                points.append((rows, estimate, self.last_meter))
                self.last_meter = None
        if not points:
            raise first_error if first_error is not None else ValueError(
                f"the batch has {self.full_rows} row(s); a real sample needs at least one.")
        self.estimates += 1
        return _extrapolate(points, plan)


def offload_measured(estimator, plan: Plan) -> bool:
    """Optimizer offload in an estimate (plans/switches.py `estimate`): a sampled estimate runs its
    samples with the state on the device and `_extrapolate` takes the state off the peak; the
    fake-tensor estimate runs the offloaded step itself."""
    return plan.offload_optimizer and not isinstance(estimator, SampledEstimator)


def _extrapolate(points: list, plan: Plan) -> MemoryEstimate:
    """The estimate at plan.micro_batch_size rows from (rows, estimate, meter) at one or two sizes:
    the peak of forward and backward, and the optimizer step's, are each a line through them (the
    step's barely grows: the micro-batch it still holds); the larger one is the step's peak."""
    m = plan.micro_batch_size
    if len(points) == 2 and m <= points[0][0]:
        points = points[:1]
    rows, last, meter = points[-1]

    def line(value):
        if len(points) == 1:
            return value(points[0])
        (r0, *_), (r1, *_) = points
        slope = max(value(points[1]) - value(points[0]), 0) / (r1 - r0)
        return value(points[1]) + round((m - r1) * slope)
    outer = line(lambda p: p[2].outer_top)
    step = line(lambda p: p[1].step_bytes or 0)
    if outer >= step:
        peak, breakdown = outer, dict(meter.outer_breakdown)
        breakdown["activations"] += outer - meter.outer_top
    else:  # the optimizer step is the peak: what the step holds, and the micro-batch
        peak, breakdown = step, dict(last.breakdown)
        breakdown["other"] += step - last.peak_bytes
    step_bytes = step or None
    if plan.offload_optimizer:  # the state, and the update's temporaries, live on the host
        state = last.resident.get("optimizer", 0)
        peak -= state
        breakdown["optimizer"] = max(breakdown["optimizer"] - state, 0)
        step_bytes = None
    # The allocator's overhead is not linear in the rows: the larger sample's is carried over.
    reserved = peak + max((last.reserved_bytes or last.peak_bytes) - last.peak_bytes, 0)
    return MemoryEstimate(plan=plan, peak_bytes=peak, breakdown=breakdown, device_type="cpu",
                          resident=dict(last.resident), optimizer=last.optimizer, step_bytes=step_bytes,
                          method="sampled", reserved_bytes=reserved)


class _SampleDevice(_FakeDevice):
    """The meter's device, with the sample's rows copied to where the model lives."""

    def __init__(self, meter, target):
        super().__init__(meter)
        self.target = target

    def to_device(self, batch):
        with self.gpu.as_kind("other"):
            return _map_tensors(batch, lambda t: t.to(self.target, copy=True))
