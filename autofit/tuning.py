"""autofit.tune (this module: autofit.tuning): measure the plans the estimator says fit, and cache the fastest for autofit.run.

The search space
----------------
`autofit.run` starts from the plan the capacity check predicts to be fastest (`start.estimated_start`:
`capacity.rank` with the runner's MARGIN, then `capacity.choose`): the *default plan*. The cost model
behind that choice is a model, and `rank` stops estimating as soon as no other plan could beat its
best one by that model, so `rank` alone returns a single fitting plan in most jobs. tune measures:

- the default plan, first (the baseline of the result);
- with precision="auto", the fitting plans `rank` finds with the other precision fixed (bf16, or
  fp16 where bf16 is unsupported; fp32 when the default is already mixed);
- for each configuration (precision, checkpointing, offload) found above, its largest fitting
  micro-batch and about a half and a quarter of it (sizes from `capacity.micro_batch_sizes`):
  memory grows with the micro-batch, so these fit too, and they test the cost model's claim that
  fewer, larger micro-batches are faster.

Plans are tried in that order: the default, then the others by the cost model's prediction, fastest
first, so a small `n_trials` measures the likeliest winners. With precision="auto", tune may pick
bf16 (fp16) where it measures faster, as the ladder may; pass precision="fp32" to keep exact math.

Trials and the study
--------------------
A trial trains `warmup + steps` real global batches under one plan with the runner's own machinery
(`throughput.measure`) and times the last `steps`; the model and optimizer are restored from host
copies after each trial. A plan is measured once (see `study.run_queue`): `n_trials` bounds the
trials of one call, and more trials than plans left are not run. A trial that runs out of memory is
pruned after the controller freed what it held, and such a plan is never the winner. The winner is
the plan with the most samples per second, except that the default plan stays unless another is
more than MIN_GAIN (3%) faster.

The study is named after the job key `autofit.run` caches plans under ("autofit-<key>"), so every
process tuning the same job (same model, batch layout, optimizer, precision, device, budget,
versions) shares it when they share a storage (`storage="postgresql://..."`). By default it lives in
the plan cache's SQLite file (`sqlite:///<PlanCache().path>`; with cache=False, in memory). The
winner is written to the plan cache as a settled plan: the next `autofit.run` of the job starts from
it with no OOM attempt and no probe.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .batches import batch_size as rows_of
from .controller import Attempt
from .device import open_device
from .errors import DoesNotFit
from .inputs import build_optimizer, global_batches
from .ladder import SizeLog, config_of
from .memo import Memo
from .plan import PRECISIONS, Plan
from .report import table
from .start import longest_batch, tensor_budget
from .study import (TuneTrial, close_storage, finished, import_optuna, open_storage, run_queue,
                    stored_space)
from .throughput import Pristine, measure, search_space

log = logging.getLogger("autofit")

STUDY_PREFIX = "autofit-"
PRECISION_POLICIES = ("auto",) + PRECISIONS
RUN_OPTIONS = ("n_trials", "steps", "warmup", "storage", "study_name", "clock")
# A plan replaces the default one only when it measured more than 3% faster, so a near-tie keeps
# the plan the cost model and the ladder agree on. It is no guard against noise: on a shared 2-core
# machine one trial's samples/s varied by 5-20% between repeats (benchmarks/tune.py); more `steps`
# per trial are.
MIN_GAIN = 0.03


@dataclass
class TuneResult:
    plan: Plan                                   # the winner, cached for autofit.run
    samples_per_second: float
    default_plan: Plan                           # where autofit.run starts without tuning
    default_samples_per_second: float | None     # None: it ran out of memory, or is not measured yet
    trials: list[TuneTrial] = field(default_factory=list)   # every finished trial of the study
    space: list[Plan] = field(default_factory=list)         # the plans, in the order they are tried
    measured: int = 0                            # trials this call ran
    study_name: str = ""
    storage: str = ""
    key: str = ""                                # the plan-cache key (fingerprint.job_key)
    cached: bool = False                         # whether the winner is in the plan cache

    @property
    def speedup(self) -> float | None:
        """Samples per second of the winner over the default plan's (None when that is unknown)."""
        if not self.default_samples_per_second:
            return None
        return self.samples_per_second / self.default_samples_per_second

    def describe(self) -> str:
        rows = [["*" if t.plan == self.plan else "", t.number, t.plan.describe(), t.outcome,
                 None if t.samples_per_second is None else round(t.samples_per_second, 1),
                 "yes" if t.plan == self.default_plan else ""] for t in self.trials]
        speedup = "unknown" if self.speedup is None else f"{self.speedup:.2f}x"
        return (table(["", "trial", "plan", "outcome", "samples/s", "default"], rows) +
                f"\nchosen: {self.plan.describe()}, {self.samples_per_second:.1f} samples/s, "
                f"{speedup} the default plan's ({self.default_plan.describe()})")


