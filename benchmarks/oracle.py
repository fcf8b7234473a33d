"""The simulated GPU's allocated peak against an oracle that is not autofit's: c10's CPU allocator
through torch.profiler (tests/meter.py), for the same plain training step (the second, with the
optimizer's state), each allocation rounded to 512 bytes as a card's allocator rounds it. The last
column lists the allocations of 8 bytes or less live at c10's peak that the simulated GPU does not
count, by the op that made them ("outside any op": a Python number the argument parser wrapped as a
host tensor, which autograd may keep for backward; on a card these stay host tensors).

    python benchmarks/oracle.py
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from common import table  # noqa: E402
from meter import both_peaks, peak_and_blocks, plain_step  # noqa: E402
from reference import bert, cls_batches, gpt2, lm_batches  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 3))


CASES = [
    ("MLP 64-256-3, 16 rows", mlp, (torch.randn(16, 64), torch.arange(16) % 3),
     lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])),
    ("BERT 2 layers, 8 x 12", bert, cls_batches(1, rows=8)[0], lambda m, b: m(**b).loss),
    ("GPT-2 2 layers, 8 x 12", gpt2, lm_batches(1, rows=8)[0], lambda m, b: m(**b).loss),
]


def main():
    rows = []
    for name, make, batch, loss_fn in CASES:
        for optimizer in (torch.optim.SGD, torch.optim.AdamW):
            measured, simulated = both_peaks(make, optimizer, batch, loss_fn)
            rows.append([name, optimizer.__name__, measured, simulated, measured - simulated,
                         _small_blocks(make, optimizer, batch, loss_fn) if measured != simulated else ""])
    print(table(["model", "optimizer", "c10 allocator peak (B)", "simulated GPU peak (B)", "difference (B)",
                 "small host blocks live at the peak"], rows))


def _small_blocks(make, optimizer_class, batch, loss_fn) -> str:
    step = plain_step(make(), optimizer_class, batch, loss_fn)
    step()
    _, blocks = peak_and_blocks(step)
    where = {}
    for n, op in blocks:
        if n <= 8 and op != "aten::nll_loss_forward":  # the loss and its total weight: on the card too
            key = f"{n} B {op or 'outside any op'}"
            where[key] = where.get(key, 0) + 1
    return ", ".join(f"{count} x {key}" for key, count in where.items())


if __name__ == "__main__":
    main()
