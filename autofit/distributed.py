"""torch.distributed in lockstep: every rank runs the same plan at the same global batch, and none
can be left waiting in a collective.

The danger with DDP is its gradient all-reduce inside backward: a rank that runs out of memory in
forward never reaches it, and the others wait there until the process group times out. So autofit
never lets DDP synchronise in backward. A global step on each rank is:

1. every micro-batch's forward and backward under `no_sync()` (local gradients only);
2. an **agreement**: one `all_gather` of a small CPU header (outcome, phase, step, plan hash, loss,
   whether the optimizer step may fail, which gradients exist) over a gloo group. A rank whose
   micro-steps failed joins it too, reporting OOM or an error, so every rank reaches it whatever
   happened, and every rank decides the same thing from the same table;
3. only when every rank succeeded: the gradients are summed with explicit in-place all-reduces
   (which allocate nothing, so they cannot run out of memory half-way);
4. the optimizer step, followed by a second agreement inside the atomic step: if the step ran out
   of memory on any rank, every rank restores its snapshot (taken on every rank when any rank's
   step was at risk) and the global batch is replayed.

After an OOM on any rank, every rank raises an OOM (its own, or `PeerOutOfMemory` naming the rank)
into the same controller, which records the same attempt and takes the same step down: the ladder is
deterministic given the same history, and each agreement checks that the plans' hashes are equal.
A non-OOM error on a rank is reported through the agreement as an error code with its text; that rank
re-raises its own error, the others raise `RankFailed` naming the rank and the error. An error that
escapes outside a step (data loading, evaluation, a cache) is reported by a farewell: the failing
rank joins the next agreement with its error, and every run ends with a final agreement, so the
others meet it there. Ranks that run out of data at different steps meet in different phases and
all raise `LockstepError`. The process-group timeout is left as the last resort for a rank that dies
outright (killed, or lost inside a collective).

Weighting: every rank holds the whole global batch and takes rows [r*n/W, (r+1)*n/W); each
micro-batch's loss is weighted by its share of the *global* batch (rows, or label tokens counted on
the global batch), and the ranks' gradients are summed, not averaged. That is the single-process
formula term by term, so token-weighted losses need no extra communication (every rank can count
the global batch's tokens itself). A global batch must divide evenly by the world size, so every rank
runs the same plan.

Rank 0 decides where the run starts (the cached plan, else the capacity check against the smallest
budget of all ranks, less DDP's own buffers) and sends the decision to the others; only rank 0
reads and writes the plan cache.

Costs and limits: DDP's reducer still allocates its gradient buckets (one copy of the gradients, as
in any DDP run) though autofit reduces the gradients itself, one tensor at a time; module buffers
are broadcast from rank 0 after each step (DDP's `broadcast_buffers`), not inside forward. With
NCCL the agreement runs over a gloo group made for it (call `torch.cuda.set_device(local_rank)`
before `run`). Every rank must call `run`: a rank that never does leaves the others waiting at the
first agreement until the process group's timeout.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import zlib

import torch

from .batches import batch_size as rows_of
from .batches import slice_batch, weights
from .ladder import SizeLog, config_of
from .oom import is_oom, summarize
from .plan import Plan
from .step import StepRunner

OK, OOM, ERROR = 0, 1, 2
HELLO, START, DECIDE, BACKWARD, STEP, DONE, FAREWELL = range(7)
PHASES = ("at the start of the run", "agreeing on the budget", "choosing the start plan",
          "in forward/backward", "in optimizer.step", "at the end of the run", "outside a training step")
FIELDS = ("code", "phase", "step", "plan", "value", "value2", "flag")
MESSAGE_BYTES = 1024


class RankFailed(RuntimeError):
    """Another rank raised an error that is not an out-of-memory error; every rank stops."""

    def __init__(self, message: str, rank: int, error: str):
        super().__init__(message)
        self.rank, self.error = rank, error


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory in this attempt; this rank drops the attempt as well."""


