"""One rank's peak under FSDP2 (autofit.estimator.sharded), against the simulated GPU's measurement
on two gloo ranks; and the counter's view of what FSDP2 allocates (DTensor shards, storages
resized outside the dispatcher)."""

from __future__ import annotations

import pytest
import torch

import autofit
from autofit.estimator import sharded
from autofit.estimator.sharded import Sharding, estimate_sharded, sharding_of
from autofit.plans.plan import Plan
from versions import needs_fsdp2_runs

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


# -- what the simulated GPU counts ------------------------------------------------------------------
def test_a_dtensor_counts_its_local_shard_not_its_global_shape():
    from torch.distributed.tensor import Shard, distribute_tensor
    world, mesh = sharded._fake_world(2)
    with sharded._entered(world), autofit.simulate_gpu() as gpu:
        full = torch.zeros(1000, 10)                      # 40000 B
        d = distribute_tensor(full, mesh, [Shard(0)])     # 500 rows here: 20000 B -> 20480
        assert gpu.memory_allocated() == 40448 + 20480
        state = torch.zeros_like(d)                        # a DTensor made by one op: its shard
        assert gpu.memory_allocated() == 40448 + 2 * 20480
        del state
        assert gpu.memory_allocated() == 40448 + 20480


def test_storage_bytes_reads_a_generator_once_and_counts_it():
    from autofit.gpu.memory import storage_bytes
    assert storage_bytes(t for t in [torch.zeros(10), torch.zeros(200)]) == 512 + 1024


def test_a_storage_resized_by_hand_is_freed_and_counted_again():
    # FSDP2 frees an all-gathered parameter with storage.resize_(0) and refills it the same way
    with autofit.simulate_gpu() as gpu:
        t = torch.empty(1000)
        assert gpu.memory_allocated() == 4096
        t.untyped_storage().resize_(0)
        assert gpu.memory_allocated() == 0
        t.untyped_storage().resize_(8000)
        assert gpu.memory_allocated() == 8192
        del t
        assert gpu.memory_allocated() == 0
    s = torch.empty(10).untyped_storage()
    s.resize_(0)  # outside a simulation nothing is told (and nothing is patched any more)
    assert "resize_" not in vars(torch.storage.UntypedStorage)


def test_a_resize_past_the_budget_is_an_oom():
    with autofit.simulate_gpu(8192) as gpu:
        t = torch.empty(1024)
        t.untyped_storage().resize_(0)
        with pytest.raises(torch.OutOfMemoryError):
            t.untyped_storage().resize_(16384)
        assert gpu.memory_allocated() == 0


# -- settings -------------------------------------------------------------------------------------
def test_sharding_is_read_from_a_sharded_model_and_the_callers_world_is_untouched():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from models import tiny_bert
    world, mesh = sharded._fake_world(4)
    model = tiny_bert()
    assert sharding_of(model) is None
    with sharded._entered(world):
        for layer in model.bert.encoder.layer:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False,
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(model, mesh=mesh)
    assert sharding_of(model) == Sharding(4, reshard_after_forward=False, param_dtype="bf16",
                                          units=("bert.encoder.layer.0", "bert.encoder.layer.1"))
    assert not torch.distributed.is_initialized()  # the fake world never became this process's


