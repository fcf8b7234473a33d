"""Naming what holds a tensor: the path from a module global, a closure variable, a frame's local or
an optimizer's state down to it, found by climbing `gc` referrers. Used by autofit.diagnosis.leaks."""

from __future__ import annotations

import gc
import inspect
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch

MAX_DEPTH = 6           # referrer hops tried when naming what holds a tensor


# -- naming what holds a tensor -----------------------------------------------------------------------

class _Holder:
    """What a search found holding one tensor: the path from a named root down to it."""

    __slots__ = ("root", "outer", "container", "optimizer")

    def __init__(self):
        self.root = None       # "the global `LOSSES` of module x", ... (None: not found)
        self.outer = ""        # ".last": the accessors from the root to the tensor's direct holder
        self.container = None  # description of the direct holder: "a list", "a SequenceClassifierOutput"
        self.optimizer = None  # description of the optimizer whose state it is, if any


def _module_dicts() -> dict:
    out = {}
    for name, module in list(sys.modules.items()):
        try:
            key = id(vars(module))
        except Exception:  # lazy modules that refuse vars()
            continue
        if key not in out or out[key].startswith("__mp_"):  # multiprocessing's alias of __main__
            out[key] = name
    return out


# Before Python 3.13 a function frame's f_locals is a snapshot dict kept on the frame: it would keep
# what it saw alive after the function rebinds its variables (an earlier phase's optimizer, say).
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)


def _stack_locals(skip_files) -> dict:
    """{id(value): (variable, function)} for the locals of the frames on this thread's stack.

    Executing frames are invisible to `gc.get_referrers`, so a list held only in a local variable
    of the caller of `autofit.run` is found here. The snapshots read are cleared again."""
    out = {}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename not in skip_files:
            for name, value in _frame_locals(frame):
                out.setdefault(id(value), (name, frame.f_code.co_qualname))
        frame = frame.f_back
    del frame
    return out


def _frame_locals(frame) -> list:
    """[(name, value)] of a frame's locals, leaving no snapshot behind on the frame."""
    try:
        names = frame.f_locals
        items = list(names.items())
        if _SNAPSHOT_LOCALS and frame.f_code.co_flags & inspect.CO_OPTIMIZED and type(names) is dict:
            names.clear()  # the values stay in the frame's own variables
        return items
    except Exception:
        return []


class _Lazy:
    """A value computed on first use (the stack's locals: needed only for what has no other name)."""

    def __init__(self, make):
        self.make, self.value = make, None

    def __call__(self):
        if self.value is None:
            self.value = self.make()
        return self.value


def _describe_container(obj) -> str:
    if isinstance(obj, list):
        return "a list"
    if isinstance(obj, tuple):
        return "a tuple"
    if isinstance(obj, Mapping):
        return "a dict" if type(obj) is dict else f"a {type(obj).__name__}"
    return f"a {type(obj).__name__}"


def _accessor(holder, obj) -> str | None:
    """How `holder` reaches `obj` directly ("[3]", "['logits']", ".last"), None when it does not."""
    try:
        if isinstance(holder, (list, tuple)):
            for i, v in enumerate(holder):
                if v is obj:
                    return f"[{i}]"
        if isinstance(holder, Mapping):
            for k, v in holder.items():
                if v is obj:
                    return f"[{k!r}]" if isinstance(k, (str, int)) else f"[<{type(k).__name__}>]"
        attrs = getattr(holder, "__dict__", None)
        if isinstance(attrs, dict):
            for k, v in attrs.items():
                if v is obj:
                    return f".{k}"
    except Exception:
        return None
    return None


def _optimizer_words(opt) -> str:
    lrs = sorted({g.get("lr") for g in opt.param_groups if "lr" in g}, key=str)
    lr = f" (lr={', '.join(f'{x:g}' if isinstance(x, float) else str(x) for x in lrs)})" if lrs else ""
    return f"another {type(opt).__name__}{lr}"


