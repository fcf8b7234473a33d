"""One agreement between the ranks: what each reports (a fixed-size header of floats, plus a text
when any rank failed) and what every rank concludes from the same table (`Verdict`). The phases
name where a rank was when it reported, for the errors the others raise."""

from __future__ import annotations

import contextlib
import json
import zlib
from dataclasses import dataclass

import torch

from autofit.distributed import internals
from autofit.distributed.presence import Presence
from autofit.errors import LockstepError, PeerOutOfMemory, RankFailed
from autofit.gpu.oom import is_oom, summarize
from autofit.plans.plan import Plan

OK, OOM, ERROR = 0, 1, 2
HELLO, START, DECIDE, BACKWARD, STEP, DONE, FAREWELL, EVALUATE, SHARES, CLIP, OPTIMIZER = range(11)
PHASES = ("at the start of the run", "agreeing on the budget", "choosing the start plan",
          "in forward/backward", "in optimizer.step", "at the end of the run", "outside a training step",
          "in evaluation", "counting the global batch", "clipping the gradients",
          "trying the optimizer on shards")
FIELDS = ("code", "phase", "step", "plan", "value", "value2", "flag", "model", "collective", "value3")
MESSAGE_BYTES = 1024
_SEPARATE: dict = {}  # the agreements' own gloo group, per default process group (see _cpu_group)


def plan_hash(plan: Plan | None) -> int:
    """A 32-bit hash of a plan (exact in the float64 header); 0 for no plan."""
    if plan is None:
        return 0
    return zlib.crc32(json.dumps(plan.to_dict(), sort_keys=True).encode()) + 1


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {summarize(error)}"


def where(step: int, phase: int) -> str:
    """'at global step 3, in forward/backward'."""
    return f"at global step {step}, {PHASES[phase] if 0 <= phase < len(PHASES) else 'phase %d' % phase}"


