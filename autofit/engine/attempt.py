"""The attempt: one try of some work on the device, and the walk down that tries again until one fits.

`Attempter` runs one attempt: only an out-of-memory error is caught (`oom.is_oom`), and all that
happens to it inside the `except` block is reading it (its first line, and what the caller's
`inspect` reads at the failure). Everything else runs after the block has exited, when no frame of
the failed attempt is alive to pin what it allocated: the caller's own `free`, `oom.release`, then
the check that allocated memory is back at its pre-attempt baseline (else `MemoryNotReleased`,
naming the bytes and the tensors that hold them). `walk` repeats attempts, each failure turning the
caller's search state into the next one (a step down), until one fits or nothing is left to try
(`until_fits`: the same for callers that keep their own state); `next_down` is the walk down a
ladder that passes over plans already known to fail.

Training (`engine/controller`), evaluation (`recipes/evaluate`) and the Hugging Face Trainer's
recovery (`integrations/hf_recovery`, `integrations/hf_eval`) all go through these.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tenacity import Retrying, retry_if_result, stop_after_attempt, wait_none
from tenacity.stop import stop_base

from autofit.engine import optimizer_state
from autofit.engine.withdrawal import error_text
from autofit.engine import attempt_writes
from autofit.errors import MemoryNotReleased
from autofit.gpu import fragmentation
from autofit.gpu.device import describe_tensors
from autofit.gpu.memory import by_kind
from autofit.gpu.oom import is_oom, release, summarize
from autofit.gpu.workspaces import Workspaces
from autofit.plans.ladder import step_down
from autofit.plans.plan import Plan
from autofit.sizes import format_size

log = logging.getLogger("autofit")


# A safety cap, not a verdict: the walk down a ladder ends where the ladder does (plans already
# seen are passed over, a move going round in circles ends it), and replays of one plan are given
# once per global batch; this many attempts of one global batch would mean a ladder or a memory
# that never settles. Reaching it raises DoesNotFit saying so (README, "The ladder").
MAX_ATTEMPTS_PER_BATCH = 1000


@dataclass(frozen=True)
class Attempt:
    """One try of one global batch under one plan."""

    plan: Plan
    outcome: str            # "ok" | "oom" | "withdrawn" (another error: the move that made the plan is withdrawn)
    reason: str             # why this plan was tried
    peak_bytes: int
    step: int = 0           # the global step (0-based) the attempt belonged to
    error: str = ""         # the OOM message, for outcome "oom"
    # Where a failure happened: one of ladder.PHASES ("copy-in", "forward", "backward",
    # "optimizer.state", "optimizer.step") for autofit's own step; "trainer.train" for the Trainer
    # integration (its step runs inside transformers); "" for an "ok" attempt or a phase not reached.
    where: str = ""
    memory: dict = field(default_factory=dict)  # bytes by kind at the failure (+ "step": the
                                                # optimizer step's own temporaries, for its phases)
    unavailable: dict = field(default_factory=dict)  # {plan field: why turning it on cannot run
                                                     # for this job}, at a failure (explain's fixes)

    def describe(self) -> str:
        text = f"step {self.step}: {self.plan.describe()} -> {self.outcome}"
        if self.peak_bytes:
            text += f" (peak {format_size(self.peak_bytes)})"
        if self.outcome in ("oom", "withdrawn"):
            text += f" in {self.where}: {self.error}"
        return text + f" [{self.reason}]"


@dataclass(frozen=True)
class Outcome:
    """What one attempt came to; it holds no exception, traceback or tensor of the attempt."""

    ok: bool
    value: object = None    # what the work returned, when ok
    error: str = ""         # the first line of the OOM message, when not
    found: object = None    # what `inspect(error)` read at the failure, inside the except block
    fragmentation: object = None  # gpu.fragmentation.measure at the failure (None: not the cache's)
    peak: int = 0           # the attempt's peak, as the caller's `peak()` reads it
    baseline: int = 0       # bytes allocated on the device before the attempt
    oom: bool = True        # False: another error, caught because the caller's `also` took it


def outside(device, model=None, optimizer=None):
    """A `holders` for `Attempter`: the live device tensors that are neither `model`'s parameters
    and buffers nor `optimizer`'s state (what a failed attempt may have left behind)."""
    def holders() -> list:
        known = set()
        if model is not None:
            known |= {id(t.untyped_storage()) for t in model.parameters()}
            known |= {id(t.untyped_storage()) for t in model.buffers()}
        if optimizer is not None:
            known |= {id(v.untyped_storage()) for v in optimizer_state.state_tensors(optimizer)}
        return [t for t in device.live_tensors() if id(t.untyped_storage()) not in known]
    return holders


