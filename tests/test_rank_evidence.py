"""A rank is named as failed only on evidence: SIGKILL any rank (rank 0, which serves the TCP store,
included) in forward while another survivor is healthy but behind, and every survivor names exactly
the killed rank, saying what it observed. Steps inside DDP's no_sync accumulate as the user's DDP
loop does; an unguarded optimizer step that runs out of memory on one rank tells every rank that
the weights now differ and which ranks did what."""

from __future__ import annotations

import json
import re
import socket

import pytest
import torch
from spawn import spawn_ranks

import evidence_ranks

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built"),
              pytest.mark.slow]

TIMEOUT = 90  # seconds for a whole spawn: fail rather than hang


def _tcp() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _spawn(worker, world: int, out, *extra) -> tuple[list, list]:
    init = _tcp()
    codes, killed = spawn_ranks(worker, lambda r: (r, world, init, str(out), *extra), world, TIMEOUT)
    assert not killed, f"ranks {killed} still running after {TIMEOUT} s"
    return codes, [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else None
                   for r in range(world)]


@pytest.mark.parametrize("world, victim", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
def test_every_survivor_names_exactly_the_killed_rank(tmp_path, world, victim):
    codes, seen = _spawn(evidence_ranks.kill_worker, world, tmp_path, victim)
    assert codes[victim] == -9 and seen[victim] is None
    observed = "died: the store it serves closed its connection" if victim == 0 else \
        "died or froze: its heartbeat stopped; it was last at global step 2, in forward/backward"
    for r in set(range(world)) - {victim}:
        s = seen[r]
        assert codes[r] == 0 and s["error"] == "RankFailed" and s["rank"] == victim, (r, s)
        assert f"rank {victim} {observed}" in s["message"], (r, s)
        assert re.findall(r"rank (\d+) (?:died|stalled)", s["message"]) == [str(victim)], (r, s)
        assert "a peer's connection closed" in s["message"] and "timeout" not in s["message"], (r, s)
        assert s["message"].endswith(f"; every rank stops, this is rank {r}."), (r, s)
        assert s["seconds"] < 30.0, (r, s)


def test_steps_inside_ddp_no_sync_accumulate_as_the_users_ddp_loop_does(tmp_path):
    codes, seen = _spawn(evidence_ranks.no_sync_worker, 2, tmp_path)
    assert codes == [0, 0]
    for r, s in enumerate(seen):
        # the OOM's replay retries the same plan (it fitted rows this long before): no split
        assert s == {"adam_steps": [2], "attempts": [[0, "ok"], [1, "oom"], [1, "ok"], [2, "ok"], [3, "ok"]]}, s
        params = torch.load(tmp_path / f"params{r}.pt", weights_only=True)
        for k, v in params["autofit"].items():
            assert torch.equal(v, params["plain"][k]), (r, k, (v - params["plain"][k]).abs().max())


@pytest.mark.parametrize("world", [2, 3])
def test_an_unguarded_step_oom_on_one_rank_is_told_to_every_rank_with_who_did_what(tmp_path, world):
    codes, seen = _spawn(evidence_ranks.step_oom_worker, world, tmp_path)
    assert codes == [0] * world
    params = [torch.load(tmp_path / f"params{r}.pt", weights_only=True) for r in range(world)]
    last = world - 1
    applied = "rank 0" if world == 2 else "ranks 0, 1"
    # the weights do differ: the ranks that applied the update against the one that did not
    assert all(torch.equal(params[0][k], params[r][k]) for r in range(last) for k in params[0])
    assert not all(torch.equal(params[0][k], params[last][k]) for k in params[0])
    for r, s in enumerate(seen):
        assert s["error"] == "PartialUpdateError", s
        assert s["message"].startswith(
            f"the ranks' weights now differ after global step 1's optimizer step: {applied} applied "
            f"the update; rank {last} failed in it (OutOfMemoryError: CUDA out of memory. Tried to "
            f"allocate 2.00 MiB (injected in the optimizer step)"), s
        assert s["message"].endswith(
            f"so no rank can undo its part and the run stops on every rank; this is rank {r}. Do not "
            f"save one rank's weights as the run's: resume every rank from the last checkpoint."), s
