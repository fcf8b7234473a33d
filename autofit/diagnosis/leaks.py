"""Leaks: device memory a training job keeps that autofit cannot free, found, named and fixed.
The watch, its heap search and the fix it names share one notion of what
"held" means; the kinds of holders are in leak_kinds, the graph walk in graphs.

autofit frees everything a step makes; what it cannot free is what the user's code still references.
Those references are the leaks people hit in the field (see shared/seeds/), each with its fix:

- ``batch-on-device``: batches handed over already on the device. The DataLoader (or a list of
  batches) lives in device memory for the whole run. `batch_on_device` names the field, its shape
  and its bytes. Fix: keep the data on the CPU; autofit moves each micro-batch.
- ``graph-kept``: a tensor with a ``grad_fn`` kept across steps: the loss appended to a list without
  ``.item()``, an output kept outside the step (and with it, when that forward was never backwarded,
  its saved activations). Fix: ``loss.item()``, ``out.detach()``.
- ``tensor-kept``: tensors without a graph that pile up on the device from step to step.
- ``previous-optimizer``: the state of another optimizer (an earlier phase's) still on the device.
- ``memory-growth``: memory after each step grows under the same plan, held by nothing Python can
  see (a graph kept through a hook or a C++ extension, a cache keyed by step).

`LeakWatch` is called after each successful global step. It follows one number: the device's
allocated bytes minus what training legitimately holds there (parameters, buffers, gradients,
optimizer state, and the current batch when it lives on the device). In a clean run that number is
the same after every step (exactly 0 on the simulated GPU), so watching it costs a few sums per
step; the tensors training holds are walked again only when the allocated bytes moved since the
last walk or the plan changed (a steady step walks none: `walks` counts them). The Python heap is searched (`gc`) only when something needs naming: once after the first
step when that number is not zero (on CUDA: once, always), and when it has grown `steps` times in a
row under the same plan (then again after twice as many, so a long leak costs few searches).
Findings are plain dicts ``{"kind", "culprit", "bytes", "fix"}`` (`LeakWatch.findings`; the kinds,
their fixes and the culprit's words are in leak_kinds, the batch check in on_device), each logged
once as a warning on the ``autofit.diagnosis.leaks`` logger (a child of ``autofit``). The watch never raises
into training and never holds a reference to a tensor it found.
"""

from __future__ import annotations

import gc
import logging
import warnings
import weakref
from collections.abc import Sequence

import torch

from autofit.engine import optimizer_state
from autofit.engine.batches import _fields
from autofit.diagnosis.culprits import locate
from autofit.diagnosis.graphs import _key, _nbytes, graph_bytes
from autofit.diagnosis.leak_kinds import FIX_BATCH, FIX_GROWTH, culprit_text, fix_for, shape_of
from autofit.diagnosis.on_device import batch_on_device, device_fields, on_device_predicate
from autofit.gpu.memory import by_kind, storage_bytes, storage_key
from autofit.sizes import format_size

log = logging.getLogger("autofit.diagnosis.leaks")

GROWTH_STEPS = 3        # the leftover grows this many steps in a row under one plan: a leak
MAX_NODES = 200         # tops of graphs held by Python that are looked into, at most


