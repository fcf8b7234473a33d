"""What autofit costs when nothing runs out of memory, and what the simulated GPU costs.

    python benchmarks/overhead.py [--repeats 5] [--steps 20] [--warmup 5]

Table 1: per-step time of `autofit.run` against a hand-written loop running the SAME plan (the
whole global batch as one micro-batch, the same AdamW, fp32) on the plain CPU device (no budget, no
simulated GPU). A step's time is the interval between the ends of two consecutive successful
`optimizer.step()` calls (a post-step hook), so it includes everything each loop does between steps:
data, splitting, loss bookkeeping, the controller. Each repeat builds a fresh model and runs
warm-up + measured steps for every method, in alternating order; a method's figure is the median of
its per-repeat medians, and the ratio is the median of per-repeat ratios (paired, so a noisy
neighbour on the machine moves both sides of a ratio together).

Table 2: the same plain loop inside `autofit.simulate_gpu()` (counting every storage, no budget)
against outside it, and inside a do-nothing TorchDispatchMode (the floor: what any dispatch mode
costs per op, before the counter and the allocator model do anything); and, for reference,
`autofit.run` on a simulated GPU with no budget and with an ample budget (where the atomic optimizer
step decides whether it needs a host snapshot).

Table 3: what making every attempt start from the same state costs per step (autofit.engine.replay's
StartState: capture of the RNG, the model's generators, the buffers, the untrained parameters a step
writes, the gradients present at entry, the param_groups and the batch, then the first attempt's
begin and the release), timed alone on the same model in a steady run, against the plain loop's
step; again with the embeddings frozen (parameters no step writes: walked, not copied); and the
walk over a loss's autograd graph that finds the leaves its backward reaches (once per attempt).
`--replay-only` prints this table alone.

Table 4: the cost per op, which step timings on a busy machine blur: microseconds of process time
per op (best of 7 rounds of 3000 ops) for an op that makes a tensor (`x + y`, 64x64) and a view
(`z.view(-1)`), with no mode, under the no-op dispatch mode, and under `simulate_gpu()`.

Table 5: the steady state against the plain loop on BERT-base's layout (12 layers, 231 modules,
201 parameters), narrow (hidden 24) so that the CPU time per step is mostly the framework's, not
the matmuls': autofit.run's extra CPU time per step (the median over interleaved rounds of the
per-round difference of median step times) and the host-device synchronisations of a steady step
(autofit.diagnosis.syncs.SyncCounter, one step after the start state has learned the job), on the
plain CPU and on a simulated GPU with an ample budget (where the leak watch and the atomic step's
free-memory check run, as on a card). On a CUDA machine the same table is measured on the card with
BERT-base at full width (32 x 128, fp32 and bf16) and reports the per-step wall-time ratio.
`--layout-only` prints this table alone.

torch.set_num_threads(1) throughout, for stable timings on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time

from common import (StepClock, adamw, bert, cls_batches, max_abs_diff, median, plain_step,
                    print_environment, setup, simulated_copy, table)

import autofit  # noqa: E402  (common put the checkout on sys.path)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

HIDDEN, LAYERS, SEQ, BATCH, VOCAB = 128, 2, 64, 16, 1000


def build():
    return bert(hidden=HIDDEN, layers=LAYERS, seq=SEQ, vocab=VOCAB)


def run_plain(batches, gpu_budget="off"):
    """The hand-written loop; gpu_budget "off": plain CPU, else inside simulate_gpu(gpu_budget)."""
    model = build()
    model.train()
    clock = StepClock()
    opt = clock.attach(adamw(model.parameters()))
    ctx = contextlib.nullcontext() if gpu_budget == "off" else autofit.simulate_gpu(gpu_budget)
    with ctx as gpu:
        if gpu is not None:
            gpu.track(list(model.parameters()) + list(model.buffers()))
        for b in batches:
            plain_step(model, opt, b)
    return clock, model


class _NoOpMode(TorchDispatchMode):
    """Runs every op as it is: the cost of the dispatch mechanism alone (without torch's per-call
    dynamo wrapper, as the simulated GPU's own mode runs)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def run_plain_noop_mode(batches):
    model = build()
    model.train()
    clock = StepClock()
    opt = clock.attach(adamw(model.parameters()))
    with _NoOpMode():
        for b in batches:
            plain_step(model, opt, b)
    return clock, model


def run_autofit(batches, gpu_budget="off", progress=False):
    model = build()
    clock = StepClock()
    ctx = contextlib.nullcontext() if gpu_budget == "off" else autofit.simulate_gpu(gpu_budget)
    quiet = contextlib.redirect_stderr(io.StringIO()) if progress else contextlib.nullcontext()
    with ctx, quiet:
        result = autofit.run(model, batches, optimizer=lambda p: clock.attach(adamw(p)),
                             progress=progress, precision="fp32")
    assert result.oom_attempts == 0, "overhead run hit an OOM; the budget is not ample"
    assert result.plan.micro_batch_size == BATCH and result.plan.accumulation_steps == 1, result.plan
    return clock, model


def measure(methods: dict, batches, warmup: int, repeats: int):
    """{name: {"wall"/"cpu": [per-repeat median step seconds]}} and the last model of each method."""
    times = {name: {"wall": [], "cpu": []} for name in methods}
    models = {}
    names = list(methods)
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            clock, model = methods[name](batches)
            for kind in ("wall", "cpu"):  # intervals ending at steps warmup+1 ...
                times[name][kind].append(median(clock.intervals(skip=warmup - 1, cpu=kind == "cpu")))
            models[name] = model
    return times, models


def paired(times, name, base, kind):
    return median([t / b for t, b in zip(times[name][kind], times[base][kind])])


def ratio_row(name, times, base, note=""):
    cpu, wall = times[name]["cpu"], times[name]["wall"]
    return [name, median(cpu) * 1e3, min(cpu) * 1e3, paired(times, name, base, "cpu"),
            median(wall) * 1e3, paired(times, name, base, "wall"), note]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per repeat")
    parser.add_argument("--warmup", type=int, default=5, help="steps before measuring, per repeat")
    parser.add_argument("--replay-only", action="store_true", help="print table 3 alone")
    parser.add_argument("--layout-only", action="store_true", help="print table 5 alone")
    args = parser.parse_args(argv)
    setup()
    with tempfile.TemporaryDirectory(prefix="autofit-bench-") as cache:
        os.environ["AUTOFIT_CACHE_DIR"] = cache  # never the user's plan cache
        return measure_and_print(args)


def replay_cost(batches, repeats: int, freeze: bool = False):
    """(median, best) seconds of one step's StartState work in a steady run (after the two steps
    that learn which untrained parameters a step writes), and the plain step's median. `freeze`:
    the embeddings frozen and left out of the optimizer (parameters no step writes)."""
    from autofit.gpu.device import CpuDevice
    from autofit.engine.replay import StartState
    model = build()
    model.train()
    if freeze:
        model.bert.embeddings.requires_grad_(False)
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    start = StartState(model, opt, CpuDevice())
    plain_step(model, opt, batches[0])  # the optimizer state exists, as in a steady run
    for b in batches[:2]:  # the steps that learn what a step writes
        start.capture(b)
        start.release()
        plain_step(model, opt, b)
    costs, steps = [], []
    for _ in range(repeats):
        for b in batches:
            t0 = time.perf_counter()
            start.capture(b)
            start.begin()
            start.release()
            t1 = time.perf_counter()
            plain_step(model, opt, b)  # the step writes the buffers a next capture may copy
            costs.append(t1 - t0)
            steps.append(time.perf_counter() - t1)
    return median(costs), min(costs), median(steps), start.untrained.copies


def graph_walk_cost(batches, repeats: int):
    """(median, best) seconds of finding the leaves a loss's backward reaches (model_state.leaves:
    what the runner does once per attempt, on its first micro-batch)."""
    from autofit.engine.model_state import leaves
    model = build()
    model.train()
    costs = []
    for _ in range(repeats):
        for b in batches:
            loss = model(**b).loss
            t0 = time.perf_counter()
            leaves(loss)
            costs.append(time.perf_counter() - t0)
            del loss
    return median(costs), min(costs)


def print_replay_cost(batches, repeats: int) -> None:
    cost, best, step, _ = replay_cost(batches, repeats)
    frozen, frozen_best, frozen_step, copies = replay_cost(batches, repeats, freeze=True)
    walk, walk_best = graph_walk_cost(batches, repeats)
    print("Table 3. per-step cost of starting every attempt from the same state (replay.StartState: RNG,")
    print("generators, buffers, untrained parameters a step writes, entry gradients, param_groups, batch)")
    print(table(["work", "median us", "best us", "share of a plain step"],
                [["capture + begin + release", cost * 1e6, best * 1e6, f"{cost / step:.2%}"],
                 ["the same, embeddings frozen (untrained)", frozen * 1e6, frozen_best * 1e6,
                  f"{frozen / frozen_step:.2%}"],
                 ["leaves a backward reaches (once per attempt)", walk * 1e6, walk_best * 1e6,
                  f"{walk / step:.2%}"],
                 ["plain loop step (for scale)", step * 1e6, "", "100%"]]))
    print(f"untrained parameters copied with frozen embeddings: {copies} (all of them at the first two "
          f"steps, none after: no step writes them)")


def per_op_cost(rounds: int = 7, n: int = 3000) -> list[list]:
    """Rows of table 4: (context, us per new-tensor op, us per view op) above no mode."""
    import torch
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    z = x + y

    def new_tensor():
        for _ in range(n):
            x + y

    def view():
        for _ in range(n):
            z.view(-1)

    def best(work, context) -> float:
        times = []
        for _ in range(rounds):
            with context():
                t0 = time.process_time()
                work()
                times.append(time.process_time() - t0)
        return min(times) / n * 1e6

    contexts = {"no mode": contextlib.nullcontext, "no-op dispatch mode": _NoOpMode,
                "simulate_gpu()": autofit.simulate_gpu}
    cost = {name: (best(new_tensor, c), best(view, c)) for name, c in contexts.items()}
    base = cost["no mode"]
    return [[name, a, b, a - base[0], b - base[1]] for name, (a, b) in cost.items()]


def bert_layout(width: int):
    """BERT-base's layout (12 layers; BertForSequenceClassification: 231 modules, 201 parameters) at
    `width` (768 is BERT-base; 24, with 12 heads of 2, leaves the CPU time to the framework)."""
    from transformers import BertConfig, BertForSequenceClassification
    import torch
    torch.manual_seed(0)
    config = BertConfig(hidden_size=width, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=4 * width if width >= 768 else 2 * width, vocab_size=VOCAB,
                        max_position_embeddings=512, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


class Layout:
    """One configuration of table 5: the model's width, the batches, the device and the precision."""

    def __init__(self, width, rows, seq, device, precision="fp32", budget=None):
        self.width, self.rows, self.seq = width, rows, seq
        self.device, self.precision, self.budget = device, precision, budget

    def model(self):
        model = bert_layout(self.width)
        return model.to(self.device) if self.device == "cuda" else model


def _plain_layout(layout, batches, counter=None):
    """The plain loop on `layout` (on a simulated GPU when it has a budget); `counter(opt)`: a
    SyncCounter to enter around the steady step COUNTED_STEP, or None."""
    import torch
    model = layout.model()
    model.train()
    clock = StepClock()
    opt = clock.attach(adamw(model.parameters()))
    gpu = autofit.simulate_gpu(layout.budget) if layout.budget else contextlib.nullcontext()
    dtype = torch.bfloat16 if layout.precision == "bf16" else None
    counted = None
    with gpu as sim:
        if sim is not None:
            sim.track(list(model.parameters()) + list(model.buffers()))
        to_device = (lambda x: {k: v.to("cuda", non_blocking=True) for k, v in x.items()}) \
            if layout.device == "cuda" else (simulated_copy if sim is not None else None)
        for i, b in enumerate(batches):
            if counter is not None and i == COUNTED_STEP:
                counted = counter(opt, sim)
            with counted if i == COUNTED_STEP and counted is not None else contextlib.nullcontext(), \
                    torch.autocast(layout.device, dtype=dtype, enabled=dtype is not None):
                plain_step(model, opt, b, to_device=to_device)
    return clock, counted


def _autofit_layout(layout, batches, counter=None):
    model = layout.model()
    clock = StepClock()
    made = []
    gpu = autofit.simulate_gpu(layout.budget) if layout.budget else contextlib.nullcontext()
    state = {}

    def data():
        for i, b in enumerate(batches):
            if counter is not None and i == COUNTED_STEP:
                state["watch"] = counter(made[0], state["gpu"])
                state["watch"].__enter__()
            yield b
            if "watch" in state and i == COUNTED_STEP:
                state["watch"].__exit__(None, None, None)
    with gpu as sim:
        state["gpu"] = sim
        result = autofit.run(model, data(), optimizer=lambda p: made.append(clock.attach(adamw(p))) or made[0],
                             progress=False, precision=layout.precision)
    assert result.oom_attempts == 0 and result.plan.accumulation_steps == 1, result.plan
    return clock, state.get("watch")


COUNTED_STEP = 4  # a steady step: after the captures the start state learns from


def _sync_counter(layout):
    """counter(optimizer, simulated gpu) -> a SyncCounter for the device the step runs on."""
    from autofit.diagnosis.syncs import SyncCounter
    from autofit.gpu.device import CpuDevice, CudaDevice, SimulatedDevice

    def counter(opt, sim):
        if layout.device == "cuda":
            device = CudaDevice(0)
        else:
            device = SimulatedDevice(sim) if sim is not None else CpuDevice()
        steps = [s["step"] for s in opt.state.values() if "step" in s]  # host values on a card
        return SyncCounter(device, steps)
    return counter


def layout_rows(layout, batches, warmup: int, repeats: int) -> list:
    """[extra CPU us per step (median of the rounds' differences), their quartiles, plain CPU ms,
    autofit CPU ms, wall ratio, plain syncs, autofit syncs]."""
    cpu, wall = {"plain": [], "autofit": []}, {"plain": [], "autofit": []}
    for r in range(repeats):
        order = [("plain", _plain_layout), ("autofit", _autofit_layout)]
        for name, method in (order if r % 2 == 0 else order[::-1]):
            clock, _ = method(layout, batches)
            cpu[name].append(median(clock.intervals(skip=warmup, cpu=True)))
            wall[name].append(median(clock.intervals(skip=warmup)))
    counter = _sync_counter(layout)
    syncs = [method(layout, batches[:COUNTED_STEP + 2], counter)[1].total
             for method in (_plain_layout, _autofit_layout)]
    extras = [a - p for a, p in zip(cpu["autofit"], cpu["plain"])]
    q1, _, q3 = statistics.quantiles(extras, n=4) if len(extras) > 1 else (extras[0],) * 3
    ratio = median([a / p for a, p in zip(wall["autofit"], wall["plain"])])
    return [median(extras) * 1e6, f"{q1 * 1e6:.0f} .. {q3 * 1e6:.0f}", median(cpu["plain"]) * 1e3,
            median(cpu["autofit"]) * 1e3, ratio, *syncs]


def print_layout_table(args) -> None:
    import torch
    if torch.cuda.is_available():
        layouts = {"BERT-base, card, fp32": Layout(768, 32, 128, "cuda"),
                   "BERT-base, card, bf16": Layout(768, 32, 128, "cuda", "bf16")}
        rows, seq = 32, 128
    else:
        layouts = {"plain CPU (no budget)": Layout(24, 4, 16, "cpu"),
                   "simulated GPU (8 GiB budget)": Layout(24, 4, 16, "cpu", budget="8GiB")}
        rows, seq = 4, 16
    batches = cls_batches(args.warmup + args.steps + 1, rows=rows, seq=seq, vocab=VOCAB)
    n_params = sum(p.numel() for p in bert_layout(24).parameters())
    print(f"Table 5. steady state vs the plain loop, BERT-base layout (12 layers, 231 modules, 201 "
          f"parameters; narrow: hidden 24, {n_params / 1e3:.0f} k parameters on CPU), {rows} x {seq}, "
          f"AdamW; {args.repeats} interleaved rounds of {args.warmup + 1} warm-up + {args.steps} steps")
    out = [[name, *layout_rows(layout, batches, args.warmup + 1, args.repeats)] for name, layout in layouts.items()]
    print(table(["device", "extra CPU us/step", "its quartiles", "plain CPU ms/step", "autofit CPU ms/step",
                 "ratio (wall)", "syncs/step plain", "syncs/step autofit"], out))


def measure_and_print(args) -> int:
    print_environment("autofit overhead benchmark")
    if args.layout_only:
        print_layout_table(args)
        return 0
    batches = cls_batches(args.warmup + args.steps + 1, rows=BATCH, seq=SEQ, vocab=VOCAB)
    if args.replay_only:
        print_replay_cost(batches, args.repeats)
        return 0
    n_params = sum(p.numel() for p in build().parameters())
    print(f"model: BertForSequenceClassification, hidden {HIDDEN}, {LAYERS} layers, seq {SEQ}, vocab "
          f"{VOCAB}, {n_params / 1e6:.2f} M parameters, random init, dropout 0")
    print(f"global batch {BATCH}, plan: micro {BATCH} x 1, fp32, AdamW(lr=1e-3); {args.warmup + 1} "
          f"warm-up + {args.steps} measured steps per repeat, {args.repeats} repeats\n")
    headers = ["loop", "CPU ms/step", "best CPU ms", "ratio (CPU)", "wall ms/step", "ratio (wall)",
               "note"]
    started = time.perf_counter()

    # -- table 1: autofit.run vs the plain loop, plain CPU device -----------------------------------
    t1 = {"plain loop": run_plain,
          "plain loop again (A/A: noise)": run_plain,
          "autofit.run(progress=False)": run_autofit,
          "autofit.run(progress=True)": lambda b: run_autofit(b, progress=True)}
    times, models = measure(t1, batches, args.warmup + 1, args.repeats)
    diff = max_abs_diff(models["plain loop"], models["autofit.run(progress=False)"])
    rows = [ratio_row(n, times, "plain loop", "baseline" if n == "plain loop" else "goal <= 1.03")
            for n in t1]
    rows[1][-1] = "the same code twice: how far 1.0 moves here"
    rows[3][-1] = "tqdm bar, to a discarded stderr"
    print("Table 1. autofit.run vs a hand-written loop, same plan, plain CPU (no budget); "
          "ratio = autofit / plain")
    print(table(headers, rows))
    print(f"parameters after {len(batches)} steps, autofit vs plain loop: max abs diff {diff:.3g}\n")

    # -- table 2: the simulated GPU's own cost --------------------------------------------------------
    with autofit.simulate_gpu() as gpu:  # the peak of one plain step, to size an ample budget
        model = build()
        gpu.track(list(model.parameters()) + list(model.buffers()))
        opt = adamw(model.parameters())
        for b in batches[:2]:
            plain_step(model, opt, b)
        peak = gpu.max_memory_allocated()
        del model, opt
    ample = 4 * peak
    t2 = {"plain loop, plain CPU": run_plain,
          "plain loop, no-op dispatch mode": run_plain_noop_mode,
          "plain loop, simulate_gpu()": lambda b: run_plain(b, gpu_budget=None),
          "autofit.run, simulate_gpu()": lambda b: run_autofit(b, gpu_budget=None),
          f"autofit.run, simulate_gpu({ample / 2**20:.0f}MiB)": lambda b: run_autofit(b, gpu_budget=ample)}
    times, _ = measure(t2, batches, args.warmup + 1, args.repeats)
    names = list(t2)
    rows = [ratio_row(n, times, names[0]) for n in names]
    rows[0][-1] = "baseline"
    rows[1][-1] = "the floor: any TorchDispatchMode"
    rows[2][-1] = "the simulated GPU's cost (goal <= 1.2)"
    rows[3][-1] = "counting, no budget"
    rows[4][-1] = f"budget 4x the step peak ({peak / 2**20:.1f} MiB)"
    print("Table 2. the simulated GPU's cost; ratio = row / plain loop on the plain CPU")
    print(table(headers, rows))
    print(f"autofit.run with a budget vs the plain loop, both on the simulated GPU: ratio "
          f"{paired(times, names[4], names[2], 'cpu'):.3f} CPU, "
          f"{paired(times, names[4], names[2], 'wall'):.3f} wall (medians of per-repeat ratios)")
    print(f"simulated GPU over the no-op dispatch mode: "
          f"{paired(times, names[2], names[1], 'cpu'):.3f} CPU (what the counter and the allocator "
          f"model add on top of the floor)")
    print()
    print_replay_cost(batches, args.repeats)
    print()
    print("Table 4. cost per op (us of process time, best of 7 rounds of 3000 ops)")
    print(table(["context", "x + y (new tensor)", "z.view(-1)", "added: new tensor", "added: view"],
                per_op_cost()))
    print()
    print_layout_table(args)
    print(f"\ntotal wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
