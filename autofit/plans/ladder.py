"""Moves and the ladder: how a plan steps down after running out of memory.

A move is a callable `Plan -> Plan | None` (None: it cannot step further). Moves compose like
tenacity's strategies: `a | b` tries `a`, and `b` only when `a` returns None. Every move has a
`why`, the reason logged and recorded with each step-down.

The micro-batch moves are not blind halving: they read a `SizeLog` of the sizes already seen to fit
or fail for each configuration (precision, checkpointing, offload) and row length, never propose a
size known to fail, and `SizeLog.probe_up` lets the controller search upward between the largest
size that fitted and the smallest that failed, so a run settles on the largest micro-batch that fits.
"""

from __future__ import annotations

from autofit.plans import precision as precisions
from autofit.plans import switches
from autofit.plans.plan import Plan
from autofit.plans.sizelog import SizeLog

BUSY_FLOOR = 8  # below this a micro-batch rarely keeps a GPU busy; cheaper moves come first


class Move:
    """A step-down. Subclasses implement `step(plan, global_batch)`; the ladder calls `take` (the
    step and its reason); `move(plan)` is the plain function Plan -> Plan | None; `a | b` composes."""

    why = "step down"

    def __call__(self, plan: Plan) -> Plan | None:
        taken = self.take(plan)
        return None if taken is None else taken[0]

    def take(self, plan: Plan, global_batch: int | None = None) -> tuple[Plan, str] | None:
        """(new plan, reason) or None. `global_batch`: the batch the plan must cover (micro-batch x
        accumulation may exceed it, 8 x 2 covering 9); the plan's own when not given."""
        new = self.step(plan, plan.global_batch if global_batch is None else global_batch)
        return None if new is None else (new, self.why)

    def step(self, plan: Plan, global_batch: int | None = None) -> Plan | None:
        """The plan one step down from `plan`, which covers `global_batch` (its own when None; moves
        that do not split the batch ignore it), or None."""
        raise NotImplementedError

    def __or__(self, other) -> "Move":
        return Either(self, as_move(other))

    def __ror__(self, other) -> "Move":
        return Either(as_move(other), self)

    def __repr__(self):
        return type(self).__name__


class Either(Move):
    def __init__(self, *moves: Move):
        self.moves = []
        for m in moves:  # flatten so repr and iteration stay readable
            self.moves.extend(m.moves if isinstance(m, Either) else [m])

    def take(self, plan, global_batch=None):
        for move in self.moves:
            taken = move.take(plan, global_batch)
            if taken is not None:
                return taken
        return None

    def __repr__(self):
        return " | ".join(repr(m) for m in self.moves)


class FunctionMove(Move):
    """A user's plain function `Plan -> Plan | None` as a move."""

    def __init__(self, fn):
        self.fn = fn
        self.why = getattr(fn, "__doc__", None) or getattr(fn, "__name__", "user move")

    def step(self, plan, global_batch=None):
        new = self.fn(plan)
        if new is not None and not isinstance(new, Plan):
            raise TypeError(f"move {self.fn!r} returned {new!r}; a move returns a Plan or None.")
        return new

    def __repr__(self):
        return getattr(self.fn, "__name__", repr(self.fn))


def as_move(obj) -> Move:
    if isinstance(obj, Move):
        return obj
    if isinstance(obj, (list, tuple)):
        if not obj:
            raise ValueError("ladder=[] has no move; give at least one move or leave ladder=None.")
        return Either(*(as_move(m) for m in obj))
    if callable(obj):
        return FunctionMove(obj)
    raise TypeError(f"a move is a callable Plan -> Plan | None, but got {obj!r}.")


