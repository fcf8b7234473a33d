"""The simulated GPU's counter (which the estimator's meter is) against an oracle that is not
autofit's own: c10's CPU allocator seen through torch.profiler (tests/meter.py). The same plain
training step, after a first step made the optimizer state, peaks at the same bytes in both."""

import pytest
import torch

from meter import both_peaks
from reference import bert, cls_batches


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 3))


CASES = {
    "mlp": (mlp, (torch.randn(16, 64, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 3),
            lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])),
    "bert": (bert, cls_batches(1, rows=8)[0], lambda m, b: m(**b).loss),
}


@pytest.mark.parametrize("name, optimizer", [("mlp", torch.optim.SGD), ("bert", torch.optim.SGD),
                                             ("bert", torch.optim.AdamW)])
def test_the_simulated_gpu_peaks_where_c10s_allocator_peaks(name, optimizer):
    make, batch, loss_fn = CASES[name]
    measured, simulated = both_peaks(make, optimizer, batch, loss_fn)
    assert simulated == measured > 0
