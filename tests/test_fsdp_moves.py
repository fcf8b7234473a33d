"""FSDP2's own moves: reshard_after_forward and a reduce-scatter per micro-batch, as plan fields, on
the ladder, priced by the capacity check, applied to the live sharded model on every rank alike."""

import os
import sys
from datetime import timedelta

import pytest
import torch

from autofit.estimator.capacity import Space, choose, rank
from autofit.estimator.cost import REDUCE_EACH_COST, RESHARD_COST, candidate_plans, plan_cost
from autofit.estimator.sharded import ShardedEstimator, Sharding
from autofit.gpu.device import CpuDevice
from autofit.plans.applies import not_applicable, unavailable_changes
from autofit.plans.ladder import default_ladder, sharded
from autofit.plans.sizelog import SizeLog, config_of
from autofit.plans.plan import Plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import bert, cls_batches, plain_loop  # noqa: E402
from spawn import max_diff, ranks_results, save_rank  # noqa: E402

WORLD, PER_RANK = 2, 8
PROCESS_TIMEOUT = 300


# -- in one process --------------------------------------------------------------------------------

def test_plan_fields_round_trip_and_old_plans_stay_valid():
    plan = Plan(4, 2, reshard_after_forward=False, reduce_each_micro_batch=True)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.to_dict()["reshard_after_forward"] is False
    assert plan.to_dict()["reduce_each_micro_batch"] is True
    old = {"micro_batch_size": 8, "accumulation_steps": 1, "precision": "fp32", "checkpointing": False,
           "offload_optimizer": False, "per_parameter_step": False}  # cached before these fields
    assert Plan.from_dict(old) == Plan(8)
    assert (Plan(8).reshard_after_forward, Plan(8).reduce_each_micro_batch) == (None, False)
    assert plan.describe() == ("micro 4 x 2, fp32, gathered params kept for backward, "
                               "reduce-scatter per micro-batch")
    assert Plan(8, reshard_after_forward=True).describe() == "micro 8 x 1, fp32, reshard after forward"
    assert Plan(8).describe() == "micro 8 x 1, fp32"
    # the settings are part of what a micro-batch size's memory depends on; unset, keys as before
    assert config_of(Plan(8)) == ("fp32", False, False)
    assert config_of(plan) == ("fp32", False, False, "kept gathered", "reduce-scatter per micro-batch")
    assert config_of(Plan(8, reshard_after_forward=True)) == ("fp32", False, False, "reshard after forward")
    with pytest.raises(TypeError, match=r"reshard_after_forward must be True, False or None .* got 'no'"):
        Plan(8, reshard_after_forward="no")
    with pytest.raises(TypeError, match="reduce_each_micro_batch must be True or False but got 1"):
        Plan(8, reduce_each_micro_batch=1)


