"""autofit.stepper: one OOM-proof global step in the user's own loop, equal to a plain loop."""

import json

import pytest
import torch

import autofit
import stepper_ranks
from spawn import spawn_ranks
from autofit.plans.ladder import checkpointing, offload_optimizer
from autofit.plans.plan import Plan
from reference import bert, cls_batches, max_diff, model_bytes, second_step_peak, storage_bytes
from autofit.engine.checkpointing import hf_checkpointing_state


def halve(plan):
    return plan.replace(micro_batch_size=plan.micro_batch_size // 2) if plan.micro_batch_size > 1 else None


def plain(model, batches, micro_sizes, opt, sched=None, max_norm=None):
    """A plain loop: split, weight by rows, accumulate, clip the whole gradient, one step per batch.
    Returns the gradient norms (before clipping)."""
    norms = []
    model.train()
    for batch, micro in zip(batches, micro_sizes):
        n = len(batch["labels"])
        for i in range(0, n, micro):
            part = {k: v[i:i + micro] for k, v in batch.items()}
            (model(**part).loss * (len(part["labels"]) / n)).backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
    return norms


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)


def test_an_injected_oom_is_replayed_and_the_result_equals_the_plain_loop():
    batches = cls_batches(3, rows=8)
    model = bert()
    opt = sgd(model.parameters())
    sched = warmup(opt)
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)  # the first allocation of the first step
        with autofit.stepper(model, opt, scheduler=sched, precision="fp32", ladder=halve) as step:
            outs = [step(b) for b in batches]
    assert [[(a.step, a.plan.micro_batch_size, a.outcome) for a in o.attempts] for o in outs] == [
        [(0, 8, "oom"), (0, 4, "ok")], [(1, 6, "ok")], [(2, 7, "ok")]]  # then searches upward
    assert [(a.step, a.outcome) for a in step.attempts] == [(0, "oom"), (0, "ok"), (1, "ok"), (2, "ok")]
    assert step.plan == outs[-1].plan == Plan.for_batch(8, 7)
    assert all(isinstance(o.loss, float) and o.grad_norm is None for o in outs)
    assert sched.last_epoch == 3  # once per global batch, never for the failed attempt
    reference = bert()
    ref_opt = sgd(reference.parameters())
    plain(reference, batches, [o.plan.micro_batch_size for o in outs], ref_opt, warmup(ref_opt))
    assert max_diff(model, reference) == 0.0
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


@pytest.mark.slow
def test_factories_and_a_budget_step_down_then_a_resumed_job_makes_no_oom_attempt():
    batches = cls_batches(4, rows=16, seq=16)
    p16 = second_step_peak(bert(), batches[0], Plan(16))
    p8 = second_step_peak(bert(), batches[0], Plan.for_batch(16, 8))
    budget = (p8 + p16) // 2
    job = dict(budget=budget, precision="fp32", capacity_check=False, cache=False)
    model = bert()
    with autofit.stepper(model, torch.optim.AdamW, scheduler=warmup, **job) as step:
        outs = [step(b) for b in batches[:2]]
        saved = json.loads(json.dumps(step.state_dict()))  # plain JSON types
    assert [(a.step, a.plan.micro_batch_size, a.outcome) for a in step.attempts] == [
        (0, 16, "ok"), (1, 16, "oom"), (1, 8, "ok")]  # 16 fits until AdamW's state exists
    assert saved["plan"] == Plan.for_batch(16, 8).to_dict()
    # The job resumes from a checkpoint: weights, optimizer and the stepper's state.
    resumed = bert()
    resumed.load_state_dict(model.state_dict())
    with autofit.stepper(resumed, torch.optim.AdamW, scheduler=warmup, **job) as again:
        again.load_state_dict(saved)
        assert again.plan == Plan.for_batch(16, 8)
        kept = again.state_dict()  # a checkpoint taken before the first batch keeps what was proven
        assert kept["plan"] == saved["plan"] and kept["sizes"]["fits"] == saved["sizes"]["fits"]
        more = [again(b) for b in batches[2:]]
    # Settled: neither the size that failed (16) nor a probe between 8 and 16 (12) is tried.
    assert [(a.step, a.plan.micro_batch_size, a.outcome) for a in again.attempts] == [(0, 8, "ok"), (1, 8, "ok")]
    assert again.attempts[0].reason.startswith("resumed")
    assert [o.plan.micro_batch_size for o in outs + more] == [16, 8, 8, 8]