def tune(model, data, *, budget=None, n_trials=None, steps=3, warmup=1, batch_size=None, loss_fn=None,
         optimizer=None, precision="auto", storage=None, study_name=None, cache=True,
         clock=time.perf_counter) -> TuneResult:
    """Measure the plans predicted to fit `budget`, `warmup + steps` real global batches each (the
    first `warmup` untimed), and cache the fastest, so the next `autofit.run(model, data,
    budget=budget, ...)` of this job starts from it. Give `budget`, `batch_size`, `optimizer` and
    `precision` as to `autofit.run`: they are part of the cache key. The model (parameters, buffers,
    gradients, train/eval flag), the optimizer's state and torch's RNG are left as they were.

    `n_trials`: at most this many trials in this call (None: every plan not measured yet).
    `storage`: an optuna storage or database URL (default: the plan cache's SQLite file).
    `clock`: the timer of the measured steps, in seconds (default `time.perf_counter`).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module but got {type(model).__name__}.")
    check_options(n_trials=n_trials, steps=steps, warmup=warmup, storage=storage,
                  study_name=study_name, clock=clock)
    if precision not in PRECISION_POLICIES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_POLICIES)} but got {precision!r}.")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (model, batch) -> scalar loss but got {loss_fn!r}.")
    if isinstance(data, Iterator):
        raise ValueError(f"data is a one-shot iterator ({type(data).__name__}): tune reads its first "
                         f"batches and a run after it would miss them; pass a list of batches, a "
                         f"DataLoader or a Dataset.")
    _refuse_distributed()
    import_optuna()  # before any work

    with kept_rng():
        first, epoch_batches = global_batches(data, batch_size, 1)
        rows_of(first)  # raises on a batch that cannot be split
        batches = take_batches(epoch_batches(), warmup + steps)
        with open_device(budget) as device:
            placed = _Placement(model, device)
            opt, _ = build_optimizer(optimizer, model)
            try:
                return tune_on(device, model, opt, first=first, batches=batches,
                               longest=longest_batch(data, first), precision=precision, loss_fn=loss_fn,
                               n_trials=n_trials, warmup=warmup, storage=storage,
                               study_name=study_name, cache=cache, clock=clock)
            finally:
                placed.undo(opt)


def tune_on(device, model, optimizer, *, first, batches, longest=None, precision="auto", loss_fn=None,
            n_trials=None, warmup=1, storage=None, study_name=None, cache=True,
            clock=time.perf_counter) -> TuneResult:
    """`tune` on an open device, the model placed and the optimizer built (for `autofit.run`):
    every trial trains `batches` (host global batches), the first `warmup` of them untimed."""
    optuna = import_optuna()
    if tensor_budget(device) is None:
        raise ValueError(no_budget_message(device.budget, device))
    if not 0 <= warmup < len(batches):
        raise ValueError(f"warmup={warmup!r} leaves none of the {len(batches)} batch(es) to time.")
    global_batch = rows_of(first)
    memo = Memo(model=model, batch=first, optimizer=optimizer, global_batch=global_batch,
                precision=precision, device=device, enabled=True)  # its key names the study

    def plan_cache_url():
        if not cache:
            return None
        memo.cache.ensure()  # our table and marks first; optuna adds its tables beside them
        return f"sqlite:///{memo.cache.path.absolute()}"

    store, where = open_storage(optuna, storage, plan_cache_url)
    try:
        pristine = Pristine(model, optimizer, device)
        try:
            study = optuna.create_study(study_name=study_name or STUDY_PREFIX + memo.key, storage=store,
                                        direction="maximize", load_if_exists=True,
                                        sampler=optuna.samplers.RandomSampler(seed=0))
            default, space = stored_space(study, global_batch, lambda: search_space(
                model, first if longest is None else longest, optimizer, loss_fn, device, precision,
                global_batch))
            plans = {p.describe(): p for p in space}
            objective = _objective(optuna, model, optimizer, device, batches, warmup, loss_fn, clock,
                                   pristine)
            measured = run_queue(optuna, study, plans, n_trials, objective)
        finally:
            pristine.finish()
        trials = finished(optuna, study, plans)
        result = _result(trials, default, space, measured, study.study_name, where, memo.key)
        if cache:
            _remember(memo, result, trials, global_batch)
    finally:
        close_storage(store, storage)
    log.info("tune: %s", result.describe())
    return result


def check_options(*, n_trials=None, steps=3, warmup=1, storage=None, study_name=None,
                  clock=time.perf_counter) -> None:
    """Raise on bad tune options, before any work."""
    if n_trials is not None and (isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1):
        raise ValueError(f"n_trials must be a positive int, or None to measure every plan once, but "
                         f"got {n_trials!r}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int (global batches timed per trial) but got {steps!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0 (untimed global batches per trial) but got {warmup!r}.")
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


# -- for autofit.run(..., tune=...) -----------------------------------------------------------------

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


def tune_for_run(options: dict, *, device, model, optimizer, data, first, epoch_batches, precision,
                 loss_fn, cache) -> TuneResult:
    """What `autofit.run` calls inside its device block, before it chooses the start plan. A
    one-shot iterator is not read further: its first batch is timed again and again."""
    options = dict(options)
    steps, warmup = options.pop("steps", 3), options.pop("warmup", 1)
    with kept_rng():
        if isinstance(data, Iterator):
            batches = [first] * (warmup + steps)
        else:
            batches = take_batches(epoch_batches(), warmup + steps)
        return tune_on(device, model, optimizer, first=first, batches=batches,
                       longest=longest_batch(data, first), precision=precision, loss_fn=loss_fn,
                       warmup=warmup, cache=cache, **options)


# -- the pieces -------------------------------------------------------------------------------------

def take_batches(batches, count: int) -> list:
    """The first `count` global batches, starting over when there are fewer."""
    taken = []
    for batch in batches:
        taken.append(batch)
        if len(taken) == count:
            break
    return [taken[i % len(taken)] for i in range(count)]


@contextlib.contextmanager
def kept_rng():
    """Tuning draws from no random stream the user sees: torch's generators are put back after."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _refuse_distributed() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError("autofit.tune runs in one process; call it before "
                           "torch.distributed.init_process_group (or in a single-GPU job) and let "
                           "autofit.run start every rank from the cached plan.")