def test_fsdp_moves_come_first_cheapest_in_speed_first():
    ladder = sharded(default_ladder(SizeLog(), precision="fp32"))
    plan, seen = Plan.for_batch(16, reshard_after_forward=False), []
    while plan is not None:
        seen.append(plan.describe())
        plan = ladder(plan)
    assert seen == [
        "micro 16 x 1, fp32, gathered params kept for backward",
        "micro 16 x 1, fp32, reshard after forward",
        # one micro-batch: a reduce-scatter per micro-batch changes nothing, so the split comes first
        "micro 8 x 2, fp32, reshard after forward",
        "micro 8 x 2, fp32, reshard after forward, reduce-scatter per micro-batch",
        "micro 8 x 2, fp32, checkpointing, reshard after forward, reduce-scatter per micro-batch",
        "micro 4 x 4, fp32, checkpointing, reshard after forward, reduce-scatter per micro-batch",
        "micro 2 x 8, fp32, checkpointing, reshard after forward, reduce-scatter per micro-batch",
        "micro 1 x 16, fp32, checkpointing, reshard after forward, reduce-scatter per micro-batch",
        "micro 1 x 16, fp32, checkpointing, offload, reshard after forward, reduce-scatter per micro-batch",
    ]
    # the model's own setting (None) is never changed by the ladder; the default ladder has no FSDP move
    assert ladder(Plan(16, reshard_after_forward=None)) == Plan(8, 2)
    assert default_ladder(SizeLog(), precision="fp32")(Plan(8, 2)) == Plan(8, 2, checkpointing=True)
    # the cost model orders them as the ladder does
    assert plan_cost(Plan(16, reshard_after_forward=True), 16) == pytest.approx(RESHARD_COST)
    assert plan_cost(Plan(8, 2, reduce_each_micro_batch=True), 16) == pytest.approx(plan_cost(Plan(8, 2), 16) * REDUCE_EACH_COST)
    assert plan_cost(Plan(8, reduce_each_micro_batch=True), 8) == 1.0  # one micro-batch: no extra reduce
    first = candidate_plans(8, "fp32", allow_offload=False, checkpointing=False, reshard=(False, True))[:5]
    assert [p.describe() for p in first] == [
        "micro 8 x 1, fp32, gathered params kept for backward",
        "micro 8 x 1, fp32, reshard after forward",
        "micro 4 x 2, fp32, gathered params kept for backward",
        "micro 4 x 2, fp32, reshard after forward",
        "micro 4 x 2, fp32, gathered params kept for backward, reduce-scatter per micro-batch"]


def test_fsdp_settings_do_not_apply_to_a_replicated_model():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    device = CpuDevice()
    assert not_applicable(Plan(4, reshard_after_forward=True), model, opt, device) == (
        "reshard_after_forward=True is FSDP2's, and Sequential is not sharded with fully_shard "
        "(shard=True or your own fully_shard)")
    assert not_applicable(Plan(2, 2, reduce_each_micro_batch=True), model, opt, device) == (
        "a reduce-scatter per micro-batch is FSDP2's, and Sequential is not sharded with fully_shard "
        "(shard=True or your own fully_shard)")
    assert not_applicable(Plan(4), model, opt, device) is None
    applies = lambda plan: not_applicable(plan, model, opt, device)  # noqa: E731
    # a replicated plan: nothing FSDP's to withhold (explain's fixes are as before)
    assert "reshard_after_forward" not in unavailable_changes(Plan(2, 2), applies)
    # a sharded plan judged on this replicated model does not apply itself: nothing known
    assert unavailable_changes(Plan(2, 2, reshard_after_forward=False), applies) == {}


@pytest.mark.slow
def test_the_capacity_check_picks_the_fastest_fsdp_setting_that_fits():
    """Priced per rank on a fake world of 2 ranks (16 rows each): the fastest plan whose predicted
    peak fits, walking the FSDP settings as the ladder does, before checkpointing."""
    model = bert(hidden=64)
    batch = {k: v[:16] for k, v in cls_batches(1, rows=32, seed=4)[0].items()}
    est = ShardedEstimator(model, batch, Sharding(WORLD, reshard_after_forward=False), device_type="cpu")
    plans = {"16F": Plan(16, reshard_after_forward=False), "16T": Plan(16, reshard_after_forward=True),
             "8F": Plan(8, 2, reshard_after_forward=False), "8T": Plan(8, 2, reshard_after_forward=True),
             "8FR": Plan(8, 2, reshard_after_forward=False, reduce_each_micro_batch=True),
             "8TR": Plan(8, 2, reshard_after_forward=True, reduce_each_micro_batch=True)}
    known = {}
    measure = est.measure
    est.measure = lambda plan: known[plan] if plan in known else known.setdefault(plan, measure(plan))
    peak = {name: est.measure(p).peak_bytes for name, p in plans.items()}
    # each setting saves memory: FSDP2's own, counted on its fake copy
    assert peak["16F"] > peak["16T"] > peak["8F"] > peak["8T"] > peak["8FR"] > peak["8TR"]

    def chosen(budget):
        return choose(rank(est, batch, budget, space=Space("fp32"))).plan
    assert chosen(peak["16F"]) == plans["16F"]
    assert chosen(peak["16F"] - 1) == plans["16T"]
    assert chosen(peak["16T"] - 1) == plans["8F"]
    assert chosen(peak["8F"] - 1) == plans["8T"]
    assert chosen(peak["8T"] - 1) == plans["8FR"]
    assert chosen(peak["8FR"] - 1) == plans["8TR"]  # before checkpointing (cost 4/3)
    # a model sharded with reshard_after_forward=True: keeping gathered parameters is never priced
    user = ShardedEstimator(model, batch, Sharding(WORLD), device_type="cpu")
    priced = {c.plan for c in rank(user, batch, peak["8F"], space=Space("fp32"))}
    assert priced and all(p.reshard_after_forward is True for p in priced)


