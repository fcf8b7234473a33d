"""autofit.tune: which plans are trialled and in what order, OOM trials pruned after their memory is
freed, the winner cached for autofit.run, the user's model and optimizer untouched, the study in the
plan-cache file or in a storage given, bad input. Timings are never asserted: a fake clock decides."""

import copy
import gc
import importlib
import re
import sqlite3
import sys

import optuna  # in the test extra: a missing install must fail, not skip
import pytest
import torch

import autofit
from autofit.cache.store import PlanCache
from autofit.cache.sqlite_file import APPLICATION_ID
from autofit.plans.plan import Plan
from autofit.tuning.study import TuneTrial
from models import bert_batch, tiny_bert
from reference import second_step_peak

# Many runs, each ending (and recovering from an OOM) with a full gc.collect(): see frozen_heap.
pytestmark = pytest.mark.usefixtures("frozen_heap")

# `autofit.tune` is the function; its module is autofit.tuning.tune.
tune_module = importlib.import_module("autofit.tuning.tune")
throughput = importlib.import_module("autofit.tuning.throughput")
tune = tune_module.tune
verdict = importlib.import_module("autofit.tuning.verdict").verdict

ROWS = 16
# The plans for tiny_bert, global batch 16 x 16, on a budget where fp32 fits micro-batch 8 but not 16
# (budget() below): the default plan first, then the others by the cost model, fastest first.
SPACE = ["micro 8 x 2, fp32", "micro 8 x 2, bf16", "micro 4 x 4, fp32", "micro 4 x 4, bf16",
         "micro 2 x 8, fp32", "micro 2 x 8, bf16"]
