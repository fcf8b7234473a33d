"""Repeated blocks estimated once: a step walked through 3 of N alike blocks, its allocations tiled N times.
(Just over 300 lines: the traced walk, the tiling and the replay are one mechanism whose event
format must agree.)

The estimator's walk (fake tensors, the real StepRunner, the simulated GPU's counter) runs on a fake
copy cut to the first 3 blocks (`autofit.estimator.repeated`), and the counter records every
allocation, free and change of kind in order. Each allocation is tagged with the block it belongs
to: the block whose forward or backward is running (forward pre-hooks, and gradient hooks on each
block's output mark where the walk is), or, outside the blocks (the optimizer step, its foreach
lists), the block of the tensors the op reads, position by position for foreach ops. The middle
block's runs of events stand for every middle block: the trace of N blocks is the cut trace with
those runs repeated N-2 times (in block order forward, reverse order backward) and the frees
re-pointed at the same relative block. Replaying that trace through the counter's arithmetic and
the model of CUDA's caching allocator gives the allocated peak, its breakdown by kind and the
reserved peak of the whole model.

It is checked, once per kind of plan (its precision, checkpointing, offload and whether it
accumulates), by walking 4 blocks: the trace tiled to 4 must equal the walked one event for event,
and so must its peak. A model whose blocks are not alike, whose cut copy fails, runs blocks out of
order or more than once, or whose trace is not tiled exactly, is walked whole.
"""

from __future__ import annotations

import functools
import itertools

import torch

from autofit.estimator.estimate import SCALER_BYTES, Estimator, MemoryEstimate, _Meter
from autofit.estimator.fakes import fake_optimizer, warm
from autofit.estimator.repeated import cut_fake_model, repeated_blocks
from autofit.gpu.allocator import CachingAllocator
from autofit.gpu.memory import KINDS
from autofit.plans import precision as precisions
from autofit.gpu.simulate import _count, _CountingMode, _skipped_by_dynamo, _tensors

CUT, CHECK = 3, 4  # blocks walked: first, middle, last; and one more middle block for the check
MIDDLE = 2


class Untileable(Exception):
    """The cut walk's trace does not stand for the whole model."""


# -- the traced walk ---------------------------------------------------------------------------

class _TracingMeter(_Meter):
    """The estimator's meter, recording each allocation (tagged with its block), free and retag."""

    def __init__(self, block_of: dict):
        super().__init__()
        self.block_of = block_of  # storage key -> block (1-based) of the cut copy's own tensors
        self.phase = None         # the block whose forward or backward runs, None outside them
        self.events: list = []
        self.recording = True
        self.broken = None        # why the trace cannot be tiled
        self.started = False      # the measured step has begun
        self.ends_at_next_allocation = False  # the last block's phase, until the head allocates
        self.op = None            # (func, args, kwargs) of the op being counted
        self._uid: dict = {}      # storage key -> (tag, ordinal)
        self._ordinals = itertools.count()
        self._next: dict = {}     # tag -> the next ordinal

    def finish(self) -> None:
        self.recording = False

    def start(self) -> None:
        super().start()
        self.started = True
        self._emit(("start",))

    def step_begins(self, *args) -> None:
        self.phase = None
        super().step_begins(*args)
        self._emit(("s",))

    def step_ends(self, *args) -> None:
        super().step_ends(*args)
        self._emit(("e",))

    def _emit(self, event) -> None:
        if self.recording:
            self.events.append(event)

    def _tag(self, keys) -> None:
        if not self.recording:
            return super()._tag(keys)
        new, seen = [], set()
        for i, key in enumerate(keys):
            entry = self._live.get(key)
            if entry is None or key in seen:
                continue
            seen.add(key)
            if key not in self._kinds:
                new.append((i, key))
            elif self._sizes[key] != entry[1]:
                self.broken = "a storage was resized in place"
        super()._tag(keys)
        if new and self.ends_at_next_allocation:
            self.phase, self.ends_at_next_allocation = None, False
        tags = None
        for i, key in new:
            # The cut copy's own tensors, counted before the step (`track`: no op); an op's results
            # are new storages, whatever id a dead one had.
            tag = self.block_of.get(key) if self.op is None else self.phase
            # Outside the blocks the optimizer step's and the gradients made before the walk's
            # ops belong to the block of what they read; the head's and embeddings' to none.
            if tag is None and self._loose():
                tags = tags if tags is not None else self._op_tags(len(keys))
                tag = tags[i]
            ordinal = self._next.get(tag, 0)
            self._next[tag] = ordinal + 1
            self._uid[key] = (tag, ordinal)
            self.events.append(("a", tag, self._loose(), (tag, ordinal), self._sizes[key], self._kinds[key]))

    def _tag_of(self, t) -> int | None:
        uid = self._uid.get(id(t.untyped_storage()))
        return uid[0] if uid is not None else None

    def _op_tags(self, count: int) -> list:
        """Outside the blocks: the block of the tensors an op reads (a foreach op's, position by
        position), or None when they belong to none or to several."""
        func, args, kwargs = self.op or (None, (), {})
        if func is not None and func.__name__.startswith("_foreach"):
            for a in args:
                if isinstance(a, (list, tuple)) and len(a) == count and \
                        all(isinstance(t, torch.Tensor) for t in a):
                    return [self._tag_of(t) for t in a]
        tags = {self._tag_of(t) for t in _tensors((args, kwargs))} - {None}
        return [tags.pop() if len(tags) == 1 else None] * count

    def _forget(self, key: int, nbytes: int) -> None:
        if self.recording and key in self._live and key in self._uid:
            uid = self._uid.pop(key)
            self.events.append(("f", self._run(uid), self._loose(), uid))
        super()._forget(key, nbytes)

    def retag(self, tensors, kind: str) -> None:
        keys = [id(t.untyped_storage()) for t in tensors if isinstance(t, torch.Tensor)]
        before = {k: self._kinds.get(k) for k in keys}
        super().retag(tensors, kind)
        for k in keys:
            if self.recording and k in self._uid and self._kinds.get(k) != before[k]:
                uid = self._uid[k]
                self.events.append(("k", self._run(uid), self._loose(), uid, kind))

    def _run(self, uid) -> int | None:
        """The block an event belongs to: the one running, else the block of its tensor."""
        return self.phase if self.phase is not None else uid[0]

    def _loose(self) -> bool:
        """Outside the blocks' forward and backward (the optimizer step, the gradients made
        before the walk), where one block's events may trail into the next one's, in block order."""
        return self.phase is None and (self.in_step or not self.started)


