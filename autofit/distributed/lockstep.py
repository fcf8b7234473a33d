"""torch.distributed in lockstep: every rank runs the same plan at the same global batch, and none
can be left waiting in a collective.

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
4. the optimizer step, followed by a second agreement inside the atomic step: if the step ran out
   of memory on any rank, every rank restores its snapshot (taken on every rank when any rank's
   step was at risk) and the global batch is replayed.

After an OOM on any rank, every rank raises an OOM (its own, or `PeerOutOfMemory` naming the rank)
into the same controller, which records the same attempt and takes the same step down: the ladder is
deterministic given the same history, and each agreement checks that the plans' hashes are equal.
A non-OOM error on a rank is reported through the agreement as an error code with its text; that rank
re-raises its own error, the others raise `RankFailed` naming the rank and the error. An error that
escapes outside a step (data loading, evaluation, a cache, the scheduler) is reported by a farewell:
the failing rank joins the next agreement with its error, and every run ends with a final
agreement, so the others meet it there. The lockstep opens before anything else in `run` (before
the first batch is read), so an error anywhere in `run` is announced. Ranks that run out of data at different steps meet in different phases and
all raise `LockstepError`. The process-group timeout is left as the last resort for a rank that dies
outright (killed, or lost inside a collective).

Data comes in one of two ways, told apart at the first agreement (each rank reports whether its
loader has a `DistributedSampler` and a hash of its first batch):
- **per rank** (a `DistributedSampler`, or first batches that differ, as torchrun jobs usually give
  it): each rank's batch is its share of the global batch, which is the ranks' batches together.
  Each micro-batch is weighted within its rank's batch, and at the agreement after backward each
  rank's gradients are scaled by its share of the global batch (its rows, or label tokens, over all
  ranks') before the sum. When autofit drives the epochs it calls `sampler.set_epoch(epoch)` before
  each one, as a plain DDP loop must.
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

import contextlib
import itertools
import json
import math
import zlib

import torch

from autofit.engine.batches import _fields, slice_batch, weights
from autofit.engine.batches import batch_size as rows_of
from autofit.errors import DoesNotFit, LockstepError, PeerOutOfMemory, RankFailed
from autofit.plans.ladder import SizeLog, config_of
from autofit.gpu.oom import is_oom, summarize
from autofit.plans.plan import Plan
from autofit.engine.step import StepRunner

OK, OOM, ERROR = 0, 1, 2
HELLO, START, DECIDE, BACKWARD, STEP, DONE, FAREWELL, EVALUATE = range(8)
PHASES = ("at the start of the run", "agreeing on the budget", "choosing the start plan",
          "in forward/backward", "in optimizer.step", "at the end of the run", "outside a training step",
          "in evaluation")
ITERABLE, SAMPLED, DATASET = range(3)  # how a rank's data came: batches, a DistributedSampler, a Dataset
# Layers that run collectives inside forward: a rank that failed before reaching one would leave the
# others waiting in it, and no agreement can come first.
COLLECTIVE_LAYERS = (torch.nn.SyncBatchNorm, torch.nn.parallel.DistributedDataParallel)
FIELDS = ("code", "phase", "step", "plan", "value", "value2", "flag", "model")
MESSAGE_BYTES = 1024


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def open_lockstep(model) -> "Lockstep | None":
    """The lockstep of this run, or None when torch.distributed is not initialised."""
    ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
    if not is_distributed():
        if ddp is not None:
            raise ValueError("model is a DistributedDataParallel but torch.distributed is not "
                             "initialised; call torch.distributed.init_process_group first.")
        return None
    return Lockstep(model, ddp)


def distributed_sampler(data):
    """The `DistributedSampler` a DataLoader draws from (its sampler or its batch sampler's), or None."""
    from torch.utils.data.distributed import DistributedSampler
    for sampler in (getattr(data, "sampler", None),
                    getattr(getattr(data, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def content_hash(batch) -> int:
    """A crc32 of a batch's content (every tensor's dtype, shape and bytes; other leaves' repr), to
    tell whether the ranks were given the same batch."""
    crc = 0
    for path, value in _fields(batch):
        crc = zlib.crc32(path.encode(), crc)
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            crc = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), crc)
            crc = zlib.crc32(t.view(-1).view(torch.uint8).numpy().tobytes(), crc)
        else:
            crc = zlib.crc32(repr(value).encode(), crc)
    return crc


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


def plan_hash(plan: Plan | None) -> int:
    """A 32-bit hash of a plan (exact in the float64 header); 0 for no plan."""
    if plan is None:
        return 0
    return zlib.crc32(json.dumps(plan.to_dict(), sort_keys=True).encode()) + 1


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {summarize(error)}"


class Verdict:
    """What every rank reported at one agreement; each rank reads the same table."""

    def __init__(self, rank: int, phase: int, rows: list[list[float]], messages: list[str] | None,
                 n_fields: int):
        self.rank, self.phase, self.messages = rank, phase, messages
        self.headers = [dict(zip(FIELDS, row[:n_fields])) for row in rows]
        self.masks = [row[n_fields:] for row in rows]
        codes = [int(h["code"]) for h in self.headers]
        self.errors = [r for r, c in enumerate(codes) if c == ERROR]
        self.ooms = [r for r, c in enumerate(codes) if c == OOM]
        self.own = codes[rank]
        self.mismatch = self._mismatch()

    def _mismatch(self) -> str | None:
        alive = [(r, h) for r, h in enumerate(self.headers) if int(h["code"]) != ERROR]
        if len({h["model"] for _, h in alive}) > 1:
            groups = {}
            for r, h in alive:
                groups.setdefault(int(h["model"]), []).append(str(r))
            shown = "; ".join(f"ranks {', '.join(g)}: {m:08x}" for m, g in groups.items())
            return (f"the ranks' models differ (hashes of their parameters' and buffers' names, shapes "
                    f"and dtypes: {shown}); give every rank the same model.")
        if len({(h["phase"], h["step"], h["plan"]) for _, h in alive}) <= 1:
            return None
        where = "; ".join(f"rank {r} at global step {int(h['step'])}, {PHASES[int(h['phase'])]}"
                          f"{', plan hash %d' % int(h['plan']) if h['plan'] else ''}" for r, h in alive)
        return (f"the ranks are out of step: {where}. Give every rank the same global batches (the "
                f"same number of them, each divisible by the world size) and the same model, "
                f"optimizer and ladder.")

    @property
    def terminal(self) -> bool:
        return bool(self.errors) or self.mismatch is not None

    def keeps_own(self) -> bool:
        """Whether this rank re-raises its own failure: a non-OOM error always; an OOM unless the run
        must stop for another reason."""
        return self.own == ERROR or (self.own == OOM and not self.terminal)

    def raise_for_peers(self) -> None:
        """Raise what the other ranks' outcomes mean for this rank (nothing when all succeeded)."""
        if self.errors:
            r = self.errors[0]
            text = self.messages[r] if self.messages else "an error"
            where = PHASES[int(self.headers[r]["phase"])]
            raise RankFailed(f"rank {r} failed with {text} ({where}); every rank stops, "
                             f"this is rank {self.rank}. The error and its traceback are in rank {r}'s "
                             f"output.", rank=r, error=text)
        if self.mismatch is not None:
            raise LockstepError(self.mismatch)
        if self.ooms:
            shown = "; ".join(f"rank {r}: {self.messages[r]}" for r in self.ooms)
            raise PeerOutOfMemory(f"out of memory on another rank ({shown}); every rank drops this "
                                  f"attempt")

    def values(self, name: str = "value") -> list[float]:
        return [h[name] for h in self.headers]

    def any_flag(self) -> bool:
        return any(h["flag"] for h in self.headers)


class _View:
    """A device as seen by the capacity check or the cache key: the agreed budget, the world size."""

    def __init__(self, device, budget: int | None, name: str | None = None):
        self._device = device
        self.budget = budget
        self.name = name or device.name

    def __getattr__(self, name):
        return getattr(self._device, name)


class Lockstep:
    """The agreement between the ranks of one run; see the module's docstring."""

    def __init__(self, model, ddp=None):
        dist = torch.distributed
        self.group = ddp.process_group if ddp is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.agreement_group = self._cpu_group()
        self.user_ddp = ddp
        self.module = ddp.module if ddp is not None else model
        if not isinstance(self.module, torch.nn.Module):  # run refuses it, inside the lockstep's scope
            self.module = torch.nn.Module()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        # Headers carry one entry per parameter only once every rank is known to have the same model.
        self.model_hash = zlib.crc32(repr([(n, tuple(t.shape), str(t.dtype), t.requires_grad) for n, t in
                                           itertools.chain(self.module.named_parameters(),
                                                           self.module.named_buffers())]).encode())
        self.met = False
        self.step = -1
        self.global_batch = None
        self.settled = False     # the other ranks know how this rank's run ends: no farewell
        self.per_rank = False    # each rank's batch is its share of the global batch
        self.sampler = None      # the DistributedSampler of per-rank data, stepped each epoch
        # DDP's broadcast_buffers: on unless the user's own DDP turned it off.
        self.sync_buffers = ddp is None or bool(getattr(ddp, "broadcast_buffers", True))
        ignored = set(getattr(self.module, "_ddp_params_and_buffers_to_ignore", ()))
        self.buffers = [b for name, b in self.module.named_buffers() if name not in ignored]
        self.budget = self.cache_budget = None
        self.limits: list[int | None] = []  # each rank's budget for tensors

    def _cpu_group(self):
        dist = torch.distributed
        backend = str(dist.get_backend(self.group))
        if "gloo" in backend:
            return self.group
        if self.world != dist.get_world_size():
            raise ValueError(f"the DDP process group is a {backend} subgroup; autofit's agreement needs "
                             f"gloo on it. Initialise with backend='cpu:gloo,cuda:nccl' or use the "
                             f"whole world.")
        return dist.new_group(backend="gloo")

    # -- agreements ----------------------------------------------------------------------------
    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        try:
            torch.distributed.all_gather(out, tensor, group=self.agreement_group)
        except Exception as error:
            self.settled = True  # the collective itself is broken: a farewell would wait for nothing
            raise LockstepError(f"the agreement between ranks failed on rank {self.rank}: "
                                f"{_describe(error)}; another rank has probably died or timed "
                                f"out.") from error
        return out

    def exchange(self, phase: int, *, failure: BaseException | None = None, value: float = 0.0,
                 value2: float = 0.0, flag: bool = False, plan: Plan | None = None,
                 mask: list[float] | None = None, host=contextlib.nullcontext) -> Verdict:
        """One agreement. Call it outside any `except` block (an error raised here must not look
        like it was raised while handling an OOM)."""
        code = OK if failure is None else ERROR if phase == FAREWELL or not is_oom(failure) else OOM
        n = len(FIELDS)
        with host():  # tiny CPU tensors that must never count against a simulated budget
            header = torch.zeros(n + (len(self.params) if self.met else 0), dtype=torch.float64)
            header[:n] = torch.tensor([code, phase, self.step, plan_hash(plan), value, value2,
                                       float(flag), self.model_hash], dtype=torch.float64)
            if mask is not None and self.met:
                header[n:] = torch.tensor(mask, dtype=torch.float64)
            rows = [t.tolist() for t in self._all_gather(header)]
            messages = None
            if any(int(row[0]) != OK for row in rows):
                text = b"" if failure is None else _describe(failure).encode()[:MESSAGE_BYTES]
                buffer = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
                buffer[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
                messages = [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace")
                            for t in self._all_gather(buffer)]
        verdict = Verdict(self.rank, phase, rows, messages, n)
        if verdict.terminal:
            self.settled = True
        return verdict

    def agree(self, phase: int, failure: BaseException | None = None, **fields) -> Verdict:
        """An agreement after which this rank raises what it must: its own failure, or what the
        others' outcomes mean. Returns the verdict when every rank succeeded."""
        verdict = self.exchange(phase, failure=failure, **fields)
        if failure is not None and verdict.keeps_own():
            try:
                raise failure
            finally:
                failure = None  # no frame -> traceback -> frame cycle pinning the attempt's tensors
        failure = None
        verdict.raise_for_peers()
        return verdict

    def farewell(self, error: BaseException) -> None:
        """Tell the other ranks, at their next agreement, that this rank ends with `error`."""
        if self.settled:
            return
        self.settled = True
        try:
            self.exchange(FAREWELL, failure=error, host=self._host)
        except Exception:
            pass  # the others are gone already; this rank's own error is what matters

    @contextlib.contextmanager
    def scope(self):
        """Around a run: an error that escapes without the others knowing is announced to them."""
        try:
            yield self
        except Exception as error:
            self.farewell(error)
            raise

    # -- the run's milestones ------------------------------------------------------------------
    _host = contextlib.nullcontext

    def hello(self, first, data, device, *, dataset: bool):
        """The first agreement: every rank has read its first batch and placed the model. Decides how
        the data is given (see the module's docstring), then copies rank 0's parameters and buffers
        to every rank in place (what DDP's constructor does, here behind an agreement)."""
        self._host = device.host
        refuse_collective_layers(self.module)
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
        self.per_rank = self._per_rank({int(k) for k in verdict.values("value2")}, verdict.values())
        with torch.no_grad():
            src = self._global(0)
            for tensor in itertools.chain(self.module.parameters(), self.buffers):
                torch.distributed.broadcast(tensor, src=src, group=self.group)
        return self.module

    def _per_rank(self, kinds: set, digests: list[float]) -> bool:
        """Whether each rank's batches are its share (True) or every rank's are the global batches."""
        if SAMPLED in kinds:
            if kinds == {SAMPLED}:
                return True
            raise ValueError("some ranks' data has a DistributedSampler and some has not, so autofit "
                             "cannot tell whether a batch is a rank's share or the global batch; give "
                             "every rank a DataLoader with a DistributedSampler, or every rank the same "
                             "global batches.")
        distinct = len(set(digests))
        if distinct == 1:
            return False
        if DATASET in kinds:
            raise ValueError("the ranks' Datasets differ (their first global batches are not equal), so "
                             "autofit cannot tell whether batch_size is each rank's share or the global "
                             "batch; pass the same Dataset on every rank (autofit takes each rank's rows), "
                             "or a DataLoader with a DistributedSampler.")
        if distinct < self.world:
            groups = {}
            for r, d in enumerate(digests):
                groups.setdefault(d, []).append(r)
            shown = "; ".join("ranks " + ", ".join(map(str, g)) for g in groups.values())
            raise ValueError(f"some ranks were given the same first batch and others different ones ("
                             f"same within: {shown}), so autofit cannot tell whether a batch is a "
                             f"rank's share or the global batch; give every rank the same global "
                             f"batches, or each rank its own (a DataLoader with a DistributedSampler).")
        return True

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

    def agree_budgets(self, device, tensor_budget) -> None:
        """The smallest budget of all ranks, for the capacity check (less DDP's buffers) and for
        the cache key (the budget the user gave)."""
        local = tensor_budget(device)
        verdict = self.agree(START, value=-1.0 if local is None else float(local),
                             value2=-1.0 if device.budget is None else float(device.budget),
                             host=self._host)
        self.limits = [int(v) if v >= 0 else None for v in verdict.values()]
        limits = [v for v in self.limits if v is not None]
        given = [int(v) for v in verdict.values("value2") if v >= 0]
        self.budget = min(limits) if limits else None
        self.cache_budget = min(given) if given else None

    def estimate_view(self, device):
        return _View(device, self.budget)

    def cache_view(self, device):
        return _View(device, self.cache_budget, f"{device.name} x{self.world} ranks (DDP)")

    def agree_start(self, choose, sizes: SizeLog):
        """Rank 0 calls `choose()` -> (plan, reason, settle_within), filling `sizes`; every rank
        returns the same decision with the same `sizes`."""
        failure, payload, refused = None, b"", False
        if self.rank == 0:
            try:
                plan, reason, settle = choose()
                payload = json.dumps({"plan": plan.to_dict(), "reason": reason, "settle": settle,
                                      "sizes": sizes.to_json()}).encode()
            except DoesNotFit as error:
                refused = self._smallest() != 0  # the rank that does not fit says so itself
                failure = None if refused else error
            except Exception as error:
                failure = error
        verdict = self.agree(DECIDE, failure=failure, value=float(len(payload)), flag=refused,
                             host=self._host)
        if verdict.any_flag():
            self._refuse_on_smallest(choose)
        size = int(verdict.values()[0])
        with self._host():
            data = torch.zeros(size, dtype=torch.uint8)
            if self.rank == 0:
                data[:] = torch.tensor(list(payload), dtype=torch.uint8)
            try:
                torch.distributed.broadcast(data, src=self._global(0), group=self.agreement_group)
            except Exception:
                self.settled = True
                raise
            decided = json.loads(bytes(data.tolist()).decode())
        agreed = SizeLog.from_json(decided["sizes"])
        sizes.fits, sizes.fails = agreed.fits, agreed.fails
        return Plan.from_dict(decided["plan"]), decided["reason"], decided["settle"]

    def _smallest(self) -> int:
        """The rank with the smallest budget (the first of equals; rank 0 when none has one)."""
        known = [(v, r) for r, v in enumerate(self.limits) if v is not None]
        return min(known)[1] if known else 0

    def _refuse_on_smallest(self, choose) -> None:
        """Rank 0 found no plan that fits the smallest budget: the rank that has it checks again on
        its own device and raises DoesNotFit there; every other rank raises RankFailed."""
        small, failure = self._smallest(), None
        if self.rank == small:
            try:
                choose()
                failure = LockstepError(f"rank 0 found no plan that fits rank {small}'s budget, but rank "
                                        f"{small} found one; give every rank the same model, data and "
                                        f"precision.")
            except Exception as error:
                failure = error
        self.agree(DECIDE, failure=failure, host=self._host)
        raise LockstepError(f"rank {small} did not report why no plan fits it")  # agree raised already

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

    def next_batch(self, batch):
        """The next global batch: remembered for weighting, this rank's rows returned."""
        self.step += 1
        self.global_batch = batch
        return self.local(batch)

    # -- evaluation ----------------------------------------------------------------------------
    def eval_share(self, data):
        """This rank's share of the evaluation data, so each sample is evaluated once: a contiguous
        part of a map-style Dataset, the rows [r*n/W, (r+1)*n/W) of each batch of an iterable, or the
        data itself when a DistributedSampler already gives each rank its share."""
        from autofit.recipes.eval_data import is_map_dataset
        if distributed_sampler(data) is not None:
            return data
        if is_map_dataset(data):
            n = len(data)
            return torch.utils.data.Subset(data, range(self.rank * n // self.world,
                                                       (self.rank + 1) * n // self.world))
        return _RowShare(data, self.rank, self.world)

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
        pass  # nothing to hand back: autofit made no wrapper

    # -- gradients and buffers -----------------------------------------------------------------
    def fill_missing_grads(self) -> list[float]:
        """Zero gradients where this rank has none, so every rank reduces the same tensors; returns
        which gradients this rank had (a parameter that no rank used gets None back)."""
        mask = []
        for p in self.params:
            mask.append(0.0 if p.grad is None else 1.0)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return mask

    def reduce_grads(self, verdict: Verdict, scale: float = 1.0) -> None:
        """Sum the gradients over the ranks, each first scaled by `scale` (this rank's share of the
        global batch), in place (nothing is allocated: nothing can fail)."""
        used = [max(column) for column in zip(*verdict.masks)] if self.params else []
        works = []
        for p, u in zip(self.params, used):
            if not u:
                p.grad = None
                continue
            if scale != 1.0:
                p.grad.mul_(scale)
            works.append(torch.distributed.all_reduce(p.grad, group=self.group, async_op=True))
        for work in works:
            work.wait()

    def broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, as DDP does (autofit does it after the agreed backward)."""
        if not self.sync_buffers:
            return
        src = self._global(0)
        for b in self.buffers:
            torch.distributed.broadcast(b, src=src, group=self.group)

    def _global(self, group_rank: int) -> int:
        group = self.agreement_group
        if group is None or group is torch.distributed.group.WORLD:
            return group_rank
        return torch.distributed.get_global_rank(group, group_rank)

    def agreed_step(self, step_fn, plan: Plan):
        """`step_fn` followed by an agreement, for the atomic step: when any rank's step failed,
        every rank raises an OOM inside it, so each restores its snapshot."""
        def step():
            failure = None
            try:
                step_fn()
            except Exception as error:
                failure = error
            self.agree(STEP, failure=failure, plan=plan, host=self._host)
        return step


class _RowShare:
    """An iterable of batches yielding rank r's rows [r*n/W, (r+1)*n/W) of each (empty ones skipped)."""

    def __init__(self, data, rank: int, world: int):
        self.data, self.rank, self.world = data, rank, world

    def __iter__(self):
        for batch in self.data:
            n = rows_of(batch)
            lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
            if hi > lo:
                yield slice_batch(batch, lo, hi)


class DistributedStepRunner(StepRunner):
    """A StepRunner whose global step is agreed between the ranks (see the module's docstring)."""

    phase_steers_ladder = False  # ranks fail in different phases; all must step down alike

    def __init__(self, model, optimizer, device, *, lockstep: Lockstep, **kwargs):
        super().__init__(model, optimizer, device, **kwargs)
        self.lockstep = lockstep
        self.share_count = 0.0  # rows or label tokens of this rank's batch (per-rank data)

    def _shares(self, batch, parts):
        if not self.lockstep.per_rank:
            # Each micro-batch's share of the whole global batch, which every rank holds.
            return weights(self.lockstep.global_batch, parts, self.count_tokens)
        tokens = self.count_tokens(batch) if self.count_tokens is not None else None
        self.share_count = float(rows_of(batch) if tokens is None else tokens)
        return weights(batch, parts, self.count_tokens)  # within this rank's batch; scaled after

    def run(self, batch, plan) -> float:
        lock = self.lockstep
        failure, value, mask, at_risk = None, 0.0, None, False
        try:
            value = self._accumulate(batch, plan).item()
            mask = lock.fill_missing_grads()
            at_risk = self.offloaded is None and self.atomic.at_risk(config_of(plan))
        except Exception as error:
            failure = error
        verdict = lock.agree(BACKWARD, failure, value=value, value2=self.share_count, flag=at_risk,
                             plan=plan, mask=mask, host=self.device.host)
        if lock.per_rank:
            counts = verdict.values("value2")
            total = math.fsum(counts)
            lock.reduce_grads(verdict, scale=self.share_count / total)
            loss = math.fsum(v * c for v, c in zip(verdict.values(), counts)) / total
        else:
            lock.reduce_grads(verdict)
            loss = math.fsum(verdict.values())
        lock.broadcast_buffers()  # before the step: nothing after its agreement communicates
        self._step(plan, guard=verdict.any_flag(), wrap=lambda step: lock.agreed_step(step, plan))
        return loss
