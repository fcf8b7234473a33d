"""Capacity ranking: the candidate plans, their costs, the search, and the check on the simulated GPU."""

from __future__ import annotations

import math

import pytest
import torch

from autofit.estimator.capacity import Candidate, Fit, Space, choose, make_estimator, needs_message, rank
from autofit.estimator.cost import CHECKPOINT_COST, OFFLOAD_COST, candidate_plans, micro_batch_sizes, plan_cost
from autofit.plans.precision import MIXED_PRECISION_COST
from autofit.gpu.device import SimulatedDevice
from autofit.estimator.estimate import estimate
from autofit.plans.plan import Plan
from autofit.gpu.simulate import round_bytes, simulate_gpu
from autofit.sizes import format_size
from autofit.engine.step import StepRunner
from test_estimate import gpt2, gpt2_batch, simulated_peak

ROWS = 16


def rank_cpu(model, batch, budget, **values):
    """`rank` of a CPU estimator of `model` on `batch` (`values`: fit=, space= as rank takes them)."""
    return rank(make_estimator(model, batch, device_type="cpu"), batch, budget, **values)


def shape(plan: Plan) -> tuple:
    return (plan.micro_batch_size, plan.accumulation_steps, plan.precision, plan.checkpointing,
            plan.offload_optimizer)


def run_steps(budget: int, plan: Plan, steps: int = 2) -> None:
    """Real CPU steps of the test model under a simulated GPU of `budget` bytes."""
    model, batch = gpt2(), gpt2_batch(ROWS)
    with simulate_gpu(budget) as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device)
        try:
            for _ in range(steps):
                runner.run(batch, plan)
        finally:
            runner.close()


# -- plans and costs ------------------------------------------------------------------------------

@pytest.mark.parametrize("global_batch, sizes", [
    (1, [1]),
    (6, [6, 3, 2, 1]),
    (8, [8, 4, 3, 2, 1]),
    (32, [32, 16, 11, 8, 7, 6, 5, 4, 3, 2, 1]),
])
def test_micro_batch_sizes_are_the_smallest_for_each_number_of_micro_batches(global_batch, sizes):
    assert micro_batch_sizes(global_batch) == sizes


def test_candidate_plans_fixed_precision_without_offload():
    assert [shape(p) for p in candidate_plans(4, "fp32", allow_offload=False)] == [
        (4, 1, "fp32", False, False),
        (4, 1, "fp32", True, False),
        (2, 2, "fp32", False, False),
        (2, 2, "fp32", True, False),
        (1, 4, "fp32", False, False),
        (1, 4, "fp32", True, False),
    ]


def test_candidate_plans_auto_precision_falls_back_to_fp16_without_bf16():
    assert [shape(p) for p in candidate_plans(2, "auto", bf16_supported=False)] == [
        (2, 1, "fp32", False, False),
        (2, 1, "fp16", False, False),
        (2, 1, "fp32", True, False),
        (2, 1, "fp16", True, False),
        (1, 2, "fp32", False, False),
        (1, 2, "fp16", False, False),
        (1, 2, "fp32", True, False),
        (2, 1, "fp32", False, True),
        (1, 2, "fp16", True, False),
        (2, 1, "fp16", False, True),
        (2, 1, "fp32", True, True),
        (2, 1, "fp16", True, True),
        (1, 2, "fp32", False, True),
        (1, 2, "fp16", False, True),
        (1, 2, "fp32", True, True),
        (1, 2, "fp16", True, True),
    ]


def test_candidate_plans_options():
    assert {p.precision for p in candidate_plans(8)} == {"fp32", "bf16"}
    assert {p.precision for p in candidate_plans(8, "bf16")} == {"bf16"}
    assert not any(p.checkpointing for p in candidate_plans(8, checkpointing=False))
    assert len(candidate_plans(8)) == 5 * 2 * 2 * 2
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, bf16, fp16 but got 'half'"):
        candidate_plans(8, "half")
    with pytest.raises(ValueError, match="global_batch must be a positive int but got 0"):
        candidate_plans(0)


def test_plan_cost_values():
    G = 32
    assert plan_cost(Plan(32), G) == 1.0
    assert plan_cost(Plan.for_batch(G, 16), G) == 2 * 17 / 33
    assert plan_cost(Plan.for_batch(G, 11), G) == (2 * 12 + 11) / 33  # 11 + 11 + 10 rows
    assert plan_cost(Plan.for_batch(G, 8), G) == 4 * 9 / 33
    # Below 8 rows a micro-batch costs what one of 8 does.
    assert plan_cost(Plan.for_batch(G, 4), G) == 8 * 9 / 33 == 2 * plan_cost(Plan.for_batch(G, 8), G)
    assert plan_cost(Plan(32, precision="bf16"), G) == MIXED_PRECISION_COST
    assert plan_cost(Plan(32, checkpointing=True), G) == CHECKPOINT_COST
    assert plan_cost(Plan(32, offload_optimizer=True), G) == OFFLOAD_COST
    assert math.isclose(plan_cost(Plan.for_batch(G, 8, precision="fp16", checkpointing=True,
                                                 offload_optimizer=True), G),
                        4 * 9 / 33 * MIXED_PRECISION_COST * CHECKPOINT_COST * OFFLOAD_COST)


