"""What each of two gloo ranks runs in tests/test_accelerate.py's multi-process test: an Accelerate
loop (MULTI_CPU, split_batches=True) converted to autofit.stepper. It imports only torch, accelerate
and autofit, and uses stepper_ranks' model and data, so stepper_ranks.split_loop is its reference."""

import json
import os

import torch

import autofit
import stepper_ranks
from stepper_ranks import GLOBAL, MAX_NORM, WORLD


def worker(rank, port, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), AUTOFIT_CACHE_DIR=os.path.join(out_dir, f"cache-{rank}"))
    torch.set_num_threads(1)
    import accelerate
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.utils import DataLoaderConfiguration

    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    net = stepper_ranks.model()
    rows = [(x[i], y[i]) for x, y in stepper_ranks.batches() for i in range(GLOBAL)]
    optimizer = torch.optim.AdamW(net.parameters())
    model, optimizer, loader, lr_scheduler = accelerator.prepare(
        net, optimizer, torch.utils.data.DataLoader(rows, batch_size=GLOBAL), stepper_ranks.decay(optimizer))
    seen = {"setup": accelerator.distributed_type.value, "model": type(model).__name__}
    # The same scheduler stepped once per process (split_batches=False): refused on every rank.
    per_process = AcceleratedScheduler(lr_scheduler.scheduler, [optimizer], split_batches=False)
    try:
        with autofit.stepper(model, optimizer, scheduler=per_process):
            pass
    except ValueError as error:
        seen["refused"] = str(error)
    if rank == 1:  # one OOM in rank 1's first forward: both ranks replay at the same smaller plan
        def fail_once(module, args):
            hook.remove()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB (injected)")
        hook = net.register_forward_pre_hook(fail_once)
    with autofit.stepper(model, optimizer, scheduler=lr_scheduler, loss_fn=stepper_ranks.loss_fn,
                         precision="fp32", ladder=stepper_ranks.halve, max_grad_norm=MAX_NORM,
                         cache=False) as step:
        outs, seen["rows"] = [], []
        for batch in loader:
            seen["rows"].append(len(batch[0]))  # this rank's share of the global batch
            outs.append(step(batch))
    seen.update(attempts=[[a.step, a.plan.micro_batch_size, a.outcome] for a in step.attempts],
                norms=[o.grad_norm for o in outs], last_lr=lr_scheduler.get_last_lr())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    torch.save(net.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    accelerator.end_training()
