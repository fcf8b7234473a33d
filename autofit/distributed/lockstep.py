"""torch.distributed in lockstep: every rank runs the same plan at the same global batch, and none
can be left waiting in a collective. The protocol every rank
keeps is written down once, here; the code is split into agreement, data, decide, replicas, runner
and fsdp.

The danger is any collective that one rank reaches and another does not: DDP's gradient all-reduce
inside backward (a rank that runs out of memory in forward never reaches it), the broadcasts of
DDP's constructor (a rank that fails while building it), a layer that communicates in forward. The
others wait there until the process group times out, or gloo aborts them on a mismatch. So every
collective autofit causes comes right after an agreement that every rank reached, and autofit does
not build a DDP wrapper at all: it runs the module itself (the module inside a DDP the user gave),
broadcasts rank 0's parameters and buffers in place once every rank has arrived, and reduces the
gradients itself. This saves DDP's gradient buckets (one copy of the gradients) and makes no
collective outside an agreement. A global step on each rank is:

1. every micro-batch's forward and backward (local gradients only);
2. an **agreement**: one `all_gather` of a small CPU header (outcome, phase, step, plan hash, loss,
   whether the optimizer step may fail, which gradients exist) over a gloo group. A rank whose
   micro-steps failed joins it too, reporting OOM or an error, so every rank reaches it whatever
   happened, and every rank decides the same thing from the same table;
3. only when every rank succeeded: the gradients are summed with explicit in-place all-reduces
   (which allocate nothing, so they cannot run out of memory half-way) and rank 0's buffers
   (BatchNorm statistics) are broadcast, as DDP does, before the optimizer step: after it, a
   scheduler or `zero_grad` that fails on one rank meets the others at their next agreement;
4. with clipping or the fp16 grad scaler (autofit.distributed.clipping): each rank's local part
   (unscale, the norm of its gradients or shards), an agreement carrying its outcome and parts, then
   the gradients scaled in place: an OOM there drops the attempt on every rank, nothing applied;
5. the optimizer step, followed by a second agreement inside the atomic step: if the step ran out
   of memory on any rank, every rank restores its snapshot (taken on every rank when any rank's
   step was at risk) and the global batch is replayed. When no rank's step was at risk there is no
   snapshot (success costs nothing), so a step that fails anyway on some ranks has been applied on
   the others: every rank then raises PartialUpdateError saying that the weights now differ, which
   ranks applied the update and which failed (with what).

After an OOM on any rank, every rank raises an OOM (its own, or `PeerOutOfMemory` naming the rank)
into the same controller, which records the same attempt and takes the same step down: the ladder is
deterministic given the same history, and each agreement checks that the plans' hashes are equal.
A non-OOM error on a rank is reported through the agreement as an error code with its text; that rank
re-raises its own error, the others raise `RankFailed` naming the rank and the error. An error that
escapes outside a step (data loading, evaluation, a cache, the scheduler) is reported by a farewell:
the failing rank joins the next agreement with its error, and every run ends with a final
agreement, so the others meet it there. The lockstep opens before anything else in `run` (before
the first batch is read), so an error anywhere in `run` is announced. Ranks that run out of data at
different steps meet in different phases and all raise `LockstepError` saying how many batches each
had. A rank that dies outright closes its connections (or, stalled, is met by the process group's
timeout, which the agreement group keeps): the others then name it on evidence only (its heartbeat
stopped, the store it served closed, or alive but behind after the timeout), with where it last
was, and stop it if it still runs (autofit.distributed.presence). A step inside the user's
`ddp.no_sync()` accumulates, as the user's DDP loop would: its gradients stay local (no reduction,
no optimizer step, no scheduler step, no clipping) until the first step outside it, which reduces
the accumulated gradients and steps once.

Data comes in one of two ways, told apart at the first agreement (each rank reports whether its
loader has a `DistributedSampler` and a hash of its first batch):
- **per rank** (a `DistributedSampler`, or first batches that differ, as torchrun jobs usually give
  it): each rank's batch is its share of the global batch, which is the ranks' batches together;
  shares may differ in rows (a loader per file shard ends with a shorter batch on each rank), not
  in number. Before each global batch the ranks agree on their shares' rows, row lengths and label
  tokens; the plan covers the largest share (one plan per global batch, the same on every rank),
  and each micro-batch is weighted by its share of the whole (so a rank whose share has no label
  token trains nothing, without error, and history counts the global batch's rows). Under FSDP2
  every rank runs the plan's number of micro-batches: a smaller share repeats its first row,
  weighted 0. When autofit drives the epochs it calls `sampler.set_epoch(epoch)` before each one,
  as a plain DDP loop must.
- **the same global batches on every rank** (equal first batches, or a map-style Dataset that
  autofit batches): each rank takes rows [r*n/W, (r+1)*n/W) and weights each micro-batch by its
  share of the *global* batch (rows, or label tokens counted on the global batch), so token
  weights need no communication. A global batch must divide evenly by the world size.
In both, the ranks' gradients are summed, not averaged: the single-process formula term by term.
When the two cannot be told apart (a sampler on some ranks only, a sampler for another world, a
map-style Dataset that differs between ranks, ranks that agree in groups), `run` refuses with the
reason.

Layers that communicate inside forward (SyncBatchNorm) are refused: a rank that failed before
reaching one would leave the others waiting in it.

A model sharded with FSDP2's `fully_shard` (or by `shard=True`, autofit.distributed.fsdp) is trained
as it is: its parameters stay each rank's shards, FSDP gathers them per unit in forward and
backward and reduce-scatters the gradients (summed: autofit weights the micro-batches) in the
last micro-batch's backward, with gradient sync off before it. FSDP's collectives cannot sit
after one agreement per attempt, so there is one inside each of them (autofit.distributed.fsdp_guard):
each unit's gather in forward and in backward (and the one FSDP prefetches), each reduce-scatter,
after FSDP allocated the collective's buffers and before it runs, so nothing between the agreement
and the collective can fail. A rank that failed (that allocation included) meets the others there
at its own agreement after backward, and every rank drops the attempt; ranks that would go on into
different collectives (their FSDP states diverged) all raise LockstepError instead;
FSDP's state is put back to sharded and idle, its unsharded accumulated gradients dropped.
The agreements of a sharded run use a gloo group of their own, so they never trade data with
FSDP's collectives.

Rank 0 decides where the run starts (the cached plan, else the capacity check against the smallest
budget of all ranks) and sends the decision to the others; only rank 0 reads and writes the plan
cache. When no plan fits the smallest budget, the rank that has it raises `DoesNotFit` (naming its
own device and budget) and the others `RankFailed`.

Costs and limits: gradients are reduced one tensor at a time (no buckets: slower than DDP's
overlapped reduction, and no extra memory); buffers are broadcast from rank 0 after each agreed
backward. A DDP the user gave keeps its own buckets (made before `run`); autofit only uses its
module. With NCCL the agreement runs over a gloo group made for it (call
`torch.cuda.set_device(local_rank)` before `run`). Every rank must call `run`: a rank that never
does leaves the others waiting at the first agreement until the process group's timeout.
"""

