"""The simulated GPU's counter (which the estimator's meter is) against an oracle that is not
autofit's own: c10's CPU allocator seen through torch.profiler (tests/meter.py). The same plain
training step, after a first step made the optimizer state, peaks at the same bytes in both, but
for Python numbers wrapped as host tensors (see the last test), which are no card's memory."""

import pytest
import torch

from meter import BLOCK, both_peaks, peak_and_blocks, plain_step
from reference import bert, cls_batches, gpt2, lm_batches


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


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_c10_counts_beyond_the_simulated_gpu_only_the_python_numbers_autograd_keeps(optimizer):
    """GPT-2's GELU multiplies by Python floats; autograd keeps each, wrapped by the argument parser
    as an 8-byte host tensor (made outside any aten op, so no dispatch mode sees it), for backward.
    On a card they stay host tensors: c10's peak is the simulated GPU's plus one block for each."""
    batch, loss_fn = lm_batches(1, rows=8)[0], lambda m, b: m(**b).loss
    measured, simulated = both_peaks(gpt2, optimizer, batch, loss_fn)
    step = plain_step(gpt2(), optimizer, batch, loss_fn)
    step()
    peak, blocks = peak_and_blocks(step)
    wrapped = [n for n, op in blocks if op == "" and n == 8]
    assert peak == measured
    assert len(wrapped) == 6  # 3 Python floats per block's GELU, 2 blocks
    assert measured == simulated + BLOCK * len(wrapped)
