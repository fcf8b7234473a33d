"""autofit.run: train a model for some epochs, fitting every global batch to the device."""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass, field

import torch

from .batches import batch_size as rows_of
from .batches import dataset_batches, peek, token_counter
from .controller import Attempt, Controller
from .device import open_device
from .distributed import DistributedStepRunner, open_lockstep
from .errors import DoesNotFit
from .eval_data import check_eval_data
from .evaluate import EVAL_START_FACTOR, EvalSizer, evaluate
from .ladder import SizeLog, as_move, default_ladder
from .leaks import LeakWatch
from .memo import Memo
from .start import SETTLE_WITHIN, estimated_start, longest_batch, tensor_budget
from .plan import PRECISIONS, Plan
from .step import StepRunner

log = logging.getLogger("autofit")

PRECISION_POLICIES = ("auto",) + PRECISIONS


@dataclass
class RunResult:
    plan: Plan
    attempts: list[Attempt] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    eval_history: list[dict] = field(default_factory=list)
    device: str = ""
    budget: int | None = None                                 # bytes, when one was enforced
    eval_attempts: list = field(default_factory=list)         # list[autofit.evaluate.EvalAttempt]
    leaks: list = field(default_factory=list)  # autofit.leaks findings: {"kind", "culprit", "bytes", "fix"}
    tune: object = None  # autofit.TuneResult when run(..., tune=...) measured the plans first

    @property
    def oom_attempts(self) -> int:
        return sum(a.outcome == "oom" for a in self.attempts)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int but got {value!r}.")


def global_batches(data, batch_size, epochs: int):
    """(first batch, a function giving each epoch's iterator); checks the data before training."""
    if isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        if batch_size is None:
            raise ValueError(f"data is a {type(data).__name__} (a map-style Dataset); pass batch_size=N, "
                             f"the global batch one optimizer step sees.")
        _check_positive_int("batch_size", batch_size)
        if len(data) == 0:
            raise ValueError(f"data is an empty {type(data).__name__}; give at least one sample.")
        loader = dataset_batches(data, batch_size)
        return next(iter(loader)), lambda: iter(loader)
    if batch_size is not None:
        raise ValueError(f"batch_size={batch_size!r} applies to a map-style Dataset, but data is a "
                         f"{type(data).__name__} that already yields batches; drop batch_size or pass "
                         f"the Dataset itself.")
    if isinstance(data, (torch.Tensor, dict)) or not hasattr(data, "__iter__"):
        raise TypeError(f"data must be a map-style Dataset or an iterable of batches (a DataLoader, a "
                        f"list of batches) but got {type(data).__name__}.")
    first, again = peek(data, epochs)
    return first, lambda: iter(again)


def build_optimizer(optimizer, model):
    if optimizer is None:
        return torch.optim.AdamW(model.parameters()), True
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, False
    if callable(optimizer):
        built = optimizer(model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(built).__name__}; it must return a "
                            f"torch.optim.Optimizer built over the parameters it is given.")
        return built, True
    raise TypeError(f"optimizer must be a torch.optim.Optimizer, a factory params -> Optimizer, or None "
                    f"but got {type(optimizer).__name__}.")


def run(model, data, *, loss_fn=None, optimizer=None, scheduler=None, epochs=1, batch_size=None,
        eval_data=None, budget=None, precision="auto", ladder=None, cache=True, progress=True,
        metric_fn=None, capacity_check=True, tune=False):
    """Train `model` in place on `data`, stepping down the plan whenever a global batch runs out of
    memory and replaying it, so the result is the same mathematics as a plain loop.

    With a budget (or on CUDA) and the default ladder, `capacity_check` estimates plans on fake
    tensors first and starts from the fastest one predicted to fit; `capacity_check=False` starts
    from the whole global batch and lets the ladder find the plan.

    Under torch.distributed (e.g. torchrun) every rank calls `run`, each with its own share of the
    data (a DataLoader with a DistributedSampler; autofit calls its set_epoch each epoch) or all
    with the same global batches; each rank trains its share of every global batch, and all ranks
    keep the same plan (see autofit.distributed).
    """
    lockstep = open_lockstep(model)  # first: every failure after this is announced to the other ranks
    with lockstep.scope() if lockstep else contextlib.nullcontext():
        return _run(model, data, loss_fn=loss_fn, optimizer=optimizer, scheduler=scheduler, epochs=epochs,
                    batch_size=batch_size, eval_data=eval_data, budget=budget, precision=precision,
                    ladder=ladder, cache=cache, progress=progress, metric_fn=metric_fn,
                    capacity_check=capacity_check, tune=tune, lockstep=lockstep)


