"""Where an optimizer keeps its state, read in one place: what autofit copies, restores and moves.

An optimizer's state is not only `optimizer.state[p]`'s tensors:
- a value may be a container of tensors: a list of past gradient norms, a dict of counters, a
  tuple of factors. Such a container is mutated in place (`state[p]["hist"].append(...)`), so a copy
  that kept the container itself would restore nothing;
- an optimizer may wrap another that keeps its own state: timm's Lookahead (`base_optimizer`), a
  wrapper of the `optimizer` or `_optimizer` kind (Accelerate's, Lightning's). The wrapped one's
  moments are in its own `state`, not the wrapper's.
`holders(optimizer)` are the optimizer and every optimizer reachable through its attributes (each
`state` mapping once: a wrapper whose `state` is its inner one's counts once); `tensors(value)` the
tensors inside one state value, at any depth of lists, tuples and dicts; `Copy` a host copy of all of
it, restored into the same objects.

Decision: a state value that is an object of another kind (a projector object holding tensors in
its attributes) is kept as it is, not copied: copying an arbitrary object could allocate on the
device in the middle of a guarded step. Such an optimizer's rollback misses what the object changes.
"""

from __future__ import annotations

import copy

import torch

from autofit.gpu.device import _map_tensors

# The attributes a wrapper keeps its wrapped optimizer in, looked at first; any other attribute
# holding an optimizer counts too (read from vars(), never from the wrapper's class name).
WRAPPED = ("optimizer", "_optimizer", "base_optimizer", "_base_optimizer", "inner_optimizer")


def chain(optimizer) -> list:
    """The optimizer and every optimizer it wraps, at any depth, each once (outermost first)."""
    out, seen = [], set()

    def visit(opt) -> None:
        if id(opt) in seen:
            return
        seen.add(id(opt))
        out.append(opt)
        attrs = vars(opt) if hasattr(opt, "__dict__") else {}
        for name in [n for n in WRAPPED if n in attrs] + sorted(n for n in attrs if n not in WRAPPED):
            value = attrs[name]
            if isinstance(value, torch.optim.Optimizer) or _wraps_an_optimizer(value):
                visit(value)

    visit(optimizer)
    return out


def _owning(optimizer, attr: str) -> list:
    """The optimizers of `chain` with an `attr` of their own (each object it names once: a wrapper
    whose `state` or `param_groups` is its inner one's counts once)."""
    out, seen = [], set()
    for opt in chain(optimizer):
        value = getattr(opt, attr, None)
        if value is not None and id(value) not in seen:
            seen.add(id(value))
            out.append(opt)
    return out


def holders(optimizer) -> list:
    """The optimizers of `chain` that keep a state of their own (each `state` mapping once)."""
    return _owning(optimizer, "state")


def group_owners(optimizer) -> list:
    """The optimizers of `chain` with param_groups of their own (each list once)."""
    return _owning(optimizer, "param_groups")


def _wraps_an_optimizer(value) -> bool:
    """A wrapper that is not an Optimizer subclass itself but holds one (Accelerate's is one)."""
    if isinstance(value, (torch.Tensor, torch.nn.Module)) or not hasattr(value, "__dict__"):
        return False
    return any(isinstance(getattr(value, n, None), torch.optim.Optimizer) for n in WRAPPED
               if n in vars(value))


def tensors(value) -> list[torch.Tensor]:
    """The tensors of one state value: itself, or those in its lists, tuples and dicts."""
    found: list = []
    _map_tensors(value, lambda t: found.append(t) or t)
    return found


def state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state and of the optimizers it wraps."""
    return [t for holder in holders(optimizer) for entry in list(holder.state.values())
            for value in list(entry.values()) for t in tensors(value)]


def map_state(optimizer, fn) -> None:
    """Replace each state tensor `t` (at any depth, in every holder) by `fn(t)`; containers are
    rebuilt only where a tensor in them changed."""
    for holder in holders(optimizer):
        for entry in list(holder.state.values()):
            for k, v in list(entry.items()):
                if isinstance(v, torch.Tensor):
                    entry[k] = fn(v)
                elif tensors(v):
                    new = _map_tensors(v, fn)
                    if any(a is not b for a, b in zip(tensors(v), tensors(new))):
                        entry[k] = new


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (no collective), else the tensor."""
    to_local = getattr(tensor, "to_local", None)  # DTensor's; torch.distributed may not be built
    return to_local() if to_local is not None else tensor


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return local(tensor.detach()).to("cpu", copy=True)