class LeakWatch:
    """Follows device memory after each global step and names what the user's code keeps there.

    `runner` is the run's `autofit.engine.step.StepRunner` (its device, model, optimizer and grad scaler are
    what training legitimately holds). Call `check_batch(first_batch, data)` once before training
    and `after_step(step, plan, batch)` after each successful global step; `findings` is the list of
    dicts for `RunResult.leaks`.
    """

    def __init__(self, runner, *, steps: int = GROWTH_STEPS, tolerance: int = 0, quiet: bool = False):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int but got {steps!r}.")
        if isinstance(tolerance, bool) or not isinstance(tolerance, int) or tolerance < 0:
            raise ValueError(f"tolerance must be a non-negative int (bytes) but got {tolerance!r}.")
        self.runner = runner
        self.device = runner.device
        self.steps, self.tolerance, self.quiet = steps, tolerance, quiet
        self.on_device = on_device_predicate(self.device)
        self._findings: dict[tuple, dict] = {}
        self._data_storages: dict[int, weakref.ref] = {}  # the data's own batches, when on the device
        self._data_bytes = 0
        self._first_scan_done = False
        self._plan = None
        self._last: int | None = None
        self._base = 0
        self._streak = 0
        self._need = steps
        self._snapshot: dict | None = None
        self.scans = 0  # how many times the Python heap was searched (tests, benchmarks)
        self.walks = 0  # how many times training's own tensors were walked to sum their bytes
        self._legit_at: tuple | None = None  # (allocated bytes, legitimate bytes) of the last walk

    @property
    def findings(self) -> list[dict]:
        return [dict(f) for f in self._findings.values()]

    # -- before training ---------------------------------------------------------------------------
    def check_batch(self, batch, data=None) -> dict | None:
        """Report a first batch that arrives already on the device; returns the finding or None.

        On the simulated GPU only batches that existed before autofit read them count: a list or
        tuple of batches. A DataLoader or a generator makes its batches while autofit iterates, and
        the simulation cannot tell a host collate from a device one, so those are not judged there.
        """
        if not self.device.counts:
            return None
        sized = isinstance(data, Sequence) and not isinstance(data, (str, bytes))
        if self.device.type != "cuda" and not sized:
            return None
        try:
            message = batch_on_device(batch, self.device)
            if message is None:
                return None
            fields = device_fields(batch, self.on_device)
            culprit = ", ".join(f"{path} {shape_of(t)}" for path, t in fields[:4])
            nbytes = storage_bytes(t for _, t in fields)
            if sized:
                everything = [t for b in data for _, t in device_fields(b, self.on_device)]
                for t in everything:
                    self._data_storages[_key(t)] = weakref.ref(t.untyped_storage())
                self._data_bytes = storage_bytes(everything)
                self._legit_at = None
                if len(data) > 1:
                    nbytes = storage_bytes(everything)
                    culprit += (f"; the data holds {len(data)} batches on the device, "
                                f"{format_size(nbytes)} in all")
                del everything
            return self._report("batch-on-device", ("batch-on-device",),
                                f"the first batch arrives on {self.device.describe()}: {culprit}",
                                nbytes, FIX_BATCH)
        except Exception as error:  # diagnostics never stop training
            log.debug("batch check failed: %r", error)
            return None

    # -- after each step -----------------------------------------------------------------------------
    def leftover(self, batch=None, allocated: int | None = None) -> int:
        """Device bytes beyond parameters, buffers, gradients, optimizer state, the grad scaler, the
        data's own batches (when they live on the device) and `batch`."""
        if allocated is None:
            allocated = self.device.memory_allocated()
        legit = self._legitimate(allocated)
        extra = {}
        scaler = getattr(self.runner, "scaler", None)  # fp16 plans: the grad scaler's two scalars
        tensors = [v for v in vars(scaler).values() if isinstance(v, torch.Tensor)] if scaler else []
        if batch is not None:
            tensors += [t for _, t in _fields(batch) if isinstance(t, torch.Tensor)]
        for t in tensors:
            k = _key(t)
            if self.on_device(t) and k not in self._data_storages:
                extra[k] = _nbytes(t)
        return max(allocated - legit - sum(extra.values()), 0)

    def _legitimate(self, allocated: int) -> int:
        """Bytes of the parameters, buffers, gradients, optimizer state, the data's own batches and
        what the runner holds; walked again only when `allocated` moved since the last walk (those
        tensors change with the plan, not from one steady step to the next)."""
        if self._legit_at is not None and self._legit_at[0] == allocated:
            return self._legit_at[1]
        self.walks += 1
        held = by_kind(self.device, self.runner.model, self.runner.optimizer)
        legit = held["params"] + held["grads"] + held["optimizer"] + self._data_bytes
        legit += storage_bytes(self._runner_held(), on_device=self.on_device)
        self._legit_at = (allocated, legit)
        return legit

    def after_step(self, step: int, plan, batch=None, allocated: int | None = None) -> list[dict]:
        """Call after a successful global step; returns the findings new or grown at this step."""
        if not self.device.counts:
            return []
        try:
            return self._after_step(step, plan, batch, allocated)
        except Exception as error:  # diagnostics never stop training
            log.debug("leak check after step %s failed: %r", step, error)
            return []

    def _after_step(self, step, plan, batch, allocated) -> list[dict]:
        moved = plan != self._plan
        if moved:
            self._legit_at = None  # a new plan may hold its state elsewhere (offload)
        left = self.leftover(batch, allocated)
        new = []
        if not self._first_scan_done:
            self._first_scan_done = True
            if left > self.tolerance or self.device.type == "cuda":
                new += self._scan(step, batch, growth=None)
        if self._last is None or moved:
            self._streak, self._snapshot = 0, None
        elif left > self._last + self.tolerance:
            if self._streak == 0:
                self._base = self._last
                self._snapshot = self._storages()
            self._streak += 1
        else:
            self._streak, self._snapshot = 0, None
        self._last, self._plan = left, plan
        if self._streak >= self._need:
            self._need *= 2  # a leak that goes on is searched for again after twice as many steps
            new += self._scan(step, batch, growth=(left - self._base, self._streak))
        return new

    # -- searching -----------------------------------------------------------------------------------
    def _storages(self) -> dict:
        """{key: weakref to storage} of what is on the device now (cheap on the simulated GPU)."""
        gpu = getattr(self.device, "gpu", None)
        if gpu is not None:
            return {storage_key(s): weakref.ref(s) for s, _ in gpu.live_storages()}
        tensors = self._live_objects()[0]
        out = {_key(t): weakref.ref(t.untyped_storage()) for t in tensors}
        del tensors
        return out

    def _training_keys(self, batch) -> set:
        model, opt = self.runner.model, self.runner.optimizer
        tensors = list(model.parameters()) + list(model.buffers())
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
        tensors += optimizer_state.state_tensors(opt)
        scaler = getattr(self.runner, "scaler", None)
        if scaler is not None:
            tensors += [v for v in vars(scaler).values() if isinstance(v, torch.Tensor)]
        if batch is not None:
            tensors += [t for _, t in _fields(batch) if isinstance(t, torch.Tensor)]
        tensors += self._runner_held()
        keys = {_key(t) for t in tensors}
        keys |= {k for k, r in self._data_storages.items() if r() is not None}
        return keys

    def _runner_held(self) -> list:
        """What the step runner holds besides the model and optimizer (a sharded model's meshes)."""
        held = getattr(self.runner, "held", None)
        return held() if held is not None else []

    def _live_objects(self):
        """(tensors on the device, one per storage; autograd nodes) reachable from Python."""
        self.scans += 1
        tensors, nodes, node_types = {}, [], {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                kind = type(obj)
                try:
                    if isinstance(obj, torch.Tensor):
                        if self.on_device(obj):
                            tensors.setdefault(_key(obj), obj)
                        continue
                    is_node = node_types.get(kind)
                    if is_node is None:
                        is_node = node_types[kind] = isinstance(obj, torch.autograd.graph.Node)
                    if is_node:
                        nodes.append(obj)
                except Exception:
                    continue
        return list(tensors.values()), nodes

    def _scan(self, step: int, batch, growth) -> list[dict]:
        """Search the heap; report what is kept. `growth`: (bytes grown, steps) when growing."""
        training = self._training_keys(batch)
        tensors, nodes, fresh = self._suspects(training, growth)
        groups = self._held_by(tensors, nodes)
        del tensors, nodes
        reports, explained = self._reports(groups, fresh, growth, training)
        del groups
        if growth is not None and not explained:
            reports.append(self._report(
                "memory-growth", ("memory-growth",),
                f"device memory left after each step grew {growth[1]} steps in a row under the same "
                f"plan (+{format_size(growth[0])}, now {format_size(self._last or 0)} beyond "
                f"parameters, gradients and optimizer state)", growth[0], FIX_GROWTH))
        return [r for r in reports if r is not None]

    def _suspects(self, training: set, growth) -> tuple[list, list, set | None]:
        """(tensors and autograd nodes alive outside the training step's own, the keys of tensors
        new since the last snapshot: None when memory is not growing)."""
        tensors, nodes = self._live_objects()
        tensors = [t for t in tensors if _key(t) not in training]
        snapshot = self._snapshot if growth is not None else None
        fresh = None if snapshot is None else {
            k for k in (_key(t) for t in tensors) if not (k in snapshot and snapshot[k]() is not None)}
        # An autograd node Python holds (not a kept tensor's own grad_fn) can hold saved activations.
        # Only the tops of graphs: a walk of a graph leaves Python wrappers for its inner nodes.
        inner = {id(t.grad_fn) for t in tensors if t.grad_fn is not None}
        for n in nodes:
            try:
                inner.update(id(child) for child, _ in n.next_functions if child is not None)
            except Exception:
                continue
        nodes = [n for n in nodes if id(n) not in inner][:MAX_NODES]
        nodes = [n for n in nodes if graph_bytes([n], self.on_device, training)]
        return tensors, nodes, fresh

    def _held_by(self, tensors: list, nodes: list) -> dict[tuple, list]:
        """{(root, outer, optimizer): [(object, holder)]}: the objects Python holds, by who holds
        them (the lists given, and this module's frames, are not holders)."""
        objects = tensors + nodes
        holders = locate(objects, {id(tensors), id(nodes), id(objects)}, self.runner.optimizer,
                         skip_files={__file__}) if objects else []
        groups: dict[tuple, list] = {}
        for obj, holder in zip(objects, holders):
            if holder.root is None and holder.container is None:
                continue  # held from C++ only (a graph's saved tensor): the graph's owner is reported
            key = (holder.root, "" if holder.optimizer else holder.outer, holder.optimizer)
            groups.setdefault(key, []).append((obj, holder))
        return groups

    def _reports(self, groups: dict, fresh: set | None, growth, training: set) -> tuple[list, bool]:
        """(a report per holder whose objects are a leak, new or grown; whether one explains the
        growth)."""
        reports, explained = [], False
        for (root, outer, optimizer), members in groups.items():
            ts = [o for o, _ in members if isinstance(o, torch.Tensor)]
            ns = [o for o, _ in members if not isinstance(o, torch.Tensor)]
            new_storage = fresh is None or any(_key(t) in fresh for t in ts)
            if optimizer is not None:
                kind = "previous-optimizer"
            elif ns or any(t.grad_fn is not None for t in ts):
                kind = "graph-kept"
            elif growth is not None and new_storage:
                kind = "tensor-kept"
            else:
                continue  # constant, without a graph: a cache or the user's own data, not a leak
            key = (kind, root, outer)
            saved = graph_bytes([t.grad_fn for t in ts] + ns, self.on_device, training)
            nbytes = storage_bytes(ts) + saved
            known = self._findings.get(key)
            grows = growth is not None and kind != "previous-optimizer" and (
                (new_storage and (fresh is not None or known is None))
                or (known is not None and nbytes > known["bytes"]))
            if growth is not None and known is not None and not grows:
                continue  # known and not growing: nothing new to say
            culprit = culprit_text(root, outer, members[0][1].container, ts, ns, saved, optimizer)
            if grows:
                culprit += (f"; device memory after each step grew {growth[1]} steps in a row under "
                            f"the same plan (+{format_size(growth[0])})")
            reports.append(self._report(kind, key, culprit, nbytes, fix_for(kind, ts)))
            explained |= grows
        return reports, explained

    def _report(self, kind: str, key: tuple, culprit: str, nbytes: int, fix: str) -> dict | None:
        finding = {"kind": kind, "culprit": culprit, "bytes": int(nbytes), "fix": fix}
        known = self._findings.get(key)
        self._findings[key] = finding
        if known is not None and known["bytes"] >= nbytes:
            return None  # already said, and no worse
        if not self.quiet:
            verb = "keeps growing" if known is not None else "found"
            log.warning("leak %s (%s): %s, %s. Fix: %s.", verb, kind, culprit, format_size(nbytes), fix)
        return dict(finding)

