"""Evaluation of an FSDP2-sharded model in lockstep (the pace autofit.recipes.evaluate keeps under
torch.distributed when the model is sharded).

Every forward of a sharded model all-gathers each unit's parameters, so the ranks must run the same
number of forwards, and none may leave a forward that the others are still in. Each rank evaluates
its own share of the data (autofit.distributed.data.eval_share), and before each forward every rank
says how many rows it wants to run (its evaluation batch size, capped by the rows its current batch
has left; none when its share is done): the attempt's size is the most any rank wants, and every
rank runs its own rows up to it, or, once its share is done while others still have rows, one row
of its own data whose result is dropped, so the gathers pair. When no rank has rows left, evaluation
ends on every rank at the same forward. Inside the forward the guards of autofit.distributed.fsdp_guard
hold an agreement inside each unit's gather, and after it every rank says how it went: an OOM on
any rank makes every rank drop the attempt (FSDP's units resharded) and halve its size alike, since
each records the same size; any other error ends every rank, the failing one with its own error,
the others with RankFailed naming it.

The forward runs under `torch.no_grad()`, not inference mode: FSDP keeps the parameters it gathers
the first time for later gathers, and ones made in inference mode cannot be used by training.
"""

from __future__ import annotations

import contextlib

import torch

from autofit.distributed.agreement import BACKWARD, EVALUATE

NOTHING_LEFT = -1.0  # what a rank whose share is done reports as the rows it wants


class ShardedEvaluation:
    """The pace of evaluation for a sharded model under a `Lockstep` (see the module's docstring);
    autofit.recipes.eval_pace.Alone has the same interface."""

    grad_mode = staticmethod(torch.no_grad)

    def __init__(self, lockstep):
        self.lock = lockstep
        self.sharded = lockstep.sharded

    def size(self, want: int | None, failure: BaseException | None = None) -> int | None:
        """The agreement before a forward: the rows of this attempt (the most any rank wants), or
        None when every rank's share is done. A failure (reading the data) ends every rank."""
        lock = self.lock
        try:
            verdict = lock.agree(EVALUATE, failure, value=NOTHING_LEFT if want is None else float(want),
                                 host=lock._host)
        finally:
            failure = None
        wants = [int(v) for v in verdict.values() if v != NOTHING_LEFT]
        return max(wants) if wants else None

    @contextlib.contextmanager
    def forward(self):
        """Around one forward: an agreement before each of FSDP's gathers (in evaluation's phase, so
        it meets a failed rank's `after`)."""
        lock = self.lock
        lock.attempt_plan, lock.attempt_agreed, lock.attempt_phase = None, False, EVALUATE
        self.sharded.arm(True)
        try:
            yield
        finally:
            self.sharded.arm(False)
            lock.attempt_phase = BACKWARD

    def after(self, failure: BaseException | None) -> None:
        """The agreement after a forward: every rank raises what any rank's failure means for it.
        When a guard inside the forward already held it, this rank raises what it met there."""
        lock = self.lock
        if lock.attempt_agreed:
            lock.attempt_agreed = False
            try:
                raise failure
            finally:
                failure = None
        try:
            lock.agree(EVALUATE, failure, host=lock._host)
        finally:
            failure = None

    def call(self, module, kwargs):
        """One forward of the sharded model outside training and evaluation (token_loss's probe of
        whether its loss shifts labels), paced as an evaluation forward: every rank runs it at the
        same point, its gathers guarded; the model is left sharded."""
        failure, output = None, None
        try:
            with self.forward():
                output = module(**kwargs)
        except Exception as error:  # noqa: BLE001 -- every rank hears of it, then it is raised
            failure = error
        try:
            self.after(failure)
        finally:
            failure = None
            self.abandon()
        return output

    def abandon(self) -> None:
        """After a failed forward: every unit back to sharded and idle, wherever it stopped."""
        self.sharded.abandon()

    def close(self) -> None:
        """Evaluation leaves the parameters sharded (the root keeps its gathered ones after a forward)."""
        self.sharded.abandon()
