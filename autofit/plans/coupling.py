"""Batch-coupled layers: modules whose training output depends on the other rows of the batch.

BatchNorm of every kind (`_BatchNorm` subclasses: BatchNorm1d/2d/3d, their Lazy forms,
SyncBatchNorm) normalises with the statistics of the rows it is given, so a micro-batch computes
another function than the whole batch, and its running statistics move once per micro-batch.
Users declare their own such modules with an attribute, `module.batch_coupled = True` (and
`False` takes a BatchNorm out, e.g. one kept in eval mode). Any other layer that couples rows is
found by measuring the whole training forward on two rows (engine/reduction.couples_in_training),
which can judge only a forward that draws nothing at random; a per-layer measured criterion was
weighed and not taken: comparing a layer's output on fewer rows is blurred by dropout, and buffers
written in forward flag counters and spectral norm's vectors while missing a BatchNorm without
running statistics. So the class stays the criterion for BatchNorm, whatever the model draws.

For a model that has them a run says so once (naming the modules), records them on the result,
walks a ladder that keeps the batch whole first (mixed precision as the policy allows,
checkpointing, offload) and splits only when nothing whole fits; `allow_split=False` forbids
splitting altogether. Checkpointing recomputes a block's forward inside backward, which would
update running statistics a second time: a forward pre-hook on every coupled module sees a forward
that runs inside backward (a recompute, whichever checkpointing runs it: autofit's blocks or Hugging
Face's) and puts the module's buffers back when that backward ends.
"""

from __future__ import annotations

import logging

import torch

from autofit import torch_internals as ti
from autofit.plans import precision as precisions
from autofit.plans.ladder import (
    ByPhase,
    Either,
    Move,
    ShrinkMicroBatch,
    default_ladder,
    phased,
)
from autofit.plans.plan import Plan
from autofit.plans.reach import Reach, configurations

log = logging.getLogger("autofit")

LOSS = "the loss"  # in `Coupling.names` when the loss itself couples the rows
ATTRIBUTE = "batch_coupled"  # set on a module: True declares it coupled, False takes a BatchNorm out


def coupled_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every batch-coupled module, in model order."""
    found = []
    for name, module in model.named_modules():
        declared = getattr(module, ATTRIBUTE, None)
        if declared is None:
            declared = isinstance(module, ti.batch_norm_base())
        if declared:
            found.append((name or type(module).__name__, module))
    return found


def declared(model: torch.nn.Module) -> bool:
    """Whether the model says which of its layers couple rows: one is known by class or declares
    `batch_coupled` (True or False). Nothing is measured then (engine/reduction.couples_in_training):
    a layer declared False is trusted, whatever a measurement would say."""
    return any(getattr(m, ATTRIBUTE, None) is not None or isinstance(m, ti.batch_norm_base())
               for m in model.modules())


def whole_first_ladder(sizes, precision: str = precisions.AUTO, bf16_supported: bool = True,
                       allow_split: bool = True) -> Move:
    """Every whole-batch plan first (plans/reach.py: mixed precision as the policy allows,
    checkpointing, offload, each alone and together, cheapest first), then halving the micro-batch
    down to 1 unless splitting is forbidden. Each phase's own moves keep the batch whole too."""
    whole = Reach(sizes, configurations(precision, bf16_supported), whole=True)
    split = [ShrinkMicroBatch(sizes, floor=1)] if allow_split else []
    return phased(Either(whole, *split))


class _KeepWhole(Move):
    """A user's move, refused where it would split the global batch (allow_split=False)."""

    def __init__(self, inner: Move):
        self.inner, self.why = inner, inner.why

    def take(self, plan, global_batch=None):
        taken = self.inner.take(plan, global_batch)
        if taken is None or taken[0].micro_batch_size < (global_batch or taken[0].global_batch):
            return None
        return taken

    def __repr__(self):
        return f"KeepWhole({self.inner!r})"


def keep_whole(move: Move) -> Move:
    if isinstance(move, ByPhase):  # each phase's moves filtered too, their order kept
        return ByPhase(keep_whole(move.general), {p: keep_whole(m) for p, m in move.first.items()})
    if isinstance(move, Either):
        return Either(*(_KeepWhole(m) for m in move.moves))
    return _KeepWhole(move)