@needs_fsdp2_runs
def test_estimate_and_rank_price_a_sharded_model_per_rank(bert_batch):
    from torch.distributed.fsdp import fully_shard
    from models import tiny_bert
    from autofit.estimator.capacity import Space, make_estimator, rank
    world, mesh = sharded._fake_world(4)
    model = tiny_bert()
    with sharded._entered(world):
        for layer in model.bert.encoder.layer:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh)
    plan = Plan(4, accumulation_steps=2)
    unsharded = tiny_bert()
    expected = estimate_sharded(unsharded, Sharding.read(unsharded, 4, reshard_after_forward=False,
                                                         units=["bert.encoder.layer.0", "bert.encoder.layer.1"]),
                                plan, bert_batch, device_type="cpu")
    # during a run, autofit's agreements hook the units: the estimate must never call them
    from autofit.distributed.fsdp import Sharded
    checks = []
    switches = Sharded(model)
    switches.guard(lambda: checks.append(1))
    switches.arm(True)
    assert autofit.estimate(model, bert_batch, plan, device_type="cpu").peak_bytes == expected.peak_bytes
    assert checks == []
    switches.close()
    candidates = rank(make_estimator(model, bert_batch, device_type="cpu"), bert_batch, "1GiB",
                      space=Space("fp32"))
    # the whole batch fits; no offload offered; the user's reshard_after_forward=False, explicit
    assert [c.plan for c in candidates] == [Plan(8, reshard_after_forward=False)]
    assert candidates[0].estimate.peak_bytes == estimate_sharded(
        model, 4, Plan(8), bert_batch, device_type="cpu").peak_bytes
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0}, "world_size must be a positive int but got 0"),
    ({"world_size": 2, "param_dtype": "int8"}, "param_dtype must be one of fp32, bf16, fp16 or None but got 'int8'"),
    ({"world_size": 2, "reshard_after_forward": "yes"}, "reshard_after_forward must be True or False"),
])
def test_bad_sharding_says_the_value(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Sharding(**kwargs)


@needs_fsdp2_runs
def test_unknown_units_and_offload_plans_are_refused(tiny_bert, bert_batch):
    with pytest.raises(ValueError, match=r"units \['bert.nope'\] are not modules of BertFor"):
        estimate_sharded(tiny_bert, Sharding.read(tiny_bert, 2, units=["bert.nope"]), Plan(4), bert_batch)
    with pytest.raises(ValueError, match="offload_optimizer is not a plan for a sharded model"):
        estimate_sharded(tiny_bert, 2, Plan(4, offload_optimizer=True), bert_batch)


@needs_fsdp2_runs
def test_more_ranks_hold_less_and_the_model_is_left_as_it_was(tiny_bert, bert_batch):
    before = {k: v.clone() for k, v in tiny_bert.state_dict().items()}
    plan = Plan(len(bert_batch["input_ids"]))
    two = estimate_sharded(tiny_bert, 2, plan, bert_batch, device_type="cpu")
    four = estimate_sharded(tiny_bert, 4, plan, bert_batch, device_type="cpu")
    whole = autofit.estimate(tiny_bert, bert_batch, plan, device_type="cpu")
    assert four.resident["optimizer"] < two.resident["optimizer"] < whole.resident["optimizer"]
    assert four.peak_bytes < two.peak_bytes < whole.peak_bytes
    assert all(torch.equal(before[k], v) for k, v in tiny_bert.state_dict().items())
    assert not torch.distributed.is_initialized()


@needs_fsdp2_runs
def test_gathered_parameters_are_params_in_the_breakdown(tiny_bert, bert_batch):
    plan = Plan(len(bert_batch["input_ids"]))
    resharded = estimate_sharded(tiny_bert, 2, plan, bert_batch, device_type="cpu")
    kept = estimate_sharded(tiny_bert, Sharding.read(tiny_bert, 2, reshard_after_forward=False), plan,
                            bert_batch, device_type="cpu")
    for est in (resharded, kept):
        assert sum(est.breakdown.values()) == est.peak_bytes
    # at the peak (forward's end) the gathered units are held beside the shards: more of them kept
    assert kept.breakdown["params"] > resharded.breakdown["params"] > resharded.resident["params"]


def test_a_torch_whose_fsdp2_lacks_what_autofit_calls_is_refused(tiny_bert, bert_batch, monkeypatch):
    """Before torch 2.13 FSDP2 has no `reset_iter_state` (what a sharded attempt is dropped with):
    the sharded estimate is refused before its walk, naming it and the torch to install, and leaves
    no process group behind."""
    from torch.distributed.fsdp import FSDPModule
    monkeypatch.delattr(FSDPModule, "reset_iter_state", raising=False)
    with pytest.raises(RuntimeError, match=rf"this torch {torch.__version__.replace('+', '.')} lacks "
                                           rf"unit\.reset_iter_state(, [\w.]+)*: install torch 2\.13"):
        estimate_sharded(tiny_bert, 2, Plan(4), bert_batch, device_type="cpu")
    assert not torch.distributed.is_initialized()


# -- against the measurement on two gloo ranks -----------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from fsdp_ranks import CONFIGS, run_ranks
    tests = [c for c in CONFIGS if c[1] == "bert"]  # GPT-2 too in benchmarks/fsdp_estimate.py
    return run_ranks(str(tmp_path_factory.mktemp("fsdp")), tests)


TOLERANCE = {  # how far above the measured peak the prediction may be
    "bert raf": 0.0,                 # predicted from the unsharded model, settings given
    "bert no-raf": 0.0,              # predicted from the sharded model, settings read from it
    "bert bf16-params": 0.0,
    "bert micro 4x2 sync-off": 0.0,
    # a reduce-scatter per micro-batch: a micro-batch after the first is priced on zero sharded
    # gradients made beforehand, where FSDP2's first reduce-scatter leaves a view of its padded output
    "bert micro 4x2 ckpt reduce-each": 0.01,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TOLERANCE))
def test_the_peak_is_predicted_where_collectives_finish_at_once(name):
    # Real tensors, this process as rank 0 of 2 on the fake backend: FSDP2 runs as on gloo, but each
    # collective is done when issued, so every buffer is freed where FSDP2's code drops it.
    from fsdp_ranks import CONFIGS, measure_and_predict
    world, mesh = sharded._fake_world(2)
    config = next(c for c in CONFIGS if c[0] == name)
    with sharded._entered(world):
        measured, est = measure_and_predict(config, mesh, 0)
    assert 0 <= est.peak_bytes - measured <= TOLERANCE[name] * measured, (measured, est.peak_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TOLERANCE))
def test_each_gloo_ranks_peak_is_predicted_within_5_percent(ranks, name):
    # gloo finishes a collective in its own thread, and what the collective held is freed there: at
    # times later than FSDP2's code drops it (seen: 3-4% more on one rank, in about one run of ten)
    errors = [(r[name]["predicted"] - r[name]["measured"]) / r[name]["measured"] for r in ranks]
    assert all(-0.05 <= e <= TOLERANCE[name] for e in errors), (name, errors)
    assert ranks[0][name]["predicted"] == ranks[1][name]["predicted"]  # padded shards: alike


@pytest.mark.slow
def test_the_settings_change_the_peak_as_fsdp2_does(ranks):
    peak = {name: ranks[0][name]["measured"] for name in ranks[0]}
    assert peak["bert no-raf"] > peak["bert raf"] > peak["bert bf16-params"]
    assert peak["bert micro 4x2 ckpt reduce-each"] < peak["bert raf"]
