"""One rank's predicted peak under FSDP2 against the simulated GPU's measurement, per configuration.

Two gloo ranks each shard a tiny BERT classifier or GPT-2 LM (hidden 64, 2 layers, dropout on for
BERT, GPT-2's labels padded with -100) with `autofit.distributed.fsdp.shard` (fully_shard per block
and the root), run two training steps of its own 8 rows through `StepRunner` under
`autofit.simulate_gpu()` and take the second step's peak (optimizer state exists); then the same
rank predicts it with `autofit.estimator.sharded.estimate_sharded` (`device_type="cpu"`, the CPU's
kernels), from the unsharded model with the settings given or from the sharded model, its settings
read from it. The configurations are those tests/test_sharded_estimate.py asserts, plus GPT-2.

    python benchmarks/fsdp_estimate.py     # about 1.5 minutes on 2 shared cores
"""

from __future__ import annotations

import os
import sys
import tempfile

from common import ROOT, print_environment, setup, table

sys.path.insert(0, os.path.join(ROOT, "tests"))  # the ranks' script is shared with the tests

from fsdp_ranks import CONFIGS, run_ranks  # noqa: E402

from autofit.sizes import format_size  # noqa: E402


def main() -> None:
    setup()
    print_environment("FSDP2 per rank: predicted vs measured peak of one training step, 2 gloo ranks")
    with tempfile.TemporaryDirectory() as out:
        ranks = run_ranks(out, CONFIGS)
    rows = []
    for name, kind, raf, param_dtype, fields, shard_first, reduce_each in CONFIGS:
        for r, seen in enumerate(ranks):
            m, p = seen[name]["measured"], seen[name]["predicted"]
            plan = f"micro {fields['micro_batch_size']} x {fields.get('accumulation_steps', 1)}" + \
                (", ckpt" if fields.get("checkpointing") else "")
            rows.append([name, r, plan, "sharded" if shard_first else "unsharded",
                         format_size(seen[name]["resident"]["params"]), format_size(p),
                         format_size(m), f"{100 * (p - m) / m:+.2f}%"])
    print(table(["configuration", "rank", "plan", "model given", "params/rank", "predicted",
                 "measured", "error"], rows))


if __name__ == "__main__":
    main()
