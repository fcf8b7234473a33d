"""The optuna study behind `autofit.tune`: where it is stored, its search space, its queue of plans.

optuna is an optional extra, imported only here and only when tuning (`import_optuna`). The study has
one categorical parameter, "plan" (a plan's `describe()` text), and the search space is stored in
the study itself (user attribute SPACE_ATTR), so every process tuning the same job measures the same
plans. Each plan is enqueued once (`Study.enqueue_trial`) and each trial pops one from the queue:
several processes sharing a storage split the plans between them, and a plan already measured,
queued or being measured is not enqueued again.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass

from .plan import Plan

log = logging.getLogger("autofit")

INSTALL_HINT = "pip install 'autofit[tune]'"
SPACE_ATTR = "autofit_space"
HEARTBEAT_S = 60  # storages tune opens beat every minute; a crashed trial is failed after two
SQLITE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TuneTrial:
    """One finished trial of the study: `outcome` is "ok", "oom" (pruned) or "error"."""

    number: int
    plan: Plan
    outcome: str
    samples_per_second: float | None
    peak_bytes: int | None = None


def import_optuna():
    try:
        import optuna
    except ImportError as error:
        raise ImportError(f"autofit.tune needs optuna, an optional extra: {INSTALL_HINT} "
                          f"(or pip install optuna).") from error
    return optuna


@contextlib.contextmanager
def _quiet(optuna):
    """Hides optuna's ExperimentalWarning (heartbeats and failing stale trials are marked so)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def open_storage(optuna, storage, default_url):
    """(what optuna.create_study takes, its description). `storage` None: `default_url()`, or an
    in-memory storage when that gives None; a URL: an RDB storage with heartbeats; else as given."""
    if storage is None:
        storage = default_url()
        if storage is None:
            return optuna.storages.InMemoryStorage(), "in memory (cache=False)"
    if not isinstance(storage, str):
        return storage, type(storage).__name__
    kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if storage.startswith("sqlite") else None
    with _quiet(optuna):
        opened = optuna.storages.RDBStorage(storage, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S)
    return opened, storage


def close_storage(store, given) -> None:
    """Let go of the database of a storage tune opened itself (never of one the caller gave)."""
    engine = getattr(store, "engine", None)
    if engine is not None and (given is None or isinstance(given, str)):
        engine.dispose()


def stored_space(study, global_batch: int, compute) -> tuple[Plan, list[Plan]]:
    """(default plan, plans in order) stored in the study; `compute()` and store it when it has none."""
    stored = study.user_attrs.get(SPACE_ATTR)
    if stored is None:
        default, space = compute()
        study.set_user_attr(SPACE_ATTR, {"global_batch": global_batch, "default": default.to_dict(),
                                         "plans": [p.to_dict() for p in space]})
        stored = study.user_attrs[SPACE_ATTR]  # another process may have stored its own first
    if stored["global_batch"] != global_batch:
        raise ValueError(f"study {study.study_name!r} holds plans for global batch "
                         f"{stored['global_batch']} but this job's is {global_batch}; pass another "
                         f"study_name or leave it None (named after the job).")
    return Plan.from_dict(stored["default"]), [Plan.from_dict(p) for p in stored["plans"]]


def run_queue(optuna, study, plans: dict, n_trials, objective) -> int:
    """Enqueue each plan (`plans`: describe() -> Plan, in order) that is not measured, queued or
    being measured yet; run at most `n_trials` trials from the queue (None: all of it), each
    `objective(plan, trial)`. Returns the number of trials run here."""
    states = optuna.trial.TrialState
    with _quiet(optuna):
        optuna.storages.fail_stale_trials(study)  # running trials of a crashed process (heartbeats)
    seen = {t.params.get("plan") for t in study.get_trials(
        deepcopy=False, states=(states.COMPLETE, states.PRUNED, states.RUNNING))}
    queued = {t.system_attrs.get("fixed_params", {}).get("plan")
              for t in study.get_trials(deepcopy=False, states=(states.WAITING,))}
    for key in plans:
        if key not in seen and key not in queued:
            study.enqueue_trial({"plan": key})
    waiting = len(study.get_trials(deepcopy=False, states=(states.WAITING,)))
    count = waiting if n_trials is None else min(n_trials, waiting)
    if n_trials is not None and n_trials > waiting:
        log.info("tune: n_trials=%d, but %d of %d plan(s) are left to measure and each plan is "
                 "measured once", n_trials, waiting, len(plans))
    if count == 0:
        return 0
    choices, ran = list(plans), []

    def trial_of(trial):
        ran.append(trial.number)
        return objective(plans[trial.suggest_categorical("plan", choices)], trial)

    def stop_when_empty(study, _trial):
        if not study.get_trials(deepcopy=False, states=(states.WAITING,)):
            study.stop()  # another process took the rest: sampling would only repeat a plan

    study.optimize(trial_of, n_trials=count, callbacks=[stop_when_empty], gc_after_trial=False)
    return len(ran)


def finished(optuna, study, plans: dict) -> list[TuneTrial]:
    """Every finished trial of a plan of `plans`, by trial number."""
    states = optuna.trial.TrialState
    outcome = {states.COMPLETE: "ok", states.PRUNED: "oom", states.FAIL: "error"}
    return [TuneTrial(t.number, plans[t.params["plan"]], outcome[t.state], t.value,
                      t.user_attrs.get("autofit", {}).get("peak_bytes"))
            for t in study.get_trials(deepcopy=False, states=tuple(outcome))
            if t.params.get("plan") in plans]