class ShrinkMicroBatch(Move):
    """Halve the micro-batch (more accumulation steps, same global batch), not below `floor`."""

    def __init__(self, sizes: SizeLog, floor: int = 1):
        if floor < 1:
            raise ValueError(f"floor must be >= 1 but got {floor}.")
        self.sizes, self.floor = sizes, floor
        self.why = f"smaller micro-batch, more accumulation (not below {floor})"

    def step(self, plan, global_batch=None):
        global_batch = plan.global_batch if global_batch is None else global_batch
        current = plan.micro_batch_size
        if current <= self.floor:
            return None
        size = max(self.floor, current // 2)
        fit = self.sizes.fit(plan)  # at the length of the batch being trained
        if fit is not None and size < fit < current:
            size = fit  # a size known to fit beats a blind halving
        return plan.with_micro_batch(size, global_batch)

    def __repr__(self):
        return f"ShrinkMicroBatch(floor={self.floor})"


class SetField(Move):
    """Switch one plan field to a value (precision, checkpointing, offload) when it is not set yet."""

    def __init__(self, name: str, value, why: str, turn_on=None):
        self.name, self.value, self.why = name, value, why
        self.turn_on = turn_on  # a switch's own rule (plans/switches.py), else: set unless set

    def step(self, plan, global_batch=None):
        if self.turn_on is not None:
            return self.turn_on(plan)
        if getattr(plan, self.name) == self.value:
            return None
        return plan.replace(**{self.name: self.value})

    def __repr__(self):
        return f"SetField({self.name}={self.value!r})"


def mixed_precision(dtype: str | None = None) -> Move:
    """Autocast in `dtype` (default: the registry's first mixed precision, bf16) from an exact plan."""
    dtype = precisions.mixed_for(True) if dtype is None else dtype
    if dtype not in precisions.mixed_names():
        raise ValueError(f"mixed precision is {' or '.join(map(repr, precisions.mixed_names()))} but got {dtype!r}.")
    return _OnlyFromFp32(dtype)


class _OnlyFromFp32(SetField):
    def __init__(self, dtype):
        super().__init__("precision", dtype, f"{dtype} autocast halves activation memory")

    def step(self, plan, global_batch=None):
        return None if precisions.get(plan.precision).mixed else super().step(plan)


def switch_on(name: str) -> Move:
    """The move that turns a plan switch on (plans/switches.py: its rule and its reason)."""
    switch = switches.get(name)
    return SetField(switch.name, True, switch.why, turn_on=switch.turn_on)


def checkpointing() -> Move:
    return switch_on("checkpointing")


def offload_optimizer() -> Move:
    return switch_on("offload_optimizer")


def per_parameter_step() -> Move:
    return switch_on("per_parameter_step")


# FSDP2's own moves (a model sharded with fully_shard; plans.applies refuses them elsewhere)
def reshard_after_forward() -> Move:
    return switch_on("reshard_after_forward")


def reduce_each_micro_batch() -> Move:
    return switch_on("reduce_each_micro_batch")


def sharded(ladder: Move) -> Move:
    """`ladder` for a model sharded with FSDP2: FSDP's own moves first, cheapest in speed first.
    Resharding after forward costs one more all-gather of each unit per micro-batch (in backward,
    overlapped with compute by FSDP's prefetch); a reduce-scatter per micro-batch costs one
    reduce-scatter of each unit per extra micro-batch, on the critical path at the end of each
    backward; both keep the mathematics. Every move of `ladder` after them costs more: a smaller
    micro-batch all-gathers every unit again (forward and backward) for each extra micro-batch, on
    top of its idle compute; precision, checkpointing and offload as in the default ladder."""
    moves = [reshard_after_forward(), reduce_each_micro_batch()]
    if isinstance(ladder, ByPhase):
        return ByPhase(Either(*moves, ladder.general), ladder.first)
    return Either(*moves, ladder)


# -- moves are offers; the phase of a failure picks which come first -----------------------------

# Where an attempt ran out of memory (`StepRunner.phase`, `Attempt.where`): "copy-in" is a
# micro-batch's copy to the device (the moves for activations answer it, as for "forward").
PHASES = ("copy-in", "forward", "backward", "optimizer.state", "optimizer.step")


class ByPhase(Move):
    """A ladder whose moves for a failure in a given phase come first: `general` is offered after
    them, and alone when the phase is not known (a plain `take`)."""

    def __init__(self, general, first: dict):
        unknown = set(first) - set(PHASES)
        if unknown:
            raise ValueError(f"phases must be among {PHASES} but got {sorted(unknown)}.")
        self.general = as_move(general)
        self.first = {phase: as_move(moves) for phase, moves in first.items()}

    def take(self, plan, global_batch=None):
        return self.general.take(plan, global_batch)

    def __repr__(self):
        return "; ".join([repr(self.general)] + [f"first after {phase}: {moves!r}"
                                                for phase, moves in self.first.items()])


def offers(ladder: Move, phase: str = "") -> list[Move]:
    """The moves of `ladder` in the order they are offered for a failure in `phase`."""
    if isinstance(ladder, ByPhase):
        first = ladder.first.get(phase)
        return (offers(first) if first is not None else []) + offers(ladder.general)
    if isinstance(ladder, Either):
        return list(ladder.moves)
    return [ladder]


def step_down(ladder: Move, plan: Plan, phase: str = "", not_applicable=None,
              global_batch: int | None = None):
    """(new plan, why, skipped) from the first move that steps `plan` down to a plan that applies to
    this job; `not_applicable(plan) -> reason | None` says why a plan does not (no repeated blocks to
    checkpoint, no bf16 on this device, ...), and such moves are skipped, listed in `skipped` as
    (move, reason). (None, "", skipped) when no move has a step left. `global_batch`: the batch the
    plan must cover, given to the moves (the plan's own micro-batch x accumulation when None)."""
    skipped = []
    for move in offers(ladder, phase):
        taken = move.take(plan, global_batch)
        while taken is not None:
            reason = not_applicable(taken[0]) if not_applicable is not None else None
            if not reason:
                return taken[0], taken[1], skipped
            skipped.append((move, reason))
            # a move that walks a list of plans (plans/reach.py) goes on past the one that does not apply
            taken = move.take(plan, global_batch, passed=taken[0]) if getattr(move, "walks", False) else None
    return None, "", skipped


# -- the ladder: one description, every variant built from it -----------------------------------

# The rungs, cheapest first: exact moves first (accumulation down to where a GPU idles), then
# cheaper numerics, then recomputation, then accumulation down to one row, then offload. Each
# ladder autofit walks is this order: the default one, the whole-batch-first one (batch-coupled
# models: every rung that keeps the batch whole, in this order, then the split), the Trainer's
# (its own micro-batch move, no offload) and the sharded one (FSDP2's moves in front).
RUNGS = (("split", BUSY_FLOOR), ("precision", None), ("checkpointing", None), ("split", 1), ("offload", None))


def ladder_of(precision: str = precisions.AUTO, bf16_supported: bool = True, *, split, whole_first: bool = False,
              allow_split: bool = True, checkpoint: bool = True, offload: bool = True) -> Either:
    """The rungs of RUNGS as moves: `split(floor)` the micro-batch move down to `floor` rows; mixed
    precision only with precision="auto" (fp16 where bf16 is unsupported); `whole_first`: the rungs
    that keep the batch whole, then the split to 1 row (none without `allow_split`); `checkpoint`,
    `offload`: whether those rungs are on this ladder."""
    rungs = [r for r in RUNGS if not (whole_first and r == ("split", BUSY_FLOOR))]
    if whole_first:
        rungs = [r for r in rungs if r[0] != "split"] + ([("split", 1)] if allow_split else [])
    made = {"precision": lambda _: mixed_precision(precisions.mixed_for(bf16_supported))
            if precision == precisions.AUTO else None,
            "checkpointing": lambda _: checkpointing() if checkpoint else None,
            "offload": lambda _: offload_optimizer() if offload else None,
            "split": split}
    return Either(*[m for m in (made[name](arg) for name, arg in rungs) if m is not None])


def default_ladder(sizes: SizeLog, precision: str = precisions.AUTO, bf16_supported: bool = True) -> Move:
    """RUNGS in their order, each phase's moves first (`phased`). With precision="auto": micro-batch
    down to BUSY_FLOOR, bf16 autocast, checkpointing, micro-batch down to 1, optimizer offload. A
    fixed precision never changes."""
    return phased(ladder_of(precision, bf16_supported, split=lambda floor: ShrinkMicroBatch(sizes, floor=floor)))


def phased(general: Move) -> ByPhase:
    """`general` with the moves that fit each phase first: an optimizer step that runs out of memory
    updates one parameter at a time, then moves its state to the host; the state's creation (the
    first step) moves it to the host; forward and backward (activations) take `general` as is."""
    return ByPhase(general, {"optimizer.step": [per_parameter_step(), offload_optimizer()],
                             "optimizer.state": [offload_optimizer()]})
