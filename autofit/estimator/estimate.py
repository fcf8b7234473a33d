"""The estimator a caller uses: the fake-tensor walk (`autofit.estimator.walk`) with its fallbacks,
and `estimate()`, one plan's estimate.

The walk's `Walker` walks the whole model and raises what fake tensors cannot follow. `Estimator`
adds what is built on the walk: a model of alike blocks is derived from a walk through 3 of them
(`autofit.estimator.tiling`), and a model fake tensors cannot follow is measured on a few real rows
(`autofit.estimator.sampled`, said once in the log). `estimate()` prices a model sharded with FSDP2
for one rank (`autofit.estimator.sharded`). The modules built on the walk import `walk`, never this
one, so no estimator module imports another in a circle.
"""

from __future__ import annotations

import logging

import torch

from autofit.engine.interfaces import Batch, LossFn, OptimizerArg
from autofit.errors import one_line
from autofit.estimator.eager_only import EagerOnly
from autofit.estimator.sampled import SampledEstimator
from autofit.estimator.sharded import ShardedEstimator, sharding_of
from autofit.estimator.tiling import Repeated
from autofit.estimator.walk import MemoryEstimate, Walker, own_reserved  # noqa: F401  (callers read them here)
from autofit.gpu.workspaces import Workspaces
from autofit.plans.plan import Plan

log = logging.getLogger("autofit")


class Estimator(Walker):
    """Fake copies of a model, its optimizer (with state) and a batch, made once; `measure(plan)`
    runs one step per plan (`autofit.estimator.walk`), derived from 3 alike blocks where the model
    has them, measured on real rows where fake tensors cannot follow it."""

    def _sample(self, error: Exception) -> None:
        """Fake tensors cannot follow this model: measure it on real rows from now on
        (autofit.estimator.sampled), or raise `error` when that fails too."""
        if self._source is None:
            raise error
        model, batch, optimizer = self._source
        try:
            self._sampled = SampledEstimator(model, batch, optimizer, self.loss_fn,
                                             device_type=self.device_type,
                                             widest=isinstance(error, EagerOnly))
        except Exception as sample_error:
            error.add_note(f"measuring it on real rows failed too: {type(sample_error).__name__}: "
                           f"{sample_error}")
            raise error from None
        log.info("estimator: fake tensors cannot follow %s (%s); measuring it on a few real rows",
                 type(model).__name__, one_line(error))
        self.model, self.resident = self._sampled.model, self._sampled.resident
        self.optimizer_name = self._sampled.optimizer_name


    def _derived(self, plan: Plan) -> MemoryEstimate | None:
        """`plan`'s estimate derived from a walk through 3 of the model's alike blocks, or None
        where the model has none or the derivation does not hold (then it is walked whole)."""
        if getattr(self, "_repeated", False) is None:
            self._repeated = Repeated.of(self) or False
        repeated = getattr(self, "_repeated", False)
        return repeated.measure(plan) if repeated else None



def estimate(model: torch.nn.Module, batch: Batch, plan: Plan, optimizer: OptimizerArg = None,
             loss_fn: LossFn | None = None, *, device_type: str = "cuda",
             workspaces: Workspaces | None = None) -> MemoryEstimate:
    """Predict the peak device memory of a training step of `model` on `batch` under `plan`.

    `workspaces` (autofit.gpu.workspaces: `Workspaces.of_capability((9, 0))` for a Hopper card) adds
    the card's library workspaces to the peaks and counts blocks handed out whole as c10 does; None
    estimates the step's tensors only.
    `batch` is one global batch (on any device, `meta` included); `optimizer` is None (AdamW), an
    Optimizer (its class, options and current state) or a factory `params -> Optimizer`; `loss_fn`
    as in `autofit.run`. Nothing of the caller's is changed and no tensor data is allocated.

    >>> est = estimate(model, batch, Plan(micro_batch_size=8, accumulation_steps=4))  # doctest: +SKIP
    >>> est.peak_bytes, est.breakdown  # doctest: +SKIP
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autofit.Plan but got {type(plan).__name__}.")
    sharding = sharding_of(model) if isinstance(model, torch.nn.Module) else None
    if sharding is not None:  # sharded with FSDP2: one rank's peak, `batch` being its share
        return ShardedEstimator(model, batch, sharding, optimizer, loss_fn,
                                device_type=device_type).measure(plan)
    return Estimator(model, batch, optimizer, loss_fn, device_type=device_type,
                     workspaces=workspaces).measure(plan)
