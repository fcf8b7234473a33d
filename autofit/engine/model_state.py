"""What a step can write on the model besides its trained parameters, kept so a replay undoes it.

A forward may write tensors that are not buffers: running statistics kept as
`nn.Parameter(..., requires_grad=False)`, an EMA copy registered as a submodule and updated by a
forward hook (often through `.data`, which does not move `_version`), noise drawn from a
`torch.Generator` the model holds. A backward accumulates into every `.grad` it reaches: the model's
(on top of gradients present before the step, which a plain loop keeps) and leaves outside the model
that the loss reached (a discriminator's parameters). A piece per kind of state:

- `Untrained`: parameters that the optimizer does not train (not in its param_groups, or frozen).
  The first captures copy them all to host memory; at each of the next `LEARN_STEPS` captures
  (a step has succeeded) those whose contents or `_version` moved are learned (with every untrained
  parameter of their module), and from then on only those are copied, plus any whose `_version`
  moves later. A frozen base model that no step writes costs a
  walk over its parameters per step, no copy.
- `Generators`: the state of every `torch.Generator` held as a module attribute.
- `Attributes`: a module's own public attributes that a forward may write (a plain tensor, a
  counter, a dict of numbers), by reference where nothing can change them in place.
- `Gradients`: host copies of the gradients present at entry, the model's and, found by walking the
  micro-batches' autograd graphs (at the first steps, and at every step of a job whose graphs reach
  such leaves), those of leaves outside the model; after a failure the failed backward's gradients
  are dropped and the entry ones put back.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import operator
import weakref

import torch

from autofit import torch_internals as ti
from autofit.engine.host_copies import HostCopies
from autofit.engine.module_tree import ModuleTree
from autofit.engine.optimizer_state import local

log = logging.getLogger("autofit")

# Steps whose writes are learned (every untrained parameter is copied until then): two, so that a
# write of the value a tensor already held at the first step (an EMA copy's first update) is seen.
LEARN_STEPS = 2


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return local(tensor.detach()).to("cpu", copy=True)


_requires_grad = operator.attrgetter("requires_grad")
_grad = operator.attrgetter("grad")


def trained(optimizer) -> set:
    """ids of the parameters the optimizer updates: in its param_groups and requiring grad."""
    params = list(itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))
    return set(map(id, itertools.compress(params, map(_requires_grad, params))))


class Untrained:
    """Host copies of the parameters the optimizer does not train that a step writes (see the module
    docstring for how they are learned)."""

    def __init__(self, model, optimizer, device, tree: ModuleTree | None = None):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.tree = tree if tree is not None else ModuleTree(model)
        self.saved: dict[tuple, list] = {}  # (module id, name) -> [module, name, param, copy|None, version]
        self.written: set = set()            # keys a step writes (learned)
        self.learned = 0                     # steps learned from so far (all are copied until LEARN_STEPS)
        self.copies = 0                      # parameters copied so far (tests, overhead benchmark)
        self._warned: set = set()
        self.host = HostCopies(device)
        self._trained_key = None  # what `_all_trained` last answered True for

    def _all_trained(self) -> bool:
        """Whether the optimizer trains every parameter of the model; the answer is kept while the
        parameters, the param_groups' lists and every `requires_grad` are as when it was given."""
        params = self.tree.parameters()
        key = (self.tree.parameters_read, tuple((id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups),
               tuple(map(_requires_grad, params)))
        if key == self._trained_key:
            return True
        if set(map(id, params)) <= trained(self.optimizer):
            self._trained_key = key
            return True
        return False

    def capture(self) -> None:
        if not self.saved and self._all_trained():
            return  # the optimizer trains every parameter: nothing else to keep
        skip = trained(self.optimizer)
        if self.saved and self.learned < LEARN_STEPS:
            self._learn()
        learning = self.learned < LEARN_STEPS
        seen = {}
        for module, own, _buffers in self.tree.slots():
            for name, p in own.items():
                if p is None or id(p) in skip:
                    continue
                key = (id(module), name)
                old = self.saved.get(key)
                moved = old is None or old[2] is not p or old[4] != ti.version(p)
                if moved and not learning:
                    self.written.add(key)  # a new writer (or a new parameter): copied from now on
                host = None
                if learning:  # read back by the next capture's _learn: a copy made now
                    with torch.no_grad(), self.device.host():
                        host = _host(p)
                    self.copies += 1
                elif key in self.written:  # read only by a restore: started, not waited for
                    host = self.host.take(key, p)
                    self.copies += 1
                seen[key] = [module, name, p, host, ti.version(p)]
        self.saved = seen

    def _learn(self) -> None:
        """After a step: the parameters whose contents or `_version` moved are written, and with
        them every untrained parameter of their module (an average that happened to write the
        value it held, as an EMA copy does at its first update, is still a writer)."""
        modules = set()
        with torch.no_grad(), self.device.host():
            for key, (module, name, p, host, version) in self.saved.items():
                if ti.own_parameters(module).get(name) is not p or ti.version(p) != version or host is None \
                        or not torch.equal(_host(p), host):
                    modules.add(id(module))
        before = len(self.written)
        self.written |= {key for key in self.saved if key[0] in modules}
        self.learned += 1
        if len(self.written) > before:
            names = sorted({f"{type(m).__name__}.{n}" for k, (m, n, *_r) in self.saved.items() if k in self.written})
            log.info("a step writes %d parameter(s) the optimizer does not train (%s); they are kept "
                     "for a replay at every step", len(self.written), ", ".join(names[:5]))

    def restore(self) -> None:
        with torch.no_grad():
            for entry in self.saved.values():
                module, name, p, host, version = entry
                if ti.own_parameters(module).get(name) is not p:
                    ti.own_parameters(module)[name] = p  # the attempt replaced it: the original comes back
                if host is None:
                    if ti.version(p) != version and (id(module), name) not in self._warned:
                        self._warned.add((id(module), name))
                        log.warning("%s.%s was written by a failed attempt although no step before wrote "
                                    "it, so autofit kept no copy; the replay starts from what the attempt "
                                    "left. It is kept from the next step on.", type(module).__name__, name)
                    self.written.add((id(module), name))
                    continue
                local(p).copy_(host)  # always: native kernels write without moving `_version`
                entry[4] = ti.version(p)


def module_generators(model) -> list[torch.Generator]:
    """Every `torch.Generator` a module of `model` holds as an attribute, each once."""
    found, seen = [], set()
    for module in model.modules():
        for value in vars(module).values():
            if type(value) is torch.Generator and id(value) not in seen:  # an identity test: isinstance costs more per value
                seen.add(id(value))
                found.append(value)
    return found


class Generators:
    """The state of every `torch.Generator` a module of the model holds as an attribute."""

    def __init__(self, model):
        self.model = model
        self.saved: list[tuple] = []

    def capture(self) -> None:
        self.saved = [(g, g.get_state()) for g in module_generators(self.model)]

    def restore(self) -> None:
        for g, state in self.saved:
            g.set_state(state)


_PLAIN = (int, float, bool, str, type(None))


PLAIN_ITEMS = 256  # a longer container (a vocabulary kept on a module) is data, not a step's state


def _plain(value) -> bool:
    """A number or string, or a short list/tuple/dict of them (at any depth): copied as it is."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) <= PLAIN_ITEMS and all(_plain(v) for v in value)
    if isinstance(value, dict):
        return len(value) <= PLAIN_ITEMS and all(isinstance(k, _PLAIN) and _plain(v) for k, v in value.items())
    return False


def immutable(value) -> bool:
    """A number, a string, None, or a tuple of them (at any depth): nothing can change it in place,
    so a reference keeps it as well as a copy."""
    if type(value) in _PLAIN:
        return True
    return type(value) is tuple and all(immutable(v) for v in value)


TENSOR, CONTENTS, GENERATOR = "tensor", "contents", "generator"  # what Attributes copies of a value

# Public attributes a plan's switch set (transformers' `gradient_checkpointing` flag on each module
# its switch turns): the plan's state, not a step's. A restore leaves them as the switch last set
# them; put back to a capture taken before the switch, they would half undo it (the model's flag
# off, its layers' on) while the switch believes it is still on.
_SWITCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> set of names


@contextlib.contextmanager
def switch_writes(model: torch.nn.Module):
    """Around a plan's switch on `model`: the public attributes it rebinds or adds on the model's
    modules are the switch's from then on (`Attributes.restore` leaves them)."""
    before = [(module, dict(vars(module))) for module in model.modules()]
    yield
    for module, was in before:
        names = {name for name, value in vars(module).items()
                 if not name.startswith("_") and (name not in was or was[name] is not value)}
        if names:
            _SWITCHED.setdefault(module, set()).update(names)


class Attributes:
    """What a forward keeps in its modules' own attributes besides parameters and buffers: a
    plain tensor attribute written in place (a running input scale), a Python counter, a dict of
    counts, and (`generators=True`) the state of a `torch.Generator` held there. Public attributes
    only (torch's bookkeeping and a module's private caches start with "_"); objects of other kinds
    (a config) are left alone.

    Each capture takes every module's attributes by reference (one shallow copy of each module's
    `__dict__`): a forward that rebinds an attribute (a counter, `self.x = ...`) is undone by
    putting the reference back, and numbers, strings and tuples of them cannot change in place.
    What can change in place is copied: a plain tensor (to host memory, started without waiting,
    written back into the same tensor), a list or dict of plain values (a deep copy), a generator's
    state. Those are found by a walk of every attribute at the first `LEARN_STEPS` captures, again
    when the module tree changes and when a module gained or lost an attribute (a list a forward
    creates at its tenth call). An attribute that held a number or None at the walk and is rebound
    later to a list, a tensor or a generator, which a failed attempt then changes in place before
    any capture copied it, is put back by reference (its contents as the attempt left them), said
    once, and copied from the next capture on."""

    def __init__(self, model, device=None, tree: ModuleTree | None = None, *, generators: bool = False):
        self.model, self.device, self.generators = model, device, generators
        self.tree = tree if tree is not None else ModuleTree(model)
        self.saved: list[tuple] = []     # (module, shallow copy of its __dict__)
        self.contents: list[tuple] = []  # (module, name, value, kind, copy of its contents)
        self.watched: list[tuple] = []   # (module, name) whose contents a capture copies
        self.scans = 0                   # walks of every attribute (tests, benchmarks)
        self._captures = 0
        self._scanned_at = None          # the tree's walk the last scan saw
        self._sizes: list = []           # each module's number of attributes at the last capture
        self._warned: set = set()
        self.host = HostCopies(device) if device is not None else None

    def _kind(self, value) -> str | None:
        if type(value) is torch.Tensor:  # not a Parameter: those are registered
            return TENSOR
        if type(value) is torch.Generator:
            return GENERATOR if self.generators else None
        return CONTENTS if not immutable(value) and _plain(value) else None

    def _scan(self, modules) -> None:
        self.scans += 1
        self._scanned_at = self.tree.walks
        self.watched = [(module, name) for module in modules for name, value in vars(module).items()
                        if not name.startswith("_") and self._kind(value) is not None]

    def capture(self) -> None:
        modules = self.tree.modules()
        dicts = list(map(vars, modules))
        sizes = list(map(len, dicts))  # an attribute set for the first time grows its module's dict
        if self._captures < LEARN_STEPS or self._scanned_at != self.tree.walks or sizes != self._sizes:
            self._scan(modules)
        self._sizes = sizes
        self._captures += 1
        self.saved = list(zip(modules, map(dict.copy, dicts)))
        contents = []
        for module, name in self.watched:
            value = vars(module).get(name)
            kind = self._kind(value)
            if kind is not None:
                contents.append((module, name, value, kind, self._copy(module, name, value, kind)))
        self.contents = contents

    def _copy(self, module, name, value, kind):
        if kind == GENERATOR:
            return value.get_state()
        if kind == CONTENTS:
            return copy.deepcopy(value)
        if self.host is None:
            return _host(value)
        return self.host.take((id(module), name), value)

    def restore(self) -> None:
        copied = {(id(m), name) for m, name, *_rest in self.contents}
        for module, before in self.saved:
            now, switched = vars(module), _SWITCHED.get(module, ())
            for name, value in before.items():
                if name.startswith("_") or (self._kind(value) is None and not _plain(value)) or name in switched:
                    continue  # torch's bookkeeping, a config, a plan's switch: not a step's state
                now[name] = value
                if self._kind(value) is not None and (id(module), name) not in copied:
                    self._unseen(module, name)
        with torch.no_grad():
            for module, name, value, kind, saved in self.contents:
                if kind == TENSOR:
                    local(value).copy_(saved)
                elif kind == GENERATOR:
                    value.set_state(saved)
                else:
                    value = copy.deepcopy(saved)  # a copy: the saved one serves the next replay
                vars(module)[name] = value

    def _unseen(self, module, name) -> None:
        """An attribute whose contents no capture copied (rebound to a list, tensor or generator
        since the last walk): from the next capture on it is copied."""
        self.watched.append((module, name))
        if (id(module), name) not in self._warned:
            self._warned.add((id(module), name))
            log.warning("%s.%s was rebound to a %s after autofit last walked the module's attributes, so "
                        "its contents were not copied for this replay (it is put back as the failed "
                        "attempt left it); it is copied from the next step on.", type(module).__name__,
                        name, type(vars(module).get(name)).__name__)


def leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors whose `.grad` a backward from `loss` accumulates into (AccumulateGrad nodes)."""
    found, seen = [], set()
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.append(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


class Gradients:
    """Gradients present when a step begins (kept: the step adds to them, as in a plain loop), on
    the model and on leaves outside it that the step's backward reaches.

    The leaves outside the model are found by walking each micro-batch's autograd graph before its
    backward, at the first `LEARN_STEPS` captures and at every capture after one of them found
    such a leaf (a discriminator, a head outside the model): a job whose graphs reach none stops
    walking (a walk visits every node of a transformer's graph, every step). The model's parameter
    ids are collected once per walk of the module tree."""

    def __init__(self, model, device, tree: ModuleTree | None = None):
        self.model, self.device = model, device
        self.tree = tree if tree is not None else ModuleTree(model)
        self.kept: dict[int, tuple] = {}     # id(tensor) -> (tensor, host copy of its entry grad)
        self.outside: dict[int, tuple] = {}  # leaves outside the model: id -> (tensor, copy or None)
        self.host = HostCopies(device)
        self.walks = 0                       # autograd graphs walked (tests, benchmarks)
        self.walking = True                  # whether this capture's graphs are walked
        self._captures = 0
        self._found_outside = False          # some walk found a leaf outside the model
        self._params: tuple | None = None    # (the tree's parameter list, their ids)

    def _param_ids(self) -> set:
        # keyed on the tree's parameter list itself: a new list after any registration of a module
        # or a parameter (a Parameter assigned mid-run is the model's, not a leaf outside it)
        params = self.tree.parameters()
        if self._params is None or self._params[0] is not params:
            self._params = (params, set(map(id, params)))
        return self._params[1]

    def capture(self) -> None:
        self.kept, self.outside = {}, {}
        self.walking = self._captures < LEARN_STEPS or self._found_outside
        self._captures += 1
        params = self.tree.parameters()
        grads = list(map(_grad, params))
        if grads.count(None) == len(grads):
            return  # no gradient at entry (a loop that zeroes them): nothing to keep
        for p, grad in zip(params, grads):
            if grad is not None and id(p) not in self.kept:
                self.kept[id(p)] = (p, self.host.take(id(p), grad))

    def reached(self, loss: torch.Tensor) -> None:
        """Before a backward from `loss`: keep the entry gradients of the leaves outside the model it
        reaches (called with every micro-batch's loss: a later one may reach a leaf the first did
        not, a head used by some rows only; a leaf already kept keeps its first, entry, gradient)."""
        if not self.walking:
            return
        self.walks += 1
        params = self._param_ids()
        for leaf in leaves(loss):
            if id(leaf) in params or id(leaf) in self.outside:
                continue
            self._found_outside = True
            with torch.no_grad(), self.device.host():
                self.outside[id(leaf)] = (leaf, None if leaf.grad is None else _host(leaf.grad))

    def drop(self) -> None:
        """After a failure: the failed backward's gradients outside the model go (before memory is
        checked; the model's are dropped by the release)."""
        for tensor, _ in self.outside.values():
            tensor.grad = None
        # A leaf with no gradient at entry has nothing to restore (its gradient was just dropped),
        # and one made inside the failed attempt (a bias its forward made with requires_grad, as
        # T5's under checkpointing) is the attempt's: held here, it would outlive the attempt.
        self.outside = {key: kept for key, kept in self.outside.items() if kept[1] is not None}

    def restore(self) -> None:
        """Before a replay: the entry gradients come back, on the device."""
        with torch.no_grad():
            for p in self.tree.parameters():
                if id(p) not in self.kept:
                    p.grad = None
            for tensor, host in list(self.kept.values()) + list(self.outside.values()):
                tensor.grad = None if host is None else _on_device(host, tensor)

    def release(self) -> None:
        self.kept, self.outside = {}, {}


def _on_device(host: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`host` (a copy of a local shard) as a gradient of `tensor`: on its device, a DTensor again
    when `tensor` is one."""
    value = host.to(local(tensor).device, copy=True)  # a copy: the host one serves the next replay
    if hasattr(tensor, "to_local"):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(value, tensor.device_mesh, tensor.placements, shape=tensor.shape,
                                  stride=tensor.stride(), run_check=False)
    return value
