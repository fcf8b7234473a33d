"""Memoized functions a fake walk fills: emptied when the walk ends, so no fake tensor outlives it.

A model's code may memoize with `functools.lru_cache`/`functools.cache` at the level of its class or
its Python module (transformers' BEiT caches its relative position index per window size). Called
during a walk on fake tensors, such a function caches a fake tensor, and every real step of any
model of that class, in the rest of the process, reads it back and fails ("Please convert all
Tensors to FakeTensors first"). The memoized functions of every class the model's modules are
instances of (and of the Python modules that define them; a cache a decorator keeps in its closure
too) that computed a new entry during the walk are emptied at its end; an entry computed for real before the walk goes with them, and is computed
again when next asked for.
"""

from __future__ import annotations

import contextlib
import sys

import torch

_TORCH = ("torch.", "torch")  # torch's own memoized functions hold no model's tensors


def memoized_of(model: torch.nn.Module) -> list:
    """The lru_cache wrappers reachable from the classes of `model`'s modules and their modules."""
    found: dict[int, object] = {}
    classes = {cls for m in model.modules() for cls in type(m).__mro__
               if cls is not object and not cls.__module__.startswith(_TORCH)}
    namespaces = [vars(cls) for cls in classes]
    namespaces += [vars(sys.modules[name]) for name in {cls.__module__ for cls in classes}
                   if name in sys.modules]
    for namespace in namespaces:
        for value in list(namespace.values()):
            for f in _caches_in(getattr(value, "__func__", value)):  # a staticmethod's function too
                found[id(f)] = f
    return list(found.values())


def _caches_in(value, depth: int = 3) -> list:
    """`value` if it is an lru_cache wrapper, else those a function holds in its closure (a
    decorator that wraps the cached function, as transformers' compile-compatible lru_cache does)."""
    if callable(value) and callable(getattr(value, "cache_info", None)) \
            and callable(getattr(value, "cache_clear", None)):  # what functools' caches answer to
        return [value]
    cells = getattr(value, "__closure__", None) if callable(value) else None
    if not cells or depth == 0:
        return []
    out = []
    for cell in cells:
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(content):
            out += _caches_in(content, depth - 1)
    return out


@contextlib.contextmanager
def emptied_after(memoized: list):
    """Inside, a walk on fake tensors; on leaving, the functions of `memoized` (`memoized_of`) that
    computed an entry meanwhile are emptied."""
    misses = [f.cache_info().misses for f in memoized]
    try:
        yield
    finally:
        for f, before in zip(memoized, misses):
            if f.cache_info().misses != before:
                f.cache_clear()
