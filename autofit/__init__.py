"""autofit: make a PyTorch training job fit the GPU it runs on, and keep it fitting."""

from autofit.engine.controller import Attempt
from autofit.errors import (
    AllocationFailed,
    DoesNotFit,
    LockstepError,
    MemoryNotReleased,
    MissingInternal,
    MetricError,
    ModelSpecError,
    NoLossError,
    PartialUpdateError,
    PeerOutOfMemory,
    RankFailed,
    UsageError,
)
from autofit.estimator.estimate import MemoryEstimate, estimate
from autofit.recipes.evaluate import EvalResult, evaluate
from autofit.recipes.eval_sizer import EvalSizer
from autofit.diagnosis.explain import explain
from autofit.plans.plan import Plan
from autofit.recipes.run import RunResult, run
from autofit.gpu.simulate import simulate_gpu
from autofit.sizes import parse_size
from autofit.recipes.stepper import StepOutput, stepper
from autofit.tuning.tune import tune
from autofit.tuning.verdict import TuneResult

__version__ = "0.1.0"

__all__ = [
    "AllocationFailed",
    "Attempt",
    "DoesNotFit",
    "EvalResult",
    "EvalSizer",
    "LockstepError",
    "MemoryEstimate",
    "MemoryNotReleased",
    "MissingInternal",
    "MetricError",
    "ModelSpecError",
    "NoLossError",
    "PartialUpdateError",
    "PeerOutOfMemory",
    "Plan",
    "RankFailed",
    "RunResult",
    "StepOutput",
    "TuneResult",
    "UsageError",
    "estimate",
    "evaluate",
    "explain",
    "parse_size",
    "run",
    "simulate_gpu",
    "stepper",
    "tune",
]
