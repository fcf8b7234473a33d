"""The retry controller: one global batch, attempted under a plan until one fits.

An attempt that runs out of memory is summarised to text inside its `except` block; everything
else happens after the block has exited, when no frame of the failed attempt is alive: gradients
dropped, cycles collected, cache emptied, memory checked against the pre-attempt baseline, the
plan stepped down, and the same global batch replayed. tenacity drives the loop: retry while the
outcome is an OOM, stop when the ladder has no step left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from tenacity import Retrying, retry_if_result, stop_after_attempt, wait_none
from tenacity.stop import stop_base

from autofit.engine.batches import batch_size, row_elements
from autofit.gpu.device import _tensors, describe_tensors
from autofit.errors import DoesNotFit, MemoryNotReleased
from autofit.plans.ladder import SizeLog, step_down
from autofit.plans.sizelog import Unguided
from autofit.diagnosis.leaks import on_device_predicate
from autofit.gpu.memory import by_kind, storage_bytes
from autofit.gpu.oom import is_oom, release, summarize
from autofit.plans.plan import Plan
from autofit.engine.replay import StartState
from autofit.sizes import format_size

log = logging.getLogger("autofit")

CUDA_BASELINE_SLACK = 64 << 20  # cuBLAS/cuDNN workspaces stay cached by design after a first use
# A failure this run recorded is forgotten after this many good global steps (then twice as many
# each time it comes back), so one bad moment (fragmentation, another process) is not a verdict
# for the rest of the run: the micro-batch search probes above it again. See README, "The ladder".
EXPIRE_AFTER = 100


@dataclass(frozen=True)
class Attempt:
    """One try of one global batch under one plan."""

    plan: Plan
    outcome: str            # "ok" | "oom"
    reason: str             # why this plan was tried
    peak_bytes: int
    step: int = 0           # the global step (0-based) the attempt belonged to
    error: str = ""         # the OOM message, for outcome "oom"
    where: str = ""         # ladder.PHASES: "forward", "backward", "optimizer.state", "optimizer.step"
    memory: dict = field(default_factory=dict)  # bytes by kind at the failure (+ "step": the
                                                # optimizer step's own temporaries, for its phases)

    def describe(self) -> str:
        text = f"step {self.step}: {self.plan.describe()} -> {self.outcome}"
        if self.peak_bytes:
            text += f" (peak {format_size(self.peak_bytes)})"
        if self.outcome == "oom":
            text += f" in {self.where}: {self.error}"
        return text + f" [{self.reason}]"


@dataclass
class _Outcome:
    ok: bool
    loss: float | None = None


class _LadderExhausted(stop_base):
    def __init__(self, controller: "Controller"):
        self.controller = controller

    def __call__(self, retry_state) -> bool:
        return self.controller.next_plan is None


class Controller:
    def __init__(self, runner, ladder, plan: Plan, *, sizes: SizeLog | None = None,
                 reason: str = "start: the whole global batch at once", max_attempts: int = 64,
                 probe_up: bool = True, settle_within: float = 0.0, on_attempt=None,
                 quiet: bool = False, expire_after: int | None = None, guide=None):
        self.runner, self.ladder = runner, ladder
        # Calibrated estimates for the upward search (autofit.estimator.guide.Guide), or none.
        self.guide = guide if guide is not None else Unguided()
        self.device, self.model = runner.device, runner.model
        self.sizes = sizes if sizes is not None else SizeLog()
        self.plan, self.reason = plan, reason
        self.probe_up, self.settle_within = probe_up, settle_within
        self.on_attempt = on_attempt
        self.quiet = quiet  # progress=False: no step-down logging either
        self.attempts: list[Attempt] = []
        # What this run proved (sizes that trained a global batch): a failure of one of them is
        # retried once before it counts, since it fitted rows this long before.
        self.proven = SizeLog()
        self._owned_at = None  # (allocated bytes, owned bytes) when the model's bytes were last counted
        self._retried: set = set()        # (step, plan) already given their one retry
        self._failed: list = []           # (plan, length) failures this run recorded, until they expire
        self.expire_after = EXPIRE_AFTER if expire_after is None else expire_after
        self._good_steps = 0              # good global steps since the last recorded failure
        self._good_total = 0              # good global steps of this run
        self._said: set = set()           # reasons for skipping a move, each said once
        self.next_plan: Plan | None = None
        self._next_reason = ""
        self.start = StartState(self.model, runner.optimizer, self.device)
        self._retrying = Retrying(
            retry=retry_if_result(lambda outcome: not outcome.ok),
            stop=_LadderExhausted(self) | stop_after_attempt(max_attempts),
            wait=wait_none(), sleep=lambda _: None, reraise=True,
            retry_error_callback=lambda state: state.outcome.result())

    # -- public --------------------------------------------------------------------------------
    def train(self, batch, step: int) -> float:
        """Train one global batch; returns its loss. Raises DoesNotFit when nothing fits."""
        global_batch = batch_size(batch)
        self.plan = self.plan.with_micro_batch(self.plan.micro_batch_size, global_batch)
        self.sizes.length = row_elements(batch)
        self._size_for_length(global_batch)
        self._fallback = None
        # No probe on a run's first step: the optimizer state does not exist yet, so a size that
        # fits then proves nothing about the steps after it.
        if self.probe_up and self.attempts:
            bigger = self.sizes.probe_up(self.plan, global_batch, guess=self.guide.largest)
            if bigger is not None and self._worth_probing(bigger):
                self._fallback, self._fallback_reason = self.plan, self.reason
                self.plan, self.reason = bigger, (f"probe a larger micro-batch ({self.plan.micro_batch_size}"
                                                  f" fits, searching upward)")
        self.start.capture(batch)  # every attempt of this batch starts from this state
        try:
            outcome = self._retrying(self._attempt, batch, step, global_batch)
        finally:
            self.start.release()  # no reference to the batch outlives its step
        if not outcome.ok:
            failed = [a for a in self.attempts if a.step == step]
            last = failed[-1] if failed else None
            raise DoesNotFit(
                f"no plan of the ladder fits global batch {global_batch} at step {step} on "
                f"{self.device.describe()}; the model is as it was before this batch. Lower the "
                f"global batch, give a larger budget, or allow offload/checkpointing in the ladder.",
                attempts=self.attempts, breakdown=last.memory if last else None,
                budget=self.device.budget)
        return outcome.loss

    def _size_for_length(self, global_batch: int) -> None:
        """Take the micro-batch proven for rows as long as this batch's: up after long batches,
        down when a batch is longer than those the current size was proven on."""
        plan, length = self.plan, self.sizes.length
        proven = self.sizes.fit(plan)
        if proven is not None:
            why = f"the micro-batch proven for rows this long ({length} elements per row)"
        else:
            longest = self.sizes.longest_fit(plan)
            if longest is None or longest[1] >= plan.micro_batch_size:
                return  # nothing proven, or nothing smaller proven: try the plan as it is
            proven = longest[1]
            why = (f"rows of {length} elements, longer than any trained so far: the micro-batch "
                   f"proven for the longest ({longest[0]})")
        sized = plan.with_micro_batch(proven, global_batch)
        if sized != plan:
            self.plan, self.reason = sized, why

    # -- one attempt ---------------------------------------------------------------------------
    def _attempt(self, batch, step: int, global_batch: int) -> _Outcome:
        plan, reason = self.plan, self.reason
        baseline = self.device.memory_allocated()
        owned = self._owned_before(baseline) if self.device.counts else 0
        failure = None
        batch = self.start.begin()  # a replay: RNG, buffers, param_groups and batch as before
        try:
            loss = self.runner.run(batch, plan)
        except Exception as error:
            if not is_oom(error):
                raise
            where = getattr(self.runner, "phase", "") or (
                "optimizer.step" if "in optimizer.step" in str(error) else "forward/backward")
            memory = by_kind(self.device, self.model, self.runner.optimizer)
            # Held before the attempt but neither weights nor this optimizer's state: a previous
            # phase's optimizer, batches parked on the device, tensors kept across steps.
            # The global batch autofit read onto the device is not the user's to free.
            batch_bytes = storage_bytes(_tensors(batch), on_device=on_device_predicate(self.device))
            memory["other"] = min(max(baseline - memory["params"] - memory["optimizer"] - batch_bytes, 0),
                                  memory["activations"])
            memory["activations"] -= memory["other"]
            if batch_bytes:
                memory["batch"] = min(batch_bytes, memory["activations"])
                memory["activations"] -= memory["batch"]
            at_failure = getattr(getattr(self.runner, "atomic", None), "failed_at", None)
            if where.startswith("optimizer") and at_failure is not None:
                # The step's temporaries (and state it made) are gone by now: what it held when it
                # failed is the memory at the failure less what is still here.
                memory["step"] = max(at_failure - sum(memory.values()), 0)
            failure = (summarize(error), where, memory)
        peak = self.runner.attempt_peak()
        if failure is None:
            self._record(Attempt(plan, "ok", reason, peak, step))
            self.sizes.record(plan, True, global_batch)
            if self._good_total:  # the run's first step made the optimizer state: it proves less
                self.proven.record(plan, True, global_batch, length=self.sizes.length)
                self.guide.observe(plan, peak, self.sizes.length)
            self._good_total += 1
            self.reason = "kept: fitted the previous global batch"
            self._expire()
            return _Outcome(True, loss)
        # Out of the except block: the failed attempt's frames are gone; free what they held.
        text, where, memory = failure
        self.runner.abandon()
        release(self.device, model=self.model, optimizer=self.runner.optimizer)
        self._check_baseline(baseline, owned)
        self._record(Attempt(plan, "oom", reason, peak, step, text, where, memory))
        if self._retry_once(plan, step, global_batch, text):
            return _Outcome(False)
        self.sizes.record(plan, False, global_batch)
        self._failed.append((plan.with_micro_batch(plan.micro_batch_size, global_batch), self.sizes.length))
        self._good_steps = 0
        self._step_down(plan, global_batch, text, where)
        return _Outcome(False)

    def _retry_once(self, plan: Plan, step: int, global_batch: int, text: str) -> bool:
        """A size this run proved at this row length (on a step after the first, with the optimizer
        state in place) that fails now may have met a transient shortage: replay the same plan
        once, after release, before the failure counts."""
        proven = self.proven.fit(plan, self.sizes.length)
        if proven is None or proven < min(plan.micro_batch_size, global_batch) \
                or (step, plan) in self._retried:
            return False
        self._retried.add((step, plan))
        self._fallback = None
        self.next_plan = plan
        self.reason = ("retry: this micro-batch trained rows this long before, so the failure may be "
                       "transient; retried once after release before it counts")
        if not self.quiet:
            log.warning("out of memory under %s (%s), which fitted rows this long before; retrying it "
                        "once after release", plan.describe(), text)
        return True

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

    def _step_down(self, plan: Plan, global_batch: int, text: str, where: str = "") -> None:
        fallback, self._fallback = self._fallback, None
        if fallback is not None and not self.sizes.known_to_fail(fallback):
            new, why = fallback, "back to the largest micro-batch known to fit"
        else:
            new, why = self._next_down(plan, global_batch, where)
        self.next_plan = new
        if new is None:
            if not self.quiet:
                log.warning("out of memory under %s (%s); the ladder has no step left",
                            plan.describe(), text)
            return
        if not self.quiet:
            log.warning("out of memory under %s (%s); stepping down to %s: %s",
                        plan.describe(), text, new.describe(), why)
        self.plan, self.reason = new, why

    def _next_down(self, plan: Plan, global_batch: int, where: str = ""):
        """The next plan down: the moves for the phase that failed first (where the runner's phases
        are the same on every rank), skipping moves that do not apply to this job."""
        current, seen = plan, {plan}
        phase = where if getattr(self.runner, "phase_steers_ladder", False) else ""
        applies = getattr(self.runner, "not_applicable", None)
        while True:
            new, why, skipped = step_down(self.ladder, current, phase, applies, global_batch)
            for move, reason in skipped:
                if reason not in self._said:
                    self._said.add(reason)
                    why = f"{why} ({move!r} skipped: {reason})" if new is not None else why
                    if not self.quiet:
                        log.warning("%s; the ladder goes on without it", reason)
            if new is None:
                return None, ""
            new = new.with_micro_batch(new.micro_batch_size, global_batch)
            if new in seen:
                return None, ""  # a move that goes round in circles has no step left
            if not self.sizes.known_to_fail(new):
                return new, why
            current = new  # a size already seen to fail: keep stepping
            seen.add(new)

    def _worth_probing(self, bigger: Plan) -> bool:
        if self.settle_within <= 0:
            return True
        ceiling = self.sizes.fail(bigger)
        fit = self.plan.micro_batch_size
        return ceiling is None or (ceiling - 1 - fit) > fit * self.settle_within

    def _owned(self) -> int:
        """Device bytes of the model's parameters and buffers and of the optimizer's state."""
        held = by_kind(self.device, self.model, self.runner.optimizer)
        return held["params"] + held["optimizer"]

    def _owned_before(self, allocated: int) -> int:
        """`_owned()` before an attempt, counted again only when the allocated bytes moved since the
        last count: between steady steps they do not, so the per-step path walks no tensor."""
        if self._owned_at is None or self._owned_at[0] != allocated:
            self._owned_at = (allocated, self._owned())
        return self._owned_at[1]

    def _check_baseline(self, baseline: int, owned: int = 0) -> None:
        slack = CUDA_BASELINE_SLACK if self.device.type == "cuda" else 0
        extra = self.device.memory_allocated() - baseline
        if extra > slack and self.device.counts:
            # Buffers and parameters the model made during the attempt (a lazily registered
            # buffer, a LazyLinear) belong to the model, not to the failed attempt.
            extra -= max(self._owned() - owned, 0)
        if extra <= slack:
            return
        known = {id(t.untyped_storage()) for t in self.model.parameters()}
        known |= {id(t.untyped_storage()) for t in self.model.buffers()}
        for entry in self.runner.optimizer.state.values():
            known |= {id(v.untyped_storage()) for v in entry.values() if isinstance(v, torch.Tensor)}
        holders = [t for t in self.device.live_tensors() if id(t.untyped_storage()) not in known]
        raise MemoryNotReleased(extra, describe_tensors(holders) if holders else "no tensor Python can see")

    def _record(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)
        if self.on_attempt is not None:
            self.on_attempt(attempt)