@pytest.mark.parametrize("global_batch", [16, 32, 96, 1001, 4096])
def test_costs_rank_plans_in_the_ladders_order(global_batch):
    """Accumulation down to micro-batch 8 first, then bf16, then checkpointing, then smaller
    micro-batches, as the runtime ladder walks them."""
    def cost(micro, **fields):
        return plan_cost(Plan.for_batch(global_batch, micro, **fields), global_batch)
    assert cost(global_batch) < cost(global_batch // 2) <= cost(8) < cost(global_batch, precision="bf16")
    assert cost(global_batch, precision="bf16") < cost(8, precision="bf16") \
        < cost(global_batch, checkpointing=True)
    assert cost(8, precision="bf16", checkpointing=True) < cost(4, precision="bf16")
    assert cost(1, precision="bf16", checkpointing=True) < cost(1, precision="bf16", checkpointing=True,
                                                                offload_optimizer=True)


def test_a_small_batch_split_unevenly_starves_the_gpu():
    # 9 rows as 8 + 1: the second micro-batch costs as much as the first, so bf16 on all 9 is faster.
    assert plan_cost(Plan.for_batch(9, 8), 9) == 2 * 9 / 10
    assert plan_cost(Plan(9, precision="bf16"), 9) < plan_cost(Plan.for_batch(9, 8), 9)


# -- rank and choose, checked on the simulated GPU ----------------------------------------------

@pytest.fixture(scope="module")
def peaks():
    """The simulated GPU's measured peaks of real CPU steps, by micro-batch (fp32 and bf16)."""
    batch = gpt2_batch(ROWS)
    return {(m, p): simulated_peak(gpt2(), batch, Plan.for_batch(ROWS, m, precision=p))
            for m, p in ((16, "fp32"), (8, "fp32"), (8, "bf16"))}


def test_rank_picks_the_largest_micro_batch_that_really_fits(peaks):
    budget = peaks[16, "fp32"] - 1  # the whole batch at once does not fit
    candidates = rank_cpu(gpt2(), gpt2_batch(ROWS), budget, fit=Fit(margin=1.0))
    assert [(shape(c.plan), c.fits) for c in candidates] == [
        ((16, 1, "fp32", False, False), False),
        ((8, 2, "fp32", False, False), True),
    ]
    assert [c.estimate.peak_bytes for c in candidates] == [peaks[16, "fp32"], peaks[8, "fp32"]]
    chosen = choose(candidates)
    assert chosen.plan == Plan.for_batch(ROWS, 8)
    run_steps(budget, chosen.plan)  # runs
    with pytest.raises(torch.OutOfMemoryError):
        run_steps(budget, Plan(ROWS))


def test_rank_prefers_bf16_to_a_gpu_starving_micro_batch(peaks):
    budget = peaks[8, "fp32"] - 1  # fp32 needs micro-batches of 6 or fewer rows
    candidates = rank_cpu(gpt2(), gpt2_batch(ROWS), budget, fit=Fit(margin=1.0))
    assert [(shape(c.plan), c.fits) for c in candidates] == [
        ((16, 1, "fp32", False, False), False),
        ((8, 2, "fp32", False, False), False),
        ((16, 1, "bf16", False, False), False),
        ((8, 2, "bf16", False, False), True),
        ((6, 3, "fp32", False, False), True),
        ((3, 6, "fp32", False, False), True),
    ]
    chosen = choose(candidates)
    assert chosen.plan == Plan.for_batch(ROWS, 8, precision="bf16")
    assert chosen.estimate.peak_bytes == peaks[8, "bf16"]
    run_steps(budget, chosen.plan)
    with pytest.raises(torch.OutOfMemoryError):
        run_steps(budget, Plan.for_batch(ROWS, 8))


def test_a_roomy_budget_needs_one_estimate():
    candidates = rank_cpu(gpt2(), gpt2_batch(ROWS), "1GiB")
    assert [(shape(c.plan), c.fits, c.cost) for c in candidates] == [
        ((16, 1, "fp32", False, False), True, 1.0)]


def test_margin_and_calibration_decide_what_fits(peaks):
    peak = peaks[16, "fp32"]
    assert rank_cpu(gpt2(), gpt2_batch(ROWS), peak, fit=Fit(margin=1.0), space=Space(max_estimates=1))[0].fits
    assert not rank_cpu(gpt2(), gpt2_batch(ROWS), peak, fit=Fit(margin=0.99),
                        space=Space(max_estimates=1))[0].fits
    assert not rank_cpu(gpt2(), gpt2_batch(ROWS), peak, fit=Fit(margin=1.0, calibration=1.01),
                        space=Space(max_estimates=1))[0].fits


def test_max_estimates_caps_the_search():
    candidates = rank_cpu(gpt2(), gpt2_batch(ROWS), "2.5MiB", space=Space(max_estimates=3))
    assert len(candidates) == 3


def test_choose_takes_the_fastest_that_fits():
    def cand(micro, cost, fits):
        plan = Plan.for_batch(ROWS, micro)
        return Candidate(plan, None, fits, cost)
    a, b, c = cand(16, 1.0, False), cand(8, 1.06, True), cand(4, 2.1, True)
    assert choose([c, b, a]) is b
    assert choose([a]) is None
    assert choose([]) is None


# -- when nothing fits ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sizes():
    model = gpt2()
    params = sum(round_bytes(p.numel() * p.element_size()) for p in model.parameters())
    return {"params": params, "grads": params, "optimizer": 2 * params}


def test_nothing_fits_even_parameters_and_gradients(sizes):
    budget = 100 * 1024
    candidates = rank_cpu(gpt2(), gpt2_batch(ROWS), budget)
    assert choose(candidates) is None
    assert [shape(c.plan) for c in candidates] == [(1, 16, "bf16", True, True)]  # one estimate
    assert candidates[0].estimate.resident == sizes
    weights = sizes["params"] + sizes["grads"]
    assert needs_message(candidates, budget, margin=0.9) == (
        f"parameters and gradients alone need {format_size(weights)} of a 100.00 KiB budget "
        f"(90.00 KiB usable at margin 0.9), even with the AdamW state "
        f"({format_size(sizes['optimizer'])}) offloaded: use a smaller model, freeze part of it, or a "
        f"GPU with more memory.")


def test_nothing_fits_without_offload(sizes):
    budget = 2 * 2**20
    everything = sum(sizes.values())
    assert sizes["params"] + sizes["grads"] < budget < everything
    candidates = rank_cpu(gpt2(), gpt2_batch(ROWS), budget, fit=Fit(margin=1.0),
                          space=Space(allow_offload=False))
    assert choose(candidates) is None
    assert not any(c.plan.offload_optimizer for c in candidates)
    assert needs_message(candidates, budget, margin=1.0) == (
        f"parameters, gradients and AdamW state alone need {format_size(everything)} of a 2.00 MiB "
        f"budget: offload the optimizer or use a smaller model.")


def test_nothing_fits_because_of_activations(sizes):
    budget = int(1.35 * 2**20)
    weights = sizes["params"] + sizes["grads"]
    assert weights < budget
    candidates = rank_cpu(gpt2(), gpt2_batch(ROWS), budget, fit=Fit(margin=1.0))
    assert choose(candidates) is None
    # Little room beyond the weights: the most frugal plans are tried first, and suffice to tell.
    assert [shape(c.plan) for c in candidates] == [(1, 16, "fp32", True, True), (1, 16, "bf16", True, True)]
    smallest = candidates[1]
    message = needs_message(candidates, budget, margin=1.0)
    assert message == (
        f"the smallest plan tried (micro 1 x 16, bf16, checkpointing, offload) needs "
        f"{format_size(smallest.estimate.peak_bytes)} of a 1.35 MiB budget: parameters and "
        f"gradients take {format_size(weights)} and activations "
        f"{format_size(smallest.estimate.breakdown['activations'])} at 1 row(s) per micro-batch; "
        f"shorten the sequences or use a smaller model.")


def test_needs_message_when_a_plan_fits():
    candidates = rank_cpu(gpt2(), gpt2_batch(ROWS), "1GiB", fit=Fit(margin=1.0))
    assert needs_message(candidates, "1GiB", margin=1.0).startswith(
        "micro 16 x 1, fp32 fits: ")
    assert needs_message([], "1GiB") == "no plan was estimated; nothing is known to fit."


@pytest.mark.parametrize("value, kwargs, match", [
    (Fit, {"margin": 0}, "margin must be in"),
    (Fit, {"margin": 1.5}, "margin must be in"),
    (Fit, {"calibration": 0}, "calibration must be a positive number"),
    (Space, {"max_estimates": 0}, "max_estimates must be a positive int"),
    (Space, {"precision": "half"}, "precision must be one of"),
])
def test_rank_rejects_bad_arguments(value, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rank_cpu(gpt2(), gpt2_batch(ROWS), "1GiB", **{value.__name__.lower(): value(**kwargs)})


def test_estimate_and_rank_agree_on_the_cuda_side():
    """device_type="cuda" (the default) ranks with the estimator's CUDA predictions."""
    batch = gpt2_batch(ROWS)
    candidates = rank(make_estimator(gpt2("sdpa"), batch), batch, "1GiB")
    assert candidates[0].estimate == estimate(gpt2("sdpa"), batch, Plan(ROWS))
    assert candidates[0].estimate.device_type == "cuda"