class Coupling:
    """A run's batch-coupled layers: what it says, the ladder it walks, the recompute guard."""

    def __init__(self, model: torch.nn.Module, allow_split: bool = True):
        if not isinstance(allow_split, bool):
            raise TypeError(f"allow_split must be True or False but got {allow_split!r}.")
        self.allow_split = allow_split
        found = coupled_modules(model)
        self.names = [name for name, _ in found]
        self._pending: dict = {}   # module -> [(buffer, copy before the recompute)]
        self._task = None          # the backward those copies belong to
        self._modules = [module for _, module in found]
        self._handles = []
        if self.names:
            log.warning("%s has batch-coupled layers (%s): splitting a global batch into micro-batches "
                        "changes what they compute (statistics over each micro-batch). autofit keeps the "
                        "batch whole first (precision as allowed, checkpointing, offload) and splits only "
                        "when nothing whole fits; allow_split=False forbids splitting.",
                        type(model).__name__, ", ".join(self.names))

    def loss_couples(self, measured: str) -> None:
        """The loss was measured not to be a row- or token-weighted combination of its rows' losses
        (`measured`: whose loss, and the three losses): the job is batch-coupled, said once."""
        if LOSS in self.names:
            return
        self.names.append(LOSS)
        log.warning("the loss couples the rows of a batch: %s is not the row- or token-weighted combination "
                    "of each row's loss, so splitting a global batch into micro-batches changes it (in-batch "
                    "negatives, a statistic over the batch). autofit tries every whole-batch plan first "
                    "(precision as allowed, checkpointing, offload, alone and together) and splits only when "
                    "none fits; allow_split=False forbids splitting.", measured)

    @property
    def whole_first(self) -> bool:
        return bool(self.names) or not self.allow_split

    def ladder(self, sizes, precision: str, bf16_supported: bool, user: Move | None = None) -> Move:
        if user is not None:
            return user if self.allow_split else keep_whole(user)
        if not self.whole_first:
            return default_ladder(sizes, precision, bf16_supported)
        return whole_first_ladder(sizes, precision, bf16_supported, self.allow_split)

    def whole_plans(self, global_batch: int, precision: str, bf16_supported: bool) -> list:
        """The whole-batch plans this run's ladder tries before it splits, in its order (the plan a
        run starts with first); [] when nothing keeps the batch whole first. The capacity check
        starts from the first of them predicted to fit, as the ladder would reach it."""
        if not self.whole_first:
            return []
        start = Plan.for_batch(global_batch)
        return [start.replace(**config) for config in configurations(precision, bf16_supported)]

    def start(self, plan, reason: str, global_batch: int):
        """The start plan, made whole when splitting is forbidden."""
        if self.allow_split or plan.micro_batch_size >= global_batch:
            return plan, reason
        return (plan.with_micro_batch(global_batch, global_batch),
                f"{reason}; the whole batch, since allow_split=False")

    def refuses(self, plan: Plan) -> str | None:
        """Why `plan` may not run: it splits the global batch (more than one micro-batch) and
        splitting is forbidden. The controller asks it of every plan, from any path (the ladder, the
        sizes a capacity check or a cache proved, an upward search, a resumed state)."""
        if self.allow_split or plan.accumulation_steps == 1:
            return None
        return f"{plan.describe()} splits the global batch, which allow_split=False forbids"

    def refusal(self) -> str | None:
        """What to add to DoesNotFit when splitting was forbidden."""
        if self.allow_split:
            return None
        return ("splitting the global batch is forbidden (allow_split=False) and no whole-batch plan "
                "fits; allow splitting, lower the global batch or give a larger budget.")

    # -- recompute guard -----------------------------------------------------------------------
    def guard(self) -> None:
        """Hook every coupled module until close()."""
        if not self._handles:
            self._handles = [m.register_forward_pre_hook(self._before_forward) for m in self._modules]

    def _before_forward(self, module, args):
        task = ti.graph_task_id()
        if task == -1:
            return  # an ordinary forward: its statistics update is the one a plain loop makes
        if task != self._task:
            self._pending, self._task = {}, task  # copies of a backward that never finished are void
        if module in self._pending:
            return
        with torch.no_grad():
            self._pending[module] = [(b, b.clone()) for b in module.buffers() if b is not None]
        if len(self._pending) == 1:
            ti.after_backward(self._put_back)

    def _put_back(self) -> None:
        with torch.no_grad():
            for saved in self._pending.values():
                for buffer, copy in saved:
                    buffer.copy_(copy)
        self.forget()

    def forget(self) -> None:
        """A failed attempt's backward never ended: its copies go (the start state puts the buffers back)."""
        self._pending, self._task = {}, None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._pending = {}


def describe(names, attempts) -> str | None:
    """A line for explain(): which layers a split changes, and whether this run split."""
    if not names:
        return None
    split = sorted({a.plan.micro_batch_size for a in attempts
                    if a.outcome == "ok" and a.plan.micro_batch_size < a.plan.global_batch})
    head = f"batch-coupled layers ({', '.join(names)}): "
    if not split:
        return head + "every global batch was trained whole, so they computed what a plain loop computes."
    return (head + f"global batches were split into micro-batches of {', '.join(map(str, split))} rows, so "
            f"they normalised over each micro-batch, not the global batch; allow_split=False keeps "
            f"batches whole.")
