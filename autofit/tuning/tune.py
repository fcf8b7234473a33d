"""autofit.tune (this module: autofit.tuning.tune): measure the plans the estimator says fit, and cache the fastest for autofit.run.
The three entry points — tune, tune_on, tune_for_run — and the optuna
objective share the placement and RNG guards kept here; options and verdicts have their own modules.

The search space
----------------
`autofit.run` starts from the plan the capacity check predicts to be fastest (`start.estimated_start`:
`capacity.rank` with the device's `start.headroom`, then `capacity.choose`): the *default plan*. The cost model
behind that choice is a model, and `rank` stops estimating as soon as no other plan could beat its
best one by that model, so `rank` alone returns a single fitting plan in most jobs. tune measures:

- the default plan, first (the baseline of the result);
- with precision="auto", the fitting plans `rank` finds with the other precision fixed (bf16, or
  fp16 where bf16 is unsupported; fp32 when the default is already mixed);
- for each configuration (precision, checkpointing, offload) found above, its largest fitting
  micro-batch and about a half and a quarter of it (sizes from `cost.micro_batch_sizes`):
  memory grows with the micro-batch, so these fit too, and they test the cost model's claim that
  fewer, larger micro-batches are faster.

Plans are tried in that order: the default, then the others by the cost model's prediction, fastest
first, so a small `n_trials` measures the likeliest winners. With precision="auto", tune may pick
bf16 (fp16) where it measures faster, as the ladder may; pass precision="fp32" to keep exact math.

Rounds, the statistic and the winner
------------------------------------
A trial trains `warmup + steps` real global batches under one plan with the runner's own machinery
(`throughput.measure`) and times the last `steps`; the model and optimizer are restored from host
copies after each trial. A machine shared with other work is noisy: on 2 busy cores one trial's
samples/s varied by 5-20% between repeats, and a stall during one trial made a plan look 30x slower.
So tune measures in `rounds` interleaved rounds (`study.round_order`): each round measures every
plan once, the order rotated by one plan per round, so a slow spell hits different plans in
different rounds. A plan's figure is the *median* of its rounds (one stalled round cannot move it)
and its *spread* the median absolute deviation of its rounds from that median (a stalled round
does not widen it either). A lead counts only when it is larger than the spread of both plans and
than MIN_GAIN (a lead the machine's own noise could make is no lead): the winner is the first plan
of the space (the default, then the cost model's order) that the highest median does not clearly
beat (`verdict.verdict`), so the default stays unless another plan clearly beats it, and between
plans the noise cannot tell apart the same one wins every time. A trial that runs out of memory
is pruned after the controller freed what it held; such a plan is not measured in later rounds and
is never the winner. `describe()` shows each plan's median, spread and range, and the reason of the
choice.

The study
---------
One optuna trial is one plan in one round. `n_trials` bounds the trials of one call (a call with a
small `n_trials` leaves the rest of the rounds queued for the next call); when every round is done,
tune measures nothing more and reads the result from the study, unless `retune=True`, which starts a
new measurement of `rounds` rounds (the stored result may come from a machine that was busier or
quieter than now); the result is read from the newest measurement only.

The study is named after the job key `autofit.run` caches plans under ("autofit-<key>"), so every
process tuning the same job (same model, batch layout, optimizer, precision, device, budget,
versions) shares it when they share a storage (`storage="postgresql://..."`). By default it lives in
the plan cache's SQLite file (`sqlite:///<PlanCache().path>`; with cache=False, in memory). The
winner is written to the plan cache as a settled plan: the next `autofit.run` of the job starts from
it with no OOM attempt and no probe.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from autofit.engine.batches import rows_of
from autofit.engine.controller import Attempt
from autofit.engine.interfaces import Data, LossFn, OptimizerArg, Size
from autofit.gpu.device import open_device
from autofit.gpu.oom import is_oom, summarize
from autofit.engine.inputs import build_optimizer, check_splittable, global_batches
from autofit.engine.replay import rng_state, set_rng_state
from autofit.plans.sizelog import SizeLog, config_of
from autofit.cache.memo import Memo
from autofit.estimator.start import longest_batch, tensor_budget
from autofit.tuning.study import (
    TuneTrial,
    close_storage,
    finished,
    import_optuna,
    open_storage,
    run_queue,
    stored_space,
)
from autofit.tuning.options import TuneOptions, check_options, no_budget_message, run_options
from autofit.tuning.throughput import Pristine, measure, search_space
from autofit.tuning.verdict import MIN_GAIN, ROUNDS, PlanStats, TuneResult, plan_stats, verdict

log = logging.getLogger("autofit")

STUDY_PREFIX = "autofit-"


# Public API (docs/tune.md): the keywords users pass, one per option as autofit.run takes them;
# inside, they are one frozen TuneOptions from the first line on.
def tune(model: torch.nn.Module, data: Data, *, budget: Size | None = None, n_trials: int | None = None,
         steps: int = 3, warmup: int = 1, rounds: int = ROUNDS, retune: bool = False,
         batch_size: int | None = None, loss_fn: LossFn | None = None, optimizer: OptimizerArg = None,
         precision: str = "auto", storage: object = None, study_name: str | None = None, cache: bool = True,
         clock: Callable[[], float] = time.perf_counter) -> TuneResult:
    """Measure the plans predicted to fit `budget` in `rounds` interleaved rounds, `warmup + steps`
    real global batches per plan and round (the first `warmup` untimed), and cache the plan with
    the highest median when its lead is larger than the spread (else the default plan), so the
    next `autofit.run(model, data, budget=budget, ...)` of this job starts from it. Give `budget`, `batch_size`, `optimizer` and
    `precision` as to `autofit.run`: they are part of the cache key. The model (parameters, buffers,
    gradients, train/eval flag), the optimizer's state and torch's RNG are left as they were.

    `n_trials`: at most this many trials (one plan in one round each) in this call (None: every
    trial of the measurement not run yet).
    `rounds`: rounds of the measurement (every plan once per round, the order rotated).
    `retune`: measure again (a new measurement of `rounds` rounds) even when the study holds one.
    `storage`: an optuna storage or database URL (default: the plan cache's SQLite file).
    `clock`: the timer of the measured steps, in seconds (default `time.perf_counter`).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module but got {type(model).__name__}.")
    options = TuneOptions(n_trials=n_trials, steps=steps, warmup=warmup, rounds=rounds, retune=retune,
                          storage=storage, study_name=study_name, clock=clock, precision=precision,
                          loss_fn=loss_fn, cache=cache)
    if isinstance(data, Iterator):
        raise ValueError(f"data is a one-shot iterator ({type(data).__name__}): tune reads its first "
                         f"batches and a run after it would miss them; pass a list of batches, a "
                         f"DataLoader or a Dataset.")
    _refuse_distributed()
    import_optuna()  # before any work

    with kept_rng():
        first, epoch_batches = global_batches(data, batch_size, 1)
        check_splittable(first, data)
        trained = TrialBatches(first, take_batches(epoch_batches(), options.warmup + options.steps),
                               longest_batch(data, first))
        with open_device(budget) as device:
            placed = _Placement(model, device)
            opt, _ = build_optimizer(optimizer, model)
            try:
                return tune_on(device, model, opt, trained, options)
            finally:
                placed.undo(opt)


@dataclass(frozen=True)
class TrialBatches:
    """What the trials train and the search space is estimated on."""

    first: object    # the first global batch: the job's cache key and the study's name
    batches: list    # host global batches every trial trains, the first `warmup` of them untimed
    longest: object  # the longest global batch, which the capacity check estimates


def tune_on(device, model, optimizer, trained: TrialBatches, options: TuneOptions) -> TuneResult:
    """`tune` on an open device, the model placed and the optimizer built (for `autofit.run`)."""
    optuna = import_optuna()
    if tensor_budget(device) is None:
        raise ValueError(no_budget_message(device.budget, device))
    if not 0 <= options.warmup < len(trained.batches):
        raise ValueError(f"warmup={options.warmup!r} leaves none of the {len(trained.batches)} batch(es) "
                         f"to time.")
    global_batch = rows_of(trained.first)
    memo = Memo(model=model, batch=trained.first, optimizer=optimizer, global_batch=global_batch,
                precision=options.precision, device=device, enabled=True)  # its key names the study

    def plan_cache_url():
        if not options.cache:
            return None
        memo.cache.ensure()  # our table and marks first; optuna adds its tables beside them
        return f"sqlite:///{memo.cache.path.absolute()}"

    store, where = open_storage(optuna, options.storage, plan_cache_url)
    try:
        pristine = Pristine(model, optimizer, device)
        try:
            study = optuna.create_study(study_name=options.study_name or STUDY_PREFIX + memo.key, storage=store,
                                        direction="maximize", load_if_exists=True,
                                        sampler=optuna.samplers.RandomSampler(seed=0))
            default, space = stored_space(study, global_batch, lambda: search_space(
                model, trained.longest, optimizer, options.loss_fn, device, options.precision,
                global_batch))
            plans = {p.describe(): p for p in space}
            objective = _objective(optuna, model, optimizer, device, trained.batches, options, pristine)
            measured, measurement = run_queue(optuna, study, plans, options.n_trials, objective,
                                              rounds=options.rounds, retune=options.retune)
        finally:
            pristine.finish()
            # optuna keeps each pruned trial's exception, whose traceback holds the objective's
            # frame and through it the batches: a cycle, collected now so no device memory waits
            # for the next automatic collection.
            gc.collect()
        trials = finished(optuna, study, plans, measurement)
        result = verdict(trials, default, space, measured, study.study_name, where, memo.key)
        result.measurement = measurement
        if options.cache:
            _remember(memo, result, trials, global_batch)
    finally:
        close_storage(store, options.storage)
    log.info("tune: %s", result.describe())
    return result


# -- for autofit.run(..., tune=...) -----------------------------------------------------------------

def tune_for_run(options: TuneOptions, *, device, model, optimizer, data, first, epoch_batches) -> TuneResult:
    """What `autofit.run` calls inside its device block, before it chooses the start plan. A
    one-shot iterator is not read further: its first batch is timed again and again."""
    count = options.warmup + options.steps
    with kept_rng():
        if isinstance(data, Iterator):
            batches = [first] * count
        else:
            batches = take_batches(epoch_batches(), count)
        return tune_on(device, model, optimizer, TrialBatches(first, batches, longest_batch(data, first)),
                       options)


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
    """Tuning draws from no random stream the user sees: the global generators are put back after."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


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


def _objective(optuna, model, optimizer, device, batches, options: TuneOptions, pristine):
    """objective(plan, trial) -> samples per second; raises optuna.TrialPruned when the plan ran out
    of memory. The model and optimizer are restored after every trial, whatever happened."""
    def objective(plan, trial):
        try:
            m = measure(model, optimizer, device, plan, batches, warmup=options.warmup,
                        loss_fn=options.loss_fn, clock=options.clock)
        except Exception as error:
            # A move the plain plan does not make (bf16 without a kernel): that plan is dropped,
            # the others are measured. The plain plan's own error is the job's: it propagates.
            if is_oom(error) or not _makes_a_move(plan):
                raise
            text = f"{type(error).__name__}: {summarize(error)}"
            trial.set_user_attr("autofit", {"outcome": "error", "peak_bytes": 0, "samples": 0, "seconds": 0.0,
                                            "device": device.describe(), "error": text})
            log.warning("tune: %s raised %s; that plan is dropped, the others are measured", plan.describe(), text)
            raise optuna.TrialPruned(f"{plan.describe()} raised {text}") from None
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


def _makes_a_move(plan) -> bool:
    """Whether `plan` turns on something the plain fp32 plan does not (a precision or a switch)."""
    return plan != plan.plain()


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
    # A trial trains several steps (its warm-up first): the winner ran with its optimizer state.
    memo.remember(winner, sizes, [Attempt(winner, "ok", "tuned: the plan tune chose", peak)],
                  global_batch, throughput=result.samples_per_second, steady=True)
    result.cached = memo.cache.get(memo.key) is not None


__all__ = ["PlanStats", "TrialBatches", "TuneOptions", "TuneResult", "TuneTrial", "check_options", "kept_rng",
           "plan_stats", "run_options", "search_space", "take_batches", "tune", "tune_for_run", "tune_on"]
