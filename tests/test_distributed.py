"""torch.distributed: two CPU ranks (gloo) in lockstep, each under its own simulated GPU.

The two processes are spawned once for the module and run every scenario one after the other in
the same process group (a scenario that ends with an error leaves the group usable, which is part
of what is tested: every rank met the same agreements). Each rank writes what it saw to a JSON file
and its parameters to a .pt file; the tests read them.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
from spawn import FlakyAdamW, Samples, sampler, spawn_ranks, timed

WORLD = 2
GLOBAL = 32                 # rows of a global batch: 16 per rank
SLOWEST_ERROR_EXIT = 30.0   # seconds; the process group's timeout is 60 s, so a hang would show
PROCESS_TIMEOUT = 480       # seconds for the whole spawn, a backstop that fails instead of hanging
FAULTS = 6                  # allocations sampled for an injected fault (benchmarks/distributed_faults.py: all)

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built"),
              pytest.mark.slow]  # every test here reads spawned gloo ranks' results


# -- what each rank runs ----------------------------------------------------------------------
def _attempts(result_or_error):
    return [[a.step, a.plan.micro_batch_size, a.outcome, a.where, a.error]
            for a in result_or_error.attempts]


class _BrokenData:
    """Yields one global batch, then fails (an error outside any step)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield self.batches[0]
        raise OSError("rank 1 lost its data file")


def _Samples():
    return Samples(GLOBAL)


def _sampler(rank, epoch=0):
    return sampler(GLOBAL, WORLD, rank, seed=7, epoch=epoch)


class _Fails:
    """An iterable of batches that raises `error` when its `at`-th batch is read."""

    def __init__(self, batches, at, error):
        self.batches, self.at, self.error = batches, at, error

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == self.at:
                raise self.error
            yield batch


def _phase_faults(rank, batches):
    """(name, run keywords) that make rank 1 fail at one phase of a run, from before the first
    agreement to after the last; on rank 0 the keywords do nothing."""
    from reference import bert
    mine = rank == 1

    class Boom(RuntimeError):
        pass

    def optimizer_fails(params):
        raise Boom("optimizer factory")

    def scheduler_fails(optimizer):
        raise Boom("scheduler factory")

    def scheduler_steps_fail(at):
        def make(optimizer):
            class Scheduler(torch.optim.lr_scheduler.LambdaLR):
                def step(self, *args):
                    if self.last_epoch == at:
                        raise Boom(f"scheduler step {at}")
                    super().step(*args)
            return Scheduler(optimizer, lambda s: 1.0)
        return make

    def metric_fails(output, batch):
        raise Boom("metric")

    yield "first batch", {"data": _Fails(batches, 0, Boom("first batch")) if mine else batches}
    yield "eval data check", {"eval_data": _Fails(batches, 0, Boom("eval data")) if mine else batches[:1]}
    yield "device", {"budget": "2 potatoes" if mine else None}
    yield "model", {"model": bert(layers=1) if mine else bert()}
    if mine:
        yield "optimizer", {"optimizer": optimizer_fails}
        yield "scheduler", {"scheduler": scheduler_fails}
        yield "scheduler step 1 (after the step agreement)", {"scheduler": scheduler_steps_fail(1)}
        yield "last scheduler step", {"scheduler": scheduler_steps_fail(len(batches))}
        yield "evaluation", {"eval_data": batches[:1], "metric_fn": metric_fails}
    else:
        yield "optimizer", {}
        yield "scheduler", {}
        yield "scheduler step 1 (after the step agreement)", {}
        yield "last scheduler step", {}
        yield "evaluation", {"eval_data": batches[:1], "metric_fn": lambda output, batch: {}}


class _SyncBNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SyncBatchNorm(8), torch.nn.Linear(8, 2))

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.net(x), y)