# -- two gloo ranks: one spawned scenario ------------------------------------------------------------

def _full(model) -> dict:
    """The whole parameters (every rank's shards gathered: a collective, run on every rank)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _user_sharded(reshard: bool):
    from torch.distributed.fsdp import fully_shard
    model = bert(hidden=64)
    for layer in model.bert.encoder.layer:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def _second_step_peak(plan, batch) -> int:
    """This rank's peak of a second global step under `plan`, trained as autofit trains a sharded
    model (FSDP's switches set by the plan), on a fresh simulated GPU."""
    import autofit
    from autofit.distributed.fsdp import Sharded
    from autofit.engine.step import StepRunner
    from autofit.gpu.device import SimulatedDevice
    with autofit.simulate_gpu() as gpu:
        model = _user_sharded(False)
        device = SimulatedDevice(gpu)
        switches = Sharded(model)
        switches.prepare(plan)
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device, sync=switches.sync)
        runner.run(batch, plan)
        runner.run(batch, plan)
        peak = runner.attempt_peak()
        runner.close()
        switches.close()
    return peak


def _worker(rank_, init_file, out_dir):
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    import autofit
    from autofit.distributed.fsdp import reshard_choices, user_reshard_after_forward

    def run(model, data, **kw):
        return autofit.run(model, data, **{"precision": "fp32", "progress": False, "cache": False, **kw})

    def attempts(result):
        return [[a.step, a.plan.micro_batch_size, a.plan.accumulation_steps, a.plan.reshard_after_forward,
                 a.plan.reduce_each_micro_batch, a.outcome] for a in result.attempts]
    seen, saved = {}, {}
    batches = cls_batches(2, rows=2 * PER_RANK, seed=4)
    # Estimated on every rank (each as rank 0 of the estimator's fake world) BEFORE any real FSDP
    # work with the same shapes: DTensor caches plans keyed by the device mesh, and a mesh equal to
    # the real one would hand rank 1 the fake rank 0's plans (the ranks' parameters then differ).
    from autofit.estimator.sharded import estimate_sharded
    mine = {k: v[rank_ * PER_RANK:(rank_ + 1) * PER_RANK] for k, v in batches[0].items()}
    kept = estimate_sharded(bert(hidden=64), WORLD, Plan(8, reshard_after_forward=False), mine,
                            device_type="cpu").peak_bytes

    # 1. The user sharded with reshard_after_forward=False; rank 1's budget lies between the second
    # step's peaks of 8 x 2 resharding (fails) and 8 x 2 with a reduce-scatter per micro-batch
    # (fits), each measured on this rank first; rank 0's is large. Both ranks walk one plan sequence.
    big = cls_batches(2, rows=4 * PER_RANK, seed=4)
    share = {k: v[rank_ * 2 * PER_RANK:(rank_ + 1) * 2 * PER_RANK] for k, v in big[0].items()}
    # gloo's thread frees a collective's buffers after the wait returns; inside autofit's runs the
    # guards let that free run at once (fsdp_guard), but these bare StepRunner measurements are at
    # times 76 KiB late: the least of three is the on-time peak.
    fails = min(_second_step_peak(Plan(8, 2, reshard_after_forward=True), share) for _ in range(3))
    fits = min(_second_step_peak(Plan(8, 2, reshard_after_forward=True, reduce_each_micro_batch=True), share)
               for _ in range(3))
    with autofit.simulate_gpu("256MiB" if rank_ == 0 else (fails + fits) // 2):
        model = _user_sharded(False)
        result = run(model, big, capacity_check=False)
        seen["budgets"] = {"attempts": attempts(result), "fails": fails, "fits": fits,
                           "why": [a.reason for a in result.attempts],
                           "errors": [a.error[:40] for a in result.attempts if a.outcome == "oom"],
                           "micro": [h["plan"].micro_batch_size for h in result.history],
                           # handed back as the user sharded it
                           "after": [user_reshard_after_forward(model), [
                               g.post_forward_mesh_info is None for u in (model.bert.encoder.layer[0], model)
                               for g in u._get_fsdp_state()._fsdp_param_groups]]}
        saved["budgets"] = _full(model)

    # 2. shard=True: the capacity check prices FSDP's settings for the model autofit sharded; with
    # room it keeps gathered parameters, with a budget below that plan's predicted peak it reshards.
    # With gathered parameters kept, an evaluation between epochs (no backward to reshard them)
    # runs in lockstep and leaves training as it was.
    for name, budget in (("roomy", "256MiB"), ("tight", kept - 1)):
        with autofit.simulate_gpu(budget):
            model = bert(hidden=64)
            extra = {"eval_data": cls_batches(1, rows=2 * PER_RANK, seed=9)} if name == "roomy" else {}
            result = run(model, batches, shard=True, optimizer=torch.optim.AdamW, **extra)
            seen[name] = {"attempts": attempts(result), "choices": list(reshard_choices(model)),
                          "reason": result.attempts[0].reason,
                          "eval": [[e["samples"], round(e["loss"], 6)] for e in result.eval_history]}
            saved[name] = _full(model)

    # 3. A user model sharded with True: never a plan that keeps gathered parameters.
    model = _user_sharded(True)
    from autofit.plans.applies import not_applicable
    from autofit.gpu.device import CpuDevice
    opt = torch.optim.AdamW(model.parameters())
    seen["user_true"] = {"choices": list(reshard_choices(model)), "refused": not_applicable(
        Plan(8, reshard_after_forward=False), model, opt, CpuDevice())}

    # 4. Optimizer offload of a sharded model's optimizer (the ladder's last rung under FSDP2): an
    # OOM on rank 1 at the first step offloads on both ranks; the StepLR acts on every update and
    # the run equals the unoffloaded one with the same splits, optimizer state included.
    from autofit.plans.ladder import offload_optimizer
    for name, fault in (("device", False), ("offloaded", rank_ == 1)):
        with autofit.simulate_gpu() as gpu:
            model, calls = bert(hidden=64, dropout=0.1), []  # dropout: the replay redraws the same masks

            def loss_fn(model, batch, gpu=gpu, fault=fault, calls=calls):
                if fault and not calls:  # the first forward's next allocation fails
                    gpu.fail_at(gpu.allocation_count)
                calls.append(1)
                return model(**batch).loss
            result = run(model, batches, shard=True, capacity_check=False, ladder=offload_optimizer(),
                         loss_fn=loss_fn,
                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                         scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5))
            opt = result.optimizer
            seen[name] = {"attempts": [[a.step, a.plan.offload_optimizer, a.outcome] for a in result.attempts],
                          "lr": [g["lr"] for g in opt.param_groups],
                          "state": sorted({k for s in opt.state.values() for k in s}),
                          "on_device": sum(gpu.holds(v) for s in opt.state.values() for v in s.values()
                                           if torch.is_tensor(v) and v.dim() > 0)}
            saved[name] = _full(model)
            saved[name + " state"] = {f"{i} {k}": (v.to_local() if hasattr(v, "to_local") else v).clone()
                                      for i, s in enumerate(opt.state.values()) for k, v in s.items()}

    save_rank(out_dir, rank_, seen, saved)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return ranks_results(_worker, tmp_path_factory.mktemp("fsdp_moves"), WORLD, PROCESS_TIMEOUT)


