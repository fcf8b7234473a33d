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

import math
from dataclasses import dataclass, field

from . import precision as precisions
from .plan import Plan

BUSY_FLOOR = 8  # below this a micro-batch rarely keeps a GPU busy; cheaper moves come first


def config_of(plan: Plan) -> tuple:
    """What a micro-batch size's memory depends on besides the size itself and the batch's rows.
    (A per-parameter step is appended only when on, so keys cached before it stay the same.)"""
    key = (plan.precision, plan.checkpointing, plan.offload_optimizer)
    return key + ("per-parameter step",) if plan.per_parameter_step else key


EVERY = None  # a length not given: a record or a question about every length


@dataclass
class SizeLog:
    """Micro-batch sizes seen to fit or fail, per configuration and per row length.

    Memory grows with the micro-batch and with the length of its rows (`batches.row_elements`:
    for token batches, a multiple of the sequence length), so a size that fitted at length L fits
    every shorter row, and a size that failed at length L fails at every longer one. The sizes
    proven for one length are therefore never taken for a longer one: a run that probed up on short
    batches goes back to the size proven for long ones when a long batch arrives.

    `length` is the row length of the global batch being trained (the controller sets it); the
    queries and records use it unless given another. A length of None stands for every length:
    a fit recorded without a length holds at every length, a failure fails at every length.
    """

    fits: dict = field(default_factory=dict)   # config -> {length: largest size that fitted at it}
    fails: dict = field(default_factory=dict)  # config -> {length: smallest size that failed at it}
    length: int | None = EVERY

    def record(self, plan: Plan, ok: bool, global_batch: int | None = None, length=None) -> None:
        key, size = config_of(plan), plan.micro_batch_size
        length = self.length if length is None else length
        if global_batch is not None:
            size = min(size, global_batch)
        if ok:
            at = math.inf if length is EVERY else length
            fits = self.fits.setdefault(key, {})
            fits[at] = max(fits.get(at, 0), size)
            return
        at = 0 if length is EVERY else length
        fails = self.fails.setdefault(key, {})
        fails[at] = min(fails.get(at, size), size)
        # What fitted at this length or longer with as many rows fitted before the optimizer state
        # existed (or not at all): not any more.
        fits = self.fits.get(key, {})
        for seen in [l for l, s in fits.items() if l >= at and s >= size]:
            del fits[seen]
        if not fits:
            self.fits.pop(key, None)

    def forget_fail(self, plan: Plan, length=EVERY) -> None:
        """Forget the failure of `plan`'s size at `length` (an expired failure), if still recorded."""
        at = 0 if length is EVERY else length
        fails = self.fails.get(config_of(plan), {})
        if fails.get(at) == plan.micro_batch_size:
            del fails[at]
            if not fails:
                self.fails.pop(config_of(plan), None)

    def settle(self, plan: Plan, length=None) -> None:
        """`plan`'s micro-batch is the largest that fits its configuration at `length`: no probe
        above it there (a cached or tuned plan)."""
        self.record(plan, True, length=length)
        self.record(plan.replace(micro_batch_size=plan.micro_batch_size + 1), False, length=length)

    def fit(self, plan: Plan, length=None) -> int | None:
        """The largest size known to fit `plan`'s configuration at `length` (fitted at it or longer)."""
        length = self.length if length is None else length
        at = math.inf if length is EVERY else length
        sizes = [s for l, s in self.fits.get(config_of(plan), {}).items() if l >= at]
        return max(sizes) if sizes else None

    def fail(self, plan: Plan, length=None) -> int | None:
        """The smallest size known to fail `plan`'s configuration at `length` (failed at it or
        shorter)."""
        length = self.length if length is None else length
        at = math.inf if length is EVERY else length
        sizes = [s for l, s in self.fails.get(config_of(plan), {}).items() if l <= at]
        return min(sizes) if sizes else None

    def longest_fit(self, plan: Plan) -> tuple[int | None, int] | None:
        """(length, size) proven at the longest length for `plan`'s configuration (length None: at
        every length), or None when nothing fitted."""
        fits = self.fits.get(config_of(plan))
        if not fits:
            return None
        longest = max(fits)
        return (EVERY if longest == math.inf else longest), fits[longest]

    def settle_proven(self, plan: Plan) -> None:
        """Settle every size proven for `plan`'s configuration at the length it was proven at."""
        for length, size in list(self.fits.get(config_of(plan), {}).items()):
            self.settle(plan.replace(micro_batch_size=size), length=EVERY if length == math.inf else length)

    def known_to_fail(self, plan: Plan, length=None) -> bool:
        failed = self.fail(plan, length)
        return failed is not None and plan.micro_batch_size >= failed

    def probe_up(self, plan: Plan, global_batch: int, length=None) -> Plan | None:
        """The next larger micro-batch worth trying for this configuration, or None when settled."""
        fit = self.fit(plan, length)
        if fit is None or fit != plan.micro_batch_size:
            return None
        ceiling = min(self.fail(plan, length) or global_batch + 1, global_batch + 1)
        if ceiling - fit <= 1:
            return None
        size = (fit + ceiling) // 2 if ceiling <= global_batch else global_batch
        return plan.with_micro_batch(size, global_batch)

    def to_json(self) -> dict:
        """Plain JSON (lengths of every length as null), for agreeing across ranks and caching."""
        def rows(table, every):
            return [[list(key), [[None if l == every else l, s] for l, s in sorted(sizes.items())]]
                    for key, sizes in table.items()]
        return {"fits": rows(self.fits, math.inf), "fails": rows(self.fails, 0)}

    @classmethod
    def from_json(cls, data: dict) -> "SizeLog":
        def table(rows, every):
            return {tuple(key): {every if l is None else l: s for l, s in sizes} for key, sizes in rows}
        return cls(fits=table(data["fits"], math.inf), fails=table(data["fails"], 0))


