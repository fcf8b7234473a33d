"""An independent meter of a CPU step's memory: c10's CPU allocator as torch.profiler reports it
(`profile_memory=True`: one event per allocation and per free, with its bytes). No autofit code
inside: it checks the simulated GPU's counter, which the estimator shares."""

from torch.profiler import ProfilerActivity, profile

BLOCK = 512  # the simulated GPU's (and CUDA's) rounding of each allocation


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def allocator_peak(work) -> int:
    """The most bytes `work()` has allocated at once above what was live before it, each allocation
    rounded to BLOCK as a card's allocator rounds it (frees of blocks made before count too)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        n = event.nbytes()
        live += rounded(n) if n > 0 else -rounded(-n)
        peak = max(peak, live)
    return peak