class _Placement:
    """The model on the device for tuning, and back where it was afterwards (CUDA: moved there)."""

    def __init__(self, model, device):
        self.model = model
        self.before = {t.device for t in list(model.parameters()) + list(model.buffers())}
        device.place_model(model)

    def undo(self, optimizer) -> None:
        if len(self.before) != 1:
            return
        home = next(iter(self.before))
        if any(t.device != home for t in self.model.parameters()):
            self.model.to(home)
            if optimizer.state:  # load_state_dict puts the state on its parameters' device
                optimizer.load_state_dict(optimizer.state_dict())


def _objective(optuna, model, optimizer, device, batches, warmup, loss_fn, clock, pristine):
    """objective(plan, trial) -> samples per second; raises optuna.TrialPruned when the plan ran out
    of memory. The model and optimizer are restored after every trial, whatever happened."""
    def objective(plan, trial):
        try:
            m = measure(model, optimizer, device, plan, batches, warmup=warmup, loss_fn=loss_fn,
                        clock=clock)
        finally:
            pristine.restore()
        # One attribute, one write to the storage.
        trial.set_user_attr("autofit", {"outcome": m.outcome, "peak_bytes": m.peak_bytes,
                                        "samples": m.samples, "seconds": m.seconds,
                                        "device": device.describe(), "error": m.error})
        if m.outcome == "oom":
            log.info("tune: %s ran out of memory: %s", plan.describe(), m.error)
            raise optuna.TrialPruned(f"out of memory under {plan.describe()}: {m.error}")
        return m.samples_per_second
    return objective