from __future__ import annotations

import itertools
import math
import zlib

import torch

from autofit.distributed.agreement import BACKWARD, DONE, ERROR, EVALUATE, HELLO, OPTIMIZER, SHARES, STEP
from autofit.distributed.agreement import Agreement, Report, where
from autofit.distributed.decide import Deciding
from autofit.distributed.data import DATASET, ITERABLE, SAMPLED, distributed_sampler, per_rank
from autofit.distributed.data import content_hash, eval_share
from autofit.distributed import internals
from autofit.distributed.fsdp import Sharded, is_sharded
from autofit.distributed.presence import Presence
from autofit.distributed.replicas import Replicas
from autofit.engine.batches import slice_batch
from autofit.engine.batches import row_elements, rows_of
from autofit.errors import LockstepError, PartialUpdateError, PeerOutOfMemory, RankFailed
from autofit.plans.plan import Plan

# Layers that run collectives inside forward: a rank that failed before reaching one would leave the
# others waiting in it, and no agreement can come first.
COLLECTIVE_LAYERS = (torch.nn.SyncBatchNorm, torch.nn.parallel.DistributedDataParallel)


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def open_lockstep(model, *, shard: bool = False) -> "Lockstep | None":
    """The lockstep of this run, or None when torch.distributed is not initialised. `shard`: the
    run will apply fully_shard (autofit.distributed.fsdp) before training."""
    ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
    if not is_distributed():
        if ddp is not None:
            raise ValueError("model is a DistributedDataParallel but torch.distributed is not "
                             "initialised; call torch.distributed.init_process_group first.")
        if shard or is_sharded(model):
            raise ValueError(f"{'shard=True' if shard else 'a model sharded with fully_shard'} needs "
                             f"torch.distributed; call torch.distributed.init_process_group first "
                             f"(torchrun), or pass shard=False.")
        return None
    if ddp is not None and shard:
        raise ValueError("shard=True with a DistributedDataParallel model: pass the plain module "
                         "(autofit shards it) or the DDP with shard=False.")
    return Lockstep(model, ddp, sharded=shard or is_sharded(model))


