"""Failures on one of two gloo ranks that every rank must meet together: an OOM in gradient clipping
(DDP-style replicas and FSDP2), a rank stalled in forward under the process group's timeout, an
optimizer that cannot step FSDP2's shards. Spawned ranks, tiny BERTs."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
import torch
from spawn import max_diff, spawn_ranks, timed

WORLD = 2
PROCESS_TIMEOUT = 120  # a backstop: each spawn ends in seconds

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")]


def _init(rank, init_file, seconds, world=WORLD):
    torch.set_num_threads(1)
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("autofit").setLevel(logging.ERROR)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=seconds))


class _OomIn:
    """The first call, while armed, of what clipping computes first (a norm: `where` "norm") or of
    the grad scaler's unscale ("unscale") raises an OOM."""

    NAMES = {"norm": ("linalg.vector_norm", "_foreach_norm"),
             "unscale": ("_amp_foreach_non_finite_check_and_unscale_",)}

    def __init__(self, where):
        self.names = self.NAMES[where]
        self.saved = tuple(self._get(n) for n in self.names)
        self.fired = 0

    @staticmethod
    def _get(name):
        owner, _, attr = name.rpartition(".")
        return getattr(torch.linalg if owner else torch, attr)

    @staticmethod
    def _set(name, value):
        owner, _, attr = name.rpartition(".")
        setattr(torch.linalg if owner else torch, attr, value)

    def __enter__(self):
        def failing(original):
            def norm(*args, **kwargs):
                if not self.fired:
                    self.fired += 1
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB "
                                                 "(injected)")
                return original(*args, **kwargs)
            return norm
        for name, original in zip(self.names, self.saved):
            self._set(name, failing(original))
        return self

    def __exit__(self, *exc):
        for name, original in zip(self.names, self.saved):
            self._set(name, original)
        return False