def _traced_count(self, func, types, args=(), kwargs=None):
    """The counting mode's dispatch, with the op's arguments shown to the meter while it counts."""
    gpu = self.gpu
    gpu.op = (func, args, kwargs or {})
    try:
        return _count(self, func, types, args, kwargs)
    finally:
        gpu.op = None


_SKIPPED = _skipped_by_dynamo(_traced_count)


class _TracingMode(_CountingMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not _SKIPPED

    __torch_dispatch__ = _traced_count


def _first_grad_tensor(value):
    for t in _tensors(value):
        if t.requires_grad:
            return t
    return None


class _Phases:
    """Hooks on the cut copy's blocks telling the meter which block's forward or backward runs."""

    def __init__(self, meter: _TracingMeter, blocks):
        self.meter, self.count = meter, len(blocks)
        self.next, self.backward, self.reached = 0, False, set()
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(functools.partial(self.before, i),
                                                                with_kwargs=True))
            self.handles.append(block.register_forward_hook(functools.partial(self.after, i),
                                                            with_kwargs=True))

    def before(self, i, module, args, kwargs):
        if self.backward:
            return None  # a checkpointed block's recompute: inside that block's backward
        if i != self.next:
            self.meter.broken = f"block {i} ran out of order"
            return None
        self.next += 1
        self.meter.phase = i + 1
        if i == 0:
            t = _first_grad_tensor((args, kwargs))
            if t is not None:
                t.register_hook(self.tail)
        return None

    def after(self, i, module, args, kwargs, output):
        if self.backward:
            return None
        t = _first_grad_tensor(output)
        if t is None:
            self.meter.broken = f"block {i}'s output needs no gradient"
        else:
            t.register_hook(functools.partial(self.grad_at, i))
        if i == self.count - 1:
            # The caller drops the block before's output when it takes this one's: those frees
            # are this block's; the head's first allocation ends its phase.
            self.meter.ends_at_next_allocation = True
        return None

    def grad_at(self, i, grad):
        self.backward = True
        self.meter.ends_at_next_allocation = False
        self.reached.add(i)
        self.meter.phase = i + 1

    def tail(self, grad):
        self.backward = True
        self.meter.phase = None

    def close(self) -> str | None:
        """Remove the hooks; why the walk cannot be tiled, or None."""
        for h in self.handles:
            h.remove()
        if self.next != self.count:
            return f"{self.next} of {self.count} blocks ran forward"
        if len(self.reached) != self.count:
            return f"the backward pass reached {len(self.reached)} of {self.count} blocks"
        return None


