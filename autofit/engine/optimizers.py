"""What autofit asks of the user's optimizer, checked before training starts.

autofit calls `optimizer.step()` once per global batch, after every micro-batch's backward. An
optimizer whose `step` needs a closure (LBFGS re-evaluates the loss several times per step) cannot
be stepped that way; it is refused before any forward runs, not after the first backward. An
optimizer that allocates its state in its constructor (Adagrad's `sum`) allocates on the device
when the factory runs: an OOM there is reported as `DoesNotFit`, never as a raw OOM.
"""

from __future__ import annotations

import gc
import inspect

from autofit.errors import DoesNotFit
from autofit.gpu.oom import is_oom, summarize


def needs_closure(optimizer) -> bool:
    """Whether `optimizer.step` has a parameter without a default (a required closure)."""
    try:
        params = list(inspect.signature(type(optimizer).step).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return any(p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def check_steppable(optimizer) -> None:
    name = type(optimizer).__name__
    if needs_closure(optimizer):
        raise ValueError(
            f"{name}.step needs a closure (it re-evaluates the loss within one step), but autofit steps "
            f"the optimizer once per global batch after accumulating the micro-batches' gradients, "
            f"without one. Use an optimizer whose step(closure=None) works without a closure (AdamW, "
            f"SGD, ...), or train {name} in a loop of your own.")


def from_factory(factory, params):
    """`factory(params)`; an out-of-memory error while it builds state becomes DoesNotFit."""
    failure = None
    try:
        return factory(params)
    except Exception as error:
        if not is_oom(error):
            raise
        failure = summarize(error)
    gc.collect()  # out of the except block: what the half-built optimizer held can go
    raise DoesNotFit(
        f"the optimizer factory ran out of memory while building the optimizer ({failure}): its "
        f"constructor allocates state on the device before the first step. Give a larger budget, "
        f"or pass an optimizer whose state is allocated at its first step.")