@pytest.mark.parametrize("offload", [False, True])
def test_clipping_equals_a_plain_loop_clipping_the_accumulated_gradient(offload):
    batches = cls_batches(3, rows=8)
    model = bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    move = (offload_optimizer() | halve) if offload else halve
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)
        with autofit.stepper(model, opt, precision="fp32", ladder=move, max_grad_norm=0.15) as step:
            outs = [step(b) for b in batches]
        # Leaving the block leaves the optimizer its state: on the host when it was offloaded.
        assert len(opt.state) == len(list(model.parameters()))
        assert [gpu.holds(s["exp_avg"]) for s in opt.state.values()] == [not offload] * len(opt.state)
    assert [o.plan.offload_optimizer for o in outs] == [offload] * 3
    reference = bert()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    norms = plain(reference, batches, [o.plan.micro_batch_size for o in outs], ref_opt, max_norm=0.15)
    assert [o.grad_norm for o in outs] == norms
    assert min(norms) > 0.15  # the clipping did act
    assert max_diff(model, reference) == 0.0


def test_clipping_under_fp16_unscales_first():
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model = make()
    reference = make()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    with autofit.stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                         precision="fp16", max_grad_norm=0.1, cache=False) as step:
        outs = [step(b) for b in batches]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    norms = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(reference, (x, y))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1).item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    assert [o.grad_norm for o in outs] == norms
    assert min(norms) > 0.1
    assert max_diff(model, reference) == 0.0


@pytest.mark.parametrize("budget", ["1GiB", None], ids=["guarded", "unguarded"])
def test_an_oom_while_clipping_is_replayed_with_nothing_to_roll_back(monkeypatch, budget):
    """Clipping runs before the optimizer step: nothing is applied when it runs out of memory, so
    the global batch is replayed whether or not the step would have been guarded (on a CPU without
    a budget it is not: an OOM inside the step there stops the run)."""
    batches = cls_batches(2, rows=8)
    clip = torch.nn.utils.clip_grad_norm_
    calls = []

    def clip_once_failing(params, max_norm):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (test)")
        return clip(params, max_norm)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_once_failing)
    model = bert()
    with autofit.stepper(model, torch.optim.AdamW(model.parameters()), precision="fp32", ladder=halve,
                         max_grad_norm=1.0, cache=False, budget=budget) as step:
        outs = [step(b) for b in batches]
    first = outs[0].attempts[0]
    assert (first.outcome, first.where) == ("oom", "optimizer.step")
    assert first.error == "CUDA out of memory. Tried to allocate 2.00 MiB (test)"
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    reference = bert()
    plain(reference, batches, [o.plan.micro_batch_size for o in outs],
          torch.optim.AdamW(reference.parameters()), max_norm=1.0)
    assert max_diff(model, reference) == 0.0


def test_leaving_the_block_hands_everything_back():
    batches = cls_batches(2, rows=8)
    model = bert()
    model.eval()
    opt = torch.optim.AdamW(model.parameters())
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)
        with autofit.stepper(model, opt, precision="fp32", ladder=checkpointing()) as step:
            assert model.training
            for b in batches:
                step(b)
            assert hf_checkpointing_state(model)
        assert step.plan.checkpointing
        assert not hf_checkpointing_state(model) and not model.training
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and gpu.holds(t)]
        assert len(state) == 2 * len(list(model.parameters()))  # exp_avg, exp_avg_sq
        assert gpu.memory_allocated() == model_bytes(model) + storage_bytes(state)
    with pytest.raises(RuntimeError, match="this stepper's block has ended"):
        step(batches[0])


def test_an_error_in_the_users_loop_still_hands_everything_back():
    model = bert()
    with autofit.simulate_gpu() as gpu:
        with pytest.raises(KeyError):
            with autofit.stepper(model, lambda p: torch.optim.AdamW(p), precision="fp32") as step:
                step(cls_batches(1, rows=8)[0])
                raise KeyError("the user's own loop failed")
        # A factory's optimizer keeps its state for a checkpoint, on the host: the device holds
        # the model alone, as before the block.
        state = [v for s in step.optimizer.state.values() for v in s.values() if v.dim() > 0]
        assert len(state) == 2 * len(list(model.parameters()))
        assert not any(gpu.holds(v) for v in state)
        assert gpu.memory_allocated() == model_bytes(model)


@pytest.mark.parametrize("kwargs, error, text", [
    ({"max_grad_norm": 0}, ValueError, "max_grad_norm must be a positive number (or None: no clipping) but got 0"),
    ({"max_grad_norm": float("nan")}, ValueError, "but got nan"),
    ({"precision": "fp8"}, ValueError, "'fp8'"),
    ({"scheduler": 3}, TypeError, "scheduler must be a learning-rate scheduler"),
    ({"optimizer": "adam"}, TypeError, "got str"),
])
def test_bad_input_is_refused(kwargs, error, text):
    model = bert()
    kwargs = {"optimizer": torch.optim.AdamW(model.parameters()), **kwargs}
    with pytest.raises(error) as info:
        with autofit.stepper(model, **kwargs):
            pass
    assert text in str(info.value)


