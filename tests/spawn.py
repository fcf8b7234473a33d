"""What the distributed tests share: spawning a job's ranks (none left running), a per-row dataset
that a DistributedSampler shares out, a half-applied optimizer step, and a rank's outcome timed."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import time

import torch


# What every rank imports (seconds each on 2 cores: torch, FSDP, autofit, transformers' BERT and
# GPT-2 through reference): imported once, by a fork server per test process, and each rank starts
# as a fork of that server instead of a new interpreter importing it all again. The server is a
# fresh interpreter that only imports these: no test code, no process group, no autofit state.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.device_mesh",
           "autofit", "reference", "spawn", "pytest"]


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    # Python 3.11's server ignores this process's sys.path (the tests folder, the checkout under
    # test): it is started with them in PYTHONPATH, so it imports the same files as this process.
    ours = [p for p in sys.path if p and not p.startswith((sys.prefix, sys.base_prefix))]
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(ours + ([saved] if saved else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return context


def _in_environment(environ: dict, files: dict, target, args) -> None:
    """Run `target(*args)` in a fork of the server as a new process would: under the spawning test's
    environment (the server's is that of the test that started it; AUTOFIT_CACHE_DIR is per test) and
    with its own random seeds (a fork inherits the server's; a new interpreter draws its own)."""
    os.environ.clear()
    os.environ.update(environ)
    for name, path in files.items():
        module = sys.modules.get(name)
        if module is not None and module.__file__ != path:
            raise RuntimeError(f"the fork server imported {name} from {module.__file__}, the tests from {path}")
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    target(*args)


def spawn_ranks(target, args_of, world: int, timeout: float) -> tuple[list, list]:
    """Run `target(*args_of(rank))` in `world` new processes (forks of the preloaded server, with this
    process's environment, working directory and sys.path), wait at most `timeout` seconds in all,
    kill what is still running. Returns the exit codes and the ranks that had to be killed."""
    context = _context()
    environ = dict(os.environ)
    files = {name: sys.modules[name].__file__ for name in PRELOAD if name in sys.modules}
    procs = [context.Process(target=_in_environment, args=(environ, files, target, args_of(r)))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 1))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    return [p.exitcode for p in procs], [procs.index(p) for p in alive]


class Samples(torch.utils.data.Dataset):
    """The rows of two classification batches of `rows` rows each, one dict per row."""

    def __init__(self, rows: int):
        from reference import cls_batches
        self.rows = [{k: v[i] for k, v in b.items()} for b in cls_batches(2, rows=rows) for i in range(rows)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def sampler(rows: int, world: int, rank: int, *, seed: int, epoch: int = 0):
    """A shuffled DistributedSampler over `Samples(rows)` at `epoch`."""
    it = torch.utils.data.distributed.DistributedSampler(Samples(rows), num_replicas=world, rank=rank,
                                                         shuffle=True, seed=seed)
    it.set_epoch(epoch)
    return it


class FlakyAdamW(torch.optim.AdamW):
    """Applies its first update, then runs out of memory: a step that fails half-way."""

    calls = 0

    def step(self, closure=None):
        super().step(closure)
        type(self).calls += 1
        if type(self).calls == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected in "
                                         "the optimizer step)")


def timed(fn) -> dict:
    """What `fn()` gave ("value") or raised ("error", "message"), and how many seconds it took."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as error:  # noqa: BLE001 - the scenario is about which error each rank gets
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    return {"value": value, "seconds": time.monotonic() - start}


def save_rank(out_dir: str, rank: int, seen: dict, saved: dict) -> None:
    """What a spawned rank reports: `seen` (JSON) and `saved` tensors (torch.save) under `out_dir`."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    torch.save(saved, os.path.join(out_dir, f"params{rank}.pt"))


def ranks_results(worker, out, world: int, timeout: float) -> tuple[list, list]:
    """Spawn `world` ranks of `worker(rank, init_file, out_dir)`, require each to exit 0 in time, and
    read back what each saved with `save_rank`."""
    codes, killed = spawn_ranks(worker, lambda r: (r, str(out / "init"), str(out)), world, timeout)
    assert not killed, f"ranks {killed} still running after {timeout} s"
    assert codes == [0] * world, f"exit codes {codes}"
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    params = [torch.load(out / f"params{r}.pt", weights_only=True) for r in range(world)]
    return seen, params


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