_PEAKS = {}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny steps on 2 shared cores run ~8x faster on one intra-op thread (measured here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def budget(micro: int = 8) -> int:
    """A budget where the second step at `micro` rows fits inside the runner's margin (0.9) and the
    whole batch does not."""
    if micro not in _PEAKS:
        _PEAKS[micro] = second_step_peak(tiny_bert(), bert_batch(ROWS), Plan.for_batch(ROWS, micro))
    return int(_PEAKS[micro] / 0.85)


def batches(n: int = 2) -> list:
    return [bert_batch(ROWS, seed=s) for s in range(n)]


class Clock:
    """A fake clock: each read advances it by 1 s, except the second read of completed trial k,
    which advances it by `durations[k]` (a completed trial reads it exactly twice). `optimizer`
    gives an optimizer factory whose steps the clock counts: `at` holds the count at each read."""

    def __init__(self, durations=None):
        self.durations, self.reads, self.now = durations, 0, 0.0
        self.steps, self.at = 0, []

    def __call__(self) -> float:
        self.reads += 1
        self.at.append(self.steps)
        trial, second = divmod(self.reads - 1, 2)
        self.now += self.durations[trial] if self.durations is not None and second else 1.0
        return self.now

    def optimizer(self, params):
        optimizer = torch.optim.AdamW(params)
        optimizer.register_step_post_hook(lambda *_: setattr(self, "steps", self.steps + 1))
        return optimizer


def state_of(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def described(plans) -> list[str]:
    return [p.describe() for p in plans]


def cache_url() -> str:
    return f"sqlite:///{PlanCache().path}"


@pytest.mark.slow
def test_every_plan_once_in_order_fastest_cached_and_run_starts_from_it(tiny_bert):
    data = batches()
    untouched = copy.deepcopy(tiny_bert)
    before = state_of(tiny_bert)
    clock = Clock(durations=[4, 4, 2, 4, 4, 4])  # micro 4 x 4, fp32 is twice as fast as the rest
    result = tune(tiny_bert, data, budget=budget(), steps=1, warmup=1, rounds=1, clock=clock,
                  optimizer=clock.optimizer)

    assert described(result.space) == SPACE
    assert [(t.number, t.plan.describe(), t.outcome) for t in result.trials] == \
        [(i, plan, "ok") for i, plan in enumerate(SPACE)]
    assert [t.samples_per_second for t in result.trials] == [4.0, 4.0, 8.0, 4.0, 4.0, 4.0]
    # Each trial: one warm-up step untimed, then the clock read around the timed step.
    assert clock.at == [n for trial in range(len(SPACE)) for n in (2 * trial + 1, 2 * trial + 2)]
    assert result.plan == Plan(4, 4, "fp32")
    assert (result.samples_per_second, result.default_samples_per_second, result.speedup) == (8.0, 4.0, 2.0)
    assert result.default_plan == Plan(8, 2, "fp32")
    assert (result.measured, result.cached) == (len(SPACE), True)
    entry = PlanCache().get(result.key)
    assert entry["plan"] == result.plan.to_dict()
    assert entry["throughput"] == pytest.approx(8.0, rel=1e-3)  # the winner's measured rate
    assert same(state_of(tiny_bert), before)
    assert all(p.grad is None for p in tiny_bert.parameters()) and tiny_bert.training

    # The default plan is the one autofit.run starts from without tuning.
    plain = autofit.run(untouched, data, budget=budget(), progress=False, cache=False)
    assert plain.attempts[0].plan == result.default_plan
    assert plain.attempts[0].reason.startswith("estimated")

    # The next run of the job starts from the tuned plan, settled: no OOM attempt, no probe.
    run = autofit.run(tiny_bert, data, budget=budget(), progress=False)
    assert [(a.step, a.plan, a.outcome) for a in run.attempts] == [(0, result.plan, "ok"), (1, result.plan, "ok")]
    assert run.attempts[0].reason.startswith("cached")
    assert PlanCache().get(result.key)["plan"] == result.plan.to_dict()


def _optimistic_start(monkeypatch):
    """The estimator "thinks" the whole batch fits (it still runs, as tune would run it)."""
    real = throughput.estimated_start

    def optimistic(*args):
        real(*args)
        return Plan(ROWS), "estimated (patched)"
    monkeypatch.setattr(throughput, "estimated_start", optimistic)


def test_a_plan_that_runs_out_of_memory_is_pruned_after_its_memory_is_freed(tiny_bert, monkeypatch):
    _optimistic_start(monkeypatch)
    optimizer = torch.optim.AdamW(tiny_bert.parameters())
    with autofit.simulate_gpu(budget()) as gpu:
        gpu.track(list(tiny_bert.parameters()) + list(tiny_bert.buffers()))
        baseline = gpu.memory_allocated()
        result = tune(tiny_bert, batches(), budget=budget(), optimizer=optimizer, steps=1, rounds=1,
                      clock=Clock())
        assert gpu.memory_allocated() == baseline  # no trial's memory, no optimizer state left
    assert optimizer.state == {}

    assert described(result.space) == ["micro 16 x 1, fp32", "micro 8 x 2, fp32", "micro 8 x 2, bf16",
                                       "micro 4 x 4, fp32", "micro 4 x 4, bf16", "micro 2 x 8, bf16"]
    assert [t.outcome for t in result.trials] == ["oom", "ok", "ok", "ok", "ok", "ok"]
    study = optuna.load_study(study_name=result.study_name, storage=cache_url())
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.PRUNED] + \
        [optuna.trial.TrialState.COMPLETE] * 5
    pruned = study.trials[0].user_attrs["autofit"]
    assert pruned["outcome"] == "oom" and pruned["peak_bytes"] > 0 and "CUDA out of memory" in pruned["error"]
    # Every completed plan took as long (1 s a read): the first of them in trial order wins.
    assert result.plan == Plan(8, 2, "fp32")
    assert (result.default_plan, result.default_samples_per_second, result.speedup) == (Plan(ROWS), None, None)
    entry = PlanCache().get(result.key)
    assert (entry["plan"], entry["smallest_failing_micro_batch"]) == (result.plan.to_dict(), 16)


def test_memory_held_in_reference_cycles_is_collected_after_each_trial(tiny_bert):
    kept = []

    def loss_fn(model, batch):  # leaves a reference cycle holding a tensor of each micro-batch
        out = model(**batch)
        cycle = [out.logits * 1]
        cycle.append(cycle)
        kept.append(len(kept))
        return out.loss

    gc.disable()  # only an explicit collection frees the cycles
    try:
        with autofit.simulate_gpu(budget()) as gpu:
            gpu.track(list(tiny_bert.parameters()) + list(tiny_bert.buffers()))
            baseline = gpu.memory_allocated()
            tune(tiny_bert, batches(), budget=budget(), loss_fn=loss_fn, n_trials=1, steps=1, clock=Clock())
            assert kept and gpu.memory_allocated() == baseline
    finally:
        gc.enable()


def test_every_trial_starts_from_the_users_weights_and_no_optimizer_state(tiny_bert):
    optimizer = torch.optim.AdamW(tiny_bert.parameters())
    seen = []

    def loss_fn(model, batch):  # what each micro-batch's forward finds (the estimator's fakes aside)
        total = sum(p.double().sum().item() for p in model.parameters())
        if type(total) is float:
            seen.append((total, len(optimizer.state)))
        return model(**batch).loss

    result = tune(tiny_bert, batches(), budget=budget(), optimizer=optimizer, loss_fn=loss_fn, n_trials=2,
                  steps=1, clock=Clock())
    assert described(result.space[:2]) == ["micro 8 x 2, fp32", "micro 8 x 2, bf16"]  # 2 x 2 forwards each
    assert len(seen) == 8 and seen[4] == seen[0] and seen[0][1] == 0 and seen[2][1] > 0


def test_a_plan_that_ever_ran_out_of_memory_never_wins():
    fast, slow = Plan(8, 2), Plan(4, 4)
    trials = [TuneTrial(0, fast, "ok", 100.0), TuneTrial(1, slow, "ok", 50.0), TuneTrial(2, fast, "oom", None),
              TuneTrial(3, slow, "ok", 70.0)]
    result = verdict(trials, fast, [fast, slow], 4, "s", "memory", "k")
    assert (result.plan, result.samples_per_second, result.default_samples_per_second) == (slow, 60.0, None)
    with pytest.raises(autofit.DoesNotFit, match="1 plan.s. are not measured yet: run tune again"):
        verdict(trials[2:3], fast, [fast, slow], 1, "s", "memory", "k")


@pytest.mark.parametrize("challenger, winner", [(103.0, "default"), (103.5, "challenger")])
def test_the_default_plan_stays_unless_another_is_more_than_3_percent_faster(challenger, winner):
    default, other = Plan(8, 2), Plan(4, 4)
    trials = [TuneTrial(0, default, "ok", 100.0), TuneTrial(1, other, "ok", challenger)]
    result = verdict(trials, default, [default, other], 2, "s", "memory", "k")
    assert result.plan == {"default": default, "challenger": other}[winner]


@pytest.mark.slow
def test_the_users_model_optimizer_gradients_and_rng_are_untouched(tiny_bert):
    for module in tiny_bert.modules():  # training steps draw from torch's RNG
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    optimizer = torch.optim.AdamW(tiny_bert.parameters(), lr=3e-4, weight_decay=0.05)
    for batch in batches():  # optimizer state and gradients exist before tuning
        optimizer.zero_grad()
        tiny_bert(**batch).loss.backward()
        optimizer.step()
    tiny_bert.eval()
    before = state_of(tiny_bert)
    grads = [p.grad.clone() for p in tiny_bert.parameters()]
    opt_state = copy.deepcopy(optimizer.state_dict())
    data, limit = batches(), budget(ROWS)  # budget() builds a model: it seeds torch's RNG
    rng = torch.get_rng_state()

    result = tune(tiny_bert, data, budget=limit, optimizer=optimizer, n_trials=2, steps=1, clock=Clock())

    assert result.measured == 2
    assert same(state_of(tiny_bert), before)
    assert all(torch.equal(p.grad, g) for p, g in zip(tiny_bert.parameters(), grads))
    after = optimizer.state_dict()
    assert after["param_groups"] == opt_state["param_groups"]
    assert after["state"].keys() == opt_state["state"].keys()
    assert all(torch.equal(after["state"][i][k], v) for i, s in opt_state["state"].items() for k, v in s.items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not tiny_bert.training


@pytest.mark.slow
def test_the_study_lives_in_the_plan_cache_file_and_resumes_without_measuring_twice(tiny_bert):
    data = batches()
    first = tune(tiny_bert, data, budget=budget(), n_trials=2, steps=1, rounds=1, clock=Clock())
    assert (first.measured, described(t.plan for t in first.trials)) == (2, SPACE[:2])
    rest = tune(tiny_bert, data, budget=budget(), n_trials=50, steps=1, rounds=1, clock=Clock())
    assert (rest.measured, described(t.plan for t in rest.trials)) == (len(SPACE) - 2, SPACE)
    again = tune(tiny_bert, data, budget=budget(), steps=1, rounds=1, clock=Clock())
    assert (again.measured, again.trials, again.plan) == (0, rest.trials, rest.plan)

    path = PlanCache().path
    assert (rest.storage, rest.study_name) == (f"sqlite:///{path}", "autofit-" + rest.key)
    conn = sqlite3.connect(path)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    conn.close()
    assert {"plans", "studies", "trials"} <= tables
    assert len(optuna.load_study(study_name=rest.study_name, storage=cache_url()).trials) == len(SPACE)
    assert [(e["key"], e["entry"]["plan"]) for e in PlanCache().entries()] == [(rest.key, rest.plan.to_dict())]
    assert list(path.parent.glob("*.corrupt-*")) == []


@pytest.mark.slow
def test_a_storage_given_is_shared_by_machines_tuning_the_same_job(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    one = tune(tiny_bert(), batches(), budget=budget(), storage=url, n_trials=3, steps=1, rounds=1,
               clock=Clock())
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "other-machine"))
    two = tune(tiny_bert(), batches(), budget=budget(), storage=url, steps=1, rounds=1, clock=Clock())

    assert one.study_name == two.study_name == "autofit-" + one.key and one.key == two.key
    assert (one.storage, one.measured, two.measured) == (url, 3, len(SPACE) - 3)
    assert described(t.plan for t in two.trials) == SPACE
    assert len(optuna.load_study(study_name=two.study_name, storage=url).trials) == len(SPACE)
    assert PlanCache().get(two.key)["plan"] == two.plan.to_dict()
    conn = sqlite3.connect(PlanCache().path)  # the plan cache holds no study when a storage is given
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")] == ["plans"]
    conn.close()


def test_without_the_cache_nothing_is_written(tiny_bert):
    result = tune(tiny_bert, batches(), budget=budget(), cache=False, n_trials=1, steps=1, clock=Clock())
    assert (result.cached, result.storage, described(t.plan for t in result.trials)) == \
        (False, "in memory (cache=False)", SPACE[:1])
    assert not PlanCache().path.exists()


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(n_trials=0), ValueError, "n_trials must be a positive int, or None to run every trial of the "
                                   "measurement, but got 0."),
    (dict(rounds=0), ValueError, "rounds must be a positive int (every plan measured once per round; 5 by "
                                 "default) but got 0."),
    (dict(retune="yes"), TypeError, "retune must be True (measure again) or False but got 'yes'."),
    (dict(n_trials=-2), ValueError, "but got -2."),
    (dict(n_trials=True), ValueError, "but got True."),
    (dict(steps=0), ValueError, "steps must be a positive int (global batches timed per trial) but got 0."),
    (dict(warmup=-1), ValueError, "warmup must be an int >= 0"),
    (dict(storage=3), TypeError, "storage must be None (the plan cache file), a database URL"),
    (dict(study_name=""), ValueError, "study_name must be a non-empty string"),
    (dict(clock=1.0), TypeError, "clock must be a callable"),
    (dict(precision="fp8"), ValueError, "precision must be one of auto, fp32, bf16, fp16 but got 'fp8'."),
    (dict(data=[]), ValueError, "data (list) yielded no batch; give at least one."),
    (dict(data=iter([bert_batch(ROWS)])), ValueError, "data is a one-shot iterator (list_iterator)"),
    (dict(budget=None), ValueError, "budget=None on cpu: nothing limits memory here, so there is nothing "
                                    "to tune against; pass budget='8GiB'"),
])
def test_bad_input_says_what_and_what_to_do(kwargs, error, words):
    if kwargs.get("budget", 1) is None and torch.cuda.is_available():
        pytest.skip("a CUDA card is something to tune against")
    kwargs = {"data": batches(1), "budget": budget(), **kwargs}
    with pytest.raises(error) as raised:
        tune(tiny_bert(), **kwargs)
    assert words in str(raised.value)