@pytest.mark.slow
def test_fsdp_moves_on_two_ranks(ranks):
    (r0, r1), (p0, p1) = ranks
    for seen in (r0, r1):
        # [step, micro-batch, accumulation, reshard_after_forward, reduce-scatter each, outcome]
        assert seen["budgets"]["attempts"] == [
            [0, 16, 1, False, False, "oom"],  # the user's setting first
            [0, 16, 1, True, False, "oom"],   # FSDP's cheapest move
            [0, 8, 2, True, False, "ok"],     # one micro-batch: no reduce-scatter move, the split
            [1, 12, 2, True, False, "oom"],   # the upward probe
            [1, 8, 2, True, False, "oom"],    # the optimizer state now exists
            [1, 8, 2, True, True, "ok"]]      # a reduce-scatter per micro-batch before a smaller one
        assert seen["budgets"]["why"][1] == ("FSDP2 frees each unit's gathered parameters after forward "
                                             "and gathers them again in backward")
        assert seen["budgets"]["why"][5] == ("FSDP2 reduce-scatters each micro-batch's gradients into the "
                                             "shards instead of keeping them unsharded until the last")
        # handed back as the user sharded it: blocks and root keep their gathered parameters
        assert seen["budgets"]["after"] == [False, [True, True]]
        # shard=True: the capacity check keeps gathered parameters when they fit, else reshards
        assert seen["roomy"]["choices"] == [False, True]
        assert seen["roomy"]["attempts"] == [[0, 8, 1, False, False, "ok"], [1, 8, 1, False, False, "ok"]]
        assert seen["tight"]["attempts"] == [[0, 8, 1, True, False, "ok"], [1, 8, 1, True, False, "ok"]]
        assert [e[0] for e in seen["roomy"]["eval"]] == [16]  # every evaluation row once
        assert seen["tight"]["reason"].startswith("estimated: fastest plan predicted to fit")
        # the user's reshard_after_forward=True is never made more expensive
        assert seen["user_true"] == {"choices": [True], "refused": (
            "FSDPBertForSequenceClassification was sharded with reshard_after_forward=True; autofit "
            "never keeps more gathered than you chose (shard it with False to allow it)")}
    assert r0["roomy"]["eval"] == r1["roomy"]["eval"]
    loop = plain_loop(bert(hidden=64), cls_batches(2, rows=2 * PER_RANK, seed=4), [8, 8]).eval()
    with torch.no_grad():
        expected = loop(**cls_batches(1, rows=2 * PER_RANK, seed=9)[0]).loss.item()
    assert abs(r0["roomy"]["eval"][0][1] - expected) <= 1e-5  # the trained model, evaluated once
    assert all(e.startswith("out of memory on another rank (rank 1") for e in r0["budgets"]["errors"])
    assert all(e.startswith("CUDA out of memory") for e in r1["budgets"]["errors"])  # its own
    # the same mathematics: every setting, on both ranks, equals one process with the same splits
    for seen in (r0, r1):
        assert seen["device"]["attempts"] == [[0, False, "ok"], [1, False, "ok"]]
        assert seen["offloaded"]["attempts"] == [[0, False, "oom"], [0, True, "ok"], [1, True, "ok"]]
        assert seen["offloaded"]["lr"] == seen["device"]["lr"] == [2.5e-3]  # two StepLR steps
        assert seen["offloaded"]["state"] == ["exp_avg", "exp_avg_sq", "step"]
        assert seen["offloaded"]["on_device"] == 0  # handed back with its state on the host
    for p in (p0, p1):
        assert max_diff(p["offloaded"], p["device"]) == 0.0
        assert max_diff(p["offloaded state"], p["device state"]) == 0.0
    for name, data in (("budgets", cls_batches(2, rows=4 * PER_RANK, seed=4)),
                       ("roomy", cls_batches(2, rows=2 * PER_RANK, seed=4)),
                       ("tight", cls_batches(2, rows=2 * PER_RANK, seed=4))):
        assert max_diff(p0[name], p1[name]) == 0
        assert max_diff(p0[name], plain_loop(bert(hidden=64), data, [8, 8]).state_dict()) <= 1e-5, name
