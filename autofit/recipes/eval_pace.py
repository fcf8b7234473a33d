"""Evaluation's pace: whether each forward must keep step with other ranks. `Alone` is one process
(or a replicated rank, whose forward talks to no other rank): nothing to agree on, inference mode.
autofit.distributed.eval_lockstep has the same interface for an FSDP2-sharded model, whose every
forward all-gathers, so the evaluator reads the same either way."""

from __future__ import annotations

import contextlib

import torch


class Alone:
    """Evaluation's pace in one process (or a replicated rank, whose forward talks to no other):
    nothing to agree on. autofit.distributed.eval_lockstep has the same interface for a sharded
    model, whose every forward all-gathers."""

    grad_mode = staticmethod(torch.inference_mode)

    def size(self, want: int | None, failure: BaseException | None = None) -> int | None:
        if failure is not None:
            raise failure
        return want

    def forward(self):
        return contextlib.nullcontext()

    def after(self, failure: BaseException | None) -> None:
        if failure is not None:
            raise failure

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        pass
