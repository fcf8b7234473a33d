"""Cold start: what autofit's first good step costs against a plain loop's first step, on CPU.

    python benchmarks/cold_start.py [--repeats 3] [--base]

A cold run has no cached plan: before its first step the capacity check estimates plans on fake
tensors, and the guide may estimate more for its upward search. This script times, per model (wall
time, median of `--repeats`, each on a freshly built model; torch.set_num_threads(1)):

- plain: a plain loop's first step on the whole global batch (AdamW made, forward, backward, step);
- autofit: `autofit.run` of that one global batch (cache off, capacity check on) on a simulated GPU
  capping reserved bytes at half the whole batch's estimated reserved peak, as a card would: the
  capacity check, the first good step (and any failed attempt before it), the run's end;
- ratio: autofit / plain, the target being <= 3;
- walks: how many steps the estimator walked on fake tensors (a plan asked again, or a step replayed
  after another, is laid out from walks already made: autofit.estimator.replayed), and one walk's
  time (the whole batch's plan, one micro-batch, median of `--repeats` on a made estimator): the
  check costs about walks x that, whatever the model's FLOPs, since a walk's cost is per op;
and the attempts' outcomes. `--base` adds a BERT-base-shaped case (12 layers, hidden 768, 16 x 128;
about a minute per repeat): the check's cost is per op, the plain step's per FLOP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from common import adamw, bert, cls_batches, gpt2, lm_batches, plain_step, print_environment, setup, table

import torch  # noqa: E402

import autofit  # noqa: E402  (common put the checkout on sys.path)
from autofit.estimator import estimate as estimate_module  # noqa: E402


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
        patch_size=4, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def image_batches(rows: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"pixel_values": torch.randn(rows, 3, 32, 32, generator=g),
             "labels": torch.randint(0, 10, (rows,), generator=g)}]


CASES = {  # name -> (build, one global batch)
    "bert h64 l2, 32 x 128": (lambda: bert(seq=128), lambda: cls_batches(1, 32, 128)),
    "gpt2 h64 l2, 16 x 128": (lambda: gpt2(seq=128), lambda: lm_batches(1, 16, 128)),
    "vit h64 l2, 64 x 32x32": (vit, lambda: image_batches(64)),
}


BASE = {"bert-base shape, 16 x 128": (lambda: bert(hidden=768, layers=12, seq=128, vocab=30522),
                                       lambda: cls_batches(1, 16, 128, vocab=30522))}


def plain_first_step(build, data) -> float:
    model = build()
    model.train()
    started = time.perf_counter()
    plain_step(model, adamw(model.parameters()), data[0])
    return time.perf_counter() - started


def one_walk(build, data) -> float:
    """Seconds of one fake walk: the whole batch's plan, one micro-batch, on a made estimator."""
    estimator = estimate_module.Estimator(build(), data[0], adamw, device_type="cpu")
    plan = autofit.Plan(autofit.engine.batches.rows_of(data[0]))
    started = time.perf_counter()
    estimator.measure(plan)
    return time.perf_counter() - started


def autofit_first_step(build, data, budget) -> tuple[float, str, int]:
    model = build()
    counted = []
    walk = estimate_module.Estimator._measure

    def counting(self, *args, **kwargs):
        counted.append(1)
        return walk(self, *args, **kwargs)
    estimate_module.Estimator._measure = counting
    try:
        with autofit.simulate_gpu(budget, caps="reserved"):
            started = time.perf_counter()
            result = autofit.run(model, data, optimizer=adamw, progress=False, cache=False)
            seconds = time.perf_counter() - started
    finally:
        estimate_module.Estimator._measure = walk
    outcomes = "; ".join(f"{a.plan.describe()}: {a.outcome}" for a in result.attempts)
    return seconds, outcomes, len(counted)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base", action="store_true", help="add a BERT-base-shaped case")
    args = parser.parse_args(argv)
    setup()
    os.environ["AUTOFIT_CACHE_DIR"] = tempfile.mkdtemp()
    print_environment("cold_start.py: autofit's first good step against a plain first step")
    rows = []
    for name, (build, batches) in {**CASES, **(BASE if args.base else {})}.items():
        data = batches()
        whole = autofit.estimate(build(), data[0], autofit.Plan(autofit.engine.batches.rows_of(data[0])),
                                 optimizer=adamw, device_type="cpu")
        budget = whole.reserved_bytes // 2
        plain_first_step(build, data)  # warm-up: the model's first dispatch of each op
        plain = statistics.median(plain_first_step(build, data) for _ in range(args.repeats))
        runs = [autofit_first_step(build, data, budget) for _ in range(args.repeats)]
        cold = statistics.median(r[0] for r in runs)
        walk = statistics.median(one_walk(build, data) for _ in range(args.repeats))
        rows.append([name, f"{budget / 2**20:.1f}", f"{plain * 1e3:.0f}", f"{cold * 1e3:.0f}",
                     f"{cold / plain:.1f}", runs[-1][2], f"{walk * 1e3:.0f}", runs[-1][1]])
    print(table(["model, global batch", "budget MiB", "plain first step ms", "autofit first step ms",
                 "ratio", "walks", "one walk ms", "attempts"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
