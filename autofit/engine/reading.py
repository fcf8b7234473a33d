"""Reading the data as a plain loop reads it.

A plain loop calls `iter(data)` once per epoch and nothing else: a shuffled DataLoader draws its
order (and its workers' base seed) from torch's global RNG at each `iter()`, and starts its worker
processes there. So the first batch, which the capacity check and the plan cache look at, is taken
from the first epoch's own iterator, and the checks that run before training leave torch's RNG
(and the generators the data carries) where they found it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from autofit.engine.model_state import module_generators
from autofit.engine.replay import rng_state, set_rng_state


def is_one_shot(data) -> bool:
    """An iterator (a generator, `iter(...)` of something) can be read once; telling so must not
    call `iter()` on a DataLoader, which would draw from the RNG and start its workers."""
    return isinstance(data, Iterator)


class Epochs:
    """`Epochs(data, epochs)()` gives each epoch's batches; `.first` is the first epoch's first
    batch, read from that epoch's own iterator before training starts."""

    def __init__(self, data, epochs: int, what: str = "data"):
        if is_one_shot(data) and epochs > 1:
            raise ValueError(f"{what} is a one-shot iterator ({type(data).__name__}) but epochs={epochs}; "
                             f"pass a DataLoader or a list so each epoch can read it again.")
        self.data = data
        self._head = iter(data)
        try:
            self.first = next(self._head)
        except StopIteration:
            raise ValueError(f"{what} ({type(data).__name__}) yielded no batch; give at least one.") from None

    def __call__(self):
        head, self._head = self._head, None
        if head is not None:
            return itertools.chain([self.first], head)
        return iter(self.data)


def _generators(obj, depth: int = 3) -> list[torch.Generator]:
    """The torch.Generators a DataLoader draws from: its own, its sampler's, its batch sampler's."""
    found = []
    if depth == 0 or obj is None:
        return found
    for name in ("generator", "sampler", "batch_sampler"):
        value = getattr(obj, name, None)
        if isinstance(value, torch.Generator):
            found.append(value)
        elif value is not None and name != "generator":
            found.extend(_generators(value, depth - 1))
    return found


@contextlib.contextmanager
def rng_untouched(*sources):
    """Work inside (fake-tensor estimates, a look at the evaluation data) leaves the global random
    generators (torch's on CPU and every CUDA device, Python's, numpy's) and the generators of
    `sources` as they were: a forward traced on fake tensors still runs the model's Python code. A
    source is a DataLoader (its own generator, its samplers') or a model (the generators its
    modules hold: a fake copy of the model draws from the same ones)."""
    generators = list({id(g): g for s in sources for g in
                       (module_generators(s) if isinstance(s, torch.nn.Module) else _generators(s))}.values())
    states = [g.get_state() for g in generators]
    rng = rng_state()
    try:
        yield
    finally:
        set_rng_state(rng)
        for g, state in zip(generators, states):
            g.set_state(state)
