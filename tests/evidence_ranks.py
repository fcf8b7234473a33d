"""What each gloo rank runs in tests/test_rank_evidence.py: a rank SIGKILLed in forward (the others
must name exactly it), steps inside DDP's no_sync, and an unguarded optimizer step that runs out of
memory on one rank only. Import-safe: spawned ranks import only torch, autofit and this module."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from datetime import timedelta

import torch

import autofit

KILL_STEP = 2       # the global step in whose forward the victim is killed
BEHIND_S = 2.0      # a healthy survivor's forward at that step takes this long: it is behind, not dead
STEP_OOM_AT = 1     # the global step whose optimizer step runs out of memory on the last rank


def _init(rank: int, world: int, init: str, seconds: int = 30) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                         timeout=timedelta(seconds=seconds))


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batches(n: int = 4, rows: int = 6):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(n)]


def loss_fn(m, batch):
    return torch.nn.functional.mse_loss(m(batch[0]), batch[1])


def _outcome(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - which error each rank gets is the test
        return {"error": type(error).__name__, "message": str(error), "rank": getattr(error, "rank", None),
                "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _write(out_dir: str, rank: int, seen: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def kill_worker(rank: int, world: int, init: str, out_dir: str, victim: int) -> None:
    """The victim SIGKILLs itself in its forward at KILL_STEP; the next rank after it is slow in
    that forward (healthy, behind the others when their agreement fails)."""
    _init(rank, world, init)
    net = model()
    calls = [0]

    def forward_hook(module, args):
        calls[0] += 1
        if calls[0] == KILL_STEP + 1 and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        if calls[0] == KILL_STEP + 1 and rank == (victim + 1) % world:
            time.sleep(BEHIND_S)
    net.register_forward_pre_hook(forward_hook)

    def train():
        with autofit.stepper(net, torch.optim.AdamW, loss_fn=loss_fn, precision="fp32", cache=False,
                             progress=False) as step:
            for batch in batches():
                step(batch)
    _write(out_dir, rank, _outcome(train))
    os._exit(0)  # the group is broken: nothing to tear down


def _rank_batches(rank: int, n: int = 4, rows: int = 6):
    """This rank's own batches (per-rank data: each rank's batch is its share)."""
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(n)]


def no_sync_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    """The user's DDP accumulation loop (every other batch inside no_sync) around autofit's step,
    with one OOM on rank 1 (every rank replays that batch from the gradients accumulated before it),
    and the same loop without autofit: DDP's own no_sync, backward and optimizer.step."""
    _init(rank, world, init)
    net = model()
    if rank == 1:  # an OOM in the forward of batch 1, on top of batch 0's accumulated gradients
        forwards = [0]

        def fail_once(module, args):
            forwards[0] += 1
            if forwards[0] == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB (injected)")
        net.register_forward_pre_hook(fail_once)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    with autofit.stepper(ddp, torch.optim.AdamW, loss_fn=loss_fn, precision="fp32", cache=False,
                         progress=False) as step:
        for i, batch in enumerate(_rank_batches(rank)):
            with ddp.no_sync() if i % 2 == 0 else contextlib.nullcontext():
                step(batch)
    adam_steps = sorted({int(s["step"]) for s in step.optimizer.state.values()})
    plain = torch.nn.parallel.DistributedDataParallel(model())
    optimizer = torch.optim.AdamW(plain.parameters())
    for i, batch in enumerate(_rank_batches(rank)):
        with plain.no_sync() if i % 2 == 0 else contextlib.nullcontext():
            loss_fn(plain, batch).backward()
        if i % 2:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    _write(out_dir, rank, {"adam_steps": adam_steps, "attempts": [[a.step, a.outcome] for a in step.attempts]})
    torch.save({"autofit": ddp.module.state_dict(), "plain": plain.module.state_dict()},
               os.path.join(out_dir, f"params{rank}.pt"))
    del ddp, plain  # DDP's reducers freed while their group lives (freed after it, it hung at times)
    torch.distributed.destroy_process_group()


def step_oom_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    """No budget, so no step is at risk and none is guarded: the last rank's optimizer runs out of
    memory at STEP_OOM_AT before it writes anything, the others apply their update."""
    _init(rank, world, init)
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    steps = [0]

    def pre_step(opt, args, kwargs):
        steps[0] += 1
        if rank == world - 1 and steps[0] == STEP_OOM_AT + 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected in "
                                         "the optimizer step)")
    optimizer.register_step_pre_hook(pre_step)

    def train():
        with autofit.stepper(net, optimizer, loss_fn=loss_fn, precision="fp32", cache=False,
                             progress=False) as step:
            for batch in batches():
                step(batch)
    seen = _outcome(train)
    _write(out_dir, rank, seen)
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()},
               os.path.join(out_dir, f"params{rank}.pt"))
    torch.distributed.destroy_process_group()
