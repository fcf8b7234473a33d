"""What every rank concludes from one agreement's table (autofit.distributed.agreement.Verdict),
here on hand-made tables; the spawned tests exercise the same tables between real ranks."""

from __future__ import annotations

import pytest

from autofit.distributed.agreement import BACKWARD, DONE, FIELDS, OK, OOM, SHARES, Verdict
from autofit.distributed.fsdp_guard import GATHER, REDUCE, collective_id, describe_collective
from autofit.errors import LockstepError, PeerOutOfMemory


def _row(code=OK, collective=0, step=3, phase=BACKWARD):
    header = {"code": code, "phase": phase, "step": step, "plan": 7, "value": 0.5, "value2": 0,
              "flag": 0, "model": 11, "collective": collective, "value3": 0}
    return [float(header[f]) for f in FIELDS]


def test_a_collective_is_named_by_kind_parameter_group_and_size_exactly():
    gather = collective_id(GATHER, 3, 8544)
    assert float(gather) == gather  # exact in the float64 header
    assert describe_collective(float(gather)) == "the all-gather of parameter group 3 (8544 elements)"
    assert describe_collective(float(collective_id(REDUCE, 0, 1188))) == \
        "the reduce-scatter of parameter group 0 (1188 elements)"
    assert describe_collective(0.0) == "the attempt's end (no collective)"
    assert collective_id(GATHER, 3, 8544) != collective_id(GATHER, 2, 8544)  # same size, another unit


def test_ranks_that_go_on_into_different_collectives_all_stop_with_both_named():
    rows = [_row(collective=collective_id(GATHER, 0, 1188)), _row(collective=collective_id(GATHER, 3, 8544))]
    for rank in (0, 1):
        verdict = Verdict(rank, BACKWARD, rows, None, len(FIELDS))
        assert verdict.terminal
        with pytest.raises(LockstepError) as raised:
            verdict.raise_for_peers()
        assert str(raised.value) == (
            "the ranks are out of step inside FSDP: rank 0 at the all-gather of parameter group 0 "
            "(1188 elements); rank 1 at the all-gather of parameter group 3 (8544 elements). Their "
            "FSDP states differ (a unit gathered or resharded on some ranks only); every rank stops "
            "rather than wait in a collective that never pairs.")
    # One rank done with its attempt while another is about to run a collective: the same.
    rows = [_row(collective=0), _row(collective=collective_id(REDUCE, 1, 64))]
    assert "rank 0 at the attempt's end (no collective); rank 1 at the reduce-scatter" in \
        Verdict(0, BACKWARD, rows, None, len(FIELDS)).mismatch


def test_the_same_collective_or_a_failed_rank_is_no_mismatch():
    same = collective_id(GATHER, 2, 5376)
    assert Verdict(0, BACKWARD, [_row(collective=same), _row(collective=same)], None, len(FIELDS)).mismatch is None
    # A rank that ran out of memory meets the others at its own agreement after backward: every
    # rank drops the attempt, so where the others stood does not matter.
    rows = [_row(collective=same), _row(code=OOM, collective=0)]
    verdict = Verdict(0, BACKWARD, rows, ["", "OutOfMemoryError: CUDA out of memory"], len(FIELDS))
    assert verdict.mismatch is None and not verdict.terminal
    with pytest.raises(PeerOutOfMemory):
        verdict.raise_for_peers()


def test_ranks_that_ran_out_of_batches_at_different_steps_are_told_the_counts():
    # Per-rank data: rank 1 ended after 5 global batches, ranks 0 and 2 count their shares of a sixth.
    rows = [_row(phase=SHARES, step=5), _row(phase=DONE, step=4), _row(phase=SHARES, step=5)]
    for rank in range(3):
        verdict = Verdict(rank, SHARES if rank != 1 else DONE, rows, None, len(FIELDS))
        with pytest.raises(LockstepError) as raised:
            verdict.raise_for_peers()
        assert str(raised.value) == (
            "the ranks were given different numbers of batches: rank 1 ended after 5 global batches; "
            "rank 0 has global batch 5; rank 2 has global batch 5. Every rank must give the same "
            "number of batches (its shares may differ in rows): shard the data so that each rank's "
            "loader yields as many batches (a DistributedSampler does), or drop the extra batches.")
