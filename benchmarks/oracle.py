"""The simulated GPU's allocated peak against an oracle that is not autofit's: c10's CPU allocator
through torch.profiler (tests/meter.py), for the same plain training step (the second, with the
optimizer's state), each allocation rounded to 512 bytes as a card's allocator rounds it.

    python benchmarks/oracle.py
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import autofit  # noqa: E402
from common import table  # noqa: E402
from meter import allocator_peak  # noqa: E402
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


def step_of(model, optimizer, batch, loss_fn):
    def step():
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def main():
    rows = []
    for name, make, batch, loss_fn in CASES:
        for optimizer in (torch.optim.SGD, torch.optim.AdamW):
            model = make()
            step = step_of(model, optimizer(model.parameters(), lr=1e-3), batch, loss_fn)
            step()
            measured = allocator_peak(step)
            model = make()
            opt = optimizer(model.parameters(), lr=1e-3)
            with autofit.simulate_gpu() as gpu:
                for t in list(model.parameters()) + list(model.buffers()):
                    t.data = t.data.clone()
                step = step_of(model, opt, batch, loss_fn)
                step()
                before = gpu.memory_allocated()
                gpu.reset_peak_memory_stats()
                step()
                simulated = gpu.max_memory_allocated() - before
            rows.append([name, optimizer.__name__, measured, simulated, measured - simulated])
    print(table(["model", "optimizer", "c10 allocator peak (B)", "simulated GPU peak (B)", "difference (B)"], rows))


if __name__ == "__main__":
    main()
