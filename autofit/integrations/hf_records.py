"""The records a Hugging Face `Trainer` keeps in plain data, put back as they were before an attempt
that leaves no trace: the capacity check's estimate (which runs the Trainer's own `compute_loss` on
fake tensors), a failed training attempt before it is replayed, a failed evaluation before it is
retried. The rule is the model's: only the attempt that succeeds is recorded, once.

What counts as a record is found by its kind, never by name: every attribute of the Trainer, of its
`TrainerState` (log_history, global_step, counters) and of its `TrainerControl` whose value is
plain data (None, numbers, strings, and lists, tuples, dicts and sets of plain data, however
nested). That covers what subclasses add (a token count, a list of metrics waiting to be logged)
as well as the Trainer's own counters. Objects (the model, the optimizer, the arguments, loaders,
callbacks) are never touched: they have their own recovery, and autofit changes some of them
between attempts on purpose. An attribute that holds an object now is left alone even if it held
plain data in the snapshot (and one that held an object then is left as it is now); one that holds
plain data now but did not exist then is removed.
Callbacks are not restored: they observe every attempt, as they see each one's `on_train_begin`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import numbers

import torch

_SCALARS = (type(None), numbers.Number, str, bytes)
_SYMBOLS = (torch.SymInt, torch.SymFloat, torch.SymBool)  # what a fake-tensor estimate leaves behind
_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)
_HOLDERS = ("state", "control")  # the Trainer's own record holders, besides the Trainer itself


def _plain(value, symbols: bool = False) -> bool:
    """Whether `value` is plain data (`symbols`: symbolic numbers count as data too)."""
    if isinstance(value, _SCALARS) and not isinstance(value, torch.Tensor):
        return True
    if symbols and isinstance(value, _SYMBOLS):
        return True
    if isinstance(value, dict):
        return all(_plain(k, symbols) and _plain(v, symbols) for k, v in value.items())
    if isinstance(value, _CONTAINERS):
        return all(_plain(v, symbols) for v in value)
    return False


def _plain_attributes(obj) -> tuple[dict, frozenset]:
    """(copies of the plain-data attributes, the names of every attribute)."""
    values = vars(obj)
    return ({name: copy.deepcopy(value) for name, value in values.items()
             if name not in _HOLDERS and _plain(value)}, frozenset(values))


def _put(current, saved):
    """`saved` (a copy of it), written into `current` in place where both are the same kind of
    mutable container, so that other references to a list or dict of records see it too."""
    if type(current) is not type(saved):
        return copy.deepcopy(saved)
    if isinstance(saved, dict):
        kept = {k: current.pop(k) for k in list(current)}
        for k, v in saved.items():  # saved's order: a log's keys come out as they went in
            current[k] = _put(kept[k], v) if k in kept else copy.deepcopy(v)
        return current
    if isinstance(saved, (list, collections.deque)):
        current.clear()
        current.extend(copy.deepcopy(v) for v in saved)
        return current
    if isinstance(saved, set):
        current.clear()
        current.update(saved)
        return current
    return copy.deepcopy(saved)


class Records:
    """A snapshot of a Trainer's plain-data records (`snapshot(trainer)`); `restore()` puts them back
    (as often as needed: the snapshot itself is never handed out)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.saved = {None: _plain_attributes(trainer)}
        for name in _HOLDERS:
            holder = getattr(trainer, name, None)
            if holder is not None:
                self.saved[name] = _plain_attributes(holder)

    def restore(self) -> None:
        for name, attributes in self.saved.items():
            holder = self.trainer if name is None else getattr(self.trainer, name, None)
            if holder is not None:
                _restore(holder, attributes)


def _restore(holder, attributes: tuple[dict, frozenset]) -> None:
    saved, names = attributes
    values = vars(holder)
    for name in [n for n, v in values.items() if n not in names and _plain(v, True)]:
        del values[name]  # a record the attempt started
    for name, value in saved.items():
        if name not in values:
            values[name] = copy.deepcopy(value)
        elif _plain(values[name], symbols=True):
            values[name] = _put(values[name], value)


def snapshot(trainer) -> Records:
    """The Trainer's plain-data records now, to `restore()` later."""
    return Records(trainer)


@contextlib.contextmanager
def kept(trainer):
    """`with kept(trainer):` leaves the Trainer's records as they were before the block, whatever it
    ran (the capacity check's estimate), also when it raises."""
    records = snapshot(trainer)
    try:
        yield records
    finally:
        records.restore()