class LockstepError(RuntimeError):
    """The ranks are not at the same point of the run (different data, or different plans)."""


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
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.step = -1
        self.global_batch = None
        self.settled = False     # the other ranks know how this rank's run ends: no farewell
        self.ddp = None
        self.sync_buffers = False
        self.overhead = 0        # bytes DDP's own buffers hold on the device
        self.budget = self.cache_budget = None

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
            header = torch.zeros(n + len(self.params), dtype=torch.float64)
            header[:n] = torch.tensor([code, phase, self.step, plan_hash(plan), value, value2,
                                       float(flag)], dtype=torch.float64)
            if mask is not None:
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

    def wrap(self, model, device):
        """(the module, the DDP that runs it): the user's DDP, or a new one over the module."""
        self._host = device.host
        self.agree(HELLO, host=self._host)
        DDP = torch.nn.parallel.DistributedDataParallel
        before = device.memory_allocated()
        if self.user_ddp is not None:
            self.ddp = self.user_ddp
            self.sync_buffers = bool(getattr(self.ddp, "forward_sync_buffers",
                                             getattr(self.ddp, "broadcast_buffers", False)))
        else:
            # DDP's own buffer broadcast runs inside forward, where a rank that failed earlier would
            # not meet it; autofit broadcasts buffers itself after each agreed step instead.
            off = ("forward_sync_buffers" if "forward_sync_buffers" in
                   inspect.signature(DDP.__init__).parameters else "broadcast_buffers")
            ids = [device.torch_device.index] if device.type == "cuda" else None
            self.ddp = DDP(model, device_ids=ids, **{off: False})
            self.sync_buffers = True
        self.ddp.require_forward_param_sync = False  # no buffer broadcast in the first forward
        self.overhead = max(device.memory_allocated() - before, 0)  # the reducer's buckets
        inner = self.ddp.module
        ignored = set(getattr(inner, "_ddp_params_and_buffers_to_ignore", ()))
        self.buffers = [b for name, b in inner.named_buffers() if name not in ignored]
        return inner, self.ddp

    def agree_budgets(self, device, tensor_budget) -> None:
        """The smallest budget of all ranks, for the capacity check (less DDP's buffers) and for
        the cache key (the budget the user gave)."""
        local = tensor_budget(device)
        verdict = self.agree(START, value=-1.0 if local is None else float(local - self.overhead),
                             value2=-1.0 if device.budget is None else float(device.budget),
                             host=self._host)
        limits = [int(v) for v in verdict.values() if v >= 0]
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
        failure, payload = None, b""
        if self.rank == 0:
            try:
                plan, reason, settle = choose()
                payload = json.dumps({"plan": plan.to_dict(), "reason": reason, "settle": settle,
                                      "sizes": sizes.to_json()}).encode()
            except Exception as error:
                failure = error
        verdict = self.agree(DECIDE, failure=failure, value=float(len(payload)), host=self._host)
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

    def local(self, batch):
        """This rank's rows of a global batch."""
        n = rows_of(batch)
        if n % self.world:
            raise ValueError(f"global batch {n} cannot be split evenly over {self.world} ranks; give "
                             f"global batches divisible by the world size (batch_size a multiple of "
                             f"{self.world}, and drop_last=True or a dataset length to match).")
        per = n // self.world
        return slice_batch(batch, self.rank * per, (self.rank + 1) * per)

    def check_dataset(self, length: int, batch_size: int) -> None:
        """Fail before training when some global batch of a map-style Dataset cannot be split."""
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

    def finish(self) -> None:
        """The last agreement of a run: every rank got here with no error and the same step count."""
        self.agree(DONE, host=self._host)

    def close(self) -> None:
        self.ddp = None  # a DDP autofit made goes with the run; the module stays as it was

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

    def reduce_grads(self, verdict: Verdict) -> None:
        """Sum the gradients over the ranks, in place (nothing is allocated: nothing can fail)."""
        used = [max(column) for column in zip(*verdict.masks)] if self.params else []
        works = []
        for p, u in zip(self.params, used):
            if not u:
                p.grad = None
                continue
            works.append(torch.distributed.all_reduce(p.grad, group=self.group, async_op=True))
        for work in works:
            work.wait()

    def broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, as DDP does (autofit does it between steps)."""
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


class DistributedStepRunner(StepRunner):
    """A StepRunner whose global step is agreed between the ranks (see the module's docstring)."""

    phase_steers_ladder = False  # ranks fail in different phases; all must step down alike

    def __init__(self, model, optimizer, device, *, lockstep: Lockstep, ddp, **kwargs):
        super().__init__(model, optimizer, device, forward=ddp,
                         sync=lambda i, last: ddp.no_sync(), **kwargs)
        self.lockstep = lockstep

    def _shares(self, batch, parts):
        # Each micro-batch's share of the whole global batch, which every rank holds.
        return weights(self.lockstep.global_batch, parts, self.count_tokens)

    def run(self, batch, plan) -> float:
        lock = self.lockstep
        failure, value, mask, at_risk = None, 0.0, None, False
        try:
            value = self._accumulate(batch, plan).item()
            mask = lock.fill_missing_grads()
            at_risk = self.offloaded is None and self.atomic.at_risk(config_of(plan))
        except Exception as error:
            failure = error
        verdict = lock.agree(BACKWARD, failure, value=value, flag=at_risk, plan=plan, mask=mask,
                             host=self.device.host)
        lock.reduce_grads(verdict)
        loss = math.fsum(verdict.values())
        self._step(plan, guard=verdict.any_flag(), wrap=lambda step: lock.agreed_step(step, plan))
        lock.broadcast_buffers()
        return loss
