"""Two gloo ranks, an injected out-of-memory error at sampled allocations of one rank's run.

Rank 1 runs `autofit.run` under a simulated GPU whose N-th allocation fails (`gpu.fail_at(N)`), for
N sampled across every phase of a run (placing the model, the first agreement, the capacity check,
forward/backward, the optimizer step, evaluation, the end); rank 0 runs the same job with no fault.
Each position must end on both ranks within seconds with one of:
- `recovered`: both ranks finished, with the same attempts (the OOM was a step's, replayed);
- `announced`: rank 1 raised its out-of-memory error, rank 0 `RankFailed` naming it.
Anything else (another error, a rank that took longer than the limit, a process that died by a
signal) is a failure; the process group's timeout is 20 s, so a hang shows as a slow position.

The second table is the memory autofit no longer spends: the DDP wrapper it used to build keeps
one bucketed copy of the gradients (measured on the simulated GPU by building one).

    python benchmarks/distributed_faults.py [--positions 120]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import common  # noqa: F401  (puts the checkout on sys.path)
import torch

from autofit.diagnosis.report import table

WORLD = 2
LIMIT_S = 10.0  # how much longer than a clean run a position may take to end, on both ranks


def _model():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     vocab_size=100, max_position_embeddings=64, num_labels=3)
    return BertForSequenceClassification(cfg)  # dropout on, buffers (position ids) present


def _batches(n, rows=16, seq=12):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 100, (rows, seq), generator=g),
             "labels": torch.randint(0, 3, (rows,), generator=g)} for _ in range(n)]


def _job(fail_at=None):
    import autofit
    data, model = _batches(3), _model()  # made outside the simulated GPU: faults are run's only
    with autofit.simulate_gpu("64MiB") as gpu:
        if fail_at is not None:
            gpu.fail_at(fail_at)
        result = autofit.run(model, data, eval_data=data[:1], precision="fp32", progress=False,
                             cache=False, scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
        return result, gpu.allocation_count


def _ddp_buckets() -> int:
    import autofit
    model = _model()
    with autofit.simulate_gpu() as gpu:
        from autofit.gpu.device import SimulatedDevice
        SimulatedDevice(gpu).place_model(model)
        before = gpu.memory_allocated()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        after = gpu.memory_allocated()
        del ddp
    return after - before


def _worker(rank, init_file, out_dir, positions):
    torch.set_num_threads(1)
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("autofit").setLevel(logging.ERROR)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=20))
    out = {"buckets": _ddp_buckets()}  # every rank builds it: its constructor communicates
    start = time.monotonic()
    clean, count = _job()
    out["clean_seconds"] = time.monotonic() - start
    out["allocations"] = count
    out["clean"] = [a.outcome for a in clean.attempts]
    rows = []
    for n in positions(count) if callable(positions) else positions:
        start = time.monotonic()
        try:
            result, _ = _job(n if rank == 1 else None)
            row = {"at": n, "outcome": "ok", "attempts": [(a.step, a.plan.micro_batch_size, a.outcome)
                                                          for a in result.attempts]}
        except Exception as error:  # noqa: BLE001 - which error each rank got is the measurement
            row = {"at": n, "outcome": type(error).__name__, "message": str(error)[:200]}
        row["seconds"] = time.monotonic() - start
        rows.append(row)
        if row["seconds"] > out["clean_seconds"] + 2 * LIMIT_S:
            break  # the group is probably broken; the parent reports it
    out["rows"] = rows
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _allocations() -> int:
    """How many allocations a clean run makes on rank 1 (one spawn of two ranks, no fault)."""
    return _spawn([])[1]["allocations"]


def _spawn(positions, limit_s=900):
    out = tempfile.mkdtemp(prefix="autofit-faults-")
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, os.path.join(out, "init"), out, positions)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 1))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    if codes != [0, 0]:
        sys.exit(f"ranks ended with exit codes {codes} (negative: killed by that signal)")
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(WORLD)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=120, help="allocations sampled (evenly)")
    args = parser.parse_args(argv)
    total = _allocations()
    step = max(total // args.positions, 1)
    positions = list(range(0, total + step, step))
    r0, r1 = _spawn(positions)
    verdicts, failures = {}, []
    allowed = max(r0["clean_seconds"], r1["clean_seconds"]) + LIMIT_S
    for a, b in zip(r0["rows"], r1["rows"]):
        slow = max(a["seconds"], b["seconds"]) > allowed
        if a["outcome"] == b["outcome"] == "ok" and a["attempts"] == b["attempts"] and not slow:
            kind = "recovered" if any(o == "oom" for *_, o in b["attempts"]) else "unaffected"
        elif b["outcome"] == "OutOfMemoryError" and a["outcome"] == "RankFailed" and not slow:
            kind = "announced"
        else:
            kind = "FAILED"
            failures.append((b["at"], a, b))
        verdicts[kind] = verdicts.get(kind, 0) + 1
    seconds = max(max(r["seconds"] for r in r0["rows"]), max(r["seconds"] for r in r1["rows"]))
    print(table(["allocations in a clean run", "clean run (s)", "positions tried", "every", "slowest end (s)"],
                [[total, f"{r1['clean_seconds']:.2f}", len(r1["rows"]), step, f"{seconds:.2f}"]]))
    print(table(["outcome", "positions"], sorted(verdicts.items())))
    for at, a, b in failures[:10]:
        print(f"FAILED at {at}: rank 0 {a['outcome']} {a.get('message', '')!r} {a.get('attempts')} "
              f"{a['seconds']:.1f} s; rank 1 {b['outcome']} {b.get('message', '')!r} {b.get('attempts')} "
              f"{b['seconds']:.1f} s")
    print(table(["memory DDP's wrapper would add (gradient buckets)", "bytes"], [["BERT 2x32", r0["buckets"]]]))
    return 1 if failures or len(r1["rows"]) < len(positions) else 0


if __name__ == "__main__":
    sys.exit(main())