class Move:
    """A step-down. Subclasses implement `step`; `a | b` composes."""

    why = "step down"

    def __call__(self, plan: Plan) -> Plan | None:
        taken = self.take(plan)
        return None if taken is None else taken[0]

    def take(self, plan: Plan, global_batch: int | None = None) -> tuple[Plan, str] | None:
        """(new plan, reason) or None. `global_batch`: the batch the plan must cover (micro-batch x
        accumulation may exceed it, 8 x 2 covering 9); the plan's own when not given."""
        new = self.step_for(plan, plan.global_batch if global_batch is None else global_batch)
        return None if new is None else (new, self.why)

    def step(self, plan: Plan) -> Plan | None:
        raise NotImplementedError

    def step_for(self, plan: Plan, global_batch: int) -> Plan | None:
        """The step for a plan that covers `global_batch`; moves that do not split it need only `step`."""
        return self.step(plan)

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

    def step(self, plan):
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

    def step(self, plan):
        return self.step_for(plan, plan.global_batch)

    def step_for(self, plan, global_batch):
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

    def __init__(self, name: str, value, why: str):
        self.name, self.value, self.why = name, value, why

    def step(self, plan):
        if getattr(plan, self.name) == self.value:
            return None
        return plan.replace(**{self.name: self.value})

    def __repr__(self):
        return f"SetField({self.name}={self.value!r})"


def mixed_precision(dtype: str = "bf16") -> Move:
    if dtype not in precisions.MIXED:
        raise ValueError(f"mixed precision is {' or '.join(map(repr, precisions.MIXED))} but got {dtype!r}.")
    return _OnlyFromFp32(dtype)


class _OnlyFromFp32(SetField):
    def __init__(self, dtype):
        super().__init__("precision", dtype, f"{dtype} autocast halves activation memory")

    def step(self, plan):
        return None if plan.precision != "fp32" else super().step(plan)


def checkpointing() -> Move:
    return SetField("checkpointing", True, "activation checkpointing recomputes activations in backward")


def offload_optimizer() -> Move:
    return SetField("offload_optimizer", True, "optimizer state moves to CPU memory")


def per_parameter_step() -> Move:
    return SetField("per_parameter_step", True, "the optimizer updates one parameter at a time "
                    "(a for-loop instead of foreach), so the step's temporaries are one parameter's")


# -- moves are offers; the phase of a failure picks which come first -----------------------------

# Where an attempt ran out of memory (`StepRunner.phase`, `Attempt.where`).
PHASES = ("forward", "backward", "optimizer.state", "optimizer.step")


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


def step_down(ladder: Move, plan: Plan, phase: str = "", applies=None, global_batch: int | None = None):
    """(new plan, why, skipped) from the first move that steps `plan` down to a plan that applies to
    this job; `applies(plan) -> reason | None` says why a plan does not (no repeated blocks to
    checkpoint, no bf16 on this device, ...), and such moves are skipped, listed in `skipped` as
    (move, reason). (None, "", skipped) when no move has a step left. `global_batch`: the batch the
    plan must cover, given to the moves (the plan's own micro-batch x accumulation when None)."""
    skipped = []
    for move in offers(ladder, phase):
        taken = move.take(plan, global_batch)
        if taken is None:
            continue
        reason = applies(taken[0]) if applies is not None else None
        if reason:
            skipped.append((move, reason))
            continue
        return taken[0], taken[1], skipped
    return None, "", skipped


def default_ladder(sizes: SizeLog, precision: str = "auto", bf16_supported: bool = True) -> Move:
    """Exact moves first (accumulation), then cheaper numerics, then recomputation, then offload.

    With precision="auto": micro-batch down to BUSY_FLOOR, bf16 autocast (fp16 where bf16 is
    unsupported), checkpointing, micro-batch down to 1, optimizer offload. A fixed precision never
    changes.
    """
    steps = [ShrinkMicroBatch(sizes, floor=BUSY_FLOOR)]
    if precision == "auto":
        steps.append(mixed_precision(precisions.mixed_for(bf16_supported)))
    steps += [checkpointing(), ShrinkMicroBatch(sizes, floor=1), offload_optimizer()]
    return phased(Either(*steps))


def phased(general: Move) -> ByPhase:
    """`general` with the moves that fit each phase first: an optimizer step that runs out of memory
    updates one parameter at a time, then moves its state to the host; the state's creation (the
    first step) moves it to the host; forward and backward (activations) take `general` as is."""
    return ByPhase(general, {"optimizer.step": [per_parameter_step(), offload_optimizer()],
                             "optimizer.state": [offload_optimizer()]})
