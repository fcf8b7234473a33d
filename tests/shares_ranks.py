"""What each gloo rank runs in tests/test_unequal_shares.py: per-rank data whose shares differ in
rows (each rank reads its own shard, no DistributedSampler), trained by autofit and by the plain
distributed loop that weights every micro-batch by the global batch's rows. Import-safe: spawned
ranks import only torch, autofit and this module."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch

import autofit

BATCH = 8
SHARD_ROWS = (37, 35, 33)  # rank r's shard: 5 batches each, the last of 5, 3 and 1 rows
SHORT_FIRST_ROWS = (33, 35, 37)  # 'short_first': rank 0's share the smallest (it decides the start)
OOM_STEP = 4               # the global step whose first forward runs out of memory on the last rank


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def loss_fn(m, batch):
    return torch.nn.functional.mse_loss(m(batch[0]), batch[1])


def halve(plan):
    return plan.replace(micro_batch_size=plan.micro_batch_size // 2) if plan.micro_batch_size > 1 else None


def loader(rank: int, extra: int = 0, rows=SHARD_ROWS):
    """Rank `rank`'s own shard in batches of BATCH (drop_last=False: the last one shorter)."""
    g = torch.Generator().manual_seed(100 + rank)
    n = rows[rank] + extra
    data = torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def batches(rank: int, scenario: str, extra: int = 0):
    """Rank `rank`'s loader; for 'short_first' its batches in reverse, rank 0's share the smallest
    (the ranks' first shares differ in rows: the start plan covers the largest, not rank 0's)."""
    if scenario == "short_first":
        return list(loader(rank, extra, SHORT_FIRST_ROWS))[::-1]
    return loader(rank, extra)


def _fail_twice_at(net, forward_call: int):
    """An OOM raised by `net`'s `forward_call`-th forward (0-based) and the next: the retry of a
    size proven before fails too, so the ladder steps down."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] in (forward_call + 1, forward_call + 2):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB (injected)")
    return net.register_forward_pre_hook(hook)


def _sharded(net, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def _full_state(net) -> dict:
    """Every parameter whole (an FSDP2 model's shards gathered), on the host."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in net.state_dict().items()}


def train_autofit(rank: int, world: int, scenario: str) -> dict:
    """One scenario: 'stepper', 'oom' (the last rank runs out of memory twice), 'sharded' (FSDP2 and
    those OOMs), 'run' (autofit.run), 'short_first' (the short batches first), 'extra' (rank 0 has
    one batch more)."""
    net = model()
    if scenario in ("oom", "sharded") and rank == world - 1:
        # the first forward of global step OOM_STEP (each earlier step ran one forward)
        _fail_twice_at(net, OOM_STEP)
    if scenario == "sharded":
        net = _sharded(net, world)
    data = batches(rank, scenario, extra=BATCH if scenario == "extra" and rank == 0 else 0)
    kw = dict(loss_fn=loss_fn, precision="fp32", ladder=halve, cache=False, progress=False)
    if scenario == "run":
        result = autofit.run(net, data, optimizer=torch.optim.AdamW, **kw)
        attempts, samples = result.attempts, [h["samples"] for h in result.history]
    else:
        with autofit.stepper(net, torch.optim.AdamW, **kw) as step:
            samples = []
            for batch in data:
                step(batch)
                samples.append(step._training.lockstep.global_rows)
        attempts = step.attempts
    return {"attempts": [[a.step, a.plan.micro_batch_size, a.plan.accumulation_steps, a.outcome]
                         for a in attempts], "samples": samples, "state": _full_state(net)}


def plain_loop(rank: int, scenario: str, micro_sizes: list[int]) -> dict:
    """The plain distributed loop: each rank splits its own batch into micro-batches of the global
    step's final size, weights each by its rows over the global batch's rows (all ranks'), and
    the ranks' gradients are summed before one AdamW step."""
    net = model()
    opt = torch.optim.AdamW(net.parameters())
    for batch, micro in zip(batches(rank, scenario), micro_sizes):
        rows = torch.tensor([batch[0].shape[0]], dtype=torch.float64)
        torch.distributed.all_reduce(rows)
        for lo in range(0, batch[0].shape[0], micro):
            part = (batch[0][lo:lo + micro], batch[1][lo:lo + micro])
            (loss_fn(net, part) * (part[0].shape[0] / rows.item())).backward()
        for p in net.parameters():
            torch.distributed.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _full_state(net)


def final_micro_sizes(attempts: list) -> list[int]:
    return [a[1] for a in attempts if a[3] == "ok"]


def worker(rank: int, world: int, init_file: str, out_dir: str, scenarios: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ["AUTOFIT_CACHE_DIR"] = os.path.join(out_dir, f"cache-{rank}")
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=world, timeout=timedelta(seconds=60))
    seen, saved = {}, {}
    for scenario in scenarios:
        try:
            done = train_autofit(rank, world, scenario)
        except Exception as error:  # noqa: BLE001 - the scenario is about which error each rank gets
            seen[scenario] = {"error": type(error).__name__, "message": str(error)}
            continue
        saved[scenario] = done.pop("state")
        saved[scenario + "/plain"] = plain_loop(rank, scenario, final_micro_sizes(done["attempts"]))
        seen[scenario] = done
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    torch.save(saved, os.path.join(out_dir, f"params{rank}.pt"))
    torch.distributed.destroy_process_group()
