"""The estimator's reserved peak, the capacity check comparing like with like, the calibration a run
measures and the cache keeps per model and device, and the probe the calibrated estimate guides."""

import logging

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

import autofit
from autofit.cache.memo import Memo
from autofit.cache.store import PlanCache
from autofit.estimator.capacity import Fit, Space, choose, rank
from autofit.estimator.estimate import Estimator, MemoryEstimate
from autofit.estimator.guide import Guide
from autofit.estimator.start import headroom
from autofit.gpu.workspaces import Workspaces
from autofit.gpu.device import Device, SimulatedDevice
from autofit.gpu.simulate import SimulatedGPU
from autofit.plans.plan import Plan
from autofit.plans.sizelog import SizeLog

ROWS, SEQ = 16, 16
MiB = 2**20


def bert(seed=0):
    """A tiny BERT with dropout, as jobs have it."""
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
        vocab_size=100, max_position_embeddings=SEQ, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1))


def batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mask = torch.ones(ROWS, SEQ, dtype=torch.long)
        mask[::3, SEQ // 2:] = 0  # padded rows
        out.append({"input_ids": torch.randint(0, 100, (ROWS, SEQ), generator=g), "attention_mask": mask,
                    "labels": torch.randint(0, 2, (ROWS,), generator=g)})
    return out


def steps(result):
    return [(a.step, a.plan.micro_batch_size, a.outcome) for a in result.attempts]


# -- point 2: the reserved peak, and a check that compares like with like ------------------------

def test_the_estimate_replays_its_allocations_through_the_caching_allocator():
    """The estimate's reserved peak is what the simulated GPU's allocator model reserves on the
    second step of the same plan (optimizer state in place), to the byte."""
    model, batch = bert(), batches(1)[0]
    for micro in (16, 5):
        plan = Plan.for_batch(ROWS, micro)
        est = autofit.estimate(model, batch, plan, device_type="cpu")
        with autofit.simulate_gpu(caps="reserved") as gpu:
            from autofit.engine.step import StepRunner
            from autofit.gpu.device import open_device
            copy = bert()
            with open_device() as device:
                device.place_model(copy)
                runner = StepRunner(copy, torch.optim.AdamW(copy.parameters()), device)
                runner.run(batch, plan)
                gpu.reset_peak_memory_stats()
                runner.run(batch, plan)
                runner.close()
            measured = gpu.max_memory_reserved()
        assert est.reserved_bytes == measured
        assert est.reserved_bytes % (2 * MiB) == 0 and est.reserved_bytes >= est.peak_bytes
        assert est.peak("reserved") == est.reserved_bytes and est.peak("allocated") == est.peak_bytes


class Peaks:
    """A stand-in estimator with hand-made peaks: allocated 10 MiB + 1 MiB per row, reserved 20 MiB
    + 1 MiB per row (a card's segments on top)."""

    rows, resident = ROWS, {"params": 1, "grads": 1, "optimizer": 1}
    model = torch.nn.Linear(2, 2)  # nothing to checkpoint

    def __init__(self):
        self.measured = []

    def measure(self, plan):
        self.measured.append(plan.micro_batch_size)
        m = plan.micro_batch_size
        return MemoryEstimate(plan, (10 + m) * MiB, {}, reserved_bytes=(20 + m) * MiB)

    def forget_source(self):
        pass


@pytest.mark.parametrize("caps, reserve, fitting", [
    ("allocated", 0, 16),                # 26 MiB allocated of 30: the whole batch
    ("reserved", 0, 8),                  # 28 MiB reserved of 30 (the whole batch: 36)
    ("reserved", 4 * MiB, 6),            # 26 of the 26 left after the workspace reserve
])
def test_the_capacity_decision_compares_the_peak_the_budget_caps(caps, reserve, fitting):
    candidates = rank(Peaks(), batches(1)[0], 30 * MiB, fit=Fit(caps=caps, reserve=reserve),
                      space=Space("fp32", allow_offload=False))
    chosen = choose(candidates)
    # micro_batch_sizes(16) = 16, 8, 6, 4, 3, 2, 1: the largest of them within the limit
    assert chosen.plan.micro_batch_size == fitting
    for c in candidates:
        assert c.fits == (c.estimate.peak(caps) <= 30 * MiB - reserve)


def test_headroom_says_which_peak_each_device_caps():
    assert headroom(SimulatedDevice(SimulatedGPU("1GiB"))) == {"caps": "allocated", "reserve": 0,
                                                               "workspaces": None}
    assert headroom(SimulatedDevice(SimulatedGPU("1GiB", caps="reserved"))) == {
        "caps": "reserved", "reserve": 0, "workspaces": None}
    hopper = Workspaces(cublas=32 * MiB, cublaslt=MiB, cudnn=32 * MiB)
    card = SimulatedGPU("1GiB", caps="reserved", workspaces=hopper)
    assert headroom(SimulatedDevice(card)) == {"caps": "reserved", "reserve": 32 * MiB, "workspaces": hopper}
    assert headroom(SimulatedDevice(card), torch.nn.Linear(2, 2)) == {"caps": "reserved", "reserve": 0,
                                                                     "workspaces": hopper}

    class Card(Device):
        type = "cuda"

        def capability(self):
            return (8, 0)
    ampere = Workspaces(cublas=8 * MiB + 128 * 1024, cublaslt=MiB, cudnn=8 * MiB + 128 * 1024)
    assert headroom(Card(), torch.nn.Conv2d(1, 1, 1)) == {"caps": "reserved", "reserve": ampere.cudnn,
                                                          "workspaces": ampere}


# -- point 4: the guided probe -------------------------------------------------------------------

def test_the_probe_goes_where_the_calibrated_estimate_says_and_bisects_after_a_failure():
    plan = Plan.for_batch(ROWS, 4)
    sizes = SizeLog(length=SEQ)
    sizes.record(plan, True)
    sizes.record(Plan.for_batch(ROWS, 16), False)
    # Blind: halfway between what fitted (4) and what failed (16).
    assert sizes.probe_up(plan, ROWS) == Plan.for_batch(ROWS, 10)
    peaks = Peaks()
    guide = Guide(None, "allocated", 21 * MiB)
    guide.attach(peaks, [], SEQ)
    # Guided: 10 MiB + m MiB <= 21 MiB -> 11, found with the estimates of 15, 10, 13, 11, 12.
    assert sizes.probe_up(plan, ROWS, guess=guide.largest) == Plan.for_batch(ROWS, 11)
    assert peaks.measured == [15, 10, 13, 11, 12]
    # The guess failed: from now on the search bisects between what fitted (4) and that failure.
    sizes.record(Plan.for_batch(ROWS, 11), False)
    assert sizes.probe_up(plan, ROWS, guess=guide.largest) == Plan.for_batch(ROWS, 7)
    # Calibrated x1.4 (cached from an earlier run): 1.4 * (10 + m) <= 21 -> 5.
    fresh = SizeLog(length=SEQ)
    fresh.record(plan, True)
    fresh.record(Plan.for_batch(ROWS, 16), False)
    calibrated = Guide(None, "allocated", 21 * MiB, calibration=1.4)
    calibrated.attach(Peaks(), [], SEQ)
    assert fresh.probe_up(plan, ROWS, guess=calibrated.largest) == Plan.for_batch(ROWS, 5)
    # Nothing above what fitted is predicted to fit: no probe.
    fresh.record(Plan.for_batch(ROWS, 5), True)
    assert fresh.probe_up(Plan.for_batch(ROWS, 5), ROWS, guess=calibrated.largest) is None
    # Other row lengths are not guided: the estimate was for rows SEQ long.
    assert guide.largest(plan, 4, 10, length=SEQ * 2) is None
    # A good attempt's peak against the estimate of its plan: the factor of the largest
    # micro-batch measured is applied (allocated peaks: an estimate found high is trusted).
    guide.device = SimulatedDevice(SimulatedGPU())
    guide.observe(Plan.for_batch(ROWS, 5), 18 * MiB, SEQ)
    assert guide.measured == 1.2 and guide.calibration == 1.2
    guide.observe(Plan.for_batch(ROWS, 4), 7 * MiB, SEQ)  # smaller: not the one applied
    assert guide.measured == 1.2
    guide.observe(Plan.for_batch(ROWS, 6), 8 * MiB, SEQ)
    assert guide.measured == 0.5 and guide.calibration == 0.5
    guide.observe(Plan.for_batch(ROWS, 8), 9 * MiB, SEQ * 2)  # rows of another length: ignored
    assert guide.measured == 0.5
    # Reserved peaks depend on what the cache held before: a factor under 1 is not applied.
    assert Guide(None, "reserved", MiB, calibration=0.8).calibration == 1.0
    assert Guide(None, "reserved", MiB, calibration=1.25).calibration == 1.25
    assert Guide(None, "allocated", MiB, calibration=0.8).calibration == 0.8


def budget_for(micro):
    """The allocated peak the estimator predicts for `micro` rows: a budget where it is the largest
    micro-batch that fits (the estimate matches the simulated GPU to the byte)."""
    return autofit.estimate(bert(), batches(1)[0], Plan.for_batch(ROWS, micro), device_type="cpu").peak_bytes


@pytest.mark.slow
def test_a_cold_run_probes_straight_to_the_largest_fit_and_caches_its_calibration(monkeypatch):
    # The estimate is ~7% high on this tiny model (its allocated peak is the step's own: a factor
    # under 1 is trusted), so 13 rows fit where 12 are predicted to (14 do not: measured).
    budget = budget_for(12)
    guided = autofit.run(bert(), batches(), budget=budget, precision="fp32", progress=False)
    # Started from 8 (the capacity check's fastest fit: 16 does not), then the estimate's largest,
    # then the calibrated estimate's: no OOM.
    assert steps(guided) == [(0, 8, "ok"), (1, 12, "ok"), (2, 13, "ok")]
    [row] = PlanCache().entries()
    entry = row["entry"]
    last = guided.attempts[-1]  # the largest micro-batch measured (not the first step's: no state)
    factor = last.peak_bytes / autofit.estimate(bert(), batches(1)[0], last.plan, device_type="cpu").peak_bytes
    assert entry["calibration"] == factor and 0.9 < factor < 1
    assert entry["calibrated_peak"] == "allocated"
    # The same run without the guide bisects blindly: one OOM, and 12 rows at the second batch.
    PlanCache().clear()
    monkeypatch.setattr("autofit.recipes.starts.make_guide", lambda *a: None)
    blind = autofit.run(bert(), batches(), budget=budget, precision="fp32", progress=False)
    assert steps(blind) == [(0, 8, "ok"), (1, 12, "ok"), (2, 14, "oom"), (2, 12, "ok")]


@pytest.mark.slow
def test_the_cached_calibration_is_applied_by_the_next_estimate_of_the_same_model(caplog):
    budget = budget_for(12)
    model = bert()
    # An earlier run of this model on this device, another job (another budget), measured 1.5.
    earlier = Memo(model=model, batch=batches(1)[0], optimizer=torch.optim.AdamW(model.parameters()),
                   global_batch=ROWS, precision="fp32",
                   device=SimulatedDevice(SimulatedGPU(2 * budget)))
    earlier.remember(Plan.for_batch(ROWS, 16), SizeLog(), [], 0, calibration=1.5, calibrated="allocated",
                     steady=True)
    with caplog.at_level(logging.INFO, logger="autofit"):
        result = autofit.run(model, batches(4), budget=budget, precision="fp32", progress=False)
    # x1.5: 8 rows would take more than the budget, the start is 6 and no probe is predicted to
    # fit above it; the second step measures this run's own factor (the estimate is high, more so
    # at 6 rows than at 12), which replaces the cached one: the probe goes up to 12, whose factor
    # then says 13 fits, the largest fit.
    assert steps(result) == [(0, 6, "ok"), (1, 6, "ok"), (2, 12, "ok"), (3, 13, "ok")]
    assert "calibration 1.500" in result.attempts[0].reason
    # This run's own factor is cached too, and the newest is what the next run reads.
    last = result.attempts[-1]
    mine = last.peak_bytes / autofit.estimate(bert(), batches(1)[0], last.plan, device_type="cpu").peak_bytes
    assert sorted(r["entry"]["calibration"] for r in PlanCache().entries()) == [mine, 1.5]
    later = Memo(model=bert(), batch=batches(1)[0], optimizer=torch.optim.AdamW(model.parameters()),
                 global_batch=ROWS, precision="fp32", device=SimulatedDevice(SimulatedGPU(3 * budget)))
    assert later.calibration("allocated") == mine
    assert later.calibration("reserved") is None


def test_calibration_is_stored_per_model_and_device_and_never_erased():
    model, other = bert(), torch.nn.Linear(4, 4)
    batch = batches(1)[0]

    def memo(m, budget, device=None, rows=ROWS):
        return Memo(model=m, batch=batch, optimizer=torch.optim.AdamW(m.parameters()), global_batch=rows,
                    precision="fp32", device=device or SimulatedDevice(SimulatedGPU(budget)))

    memo(model, 10 * MiB).remember(Plan.for_batch(ROWS, 8), SizeLog(), [], 0, calibration=1.25,
                                   calibrated="reserved", steady=True)
    # Another job of the same model on the same device: another budget and global batch.
    again = memo(model, 20 * MiB, rows=8)
    assert again.calibration("reserved") == 1.25
    assert again.calibration("allocated") is None
    assert memo(other, 10 * MiB).calibration("reserved") is None

    card = SimulatedDevice(SimulatedGPU(10 * MiB))
    card.name = "NVIDIA H200"  # another device
    assert memo(model, 10 * MiB, device=card).calibration("reserved") is None
    # A run that measured nothing (started from the cache) keeps the factor it read.
    again.remember(Plan.for_batch(8, 8), SizeLog(), [], 0, calibration=None, calibrated="reserved", steady=True)
    assert sorted(r["entry"]["calibration"] for r in PlanCache().entries()) == [1.25, 1.25]


# -- point 4 where the budget caps reserved bytes: the cache's history -----------------------------

LM_ROWS, LM_SEQ = 32, 32


def gpt2(seed=0):
    """A tiny GPT-2 (default dropout 0.1) whose loss backward holds b x s x vocab fp32 tensors of
    megabytes: its blocks come from the large pool's 20 MiB segments, where layouts matter."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=2000, n_embd=64, n_layer=1, n_head=2, n_positions=LM_SEQ))


def lm_batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 2000, (LM_ROWS, LM_SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[::3, LM_SEQ // 2:] = 0  # padded rows, their labels ignored
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def lm_steps(first, then, budget=None):
    """The simulated GPU's (caps="reserved") reserved peak of a step of `then` rows after a first
    step of `first` rows, from a fresh cache; None when a step ran out of `budget`."""
    from autofit.engine.step import StepRunner
    from autofit.gpu.device import open_device
    model, data = gpt2(), lm_batches(2)
    with autofit.simulate_gpu(budget, caps="reserved") as gpu, open_device() as device:
        device.place_model(model)
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device)
        try:
            runner.run(data[0], Plan.for_batch(LM_ROWS, first, precision="fp32"))
            gpu.reset_peak_memory_stats()
            runner.run(data[1], Plan.for_batch(LM_ROWS, then, precision="fp32"))
            return gpu.max_memory_reserved()
        except torch.OutOfMemoryError:
            runner.abandon()
            return None
        finally:
            runner.close()


def test_the_estimate_replays_the_step_before_it_and_the_cap_of_the_allocator():
    estimator = Estimator(gpt2(), lm_batches(1)[0], device_type="cpu")

    def plan(m):
        return Plan.for_batch(LM_ROWS, m, precision="fp32")

    # After the step before it (the run's first, which makes the optimizer state), to the byte;
    # from a fresh cache with the state laid out first, 4 MiB low at 7 rows and 2 MiB high at 28.
    for first, then, measured, fresh in ((7, 7, 30, 26), (16, 28, 54, 56)):
        assert lm_steps(first, then) == measured * MiB
        assert estimator.measure(plan(then), after=plan(first)).reserved_bytes == measured * MiB
        assert estimator.measure(plan(then)).reserved_bytes == fresh * MiB
    # Under a 29 MiB cap the allocator releases its cached segments before it fails: 7 rows fit
    # (their unbounded peak is 30 MiB), 20 rows after 16 do not; the capped replay says the same.
    cap = 29 * MiB
    assert lm_steps(7, 7, cap) is not None and lm_steps(16, 20, cap) is None
    assert estimator.measure(plan(7), after=plan(7), limit=cap).reserved_bytes <= cap
    assert estimator.measure(plan(20), after=plan(16), limit=cap).reserved_bytes > cap


@pytest.mark.slow
def test_a_reserved_capped_run_starts_at_the_largest_size_its_own_first_step_leaves_room_for():
    budget = 33 * MiB
    # The largest micro-batch that fits, measured: a run's two steps of 27 rows fit, of 28-32 not.
    assert [m for m in range(27, LM_ROWS + 1) if lm_steps(m, m, budget) is not None] == [27]
    model, data = gpt2(), lm_batches()  # on the host, as a DataLoader gives them
    with autofit.simulate_gpu(budget, caps="reserved"):
        result = autofit.run(model, data, precision="fp32", progress=False)
    # The capacity check's fastest plan is 16 x 2; the capped replays of a run starting with it
    # say 27 rows fit (a fresh cache's unbounded estimate: 16), so the run starts there: no OOM,
    # the largest fit from the first global batch. (Before: 16, then 21 rows probed, no further.)
    assert steps(result) == [(0, 27, "ok"), (1, 27, "ok"), (2, 27, "ok")]
    assert "micro-batch 27, the largest predicted to fit a run starting with it" in result.attempts[0].reason


def test_where_the_budget_caps_allocated_bytes_the_start_and_probe_are_as_before():
    budget = autofit.estimate(gpt2(), lm_batches(1)[0], Plan.for_batch(LM_ROWS, 12, precision="fp32"),
                              device_type="cpu").peak_bytes
    model, data = gpt2(), lm_batches()
    result = autofit.run(model, data, budget=budget, precision="fp32", progress=False)
    # The cost model's even split first (11 x 3), the allocated estimate's largest at the second.
    assert steps(result) == [(0, 11, "ok"), (1, 12, "ok"), (2, 12, "ok")]