def _run(model, data, *, loss_fn, optimizer, scheduler, epochs, batch_size, eval_data, budget, precision,
         ladder, cache, progress, metric_fn, capacity_check, tune, lockstep):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module but got {type(model).__name__}.")
    _check_positive_int("epochs", epochs)
    tune_options = None
    if tune is not False:  # True or a dict of autofit.tune options; checked before any work
        from .tuning import run_options
        tune_options = run_options(tune)
    if precision not in PRECISION_POLICIES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_POLICIES)} but got {precision!r}.")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (model, batch) -> scalar loss but got {loss_fn!r}.")
    first, epoch_batches = global_batches(data, batch_size, epochs)
    first_rows = rows_of(first)  # raises on a batch that cannot be split
    if tune_options is not None and lockstep is not None:
        raise ValueError("tune= runs in one process; call autofit.tune(...) before torch.distributed "
                         "starts, and every rank of autofit.run starts from the cached plan.")
    shard = _same
    if lockstep is not None:
        model = lockstep.module  # autofit runs the module itself (inside the user's DDP, if any)
        shard = lockstep.next_batch
        progress = progress and lockstep.rank == 0
    if eval_data is not None:  # a wrong field or a one-shot iterator fails now, not after an epoch
        eval_data = check_eval_data(eval_data, expect_like=first, epochs=epochs)
    user_ladder = None if ladder is None else as_move(ladder)

    with open_device(budget) as device:
        device.place_model(model)
        if lockstep is not None:  # the first agreement: how the data is given, rank 0's weights
            lockstep.hello(first, data, device, dataset=batch_size is not None)
            if batch_size is not None:
                lockstep.check_dataset(len(data), batch_size)
            first_rows = rows_of(lockstep.local(first))  # a plan is per rank: its rows of a global batch
            epoch_batches = lockstep.epochs(epoch_batches)
        was_training = model.training
        model.train()
        opt, own_optimizer = build_optimizer(optimizer, model)
        device.place_optimizer(opt)  # a warm optimizer's state counts against the budget
        sched = scheduler(opt) if scheduler is not None else None
        sizes = SizeLog()
        if precision == "fp16" and device.type == "cpu":
            log.info("fp16 autocast on CPU is far slower than bf16; it is honoured as asked")
        if lockstep is not None:
            lockstep.agree_budgets(device, tensor_budget)
        memo = Memo(model=model, batch=first, optimizer=opt, global_batch=first_rows,
                    precision=precision, device=lockstep.cache_view(device) if lockstep else device,
                    enabled=cache and (lockstep is None or lockstep.rank == 0))  # rank 0 owns the cache

        tuned = None
        if tune_options is not None:
            from .tuning import tune_for_run
            tuned = tune_for_run(tune_options, device=device, model=model, optimizer=opt, data=data,
                                 first=first, epoch_batches=epoch_batches, precision=precision,
                                 loss_fn=loss_fn, cache=cache)

        def choose():
            """(start plan, reason, settle_within); fills `sizes` with what is already known."""
            if tuned is not None:
                sizes.settle(tuned.plan)  # for every length
                return (tuned.plan.with_micro_batch(tuned.plan.micro_batch_size, first_rows),
                        f"tuned: fastest of {len(tuned.space)} plan(s) measured "
                        f"({tuned.samples_per_second:.1f} samples/s)", 0.0)
            recalled = memo.recall(sizes)
            if recalled is not None:
                return recalled[0], f"cached: worked for this job on {device.describe()}", 0.0
            if capacity_check and user_ladder is None:
                batch = longest_batch(data, first)
                estimated = estimated_start(model, lockstep.local(batch) if lockstep else batch, opt,
                                            loss_fn, lockstep.estimate_view(device) if lockstep else device,
                                            precision, sizes)
                if estimated is not None:
                    start, reason = estimated
                    return start.with_micro_batch(start.micro_batch_size, first_rows), reason, SETTLE_WITHIN
            return (Plan.for_batch(first_rows, precision="fp32" if precision == "auto" else precision),
                    "start: the whole global batch at once", 0.0)
        # Under torch.distributed rank 0 decides (its cache, or the smallest budget of all ranks).
        start, reason, settle_within = lockstep.agree_start(choose, sizes) if lockstep else choose()
        moves = user_ladder or default_ladder(sizes, precision, device.supports_bf16())
        count_tokens = token_counter(model) if loss_fn is None else None
        if lockstep is None:
            runner = StepRunner(model, opt, device, scheduler=sched, loss_fn=loss_fn,
                                count_tokens=count_tokens)
        else:
            runner = DistributedStepRunner(model, opt, device, lockstep=lockstep, scheduler=sched,
                                           loss_fn=loss_fn, count_tokens=count_tokens)
        controller = Controller(runner, moves, start, sizes=sizes, reason=reason, quiet=not progress,
                                settle_within=settle_within)
        result = RunResult(plan=start, device=device.describe(), budget=device.budget, tune=tuned)
        watch = LeakWatch(runner)  # batches handed over on the device; memory kept across steps
        watch.check_batch(first, data)
        sizer = EvalSizer()  # the evaluation batch that worked, kept from epoch to epoch

        def evaluation(epoch):
            share = lockstep.eval_share(eval_data) if lockstep else eval_data  # each sample on one rank
            done = evaluate(model, share, loss_fn=loss_fn, metric_fn=metric_fn, device=device,
                            sizer=sizer, expect_like=first, progress=progress,
                            start_batch_size=EVAL_START_FACTOR * controller.plan.micro_batch_size)
            if lockstep is not None:
                done = lockstep.combine_eval(done)  # the mean over every rank's share
            result.eval_attempts.extend(done.attempts)
            result.eval_history.append(done.record(epoch))
        try:
            _train(controller, epoch_batches, epochs, result, progress,
                   evaluation if eval_data is not None else None, shard, watch)
            if lockstep is not None:
                lockstep.finish()  # every rank got to the end, at the same step
            memo.remember(controller.plan, sizes, controller.attempts,
                          sum(h["samples"] for h in result.history))
        except DoesNotFit as error:
            error.leaks = watch.findings  # explain(error) names what the user's code kept
            raise
        finally:
            result.leaks = watch.findings
            runner.close()
            if not was_training:
                model.eval()
            result.attempts = controller.attempts
            result.plan = controller.plan
            if own_optimizer:
                opt.state.clear()
            # Drop this frame's references (closures share the cells) so gc can free them now.
            controller = runner = sched = watch = opt = None
            gc.collect()
            device.empty_cache()
    return result


def _same(batch):
    return batch


def _train(controller, epoch_batches, epochs, result, progress, evaluation=None, shard=_same,
           watch=None) -> None:
    step = 0
    for epoch in range(epochs):
        batches = epoch_batches()
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(batches, desc=f"epoch {epoch + 1}/{epochs}", leave=False)
            batches = bar
        for batch in batches:
            loss = controller.train(shard(batch), step)
            plan = controller.plan
            if watch is not None:
                watch.after_step(step, plan, batch)
            result.history.append({"step": step, "epoch": epoch, "loss": loss, "samples": rows_of(batch),
                                   "plan": plan})
            if bar is not None:
                bar.set_postfix_str(f"loss {loss:.4f} | {plan.describe()}")
            step += 1
        if bar is not None:
            bar.close()
        if evaluation is not None:
            evaluation(epoch)