def test_a_simulated_gpu_without_a_budget_has_nothing_to_tune_against():
    with autofit.simulate_gpu(), pytest.raises(ValueError, match="nothing limits memory here"):
        tune(tiny_bert(), batches(1))


def test_without_optuna_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ImportError
    with pytest.raises(ImportError, match=r"autofit\.tune needs optuna, an optional extra: "
                                          r"pip install 'autofit\[tune\]'"):
        tune(tiny_bert(), batches(1), budget=budget())
    with pytest.raises(ImportError, match="pip install"):
        tune_module.run_options(True)


@pytest.mark.parametrize("option, error, words", [
    ("yes", TypeError, "tune must be False, True or a dict of options"),
    ({"trials": 3}, ValueError, "has unknown option(s) ['trials']"),
    ({"n_trials": 0}, ValueError, "n_trials must be a positive int"),
])
def test_run_options_are_checked_before_any_work(option, error, words):
    assert tune_module.run_options(True) == {}
    assert tune_module.run_options({"n_trials": 2, "steps": 1}) == {"n_trials": 2, "steps": 1}
    with pytest.raises(error) as raised:
        tune_module.run_options(option)
    assert words in str(raised.value)


def test_run_with_tune_starts_from_the_fastest_measured_plan(tiny_bert):
    data = batches()
    result = autofit.run(tiny_bert, data, budget=budget(), progress=False,
                         tune={"steps": 1, "rounds": 1, "clock": Clock(durations=[4, 4, 2, 4, 4, 4])})
    assert [(a.plan, a.outcome) for a in result.attempts] == [(Plan(4, 4, "fp32"), "ok")] * 2
    assert result.attempts[0].reason.startswith("tuned")


