"""What freeing memory costs after an out-of-memory error and at a run's end, with transformers loaded.

    python benchmarks/recovery_cost.py [--repeats 5]

Every recovery from an OOM (`engine.attempt.Attempter` -> `gpu.oom.release`) and every run's end
(`recipes.training.Training._close`) collects the reference cycles that may still hold device
memory. A full `gc.collect()` walks every object alive: with torch, transformers and a model loaded
that is a few hundred thousand objects. This script times, on a tiny BERT (hidden 32, 1 layer, seq 16)
on the simulated GPU (wall time, median of `--repeats`; the count of full collections is exact):

- a full `gc.collect()` alone, and the objects it walks;
- one recovery: an attempt whose backward fails (a fault injected at a fixed allocation), freed and
  checked against the baseline;
- `autofit.run` of one global batch with an ample budget (start, one step, end);
- `autofit.run` of one global batch whose first attempt fails (start, the failed attempt and its
  recovery, the step down, the step, end).

torch.set_num_threads(1), as the other benchmarks.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

from common import print_environment, setup, table

import torch  # noqa: E402

import autofit  # noqa: E402  (common put the checkout on sys.path)
from autofit.engine.attempt import Attempter  # noqa: E402
from autofit.gpu.device import open_device  # noqa: E402


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        vocab_size=200, max_position_embeddings=32, num_labels=2)
    return BertForSequenceClassification(config)


def batch(rows=16, seq=16):
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 200, (rows, seq), generator=g),
            "attention_mask": torch.ones(rows, seq, dtype=torch.long),
            "labels": torch.randint(0, 2, (rows,), generator=g)}


class FullCollections:
    """Counts full (generation 2) collections while it is open."""

    def __enter__(self):
        self.count = 0
        gc.callbacks.append(self._seen)
        return self

    def _seen(self, phase, info):
        if phase == "start" and info["generation"] == 2:
            self.count += 1

    def __exit__(self, *exc):
        gc.callbacks.remove(self._seen)


def timed(fn, repeats):
    """(median seconds, full collections per call) of `fn()`."""
    times, fulls = [], []
    for _ in range(repeats):
        with FullCollections() as full:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        fulls.append(full.count)
    return statistics.median(times), statistics.median(fulls)


def full_collect():
    gc.collect()


def one_recovery():
    model = tiny_bert()
    data = batch()
    with autofit.simulate_gpu("64MiB") as gpu, open_device() as device:
        device.place_model(model)

        def work():
            gpu.fail_at(gpu.allocation_count + 80)  # inside backward (51 allocations forward, 63 backward)
            model(**data).loss.backward()
        outcome = Attempter(device, lambda: (model, None))(work)
        gpu.fail_at(None)
    assert not outcome.ok, "the injected fault did not fire"


def run(budget, fail_first):
    model = tiny_bert()
    data = [batch()]
    with autofit.simulate_gpu(budget) as gpu:
        if fail_first:
            gpu.fail_at(gpu.allocation_count + 80)
        result = autofit.run(model, data, progress=False, cache=False, capacity_check=False)
    assert [a.outcome for a in result.attempts][:1] == (["oom"] if fail_first else ["ok"]), result.attempts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    setup()
    os.environ["AUTOFIT_CACHE_DIR"] = tempfile.mkdtemp()
    import transformers  # noqa: F401  (loaded, as in a Hugging Face job)
    print_environment("recovery_cost.py: freeing after an OOM and at a run's end")
    run("64MiB", False)  # warm up: imports, first dispatch
    gc.collect()
    rows = []
    seconds, _ = timed(full_collect, args.repeats)
    rows.append(["gc.collect() alone", f"{seconds * 1e3:.1f}", 1, f"{len(gc.get_objects())} objects"])
    for name, fn in [("one recovery (Attempter, fault in backward)", one_recovery),
                     ("autofit.run, 1 global batch, no OOM", lambda: run("64MiB", False)),
                     ("autofit.run, 1 global batch, first attempt OOM", lambda: run("64MiB", True))]:
        seconds, fulls = timed(fn, args.repeats)
        rows.append([name, f"{seconds * 1e3:.1f}", fulls, ""])
    print(table(["what", "median ms", "full collections", "note"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
