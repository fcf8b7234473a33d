"""One rank of a short FSDP2 job, run as its own Python process as torchrun would start it (a
normal interpreter exit, not multiprocessing's os._exit, so whatever outlives the run meets the
interpreter's teardown): `python fsdp_job.py RANK WORLD INIT_METHOD`. Prints what autofit left
running after the run as one JSON line, then tears the process group down and exits."""

from __future__ import annotations

import json
import sys
import threading
from datetime import timedelta

import torch

import autofit


def main(rank: int, world: int, init: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                         timeout=timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
    result = autofit.run(net, batches, loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                         optimizer=torch.optim.AdamW, budget="64MiB", precision="fp32", cache=False,
                         progress=False)
    left = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    print(json.dumps({"rank": rank, "steps": len(result.history), "threads": left}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