# -- rounds: interleaved, median and spread, a lead larger than the spread -------------------------

FP32 = ["micro 8 x 2, fp32", "micro 4 x 4, fp32", "micro 2 x 8, fp32"]  # the space with precision="fp32"


def seconds_for(order, per_plan) -> list:
    """Clock durations for trials measured in `order` ([(round, plan text)]): `per_plan[plan][round]`."""
    return [per_plan[plan][round_] for round_, plan in order]


@pytest.mark.slow
def test_rounds_interleave_every_plan_once_per_round_the_order_rotated(tiny_bert):
    order = [(0, FP32[0]), (0, FP32[1]), (0, FP32[2]), (1, FP32[1]), (1, FP32[2]), (1, FP32[0]),
             (2, FP32[2]), (2, FP32[0]), (2, FP32[1])]
    # 16 rows a step: 4 s is 4 samples/s. The default's round 1 stalls (32 s: 0.5 samples/s) and
    # micro 4 x 4 is fast in one round only: neither a stall nor one lucky round decides.
    per_plan = {FP32[0]: [4, 32, 4], FP32[1]: [2, 4, 4], FP32[2]: [4, 8, 16]}
    clock = Clock(durations=seconds_for(order, per_plan))
    result = tune(tiny_bert, batches(), budget=budget(), precision="fp32", steps=1, rounds=3, clock=clock,
                  optimizer=clock.optimizer)

    assert [(t.round, t.plan.describe()) for t in result.trials] == order
    assert clock.at == [n for trial in range(9) for n in (2 * trial + 1, 2 * trial + 2)]
    stats = [(s.plan.describe(), s.outcome, s.rounds, s.median, s.spread) for s in result.stats]
    assert stats == [(FP32[0], "ok", (4.0, 0.5, 4.0), 4.0, 0.0),
                     (FP32[1], "ok", (8.0, 4.0, 4.0), 4.0, 0.0),
                     (FP32[2], "ok", (4.0, 2.0, 1.0), 2.0, 1.0)]
    # The mean of rounds would crown micro 4 x 4 (5.33 against 2.83 samples/s); the medians tie.
    assert (result.plan, result.samples_per_second, result.speedup) == (Plan(8, 2), 4.0, 1.0)
    assert result.reason == "the default plan has the highest median"
    assert PlanCache().get(result.key)["plan"] == Plan(8, 2).to_dict()


