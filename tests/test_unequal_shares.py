"""Per-rank data whose shares differ in rows (each rank reads its own shard; the last batches have
5, 3 and 1 rows): every rank trains to the end under one plan per global batch, derived from the
global batch (its largest share), and ends equal to the plain distributed loop that weights each
micro-batch by the global batch's rows. A different number of batches per rank is the one error."""

from __future__ import annotations

import json

import pytest
import torch
from spawn import spawn_ranks
from versions import needs_fsdp2_runs

import shares_ranks
from shares_ranks import worker

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built"),
              pytest.mark.slow]

SCENARIOS = ["stepper", "oom", "sharded", "run", "short_first", "extra"]
TIMEOUT = 300  # seconds for a whole spawn: fail rather than hang


def _spawned(tmp_path_factory, world: int):
    out = tmp_path_factory.mktemp(f"shares{world}")
    codes, killed = spawn_ranks(worker, lambda r: (r, world, str(out / "init"), str(out), SCENARIOS),
                                world, TIMEOUT)
    assert not killed and codes == [0] * world, f"exit codes {codes}, killed {killed}"
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    params = [torch.load(out / f"params{r}.pt", weights_only=True) for r in range(world)]
    return seen, params


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request, tmp_path_factory):
    return request.param, *_spawned(tmp_path_factory, request.param)


def _global_rows(world: int, shards=shares_ranks.SHARD_ROWS) -> list[int]:
    rows = shards[:world]
    return [sum(min(shares_ranks.BATCH, n - i) for n in rows) for i in range(0, max(rows), shares_ranks.BATCH)]


def assert_equals_plain(params, scenario: str, tolerance: float = 0.0) -> None:
    """Every rank's parameters after `scenario` equal (bitwise, or within `tolerance`) those of the
    plain distributed loop that weights by global rows, run on the same rank."""
    for r, mine in enumerate(params):
        for k, v in mine[scenario].items():
            plain = mine[scenario + "/plain"][k]
            assert (torch.equal(v, plain) if tolerance == 0 else (v - plain).abs().max().item() <= tolerance), (r, k)


@pytest.mark.parametrize("scenario", ["stepper", "run"])
def test_unequal_shares_train_to_the_end_equal_to_the_plain_loop(ranks, scenario):
    world, seen, params = ranks
    # one plan per global batch on every rank: the whole largest share (its last: 5 rows)
    expected = [[s, 8, 1, "ok"] for s in range(4)] + [[4, 5, 1, "ok"]]
    assert [s[scenario]["attempts"] for s in seen] == [expected] * world
    assert [s[scenario]["samples"] for s in seen] == [_global_rows(world)] * world
    assert_equals_plain(params, scenario)
    for r in range(world):  # and the ranks hold one model
        assert all(torch.equal(v, params[0][scenario][k]) for k, v in params[r][scenario].items()), r


def test_first_shares_that_differ_in_rows_start_every_rank_on_the_plan_of_the_largest(ranks):
    world, seen, params = ranks
    # the short batches first (1 and 3 rows with 2 ranks, 1, 3 and 5 with 3): the whole largest
    # share, not rank 0's; then the 8-row batches whole (probed up)
    largest = {2: 3, 3: 5}[world]
    expected = [[0, largest, 1, "ok"]] + [[s, 8, 1, "ok"] for s in range(1, 5)]
    assert [s["short_first"]["attempts"] for s in seen] == [expected] * world
    assert [s["short_first"]["samples"] for s in seen] == \
        [_global_rows(world, shares_ranks.SHORT_FIRST_ROWS)[::-1]] * world
    assert_equals_plain(params, "short_first")


def test_a_one_rank_oom_steps_every_rank_down_at_the_same_global_batch(ranks):
    world, seen, params = ranks
    expected = [[s, 8, 1, "ok"] for s in range(4)] + [[4, 5, 1, "oom"], [4, 5, 1, "oom"], [4, 2, 3, "ok"]]
    assert [s["oom"]["attempts"] for s in seen] == [expected] * world
    assert_equals_plain(params, "oom")


@needs_fsdp2_runs
def test_fsdp2_pads_the_shorter_shares_micro_batches_and_equals_the_plain_loop(ranks):
    # The last global batch at micro-batch 2: 3 micro-batches on the 5-row share, 2 and 1 on the
    # others, which run their first row again weighted 0 so that FSDP's collectives pair.
    world, seen, params = ranks
    expected = [[s, 8, 1, "ok"] for s in range(4)] + [[4, 5, 1, "oom"], [4, 5, 1, "oom"], [4, 2, 3, "ok"]]
    assert [s["sharded"]["attempts"] for s in seen] == [expected] * world
    assert_equals_plain(params, "sharded", tolerance=1e-6)


def test_a_different_number_of_batches_is_the_error_at_the_first_step_that_shows_it(ranks):
    world, seen, _ = ranks
    text = (f"the ranks were given different numbers of batches: "
            + "; ".join(f"rank {r} ended after 5 global batches" for r in range(1, world))
            + "; rank 0 has global batch 5.")
    for s in seen:
        assert s["extra"]["error"] == "LockstepError"
        assert s["extra"]["message"].startswith(text), s["extra"]["message"]
