"""How long `autofit probe` takes, in a fresh process (imports included): wall seconds and CPU seconds
(user + system, which a box shared with other work inflates less than the wall clock).

Commands: README's first one (`--gpu-mem 2GiB`: BERT-base, 32 x 128 tokens, about 7 plans), and a
searching probe of a Llama-2-7B config (written to a temporary directory; 32 x 128 tokens, a 60 GiB
card: several plans, repeated blocks walked through 3 of 32). `--root DIR` times the checkout at DIR
instead of this one; given more than once, the checkouts take turns run by run (to compare before and
after a change under the same load), and the last column says whether each printed exactly what the
first printed. `--repeat N` keeps the fastest (by CPU) of N runs.

    python benchmarks/probe_speed.py [--root DIR ...] [--repeat 3]

Measured 2026-12-03 on the 2-core box shared with other work (load 0.5-1.5), fastest of 3 runs,
before (/work/main) and after (the estimator sharing FakeTensorMode's dispatch cache between the plans
of one search and a plan's cut walks, answering `prim.device` itself, no device context where CPU is
the default already, the optimizer warmed one parameter per kind, cut copies making fakes only for the
blocks they keep), two runs of the benchmark:

    command                                  before: wall s  CPU s   after: wall s  CPU s   output
    probe --gpu-mem 2GiB (BERT-base)                9.6 / 11.0   9.7 / 11.1     8.4 / 8.6   8.5 / 8.7   same
    probe Llama-2-7B config --gpu-mem 60GiB        14.5 / 12.5  14.4 / 12.4    12.1 / 11.2  12.1 / 11.1   same

Of the 8.5 s for BERT-base about 4 s are imports and building the model on meta (0.9 s of them
Python's garbage collector over what the imports make), 0.3 s the fake copies and warm step, and
about 3.5 s the 11 walks (7 plans; 4 checks against a walk of 4 blocks, all dispatch-cache hits).
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
    parser.add_argument("--root", action="append", help="a checkout to time (default: this one); given "
                        "more than once, the checkouts' runs take turns, so they share the box's noise")
    parser.add_argument("--repeat", type=int, default=1, help="runs per command; the fastest is kept")
    options = parser.parse_args()
    roots = options.root or [ROOT]
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
            runs: dict = {root: [] for root in roots}
            for _ in range(max(options.repeat, 1)):
                for root in roots:
                    runs[root].append(run_probe(root, args))
            tables = {root: min(r, key=lambda run: run[1])[2] for root, r in runs.items()}
            for root, r in runs.items():
                wall, cpu, output = min(r, key=lambda run: run[1])
                plans = sum(1 for line in output.splitlines() if line.rstrip().endswith((" yes", " no")))
                same = "" if len(roots) == 1 else ("yes" if output == tables[roots[0]] else "NO")
                rows.append([name, root, f"{wall:.1f}", f"{cpu:.1f}", plans] + ([same] if same else []))
    headers = ["command", "checkout", "wall s", "CPU s", "plans estimated"]
    headers += ["output as the first checkout's"] if len(roots) > 1 else []
    print(table(headers, rows, align="llrrr" + "l" * (len(roots) > 1)))


if __name__ == "__main__":
    main()