def _full_state(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


CLIP_CASES = {"ddp": (False, "fp32", "norm"), "fsdp2": (True, "fp32", "norm"),
              "fsdp2-fp16-unscale": (True, "fp16", "unscale")}


def _clip_cases(rank, seen, saved):
    """Every case of CLIP_CASES: a clean run, then the run with rank 1's first clipping failing."""
    import autofit
    from reference import bert, cls_batches
    for case, (shard, precision, where) in CLIP_CASES.items():
        for name, faulty in (("clean", False), ("fault", rank == 1)):
            model = bert()
            with _OomIn(where) if faulty else _nothing():
                result = autofit.run(model, cls_batches(2, rows=8), max_grad_norm=0.05, shard=shard,
                                     optimizer=torch.optim.AdamW, precision=precision, progress=False,
                                     cache=False, capacity_check=False)
            seen[f"{case} {name}"] = {
                "attempts": [[a.step, a.plan.micro_batch_size, a.outcome, a.where] for a in result.attempts],
                "norms": [h.get("grad_norm") for h in result.history]}
            saved[f"{case} {name}"] = _full_state(model)


def _group_kept_worker(rank, init_file, out_dir):
    """The failures after which the group stays usable, one after the other in one spawned pair:
    the clipping OOMs, a SystemExit and a KeyboardInterrupt, the refused optimizer."""
    _init(rank, init_file, 60)
    seen, saved = {}, {}
    _clip_cases(rank, seen, saved)
    _interrupts(rank, seen)
    _adafactor(rank, seen)
    torch.save(saved, os.path.join(out_dir, f"params{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    torch.distributed.destroy_process_group()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _spawn(worker, tmp_path, *args, world=WORLD):
    codes, killed = spawn_ranks(worker, lambda r: (r, str(tmp_path / "init"), str(tmp_path), *args),
                                world, PROCESS_TIMEOUT)
    assert not killed and codes == [0] * world, (codes, killed)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def group_kept(tmp_path_factory):
    out = tmp_path_factory.mktemp("group_kept")
    seen = _spawn(_group_kept_worker, out)
    return seen, [torch.load(out / f"params{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("case", list(CLIP_CASES))
def test_an_oom_in_clipping_on_one_rank_is_replayed_on_every_rank(group_kept, case):
    """Nothing is applied when clipping (or the grad scaler's unscale before it) runs out of memory:
    both ranks drop the attempt at the clipping agreement and replay the global batch, ending as the
    fault-free run did."""
    seen, params = group_kept
    for name in ("clean", "fault"):  # the same attempts and norms on both ranks
        assert seen[0][f"{case} {name}"] == seen[1][f"{case} {name}"]
    clean, fault = seen[1][f"{case} clean"], seen[1][f"{case} fault"]
    assert clean["attempts"] == [[0, 4, "ok", ""], [1, 4, "ok", ""]]
    # A transient OOM: the same plan again (no verdict), so the same mathematics as the clean run.
    assert fault["attempts"] == [[0, 4, "oom", "optimizer.step"], [0, 4, "ok", ""], [1, 4, "ok", ""]]
    assert fault["norms"] == clean["norms"] and min(clean["norms"]) > 0.05  # it clipped
    assert max(clean["norms"]) < 1.0  # unscaled first (fp16: a scaled gradient's norm is ~65536x)
    for p in params:
        assert max_diff(p[f"{case} fault"], p[f"{case} clean"]) == 0.0
    assert max_diff(params[0][f"{case} fault"], params[1][f"{case} fault"]) == 0.0


STALL_S = 45.0


def _stall_worker(rank, init_file, out_dir, world=WORLD, shard=True):
    _init(rank, init_file, 10, world)
    import autofit
    from reference import bert, cls_batches
    model = bert()
    calls = []
    if rank == world - 1:  # its first training forward of block 1 stalls, as a hung device would
        model.bert.encoder.layer[1].register_forward_pre_hook(
            lambda m, a: None if calls or not torch.is_grad_enabled() else (calls.append(1), time.sleep(STALL_S)))
    seen = timed(lambda: autofit.run(model, cls_batches(2, rows=4 * world), shard=shard,
                                     optimizer=torch.optim.AdamW, precision="fp32", progress=False,
                                     cache=False, capacity_check=False))
    seen.pop("value", None)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    os._exit(0)  # the group is broken: nothing to tear down


def test_a_rank_stalled_in_forward_ends_every_rank_within_the_users_timeout_naming_it(tmp_path):
    """init_process_group(timeout=10 s), FSDP2: rank 1 sleeps 45 s inside its first forward. Rank 0
    waits at its next agreement for the timeout the user gave (not torch's 30 minutes) and names
    rank 1 and where it last was; rank 1 is stopped by the others' verdict, not at its wake-up."""
    start = time.monotonic()
    seen = _spawn(_stall_worker, tmp_path)
    assert time.monotonic() - start < STALL_S  # the stalled rank did not sleep its 45 s out
    stalled = ("rank 1 stalled: its heartbeat goes on but it did not reach the agreement; it was last "
               "at global step 0, in forward/backward (the agreement at global step 0, in "
               "forward/backward failed: the process group's timeout (10 s) ran out)")
    assert seen[0]["error"] == "RankFailed"
    assert seen[0]["message"].startswith(stalled + "; every rank stops, this is rank 0."), seen[0]["message"]
    assert seen[1]["error"] == "RankFailed"
    assert seen[1]["message"] == f"rank 0 stopped the run: {stalled}; every rank " \
                                 f"stops, this is rank 1."
    for s in seen:
        assert 10.0 <= s["seconds"] < 40.0, seen


def test_with_three_ranks_the_two_that_waited_name_the_stalled_one(tmp_path):
    """Replicas (the agreement on the training group itself), 3 ranks, rank 2 stalled: ranks 0 and
    1 both name rank 2, and rank 2 is stopped by their verdict."""
    start = time.monotonic()
    seen = _spawn(_stall_worker, tmp_path, 3, False, world=3)
    assert time.monotonic() - start < STALL_S
    stalled = ("rank 2 stalled: its heartbeat goes on but it did not reach the agreement; it was last "
               "at global step 0, in forward/backward (the agreement at global step 0, in "
               "forward/backward failed: the process group's timeout (10 s) ran out)")
    for r in (0, 1):
        assert seen[r]["error"] == "RankFailed"
        # its own verdict, or the other waiting rank's read from the store first: the same evidence
        assert seen[r]["message"] in (f"{stalled}; every rank stops, this is rank {r}.",
                                      f"rank {1 - r} stopped the run: {stalled}; every rank stops, "
                                      f"this is rank {r}."), seen[r]
    assert seen[2]["error"] == "RankFailed"
    assert seen[2]["message"].endswith(f": {stalled}; every rank stops, this is rank 2."), seen[2]
    assert seen[2]["message"].startswith(("rank 0 stopped the run", "rank 1 stopped the run")), seen[2]
    for s in seen:
        assert 10.0 <= s["seconds"] < 40.0, seen


def _interrupts(rank, seen):
    import autofit
    from reference import bert, cls_batches
    for kind in (SystemExit, KeyboardInterrupt):
        def loss_fn(model, batch, _calls=[]):
            _calls.append(1)
            if rank == 1 and len(_calls) == 2:  # the second global batch's forward
                raise kind(3) if kind is SystemExit else kind()
            return model(**batch).loss
        start = time.monotonic()
        try:
            autofit.run(bert(), cls_batches(3, rows=8), loss_fn=loss_fn, precision="fp32", progress=False,
                        cache=False, capacity_check=False)
            seen[kind.__name__] = {"error": None}
        except BaseException as error:  # noqa: BLE001 - which error each rank got is the test
            seen[kind.__name__] = {"error": type(error).__name__, "message": str(error),
                                   "seconds": time.monotonic() - start}


def test_a_system_exit_or_keyboard_interrupt_on_one_rank_is_announced_to_the_others(group_kept):
    """Not only Exceptions: the others learn of any BaseException at their next agreement and end
    with RankFailed naming it, while the rank itself propagates its own (the group stays usable)."""
    seen = group_kept[0]
    for kind in ("SystemExit", "KeyboardInterrupt"):
        assert seen[1][kind]["error"] == kind
        assert seen[0][kind]["error"] == "RankFailed"
        assert seen[0][kind]["message"].startswith(f"rank 1 failed with {kind}: "), seen[0][kind]
        assert "at global step 1" in seen[0][kind]["message"], seen[0][kind]
        assert seen[0][kind]["seconds"] < 30.0


def _adafactor(rank, seen):
    import autofit
    from reference import bert, cls_batches
    model = bert()
    steps = []
    optimizer = lambda params: torch.optim.Adafactor(params, lr=0.01)  # noqa: E731
    losses = lambda m, b: steps.append(1) or m(**b).loss  # noqa: E731
    before = _full_state(model)
    refused = timed(lambda: autofit.run(model, cls_batches(2, rows=8), loss_fn=losses, shard=True,
                                        optimizer=optimizer, precision="fp32", progress=False,
                                        cache=False, capacity_check=False))
    refused.pop("value", None)
    refused["forwards"] = len(steps)
    refused["untouched"] = max_diff(before, _full_state(model)) == 0.0
    seen["adafactor"] = refused


def test_an_optimizer_that_cannot_step_shards_is_refused_on_every_rank_before_training(group_kept):
    """torch.optim.Adafactor raises on FSDP2's DTensors at its first step: found by a trial step on
    a tiny sharded parameter, refused on both ranks before any forward, naming it and torch's reason."""
    for s in (r["adafactor"] for r in group_kept[0]):
        assert s["error"] == "ValueError", s
        assert s["message"].startswith("torch.optim.Adafactor cannot step FSDP2's sharded parameters "
                                       "(DTensors): a step on a tiny sharded parameter ("), s
        assert "raised RuntimeError: aten.pow_.Scalar: in-place operations that require placement " \
               "changes are not supported." in s["message"], s
        assert s["forwards"] == 0 and s["untouched"]
