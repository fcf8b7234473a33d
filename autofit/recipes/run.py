"""autofit.run: train a model for some epochs, fitting every global batch to the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autofit.engine.controller import Attempt
from autofit.engine.interfaces import Data, MetricFn
from autofit.recipes.eval_data import check_eval_data
from autofit.engine.inputs import check_splittable, global_batches
from autofit.engine.inputs import check_optimizer
from autofit.engine.inputs import check_positive_int as _check_positive_int
from autofit.plans.plan import Plan
from autofit.recipes.options import Options, check_model, keywords
from autofit.recipes.training import Training
from autofit.tuning.tune import tune_for_run
from autofit.tuning.options import TuneOptions, run_options


@dataclass
class RunResult:
    plan: Plan
    attempts: list[Attempt] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    eval_history: list[dict] = field(default_factory=list)
    device: str = ""
    budget: int | None = None                                 # bytes, when one was enforced
    eval_attempts: list = field(default_factory=list)         # list[autofit.recipes.evaluate.EvalAttempt]
    leaks: list = field(default_factory=list)  # autofit.diagnosis.leaks findings: {"kind", "culprit", "bytes", "fix"}
    tune: object = None  # autofit.TuneResult when run(..., tune=...) measured the plans first
    batch_coupled: list = field(default_factory=list)  # names of modules a split changes (BatchNorm)
    # The optimizer trained (the one given, or built from the factory), with its state: save its
    # state_dict() to resume. Offloaded state stays in host memory.
    optimizer: object = None
    # The LR scheduler stepped (the one given, or built from the factory; None without one): its
    # state_dict() resumes the schedule.
    scheduler: object = None
    # The run's peaks on the device, in bytes (0 where nothing is counted: the plain CPU): the
    # largest allocated and reserved through every window autofit measured. The device's own
    # counter reads the same allocated peak after the run (gpu/peaks).
    peak_allocated: int = 0
    peak_reserved: int = 0

    @property
    def oom_attempts(self) -> int:
        return sum(a.outcome == "oom" for a in self.attempts)


def run(model: torch.nn.Module, data: Data, *, epochs: int = 1, batch_size: int | None = None,
        eval_data: Data | None = None, metric_fn: MetricFn | None = None, tune: bool | dict = False,
        **options: object) -> RunResult:
    """Train `model` in place on `data`, stepping down the plan whenever a global batch runs out of
    memory and replaying it, so the result is the same mathematics as a plain loop.

    With a budget (or on CUDA) and the default ladder, `capacity_check` estimates plans on fake
    tensors first and starts from the fastest one predicted to fit; `capacity_check=False` starts
    from the whole global batch and lets the ladder find the plan.

    `max_grad_norm` clips the gradient accumulated over the whole global batch (after unscaling
    under fp16, after the all-reduce under DDP) before each optimizer step; each history entry's
    "grad_norm" is its norm before clipping (None without clipping).

    Under torch.distributed (e.g. torchrun) every rank calls `run`, each with its own share of the
    data (a DataLoader with a DistributedSampler; autofit calls its set_epoch each epoch) or all
    with the same global batches; each rank trains its share of every global batch, and all ranks
    keep the same plan (see autofit.distributed.lockstep). A model sharded with FSDP2's `fully_shard`
    is trained as it is (each rank steps its shards); `shard=True` applies fully_shard to each
    transformer block and the root first (autofit.distributed.fsdp; pass an optimizer factory).

    `allow_split=False` never splits a global batch into micro-batches (what a model with
    BatchNorm needs to compute exactly what a full-batch loop computes); when no whole-batch plan
    fits, DoesNotFit says so. A model with batch-coupled layers (autofit.plans.coupling) walks a ladder
    that keeps the batch whole first either way.

    The options besides `epochs`, `batch_size`, `eval_data`, `metric_fn` and `tune` are the fields of
    `autofit.recipes.options.Options`, shared with autofit.stepper.

    `batch_dim` says where the rows of the data's batches are when not along dimension 0 (1 for
    time-first batches, or a dict per field; autofit.engine.layout); the loss_fn, the model and
    metric_fn see batches as the data gives them.
    """
    _check_positive_int("epochs", epochs)
    tune_options = None
    if tune is not False:  # True or a dict of autofit.tune options; checked before any work
        tune_options = run_options(tune)
    check_model(model)
    job = Options.of("autofit.run", options)
    tuning = None if tune_options is None else \
        TuneOptions(**tune_options, precision=job.precision, loss_fn=job.loss_fn, cache=job.cache)
    check_optimizer(job.optimizer)
    # The lockstep opens here, before the data is read: every failure after this is announced.
    training = Training(model, job)
    if not training.layout.row_first and (tuning is not None or batch_size is not None):
        raise ValueError(f"batch_dim={job.batch_dim!r} needs data given as batches laid out that way, "
                         f"trained as given: not with batch_size= (a Dataset's samples are collated rows "
                         f"first) nor tune= (it measures row-first batches); give a DataLoader or a list "
                         f"of batches and no tune=.")
    with training.lockstep.scope():
        return _run(training, data, epochs=epochs, batch_size=batch_size, eval_data=eval_data,
                    metric_fn=metric_fn, tuning=tuning)


keywords(run)


def _run(training, data, *, epochs, batch_size, eval_data, metric_fn, tuning: TuneOptions | None):
    first, epoch_batches = global_batches(data, batch_size, epochs)
    check_splittable(training.layout.rows_first(first), data)
    progress = training.progress
    if tuning is not None and training.distributed:
        raise ValueError("tune= runs in one process; call autofit.tune(...) before torch.distributed "
                         "starts, and every rank of autofit.run starts from the cached plan.")
    if eval_data is not None:  # a wrong field or a one-shot iterator fails now, not after an epoch
        eval_data = check_eval_data(eval_data, expect_like=first, epochs=epochs)

    with training:
        tuned = None
        if tuning is not None:
            tuned = tune_for_run(tuning, device=training.device, model=training.model,
                                 optimizer=training.optimizer, data=data, first=first,
                                 epoch_batches=epoch_batches)
        training.start(first, data=data, tuned=tuned, batch_size=batch_size)
        epoch_batches = training.lockstep.epochs(epoch_batches)  # a DistributedSampler's set_epoch
        result = RunResult(plan=training.plan, device=training.device.describe(), optimizer=training.optimizer,
                           scheduler=training.scheduler, budget=training.device.budget, tune=tuned,
                           batch_coupled=list(training.coupling.names))

        def evaluation(epoch):
            done = training.evaluate(eval_data, metric_fn=metric_fn, expect_like=first, progress=progress)
            result.eval_attempts.extend(done.attempts)
            result.eval_history.append(done.record(epoch))
        try:
            _train(training, epoch_batches, epochs, result, progress,
                   evaluation if eval_data is not None else None)
        finally:
            result.attempts = training.attempts
            result.plan = training.plan
            result.peak_allocated, result.peak_reserved = training.device.run_peaks()
    result.leaks = training.findings
    return result


def _train(training, epoch_batches, epochs, result, progress, evaluation=None) -> None:
    for epoch in range(epochs):
        batches = epoch_batches()
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(batches, desc=f"epoch {epoch + 1}/{epochs}", leave=False)
            batches = bar
        for batch in batches:
            step = training.step
            loss = training.train(batch)
            plan = training.plan
            result.history.append({"step": step, "epoch": epoch, "loss": loss, "samples": training.lockstep.global_rows,
                                   "plan": plan, "grad_norm": training.runner.grad_norm})
            if bar is not None:
                # shown at tqdm's own refresh rate: a forced redraw per step costs every step
                bar.set_postfix_str(f"loss {loss:.4f} | {plan.describe()}", refresh=False)
        if bar is not None:
            bar.close()
        if evaluation is not None:
            evaluation(epoch)
