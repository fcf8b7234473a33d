"""autofit: make a PyTorch training job fit the GPU it runs on, and keep it fitting."""

from .controller import Attempt
from .errors import DoesNotFit, MemoryNotReleased
from .plan import Plan
from .run import RunResult, run
from .simulate import simulate_gpu
from .sizes import parse_size

__version__ = "0.1.0"

__all__ = [
    "Attempt",
    "DoesNotFit",
    "MemoryNotReleased",
    "Plan",
    "RunResult",
    "parse_size",
    "run",
    "simulate_gpu",
]
