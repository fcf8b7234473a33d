"""Faults on one rank of a 2-rank FSDP2 job (shard=True, capacity check on), at each phase: every
position ends both ranks within seconds, `recovered` (both ranks the same attempts) or `announced`
(the original error on rank 1, RankFailed on rank 0). One spawned pair walks all positions, the job
re-created per position (benchmarks/fsdp_faults.py is the job and samples many more positions)."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import pytest
import torch

from spawn import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

WORLD = 2
PROCESS_TIMEOUT = 600  # a hang guard: the walk took 294 s on 2 loaded shared cores
SLOWEST_END = 15.0  # seconds per position; the process group's timeout is 20 s, so a hang shows
# Faults in a training attempt (the loss's forward, the block's forward, backward, the optimizer
# step) are replayed; before the first agreement (sharding) and non-OOM errors are announced.
# An OOM at the allocation of a collective's own buffer (FSDP's all-gather output, reduce-scatter
# input and output) is replayed too: the agreement sits after it, inside the collective. So is one
# in a gather's copy-out (`unshard`: a parameter's unsharded storage, those before it in its group
# already allocated, which the recovery frees although FSDP still thinks the group sharded).
ALLOCS = ("loss", "forward", "backward", "step", "gather", "reduce", "unshard")
ERRORS = ("loss", "forward", "backward", "step", "scheduler")
EXPECTED = [["alloc: first (sharding)", "announced"], ["alloc: the first batch to the device", "recovered"]] + \
    [[f"alloc: {where} {which}", "recovered"] for where in ALLOCS for which in ("first", "last")] + \
    [["alloc: last of the run", "recovered"]] + \
    [[f"{where} {which}", "announced"] for where in ERRORS for which in ("first", "last")] + \
    [["gather first", "announced"], ["reduce last", "announced"]]


def _positions(clean: dict) -> list:
    """Deterministic positions from a clean run's marks (allocation counts at each call), each
    [name, position]: the first allocation of the run (sharding), the first micro-batch's move to
    the device (before the first forward, so before FSDP's lazy init), the allocation right after each
    place's first and last call (the forward gathers after the loss is called and the block's
    forward starts, the backward gathers and reduce-scatters, the optimizer step on shards) and
    FSDP's own buffers for a collective (the first and last all-gather output, reduce-scatter
    input/output), the last allocation of the run; a ValueError at the first and last call of
    every place, and where FSDP allocates the first gather's and the last reduce-scatter's buffer."""
    marks, total = clean["marks"], clean["allocations"]
    # The allocation before the first loss call moves the first micro-batch to the device: the
    # faulty rank fails before FSDP's lazy init, which the other rank then ran in the failed attempt.
    out = [["alloc: first (sharding)", ["alloc", 0]],
           ["alloc: the first batch to the device", ["alloc", marks["loss"][0] - 1]]]
    for where in ALLOCS:
        out += [[f"alloc: {where} first", ["alloc", marks[where][0]]],
                [f"alloc: {where} last", ["alloc", marks[where][-1]]]]
    out.append(["alloc: last of the run", ["alloc", total - 1]])
    for where in ERRORS:
        out += [[f"{where} first", [where, 1]], [f"{where} last", [where, clean["calls"][where]]]]
    return out + [["gather first", ["gather", 1]], ["reduce last", ["reduce", clean["calls"]["reduce"]]]]


def _worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("autofit").setLevel(logging.ERROR)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=20))
    import fsdp_faults as F
    fault = F._Fault()
    _, count = F.job(fault, batches=2)
    clean = {"allocations": count, "calls": fault.calls, "marks": fault.marks}
    # Rank 1's marks decide the positions; both ranks walk the same list.
    shared = [None, None]
    dist.all_gather_object(shared, clean)
    rows = []
    for name, position in _positions(shared[1]):
        row = F._attempt(tuple(position), injected=rank == 1, batches=2)
        rows.append({"name": name, "at": position, **row})
        if row["seconds"] > 2 * SLOWEST_END:
            break  # the group is probably broken
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"clean": shared[1], "rows": rows}, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_faults")
    codes, killed = spawn_ranks(_worker, lambda r: (r, str(out / "init"), str(out)), WORLD, PROCESS_TIMEOUT)
    assert not killed, f"ranks {killed} still running after {PROCESS_TIMEOUT} s"
    assert codes == [0] * WORLD, f"exit codes {codes}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_every_position_recovers_or_is_announced_promptly(walked):
    import fsdp_faults as F
    r0, r1 = walked
    assert len(r0["rows"]) == len(r1["rows"]) == len(_positions(r1["clean"]))
    kinds = [[b["name"], F.classify(a, b, SLOWEST_END)] for a, b in zip(r0["rows"], r1["rows"])]
    assert kinds == EXPECTED, [(a, b) for a, b in zip(r0["rows"], r1["rows"]) if F.classify(a, b, SLOWEST_END) == "FAILED"]
    for a, b in zip(r0["rows"], r1["rows"]):
        if b["at"][0] != "alloc":  # the original error on rank 1, RankFailed naming it on rank 0
            assert b["message"] == f"injected at call {b['at'][1]} of {b['at'][0]}"
            assert a["message"].startswith(f"rank 1 failed with ValueError: {b['message']}")


def _diverging_worker(rank, init_file, out_dir):
    """Rank 1 keeps its second block gathered after forward behind autofit's back (a user hook
    changing FSDP's setting mid-forward): the ranks' backward gathers differ."""
    torch.set_num_threads(1)
    import time
    import warnings
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=20))
    import autofit
    from spawn import timed
    import fsdp_faults as F
    model = F._model()
    block = model.bert.encoder.layer[1]
    if rank == 1:
        block.register_forward_pre_hook(lambda m, a: m.set_reshard_after_forward(False, recurse=False))
    seen = timed(lambda: autofit.run(model, F._batches(2), shard=True, precision="fp32", progress=False,
                                     cache=False, capacity_check=False, optimizer=torch.optim.AdamW))
    seen.pop("value", None)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


def test_ranks_about_to_run_different_fsdp_collectives_stop_together_instead_of_aborting(tmp_path):
    codes, killed = spawn_ranks(_diverging_worker, lambda r: (r, str(tmp_path / "init"), str(tmp_path)),
                                WORLD, PROCESS_TIMEOUT)
    assert not killed and codes == [0] * WORLD, (codes, killed)  # no SIGABRT, no hang
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for s in seen:
        assert s["error"] == "LockstepError"
        assert s["message"].startswith("the ranks are out of step inside FSDP: rank 0 at the all-gather "
                                       "of parameter group ")
        assert s["seconds"] < SLOWEST_END
    assert seen[0]["message"] == seen[1]["message"]