def _result(trials, default, space, measured, study_name, where, key) -> TuneResult:
    """The fastest plan by mean samples per second over its trials; a plan that ever ran out of
    memory (or failed) is not eligible; ties go to the earlier plan of the space, and the default
    plan stays unless another is faster by more than MIN_GAIN."""
    failed = {t.plan for t in trials if t.outcome != "ok"}
    speeds: dict[Plan, list[float]] = {}
    for t in trials:
        if t.outcome == "ok":
            speeds.setdefault(t.plan, []).append(t.samples_per_second)
    mean = {p: statistics.fmean(v) for p, v in speeds.items()}
    eligible = [p for p in space if p in mean and p not in failed]
    if not eligible:
        left = [p for p in space if p not in speeds and p not in failed]
        tried = ", ".join(f"{t.plan.describe()} -> {t.outcome}" for t in trials) or "none"
        raise DoesNotFit(f"no plan of this job completed a trial in study {study_name!r} (trials: "
                         f"{tried}); " + (f"{len(left)} plan(s) are not measured yet: run tune again "
                                          f"or with a larger n_trials." if left else
                                          "give a larger budget or a smaller global batch."))
    best = max(eligible, key=lambda p: (mean[p], -eligible.index(p)))
    if default in eligible and mean[best] <= mean[default] * (1 + MIN_GAIN):
        best = default  # within one trial's noise: keep the plan run would start from anyway
    return TuneResult(plan=best, samples_per_second=mean[best], default_plan=default,
                      default_samples_per_second=None if default in failed else mean.get(default),
                      trials=trials, space=list(space), measured=measured, study_name=study_name,
                      storage=where, key=key)


def _remember(memo: Memo, result: TuneResult, trials, global_batch: int) -> None:
    """The winner into the plan cache (the cache takes it as settled), with the sizes of its
    configuration that ran out of memory above it. The sizes that fitted are left out on purpose:
    the cache would start a run from the largest of them, and the winner is the size to start from."""
    winner = result.plan
    sizes = SizeLog()
    for t in trials:
        if t.outcome == "oom" and config_of(t.plan) == config_of(winner) \
                and t.plan.micro_batch_size > winner.micro_batch_size:
            sizes.record(t.plan, False, global_batch)
    peak = max((t.peak_bytes or 0 for t in trials if t.plan == winner and t.outcome == "ok"), default=0)
    memo.remember(winner, sizes, [Attempt(winner, "ok", "tuned: fastest measured plan", peak)],
                  global_batch, throughput=result.samples_per_second)
    result.cached = memo.cache.get(memo.key) is not None


__all__ = ["TuneResult", "TuneTrial", "check_options", "kept_rng", "run_options", "search_space",
           "take_batches", "tune", "tune_for_run", "tune_on"]