def like(saved: torch.Tensor, model: torch.Tensor, device) -> torch.Tensor:
    """`saved` (a host copy of a local shard) back on `device`, a DTensor again when `model` is one."""
    value = saved.to(device, copy=True)  # never the saved copy itself: it may be restored again
    if hasattr(model, "to_local"):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(value, model.device_mesh, model.placements, shape=model.shape,
                                  stride=model.stride(), run_check=False)
    return value


def _put_back(saved: torch.Tensor, now, was: torch.Tensor) -> torch.Tensor:
    """`saved`'s values in `now` in place when it still fits them, else a new tensor where `was` lived."""
    if isinstance(now, torch.Tensor) and local(now).shape == saved.shape and now.dtype == saved.dtype:
        local(now).copy_(saved)
        return now
    return like(saved, was, was.device if not isinstance(now, torch.Tensor) else now.device)


def _same(value, saved) -> bool:
    """Whether `value` is what `Copy._save` saved as `saved`."""
    kind, kept, copied = saved
    if kind == "tensor":
        return value is kept and torch.equal(local(value).detach().cpu(), copied)
    if kind == "tree":
        return all(torch.equal(local(t).detach().cpu(), c) for t, c in copied)
    return value == kept


class Copy:
    """Host copies of an optimizer's whole state (every holder, every depth), put back by `restore`
    into the same dicts and, where their shapes still match, the same tensors; what was added since
    (a parameter's state made by a failed first step, a key, an item appended to a list) goes.
    `spare`: host copies of an earlier Copy that nothing else holds, written again instead of
    allocated (a step guarded every time, offload's)."""

    def __init__(self, optimizer, spare: dict | None = None):
        spare = spare or {}
        self.saved = []  # (holder's state mapping, {p: (its dict, {key: saved value})})
        for h, holder in enumerate(holders(optimizer)):
            entries = {}
            for p, entry in list(holder.state.items()):
                entries[p] = (entry, {k: self._save(v, spare.get((h, id(p), k))) for k, v in entry.items()})
            self.saved.append((holder.state, entries))

    @staticmethod
    def _save(value, kept):
        if isinstance(value, torch.Tensor):
            if kept is not None and type(value) is torch.Tensor and kept.shape == value.shape \
                    and kept.dtype == value.dtype and kept.stride() == value.stride():
                return ("tensor", value, kept.copy_(value.detach()))
            return ("tensor", value, host_copy(value))
        leaves = tensors(value)
        if leaves:  # a container: its shape (new containers, the same tensors) and their values
            return ("tree", _map_tensors(value, lambda t: t), [(t, host_copy(t)) for t in leaves])
        if isinstance(value, (list, tuple, dict)):  # numbers kept in a list: mutable too
            return ("plain", copy.deepcopy(value), None)
        return ("value", value, None)

    def spare(self) -> dict:
        """{(holder, id(param), key): host copy} for the next Copy, once this one is not needed (a
        restore may hand these copies to the optimizer: never after one)."""
        return {(h, id(p), k): saved[2] for h, (_, entries) in enumerate(self.saved)
                for p, (_, held) in entries.items() for k, saved in held.items() if saved[0] == "tensor"}

    def unchanged(self) -> bool:
        """Whether the state holds what was copied: the same parameters and keys, equal values."""
        for state, entries in self.saved:
            if set(state) != set(entries):
                return False
            for p, (entry, held) in entries.items():
                if state[p] is not entry or set(entry) != set(held):
                    return False
                if not all(_same(entry[k], saved) for k, saved in held.items()):
                    return False
        return True

    def restore(self) -> None:
        with torch.no_grad():
            for state, entries in self.saved:
                for p in [p for p in state if p not in entries]:
                    del state[p]
                for p, (entry, held) in entries.items():
                    current = state.get(p, entry)
                    values = {k: self._restored(saved, current.get(k)) for k, saved in held.items()}
                    entry.clear()
                    entry.update(values)
                    state[p] = entry

    @staticmethod
    def _restored(saved, now):
        kind, was, copied = saved
        if kind == "tensor":
            return _put_back(copied, now, was)
        if kind == "tree":
            leaves = iter([_put_back(c, t, t) for t, c in copied])
            return _map_tensors(was, lambda t: next(leaves))
        if kind == "plain":
            return copy.deepcopy(was)
        return was