@pytest.mark.parametrize("rounds, winner, reason", [
    # default 100 +/- 2, the other 110 +/- 4: a 10% lead, larger than both spreads.
    ([[98, 100, 102], [106, 110, 114]], "other",
     "micro 4 x 4, fp32 leads by 10.0%, the larger spread of the two is 4.0%: a lead larger than the spread"),
    # the same medians, the other's rounds spread by 12: the lead is within the noise.
    ([[98, 100, 102], [98, 110, 122]], "default",
     "kept the default plan: micro 4 x 4, fp32 leads by 10.0%, the larger spread of the two is 12.0%, "
     "within the noise (or under 3%)"),
    # the default's own spread is as large as the lead.
    ([[90, 100, 110], [110, 110, 110]], "default",
     "kept the default plan: micro 4 x 4, fp32 leads by 10.0%, the larger spread of the two is 10.0%, "
     "within the noise (or under 3%)"),
])
def test_a_plan_wins_only_when_its_lead_is_larger_than_the_spread(rounds, winner, reason):
    default, other = Plan(8, 2), Plan(4, 4)
    trials = [TuneTrial(i, plan, "ok", float(v), round=r)
              for i, (r, plan, v) in enumerate((r, plan, values[r]) for r in range(3)
                                               for plan, values in zip((default, other), rounds))]
    result = verdict(trials, default, [default, other], 6, "s", "memory", "k")
    assert result.plan == {"default": default, "other": other}[winner]
    assert result.reason == reason
    assert result.default_samples_per_second == 100.0


