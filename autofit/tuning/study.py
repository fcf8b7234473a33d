"""The optuna study behind `autofit.tune`: where it is stored, its search space, its queue of plans.

optuna is an optional extra, imported only here and only when tuning (`import_optuna`). The study has
one categorical parameter, "plan" (a plan's `describe()` text), and the search space is stored in
the study itself (user attribute SPACE_ATTR), so every process tuning the same job measures the same
plans.

One optuna trial is one plan measured once. A *measurement* of the study is `rounds` rounds, each
round every plan once, the order rotated by one plan per round (round r starts at plan r mod n), so
a slow spell of the machine falls on different plans in different rounds, and no plan is always
measured first or right after another. Each (round, plan) is enqueued once (`Study.enqueue_trial`,
the user attribute ROUND_ATTR = [measurement, round]) and each trial pops the oldest from the
queue: several processes sharing a storage split the trials between them, and a trial already
done, queued or running is not enqueued again. The first measurement is number 0; `retune=True`
starts the next one, and the result is read from the newest measurement only (older ones stay in
the study as history). A plan that ran out of memory in a round is not measured again in that
measurement: its later trials are pruned at once.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass

from autofit.plans.plan import Plan

log = logging.getLogger("autofit")

INSTALL_HINT = "pip install 'autofit[tune]'"
SPACE_ATTR = "autofit_space"
ROUND_ATTR = "autofit_round"  # [measurement, round] of a trial
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
    round: int = 0          # the round of its measurement
    measurement: int = 0    # 0 for the first measurement of the study, +1 for each retune


def round_order(keys: list, rounds: int) -> list[tuple[int, str]]:
    """[(round, plan key)] in the order they are measured: every plan once per round, round r
    starting at plan r mod n (a rotation), so each plan is measured in every position."""
    n = len(keys)
    return [(r, keys[(r + i) % n]) for r in range(rounds) for i in range(n)]


def _round_of(trial) -> tuple[int, int]:
    """(measurement, round) of a trial (a trial of an older study without the attribute: (0, 0))."""
    measurement, round_ = trial.user_attrs.get(ROUND_ATTR, (0, 0))
    return measurement, round_


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


def run_queue(optuna, study, plans: dict, n_trials, objective, *, rounds: int = 1,
              retune: bool = False) -> tuple[int, int]:
    """Enqueue the (round, plan) trials of the newest measurement (`plans`: describe() -> Plan, in
    order; `retune`: of a new measurement) that are not done, queued or running yet, in
    `round_order`; run at most `n_trials` of the queue (None: all of it), each
    `objective(plan, trial)`. Returns (trials run here, the measurement)."""
    states = optuna.trial.TrialState
    with _quiet(optuna):
        optuna.storages.fail_stale_trials(study)  # running trials of a crashed process (heartbeats)
    everything = study.get_trials(deepcopy=False)
    measurement = max((_round_of(t)[0] for t in everything), default=0)
    if retune and everything:
        measurement += 1
    taken = {(_round_of(t)[1], t.params.get("plan") or t.system_attrs.get("fixed_params", {}).get("plan"))
             for t in everything if _round_of(t)[0] == measurement and t.state != states.FAIL}
    for round_, key in round_order(list(plans), rounds):
        if (round_, key) not in taken:
            study.enqueue_trial({"plan": key}, user_attrs={ROUND_ATTR: [measurement, round_]})
    waiting = len(study.get_trials(deepcopy=False, states=(states.WAITING,)))
    count = waiting if n_trials is None else min(n_trials, waiting)
    if n_trials is not None and n_trials > waiting:
        log.info("tune: n_trials=%d, but %d trial(s) of %d round(s) of %d plan(s) are left to measure",
                 n_trials, waiting, rounds, len(plans))
    if count == 0:
        return 0, measurement
    choices, ran = list(plans), []

    def out_of_memory_before(key) -> bool:
        return any(t.params.get("plan") == key and t.state == states.PRUNED
                   and t.user_attrs.get("autofit", {}).get("outcome") == "oom"
                   and _round_of(t)[0] == measurement
                   for t in study.get_trials(deepcopy=False, states=(states.PRUNED,)))

    def trial_of(trial):
        ran.append(trial.number)
        key = trial.suggest_categorical("plan", choices)
        if _round_of(trial)[0] != measurement:  # queued by an older measurement: not this one's
            trial.set_user_attr("autofit", {"outcome": "superseded"})
            raise optuna.TrialPruned("queued for an older measurement of the study")
        if out_of_memory_before(key):
            trial.set_user_attr("autofit", {"outcome": "oom", "skipped": True,
                                            "error": "ran out of memory in an earlier round"})
            raise optuna.TrialPruned(f"{key} ran out of memory in an earlier round")
        return objective(plans[key], trial)

    def stop_when_empty(study, _trial):
        if not study.get_trials(deepcopy=False, states=(states.WAITING,)):
            study.stop()  # another process took the rest: sampling would only repeat a plan

    study.optimize(trial_of, n_trials=count, callbacks=[stop_when_empty], gc_after_trial=False)
    return len(ran), measurement


def finished(optuna, study, plans: dict, measurement: int = 0) -> list[TuneTrial]:
    """Every finished trial of a plan of `plans` in `measurement`, by trial number."""
    states = optuna.trial.TrialState
    outcome = {states.COMPLETE: "ok", states.PRUNED: "oom", states.FAIL: "error"}
    trials = []
    for t in study.get_trials(deepcopy=False, states=tuple(outcome)):
        which, round_ = _round_of(t)
        attrs = t.user_attrs.get("autofit", {})
        if t.params.get("plan") in plans and which == measurement and attrs.get("outcome") != "superseded":
            # a pruned trial is out of memory, or a plan dropped for another error (tune's objective)
            kind = "error" if attrs.get("outcome") == "error" else outcome[t.state]
            trials.append(TuneTrial(t.number, plans[t.params["plan"]], kind, t.value,
                                    attrs.get("peak_bytes"), round_, which))
    return trials
