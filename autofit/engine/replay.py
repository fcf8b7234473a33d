"""The state an attempt starts from, captured once and restored before the next: `StartState`, the
one capture of every retry autofit makes (its modes: a replay of one global batch, a Trainer's run
restarted from its start, an estimate's sampled steps; whole copies are engine/whole_state.py's).
What follows is the replay's (REPLAY, training's controller).

A failed attempt has already drawn dropout masks, updated BatchNorm's running statistics, maybe
advanced a counter in the optimizer's param_groups, and handed its micro-batches to a `loss_fn`
that may change them in place. Replaying on top of that would not be the mathematics of a plain
loop. `StartState` keeps what a replay needs, in host memory:
- the global random generators a forward may draw from: torch's (CPU and every CUDA device),
  Python's `random` and numpy's (a layer-drop written with `random.random()`): a few KiB;
- the model's buffers: host copies at every capture (running statistics are written without a
  `_version` bump, and anything written through `.data` too);
- the parameters the optimizer does not train that a step writes, the generators the model holds,
  its modules' own public attributes a forward may write (a plain tensor, a counter) and the
  gradients present at entry, on the model and on leaves outside it that the backward
  reaches (`model_state`);
- the optimizer's param_groups (every entry but "params"; the state is rolled back by
  `atomic.Snapshot`, the trained parameters are only written by a step);
- the batch as given: fresh containers for every attempt, and host copies of the tensors that reach
  the loss without being copied (already on the device), restored when an attempt wrote to them.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys

import torch

from autofit import torch_internals as ti
from autofit.engine import attempt_writes
from autofit.engine.host_copies import HostCopies
from autofit.engine.model_state import Attributes, Generators, Gradients, Untrained, immutable
from autofit.engine.module_tree import ModuleTree
from autofit.engine.whole_state import OptimizerState, StateDicts, Tensors
from autofit.gpu.device import _map_tensors


def rng_state() -> tuple:
    """The global random generators: torch's (CPU, every CUDA device), Python's and numpy's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return (torch.get_rng_state(), cuda) + python_rng_state()


def set_rng_state(state: tuple) -> None:
    cpu, cuda, *python = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    set_python_rng_state(tuple(python))


def python_rng_state() -> tuple:
    """Python's `random` and numpy's global generators (numpy only when something imported it:
    code that never did cannot have drawn from it)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy and numpy.random.get_state()


def set_python_rng_state(state: tuple) -> None:
    py, np_state = state
    random.setstate(py)
    if np_state is not None:
        sys.modules["numpy"].random.set_state(np_state)


def save_groups(optimizer) -> list[dict]:
    """Copies of every param_group's entries but "params" (lr, betas, a step counter kept there);
    a value nothing can change in place (a number, a string, a tuple of them) is kept as it is."""
    return [{k: v if immutable(v) else copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def restore_groups(optimizer, saved: list[dict]) -> None:
    """Put `save_groups`' copies back, in place: schedulers and GradScaler hold these dicts."""
    for group, entries in zip(optimizer.param_groups, saved):
        for k in [k for k in group if k != "params" and k not in entries]:
            del group[k]
        group.update({k: copy.deepcopy(v) for k, v in entries.items()})


def fresh(batch, tensor=lambda t: t):
    """The batch in new containers (dicts, lists, tuples, BatchEncoding), leaves passed to `tensor`
    when they are tensors and kept as they are otherwise."""
    return _map_tensors(batch, tensor)


def _leaves(batch):
    out = []
    fresh(batch, lambda t: out.append(t) or t)
    return out


class _Buffers:
    """Host copies of a model's buffers, taken at every capture: any buffer may have been written
    since the last one without a trace (native kernels write batch norm's running statistics without
    bumping `_version`, and a write through `.data` bumps nothing, a flag set with
    `self.initialized.data.fill_(1)` included). Buffers are small next to the parameters; their
    copies are started without waiting (host_copies) and read only by a restore."""

    def __init__(self, model, device, tree: ModuleTree):
        self.model, self.device, self.tree = model, device, tree
        self.saved: list[tuple] = []  # (module, name, tensor, copy)
        self.host = HostCopies(device)

    @property
    def copies(self) -> int:
        """Buffers copied to host so far (for tests and the overhead benchmark)."""
        return self.host.copies

    def capture(self) -> None:
        saved = []
        for module, own in self.tree.buffer_slots():
            for name, buf in own.items():
                if buf is not None:
                    saved.append((module, name, buf, self.host.take((id(module), name), buf)))
        self.host.keep_only({(id(m), n) for m, n, _b, _h in saved})
        self.saved = saved

    def restore(self) -> None:
        with torch.no_grad():
            for module, name, buf, host in self.saved:
                if ti.own_buffers(module).get(name) is not buf:
                    ti.own_buffers(module)[name] = buf  # the attempt replaced it: the original comes back
                buf.copy_(host)


REPLAY, RESTART, TRIAL = "replay", "restart", "trial"  # StartState's modes


class _Rng:
    def capture(self) -> None:
        self.state = rng_state()

    def restore(self) -> None:
        set_rng_state(self.state)