@dataclass(frozen=True)
class Report:
    """What a rank reports at an agreement besides its outcome: the header's free fields (what each
    means is the caller's: a budget, a share's rows, a norm), and an optional mask of floats."""

    value: float = 0.0
    value2: float = 0.0
    value3: float = 0.0
    flag: bool = False
    plan: Plan | None = None   # sent as its hash: ranks on different plans are out of step
    collective: int = 0        # the FSDP collective this agreement stands in front of (0: none)
    mask: list[float] | None = None


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
            return self._collectives_differ()
        ended = [r for r, h in alive if int(h["phase"]) == DONE]
        if ended and len(ended) < len(alive):
            return self._batches_differ(alive, ended)
        where = "; ".join(f"rank {r} at global step {int(h['step'])}, {PHASES[int(h['phase'])]}"
                          f"{', plan hash %d' % int(h['plan']) if h['plan'] else ''}" for r, h in alive)
        return (f"the ranks are out of step: {where}. Give every rank the same global batches (the "
                f"same number of them, each divisible by the world size) and the same model, "
                f"optimizer and ladder.")

    @staticmethod
    def _batches_differ(alive: list, ended: list) -> str:
        """Some ranks ended their data while others have another global batch: the one error of
        per-rank data (shares may differ in rows, not in number)."""
        going = [(r, int(h["step"])) for r, h in alive if r not in ended]
        trained = {r: int(h["step"]) + 1 for r, h in alive if r in ended}
        shown = "; ".join(f"rank {r} ended after {n} global batches" for r, n in trained.items())
        more = "; ".join(f"rank {r} has global batch {s}" for r, s in going)
        return (f"the ranks were given different numbers of batches: {shown}; {more}. Every rank must "
                f"give the same number of batches (its shares may differ in rows): shard the data so "
                f"that each rank's loader yields as many batches (a DistributedSampler does), or drop "
                f"the extra batches.")

    def _collectives_differ(self) -> str | None:
        """When every rank goes on, they must be about to run the same FSDP collective (or none):
        otherwise their FSDP states diverged and the collective would never pair."""
        if any(int(h["code"]) != OK for h in self.headers):
            return None  # every rank drops the attempt: no collective runs
        if len({h["collective"] for h in self.headers}) <= 1:
            return None
        from autofit.distributed.fsdp_guard import describe_collective
        where = "; ".join(f"rank {r} at {describe_collective(h['collective'])}" for r, h in enumerate(self.headers))
        return (f"the ranks are out of step inside FSDP: {where}. Their FSDP states differ (a unit "
                f"gathered or resharded on some ranks only); every rank stops rather than wait in a "
                f"collective that never pairs.")

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
            at = where(int(self.headers[r]["step"]), int(self.headers[r]["phase"]))
            raise RankFailed(f"rank {r} failed with {text} ({at}); every rank stops, "
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


class Agreement:
    """The agreements of one run over a CPU group (`agreement_group`); the subclass sets `rank`,
    `world`, `group`, `step`, `model_hash`, `met` and `mask_size` (entries per header once met)."""

    settled = False  # the other ranks know how this rank's run ends: no farewell
    _phase = HELLO   # the phase of the agreement under way (for the errors when it fails)
    _host = contextlib.nullcontext

    def _cpu_group(self, separate: bool = False):
        """The gloo group agreements run on: the training group itself when it is gloo, unless
        `separate` (FSDP runs collectives of its own in forward and backward: on another group, a
        rank waiting in one of them never trades data with a rank at an agreement)."""
        dist = torch.distributed
        backend = str(dist.get_backend(self.group))
        if "gloo" in backend and not separate:
            return self.group
        if self.world != dist.get_world_size():
            raise ValueError(f"the DDP process group is a {backend} subgroup; autofit's agreement needs "
                             f"gloo on it. Initialise with backend='cpu:gloo,cuda:nccl' or use the "
                             f"whole world.")
        # One per process, kept for later runs: creating a group is itself a collective, and a
        # second run's creation hung for good after rank 0 alone had run a sharded capacity check.
        # It waits as long as the user's own group does (new_group alone would wait 30 minutes).
        key = internals.default_group_key()
        kept = _SEPARATE.get(key)
        if kept is None or not internals.group_alive(kept):  # none yet, or its world was destroyed
            timeout = internals.group_timeout(dist.group.WORLD)
            kept = _SEPARATE[key] = dist.new_group(backend="gloo", timeout=timeout)
        return kept

    # -- agreements ----------------------------------------------------------------------------
    def _presence(self) -> Presence:
        if self.__dict__.get("presence") is None:
            self.presence = Presence(self.rank, self.world, where)
        return self.presence

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        presence = self._presence()
        presence.waiting = True
        try:
            torch.distributed.all_gather(out, tensor, group=self.agreement_group)
        except Exception as error:
            self.settled = True  # the collective itself is broken: a farewell would wait for nothing
            failed = error
        else:
            return out
        finally:
            presence.waiting = False
        raise self._unreached(failed)

    def _unreached(self, error: Exception) -> Exception:
        """The error for an agreement whose collective failed: RankFailed naming the ranks that
        the evidence shows failed (autofit.distributed.presence) and what was observed, else
        LockstepError."""
        presence = self._presence()
        here = where(self.step, self._phase)
        observed, timed_out = self._observed(error)
        failed = presence.failed(timed_out)
        if not failed:
            presence.stop(None, f"the agreement {here} failed ({observed})")
            return LockstepError(f"the agreement between ranks failed {here}: {observed}, and no "
                                 f"rank is known to have failed (every other rank's heartbeat goes "
                                 f"on); this is rank {self.rank}. ({_describe(error)})")
        names = "; ".join(f"rank {r} {what}" for r, what in failed)
        reason = f"{names} (the agreement {here} failed: {observed})"
        presence.stop(failed[0][0], reason)
        failed = RankFailed(f"{reason}; every rank stops, this is rank {self.rank}.",
                            rank=failed[0][0], error=reason)
        failed.__cause__ = error
        return failed

    def _observed(self, error: Exception) -> tuple[str, bool]:
        """What the failed collective showed, and whether it was the process group's timeout."""
        text = str(error).lower()
        if any(s in text for s in ("connection closed", "connection reset", "broken pipe", "closed by peer")):
            return "a peer's connection closed", False
        if "timed out" in text or "timeout" in text:
            timeout = internals.group_timeout(self.agreement_group)
            within = f" ({timeout.total_seconds():g} s)" if timeout else ""
            return f"the process group's timeout{within} ran out", True
        return _describe(error), False

    def _stopped(self, rank: int, failed: int | None, reason: str) -> RankFailed:
        return RankFailed(f"rank {rank} stopped the run: {reason}; every rank stops, this is rank "
                          f"{self.rank}.", rank=rank if failed is None else failed, error=reason)

    def exchange(self, phase: int, *, failure: BaseException | None = None, report: Report = Report(),
                 host=contextlib.nullcontext) -> Verdict:
        """One agreement: this rank's outcome and `report` against every other rank's. Call it
        outside any `except` block (an error raised here must not look like it was raised while
        handling an OOM)."""
        code = OK if failure is None else ERROR if phase == FAREWELL or not is_oom(failure) else OOM
        presence = self._presence()
        if presence.stopped is not None:  # another rank ended the run: no one answers any more
            self.settled = True
            raise presence.stopped
        self._phase = phase
        presence.enter(self.step, phase)
        n = len(FIELDS)
        with host():  # tiny CPU tensors that must never count against a simulated budget
            header = torch.zeros(n + (self.mask_size if self.met else 0), dtype=torch.float64)
            header[:n] = torch.tensor([code, phase, self.step, plan_hash(report.plan), report.value,
                                       report.value2, float(report.flag), self.model_hash, report.collective,
                                       report.value3], dtype=torch.float64)
            if report.mask is not None and self.met:
                header[n:] = torch.tensor(report.mask, dtype=torch.float64)
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

    def agree(self, phase: int, failure: BaseException | None = None, host=contextlib.nullcontext,
              **report) -> Verdict:
        """An agreement after which this rank raises what it must: its own failure, or what the
        others' outcomes mean. `report`: the fields of `Report`. Returns the verdict when every
        rank succeeded."""
        verdict = self.exchange(phase, failure=failure, report=Report(**report), host=host)
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
        """Around a run: an error that escapes without the others knowing is announced to them
        (any BaseException: SystemExit and KeyboardInterrupt too); the presence watch runs inside
        the outermost scope."""
        presence = self._presence()
        self._scopes = getattr(self, "_scopes", 0) + 1
        if self._scopes == 1:
            presence.watch(self._stopped)
        try:
            yield self
        except BaseException as error:
            self.farewell(error)
            raise
        finally:
            self._scopes -= 1
            if self._scopes == 0:
                presence.close()

    def _global(self, group_rank: int) -> int:
        group = self.agreement_group
        if group is None or group is torch.distributed.group.WORLD:
            return group_rank
        return torch.distributed.get_global_rank(group, group_rank)
