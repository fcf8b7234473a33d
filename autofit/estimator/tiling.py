"""Repeated blocks estimated once: a step walked through 3 of N alike blocks, its allocations tiled N times.

The estimator's walk (fake tensors, the real StepRunner, the simulated GPU's counter) runs on a fake
copy cut to the first 3 blocks (`autofit.estimator.repeated`), and the counter records every
allocation, free and change of kind in order, each allocation tagged with its block
(`autofit.estimator.traced`). The middle block's runs of events stand for every middle block: the
trace of N blocks is the cut trace with those runs repeated N-2 times (in block order forward, reverse order backward) and the frees
re-pointed at the same relative block. Replaying that trace through the counter's arithmetic and
the model of CUDA's caching allocator gives the allocated peak, its breakdown by kind and the
reserved peak of the whole model.

It is checked, once per kind of plan (its precision, checkpointing, offload and whether it
accumulates), by walking 4 blocks: the trace tiled to 4 must equal the walked one event for event,
and so must its peak. A model whose blocks are not alike, whose cut copy fails, runs blocks out of
order or more than once, or whose trace is not tiled exactly, is walked whole.
"""

from __future__ import annotations

import itertools

from autofit.estimator.walk import MemoryEstimate, Walker, scaler_bytes
from autofit.estimator.repeated import repeated_blocks
from autofit.estimator.traced import Untileable, _CutEstimator
from autofit.errors import AllocationFailed
from autofit.gpu.allocator import CachingAllocator, round_size, segment_size
from autofit.gpu.memory import KINDS

CUT, CHECK = 3, 4  # blocks walked: first, middle, last; and one more middle block for the check
MIDDLE = 2



# -- tiling and replay ---------------------------------------------------------------------------

Event = tuple  # ("a", block, loose, uid, bytes, kind) | ("f", block, loose, uid) |
#                ("k", block, loose, uid, kind) | ("t",) | ("start",) | ("s",) | ("e",); uid = (tag, ordinal)
# ("t",): what was there before the step is placed (estimate._Meter.tracked)


def _sections(events):
    """Consecutive events grouped by the block they belong to (markers: None). Where the events
    are loose (the optimizer's loop over parameters), frees of the block before that fall between
    a block's own events (the last temporaries of the previous parameter) join that block's."""
    def block(e):
        return e[1] if e[0] in ("a", "f", "k") else None
    sections: list = []
    for b, group in itertools.groupby(events, key=block):
        group = list(group)
        if len(sections) >= 2 and sections[-2][0] == b and b is not None:
            lower, trailing = sections[-1]
            if lower is not None and lower < b and all(e[0] == "f" and e[2] for e in trailing):
                sections.pop()
                sections[-1][1].extend(trailing + group)
                continue
        sections.append((b, group))
    return sections


def tile(events: list, blocks: int) -> list:
    """The cut walk's trace (3 blocks) as the trace of `blocks` blocks (in the walked form)."""
    signatures = {t: [e[4:] for e in events if e[0] == "a" and e[3][0] == t] for t in (1, 2, 3)}
    if not signatures[1] == signatures[2] == signatures[3]:
        raise Untileable("the first, middle and last blocks allocate differently")
    ends = {1: 1, CUT: blocks}
    sections = _sections(events)
    out = []
    for i, (owner, group) in enumerate(sections):
        if owner == MIDDLE:
            before = next((o for o, _ in reversed(sections[:i]) if o in ends), None)
            after = next((o for o, _ in sections[i + 1:] if o in ends), None)
            backward = before == CUT or (before is None and after == 1)
            for b in (range(blocks - 1, 1, -1) if backward else range(2, blocks)):
                out.extend(_moved(e, owner, b, blocks) for e in group)
        else:
            out.extend(_moved(e, owner, ends.get(owner), blocks) for e in group)
    return canonical(out)


def _moved(event, owner, block, blocks):
    """`event` of the section of block `owner` (cut numbering) as an event of block `block` of
    `blocks`: its tensor's block is re-numbered relative to the section's."""
    if event[0] not in ("a", "f", "k"):
        return event
    tag, ordinal = event[3]
    if tag is None:
        if owner == MIDDLE:
            raise Untileable("a middle block frees a tensor made outside the blocks")
        target = None
    elif owner is None:
        raise Untileable("an event outside the blocks refers to a block")
    else:
        target = block + (tag - owner)
        if not 1 <= target <= blocks:
            raise Untileable("a block refers to a block past the ends")
    return (event[0], (target, ordinal)) + event[4:]


def walked(events: list) -> list:
    """A walked trace in the tiled form: what `tile` returns and `replay` reads."""
    return canonical([(e[0],) + e[3:] if e[0] in ("a", "f", "k") else e for e in events])


def canonical(events: list) -> list:
    """`events` (tiled form) with each run of frees and retags between two allocations in one
    order: such a run's order is the order of a hash map (autocast's cache of cast weights, freed
    when autocast exits) and changes neither the bytes counted nor the allocator's state after it
    (free blocks merge with their free neighbours whatever the order)."""
    def key(e):
        tag, ordinal = e[1]
        return (-1 if tag is None else tag, ordinal, e[0] == "f")
    out, run = [], []
    for e in events:
        if e[0] in ("f", "k"):
            run.append(e)
            continue
        if run:
            out.extend(sorted(run, key=key))
            run = []
        out.append(e)
    out.extend(sorted(run, key=key))
    return out