def test_describe_shows_each_plans_median_spread_and_range():
    default, other = Plan(8, 2), Plan(4, 4)
    trials = [TuneTrial(0, default, "ok", 100.0, round=0), TuneTrial(1, other, "ok", 120.0, round=0),
              TuneTrial(2, other, "ok", 124.0, round=1), TuneTrial(3, default, "ok", 98.0, round=1),
              TuneTrial(4, default, "ok", 102.0, round=2), TuneTrial(5, other, "ok", 116.0, round=2),
              TuneTrial(6, Plan(2, 8), "oom", None, round=0)]
    result = verdict(trials, default, [default, other, Plan(2, 8)], 7, "s", "memory", "k")
    assert result.describe().splitlines() == [
        "   plan               outcome  rounds ok  median samples/s  spread  range        default",
        "-  -----------------  -------  ---------  ----------------  ------  -----------  -------",
        "   micro 8 x 2, fp32  ok               3  100.0             2.0%    98.0-102.0   yes",
        "*  micro 4 x 4, fp32  ok               3  120.0             3.3%    116.0-124.0",
        "   micro 2 x 8, fp32  oom              0  -                 -       -",
        "chosen: micro 4 x 4, fp32, 120.0 samples/s +/- 3.3% (median of rounds), 1.20x the default plan's "
        "(micro 8 x 2, fp32); micro 4 x 4, fp32 leads by 20.0%, the larger spread of the two is 4.0%: "
        "a lead larger than the spread"]


@pytest.mark.slow
def test_retune_measures_a_stored_study_again_and_reads_the_new_measurement(tiny_bert):
    data = batches()
    first = tune(tiny_bert, data, budget=budget(), precision="fp32", steps=1, rounds=1,
                 clock=Clock(durations=[4, 2, 4]))
    assert (first.plan, first.measurement, first.measured) == (Plan(4, 4), 0, 3)
    again = tune(tiny_bert, data, budget=budget(), precision="fp32", steps=1, rounds=1, clock=Clock())
    assert (again.plan, again.measurement, again.measured) == (Plan(4, 4), 0, 0)  # nothing measured

    clock = Clock(durations=[4, 4, 2, 4, 2, 4])  # now micro 2 x 8 is twice as fast, in both rounds
    retuned = tune(tiny_bert, data, budget=budget(), precision="fp32", steps=1, rounds=2, retune=True,
                   clock=clock)
    assert (retuned.measurement, retuned.measured) == (1, 6)
    assert [(t.round, t.plan.describe()) for t in retuned.trials] == \
        [(0, FP32[0]), (0, FP32[1]), (0, FP32[2]), (1, FP32[1]), (1, FP32[2]), (1, FP32[0])]
    assert [s.rounds for s in retuned.stats] == [(4.0, 4.0), (4.0, 4.0), (8.0, 8.0)]
    assert (retuned.plan, retuned.speedup) == (Plan(2, 8), 2.0)
    assert PlanCache().get(retuned.key)["plan"] == Plan(2, 8).to_dict()
    study = optuna.load_study(study_name=retuned.study_name, storage=cache_url())
    assert [t.user_attrs["autofit_round"] for t in study.trials] == \
        [[0, 0]] * 3 + [[1, 0]] * 3 + [[1, 1]] * 3


