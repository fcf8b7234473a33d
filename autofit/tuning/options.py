"""The options of `autofit.tune` and of `autofit.run(..., tune=...)`, checked before any work."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from autofit.engine.interfaces import LossFn
from autofit.plans import precision as precisions
from autofit.tuning.study import import_optuna
from autofit.tuning.verdict import ROUNDS

RUN_OPTIONS = ("n_trials", "steps", "warmup", "rounds", "retune", "storage", "study_name", "clock")


@dataclass(frozen=True)
class TuneOptions:
    """How `autofit.tune` measures, and the job it measures for: checked when made, before any work.
    The first eight fields are the options `run(..., tune=...)` takes (RUN_OPTIONS); `precision`,
    `loss_fn` and `cache` are the job's own, as `autofit.run` is given them."""

    n_trials: int | None = None   # at most this many trials in this call (None: every one not run yet)
    steps: int = 3                # global batches timed per trial
    warmup: int = 1               # untimed global batches before them
    rounds: int = ROUNDS          # every plan measured once per round, the order rotated
    retune: bool = False          # measure again even when the study holds a measurement
    storage: object = None        # an optuna storage or database URL (None: the plan cache's file)
    study_name: str | None = None  # None: named after the job's cache key
    clock: Callable[[], float] = time.perf_counter  # the timer of the measured steps, in seconds
    precision: str = precisions.AUTO
    loss_fn: LossFn | None = None
    cache: bool = True

    def __post_init__(self):
        check_options(**{name: getattr(self, name) for name in RUN_OPTIONS})
        precisions.check_policy(self.precision)
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be a callable (model, batch) -> scalar loss but got {self.loss_fn!r}.")


def check_options(*, n_trials=None, steps=3, warmup=1, rounds=ROUNDS, retune=False, storage=None,
                  study_name=None, clock=time.perf_counter) -> None:
    """Raise on bad tune options, before any work."""
    if n_trials is not None and (isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1):
        raise ValueError(f"n_trials must be a positive int, or None to run every trial of the "
                         f"measurement, but got {n_trials!r}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int (global batches timed per trial) but got {steps!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0 (untimed global batches per trial) but got {warmup!r}.")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int (every plan measured once per round; "
                         f"{ROUNDS} by default) but got {rounds!r}.")
    if not isinstance(retune, bool):
        raise TypeError(f"retune must be True (measure again) or False but got {retune!r}.")
    if storage is not None and not isinstance(storage, str) and not hasattr(storage, "create_new_study"):
        raise TypeError(f"storage must be None (the plan cache file), a database URL such as "
                        f"'postgresql://...' or an optuna storage, but got {type(storage).__name__}.")
    if study_name is not None and (not isinstance(study_name, str) or not study_name):
        raise ValueError(f"study_name must be a non-empty string, or None to name the study after the "
                         f"job, but got {study_name!r}.")
    if not callable(clock):
        raise TypeError(f"clock must be a callable returning seconds, e.g. time.perf_counter, but got "
                        f"{clock!r}.")


def no_budget_message(budget, device) -> str:
    return (f"budget={budget!r} on {device.describe()}: nothing limits memory here, so there is "
            f"nothing to tune against; pass budget='8GiB' (the memory of the card you will train on; "
            f"without CUDA, a simulated GPU of that size) or run on a GPU.")


def run_options(tune) -> dict:
    """The options of `run(..., tune=...)`: True (defaults) or a dict of some of RUN_OPTIONS.
    Raises on bad ones, and when optuna is missing, before any work."""
    if tune is True:
        options = {}
    elif isinstance(tune, dict):
        unknown = sorted(set(tune) - set(RUN_OPTIONS))
        if unknown:
            raise ValueError(f"tune={tune!r} has unknown option(s) {unknown}; the options are "
                             f"{', '.join(RUN_OPTIONS)}.")
        options = dict(tune)
    else:
        raise TypeError(f"tune must be False, True or a dict of options ({', '.join(RUN_OPTIONS)}) "
                        f"but got {tune!r}.")
    check_options(**options)
    import_optuna()
    return options
