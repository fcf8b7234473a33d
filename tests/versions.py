"""What the installed torch lacks of the features autofit refuses on it (README, "Supported
versions"): a test of such a feature runs where the feature is, and a test of the refusal runs on
every version of the matrix (it takes the names away where they are there)."""

import pytest
import torch

from autofit.distributed import internals


def fsdp2_runs_missing() -> list[str]:
    """The FSDP2 module methods autofit's sharded runs and estimates call that this torch lacks
    (its recovery call, `reset_iter_state`, is torch 2.13's)."""
    if not torch.distributed.is_available():
        return ["torch.distributed"]
    from torch.distributed.fsdp import FSDPModule
    return [name for name in internals.CHECKED["unit"] if not hasattr(FSDPModule, name)]


needs_fsdp2_runs = pytest.mark.skipif(
    bool(fsdp2_runs_missing()),
    reason=f"this torch's FSDP2 lacks {fsdp2_runs_missing()}: autofit refuses sharded runs and estimates "
           f"here (test_sharded_estimate.py::test_a_torch_whose_fsdp2_lacks_what_autofit_calls_is_refused)")


def cuda_here(monkeypatch) -> None:
    """Make this process say it has a CUDA device that captures no graph, as a card's would: the
    probe's CUDA branches run on the CPU. (A CUDA build of torch without a driver raises where the
    optimizers ask whether a graph is being captured; a CPU build answers no.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def adagrad_takes_a_group_added_later() -> bool:
    """Whether torch's own Adagrad steps a parameter group added after it was built: before torch
    2.13 it makes its state in __init__ only, and the plain loop itself fails (KeyError: 'sum')."""
    first, later = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adagrad([first])
    optimizer.add_param_group({"params": [later]})
    first.grad, later.grad = torch.ones(1), torch.ones(1)
    try:
        optimizer.step()
    except KeyError:
        return False
    return True