def refuse_collective_layers(module) -> None:
    """Refuse a model with a layer that communicates inside forward (see COLLECTIVE_LAYERS)."""
    for name, layer in module.named_modules():
        if isinstance(layer, COLLECTIVE_LAYERS):
            raise ValueError(
                f"{name or 'the model'} is a {type(layer).__name__}, which communicates with the other "
                f"ranks inside forward: a rank that failed earlier in the step would leave the others "
                f"waiting there, and autofit cannot put that collective behind an agreement. Build the "
                f"model with torch.nn.BatchNorm* instead of SyncBatchNorm (autofit broadcasts rank 0's "
                f"running statistics after every step, as DDP does) and pass DDP only as the outermost "
                f"wrapper.")


def diverged(verdict, step: int) -> Exception:
    """The error a rank raises when an unguarded optimizer step failed on some ranks and was
    applied on the others: the ranks' weights now differ, so the run stops on every rank, each
    told which ranks applied the update and which failed (with what). PartialUpdateError, or
    RankFailed when a rank failed with another error than OOM (which that rank raises itself)."""
    failed = {r: verdict.messages[r] if verdict.messages else "an error" for r in verdict.errors + verdict.ooms}
    applied = [r for r in range(len(verdict.headers)) if r not in failed]
    shown = "; ".join(f"rank {r} failed in it ({text}), its update not applied or applied in part"
                      for r, text in sorted(failed.items()))
    text = (f"the ranks' weights now differ after global step {step}'s optimizer step: "
            f"{_ranks(applied)} applied the update; {shown}. The step was not guarded (no rank's "
            f"step was at risk: its last run under this plan fitted with room to spare), so no rank "
            f"can undo its part and the run stops on every rank; this is rank {verdict.rank}. Do not "
            f"save one rank's weights as the run's: resume every rank from the last checkpoint.")
    if verdict.errors:
        error = RankFailed(text, rank=verdict.errors[0], error=failed[verdict.errors[0]])
    else:
        error = PartialUpdateError(text)
    error.applied, error.failed = applied, failed
    return error


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Lockstep(Deciding, Agreement):
    """The agreement between the ranks of one run; see the module's docstring."""

    def __init__(self, model, ddp=None, *, sharded: bool = False):
        dist = torch.distributed
        internals.refuse_missing(sharded)  # before any agreement: a clear refusal, not a mid-step error
        self.group = ddp.process_group if ddp is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.agreement_group = self._cpu_group(separate=sharded)
        self.presence = Presence(self.rank, self.world, where)  # names a rank that stalls or dies
        self.user_ddp = ddp
        self.module = ddp.module if ddp is not None else model
        if not isinstance(self.module, torch.nn.Module):  # run refuses it, inside the lockstep's scope
            self.module = torch.nn.Module()
        # Headers carry one entry per parameter only once every rank is known to have the same model.
        self.model_hash = zlib.crc32(repr([(n, tuple(t.shape), str(t.dtype), t.requires_grad) for n, t in
                                           itertools.chain(self.module.named_parameters(),
                                                           self.module.named_buffers())]).encode())
        self.met = False
        self.step = -1
        self.global_batch = None
        self.global_rows = 0       # rows of the last global batch, over all ranks
        self.global_count = None   # its rows or label tokens over all ranks (per-rank data)
        # (rows, elements per row) the plan of the last global batch covers on every rank: the
        # largest share's with per-rank data (shares may differ in rows), else this rank's rows.
        self.plan_shape = (0, 0)
        self.per_rank = False    # each rank's batch is its share of the global batch
        self.sharded = None      # autofit.distributed.fsdp.Sharded for a fully_shard model, from hello
        self.attempt_plan = None      # the plan of the attempt under way (its agreements carry it)
        self.attempt_agreed = False   # a guard inside forward held the attempt's agreement
        self.attempt_phase = BACKWARD  # the phase its agreements carry (EVALUATE in evaluation)
        self.sampler = None      # the DistributedSampler of per-rank data, stepped each epoch
        # DDP's broadcast_buffers: on unless the user's own DDP turned it off.
        sync_buffers = ddp is None or bool(getattr(ddp, "broadcast_buffers", True))
        self.replicas = Replicas(self.module, self.group, self._global(0), sync_buffers)
        self.budget = self.cache_budget = None
        self.limits: list[int | None] = []  # each rank's budget for tensors

    @property
    def mask_size(self) -> int:
        return len(self.replicas.params)

    # -- the run's milestones ------------------------------------------------------------------
    def hello(self, first, data, device, *, dataset: bool):
        """The first agreement: every rank has read its first batch and placed the model. Decides how
        the data is given (see the module's docstring), then copies rank 0's replicated parameters
        and buffers to every rank in place (what DDP's constructor does, here behind an agreement;
        FSDP's shards stay each rank's own)."""
        self._host = device.host
        refuse_collective_layers(self.module)
        self.replicas.refresh()  # shard=True made DTensors of the parameters since the lockstep opened
        self.sharded = Sharded(self.module) if is_sharded(self.module) else None
        if self.sharded is not None:
            self.sharded.guard(self._before_collective)
        self.sampler = None if dataset else distributed_sampler(data)
        if self.sampler is not None and (self.sampler.num_replicas, self.sampler.rank) != (self.world, self.rank):
            raise ValueError(f"the DataLoader's DistributedSampler is for rank {self.sampler.rank} of "
                             f"{self.sampler.num_replicas}, but this is rank {self.rank} of {self.world}; "
                             f"build it with the default num_replicas and rank.")
        kind = DATASET if dataset else SAMPLED if self.sampler is not None else ITERABLE
        with self._host():
            digest = float(content_hash(first))
        verdict = self.agree(HELLO, value=digest, value2=float(kind), host=self._host)
        self.met = True  # every rank has this model: headers may carry per-parameter entries
        self.per_rank = per_rank({int(k) for k in verdict.values("value2")}, verdict.values(), self.world)
        if self.per_rank:  # the first global batch's shape, which the start plan covers
            self.plan_shape = self._agree_shape(SHARES, first)
        self.replicas.broadcast_from_rank0()
        return self.module

    def first_shape(self, first) -> tuple[int, int]:
        """(rows, elements per row) the start plan covers: see `plan_shape`."""
        if self.per_rank:
            return self.plan_shape
        mine = self.local(first)
        return rows_of(mine), row_elements(mine)

    def _agree_shape(self, phase: int, mine, count=None) -> tuple[int, int]:
        """With per-rank data: the largest share's rows and row length over all ranks (a plan per
        global batch, the same on every rank, covering every rank's share), after an agreement
        that also sums the shares' rows and `count`s (label tokens) into `global_rows` and
        `global_count`."""
        failure, counted, length = None, 0.0, 0.0
        try:
            with self._host():
                counted = float(count(mine)) if count is not None else 0.0
                length = float(row_elements(mine))
        except Exception as error:
            failure = error
        verdict = self.agree(phase, failure, value=float(rows_of(mine)), value2=counted, value3=length,
                             host=self._host)
        self.global_rows = int(math.fsum(verdict.values()))
        self.global_count = math.fsum(verdict.values("value2"))
        return int(max(verdict.values())), int(max(verdict.values("value3")))


    def check_optimizer(self, optimizer) -> None:
        """Refuse, on every rank before the first step, an optimizer that cannot step this model's
        shards (autofit.distributed.shard_step: found by trying)."""
        if self.sharded is None:
            return
        from autofit.distributed.shard_step import sharded_step_problem
        failure = None
        try:
            with self._host():
                problem = sharded_step_problem(optimizer, self.module)
            if problem is not None:
                failure = ValueError(problem)
        except Exception as error:
            failure = error
        self.agree(OPTIMIZER, failure, host=self._host)

    def epochs(self, epoch_batches):
        """`epoch_batches` that first calls `sampler.set_epoch(k)` for the k-th epoch, as a plain
        DDP loop must (a DistributedSampler shuffles by its epoch)."""
        sampler = self.sampler
        if sampler is None:
            return epoch_batches
        count = itertools.count()

        def again():
            sampler.set_epoch(next(count))
            return epoch_batches()
        return again

    def local(self, batch):
        """This rank's rows of a global batch (the batch itself when each rank gives its share)."""
        if self.per_rank:
            return batch
        n = rows_of(batch)
        if n % self.world:
            raise ValueError(f"global batch {n} cannot be split evenly over {self.world} ranks; give "
                             f"global batches divisible by the world size (batch_size a multiple of "
                             f"{self.world}, and drop_last=True or a dataset length to match).")
        per = n // self.world
        return slice_batch(batch, self.rank * per, (self.rank + 1) * per)

    def accumulating(self) -> bool:
        """Whether this step runs inside the user's `ddp.no_sync()` (DDP's
        `require_backward_grad_sync` is False there): its gradients are accumulated, as the user's
        DDP loop would, and reduced and stepped on at the first step outside it."""
        ddp = self.user_ddp
        return ddp is not None and not getattr(ddp, "require_backward_grad_sync", True)

    def accumulated(self, verdict) -> bool:
        """After the agreement of a successful backward: True when every rank is inside no_sync
        (the step ends there), False when none is; refused when the ranks differ, as DDP would
        leave the reducing ranks waiting."""
        inside = {bool(v) for v in verdict.values("value3")}
        if len(inside) > 1:
            ranks = [r for r, v in enumerate(verdict.values("value3")) if v]
            raise LockstepError(f"at global step {self.step}, ranks {', '.join(map(str, ranks))} stepped "
                                f"inside ddp.no_sync() and the others outside it; enter no_sync() on "
                                f"every rank alike.")
        return inside == {True}

    def check_dataset(self, length: int, batch_size: int) -> None:
        """Fail before training when some global batch of a map-style Dataset cannot be split."""
        if self.per_rank:
            return
        for n in {batch_size, length % batch_size} - {0}:
            if n % self.world:
                raise ValueError(f"a Dataset of {length} samples in global batches of {batch_size} "
                                 f"has a batch of {n}, which cannot be split evenly over {self.world} "
                                 f"ranks; make batch_size and the last batch multiples of "
                                 f"{self.world} (e.g. trim the dataset).")

    def next_batch(self, batch, count=rows_of):
        """The next global batch: remembered for weighting, this rank's rows returned, `plan_shape`
        set. With per-rank data every rank reports its share's `count` (rows, or label tokens), rows
        and row length, so micro-batches are weighted by their share of the whole global batch (a
        rank whose share has no label token is not an error when the others have some), the
        global batch's rows are known, and the plan covers the largest share on every rank."""
        self.step += 1
        self.global_batch = batch
        mine = self.local(batch)
        if not self.per_rank:
            self.global_rows = rows_of(batch)
            self.plan_shape = (rows_of(mine), row_elements(mine))
            return mine
        self.plan_shape = self._agree_shape(SHARES, mine, count)
        if self.global_count == 0:
            raise ValueError(f"global batch {self.step} has no label token to learn from on any rank "
                             f"(every label is -100); drop such batches or check the labels.")
        return mine

    # -- evaluation ----------------------------------------------------------------------------
    def eval_share(self, data):
        return eval_share(data, self.rank, self.world)

    def combine_eval(self, result):
        """Every rank's EvalResult of its share -> the same EvalResult of the whole data on every
        rank: loss and metrics weighted as one process would weight them."""
        import dataclasses
        names = sorted(result.metrics)
        verdict = self.agree(EVALUATE, plan=None, value=float(zlib.crc32(repr(names).encode())),
                             host=self._host)
        if len(set(verdict.values())) > 1:
            raise LockstepError("the ranks' metric_fn returned different metric names; return the same "
                                "names on every rank.")
        with self._host():
            mine = torch.tensor([result.loss * result.weight, result.weight, result.samples]
                                + [result.metrics[k] * result.samples for k in names], dtype=torch.float64)
            rows = [t.tolist() for t in self._all_gather(mine)]
        loss_sum, weight, samples, *metric_sums = (math.fsum(column) for column in zip(*rows))
        return dataclasses.replace(result, loss=loss_sum / weight, weight=weight, samples=int(samples),
                                   metrics={k: v / samples for k, v in zip(names, metric_sums)})

    def finish(self) -> None:
        """The last agreement of a run: every rank got here with no error and the same step count."""
        self.agree(DONE, host=self._host)

    def close(self) -> None:
        """Hand FSDP's switches back (autofit made no wrapper: nothing else to undo)."""
        if self.sharded is not None:
            self.sharded.close()

    # -- FSDP ------------------------------------------------------------------------------------
    def _before_collective(self, collective: int = 0) -> None:
        """Inside each of FSDP's collectives, after it allocated its buffers and before it runs:
        every rank agrees that the attempt goes on. A rank that failed earlier (its allocation for
        this collective included) is at its agreement after backward and meets this one, so both
        stop; `attempt_agreed` tells the step runner that this attempt's agreement has been held."""
        self.attempt_agreed = True
        self.agree(self.attempt_phase, plan=self.attempt_plan, host=self._host, collective=collective)
        self.attempt_agreed = False

    def agreed_step(self, step_fn, plan: Plan, guarded: bool):
        """`step_fn` followed by an agreement, for the atomic step. `guarded` (every rank took a
        snapshot): when any rank's step failed, every rank raises an OOM inside it, so each
        restores its snapshot. Unguarded, the ranks whose step succeeded have applied their update
        and nothing undoes it: when another rank's step failed, every rank is told that the ranks'
        weights now differ and which did what (see `diverged`)."""
        def step():
            failure = None
            try:
                step_fn()
            except Exception as error:
                failure = error
            if guarded:
                self.agree(STEP, failure=failure, plan=plan, host=self._host)
                return
            verdict = self.exchange(STEP, failure=failure, report=Report(plan=plan), host=self._host)
            if verdict.own == ERROR:  # a non-OOM error is this rank's own, raised as it was
                try:
                    raise failure
                finally:
                    failure = None
            failure = None
            if verdict.errors or verdict.ooms:
                raise diverged(verdict, self.step)
        return step
