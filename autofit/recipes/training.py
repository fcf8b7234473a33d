"""The setup one training job needs, shared by `autofit.run` and `autofit.stepper`.
Setup, start, each global batch and cleanup are one object's life and share its
state; the parts that stand alone live in their own modules: options, layout, kept, the lockstep.

setup (`Training.__enter__`): the device and its budget, the lockstep under torch.distributed, the
model placed and in train mode, the optimizer and scheduler built; start (`start(first)`, with the
first global batch): the plan cache, the start plan (recipes/starts: resumed, tuned, cached,
estimated, or the whole batch), the step runner and the controller; each global batch
(`train(batch)`); cleanup (`__exit__`): the last agreement and the cache written after a clean
end, then the model, optimizer and device handed back as a plain loop would leave them
(checkpointing switches off, the optimizer with its state, offloaded state in host memory, the
budget restored). A single process has no lockstep to keep: `Local` has `distributed.Lockstep`'s
interface and agrees with itself, so the recipe reads the same with one rank or many.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch

from autofit.engine.batches import rows_of
from autofit.engine.controller import Controller, Policy
from autofit.engine.interfaces import Lockstep
from autofit.engine.kept import joined
from autofit.engine.layout import Layout
from autofit.plans.coupling import Coupling
from autofit.plans.reach import Reach, configurations
from autofit.engine.rules import Rules
from autofit.gpu.device import open_device
from autofit.gpu.memory import by_kind
from autofit.gpu.oom import collect
from autofit.distributed.fsdp import is_sharded, shard as shard_model, user_reshard_after_forward
from autofit.distributed.eval_lockstep import ShardedEvaluation
from autofit.distributed.local import Local
from autofit.distributed.lockstep import open_lockstep
from autofit.distributed.runner import DistributedStepRunner
from autofit.errors import DoesNotFit
from autofit.recipes.evaluate import EVAL_START_FACTOR, evaluate
from autofit.recipes.eval_sizer import EvalSizer
from autofit.engine.inputs import build_optimizer, build_scheduler
from autofit.recipes.options import Options, check_model
from autofit.engine.offload import to_host
from autofit.plans.ladder import as_move, sharded as sharded_ladder
from autofit.plans.sizelog import SizeLog
from autofit.diagnosis.leaks import LeakWatch
from autofit.integrations import accelerate
from autofit.cache.memo import Memo
from autofit.plans import precision as precisions
from autofit.plans.plan import Plan
from autofit.estimator.start import budget_caps, tensor_budget
from autofit.recipes.starts import FirstBatch, Start, first_start
from autofit.engine.step import StepRunner, Update
from autofit.engine.token_loss import loss_weighting

log = logging.getLogger("autofit")


class Training:
    """One training job: see the module's docstring. `progress` also decides step-down logging."""

    def __init__(self, model: torch.nn.Module, options: Options):
        check_model(model)
        # Where the batches' rows are; inside, every batch is row-first (engine/layout.py).
        self.layout = Layout(options.batch_dim)
        self.layout.check_model(model)
        self.options = options
        loss_fn, budget, precision, shard = options.loss_fn, options.budget, options.precision, options.shard
        loss_fn = self.layout.loss_fn(loss_fn)
        # what accelerator.prepare returned
        optimizer, scheduler = accelerate.unwrap(options.optimizer, options.scheduler)
        self.shard = shard
        lockstep = open_lockstep(model, shard=shard)  # None unless torch.distributed is initialised
        self.distributed = lockstep is not None
        self.lockstep: Lockstep = lockstep or Local(model)
        lockstep = self.lockstep
        model = lockstep.module  # under DDP the module it runs (the user's DDP's), no wrapper
        self.model, self.optimizer_given, self.scheduler_given = model, optimizer, scheduler
        self.loss_fn, self.budget, self.precision = loss_fn, budget, precision
        self.max_grad_norm, self.cache = options.max_grad_norm, options.cache
        self.progress = options.progress and lockstep.rank == 0
        self.capacity_check = options.capacity_check
        self.allow_split, self.coupling = options.allow_split, None
        self.user_ladder = None if options.ladder is None else as_move(options.ladder)
        self.sizes = SizeLog()
        self.controller = self.runner = self.watch = self.memo = self.guide = None
        self.closed = False
        self.findings: list[dict] = []  # autofit.diagnosis.leaks findings, kept after the watch is gone
        self.step = 0             # global batches trained
        self.sizer = EvalSizer()  # the evaluation batch that worked, kept from one evaluation to the next
        self.samples = 0
        self.kept = None  # the last global batch's kept outputs (engine/kept.py)

    # -- setup and cleanup ---------------------------------------------------------------------
    def __enter__(self) -> "Training":
        lockstep = self.lockstep
        self._stack = contextlib.ExitStack()
        self.device = device = self._stack.enter_context(open_device(self.budget))
        self._stack.enter_context(lockstep.scope())
        try:
            model = self.model
            if self.shard:  # before the optimizer is built: it steps the shards
                shard_model(model)
            device.place_model(model)
            self.was_training = model.training
            model.train()
            self.coupling = Coupling(model, self.allow_split)  # says so once when a split would matter
            self.optimizer, self.own_optimizer = build_optimizer(self.optimizer_given, model)
            device.place_optimizer(self.optimizer)  # a warm optimizer's state counts against the budget
            self.outside_before = self._outside()  # what the end's collection need not go below
            self.scheduler = build_scheduler(self.scheduler_given, self.optimizer)
            if device.type in getattr(precisions.REGISTRY.get(self.precision), "slow_on", ()):
                log.info("%s autocast is far slower than the other precisions on %s; it is honoured as asked",
                         self.precision, device.type)
        except BaseException:
            if not self._stack.__exit__(*sys.exc_info()):
                raise
        return self

    def start(self, first, *, data=None, tuned=None, resume=None, batch_size=None) -> None:
        """Choose the start plan from the first global batch and build the controller.
        `data` (for the longest batch the capacity check estimates, and its DistributedSampler),
        `tuned` (an autofit.TuneResult), `resume` ((plan, SizeLog) from a stepper's state_dict),
        `batch_size` (when `data` is a map-style Dataset that run batches) are optional."""
        row_first = self.layout.rows_first(first)
        rows = self._first_agreement(row_first, data, batch_size)
        self.memo = Memo(
            model=self.model, batch=row_first, optimizer=self.optimizer, global_batch=rows,
            precision=self.precision, device=self.lockstep.cache_view(self.device),
            enabled=self.cache and self.lockstep.rank == 0)  # rank 0 owns the cache
        weighting = self._loss_weighting(row_first)
        start = self._agreed_start(FirstBatch(first, row_first, rows, data, tuned, resume))
        self.runner = self._runner(weighting)
        self.controller = Controller(self.runner, self._moves(), start.plan, reason=start.reason,
                                     sizes=self.sizes, guide=self.guide,
                                     rules=self._rules(self.precision, self.device),
                                     policy=Policy(quiet=not self.progress, settle_within=start.settle_within))
        self.watch = LeakWatch(self.runner)  # batches handed over on the device; memory kept across steps
        self.watch.check_batch(row_first, data)
        self.coupling.guard()  # a recompute in backward leaves running statistics as they were

    def _first_agreement(self, first, data, batch_size) -> int:
        """How the data is given, rank 0's weights on every rank, the budgets; returns the rows a
        plan covers (per rank: the rows of a global batch it covers, the same on every rank)."""
        lockstep = self.lockstep
        lockstep.hello(first, data, self.device, dataset=batch_size is not None)
        lockstep.check_optimizer(self.optimizer)  # one that cannot step FSDP2's shards: refused on every rank
        if batch_size is not None:
            lockstep.check_dataset(len(data), batch_size)
        lockstep.agree_budgets(self.device, tensor_budget)
        return lockstep.first_shape(first)[0]

    def _loss_weighting(self, first):
        """How the loss weighs micro-batches, asked before the start is chosen (a sharded model's
        probe runs on every rank at once, agreed): a loss that couples its rows makes the job
        batch-coupled (whole-batch plans first, in the capacity check too)."""
        lockstep = self.lockstep
        call = None if lockstep.sharded is None else ShardedEvaluation(lockstep).call
        weighting = loss_weighting(self.model, lockstep.local(first), self.loss_fn, self.device,
                                   probe=lockstep.sharded is None, call=call, ask=not self.distributed)
        if weighting.coupled:
            self.coupling.loss_couples(weighting.coupled)
        return weighting

    def _agreed_start(self, asked: FirstBatch) -> Start:
        """The first answer of the start strategies (recipes/starts.py), decided by rank 0 under
        torch.distributed (its cache, or the smallest budget of all ranks), then made whole for a
        batch-coupled job and explicit about FSDP2's resharding."""
        # The agreement carries plan, reason and settle_within; the guide stays with the process
        # that chose (a single process only: ranks' agreements steer them instead).
        self.guide = None

        def choose():
            start = first_start(self, asked)
            self.guide = start.guide
            return start.plan, start.reason, start.settle_within
        plan, reason, settle_within = self.lockstep.agree_start(choose, self.sizes)
        if self.lockstep.sharded is not None and plan.reshard_after_forward is None:
            # FSDP2's setting made explicit (the model's own), so the ladder can step from it
            plan = plan.replace(reshard_after_forward=user_reshard_after_forward(self.model))
        plan, reason = self.coupling.start(plan, reason, asked.rows)
        return Start(plan, reason, settle_within)

    def _moves(self):
        """The ladder: the coupling's (whole batch first where a split changes the mathematics),
        FSDP2's own moves first for a sharded model."""
        moves = self.coupling.ladder(self.sizes, self.precision, self.device.supports_bf16(), self.user_ladder)
        if self.lockstep.sharded is not None and self.user_ladder is None:
            moves = sharded_ladder(moves)  # FSDP2's own moves first
        return moves

    def _runner(self, weighting) -> StepRunner:
        """One process's step runner, or one rank's in lockstep with the others."""
        # ranks weigh by shares; a loss_fn told num_items_in_batch counts through its weighting
        told_items = self.loss_fn is not None and weighting.pass_items
        options = dict(update=Update(self.scheduler, self.max_grad_norm), loss_fn=self.loss_fn,
                       count_tokens=None if told_items else weighting.count)
        if not self.distributed:
            return StepRunner(self.model, self.optimizer, self.device, weighting=weighting, **options)
        sharded = self.lockstep.sharded
        # A loss_fn that takes num_items_in_batch is told the global count (all ranks' shares).
        return DistributedStepRunner(self.model, self.optimizer, self.device, lockstep=self.lockstep,
                                     sync=None if sharded is None else sharded.sync,  # FSDP's gradient sync
                                     weighting=weighting if told_items else None, **options)

    def _rules(self, precision: str, device) -> Rules:
        """No split where allow_split=False forbids it, on any path; before giving up, every plan
        of autofit's own ladder's configurations (plans/reach.py), on one process (ranks walk only
        the ladder, which they agree on step by step)."""
        reach = None
        if self.user_ladder is None and not self.distributed:
            configs = configurations(precision, device.supports_bf16())
            reach = Reach(self.sizes, configs, whole=not self.allow_split, restart=True)
        return Rules(refuse=self.coupling.refuses, reach=reach, forget=self.coupling.forget)

    @property
    def plan(self) -> Plan | None:
        return None if self.controller is None else self.controller.plan

    @property
    def attempts(self) -> list:
        return [] if self.controller is None else self.controller.attempts

    def train(self, batch) -> float:
        """Train one global batch (replayed on OOM); returns its loss. `self.kept`: the kept
        outputs the loss_fn returned for it (engine/kept.py), joined in row order, or None."""
        lockstep = self.lockstep
        batch = self.layout.rows_first(batch)
        count = self.runner.count if self.distributed else None  # weighs each rank's share
        local = lockstep.next_batch(batch, count)
        loss = self.controller.train(local, self.step, shape=lockstep.plan_shape)
        self.kept = self._kept(local)
        self.watch.after_step(self.step, self.controller.plan, batch)
        self.step += 1
        self.samples += lockstep.global_rows  # the global batch's rows, every rank's share counted
        return loss

    def _kept(self, local):
        """The successful attempt's kept outputs, joined and laid out as the batch is."""
        parts, self.runner.kept = self.runner.kept, []
        return joined(parts, self.layout, rows=rows_of(local))

    def evaluate(self, data, *, metric_fn=None, expect_like=None, progress=False):
        """autofit.evaluate on this job's device with its loss: inference mode, its own batch size
        (first EVAL_START_FACTOR training micro-batches, then what worked), never the training plan.
        A sharded model's ranks evaluate in lockstep (autofit.distributed.eval_lockstep)."""
        pace = None
        if is_sharded(self.model):
            if self.lockstep.sharded is None:  # the same on every rank, before any collective
                raise ValueError(f"evaluation of a model sharded with fully_shard ({type(self.model).__name__}) "
                                 "needs the ranks' first agreement, made by the first training step; "
                                 "call step(batch) once before step.evaluate(...).")
            pace = ShardedEvaluation(self.lockstep)
        start = None if self.plan is None else EVAL_START_FACTOR * self.plan.micro_batch_size
        data = self.layout.over(data)  # row-first batches, as each rank's share is cut
        done = evaluate(self.model, self.lockstep.eval_share(data), loss_fn=self.loss_fn, layout=self.layout,
                        metric_fn=metric_fn, device=self.device, sizer=self.sizer,
                        expect_like=expect_like, progress=progress, start_batch_size=start, pace=pace)
        return self.lockstep.combine_eval(done)  # under torch.distributed: the mean of every rank's share

    def explained(self, error: DoesNotFit) -> DoesNotFit:
        """`error` saying (once) that splitting was forbidden, and what the user's code kept (for
        explain(error)): a new error, or `error` itself when there is nothing to add."""
        leaks = self.watch.findings if self.watch is not None else error.leaks
        return error.explained(self.coupling.refusal() or "", leaks)

    def __exit__(self, kind, error, traceback) -> bool:
        replaced = None
        try:
            if error is None:
                self.lockstep.finish()  # every rank got to the end, at the same step
                if self.controller is not None:
                    self.memo.remember(self.controller.plan, self.sizes, self.controller.attempts,
                                       self.samples, calibration=self.controller.guide.measured,
                                       calibrated=budget_caps(self.device))
            elif isinstance(error, DoesNotFit) and self.watch is not None:
                explained = self.explained(error)
                replaced = None if explained is error else explained
        except BaseException:
            self._close()
            if not self._stack.__exit__(*sys.exc_info()):
                raise
            return False
        self._close()
        if replaced is None:
            return self._stack.__exit__(kind, error, traceback)
        # The explained copy of the DoesNotFit replaces it, raised where the original was.
        if not self._stack.__exit__(DoesNotFit, replaced, traceback):
            raise replaced.with_traceback(traceback) from None
        return True

    def _close(self) -> None:
        """Hand the model and optimizer back as a plain loop would leave them."""
        self.closed = True
        if self.runner is not None:
            self.runner.close()
        if self.coupling is not None:
            self.coupling.close()
        self.lockstep.close()
        if not self.was_training:
            self.model.eval()
        if self.own_optimizer:
            # Built from a factory, so nothing but autofit (and RunResult.optimizer) holds it: its
            # state goes to the host, where it can be saved, and the device is left as before the
            # run (the two-phase fine-tune's second phase needs that memory). A user's own
            # instance keeps its state where a plain loop would leave it.
            to_host(self.optimizer, self.device)
        if self.watch is not None:
            self.findings = self.watch.findings
        # Drop the references to the step's objects so gc can free them now. The optimizer and
        # scheduler stay: the user saves their state_dict() to resume (a factory's are held nowhere
        # else), and the scheduler holds nothing but the optimizer.
        self.runner = self.watch = None
        if self.controller is not None:
            self.controller.close()
        if self.guide is not None:
            self.guide.estimator = None  # its fake copies of the model and optimizer
        # Collected only while the device holds more outside the model and optimizer than before
        # the run (a full collection scans every object transformers left: slow): gpu.oom.collect.
        before = getattr(self, "outside_before", None)
        collect(None if before is None else lambda: self._outside() <= before)
        self.device.empty_cache()

    def _outside(self) -> int | None:
        """Device bytes held outside the model's parameters, buffers and gradients and the
        optimizer's state; None on a device that counts nothing."""
        if not self.device.counts:
            return None
        held = by_kind(self.device, self.model, self.optimizer)
        return self.device.memory_allocated() - held["params"] - held["grads"] - held["optimizer"]

