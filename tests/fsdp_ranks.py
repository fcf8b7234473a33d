"""Two gloo ranks train a model sharded with FSDP2 under the simulated GPU and predict their own peak
(autofit.estimator.sharded), per configuration: what test_sharded_estimate.py asserts and
benchmarks/fsdp_estimate.py prints. Spawned processes: import-safe, no autofit state shared."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch

WORLD = 2
TIMEOUT = 300  # seconds for the whole spawn: fail rather than hang

# (name, model, reshard_after_forward, param_dtype, plan fields, shard before estimating,
#  a reduce-scatter per micro-batch rather than gradient sync off until the last)
CONFIGS = [
    ("bert raf", "bert", True, None, {"micro_batch_size": 8}, False, False),
    ("bert no-raf", "bert", False, None, {"micro_batch_size": 8}, True, False),
    ("bert bf16-params", "bert", True, "bf16", {"micro_batch_size": 8}, True, False),
    ("bert micro 4x2 sync-off", "bert", True, None,
     {"micro_batch_size": 4, "accumulation_steps": 2}, True, False),
    ("bert micro 4x2 ckpt reduce-each", "bert", True, None,
     {"micro_batch_size": 4, "accumulation_steps": 2, "checkpointing": True}, False, True),
    ("gpt2 raf", "gpt2", True, None, {"micro_batch_size": 8}, True, False),
    ("gpt2 no-raf bf16-params", "gpt2", False, "bf16", {"micro_batch_size": 8}, False, False),
    ("gpt2 micro 2x4 sync-off", "gpt2", True, None, {"micro_batch_size": 2, "accumulation_steps": 4},
     False, False),
]


def _model(kind: str):
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    if kind == "bert":  # dropout on: the step is a training step
        return BertForSequenceClassification(BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            vocab_size=100, max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1))
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100, n_positions=64))


def _batch(kind: str, rank: int, rows: int = 8, seq: int = 16):
    """This rank's rows of a global batch; GPT-2's labels padded with -100 unevenly."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 100, (rows, seq), generator=g)
    if kind == "bert":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (rows,), generator=g)}
    labels = ids.clone()
    for r in range(rows):
        labels[r, seq - r:] = -100
    return {"input_ids": ids, "labels": labels}


def _shard(model, mesh, raf, param_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from autofit.distributed.fsdp import shard
    kw = {"mesh": mesh, "reshard_after_forward": raf}
    if param_dtype:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard(model, **kw)


def measure_and_predict(config, mesh, rank: int):
    """(the simulated GPU's peak of the second of two steps of this rank, the estimate of it)."""
    import autofit
    from autofit.distributed.fsdp import Sharded
    from autofit.engine.step import StepRunner
    from autofit.estimator.sharded import Sharding, estimate_sharded
    from autofit.gpu.device import SimulatedDevice
    from autofit.plans.plan import Plan
    name, kind, raf, param_dtype, fields, shard_first, reduce_each = config
    plan = Plan(**fields)
    batch = _batch(kind, rank)
    with autofit.simulate_gpu() as gpu:
        model = _model(kind)
        _shard(model, mesh, raf, param_dtype)
        device = SimulatedDevice(gpu)
        device.place_model(model)
        # as autofit trains a sharded model (sum reduction, sync on the last micro-batch only)
        switches = Sharded(model)
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device,
                            sync=None if reduce_each else switches.sync)
        runner.run(batch, plan)
        runner.run(batch, plan)  # the second step: optimizer state exists
        measured = runner.attempt_peak()
        runner.close()
        del runner, model
    # Predicted in this process, beside its own process group: from the sharded model (its
    # settings read from it) or from an unsharded one with the settings given.
    model = _model(kind)
    if shard_first:
        _shard(model, mesh, raf, param_dtype)
        est = estimate_sharded(model, Sharding.read(model, WORLD, reduce_each_micro_batch=reduce_each), plan,
                               batch, device_type="cpu")
    else:
        sharding = Sharding.read(model, WORLD, reshard_after_forward=raf, param_dtype=param_dtype,
                                 reduce_each_micro_batch=reduce_each)
        est = estimate_sharded(model, sharding, plan, batch, device_type="cpu")
    return measured, est


def _worker(rank, init_file, out_dir, configs):
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for config in configs:
        name = config[0]
        measured, est = measure_and_predict(config, mesh, rank)
        out[name] = {"measured": measured, "predicted": est.peak_bytes, "breakdown": est.breakdown,
                     "resident": est.resident}
        dist.barrier()  # the group still works after an estimate swapped the world in and out
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def run_ranks(out_dir: str, configs=CONFIGS) -> list[dict]:
    """Spawn the ranks; what each one measured and predicted, per configuration name."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from spawn import spawn_ranks
    init = os.path.join(out_dir, "init")
    codes, killed = spawn_ranks(_worker, lambda r: (r, init, out_dir, configs), WORLD, TIMEOUT)
    if killed or any(codes):
        raise RuntimeError(f"ranks ended with exit codes {codes}{' (killed after a timeout)' if killed else ''}")
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(WORLD)]
