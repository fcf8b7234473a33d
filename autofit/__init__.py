"""autofit: make a PyTorch training job fit the GPU it runs on, and keep it fitting."""

from .controller import Attempt
from .errors import (
    AllocationFailed,
    DoesNotFit,
    LockstepError,
    MemoryNotReleased,
    MetricError,
    ModelSpecError,
    NoLossError,
    PartialUpdateError,
    PeerOutOfMemory,
    RankFailed,
    UsageError,
)
from .estimate import MemoryEstimate, estimate
from .evaluate import EvalResult, EvalSizer, evaluate
from .explain import explain
from .plan import Plan
from .run import RunResult, run
from .simulate import simulate_gpu
from .sizes import parse_size
from .stepper import StepOutput, stepper
from .tuning import TuneResult, tune

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