def locate(objects: list, ignore: set, current_optimizer=None, skip_files=()) -> list[_Holder]:
    """For each object (tensors, autograd nodes), a _Holder naming what references it.

    Climbs referrers (`gc.get_referrers`, one call per level for all objects) up to MAX_DEPTH hops,
    stopping at a name: a module global, a variable captured by a closure, a local of a frame on
    the stack, or an optimizer's state.
    """
    skip_files = {__file__, *skip_files}  # the searcher's own frames name nothing
    modules = _module_dicts()
    stack = _Lazy(lambda: _stack_locals(skip_files))
    holders = [_Holder() for _ in objects]
    current = list(objects)           # the object each search has climbed to
    trail: list[list] = [[] for _ in objects]  # accessor strings, innermost first
    open_ = list(range(len(objects)))
    mine = {id(objects), id(holders), id(current), id(trail), id(open_), id(modules)}
    mine |= {id(t) for t in trail}
    for _ in range(MAX_DEPTH):
        if not open_:
            break
        level = []
        seen = set()
        for i in open_:
            if id(current[i]) not in seen:
                seen.add(id(current[i]))
                level.append(current[i])
        wanted = {id(o) for o in level}
        refs: dict = {k: [] for k in wanted}
        mine.add(id(level))
        for r in gc.get_referrers(*level):
            if id(r) in ignore or id(r) in mine:
                continue
            if isinstance(r, types.FrameType):
                if r.f_code.co_filename in skip_files:
                    continue
            elif isinstance(r, tuple) and len(r) == len(level) and all(a is b for a, b in zip(r, level)):
                continue  # the argument tuple of get_referrers itself
            try:
                inside = {id(x) for x in gc.get_referents(r)} & wanted
            except Exception:
                continue
            for k in inside:
                refs[k].append(r)
        owners = _dict_owners([r for rs in refs.values() for r in rs
                               if type(r) is dict and id(r) not in modules])
        closures = _closure_owners([r for rs in refs.values() for r in rs if isinstance(r, types.CellType)])
        names = _Names(modules, stack, owners, closures)
        still = []
        for i in open_:
            obj = current[i]
            found = _step_up(obj, refs.get(id(obj), []), names, holders[i], trail[i], current_optimizer)
            if found is None:
                continue  # named, or nothing to climb to
            current[i] = found
            still.append(i)
        open_ = still
        del level, refs, owners, closures, names
    for i, h in enumerate(holders):
        h.outer = "".join(reversed(trail[i][1:]))  # trail[i][0] reaches the tensor itself
    del current, trail
    return holders


@dataclass(frozen=True)
class _Names:
    """What names a referrer at one level of the search: module globals, the stack's locals,
    the instances owning a `__dict__`, the functions owning a closure cell."""

    modules: dict   # id(a module's __dict__) -> the module's name
    stack: object   # () -> {id(obj): (variable, function)} of the frames on this stack
    owners: dict    # id(a __dict__) -> the instance it belongs to
    closures: dict  # id(a cell) -> (function, the captured variable's name)


def _step_up(obj, referrers, names: _Names, holder: _Holder, trail: list, current_optimizer):
    """Name `obj` from its referrers, or return the container to climb to next (None: stop)."""
    root = _root(obj, referrers, names)
    if root is not None:
        holder.root = root
        return None
    return _climb(obj, referrers, names.owners, holder, trail, current_optimizer)


