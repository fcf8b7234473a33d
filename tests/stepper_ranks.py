"""What each of two gloo ranks runs in tests/test_stepper.py's DDP test, in a module that imports only
torch and autofit (a spawned rank starts in seconds), and the single-process loop it must equal."""

import contextlib
import json
import os
from datetime import timedelta

import torch

import autofit
from reference import device_copy

GLOBAL, WORLD, MAX_NORM = 8, 2, 0.15


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 1, generator=g)) for _ in range(2)]


def loss_fn(m, batch):
    return torch.nn.functional.mse_loss(m(batch[0]), batch[1])


def halve(plan):
    return plan.replace(micro_batch_size=plan.micro_batch_size // 2) if plan.micro_batch_size > 1 else None


def decay(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def worker(rank, init_file, out_dir, offload=False):
    """`offload`: on a simulated GPU, the OOM steps both ranks down to optimizer offload, with a
    StepLR scheduler (its wrapper around the optimizer's step must reach the update)."""
    os.environ["AUTOFIT_CACHE_DIR"] = os.path.join(out_dir, f"cache-{rank}")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=WORLD, timeout=timedelta(seconds=60))
    net = model()
    if rank == 1:  # one OOM in rank 1's first forward: both ranks replay at the same smaller plan
        def fail_once(module, args):
            hook.remove()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB (injected)")
        hook = net.register_forward_pre_hook(fail_once)
    from autofit.plans.ladder import offload_optimizer
    with autofit.simulate_gpu() if offload else contextlib.nullcontext():
        with autofit.stepper(net, torch.optim.AdamW, loss_fn=loss_fn, precision="fp32",
                             ladder=offload_optimizer() if offload else halve,
                             scheduler=decay if offload else None, max_grad_norm=MAX_NORM,
                             cache=False) as step:
            outs = [step(b) for b in batches()]
    seen = {"attempts": [[a.step, a.plan.micro_batch_size, a.plan.offload_optimizer, a.outcome]
                         for a in step.attempts],
            "state": len(step.optimizer.state_dict()["state"]),
            "norms": [o.grad_norm for o in outs], "losses": [o.loss for o in outs]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    torch.save(net.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def split_loop(micro_sizes, scheduler=None, copied=False):
    """One process doing what the ranks do: each rank's rows accumulated on their own in micro-batches
    weighted by their share of the global batch, the ranks' gradients summed, then clipped.
    `copied`: each micro-batch a device copy (reference.device_copy), as the simulated GPU's ranks
    get theirs; else views of the batch, as the ranks on the CPU device get theirs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: the same kernels reduce in the same order
    try:
        net = model()
        params = list(net.parameters())
        opt = torch.optim.AdamW(params)
        sched = None if scheduler is None else scheduler(opt)
        norms = []
        local = GLOBAL // WORLD
        for batch, micro in zip(batches(), micro_sizes):
            summed = None
            for start in range(0, GLOBAL, local):
                for i in range(start, start + local, micro):
                    part = tuple(t[i:min(i + micro, start + local)] for t in batch)
                    part = device_copy(part) if copied else part
                    (loss_fn(net, part) * (len(part[0]) / GLOBAL)).backward()
                grads = [p.grad for p in params]
                summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
                opt.zero_grad(set_to_none=True)
            for p, g in zip(params, summed):
                p.grad = g
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM).item())
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad(set_to_none=True)
        return net.state_dict(), norms
    finally:
        torch.set_num_threads(threads)
