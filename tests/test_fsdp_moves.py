"""FSDP2's own moves: reshard_after_forward and a reduce-scatter per micro-batch, as plan fields, on
the ladder, priced by the capacity check, applied to the live sharded model on every rank alike."""

import json
import os
import sys
from datetime import timedelta

import pytest
import torch

from autofit.estimator.capacity import choose, rank
from autofit.estimator.cost import REDUCE_EACH_COST, RESHARD_COST, candidate_plans, plan_cost
from autofit.estimator.sharded import ShardedEstimator, Sharding
from autofit.gpu.device import CpuDevice
from autofit.plans.applies import not_applicable, unavailable_changes
from autofit.plans.ladder import SizeLog, config_of, default_ladder, sharded
from autofit.plans.plan import Plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import bert, cls_batches, plain_loop  # noqa: E402
from spawn import spawn_ranks  # noqa: E402

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
        return choose(rank(model, batch, budget, precision="fp32", estimator=est, device_type="cpu")).plan
    assert chosen(peak["16F"]) == plans["16F"]
    assert chosen(peak["16F"] - 1) == plans["16T"]
    assert chosen(peak["16T"] - 1) == plans["8F"]
    assert chosen(peak["8F"] - 1) == plans["8T"]
    assert chosen(peak["8T"] - 1) == plans["8FR"]
    assert chosen(peak["8FR"] - 1) == plans["8TR"]  # before checkpointing (cost 4/3)
    # a model sharded with reshard_after_forward=True: keeping gathered parameters is never priced
    user = ShardedEstimator(model, batch, Sharding(WORLD), device_type="cpu")
    priced = {c.plan for c in rank(model, batch, peak["8F"], precision="fp32", estimator=user,
                                   device_type="cpu", sharding=Sharding(WORLD))}
    assert priced and all(p.reshard_after_forward is True for p in priced)
