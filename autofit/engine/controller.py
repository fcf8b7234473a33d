"""The retry controller: one global batch, attempted under a plan until one fits.

Where the search for a plan stands is one value, `Search` (the plan to attempt and why, the proven
plan an upward probe left, the batch's last out-of-memory attempt); each failed attempt turns one
`Search` into the next (`_after_failure`), and `engine.attempt.walk` (tenacity after the first
failure) attempts each in turn until one fits or the ladder has no step left. The controller keeps
what the run learns across batches: the attempts, the sizes that fitted or failed, the withdrawn
moves.

Each attempt is an `engine.attempt.Attempter` attempt: the OOM is only read inside its `except`
block (`read_failure`: the facts the runner reports); after the block has exited, when no frame of
the failed attempt is alive, the runner forgets the attempt, gradients are dropped, cycles
collected, the cache emptied and memory checked against the pre-attempt baseline. The step-down
then records the attempt and moves the plan down (or replays a proven plan once), and the same
global batch is replayed from the same start state.
(`Attempt` is defined in engine/attempt; it is still importable from here.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial

from autofit.engine import attempt as attempts_
from autofit.engine.attempt import Attempt, Attempter, next_down, walk
from autofit.engine.attempt_log import AttemptLog
from autofit.engine.interfaces import Guide, Runner
from autofit.engine.batches import rows_of, row_elements
from autofit.engine.replay import StartState
from autofit.engine.rules import Rules
from autofit.engine.withdrawal import MOVES, Withdrawals
from autofit.errors import DoesNotFit
from autofit.sizes import format_size
from autofit.gpu.device import _tensors
from autofit.gpu.fragmentation import requested
from autofit.gpu.memory import by_kind, on_device_predicate, storage_bytes
from autofit.plans.applies import unavailable_changes
from autofit.plans.reach import advice
from autofit.plans.sizelog import SizeLog
from autofit.plans.plan import Plan
from autofit.plans.sizelog import Unguided

log = logging.getLogger("autofit")

# A failure this run recorded is forgotten after this many good global steps (then twice as many
# each time it comes back), so one bad moment (fragmentation, another process) is not a verdict
# for the rest of the run: the micro-batch search probes above it again. See README, "The ladder".
EXPIRE_AFTER = 100


def reached(memory: dict, text: str) -> int | None:
    """Bytes a failed attempt is known to have needed at least: what it held when it failed (the
    breakdown's kinds) plus the allocation that failed, whose size the message gives to two
    decimals of its unit (taken at the low end of that rounding); None without a size."""
    asked = requested(RuntimeError(text))  # (it reads an error's message; the outcome keeps the text)
    if asked is None:
        return None
    unit = next((u for u in (2**30, 2**20, 2**10) if asked >= u), 1)
    return sum(memory.values()) + asked - (unit // 200 if unit > 1 else 0)


@dataclass(frozen=True)
class Search:
    """Where the search for a plan that fits one global batch stands."""

    plan: Plan              # the plan to attempt next
    reason: str             # why
    fallback: Plan | None = None  # the proven plan an upward probe left, to go back to
    oom: tuple | None = None      # (plan, phase, message) of this batch's last out-of-memory attempt

    def then(self, plan: Plan, reason: str, **changes) -> "Search":
        return replace(self, plan=plan, reason=reason, **changes)


@dataclass(frozen=True)
class Refusals:
    """Why a plan cannot run for this job: the runner's rule, a move withdrawn in this run, or the
    job's own rules (allow_split=False)."""

    runner: Runner
    withdrawals: Withdrawals
    rules: Rules

    def __call__(self, plan: Plan) -> str | None:
        return self.runner.not_applicable(plan) or self.withdrawals.reason(plan) or self.rules.refuses(plan)


def read_failure(runner: Runner, error) -> tuple:
    """What the runner reports of a failed attempt, read inside the except block while the failed
    blocks are held: (phase, bytes by kind, the atomic step's bytes at its failure)."""
    held = by_kind(runner.device, runner.model, runner.optimizer)
    return runner.phase, held, runner.atomic.failed_at


@dataclass(frozen=True)
class Policy:
    """How the controller searches, whatever the job."""

    probe_up: bool = True        # search above a size that fits, once a step has trained
    settle_within: float = 0.0   # stop probing up when the gap to a failed size is within this fraction
    quiet: bool = False          # progress=False: no step-down logging either
    max_attempts: int | None = None  # attempts per global batch (None: engine.attempt.MAX_ATTEMPTS_PER_BATCH)
    expire_after: int | None = None  # good steps before a failure is forgotten (None: EXPIRE_AFTER)


class Controller:
    def __init__(self, runner: Runner, ladder, plan: Plan, *, reason: str = "start: the whole global batch at once",
                 sizes: SizeLog | None = None, guide: Guide | None = None, rules: Rules | None = None,
                 policy: Policy = Policy()):
        self.runner, self.ladder = runner, ladder
        self.rules = rules if rules is not None else Rules()  # the job's own refusals and last resort
        # Calibrated estimates for the upward search (autofit.estimator.guide.Guide), or none.
        self.guide = guide if guide is not None else Unguided()
        self.device, self.model = runner.device, runner.model
        self.sizes = sizes if sizes is not None else SizeLog()
        self.plan, self.reason = plan, reason  # the run's plan: the last attempted, and why
        self.probe_up, self.settle_within, self.quiet = policy.probe_up, policy.settle_within, policy.quiet
        self.attempts = AttemptLog()  # every attempt; a run of alike successes is one entry
        # What this run proved (sizes that trained a global batch): a failure of one of them is
        # retried once before it counts, since it fitted rows this long before.
        self.proven = SizeLog()
        self._failed: list = []           # (plan, length) failures this run recorded, until they expire
        self.expire_after = EXPIRE_AFTER if policy.expire_after is None else policy.expire_after
        self._good_steps = 0              # good global steps since the last recorded failure
        self._good_total = 0              # good global steps of this run
        self._said: set = set()           # reasons for skipping a move, each said once
        self.withdrawals = Withdrawals()  # moves whose plan raised what the plan before did not
        self.refusals = Refusals(runner, self.withdrawals, self.rules)
        self._tried: set = set()          # plans attempted in this run (a move's first attempt)
        self.verdict = ""                 # why no plan can fit, found from one attempt
        # attempts of one global batch: a safety cap (engine.attempt.MAX_ATTEMPTS_PER_BATCH), no verdict
        self.max_attempts = policy.max_attempts or attempts_.MAX_ATTEMPTS_PER_BATCH
        self.start = start = StartState(self.model, runner.optimizer, self.device)
        rules = self.rules

        def forget_attempt() -> None:
            runner.abandon()
            start.failed()
            rules.failed()
        # Buffers and parameters the model makes during an attempt (a lazily registered buffer, a
        # LazyLinear) and optimizer state belong to the job, not to the failed attempt: `grows`.
        self.attempter = Attempter(self.device, lambda: (runner.model, runner.optimizer), grows=True,
                                   free=forget_attempt)
        self._read_failure = partial(read_failure, runner)
        # Leaves outside the model keep their gradients; a sharded model's own leaves are FSDP's business.
        self._before_backward = None if runner.distributed else start.reached

    # -- public --------------------------------------------------------------------------------
    def resume(self, plan: Plan, reason: str) -> None:
        """Go on from `plan` (a stepper's state_dict loaded mid-run), saying why."""
        self.plan, self.reason = plan, reason

    def close(self) -> None:
        """The run is over: let go of the runner, the start state and the attempter, which hold the
        model's optimizer (the caller decides how long that lives)."""
        self.runner = self.start = self.attempter = self._before_backward = self._read_failure = None

    def train(self, batch, step: int, shape: tuple | None = None) -> float:
        """Train one global batch; returns its loss. Raises DoesNotFit when nothing fits. `shape`:
        the (rows, elements per row) the plan covers when not the batch's own (under
        torch.distributed the same on every rank, whatever this rank's share)."""
        global_batch, self.sizes.length = (rows_of(batch), row_elements(batch)) if shape is None else shape
        search = self._opening(global_batch)
        self.start.capture(batch)  # every attempt of this batch starts from this state
        try:
            outcome, left = walk(partial(self._attempt, step=step, global_batch=global_batch),
                                 partial(self._after_failure, step=step, global_batch=global_batch),
                                 search, max_attempts=self.max_attempts)
        finally:
            self.start.release()  # no reference to the batch outlives its step
        if not outcome.ok:
            raise self._does_not_fit(step, global_batch, left)
        return outcome.value

    def _opening(self, global_batch: int) -> Search:
        """The batch's first plan: the run's plan sized for this batch's rows, or, once a step has
        trained, a larger micro-batch to probe with the run's plan to fall back to."""
        plan = self.plan.with_micro_batch(self.plan.micro_batch_size, global_batch)
        search = self._sized_for_length(Search(plan, self.reason), global_batch)
        # No probe on a run's first step: the optimizer state does not exist yet, so a size that
        # fits then proves nothing about the steps after it.
        if not self.probe_up or not self.attempts:
            return search
        bigger = self.sizes.probe_up(search.plan, global_batch, guess=self.guide.largest)
        if bigger is None or not self._worth_probing(search.plan, bigger) or self.refusals(bigger) is not None:
            return search
        why = f"probe a larger micro-batch ({search.plan.micro_batch_size} fits, searching upward)"
        return search.then(bigger, why, fallback=search.plan)

    def _sized_for_length(self, search: Search, global_batch: int) -> Search:
        """Take the micro-batch proven for rows as long as this batch's: up after long batches,
        down when a batch is longer than those the current size was proven on."""
        plan, length = search.plan, self.sizes.length
        proven = self.sizes.fit(plan)
        if proven is not None:
            why = f"the micro-batch proven for rows this long ({length} elements per row)"
        else:
            longest = self.sizes.longest_fit(plan)
            if longest is None or longest[1] >= plan.micro_batch_size:
                return search  # nothing proven, or nothing smaller proven: try the plan as it is
            proven = longest[1]
            why = (f"rows of {length} elements, longer than any trained so far: the micro-batch "
                   f"proven for the longest ({longest[0]})")
        sized = plan.with_micro_batch(proven, global_batch)
        if sized == plan or self.rules.refuses(sized) is not None:
            return search
        return search.then(sized, why)

    def _does_not_fit(self, step: int, global_batch: int, left: Search | None) -> DoesNotFit:
        failed = self.attempts.of_step(step)
        last = failed[-1] if failed else None
        where = f"global batch {global_batch} at step {step} on {self.device.describe()}"
        if self.verdict:
            text = f"{where}: {self.verdict}"
        elif left is not None:  # the ladder had a plan left: the cap ended the walk
            text = (f"stopped after {len(failed)} attempts of {where}: autofit's safety cap of "
                    f"{self.max_attempts} attempts per global batch (the ladder still had "
                    f"{left.plan.describe()} to try); the model is as it was before this batch. A ladder "
                    f"this long or a memory this unsteady needs looking at: autofit.explain(error) lists "
                    f"the attempts.")
        else:
            text = (f"no plan of the ladder fits {where}; the model is as it was before this batch. "
                    f"{advice([a.plan for a in failed])}")
        return DoesNotFit(text, attempts=self.attempts, breakdown=last.memory if last else None,
                          budget=self.device.budget)

    # -- one attempt ---------------------------------------------------------------------------
    def _attempt(self, search: Search, *, step: int, global_batch: int):
        plan = search.plan
        self.plan, self.reason = plan, search.reason
        # begin(): a replay starts from the RNG, buffers, param_groups and batch as before
        outcome = self.attempter(lambda: self.runner.run(self.start.begin(), plan, self._before_backward),
                                 inspect=self._read_failure, peak=self.runner.attempt_peak,
                                 also=self._withdrawable(search))
        self._tried.add(plan)
        if outcome.ok:
            self._record(Attempt(plan, "ok", search.reason, outcome.peak, step))
            self.sizes.record(plan, True, global_batch)
            # The run's first step made the optimizer state, on the device: it proves less. An
            # offloaded step makes it in host memory, so its first step proves as much as any.
            if self._good_total or plan.offload_optimizer:
                self.proven.record(plan, True, global_batch, length=self.sizes.length)
            self.guide.observe(plan, outcome.peak, self.sizes.length, first=not self._good_total)
            self._good_total += 1
            self.reason = "kept: fitted the previous global batch"
            self._expire()
        return outcome

    def _withdrawable(self, search: Search):
        """For a move's first attempt, after the plan before it ran out of memory on this batch: an
        error that is not out-of-memory is the move's (withdrawn), unless it is one a withdrawn move
        raised already (then it is the user's code's) or it came from the optimizer step (whose
        partial update only an out-of-memory rollback undoes). None: every other error propagates."""
        before = _before_move(search)
        if before is None or search.plan in self._tried or self.runner.distributed:
            return None  # (under torch.distributed an error is announced to every rank: it propagates)
        return self.withdrawals.takes(lambda: self.runner.phase)

    def _withdraw(self, search: Search, outcome, step: int, global_batch: int) -> Search | None:
        """The move from the plan before (which ran out of memory) to this one raised another error:
        withdraw it for the rest of the run and step down from the plan before without it."""
        plan, text = search.plan, outcome.error
        before = _before_move(search)
        where_now = outcome.found[0] if outcome.found else ""
        self._record(Attempt(plan, "withdrawn", search.reason, outcome.peak, step, text, where_now))
        self.withdrawals.withdraw(plan, before, text)
        if search.oom is None:  # an upward probe: back to the plan it left, proven
            self.sizes.record(plan, False, global_batch)  # the search stops below it
            return search.then(before, "back to the largest micro-batch known to fit: the probe above it "
                                       "was withdrawn", fallback=None)
        _, where, oom_text = search.oom
        return self._step_down(search.then(before, search.reason), global_batch, oom_text, where)

    def _breakdown(self, outcome) -> tuple[str, dict]:
        where, memory, at_failure = outcome.found
        # Held before the attempt but neither weights nor this optimizer's state: a previous
        # phase's optimizer, batches parked on the device, tensors kept across steps.
        # The global batch autofit read onto the device is not the user's to free.
        batch_bytes = storage_bytes(_tensors(self.start.given), on_device=on_device_predicate(self.device))
        memory["other"] = min(max(outcome.baseline - memory["params"] - memory["optimizer"] - batch_bytes, 0),
                              memory["activations"])
        memory["activations"] -= memory["other"]
        if batch_bytes:
            memory["batch"] = min(batch_bytes, memory["activations"])
            memory["activations"] -= memory["batch"]
        if where.startswith("optimizer") and at_failure is not None:
            # The step's temporaries (and state it made) are gone by now: what it held when it
            # failed is the memory at the failure less what is still here.
            memory["step"] = max(at_failure - sum(memory.values()), 0)
        return where, memory

    def _after_failure(self, search: Search, outcome, *, step: int, global_batch: int) -> Search | None:
        """Record the failed attempt (the attempter has freed it) and return the search's next
        state; None when the ladder has no step left."""
        if not outcome.oom:
            return self._withdraw(search, outcome, step, global_batch)
        plan, text = search.plan, outcome.error
        where, memory = self._breakdown(outcome)
        search = replace(search, oom=(plan, where, text))
        unavailable = unavailable_changes(plan, self.refusals)
        self._record(Attempt(plan, "oom", search.reason, outcome.peak, step, text, where, memory, unavailable))
        if self._nothing_fits(outcome, where):
            return None
        # One replay of the same plan per global batch, for either reason: the cache's holes
        # (freed first) or a size this run proved.
        why = self.attempter.empty_cache_for_replay(outcome, (step, plan)) or self._untouched_step(where, step, plan)
        if why:
            if not self.quiet:
                log.warning("out of memory under %s (%s); %s", plan.describe(), text, why)
            return search.then(plan, why)
        retried = self._retry_once(search, step, global_batch, text)
        if retried is not None:
            return retried
        self.sizes.record(plan, False, global_batch)
        self.guide.failed(plan, self.sizes.length, reached=reached(memory, text))
        self._failed.append((plan.with_micro_batch(plan.micro_batch_size, global_batch), self.sizes.length))
        self._good_steps = 0
        return self._step_down(search, global_batch, text, where)

    def _nothing_fits(self, outcome, where: str) -> bool:
        """An attempt that failed copying its batch in while what the device held before it (the
        weights, the optimizer's state) already filled the budget: no plan can fit, since every
        plan keeps the weights on the device; said after this one attempt (on one process: ranks
        step down together, as their agreement decides)."""
        budget = self.device.budget
        if where != "copy-in" or budget is None or outcome.baseline < budget or self.runner.distributed:
            return False
        self.verdict = (f"the weights and what the device held before the step ({format_size(outcome.baseline)}) "
                        f"already fill the budget ({format_size(budget)}), so no plan can fit: use a smaller "
                        f"model, freeze part of it, or give a larger budget.")
        return True

    def _untouched_step(self, where: str, step: int, plan: Plan) -> str | None:
        """The reason to replay `plan` once when its optimizer step ran out of memory before it
        wrote anything (engine/atomic.Written): no verdict on the plan, as for any transient OOM."""
        if where != "optimizer.step" or not getattr(self.runner.atomic, "untouched", False) \
                or not self.attempter.replay_once((step, plan)):
            return None
        return ("the optimizer step ran out of memory before it wrote anything (parameters and state "
                "unchanged): the same plan replayed once before any step down")

    def _retry_once(self, search: Search, step: int, global_batch: int, text: str) -> Search | None:
        """A size this run proved at this row length (on a step after the first, with the optimizer
        state in place) that fails now may have met a transient shortage: replay the same plan
        once, after release, before the failure counts."""
        plan = search.plan
        proven = self.proven.fit(plan, self.sizes.length)
        if proven is None or proven < min(plan.micro_batch_size, global_batch) \
                or not self.attempter.replay_once((step, plan)):
            return None
        if not self.quiet:
            log.warning("out of memory under %s (%s), which fitted rows this long before; retrying it "
                        "once after release", plan.describe(), text)
        return search.then(plan, "retry: this micro-batch trained rows this long before, so the failure may be "
                                 "transient; retried once after release before it counts", fallback=None)

    def _expire(self) -> None:
        """After `expire_after` good global steps, forget the failures this run recorded (and wait
        twice as long next time), so the search probes above them again."""
        self._good_steps += 1
        if not self._failed or self._good_steps < self.expire_after:
            return
        for plan, length in self._failed:
            self.sizes.forget_fail(plan, length)
        if not self.quiet:
            log.info("%d out-of-memory failure(s) expired after %d good steps; probing above them again",
                     len(self._failed), self._good_steps)
        self._failed, self._good_steps = [], 0
        self.expire_after *= 2

    def _step_down(self, search: Search, global_batch: int, text: str, where: str = "") -> Search | None:
        """The next state down from `search.plan`: back to the plan an upward probe left, or the
        ladder's next plan; None when the ladder has no step left."""
        plan, fallback = search.plan, search.fallback
        if fallback is not None and not self.sizes.known_to_fail(fallback):
            new, why = fallback, "back to the largest micro-batch known to fit"
        else:
            new, why = self._judged(plan, *self._next_down(plan, global_batch, where), global_batch, where)
        if new is None:
            if not self.quiet:
                log.warning("out of memory under %s (%s); the ladder has no step left", plan.describe(), text)
            return None
        if not self.quiet:
            log.warning("out of memory under %s (%s); stepping down to %s: %s",
                        plan.describe(), text, new.describe(), why)
        return search.then(new, why, fallback=None)

    def _next_down(self, plan: Plan, global_batch: int, where: str = ""):
        """The next plan down: the moves for the phase that failed first (where the runner's phases
        are the same on every rank), skipping moves that do not apply to this job."""
        phase = where if self.runner.phase_steers_ladder else ""
        for ladder in (self.ladder, self.rules.reach):  # the ladder, then the plans its path passed by
            taken = None if ladder is None else next_down(
                ladder, plan, global_batch, phase=phase, not_applicable=self.refusals,
                failed=self.sizes.known_to_fail, said=self._said, quiet=self.quiet)
            if taken is not None:
                return taken
        return None, ""

    def _judged(self, plan: Plan, new, why: str, global_batch: int, where: str):
        """`new`, unless it is a precision or checkpointing move predicted to peak no lower than
        the same sizes without it: then the move is withdrawn (engine/withdrawal) and the ladder
        goes on from `plan` without it."""
        saves = getattr(self.guide, "saves", None)
        while new is not None and saves is not None:
            without = new.replace(**{f: getattr(plan, f) for f in MOVES})
            verdict = saves(new, without) if without != new else None
            if verdict is None or verdict[0]:
                break
            self.withdrawals.withdraw_costlier(new, without, verdict[1], verdict[2])
            new, why = self._next_down(plan, global_batch, where)  # its reason names the skipped move
        return new, why

    def _worth_probing(self, fit: Plan, bigger: Plan) -> bool:
        if self.settle_within <= 0:
            return True
        ceiling = self.sizes.fail(bigger)
        size = fit.micro_batch_size
        return ceiling is None or (ceiling - 1 - size) > size * self.settle_within

    def _record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)


def _before_move(search: Search) -> Plan | None:
    """The plan `search.plan` was moved from on this batch: the one that ran out of memory, or the
    proven plan an upward probe left (a larger micro-batch may raise what the proven one did not:
    a last micro-batch of one row that BatchNorm refuses); None for neither."""
    if search.oom is not None and search.plan != search.oom[0]:
        return search.oom[0]
    if search.oom is None and search.fallback is not None and search.plan != search.fallback:
        return search.fallback
    return None