class Attempter:
    """Runs attempts on `device`, one at a time (see the module docstring).

    - `owner() -> (model, optimizer)`: the job's own; `release` drops their gradients, and with
      `grows` the bytes they gain during an attempt (a lazily registered buffer, optimizer state
      made at a first step) are theirs, not the attempt's, where the device counts its bytes;
    - `holders() -> tensors`: what to name when memory stays above the baseline (default: the
      live tensors outside the owner's, `outside`);
    - `free()`: the caller's own references to drop after the except block, before `release`;
    - `catches(error) -> bool`: which errors are an attempt's out-of-memory (default `is_oom`);
      every other error propagates untouched.
    """

    def __init__(self, device, owner=None, *, holders=None, grows: bool = False, free=None,
                 catches=is_oom):
        self.device = device
        self.owner = owner if owner is not None else (lambda: (None, None))
        self.holders = holders if holders is not None else (lambda: outside(device, *self.owner())())
        self.grows, self.free, self.catches = grows, free, catches
        self._owned_at = None  # (allocated bytes, owned bytes) when the owner's bytes were last counted
        # The keys (a global batch and plan, an evaluation batch and size) given their one replay.
        self.replayed: set = set()

    def __call__(self, work, *, inspect=None, peak=None, also=None) -> Outcome:
        """`work()` once; `inspect(error)` reads the failure while it is happening (it must keep
        no tensor), `peak()` the attempt's peak after it; `also(error) -> bool` takes errors that
        are not out-of-memory as this attempt's failure too (a move that cannot run), freed alike."""
        baseline = self.device.memory_allocated()
        owned = self._owned_before(baseline) if self.grows and self.device.counts else None
        failure = None
        try:
            value = work()
        except Exception as error:
            oom = self.catches(error)
            if not oom and not (also is not None and also(error)):
                raise
            # Read while the failed blocks are still held: afterwards the holes are gone.
            failure = (summarize(error) if oom else error_text(error),
                       None if inspect is None else inspect(error),
                       fragmentation.measure(self.device, error) if oom else None, oom)
        peak_bytes = 0 if peak is None else peak()
        if failure is None:
            return Outcome(True, value, peak=peak_bytes, baseline=baseline)
        # Out of the except block: the failed attempt's frames are gone; free what they held.
        if self.free is not None:
            self.free()
        model, optimizer = self.owner()
        # Cycles are collected only as far as memory is above the baseline (a full collection
        # scans every object transformers left: slow); `check` then reads the same memory.
        settled = (lambda: self.above(baseline, owned) <= 0) if self.device.counts else None
        release(self.device, model=model, optimizer=optimizer, settled=settled)
        self.check(baseline, owned)
        return Outcome(False, error=failure[0], found=failure[1], fragmentation=failure[2], peak=peak_bytes,
                       baseline=baseline, oom=failure[3])

    def replay_once(self, key) -> bool:
        """The one rule for replaying the same work: each `key` (a global batch and plan, an
        evaluation batch and size) gets one replay, for whatever reason; True when it gets it now."""
        if key in self.replayed:
            return False
        self.replayed.add(key)
        return True

    def empty_cache_for_replay(self, outcome: Outcome, key) -> str | None:
        """When the cache's holes caused `outcome`'s failure and `key` has not had its replay: empty
        the cache and return the reason to replay the same work (gpu/fragmentation); else None.
        The replay is no verdict on the plan: callers record nothing about its size."""
        if key in self.replayed:
            return None
        why = fragmentation.retry_reason(self.device, outcome.fragmentation)
        return why if why and self.replay_once(key) else None

    def check(self, baseline: int, owned: int | None = None) -> None:
        """MemoryNotReleased when more than `baseline` (plus the device's library workspaces) stays
        allocated; `owned`: the owner's bytes before the attempt, when its growth is allowed."""
        # The device's library workspaces, taken by the first kernels and kept by design.
        slack = Workspaces.of_device(self.device).resident
        extra = self.above(baseline, owned, slack)
        if extra <= slack:
            return
        raise MemoryNotReleased(extra, *self._named())

    def above(self, baseline: int, owned: int | None = None, slack: int = 0) -> int:
        """Bytes allocated above `baseline`, less the owner's growth since `owned` (counted only
        when more than `slack` is above: it walks the owner's tensors)."""
        extra = self.device.memory_allocated() - baseline
        if extra > slack and owned is not None:
            extra -= max(self._owned() - owned, 0)
        return extra

    def _named(self) -> tuple[str, str | None]:
        """(the tensors still held, the fix when the model's own attributes hold them)."""
        # A function of its own: the holders die with its frame, not pinned by the error's traceback.
        holders = self.holders()
        model = self.owner()[0]
        in_model = attempt_writes.holders(model, holders) if model is not None else []
        return (describe_tensors(holders) if holders else "no tensor Python can see",
                attempt_writes.fix_for(in_model) if in_model else None)

    def _owned(self) -> int:
        """Device bytes of the owner's parameters and buffers and of its optimizer's state."""
        model, optimizer = self.owner()
        held = by_kind(self.device, model, optimizer)
        return held["params"] + held["optimizer"]

    def _owned_before(self, allocated: int) -> int:
        """`_owned()` before an attempt, counted again only when the allocated bytes moved since the
        last count: between steady steps they do not, so the per-step path walks no tensor."""
        if self._owned_at is None or self._owned_at[0] != allocated:
            self._owned_at = (allocated, self._owned())
        return self._owned_at[1]


