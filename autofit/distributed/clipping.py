"""Unscaling and clipping the gradients of a global batch on every rank, behind one agreement.

Both only change the gradients, before the optimizer step (StepRunner._prestep). Each rank does its
local part first (the grad scaler's unscale and non-finite check, the norms of the gradients it
holds), then every rank meets at one agreement that carries each rank's outcome and its parts, and
only then is the result applied (a multiply in place, which allocates nothing). So a rank that runs
out of memory in its part meets the others at that agreement and every rank replays the global
batch, and no collective runs outside an agreement:
- replicated gradients (DDP-style, summed already) are the same on every rank: torch's own
  `clip_grad_norm_` clips them locally, with the exact norm a plain loop gets;
- sharded gradients (FSDP2's DTensors) would be reduced by torch inside `clip_grad_norm_` (an
  all-reduce of the norm) and inside the scaler's unscale (an all-reduce of found-inf): here each
  rank's squared local norm and found-inf travel in the agreement's header instead, and the total
  norm is the square root of their sum (float64; torch reduces in the gradients' dtype, so the norm
  may differ from torch's in its last bits).
"""

from __future__ import annotations

import contextlib
import math

import torch

from autofit.distributed.agreement import CLIP
from autofit.distributed.fsdp import is_dtensor, local
from autofit.distributed.internals import local_found_inf

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def _squared_norm(tensors) -> float:
    """The squared 2-norm of `tensors` together, as torch's clip computes a norm (per tensor, then
    the norm of the norms)."""
    if not tensors:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(t, 2.0) for t in tensors])
    return float(torch.linalg.vector_norm(norms, 2.0).item()) ** 2


def agreed_prestep(runner, target) -> None:
    """`runner`'s (a DistributedStepRunner) unscale and clip, agreed between the ranks."""
    lock, scaler = runner.lockstep, runner.scaler
    max_norm = runner.max_grad_norm
    clip = max_norm is not None
    sharded = lock.sharded is not None
    # Else scaler.step unscales (no collective); an offloaded step unscales on the device first.
    unscale = scaler is not None and (clip or sharded or runner.offloaded is not None)
    if not clip and not unscale:
        return  # nothing before the update: no agreement needed
    params = [p for p in runner.model.parameters() if p.grad is not None]
    failure, parts, found, infinite = None, (0.0, 0.0), [], False
    try:
        if unscale:
            with local_found_inf(found) if sharded else contextlib.nullcontext():
                scaler.unscale_(target)
            infinite = any(bool(t.item()) for t in found)
        if clip and not sharded:
            runner._clip(params)
        elif clip:
            parts = (_squared_norm([local(p.grad) for p in params if is_dtensor(p.grad)]),
                     _squared_norm([p.grad for p in params if not is_dtensor(p.grad)]))
    except Exception as error:
        failure = error
    verdict = lock.agree(CLIP, failure, value=parts[0], value2=parts[1], flag=infinite,
                         plan=lock.attempt_plan, host=runner.device.host)
    if verdict.any_flag():  # some rank's shard is not finite: every rank skips the update
        for t in found:
            t.fill_(1.0)
    if clip and sharded:
        # the replicated part is the same on every rank: counted once
        total = math.sqrt(math.fsum(verdict.values()) + verdict.values("value2")[0])
        coefficient = min(max_norm / (total + EPS), 1.0) if not math.isnan(total) else total
        with torch.no_grad():
            for p in params:
                local(p.grad).mul_(coefficient)
        runner.grad_norm = total
