"""Two gloo ranks training an FSDP2 model, a fault injected on one rank at every phase of its run.

The sibling of distributed_faults.py (DDP-style replicas) for sharded models, where FSDP runs its
collectives inside forward and backward and autofit holds an agreement before each one
(autofit.distributed.fsdp_guard). Rank 1 runs `autofit.run(..., shard=True)` on a tiny BERT under a
simulated GPU and gets, at one position per run:
- `alloc N`: its N-th allocation raises OOM (`gpu.fail_at(N)`), N sampled over the whole run:
  sharding, the first agreement, the capacity check, each unit's forward gather, the backward
  gathers and reduce-scatters, the end-of-backward callback, the optimizer step on shards, the end;
- `<where> k`: a ValueError at the k-th call of the loss function, of a block's forward pre-hook or
  backward pre-hook, of the optimizer's step or of the scheduler's step, or where FSDP allocates a
  collective's buffer (an all-gather's output: `gather`; a reduce-scatter's input and output:
  `reduce`), or where a gather's copy-out gives one parameter its unsharded storage (`unshard`),
  every k of a clean run (at most MOST_CALLS per place, evenly). The allocation counts at those
  calls mark the buffers' own allocations, so a fault there is among the `alloc` positions the
  test picks.
Rank 0 runs the same job with no fault. Each position must end on both ranks within seconds as
- `recovered`: both finished with the same attempts, an OOM among them (replayed);
- `unaffected`: both finished, no OOM (the fault hit nothing the run still needed);
- `announced`: rank 1 raised its own error, rank 0 `RankFailed` naming it.
`--faulty 0` injects on rank 0 instead (the rank that decides the start: capacity check, cache).
Anything else (another error, a slow end, a process killed by a signal) is FAILED. The process
group's timeout is 20 s, so a hang shows as a slow position.

    python benchmarks/fsdp_faults.py [--positions 60] [--most-calls 30] [--rich] [--replicas]

`--rich`: the job is a token model with BatchNorm (its statistics broadcast from rank 0), a padded
token loss through `loss_fn`, `max_grad_norm` and the fp16 grad scaler; a run that finishes with the
clean run's splits must then end bit-identical to it. `--replicas`: the same job unsharded (the
DDP twin of benchmarks/distributed_faults.py's job).
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
ERRORS = ("loss", "forward", "backward", "step", "scheduler", "gather", "reduce", "unshard")
MOST_CALLS = 30  # ValueError positions per place at most (evenly over its calls): `unshard` has hundreds


def _model():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     vocab_size=100, max_position_embeddings=64, num_labels=3)
    return BertForSequenceClassification(cfg)  # dropout on, buffers (position ids) present


class _Block(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


class _Rich(torch.nn.Module):
    """A token model with BatchNorm (batch-coupled: its statistics broadcast from rank 0) and
    repeated blocks in a ModuleList (what shard=True wraps), for the `--rich` job."""

    def __init__(self, vocab=100, hidden=32):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.bn = torch.nn.Embedding(vocab, hidden), torch.nn.BatchNorm1d(hidden)
        self.blocks = torch.nn.ModuleList([_Block(hidden) for _ in range(2)])
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids):
        x = self.bn(self.embed(input_ids).transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _rich_batches(n, rows=16, seq=12):
    """Token batches whose labels are padded with -100 unevenly (row r keeps seq - r % seq tokens)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 100, (rows, seq), generator=g)
        labels = ids.clone()
        for r in range(rows):
            labels[r, seq - r % seq:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _batches(n, rows=16, seq=12):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 100, (rows, seq), generator=g),
             "labels": torch.randint(0, 3, (rows,), generator=g)} for _ in range(n)]


class _Fault:
    """A ValueError at the k-th call of one place (`where`); counts the calls of every place."""

    def __init__(self, where=None, k=None):
        self.where, self.k = where, k
        self.calls = dict.fromkeys(ERRORS, 0)
        self.marks = {w: [] for w in ERRORS}  # the simulated GPU's allocation count at each call
        self.gpu = None

    def __call__(self, where):
        self.calls[where] += 1
        if self.gpu is not None:
            self.marks[where].append(self.gpu.allocation_count)
        if where == self.where and self.calls[where] == self.k:
            raise ValueError(f"injected at call {self.k} of {where}")