def _root(obj, referrers, names: _Names) -> str | None:
    """The name that holds `obj` itself, best first: a module global, a variable a closure
    captured, a local of a frame on this stack, a local of a frame not on it (a generator, a kept
    traceback)."""
    for r in referrers:
        name = names.modules.get(id(r))
        if name is not None:
            key = next((k for k, v in r.items() if v is obj), None)
            if key is not None:
                return f"the global `{key}` of module {name}"
    for r in referrers:
        if isinstance(r, types.CellType):
            owner = names.closures.get(id(r))
            if owner is not None:
                fn, var = owner
                return f"the variable `{var}` captured by {fn.__qualname__}()"
    named = names.stack().get(id(obj))
    if named is not None:
        var, fn = named
        return f"the local variable `{var}` of {fn}()"
    for r in referrers:
        if isinstance(r, types.FrameType):
            var = next((k for k, v in _frame_locals(r) if v is obj), None)
            if var is not None:
                return f"the local variable `{var}` of {r.f_code.co_qualname}()"
    return None


def _climb(obj, referrers, owners: dict, holder: _Holder, trail: list, current_optimizer):
    """The container to climb to from `obj` (another optimizer first, then an instance whose
    attribute holds it, then any container), its accessor appended to `trail`; None: stop."""
    for r in referrers:
        if isinstance(r, torch.optim.Optimizer) and r is not current_optimizer:
            holder.optimizer = _optimizer_words(r)
            trail.append(".state")
            return r  # climb on: name the optimizer itself
    best = _holding(obj, referrers, owners)
    if best is None:
        return None
    owner, acc = best
    if isinstance(owner, torch.optim.Optimizer):
        if owner is current_optimizer:
            return None  # the current optimizer's own state: not a leak (filtered before)
        holder.optimizer = _optimizer_words(owner)
    if holder.container is None:
        holder.container = _describe_container(owner)
    trail.append(acc)
    return owner


def _holding(obj, referrers, owners: dict):
    """(container, accessor) of the referrer that holds `obj` best: an instance's attribute
    first, else an attribute-style accessor over an item, the current optimizer at once; None
    when none does."""
    best = None
    for r in referrers:
        if isinstance(r, (types.FrameType, types.CellType, types.FunctionType, type)):
            continue
        if isinstance(r, dict):
            owner = owners.get(id(r))
            if owner is not None:
                key = next((k for k, v in r.items() if v is obj), None)
                if key is not None:
                    return owner, f".{key}"
        acc = _accessor(r, obj)
        if acc is None:
            continue
        if isinstance(r, torch.optim.Optimizer):
            return r, acc  # the current optimizer (another one was climbed to before): stop there
        if best is None or (acc.startswith(".") and not best[1].startswith(".")):
            best = (r, acc)
    return best


def _closure_owners(cells) -> dict:
    """{id(cell): (function, the captured variable's name)} for those of `cells` a function's
    closure holds: two heap searches for all the cells of a level (one per cell took seconds once
    transformers is loaded)."""
    if not cells:
        return {}
    wanted = {id(c) for c in cells}
    tuples = [t for t in gc.get_referrers(*cells)
              if isinstance(t, tuple) and any(id(c) in wanted for c in t)]
    out = {}
    if tuples:
        by_id = {id(t): t for t in tuples}
        for fn in gc.get_referrers(*tuples):
            closure = getattr(fn, "__closure__", None) if isinstance(fn, types.FunctionType) else None
            if closure is not None and by_id.get(id(closure)) is closure:
                for var, cell in zip(fn.__code__.co_freevars, closure):
                    if id(cell) in wanted:
                        out.setdefault(id(cell), (fn, var))
    del tuples, wanted
    return out


def _dict_owners(dicts) -> dict:
    """{id(d): the object whose __dict__ d is} for those of `dicts` that are an instance's
    attributes (one heap search for all); the others are containers."""
    if not dicts:
        return {}
    wanted = {id(d): d for d in dicts}
    out = {}
    for o in gc.get_referrers(*wanted.values()):
        try:
            if isinstance(o, (dict, list, tuple, types.FrameType)):
                continue
            d = getattr(o, "__dict__", None)
            if d is not None and id(d) in wanted and wanted[id(d)] is d:
                out[id(d)] = o
        except Exception:
            continue
    del wanted
    return out

