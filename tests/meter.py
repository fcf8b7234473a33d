"""An independent meter of a CPU step's memory: c10's CPU allocator as torch.profiler reports it
(`profile_memory=True`: one event per allocation and per free, with its bytes). `allocator_peak`
uses no autofit code: it checks the simulated GPU's counter, which the estimator shares;
`both_peaks` runs the same step under both."""

from torch.profiler import ProfilerActivity, profile

BLOCK = 512  # the simulated GPU's (and CUDA's) rounding of each allocation


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def allocator_peak(work) -> int:
    """The most bytes `work()` has allocated at once above what was live before it, each allocation
    rounded to BLOCK as a card's allocator rounds it (frees of blocks made before count too)."""
    return peak_and_blocks(work)[0]


def peak_and_blocks(work) -> tuple[int, list]:
    """(peak as allocator_peak, the allocations `work()` made that were live at that peak: (bytes,
    the innermost op running when each was made, or "" outside any op)). The profiler's memory
    events carry no address, so a free is paired with the latest live allocation of its size."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    running = []  # (end_ns, name) of the ops enclosing the current event
    live, blocks, peak, at_peak = 0, [], 0, []
    for event in events:
        while running and running[-1][0] < event.start_ns():
            running.pop()
        if event.name() != "[memory]":
            running.append((event.start_ns() + event.duration_ns(), event.name()))
            continue
        n = event.nbytes()
        if n > 0:
            blocks.append((n, running[-1][1] if running else ""))
            live += rounded(n)
        else:
            same = [i for i, (b, _) in enumerate(blocks) if b == -n]
            if same:
                blocks.pop(same[-1])
            live -= rounded(-n)
        if live > peak:
            peak, at_peak = live, list(blocks)
    return peak, at_peak


def both_peaks(make, optimizer_class, batch, loss_fn) -> tuple[int, int]:
    """(c10 allocator's peak, the simulated GPU's peak) of the same plain training step, the second
    one (the optimizer's state made by the first), each on a fresh `make()` model."""
    import autofit  # only for the simulated side

    step = plain_step(make(), optimizer_class, batch, loss_fn)
    step()
    measured = allocator_peak(step)
    model = make()
    with autofit.simulate_gpu() as gpu:
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.clone()  # the model on the simulated GPU, as a run places it
        step = plain_step(model, optimizer_class, batch, loss_fn)
        step()
        before = gpu.memory_allocated()
        gpu.reset_peak_memory_stats()
        step()
        simulated = gpu.max_memory_allocated() - before
    return measured, simulated


def plain_step(model, optimizer_class, batch, loss_fn):
    """One plain training step of `model` (forward, backward, step, zero_grad) as a function."""
    optimizer = optimizer_class(model.parameters(), lr=1e-3)

    def step():
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step