def job(fault: _Fault, fail_at=None, *, budget="64MiB", batches=3, rich=False, shard=True):
    """One run of the sharded job with `fault`'s places armed and, when given, allocation `fail_at`
    failing. `rich`: the token model with BatchNorm, a padded token loss through loss_fn, gradient
    clipping and the fp16 grad scaler; `shard=False`: replicas (the DDP twin). Returns (RunResult,
    allocations made)."""
    import autofit
    data, model = (_rich_batches(batches), _Rich()) if rich else (_batches(batches), _model())
    block = model.blocks[1] if rich else model.bert.encoder.layer[1]
    block.register_forward_pre_hook(lambda m, a: fault("forward"))
    block.register_full_backward_pre_hook(lambda m, g: fault("backward"))

    def loss_fn(model, batch):
        fault("loss")
        if rich:  # the mean over the batch's label tokens
            logits = model(batch["input_ids"])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                     ignore_index=-100)
        return model(**batch).loss

    class optimizer(torch.optim.AdamW):
        def step(self, closure=None):
            fault("step")
            return super().step(closure)

    def scheduler(opt):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        step = sched.step

        def checked(*a, **k):  # installed after the constructor's own first step
            fault("scheduler")
            return step(*a, **k)
        sched.step = checked
        return sched
    with autofit.simulate_gpu(budget) as gpu, _marking_collectives(fault):
        fault.gpu = gpu
        if fail_at is not None:
            gpu.fail_at(fail_at)
        extra = {"max_grad_norm": 0.5, "precision": "fp16"} if rich else {"precision": "fp32"}
        result = autofit.run(model, data, loss_fn=loss_fn, optimizer=optimizer, scheduler=scheduler,
                             progress=False, cache=False, shard=shard, **extra)
        count = gpu.allocation_count
    result.digest = _digest(model)  # outside the fault: gathering the shards communicates
    return result, count


def _digest(model) -> str:
    """A hash of the whole model's parameters and buffers (the same on every rank)."""
    import hashlib
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        h.update(name.encode())
        h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class _marking_collectives:
    """FSDP's default comms call `fault` where they allocate a collective's buffer, and each
    parameter's copy-out where it allocates its unsharded storage (instrumentation: the job itself
    keeps FSDP's comms, which autofit wraps)."""

    def __init__(self, fault):
        self.fault = fault

    def __enter__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as c
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        self.saved = []
        unshard = FSDPParam.alloc_all_gather_outputs
        self.saved.append((FSDPParam, "alloc_all_gather_outputs", unshard))

        def alloc_all_gather_outputs(param, _original=unshard):
            self.fault("unshard")
            return _original(param)
        FSDPParam.alloc_all_gather_outputs = alloc_all_gather_outputs
        for cls, where in ((c.DefaultAllGather, "gather"), (c.DefaultReduceScatter, "reduce")):
            original = cls.allocate
            self.saved.append((cls, "allocate", original))

            def allocate(comm, size, *, dtype, device, _original=original, _where=where):
                self.fault(_where)
                return _original(comm, size, dtype=dtype, device=device)
            cls.allocate = allocate
        return self

    def __exit__(self, *exc):
        for cls, name, original in self.saved:
            setattr(cls, name, original)
        return False


def _attempt(position, injected: bool, **options) -> dict:
    kind, n = position
    start = time.monotonic()
    fault = _Fault(kind, n) if injected and kind != "alloc" else _Fault()
    try:
        result, _ = job(fault, n if injected and kind == "alloc" else None, **options)
        row = {"outcome": "ok", "attempts": [(a.step, a.plan.micro_batch_size, a.outcome) for a in result.attempts],
               "splits": [h["plan"].micro_batch_size for h in result.history], "digest": result.digest}
    except Exception as error:  # noqa: BLE001 - which error each rank got is the measurement
        row = {"outcome": type(error).__name__, "message": str(error)[:200]}
    row["seconds"] = time.monotonic() - start
    return row


def _worker(rank, init_file, out_dir, positions, faulty=1, rich=False, shard=True):
    torch.set_num_threads(1)
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("autofit").setLevel(logging.ERROR)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=20))
    start = time.monotonic()
    fault = _Fault()
    clean, count = job(fault, rich=rich, shard=shard)
    out = {"clean_seconds": time.monotonic() - start, "allocations": count, "calls": fault.calls,
           "clean": [(a.step, a.plan.micro_batch_size, a.outcome) for a in clean.attempts],
           "clean_splits": [h["plan"].micro_batch_size for h in clean.history], "clean_digest": clean.digest,
           "rows": []}
    for position in positions:
        row = {"at": position, **_attempt(position, injected=rank == faulty, rich=rich, shard=shard)}
        out["rows"].append(row)
        print(f"rank {rank} {position}: {row['outcome']} {row['seconds']:.1f} s {row.get('message', '')[:90]}",
              file=sys.stderr, flush=True)
        if row["seconds"] > out["clean_seconds"] + LIMIT_S:
            break  # the group is probably broken; the parent reports it
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def spawn(positions, limit_s=3600, faulty=1, rich=False, shard=True):
    out = tempfile.mkdtemp(prefix="autofit-fsdp-faults-")
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, os.path.join(out, "init"), out, positions, faulty, rich, shard))
             for r in range(WORLD)]
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