def replay(events: list, whole_blocks: bool = False) -> tuple[int, dict, int | None, int]:
    """(allocated peak, breakdown at it, peak inside the optimizer step, reserved peak) of a trace,
    counted as the estimator's meter counts (from its `start`) through the allocator model; with
    `whole_blocks`, as a card's meter counts: a block the allocator hands out whole (c10 does not
    split a large-pool block whose remainder is <= 1 MiB) counts whole (`SimulatedGPU._charge`)."""
    allocator = CachingAllocator()
    live: dict = {}
    totals = dict.fromkeys(KINDS, 0)
    allocated = top = 0
    top_breakdown, in_step, step_top = dict(totals), False, None
    for e in events:
        kind = e[0]
        if kind == "a":
            _, uid, size, of = e
            block = allocator.malloc(size, False) if size else None
            charged = block.size if whole_blocks and block is not None else size
            live[uid] = [charged, of, block]
            allocated += charged
            totals[of] += charged
            if allocated > top:
                top, top_breakdown = allocated, dict(totals)
            if in_step and allocated > step_top:
                step_top = allocated
        elif kind == "f":
            size, of, block = live.pop(e[1])
            if block is not None:
                allocator.free(block)
            allocated -= size
            totals[of] -= size
        elif kind == "k":
            entry = live[e[1]]
            totals[entry[1]] -= entry[0]
            totals[e[2]] += entry[0]
            entry[1] = e[2]
        elif kind == "start":
            allocator.reset_peak()
            top, top_breakdown = allocated, dict(totals)
        elif kind == "s":
            in_step, step_top = True, max(step_top or 0, allocated)
        elif kind == "e":
            in_step = False
    return top, top_breakdown, step_top, allocator.max_reserved


def replay_capped(events: list, limit: int) -> tuple[int, bool]:
    """(reserved peak, True) of a trace replayed through the allocator model capped at `limit`, as
    `autofit.gpu.allocator.replay_capped` replays a walk's record: what was there before the step
    (up to the "t" marker) is placed whatever the cap, as the walk places it; (reserved when a
    request failed plus the segment it needed, False) when the cap cannot be kept."""
    allocator = CachingAllocator(limit)
    blocks: dict = {}
    enforce = False
    for e in events:
        kind = e[0]
        if kind == "a":
            if e[2]:
                try:
                    blocks[e[1]] = allocator.malloc(e[2], enforce)
                except AllocationFailed:
                    return allocator.reserved + segment_size(round_size(e[2])), False
        elif kind == "f":
            block = blocks.pop(e[1], None)
            if block is not None:
                allocator.free(block)
        elif kind == "t":
            enforce = True
        elif kind == "start":
            allocator.reset_peak()
    return allocator.max_reserved, True


class Repeated:
    """An estimator's repeated blocks: its cut copies and which kinds of plan passed the check."""

    def __init__(self, parent: Walker, path: str, blocks: int):
        self.parent, self.path, self.blocks = parent, path, blocks
        self.cuts: dict = {}
        self.checked: dict = {}  # kind of plan -> whether the tiled trace matched the walk of 4
        self.why: dict = {}      # kind of plan -> why it is walked whole

    @classmethod
    def of(cls, estimator: Walker) -> "Repeated | None":
        found = repeated_blocks(estimator.model)
        return cls(estimator, *found) if found is not None else None

    def _cut(self, keep: int) -> _CutEstimator:
        if keep not in self.cuts:
            self.cuts[keep] = _CutEstimator(self.parent, self.path, keep)
        return self.cuts[keep]

    def _checkpoints_the_blocks(self) -> bool:
        """Without Hugging Face's switch, checkpointing wraps the largest block list: it must be
        these blocks, in the whole model and in the cut copy alike."""
        from autofit.engine.checkpointing import Checkpointing, largest_block_list
        if Checkpointing(self.parent.model).hf:
            return True
        cut = self._cut(CUT)
        return largest_block_list(self.parent.model) is self.parent.model.get_submodule(self.path) \
            and largest_block_list(cut.model) is cut.blocks

    def measure(self, plan) -> MemoryEstimate | None:
        """The estimate of `plan` derived from the cut walk, or None (walk the whole model)."""
        kind = (plan.replace(micro_batch_size=1, accumulation_steps=1),
                self.parent.rows > plan.micro_batch_size)
        if self.checked.get(kind) is False:
            return None
        # What an estimate adds to its walk's peak (GradScaler's two scalars, for fp16).
        extra = scaler_bytes(plan)
        try:
            if plan.checkpointing and not self._checkpoints_the_blocks():
                raise Untileable("checkpointing would wrap other modules in the cut copy")
            events, own = self._cut(CUT).trace(plan)
            if replay(walked(events))[0] + extra != own.peak_bytes:
                raise Untileable("the replayed trace differs from the walk it was recorded in")
            if kind not in self.checked:
                check, walked_estimate = self._cut(CHECK).trace(plan)
                tiled = tile(events, CHECK)
                if tiled != walked(check) or replay(tiled)[0] + extra != walked_estimate.peak_bytes:
                    raise Untileable("the trace tiled to 4 blocks differs from the walk of 4")
                self.checked[kind] = True
            tiled = tile(events, self.blocks)
            # The cut walks count requests (their meter keeps no card's accounting), as the checks
            # above compare; the model's estimate counts as the parent's meter would.
            peak, breakdown, step, reserved = replay(tiled, whole_blocks=self.parent._own() is not None)
        except Exception as error:  # the cut copy cannot stand for the model: walk it whole
            self.checked[kind] = False
            self.why[kind] = f"{type(error).__name__}: {error}"
            return None
        breakdown["other"] += extra
        estimate = MemoryEstimate(plan=plan, peak_bytes=peak + extra, breakdown=breakdown,
                                  device_type=self.parent.device_type, resident=dict(self.parent.resident),
                                  step_bytes=step, reserved_bytes=reserved + extra,
                                  optimizer=self.parent.optimizer_name)
        self.parent._record(plan, estimate, lambda limit: replay_capped(tiled, limit), extra)
        return estimate
