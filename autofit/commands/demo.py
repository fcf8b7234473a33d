"""`autofit demo`: a tiny model on a simulated GPU that runs out of memory, every attempt shown."""

from __future__ import annotations

import contextlib
import sys

from autofit.sizes import format_size
from autofit.commands import EXIT_DOES_NOT_FIT, EXIT_OK, attempts_table, out, positive_arg, size_arg

DEMO_MODEL = "tiny-bert"
DEMO_BUDGET = "8MiB"
DEMO_BATCH, DEMO_SEQ, DEMO_STEPS = 64, 64, 4


@contextlib.contextmanager
def _one_thread():
    """A tiny model's ops are too small for intra-op threads; on a busy machine OpenMP's spinning
    threads made the demo ~8x slower. Restored afterwards (main() runs inside tests too)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cmd_demo(args) -> int:
    budget = size_arg("--budget", args.budget)
    steps = positive_arg("--steps", args.steps)
    import torch

    from autofit.commands import models
    from autofit import run, simulate_gpu
    from autofit.errors import DoesNotFit
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, batch = models.load(DEMO_MODEL, batch_size=DEMO_BATCH, seq_len=DEMO_SEQ, device="cpu")
    n_params = sum(p.numel() for p in model.parameters())
    out(f"model: {DEMO_MODEL} ({type(model).__name__}, {n_params / 1e6:.2f}M parameters, random "
         f"weights), global batch {DEMO_BATCH} x {DEMO_SEQ} tokens, {steps} step(s)")
    out(f"simulated GPU: {format_size(budget)} (CPU tensors counted as a CUDA allocator would; going "
         f"over raises torch.OutOfMemoryError)")
    out("capacity check off: every plan below is found by running out of memory and stepping down")
    out()
    with _one_thread():
        try:
            with simulate_gpu(budget), models.quiet_transformers():
                # The capacity check would start at a fitting plan; the demo shows the retry ladder.
                result = run(model, [batch] * steps, progress=False, cache=False, capacity_check=False)
        except DoesNotFit as e:
            attempts_table(e.attempts)
            out()
            print(f"autofit: does not fit: {str(e).splitlines()[0]}", file=sys.stderr)
            if e.breakdown:
                from autofit.sizes import format_breakdown
                print(f"autofit: memory at the last failure: {format_breakdown(e.breakdown, budget)}",
                      file=sys.stderr)
            return EXIT_DOES_NOT_FIT
    attempts_table(result.attempts)
    out()
    ooms = result.oom_attempts
    losses = [h["loss"] for h in result.history]
    out(f"final plan: {result.plan.describe()} (global batch {DEMO_BATCH} unchanged)")
    out(f"{ooms} out-of-memory attempt(s) caught and replayed; {len(losses)} step(s) trained, loss "
         f"{losses[0]:.4f} -> {losses[-1]:.4f}")
    return EXIT_OK