def classify(a: dict, b: dict, allowed: float, clean: dict | None = None) -> str:
    """recovered / unaffected / announced / FAILED for the healthy rank's row `a` and the faulty
    rank's row `b`; with the `clean` run (a worker's output), a finished run whose final splits are
    the clean run's must end bit-identical to it (the same parameters and buffers)."""
    slow = max(a["seconds"], b["seconds"]) > allowed
    injected = "OutOfMemoryError" if b["at"][0] == "alloc" else "ValueError"
    if slow:
        return "FAILED"
    if a["outcome"] == b["outcome"] == "ok" and a["attempts"] == b["attempts"]:
        if a.get("digest") != b.get("digest"):
            return "FAILED"  # the ranks' models differ
        if clean is not None and b["splits"] == clean["clean_splits"] and b["digest"] != clean["clean_digest"]:
            return "FAILED"  # the same splits as the clean run, another result
        return "recovered" if any(o == "oom" for *_, o in b["attempts"]) else "unaffected"
    if b["outcome"] == injected and a["outcome"] == "RankFailed":
        return "announced"
    return "FAILED"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=60, help="allocations sampled (evenly)")
    parser.add_argument("--faulty", type=int, default=1, choices=(0, 1), help="the rank that gets the faults")
    parser.add_argument("--most-calls", type=int, default=MOST_CALLS,
                        help="ValueError positions per place at most (evenly over its calls)")
    parser.add_argument("--rich", action="store_true", help="the token model with BatchNorm, a padded "
                        "token loss through loss_fn, clipping and the fp16 grad scaler")
    parser.add_argument("--replicas", action="store_true", help="the same job unsharded (DDP-style replicas)")
    args = parser.parse_args(argv)

    shard = not args.replicas
    clean = spawn([], rich=args.rich, shard=shard)[args.faulty]  # how many allocations and calls a clean run makes on that rank
    total, calls = clean["allocations"], clean["calls"]
    step = max(total // args.positions, 1)
    positions = [("alloc", n) for n in range(0, total + step, step)]
    for where in ERRORS:
        ks = list(range(1, calls[where] + 2))
        positions += [(where, k) for k in ks[::max(len(ks) // args.most_calls, 1)]]
    r0, r1 = spawn(positions, faulty=args.faulty, rich=args.rich, shard=shard)
    if args.faulty == 0:
        r0, r1 = r1, r0  # r0: the healthy rank, r1: the faulty one
    allowed = max(r0["clean_seconds"], r1["clean_seconds"]) + LIMIT_S
    verdicts, failures, identical = {}, [], 0
    for a, b in zip(r0["rows"], r1["rows"]):
        kind = classify(a, b, allowed, r1)
        phase = "allocation" if b["at"][0] == "alloc" else f"ValueError in {b['at'][0]}"
        verdicts.setdefault(phase, {}).setdefault(kind, 0)
        verdicts[phase][kind] += 1
        if kind == "FAILED":
            failures.append((b["at"], a, b))
        elif kind == "recovered" and b["splits"] == r1["clean_splits"]:
            identical += 1  # classify checked: bit-identical to the clean run
    seconds = max(max(r["seconds"] for r in r0["rows"]), max(r["seconds"] for r in r1["rows"]))
    print(table(["allocations in a clean run", f"calls ({', '.join(ERRORS)})",
                 "clean run (s)", "positions tried", "slowest end (s)",
                 "recovered with the clean splits (all bit-identical)"],
                [[r1["allocations"], ", ".join(str(r1["calls"][w]) for w in ERRORS),
                  f"{r1['clean_seconds']:.2f}", len(r1["rows"]), f"{seconds:.2f}", identical]]))
    kinds = ["recovered", "unaffected", "announced", "FAILED"]
    print(table([f"fault on rank {args.faulty}"] + kinds, [[phase] + [v.get(k, 0) for k in kinds]
                                              for phase, v in verdicts.items()]))
    for at, a, b in failures[:12]:
        print(f"FAILED at {at}: healthy rank {a['outcome']} {a.get('message', '')!r} {a.get('attempts')} "
              f"{a['seconds']:.1f} s; faulty rank {b['outcome']} {b.get('message', '')!r} {b.get('attempts')} "
              f"{b['seconds']:.1f} s")
    return 1 if failures or len(r1["rows"]) < len(r0["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