def test_a_scheduler_of_another_optimizer_and_a_foreign_state_dict_are_refused():
    model = bert()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="built on another optimizer"):
        with autofit.stepper(model, torch.optim.AdamW(model.parameters()), scheduler=warmup(other)):
            pass
    with autofit.stepper(model, other) as step:
        with pytest.raises(ValueError, match="not a stepper state_dict"):
            step.load_state_dict({"plan": 3})


def test_run_clips_the_global_gradient_and_reports_its_norm():
    batches = cls_batches(3, rows=8)
    model = bert()
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)
        result = autofit.run(model, batches, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                             precision="fp32", ladder=halve, max_grad_norm=0.15, progress=False)
    micro = [h["plan"].micro_batch_size for h in result.history]
    assert micro == [4, 6, 7]
    reference = bert()
    norms = plain(reference, batches, micro, torch.optim.AdamW(reference.parameters(), lr=1e-2), max_norm=0.15)
    assert [h["grad_norm"] for h in result.history] == norms and min(norms) > 0.15
    assert max_diff(model, reference) == 0.0


# -- torch.distributed: two gloo ranks, the same lockstep as run ----------------------------------

@pytest.mark.slow
def test_the_stepper_under_ddp_keeps_every_rank_in_lockstep_and_clips_the_reduced_gradient(tmp_path):
    codes, killed = spawn_ranks(stepper_ranks.worker, lambda r: (r, str(tmp_path / "init"), str(tmp_path)), 2, 180)
    assert codes == [0, 0] and not killed
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1]  # the same attempts, losses and norms on both ranks
    assert seen[0]["attempts"] == [[0, 4, False, "oom"], [0, 2, False, "ok"], [1, 3, False, "ok"]]  # 4 rows per rank
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    expected, norms = stepper_ranks.split_loop([2, 3])
    assert seen[0]["norms"] == norms and min(norms) > 0.15
    for state in states:
        assert all(torch.equal(state[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_the_stepper_under_ddp_offloads_the_users_optimizer_on_every_rank_with_its_scheduler(tmp_path):
    """Offloaded on both ranks from the first step: the StepLR reaches every update, the optimizer
    keeps its state, and the parameters equal the single-process loop bit for bit."""
    codes, killed = spawn_ranks(stepper_ranks.worker,
                                lambda r: (r, str(tmp_path / "init"), str(tmp_path), True), 2, 180)
    assert codes == [0, 0] and not killed
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1]
    assert seen[0]["attempts"] == [[0, 4, False, "oom"], [0, 4, True, "ok"], [1, 4, True, "ok"]]
    assert seen[0]["state"] == 4
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    expected, norms = stepper_ranks.split_loop([4, 4], scheduler=stepper_ranks.decay, copied=True)
    assert seen[0]["norms"] == norms
    for state in states:
        assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_an_unguarded_step_that_fails_half_way_stops_instead_of_being_replayed_on_top_of_itself():
    class HalfWay(torch.optim.AdamW):
        """Applies its update, then runs out of memory (foreach AdamW's failure mode)."""

        def step(self, closure=None):
            super().step(closure)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (test)")
    model = bert()
    # No budget on a CPU: the free memory is unknown, so the step runs without a snapshot.
    with pytest.raises(autofit.errors.PartialUpdateError, match="cannot be undone"):
        with autofit.stepper(model, HalfWay(model.parameters()), precision="fp32", ladder=halve,
                             cache=False) as step:
            step(cls_batches(1, rows=8)[0])
    assert step.attempts == []  # not taken for an OOM: no step-down, no replay


def test_a_scheduler_built_by_a_factory_is_reachable_after_the_block_and_the_run():
    """Its state is what resumes the schedule: step.scheduler and RunResult.scheduler keep it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = [{"x": torch.randn(8, 4)} for _ in range(3)]

    def loss_fn(m, b):
        return m(b["x"]).pow(2).mean()

    def schedule(opt):
        return torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

    with autofit.stepper(model, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn, scheduler=schedule,
                         cache=False) as step:
        for b in data:
            step(b)
    assert isinstance(step.scheduler, torch.optim.lr_scheduler.StepLR)
    assert step.scheduler.optimizer is step.optimizer
    assert (step.scheduler.state_dict()["last_epoch"], step.scheduler.get_last_lr()) == (3, [0.1 * 0.5 ** 3])
    result = autofit.run(model, data, loss_fn=loss_fn, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                         scheduler=schedule, progress=False, cache=False)
    assert result.scheduler.optimizer is result.optimizer
    assert result.scheduler.state_dict()["last_epoch"] == 3