class _CutEstimator(Estimator):
    """The estimator's walk on a fake copy cut to `keep` blocks, recording the trace."""

    def __init__(self, parent: Estimator, path: str, keep: int):
        # The parent's fake mode, batch and options; a cut copy of its fake model and optimizer.
        vars(self).update({k: getattr(parent, k) for k in
                           ("rows", "device_type", "loss_fn", "mode", "optimizer_name", "resident")})
        self._source, self._sampled, self.estimates = None, None, 0
        with self._quiet(), self.mode:
            self.model, fakes = cut_fake_model(parent.model, path, keep)
            self.model.train(parent.model.training)
            self.optimizer = fake_optimizer(parent.optimizer, parent.model, fakes, self.device_type,
                                            partial=True)
            for p, state in parent.optimizer.state.items():  # the step counters as the parent's
                if id(p) in fakes:
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor) and v.dim() == 0:
                            self.optimizer.state[fakes[id(p)]][k] = v.clone()
            warm(self.optimizer)
        self.batch = parent.batch
        self.blocks = self.model.get_submodule(path)
        self.block_of = {}
        for i, block in enumerate(self.blocks, start=1):
            own = list(block.parameters()) + list(block.buffers())
            for p in own:
                self.block_of[id(p.untyped_storage())] = i
                for v in self.optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        self.block_of[id(v.untyped_storage())] = i
        self._phases = None
        self._repeated = False  # the cut copy itself is walked whole

    def _new_meter(self):
        meter = _TracingMeter(self.block_of)
        self._phases = _Phases(meter, self.blocks)
        return meter

    def _counting_mode(self, meter):
        return _TracingMode(meter)

    def trace(self, plan) -> tuple[list, MemoryEstimate]:
        """The walk's events and its own estimate; raises Untileable when they cannot be tiled."""
        try:
            estimate = self.measure(plan)
        finally:
            why = self._phases.close() if self._phases is not None else "no walk"
        meter = self.last_meter
        self.last_meter = None
        why = why or meter.broken
        if why:
            raise Untileable(why)
        return meter.events, estimate


# -- tiling and replay ---------------------------------------------------------------------------

Event = tuple  # ("a", block, loose, uid, bytes, kind) | ("f", block, loose, uid) |
#                ("k", block, loose, uid, kind) | ("start",) | ("s",) | ("e",); uid = (tag, ordinal)


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


def replay(events: list) -> tuple[int, dict, int | None, int]:
    """(allocated peak, breakdown at it, peak inside the optimizer step, reserved peak) of a trace,
    counted as the estimator's meter counts (from its `start`) through the allocator model."""
    allocator = CachingAllocator()
    live: dict = {}
    totals = dict.fromkeys(KINDS, 0)
    allocated = top = 0
    top_breakdown, in_step, step_top = dict(totals), False, None
    for e in events:
        kind = e[0]
        if kind == "a":
            _, uid, size, of = e
            live[uid] = [size, of, allocator.malloc(size, False) if size else None]
            allocated += size
            totals[of] += size
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


class Repeated:
    """An estimator's repeated blocks: its cut copies and which kinds of plan passed the check."""

    def __init__(self, parent: Estimator, path: str, blocks: int):
        self.parent, self.path, self.blocks = parent, path, blocks
        self.cuts: dict = {}
        self.checked: dict = {}  # kind of plan -> whether the tiled trace matched the walk of 4
        self.why: dict = {}      # kind of plan -> why it is walked whole

    @classmethod
    def of(cls, estimator: Estimator) -> "Repeated | None":
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
        extra = SCALER_BYTES if precisions.get(plan.precision).needs_scaler else 0
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
            peak, breakdown, step, reserved = replay(tile(events, self.blocks))
        except Exception as error:  # the cut copy cannot stand for the model: walk it whole
            self.checked[kind] = False
            self.why[kind] = f"{type(error).__name__}: {error}"
            return None
        breakdown["other"] += extra
        return MemoryEstimate(plan=plan, peak_bytes=peak + extra, breakdown=breakdown,
                              device_type=self.parent.device_type, resident=dict(self.parent.resident),
                              step_bytes=step, reserved_bytes=reserved + extra,
                              optimizer=self.parent.optimizer_name)
