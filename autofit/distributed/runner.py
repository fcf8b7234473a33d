"""The global step of one rank in lockstep with the others (see autofit.distributed.lockstep): every
micro-batch weighted by its share of the global batch (all ranks' rows or label tokens), one
agreement after backward, the gradients summed, one optimizer step agreed inside the atomic step."""

from __future__ import annotations

import math

from autofit.distributed.agreement import BACKWARD
from autofit.distributed.clipping import agreed_prestep
from autofit.engine.batches import rows_of, slice_batch, split
from autofit.engine.batches import weights
from autofit.engine.step import StepRunner
from autofit.engine.token_loss import ITEMS
from autofit.plans.sizelog import config_of


class DistributedStepRunner(StepRunner):
    """A StepRunner whose global step is agreed between the ranks (see the module's docstring)."""

    phase_steers_ladder = False  # ranks fail in different phases; all must step down alike
    distributed = True  # an error on one rank is every rank's (announced): none is withdrawn

    def __init__(self, model, optimizer, device, *, lockstep, **kwargs):
        super().__init__(model, optimizer, device, **kwargs)
        self.lockstep = lockstep
        # A share with no label token adds nothing (its loss is 0/0); FSDP communicates inside
        # every micro-batch's forward and backward, so there none may be skipped.
        self.skip_empty = lockstep.sharded is None
        self.padding = 0  # micro-batches of the attempt under way that only pair FSDP's collectives

    @property
    def sharded(self):
        """The lockstep's FSDP2 switches (made when the ranks first agree), which the plan's FSDP
        settings are set on by their hooks (plans/switches.py), on every rank alike."""
        return self.lockstep.sharded

    def abandon(self) -> None:
        super().abandon()
        if self.lockstep.sharded is not None:
            self.lockstep.sharded.abandon()

    def _prestep(self, optimizer) -> None:
        """Unscale and clip behind an agreement (autofit.distributed.clipping), offloaded or not:
        both act on the device gradients before an offloaded step stages them."""
        agreed_prestep(self, optimizer)

    def held(self) -> list:
        """Tensors training holds besides the model's and the optimizer's (the leak watch's
        legitimate memory): FSDP's meshes for a sharded model."""
        return [] if self.lockstep.sharded is None else self.lockstep.sharded.held()

    def count(self, batch) -> float:
        """What a batch weighs: its label tokens for a token-level loss, else its rows (for a
        loss_fn told num_items_in_batch: what its weighting counts)."""
        if self.weighting is not None:
            return float(self.weighting.count(batch))
        tokens = self.count_tokens(batch) if self.count_tokens is not None else None
        return float(rows_of(batch) if tokens is None else tokens)

    def _parts(self, batch, plan) -> list:
        """This rank's micro-batches. FSDP communicates inside every micro-batch's forward and
        backward, so each rank runs the plan's number of them: a share with fewer rows than the
        largest (per-rank data) runs its first row again for each micro-batch it lacks, weighted 0,
        so its gradient adds exactly nothing."""
        parts = split(batch, plan.micro_batch_size)
        self.padding = 0
        if self.lockstep.sharded is not None and len(parts) < plan.accumulation_steps:
            self.padding = plan.accumulation_steps - len(parts)
            parts += [slice_batch(batch, 0, 1)] * self.padding
        return parts

    def _shares(self, batch, parts):
        real = parts[:len(parts) - self.padding]
        return self._real_shares(batch, real) + [0.0] * self.padding

    def _real_shares(self, batch, parts):
        lock = self.lockstep
        if self.weighting is not None:  # the loss_fn divides by the global count itself
            return [1.0] * len(parts)
        if not lock.per_rank:
            # Each micro-batch's share of the whole global batch, which every rank holds.
            return weights(lock.global_batch, parts, self.count_tokens)
        # Each micro-batch's share of the ranks' batches together (counted at their agreement).
        return [self.count(part) / lock.global_count for part in parts]

    def _items(self, batch) -> dict:
        """num_items_in_batch for a loss_fn that takes it: the whole global batch's count, every
        rank's share included (agreed before the batch with per-rank data)."""
        if self.weighting is None:
            return {}
        lock = self.lockstep
        return {ITEMS: int(lock.global_count if lock.per_rank else self.weighting.count(lock.global_batch))}

    def run(self, batch, plan, before_backward=None) -> float:
        lock = self.lockstep
        failure, value, mask, at_risk = None, 0.0, None, False
        lock.attempt_plan, lock.attempt_agreed = plan, False
        lock.presence.mark(lock.step, BACKWARD)  # a rank that stalls in it is named with where
        sharded = lock.sharded
        try:
            if sharded is not None:
                sharded.arm(True)  # each of FSDP's collectives waits for an agreement first
            value = self._accumulate(batch, plan, before_backward).item()
            if self.padding and self.kept:
                del self.kept[-self.padding:]  # what the padding's repeated row kept is not the batch's
            mask = lock.replicas.fill_missing_grads()
            at_risk = self.offloaded is None and self.atomic.at_risk(config_of(plan))
        except Exception as error:
            failure = error
        finally:
            if sharded is not None:
                sharded.arm(False)
        if lock.attempt_agreed:  # every rank already knows how this attempt ended
            try:
                raise failure
            finally:
                failure = None
        accumulate = lock.accumulating()  # inside the user's ddp.no_sync(): no reduction, no step
        verdict = lock.agree(BACKWARD, failure, value=value, flag=at_risk, plan=plan, mask=mask,
                             value3=float(accumulate), host=self.device.host)
        if lock.accumulated(verdict):
            self.grad_norm = None
            return math.fsum(verdict.values())
        lock.replicas.reduce_grads(verdict)  # FSDP reduced its shards' gradients in backward
        lock.replicas.broadcast_buffers()    # before the step: nothing after its agreement communicates
        guard = verdict.any_flag()  # some rank's step may fail: every rank takes a snapshot
        guarded = guard or self.offloaded is not None  # an offloaded step always is (engine/step.py)
        self._step(plan, guard=guard, wrap=lambda step: lock.agreed_step(step, plan, guarded))
        return math.fsum(verdict.values())
