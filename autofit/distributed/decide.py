"""Where a distributed run starts, decided once for every rank: the smallest budget of all ranks
(for the capacity check) and rank 0's choice (its cache, else its estimate against that budget),
sent to the others; when nothing fits, the rank with the smallest budget says so itself. The cache
key sees the world size and the sharding (`cache_view`)."""

from __future__ import annotations

import json

import torch

from autofit.distributed.agreement import DECIDE, START
from autofit.distributed.fsdp import sharding
from autofit.errors import DoesNotFit, LockstepError
from autofit.plans.sizelog import SizeLog
from autofit.plans.plan import Plan


class _View:
    """A device as seen by the capacity check or the cache key: the agreed budget, the world size
    and how the model is spread over the ranks (`parallel`, part of the cache key)."""

    def __init__(self, device, budget: int | None, name: str | None = None, parallel: dict | None = None):
        self._device = device
        self.budget = budget
        self.name = name or device.name
        self.parallel = parallel

    def __getattr__(self, name):
        return getattr(self._device, name)


class Deciding:
    """The start decision of `Lockstep` (which supplies the agreements, rank, world and module)."""

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
        parallel = {"world": self.world, **sharding(self.module)}
        kind = "FSDP2" if parallel["sharding"] == "fsdp2" else "DDP"
        return _View(device, self.cache_budget, f"{device.name} x{self.world} ranks ({kind})", parallel)

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
        sizes.adopt(agreed)
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
