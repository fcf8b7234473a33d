"""What the estimator does where a step reads values that fake tensors do not have.

Fake tensors carry shapes, not values. A size that depends on the data (the rows a boolean mask
selects, a `nonzero` count) is a symbol, and so is a value read with `.item()` or a branch on
`.any()`. torch decides such a branch from the values its real-tensor propagation records;
`Hints` gives it one for every symbol instead, and the meter sizes a storage at its upper bound.
torch logs its own traceback when a fake kernel fails; `silenced_torch_logs` keeps it quiet while
the estimator runs (the caller reports the failure once).
"""

from __future__ import annotations

import contextlib
import logging

import sympy

# torch logs a traceback of its own when a fake kernel fails (~25 lines for one Mixtral step); the
# estimator's caller reports the failure once, so these are silenced while it runs.
# torch.__trace is torch's structured-trace log, always at DEBUG: where a handler receives its records
# (propagation switched on by a logging setup) they hold the estimate's fake tensors and shape envs.
TORCH_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes",
                 "torch._dynamo", "torch._functorch", "torch._guards", "torch.__trace")


@contextlib.contextmanager
def silenced_torch_logs():
    """torch's fake-tensor and symbolic-shape loggers say nothing inside; their levels are restored."""
    loggers = [logging.getLogger(name) for name in TORCH_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def upper_bound(n) -> int:
    """An int, or the largest value a data-dependent size can take (the rows a boolean mask may
    select: all of them), which is what the memory must allow for."""
    if isinstance(n, int):
        return n
    bound = n.node.shape_env.bound_sympy(n.node.expr).upper
    if not bound.is_finite:
        raise ValueError(f"a tensor's size depends on its data with no upper bound ({n.node.expr}); "
                         f"the estimator cannot size it.")
    return int(bound)


class Hints(dict):
    """A value for every data-dependent symbol, looked up when torch must decide a branch on one
    (torch's real-tensor propagation reads its values from this mapping; here they are hints):
    a size (the rows a mask selects, a nonzero count) is its upper bound, the memory to allow for;
    any other value (`.item()`, `.any()`) is 0 within its range, the path of a check that passes."""

    def __init__(self, shape_env):
        super().__init__()
        self.shape_env = shape_env

    def __bool__(self) -> bool:
        return True

    def __contains__(self, symbol) -> bool:
        return super().__contains__(symbol) or (symbol in self.shape_env.var_to_range
                                                and symbol not in self.shape_env.backed_var_to_val)

    def __getitem__(self, symbol):
        if super().__contains__(symbol):
            return super().__getitem__(symbol)
        bounds = self.shape_env.var_to_range[symbol]
        if symbol in self.shape_env.size_like and bounds.upper.is_finite:
            value = bounds.upper
        else:
            value = min(max(sympy.Integer(0), bounds.lower), bounds.upper)
        value = sympy.Integer(value) if symbol.is_integer else sympy.Float(value)
        self[symbol] = value  # the same answer every time it is asked
        return value