def _worker(rank, init_file, out_dir, budgets, ddp_buckets):
    os.environ["AUTOFIT_CACHE_DIR"] = os.path.join(out_dir, f"cache-{rank}")
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    import autofit
    from autofit.cache.store import PlanCache
    from reference import bert, cls_batches, gpt2, lm_batches

    batches = cls_batches(3, rows=GLOBAL)
    seen = {}

    def run(model, data=batches, **kw):
        kw = {"precision": "fp32", "progress": False, "capacity_check": False, **kw}
        return autofit.run(model, data, **kw)

    # 1. Only rank 1's budget is too small for its 16 rows at once.
    model = bert()
    with autofit.simulate_gpu(budgets[rank]):
        result = run(model)
    seen["oom"] = {"attempts": _attempts(result),
                   "micro": [h["plan"].micro_batch_size for h in result.history],
                   "losses": [h["loss"] for h in result.history], "cache": len(PlanCache().entries())}
    torch.save(model.state_dict(), os.path.join(out_dir, f"oom-{rank}.pt"))

    # 2. The same job again: rank 0 reads its cache and every rank starts from that plan.
    with autofit.simulate_gpu(budgets[rank]):
        result = run(bert())
    seen["cached"] = {"attempts": _attempts(result), "reason": result.attempts[0].reason}

    # 3. The capacity check: rank 0 estimates against the smallest budget, every rank starts there.
    with autofit.simulate_gpu(budgets[rank]):
        result = run(bert(), capacity_check=True, cache=False)
    seen["estimated"] = {"attempts": _attempts(result), "reason": result.attempts[0].reason}

    # 4. Token-weighted loss (a causal LM, rows with different numbers of label tokens): one OOM in
    # rank 1's first forward makes both ranks replay with micro-batches of 2.
    model = gpt2()
    if rank == 1:
        def fail_once(module, args, kwargs):
            hook.remove()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB (injected)")
        hook = model.register_forward_pre_hook(fail_once, with_kwargs=True)
    result = run(model, data=lm_batches(2, rows=8), cache=False,
                 ladder=lambda plan: plan.replace(micro_batch_size=2) if plan.micro_batch_size > 2 else None)
    seen["tokens"] = {"attempts": _attempts(result),
                      "micro": [h["plan"].micro_batch_size for h in result.history]}
    torch.save(model.state_dict(), os.path.join(out_dir, f"tokens-{rank}.pt"))

    # 5. Rank 1's optimizer step runs out of memory after updating: both ranks roll back.
    model = bert()
    with autofit.simulate_gpu("8MiB"):
        result = run(model, optimizer=FlakyAdamW if rank == 1 else None, cache=False)
    seen["step_oom"] = {"attempts": _attempts(result),
                        "micro": [h["plan"].micro_batch_size for h in result.history]}
    torch.save(model.state_dict(), os.path.join(out_dir, f"step_oom-{rank}.pt"))

    # 6. A non-OOM error inside rank 1's step.
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise ValueError("rank 1 cannot compute this loss")
        return model(**batch).loss
    with autofit.simulate_gpu("8MiB"):
        seen["error"] = timed(lambda: run(bert(), loss_fn=loss_fn, cache=False))

    # 7. A non-OOM error outside any step (reading rank 1's data).
    with autofit.simulate_gpu("8MiB"):
        seen["data_error"] = timed(lambda: run(bert(), data=_BrokenData(batches) if rank == 1 else batches,
                                                cache=False))

    # 8. Rank 1 has one global batch fewer.
    with autofit.simulate_gpu("8MiB"):
        seen["short"] = timed(lambda: run(bert(), data=batches[:2] if rank == 1 else batches, cache=False))

    # 9. Global batches that cannot be split evenly: the first one, and a later one.
    odd = {k: v[:GLOBAL - 1] for k, v in batches[1].items()}
    seen["odd_first"] = timed(lambda: run(bert(), data=[odd], cache=False))
    seen["odd_later"] = timed(lambda: run(bert(), data=[batches[0], odd], cache=False))

    # 10. The user's own DDP model, under the budgets of scenario 1 plus the buckets its reducer holds
    # (autofit makes no DDP of its own, so scenario 1 has none).
    with autofit.simulate_gpu(budgets[rank] + ddp_buckets):
        model = torch.nn.parallel.DistributedDataParallel(bert())
        result = run(model, cache=False)
    seen["user_ddp"] = {"attempts": _attempts(result)}
    torch.save(model.module.state_dict(), os.path.join(out_dir, f"user_ddp-{rank}.pt"))

    # 11. Per-rank data as torchrun jobs give it: a DataLoader with a DistributedSampler (shuffled,
    # two epochs), 16 rows per rank, under the budgets of scenario 1.
    model = bert()
    loader = torch.utils.data.DataLoader(_Samples(), batch_size=GLOBAL // WORLD, sampler=_sampler(rank))
    with autofit.simulate_gpu(budgets[rank]):
        result = run(model, data=loader, epochs=2, cache=False)
    seen["sampled"] = {"attempts": _attempts(result), "micro": [h["plan"].micro_batch_size for h in result.history]}
    torch.save(model.state_dict(), os.path.join(out_dir, f"sampled-{rank}.pt"))

    # 12. Each rank given its own rows of scenario 1's batches as a list (first batches differ).
    model = bert()
    half = [{k: v[rank * GLOBAL // WORLD:(rank + 1) * GLOBAL // WORLD] for k, v in b.items()} for b in batches]
    with autofit.simulate_gpu(budgets[rank]):
        result = run(model, data=half, cache=False)
    seen["halves"] = {"attempts": _attempts(result)}
    torch.save(model.state_dict(), os.path.join(out_dir, f"halves-{rank}.pt"))

    # 13. Data that cannot be told apart: refused on every rank at the first agreement.
    sampled = torch.utils.data.DataLoader(_Samples(), batch_size=GLOBAL // WORLD, sampler=_sampler(rank))
    seen["mixed"] = timed(lambda: run(bert(), data=sampled if rank == 0 else batches, cache=False))
    mine = torch.utils.data.Subset(_Samples(), range(rank, 2 * GLOBAL, WORLD))
    seen["datasets"] = timed(lambda: run(bert(), data=mine, batch_size=GLOBAL, cache=False))

    # 14. An error at each phase of a run on rank 1 (the budget is large: nothing runs out of memory).
    seen["phases"] = {}
    for name, kw in _phase_faults(rank, batches[:2]):
        with autofit.simulate_gpu("64MiB"):
            seen["phases"][name] = timed(lambda: run(**{"model": bert(), "cache": False, **kw}))

    # 15. A layer that communicates in forward.
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
    seen["syncbn"] = timed(lambda: run(_SyncBNNet(), data=data, cache=False))

    # 16. No plan fits rank 1's budget: rank 1 says so, naming its own device and budget.
    from reference import model_bytes
    tiny = int(model_bytes(bert()) * 1.5)
    seen["tiny"] = {"budget": tiny}
    with autofit.simulate_gpu("64MiB" if rank == 0 else tiny):
        seen["tiny"].update(timed(lambda: run(bert(), capacity_check=True, cache=False)))

    # 17. Evaluation: each rank evaluates its share of eval_data (a list of batches, a Dataset).
    model, evaluated = bert(), []

    def metric_fn(output, batch):
        evaluated.append(len(batch["labels"]))
        return {"accuracy": (output.logits.argmax(-1) == batch["labels"]).float().mean()}
    result = run(model, data=batches[:1], eval_data=batches, metric_fn=metric_fn, cache=False)
    seen["eval"] = {"history": result.eval_history, "rows": sum(evaluated)}
    evaluated.clear()
    result = run(bert(), data=batches[:1], eval_data=_Samples(), metric_fn=metric_fn, cache=False)
    seen["eval_dataset"] = {"history": result.eval_history, "rows": sum(evaluated)}
    torch.save(model.state_dict(), os.path.join(out_dir, f"eval-{rank}.pt"))

    # 18. An out-of-memory error at allocations sampled across a whole run on rank 1 (placing the
    # model, the agreements, forward/backward, the step, evaluation); rank 0 has no fault.
    def faulted(at):
        model = bert()
        with autofit.simulate_gpu("64MiB") as gpu:
            gpu.fail_at(at)
            result = run(model, data=batches[:2], eval_data=batches[:1], cache=False)
            return [a[:3] for a in _attempts(result)], gpu.allocation_count
    _, count = faulted(None)
    seen["faults"] = [timed(lambda: faulted(count * k // FAULTS if rank == 1 else None)[0])
                      for k in range(FAULTS)]

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


# -- the parent ------------------------------------------------------------------------------
def _second_step_peak(rows: int, micro: int) -> int:
    import autofit
    from autofit.gpu.device import SimulatedDevice
    from autofit.plans.plan import Plan
    from autofit.engine.step import StepRunner
    from reference import bert, cls_batches

    batch = {k: v[:rows] for k, v in cls_batches(1, rows=GLOBAL)[0].items()}
    model = bert()
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device)
        runner.run(batch, Plan.for_batch(rows, micro))
        runner.run(batch, Plan.for_batch(rows, micro))
        return runner.attempt_peak()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each rank saw: [rank 0's dict, rank 1's dict], and the folder with their parameters."""
    from reference import bert
    out = tmp_path_factory.mktemp("distributed")
    local = GLOBAL // WORLD
    from autofit.gpu.simulate import round_bytes
    # A user's DDP keeps one bucket holding a copy of the gradients (the model is below 1 MiB).
    ddp_buckets = round_bytes(sum(p.numel() * p.element_size() for p in bert().parameters()))
    # Rank 1 fits 8 of its 16 rows at once but not 12; rank 0 fits all 16.
    small = (_second_step_peak(local, 8) + _second_step_peak(local, 12)) // 2
    budgets = [2 * small, small]
    codes, killed = spawn_ranks(_worker, lambda r: (r, str(out / "init"), str(out), budgets, ddp_buckets),
                                WORLD, PROCESS_TIMEOUT)
    assert not killed, f"ranks {killed} still running after {PROCESS_TIMEOUT} s"
    assert codes == [0] * WORLD, f"exit codes {codes}"
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return seen, out


def _load(out, name, rank):
    return torch.load(out / f"{name}-{rank}.pt")


def _split_loop(micro_sizes, make_model=None, batches=None, tokens=False):
    """A plain single-process loop doing what the ranks do: each global batch cut into the ranks'
    halves, each half into micro-batches of the given size, every piece weighted by its share of the
    global batch (rows, or label tokens after the causal shift), each half's gradients accumulated
    on their own and the halves then summed."""
    from reference import bert, cls_batches
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: the same kernels reduce in the same order
    try:
        return _split_loop_1(micro_sizes, make_model or bert, batches or cls_batches(3, rows=GLOBAL), tokens)
    finally:
        torch.set_num_threads(threads)


def _split_loop_1(micro_sizes, make_model, batches, tokens):
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params)
    share = (lambda b: int((b["labels"][:, 1:] != -100).sum())) if tokens else (lambda b: len(b["labels"]))
    for batch, micro in zip(batches, micro_sizes):
        n = len(batch["labels"])
        local = n // WORLD
        summed = None
        for start in range(0, n, local):
            for i in range(start, start + local, micro):
                part = {k: v[i:min(i + micro, start + local)] for k, v in batch.items()}
                (model(**part).loss * (share(part) / share(batch))).backward()
            grads = [p.grad for p in params]
            summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
            opt.zero_grad(set_to_none=True)
        for p, g in zip(params, summed):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_an_oom_on_one_rank_steps_every_rank_down_to_the_same_plan(ranks):
    (r0, r1), out = ranks
    plans0 = [a[:3] for a in r0["oom"]["attempts"]]
    plans1 = [a[:3] for a in r1["oom"]["attempts"]]
    assert plans0 == plans1
    # The first step fits (no optimizer state yet); then 16 rows fail on rank 1, 8 fit, 12 fail.
    assert plans0 == [[0, 16, "ok"], [1, 16, "oom"], [1, 8, "ok"], [2, 12, "oom"], [2, 8, "ok"]]
    # Only rank 1 ran out of memory itself; rank 0 dropped its attempts because of it.
    for attempt in r0["oom"]["attempts"]:
        if attempt[2] == "oom":
            assert attempt[4].startswith("out of memory on another rank (rank 1: OutOfMemoryError")
    assert all(a[4].startswith("CUDA out of memory") for a in r1["oom"]["attempts"] if a[2] == "oom")
    assert r0["oom"]["losses"] == r1["oom"]["losses"]


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_ranks_end_with_identical_parameters_equal_to_a_single_process_loop(ranks):
    from reference import bert, cls_batches, plain_loop
    (r0, r1), out = ranks
    p0, p1 = _load(out, "oom", 0), _load(out, "oom", 1)
    assert _equal(p0, p1)
    assert r0["oom"]["micro"] == r1["oom"]["micro"] == [16, 8, 8]
    assert _equal(p0, _split_loop(r0["oom"]["micro"]))  # bit for bit
    full = plain_loop(bert(), cls_batches(3, rows=GLOBAL), [GLOBAL] * 3).state_dict()
    assert _max_diff(p0, full) <= 1e-6  # the whole global batch at once, in one process


def test_only_rank_0_writes_the_cache_and_every_rank_starts_from_it(ranks):
    (r0, r1), _ = ranks
    assert (r0["oom"]["cache"], r1["oom"]["cache"]) == (1, 0)
    for seen in (r0, r1):
        assert [a[2] for a in seen["cached"]["attempts"]] == ["ok"] * 3
        assert seen["cached"]["reason"].startswith("cached: worked for this job")
    assert [a[:3] for a in r0["cached"]["attempts"]] == [a[:3] for a in r1["cached"]["attempts"]]


def test_every_rank_starts_from_the_plan_rank_0_estimated_for_the_smallest_budget(ranks):
    (r0, r1), _ = ranks
    assert [a[:3] for a in r0["estimated"]["attempts"]] == [a[:3] for a in r1["estimated"]["attempts"]]
    assert r0["estimated"]["attempts"][0][:3] == [0, 8, "ok"]  # 16 would not fit rank 1
    assert r0["estimated"]["reason"] == r1["estimated"]["reason"]
    assert r0["estimated"]["reason"].startswith("estimated: fastest plan predicted to fit")


def test_token_weighted_losses_match_the_single_process_full_batch(ranks):
    from reference import gpt2, lm_batches, plain_loop
    (r0, r1), out = ranks
    for seen in (r0, r1):
        assert [a[:3] for a in seen["tokens"]["attempts"]] == [[0, 4, "oom"], [0, 2, "ok"], [1, 3, "ok"]]
    p0, p1 = _load(out, "tokens", 0), _load(out, "tokens", 1)
    assert _equal(p0, p1)
    batches = lm_batches(2, rows=8)
    assert _equal(p0, _split_loop(r0["tokens"]["micro"], gpt2, batches, tokens=True))
    # The whole global batch at once sums in another order: guarantee 1's bound (measured ~1e-6).
    assert _max_diff(p0, plain_loop(gpt2(), batches, [8, 8], tokens=True).state_dict()) <= 1e-4


def test_an_oom_in_one_ranks_optimizer_step_is_rolled_back_on_every_rank(ranks):
    (r0, r1), out = ranks
    first0, first1 = r0["step_oom"]["attempts"][0], r1["step_oom"]["attempts"][0]
    assert first0[:4] == first1[:4] == [0, 16, "oom", "optimizer.step"]
    assert "rank 1" in first0[4] and "rolled back" in first0[4]
    assert [a[:3] for a in r0["step_oom"]["attempts"]] == [a[:3] for a in r1["step_oom"]["attempts"]]
    p0, p1 = _load(out, "step_oom", 0), _load(out, "step_oom", 1)
    assert _equal(p0, p1)
    assert _equal(p0, _split_loop(r0["step_oom"]["micro"]))  # no update applied twice, on any rank


@pytest.mark.parametrize("scenario, error, text", [
    ("error", "ValueError", "rank 1 cannot compute this loss"),
    ("data_error", "OSError", "rank 1 lost its data file"),
])
def test_a_non_oom_error_on_one_rank_ends_every_rank_promptly(ranks, scenario, error, text):
    (r0, r1), _ = ranks
    assert (r1[scenario]["error"], r1[scenario]["message"]) == (error, text)  # its own error, as raised
    assert r0[scenario]["error"] == "RankFailed"
    assert r0[scenario]["message"].startswith(f"rank 1 failed with {error}: {text}")
    assert max(r0[scenario]["seconds"], r1[scenario]["seconds"]) < SLOWEST_ERROR_EXIT


def test_ranks_with_different_numbers_of_batches_stop_together(ranks):
    (r0, r1), _ = ranks
    for seen in (r0, r1):
        assert seen["short"]["error"] == "LockstepError"
        assert seen["short"]["message"].startswith(
            "the ranks were given different numbers of batches: rank 1 ended after 2 global batches; "
            "rank 0 has global batch 2.")
        assert seen["short"]["seconds"] < SLOWEST_ERROR_EXIT


@pytest.mark.parametrize("scenario", ["odd_first", "odd_later"])
def test_a_global_batch_that_cannot_be_split_evenly_is_refused_on_every_rank(ranks, scenario):
    (r0, r1), _ = ranks
    for seen in (r0, r1):
        assert seen[scenario]["error"] == "ValueError"
        assert seen[scenario]["message"].startswith(f"global batch {GLOBAL - 1} cannot be split evenly "
                                                    f"over 2 ranks")


def test_a_model_already_wrapped_in_ddp_is_accepted(ranks):
    (r0, r1), out = ranks
    plans = [a[:3] for a in r0["user_ddp"]["attempts"]]
    assert plans == [a[:3] for a in r1["user_ddp"]["attempts"]] == [a[:3] for a in r0["oom"]["attempts"]]
    p0, p1 = _load(out, "user_ddp", 0), _load(out, "user_ddp", 1)
    assert _equal(p0, p1) and _equal(p0, _load(out, "oom", 0))


def test_a_distributed_sampler_loader_trains_every_sample_once_per_epoch(ranks):
    from reference import bert, plain_loop
    (r0, r1), out = ranks
    # Unequal budgets: rank 1 runs out of memory, and both ranks walk the same plans.
    assert [a[:3] for a in r0["sampled"]["attempts"]] == [a[:3] for a in r1["sampled"]["attempts"]]
    assert [a[:3] for a in r0["sampled"]["attempts"]] == [[0, 16, "ok"], [1, 16, "oom"], [1, 8, "ok"],
                                                          [2, 12, "oom"], [2, 8, "ok"], [3, 10, "ok"]]
    p0, p1 = _load(out, "sampled", 0), _load(out, "sampled", 1)
    assert _equal(p0, p1)
    # The single-process loop over the global batches: rank 0's rows then rank 1's, epoch by epoch
    # in the samplers' order for that epoch (so set_epoch was called: epoch 1 differs from epoch 0).
    samples = _Samples()
    orders = {(e, r): list(_sampler(r, e)) for e in range(2) for r in range(WORLD)}
    assert orders[0, 0] != orders[1, 0]
    for e in range(2):
        assert sorted(orders[e, 0] + orders[e, 1]) == list(range(len(samples)))  # each sample once
    per = GLOBAL // WORLD
    batches = []
    for e in range(2):
        for i in range(0, len(samples) // WORLD, per):
            rows = [samples[j] for r in range(WORLD) for j in orders[e, r][i:i + per]]
            batches.append(torch.utils.data.default_collate(rows))
    loop = plain_loop(bert(), batches, [GLOBAL] * len(batches)).state_dict()
    assert _max_diff(p0, loop) <= 1e-5


def test_ranks_given_different_batches_train_them_as_shares_of_one_global_batch(ranks):
    (r0, r1), out = ranks
    assert [a[:3] for a in r0["halves"]["attempts"]] == [a[:3] for a in r1["halves"]["attempts"]] \
        == [a[:3] for a in r0["oom"]["attempts"]]
    p0 = _load(out, "halves", 0)
    assert _equal(p0, _load(out, "halves", 1))
    assert _max_diff(p0, _load(out, "oom", 0)) <= 1e-6  # the same global batches, given per rank


def test_data_that_cannot_be_told_apart_is_refused_on_every_rank(ranks):
    (r0, r1), _ = ranks
    for seen in (r0, r1):
        assert seen["mixed"]["error"] == "ValueError"
        assert seen["mixed"]["message"].startswith("some ranks' data has a DistributedSampler and some has not")
        assert seen["datasets"]["error"] == "ValueError"
        assert seen["datasets"]["message"].startswith("the ranks' Datasets differ")


PHASES = {"first batch": "Boom: first batch", "eval data check": "Boom: eval data",
          "device": "ValueError: ", "model": "", "optimizer": "Boom: optimizer factory",
          "scheduler": "Boom: scheduler factory",
          "scheduler step 1 (after the step agreement)": "Boom: scheduler step 1",
          "last scheduler step": "Boom: scheduler step 2", "evaluation": "MetricError: "}


@pytest.mark.parametrize("phase", PHASES)
def test_an_error_at_any_phase_on_one_rank_ends_every_rank_promptly(ranks, phase):
    (r0, r1), _ = ranks
    mine, other = r1["phases"][phase], r0["phases"][phase]
    assert max(mine["seconds"], other["seconds"]) < SLOWEST_ERROR_EXIT
    if phase == "model":  # a different model on rank 1: refused on both at the first agreement
        for seen in (mine, other):
            assert seen["error"] == "LockstepError"
            assert seen["message"].startswith("the ranks' models differ"), seen["message"]
        return
    assert other["error"] == "RankFailed", other
    assert other["message"].startswith(f"rank 1 failed with {PHASES[phase]}"), other["message"]
    assert mine["error"] != "RankFailed" and mine["error"] in PHASES[phase] + "Boom", mine


def test_a_layer_that_communicates_in_forward_is_refused(ranks):
    (r0, r1), _ = ranks
    for seen in (r0, r1):
        assert seen["syncbn"]["error"] == "ValueError"
        assert seen["syncbn"]["message"].startswith("net.1 is a SyncBatchNorm, which communicates with the "
                                                    "other ranks inside forward")


def test_does_not_fit_is_raised_on_the_rank_that_does_not_fit(ranks):
    from autofit.sizes import format_size
    (r0, r1), _ = ranks
    assert r1["tiny"]["error"] == "DoesNotFit"
    assert f"simulated GPU ({format_size(r1['tiny']['budget'])})" in r1["tiny"]["message"]
    assert r0["tiny"]["error"] == "RankFailed"
    assert r0["tiny"]["message"].startswith("rank 1 failed with DoesNotFit: no plan can fit")


def test_evaluation_splits_the_data_across_ranks_with_the_same_global_mean(ranks):
    import autofit
    from reference import bert, cls_batches
    (r0, r1), out = ranks
    model = bert()
    model.load_state_dict(_load(out, "eval", 0))

    def accuracy(output, batch):
        return {"accuracy": (output.logits.argmax(-1) == batch["labels"]).float().mean()}
    for scenario, data in (("eval", cls_batches(3, rows=GLOBAL)), ("eval_dataset", _Samples())):
        whole = autofit.evaluate(model, data, metric_fn=accuracy, batch_size=1000)
        assert (r0[scenario]["rows"], r1[scenario]["rows"]) == (whole.samples // 2, whole.samples // 2)
        for seen in (r0, r1):
            (record,) = seen[scenario]["history"]
            assert record["samples"] == whole.samples
            assert abs(record["loss"] - whole.loss) <= 1e-6
            assert abs(record["accuracy"] - whole.metrics["accuracy"]) <= 1e-6
        assert r0[scenario]["history"] == r1[scenario]["history"]


def test_an_oom_at_sampled_allocations_of_one_rank_is_recovered_or_announced(ranks):
    (r0, r1), _ = ranks
    kinds = []
    for mine, other in zip(r1["faults"], r0["faults"]):
        assert max(mine["seconds"], other["seconds"]) < SLOWEST_ERROR_EXIT
        if "value" in mine:  # a step's OOM (replayed) or evaluation's (halved): the same attempts
            assert other["value"] == mine["value"]
            kinds.append("recovered")
        else:
            assert mine["error"] == "OutOfMemoryError" and other["error"] == "RankFailed", (mine, other)
            assert other["message"].startswith("rank 1 failed with OutOfMemoryError")
            kinds.append("announced")
    assert "recovered" in kinds  # some position fell in a step, which both ranks replayed