def walk(once, step_down, state, *, max_attempts: int | None = None):
    """Attempt until one fits: `once(state) -> Outcome` tries the state's plan; after a failed
    attempt `step_down(state, outcome)` records it and returns the state to attempt next, or None
    when nothing is left to try. Returns (the last outcome, the state that would be attempted next:
    None when the walk ended for want of one). Other errors propagate.

    The first attempt runs plainly, so a global batch that fits costs one call; after a failure
    tenacity's `Retrying` is the loop: it retries while the outcome is a failure, its `after` hook
    is the step-down, and it stops when the step-down left nothing or after `max_attempts` in all."""
    outcome = once(state)
    if outcome.ok:
        return outcome, state
    walked = _Walked(step_down, step_down(state, outcome))
    if walked.state is None or max_attempts == 1:
        return outcome, walked.state
    stop = _NothingLeft(walked)
    if max_attempts is not None:
        stop = stop | stop_after_attempt(max_attempts - 1)
    retrying = Retrying(retry=retry_if_result(lambda outcome: not outcome.ok), after=walked.after, stop=stop,
                        wait=wait_none(), sleep=lambda _: None, reraise=True,
                        retry_error_callback=lambda retry_state: retry_state.outcome.result())
    return retrying(lambda: once(walked.state)), walked.state


class _Walked:
    """The state a walk attempts next, as its step-downs leave it."""

    def __init__(self, step_down, state):
        self.step_down, self.state = step_down, state

    def after(self, retry_state) -> None:
        """tenacity's `after` hook, run after each failed attempt: the step-down."""
        self.state = self.step_down(self.state, retry_state.outcome.result())


class _NothingLeft(stop_base):
    """Stop when the last step-down left nothing to attempt."""

    def __init__(self, walked: _Walked):
        self.walked = walked

    def __call__(self, retry_state) -> bool:
        return self.walked.state is None


def until_fits(once, after_failure, *, max_attempts: int | None = None) -> Outcome:
    """`walk` for callers that keep their own state: `once() -> Outcome`, and `after_failure(outcome)`
    records a failure and sets up the next attempt, False when nothing is left to try. Returns
    the last outcome."""
    outcome, _ = walk(lambda _: once(), lambda _, outcome: True if after_failure(outcome) else None, True,
                      max_attempts=max_attempts)
    return outcome


def next_down(ladder, plan: Plan, global_batch: int, *, phase: str = "", not_applicable=None, failed=None,
              said: set | None = None, quiet: bool = False):
    """(plan, why): the ladder's first step below `plan` (the moves for `phase` first; each move is
    given the true `global_batch`) that applies to the job (`not_applicable(plan) -> reason | None`) and is
    not known to fail (`failed(plan)`), walking on past those that are; None when no step is left or
    the moves go round in circles. A move skipped because it does not apply is logged once per
    reason (`said`: the reasons already given) and named in `why`."""
    said = set() if said is None else said
    current, seen = plan, {plan}
    while True:
        new, why, skipped = step_down(ladder, current, phase, not_applicable, global_batch)
        for move, reason in skipped:
            if reason not in said:
                said.add(reason)
                why = f"{why} ({move!r} skipped: {reason})" if new is not None else why
                if not quiet:
                    log.warning("%s; the ladder goes on without it", reason)
        if new is None:
            return None
        new = new.with_micro_batch(new.micro_batch_size, global_batch)  # for moves that see only the plan
        if new in seen:
            return None  # a move that goes round in circles has no step left
        if failed is None or not failed(new):
            return new, why
        current = new  # a plan already seen to fail: keep stepping
        seen.add(new)