def test_a_plan_out_of_memory_in_one_round_is_not_measured_again(tiny_bert, monkeypatch):
    _optimistic_start(monkeypatch)
    calls = []
    monkeypatch.setattr(tune_module, "measure", lambda model, opt, device, plan, *a, **k: (
        calls.append(plan.describe()), real_measure(model, opt, device, plan, *a, **k))[1])
    real_measure = throughput.measure
    result = tune(tiny_bert, batches(), budget=budget(), precision="fp32", steps=1, rounds=2, clock=Clock())
    # The space: 16 (the patched default), 8 and 4 rows; round 1 is 8, 4, then 16, pruned unmeasured.
    assert calls == ["micro 16 x 1, fp32", "micro 8 x 2, fp32", "micro 4 x 4, fp32",
                     "micro 8 x 2, fp32", "micro 4 x 4, fp32"]
    assert [(t.round, t.plan.micro_batch_size, t.outcome) for t in result.trials] == \
        [(0, 16, "oom"), (0, 8, "ok"), (0, 4, "ok"), (1, 8, "ok"), (1, 4, "ok"), (1, 16, "oom")]
    assert result.plan == Plan(8, 2) and result.stats[0].outcome == "oom"


def test_between_plans_the_noise_cannot_tell_apart_the_earlier_in_the_space_wins():
    default, second, third = Plan(16, 1), Plan(8, 2), Plan(4, 4)
    values = {default: [50, 52, 48], second: [100, 90, 110], third: [104, 112, 96]}
    trials = [TuneTrial(3 * r + i, plan, "ok", float(values[plan][r]), round=r)
              for r in range(3) for i, plan in enumerate((default, second, third))]
    result = verdict(trials, default, [default, second, third], 9, "s", "memory", "k")
    # micro 4 x 4 has the highest median (104), 4% above micro 8 x 2's, inside both spreads (10, 8).
    assert (result.plan, result.samples_per_second, result.speedup) == (second, 100.0, 2.0)
    assert result.reason == ("micro 8 x 2, fp32 comes first in the cost model's order and micro 4 x 4, fp32 "
                             "leads by 4.0%, the larger spread of the two is 10.0%, within the noise (or under 3%)")
    values[third] = [112, 115, 118]  # now 15% above, more than either spread (10, 3)
    trials = [TuneTrial(3 * r + i, plan, "ok", float(values[plan][r]), round=r)
              for r in range(3) for i, plan in enumerate((default, second, third))]
    assert verdict(trials, default, [default, second, third], 9, "s", "memory", "k").plan == third


def _no_bf16_kernel(estimated: bool):
    """As oneDNN's LSTM on a CPU without its bf16 kernel: a RuntimeError under bf16 autocast, on real
    tensors only or (`estimated`) on the estimator's fake tensors too."""
    from torch._subclasses.fake_tensor import is_fake

    def hook(module, args, kwargs):
        bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        if module.training and bf16 and (estimated or not is_fake(kwargs["input_ids"])):
            raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")
    return hook


def test_a_plan_whose_move_cannot_run_is_dropped_and_the_others_are_measured(tiny_bert):
    tiny_bert.register_forward_pre_hook(_no_bf16_kernel(estimated=False), with_kwargs=True)
    with autofit.simulate_gpu(budget()):
        result = tune(tiny_bert, batches(), budget=budget(), steps=1, rounds=1, clock=Clock())
    assert described(result.space) == SPACE
    assert [(t.plan.describe(), t.outcome) for t in result.trials] == [
        (p, "error" if "bf16" in p else "ok") for p in SPACE]
    study = optuna.load_study(study_name=result.study_name, storage=cache_url())
    dropped = study.trials[1].user_attrs["autofit"]
    assert dropped["outcome"] == "error" and dropped["error"] == (
        "RuntimeError: could not create a primitive descriptor for the LSTM forward propagation primitive")
    assert result.plan.precision == "fp32"


def test_the_capacity_check_drops_the_candidates_whose_move_cannot_run(tiny_bert, caplog):
    tiny_bert.register_forward_pre_hook(_no_bf16_kernel(estimated=True), with_kwargs=True)
    with autofit.simulate_gpu(budget()):
        result = tune(tiny_bert, batches(), budget=budget(), steps=1, rounds=1, clock=Clock())
    assert [p for p in described(result.space) if "bf16" in p] == []
    assert described(result.space)[0] == "micro 8 x 2, fp32"
    assert "error" not in {t.outcome for t in result.trials}  # nothing left to drop
    assert any(re.match(r"estimating micro \d+ x \d+, bf16 raised RuntimeError: could not create a primitive "
                        r"descriptor .*; plans like it are left out of the capacity check", r.getMessage())
               for r in caplog.records)
