"""How long `autofit probe` takes, in a fresh process (imports included): wall seconds and CPU seconds
(user + system, which a box shared with other work inflates less than the wall clock).

Commands: README's first one (`--gpu-mem 2GiB`: BERT-base, 32 x 128 tokens, about 7 plans), and a
searching probe of a Llama-2-7B config (written to a temporary directory; 32 x 128 tokens, a 60 GiB
card: several plans, repeated blocks walked through 3 of 32). `--root DIR` times the checkout at DIR
instead of this one (to compare before and after a change); `--repeat N` keeps the fastest of N runs.

    python benchmarks/probe_speed.py [--root DIR] [--repeat 3]

Measured 2026-12-03 on the 2-core box while idle (load under 1), fastest of 1 run, before
(the estimator walking offloaded plans with their host copies, snapshots and host updates) and after
(those skipped: no device memory effect; the same plans and figures):

    command                                  before: wall s  CPU s   after: wall s  CPU s
    probe --gpu-mem 2GiB (BERT-base)                   17.1   16.8            10.2   10.2
    probe Llama-2-7B config --gpu-mem 60GiB            19.4   19.5            11.8   11.9

Of the 10 s left for BERT-base, about 4 s are imports (torch, transformers' BERT) and building the
model on meta, and the 11 walks' forward and backward on fake tensors (7 plans; 4 checks against a
walk of 4 blocks) most of the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

LLAMA_2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-05, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
              "tie_word_embeddings": False}


def run_probe(root: str, args: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s, the output's plan table) of `autofit probe ARGS` run from checkout `root`."""
    code = ("import sys; from autofit.cli import entry; "
            f"sys.argv = ['autofit', 'probe'] + {args!r}; sys.exit(entry())")
    env = dict(os.environ, PYTHONPATH=root)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode not in (0, 1):  # 1: no plan fits, still an answer
        raise SystemExit(f"probe {' '.join(args)} failed under {root}:\n{done.stderr}")
    return wall, cpu, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=ROOT, help="the checkout to time (default: this one)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per command; the fastest is kept")
    options = parser.parse_args()
    sys.path.insert(0, ROOT)
    from autofit.diagnosis.report import table
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "config.json")
        with open(config, "w") as f:
            json.dump(LLAMA_2_7B, f)
        commands = {"probe --gpu-mem 2GiB (BERT-base)": ["--gpu-mem", "2GiB"],
                    "probe Llama-2-7B config --gpu-mem 60GiB": ["--model", config, "--gpu-mem", "60GiB"]}
        rows = []
        for name, args in commands.items():
            runs = [run_probe(options.root, args) for _ in range(max(options.repeat, 1))]
            wall, cpu, output = min(runs, key=lambda r: r[1])
            plans = sum(1 for line in output.splitlines() if line.rstrip().endswith((" yes", " no")))
            rows.append([name, f"{wall:.1f}", f"{cpu:.1f}", plans])
    print(f"checkout: {options.root}")
    print(table(["command", "wall s", "CPU s", "plans estimated"], rows, align="lrrr"))


if __name__ == "__main__":
    main()
