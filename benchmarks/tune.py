"""autofit.tune: the tuned plan against the default ladder's plan, measured in one run.

    python benchmarks/tune.py [--repeats 3] [--steps 5] [--warmup 2] [--rounds 4] [--global-batch 32]
                              [--seq 64] [--hidden 128] [--precision auto]

For two models (a BERT classifier and a GPT-2 LM built from configs, random init, dropout 0), on a
simulated GPU whose budget is chosen from a measured peak so that the whole global batch does not fit
and half of it does, `autofit.tune` measures every plan of its space (`--warmup` untimed and `--steps`
timed global batches each) and reports the winner's samples per second against the default plan's
(the plan `autofit.run` starts from without tuning: the capacity check's choice). The whole tune is
repeated `--repeats` times, each with a fresh plan cache and study, so the spread of the ratio is
shown next to it.

The ratio tune reports comes from one trial per plan, measured in a fixed order (the default plan
first). To check it is not an artefact of order or noise, each repeat then measures the default and
the tuned plan again, `--rounds` times back to back in alternating order, with tune's own trial
(`autofit.throughput.measure`) on a fresh model: the "paired ratio" is the median of tuned/default
over those rounds. After each tune, `autofit.run` trains the same batches with the cache tune wrote:
the table says how many OOM attempts it made and whether it started from the tuned plan.

All optimizers are AdamW(lr=1e-3, foreach=True). torch.set_num_threads(1).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time

from common import adamw, bert, cls_batches, gpt2, lm_batches, print_environment, setup, table

import autofit  # noqa: E402  (common put the checkout on sys.path)
from autofit.device import SimulatedDevice  # noqa: E402
from autofit.throughput import Pristine, measure  # noqa: E402
from autofit import tune  # noqa: E402


def foreach_adamw(params):
    return adamw(params, foreach=True)


def second_step_peak(build, batch: dict, micro: int) -> int:
    """Peak bytes of the second of two global steps (AdamW state exists) at `micro` rows per
    micro-batch, with accumulation, on an unlimited simulated GPU (plain loop, no autofit code)."""
    model = build()
    model.train()
    with autofit.simulate_gpu() as gpu:
        gpu.track(list(model.parameters()) + list(model.buffers()))
        opt = foreach_adamw(model.parameters())
        n = next(iter(batch.values())).shape[0]
        for _ in range(2):
            gpu.reset_peak_memory_stats()
            for i in range(0, n, micro):
                part = {k: v[i:i + micro].clone() for k, v in batch.items()}
                (model(**part).loss * (len(part["input_ids"]) / n)).backward()
                del part
            opt.step()
            opt.zero_grad(set_to_none=True)
        return gpu.max_memory_allocated()


def remeasure(build, data, budget, default, tuned, rounds: int, warmup: int) -> list[float]:
    """tuned / default samples per second, once per round, the two plans measured back to back
    with tune's own trial (`autofit.throughput.measure`) in alternating order (default first in
    even rounds). When tune kept the default plan, this is an A/A ratio: the noise of the figure."""
    model = build()
    ratios = []
    with autofit.simulate_gpu(budget) as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        optimizer = foreach_adamw(model.parameters())
        pristine = Pristine(model, optimizer, device)
        for r in range(rounds):
            speed = {}
            for i, plan in enumerate((default, tuned) if r % 2 == 0 else (tuned, default)):
                m = measure(model, optimizer, device, plan, data, warmup=warmup, clock=time.perf_counter)
                pristine.restore()
                speed[i if r % 2 == 0 else 1 - i] = m.samples_per_second
            ratios.append(speed[1] / speed[0])
        pristine.finish()
    return ratios


def mib(n) -> str:
    return f"{n / 2**20:.2f} MiB"


def one_model(name, build, data, args):
    global_batch = args.global_batch
    half, full = (second_step_peak(build, data[0], m) for m in (global_batch // 2, global_batch))
    budget = int(half / 0.85)  # half the batch fits inside the runner's margin (0.9); all of it does not
    n_params = sum(p.numel() for p in build().parameters())
    facts = [name, f"{n_params / 1e6:.2f} M", mib(budget), mib(full), mib(half)]
    repeats = []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="tune_bench_") as cache:
            os.environ["AUTOFIT_CACHE_DIR"] = cache
            start = time.perf_counter()
            result = tune(build(), data, budget=budget, steps=args.steps, warmup=args.warmup,
                          optimizer=foreach_adamw, precision=args.precision)
            seconds = time.perf_counter() - start
            after = autofit.run(build(), data, budget=budget, optimizer=foreach_adamw, progress=False,
                                precision=args.precision)
        again = remeasure(build, data, budget, result.default_plan, result.plan, args.rounds, args.warmup)
        repeats.append((result, seconds, after, again))
    return facts, repeats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="paired re-measurements per repeat")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    args = parser.parse_args(argv)
    setup()
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print_environment("autofit.tune benchmark")
    n = args.warmup + args.steps
    jobs = [
        ("BERT cls", lambda: bert(hidden=args.hidden, seq=args.seq),
         cls_batches(n, args.global_batch, args.seq)),
        ("GPT-2 LM", lambda: gpt2(hidden=args.hidden, seq=args.seq),
         lm_batches(n, args.global_batch, args.seq)),
    ]
    print(f"global batch {args.global_batch} x {args.seq} tokens, hidden {args.hidden}, 2 layers, vocab 1000; "
          f"precision={args.precision!r}; each trial: {args.warmup} untimed + {args.steps} timed global "
          f"batches; {args.repeats} repeats, each with a fresh plan cache and study, then {args.rounds} "
          f"paired rounds\n")
    facts, summary, per_repeat, last_trials = [], [], [], []
    for name, build, data in jobs:
        fact, repeats = one_model(name, build, data, args)
        facts.append(fact)
        for i, (result, seconds, after, again) in enumerate(repeats):
            ok = sum(t.outcome == "ok" for t in result.trials)
            per_repeat.append([name, i + 1, result.default_plan.describe(),
                               round(result.default_samples_per_second or 0, 1), result.plan.describe(),
                               round(result.samples_per_second, 1), round(result.speedup or 0, 3),
                               round(statistics.median(again), 3),
                               f"{ok}/{len(result.trials)}", round(seconds, 1), after.oom_attempts,
                               after.attempts[0].reason.startswith("cached") and after.attempts[0].plan == result.plan])
        ratios = [r.speedup for r, *_ in repeats if r.speedup]
        paired = [x for *_, again in repeats for x in again]
        defaults = [r.default_samples_per_second for r, *_ in repeats if r.default_samples_per_second]
        chosen = collections.Counter(r.plan.describe() for r, *_ in repeats).most_common(1)[0]
        summary.append([name, repeats[0][0].default_plan.describe(), round(statistics.median(defaults), 1),
                        f"{chosen[0]} ({chosen[1]}/{len(repeats)})",
                        round(statistics.median(r.samples_per_second for r, *_ in repeats), 1),
                        round(statistics.median(ratios), 3), f"{min(ratios):.3f}-{max(ratios):.3f}",
                        round(statistics.median(paired), 3), f"{min(paired):.3f}-{max(paired):.3f}",
                        f"{(max(defaults) - min(defaults)) / statistics.median(defaults):.1%}"])
        last = repeats[-1][0]
        last_trials += [[name, t.number, t.plan.describe(), t.outcome,
                         None if t.samples_per_second is None else round(t.samples_per_second, 1),
                         "yes" if t.plan == last.default_plan else "", "yes" if t.plan == last.plan else ""]
                        for t in last.trials]
    print("Table 1: the jobs (budget: half the global batch fits inside the 0.9 margin)")
    print(table(["model", "params", "budget", "full-batch peak", "half-batch peak"], facts))
    print("\nTable 2: tuned plan against the default plan (medians over repeats)")
    print(table(["model", "default plan", "default samples/s", "tuned plan (chosen in)", "tuned samples/s",
                 "ratio", "range", "paired ratio", "range", "default spread"], summary))
    print("\nTable 3: every repeat; then autofit.run with the cache tune wrote")
    print(table(["model", "repeat", "default plan", "samples/s", "tuned plan", "samples/s", "ratio",
                 "paired", "trials ok", "tune s", "run OOMs", "run starts tuned"], per_repeat))
    print("\nTable 4: the trials of the last repeat")
    print(table(["model", "trial", "plan", "outcome", "samples/s", "default", "chosen"], last_trials))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