class _Groups:
    def __init__(self, optimizer, device):
        self.optimizer, self.device = optimizer, device

    def capture(self) -> None:
        with _host_of(self.device):
            self.saved = save_groups(self.optimizer)

    def restore(self) -> None:
        restore_groups(self.optimizer, self.saved)


def _host_of(device):
    return device.host() if device is not None else contextlib.nullcontext()


class StartState:
    """The state an attempt starts from: `capture` before the first attempt, `restore` before
    another. One capture for every kind of attempt autofit retries; `mode` says which:
    - REPLAY (training's controller, one global batch): the module's list above; `begin` at the
      start of each attempt (it restores before a replay) gives the batch to train;
    - RESTART (a Hugging Face Trainer's run restarted from its start, hf_recovery): host copies of
      the `state_dict()`s of the model (unless `weights=False`: the Trainer re-creates it), the
      optimizer (None: the Trainer makes its own) and `scheduler`, and the random generators;
    - TRIAL (an estimate's sampled steps, estimator/sampled.py; `held()` around them): every tensor,
      gradient and mode of the model, the optimizer's state and groups, and the random generators
      (the global ones and those the model's modules hold).
    `device`: where host copies are made (its `host()`; None: no device, as for TRIAL)."""

    def __init__(self, model, optimizer, device, *, mode: str = REPLAY, scheduler=None, weights: bool = True):
        if mode not in (REPLAY, RESTART, TRIAL):
            raise ValueError(f"mode must be one of {REPLAY!r}, {RESTART!r}, {TRIAL!r} but got {mode!r}.")
        self.model, self.optimizer, self.device, self.mode = model, optimizer, device, mode
        if mode == RESTART:
            kept = [o for o in (model if weights else None, optimizer, scheduler) if o is not None]
            self.parts = [StateDicts(kept, [o for o in (optimizer, scheduler) if o is not None], device), _Rng()]
            return
        if mode == TRIAL:
            self.parts = [Tensors(model), OptimizerState(optimizer), _Groups(optimizer, device), _Rng(),
                          Generators(model)]
            return
        ti.require(ti.REPLAY)
        self.tree = ModuleTree(model)  # one walk of the modules for every part, again when it changes
        self.buffers = _Buffers(model, device, self.tree)
        self.untrained = Untrained(model, optimizer, device, self.tree)
        self.attributes = Attributes(model, device, self.tree, generators=True)
        self.gradients = Gradients(model, device, self.tree)
        self.parts = [_Rng(), self.buffers, self.untrained, self.attributes, _Groups(optimizer, device),
                      self.gradients]
        self.attempts = 0
        self.batch_copies = HostCopies(device)  # the batch's tensors a loss could write

    def capture(self, batch=None) -> None:
        """Take the state now; REPLAY takes the global batch to replay too."""
        for part in self.parts:
            part.capture()
        if self.mode != REPLAY:
            return
        self.attempts = 0
        self.given = batch
        # Tensors the device hands to the loss as they are (no host-to-device copy) could be
        # written by the loss; keep their contents. The others reach the loss as copies.
        self.versions = [(t, ti.version(t)) for t in _leaves(batch)]
        self.kept = {id(t): self.batch_copies.take(i, t)
                     for i, (t, _) in enumerate(self.versions) if self.device.shares(t)}

    @contextlib.contextmanager
    def held(self):
        """Captured on entering, restored on leaving (also on error): inside, anything may train."""
        self.capture()
        try:
            yield self
        finally:
            self.restore()

    def release(self) -> None:
        """Drop the batch and its copies once its step is over (the buffer copies stay)."""
        self.given, self.versions, self.kept = None, [], {}
        self.gradients.release()

    def reached(self, loss) -> None:
        """A micro-batch's loss, before its backward: the leaves it reaches keep their entry
        gradients (see model_state.Gradients)."""
        self.gradients.reached(loss)

    def failed(self) -> None:
        """After a failed attempt, before memory is checked: its gradients go, and what it wrote
        into the model (engine/attempt_writes)."""
        self.gradients.drop()
        attempt_writes.undo(self.attributes, self.buffers)

    def begin(self):
        """The batch as given, in fresh containers; before a replay, the start state is restored."""
        if self.attempts:
            self.restore()
        self.attempts += 1
        return fresh(self.given)

    def restore(self) -> None:
        for part in self.parts:
            part.restore()
        if self.mode != REPLAY:
            return
        for i, (t, version) in enumerate(self.versions):
            if ti.version(t) == version:
                continue
            kept = self.kept.get(id(t))
            if kept is None:
                raise RuntimeError(
                    f"a tensor of the batch ({list(t.shape)}, {t.dtype}) was written in place during an "
                    f"attempt that ran out of memory, and autofit kept no copy of it, so the replay "
                    f"cannot start from the batch as given. Make loss_fn leave its batch unchanged "
                    f"(use out-of-place operations, e.g. x = x * 2 instead of x.mul_(2)).")
            with torch.no_grad():
                t.copy_(kept)
            self.versions[i] = (t, ti.version(t))
