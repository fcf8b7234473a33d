"""The traced walk: the estimator's step on a fake copy cut to a few alike blocks, every allocation,
free and change of kind recorded in order, each allocation tagged with the block it belongs to.

The tag is the block whose forward or backward is running (forward pre-hooks, and gradient hooks on
each block's output mark where the walk is), or, outside the blocks' forward and backward (the
optimizer step and its foreach lists, the gradients made before the walk), the block of the tensors
the op reads, position by position for foreach ops. `autofit.estimator.tiling` tiles the trace.
"""

from __future__ import annotations

import functools

import torch

from autofit.estimator.walk import MemoryEstimate, Walker, _Meter, _device_query, as_run
from autofit.estimator.fakes import fake_optimizer, warm
from autofit.estimator.repeated import cut_fake_model
from autofit.gpu.simulate import _count, _CountingMode, _skipped_by_dynamo, _tensors


class Untileable(Exception):
    """The cut walk's trace does not stand for the whole model."""



class _TracingMeter(_Meter):
    """The estimator's meter, recording each allocation (tagged with its block), free and retag."""

    def __init__(self, block_of: dict):
        super().__init__(record=False)  # the trace is the record
        self.block_of = block_of  # storage key -> block (1-based) of the cut copy's own tensors
        self.phase = None         # the block whose forward or backward runs, None outside them
        self.events: list = []
        self.recording = True
        self.broken = None        # why the trace cannot be tiled
        self.started = False      # the measured step has begun
        self.ends_at_next_allocation = False  # the last block's phase, until the head allocates
        self.op = None            # (func, args, kwargs) of the op being counted
        self._uid: dict = {}      # storage key -> (tag, ordinal)
        self._next: dict = {}     # tag -> the next ordinal

    def finish(self) -> None:
        self.recording = False

    def tracked(self) -> None:
        self._emit(("t",))

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
    device = _device_query(func, args)
    if device is not None:
        return device
    gpu = self.gpu
    gpu.op = (func, args, kwargs or {})
    try:
        return _count(self, *as_run(func, types, args, kwargs))
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


class _CutEstimator(Walker):
    """The estimator's walk on a fake copy cut to `keep` blocks, recording the trace."""

    def __init__(self, parent: Walker, path: str, keep: int):
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

    def _forgets_dispatch(self) -> bool:
        return False  # the measure of the whole model drops what its cut walks added, at its end

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
