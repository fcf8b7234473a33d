"""A cold start on models the tests never use: OOM attempts and the micro-batch reached, before and
after the calibrated, guided search (issue 12, point 4).

    python benchmarks/calibrate.py [--before REF] [--batches 3] [--caps allocated reserved]

For each held-out model (a DistilBERT-like classifier, a ViT and a GPT-NeoX (Pythia-like) causal LM,
built from transformers configs with their default dropout), `autofit.run` trains `--batches` global
batches of 32 (precision="fp32", an empty plan cache) on a simulated GPU whose budget caps allocated
bytes (the default) or reserved bytes (`caps="reserved"`, as a card's memory limit does). The budget
is set from measured peaks of autofit's own step so that about 40% of the batch fits: it lies halfway
between the peak of autofit's own step at 13 rows (the second global step, with the AdamW state, on a
fresh model under an unlimited simulated GPU of the same caps) and the next larger peak (at 14 rows,
or further up where reserved peaks share a segment). "largest" is the largest micro-batch that fits,
measured directly under that budget: the largest size whose two steps (from a fresh model) run
without an OOM. Where the budget caps reserved bytes this can be above the unbounded peaks' answer:
a capped allocator releases its cached segments before it fails. Sequences are 64 tokens, padded rows; ViT
images 32 x 32 in patches of 4.

Each run happens twice, in a child process: with this checkout's autofit ("after") and with the
autofit of `--before` (default: 00ef491, the code before the calibrated search; extracted with
`git archive` into a temporary folder). Columns: OOM attempts of the run; micro-batch of the second
global batch (the goal: >= 95% of the largest, with at most 1 OOM attempt) and of the last one;
the attempts in order (step:micro, x = OOM).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
GLOBAL_BATCH, TARGET, SEQ = 32, 13, 64
MODELS = ("distilbert", "vit", "gpt-neox")


# -- the jobs (run in the child) ------------------------------------------------------------------

def build(name: str, seed: int = 0):
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    if name == "distilbert":
        return tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
            vocab_size=2000, dim=128, hidden_dim=512, n_layers=3, n_heads=4, max_position_embeddings=SEQ))
    if name == "vit":
        return tf.ViTForImageClassification(tf.ViTConfig(
            image_size=32, patch_size=4, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=512, num_labels=10, hidden_dropout_prob=0.1))
    if name == "gpt-neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
            vocab_size=2000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=512, max_position_embeddings=SEQ, hidden_dropout=0.1, attention_dropout=0.1))
    raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")


def batches(name: str, n: int, seed: int = 1) -> list[dict]:
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if name == "vit":
            out.append({"pixel_values": torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=g),
                        "labels": torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)})
            continue
        ids = torch.randint(0, 2000, (GLOBAL_BATCH, SEQ), generator=g)
        mask = torch.ones_like(ids)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (GLOBAL_BATCH,), generator=g)  # padded rows
        for i, n_tokens in enumerate(lengths.tolist()):
            mask[i, n_tokens:] = 0
        if name == "distilbert":
            out.append({"input_ids": ids, "attention_mask": mask,
                        "labels": torch.randint(0, 2, (GLOBAL_BATCH,), generator=g)})
        else:
            out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def step_peak(name: str, caps: str, micro: int, budget=None) -> int | None:
    """The peak (of `caps`) of autofit's own step at `micro` rows, second global step; None: OOM."""
    import torch
    import autofit
    from autofit.engine.step import StepRunner
    from autofit.gpu.device import open_device
    from autofit.plans.plan import Plan
    model, data = build(name), batches(name, 2)
    plan = Plan.for_batch(GLOBAL_BATCH, micro, precision="fp32")
    try:
        with autofit.simulate_gpu(budget, caps=caps) as gpu, open_device() as device:
            device.place_model(model)
            runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device)
            try:
                runner.run(data[0], plan)
                gpu.reset_peak_memory_stats()
                runner.run(data[1], plan)
                peak = gpu.max_memory_reserved() if caps == "reserved" else runner.attempt_peak()
            finally:
                runner.close()
        return peak
    except torch.OutOfMemoryError:
        return None


def budget_and_largest(name: str, caps: str) -> tuple[int, int]:
    """A budget halfway between the peak of TARGET rows and the next larger peak (reserved peaks
    come in segments: several sizes may share one), and the largest micro-batch that fits it."""
    low = step_peak(name, caps, TARGET)
    size = TARGET + 1
    while (high := step_peak(name, caps, size)) == low:
        size += 1
    budget = (low + high) // 2
    largest = next(m for m in range(GLOBAL_BATCH, 0, -1) if step_peak(name, caps, m, budget) is not None)
    return budget, largest


def cold_run(name: str, caps: str, budget: int, n: int) -> dict:
    import logging
    import autofit
    logging.getLogger("autofit").setLevel(logging.ERROR)
    os.environ["AUTOFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="autofit-calibrate-")
    model, data = build(name), batches(name, n)  # on the host, as a DataLoader gives them
    with autofit.simulate_gpu(budget, caps=caps):
        result = autofit.run(model, data, precision="fp32", progress=False)
    attempts = [(a.step, a.plan.micro_batch_size, a.outcome) for a in result.attempts]
    ok = {step: micro for step, micro, outcome in attempts if outcome == "ok"}
    return {"attempts": attempts, "ooms": sum(o == "oom" for _, _, o in attempts),
            "second": ok.get(1), "final": ok[max(ok)]}


def child(args) -> None:
    import warnings
    import torch
    import transformers
    torch.set_num_threads(1)  # a shared machine: stable, and what the other benchmarks use
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    job = json.loads(args.child)
    if job["do"] == "measure":  # the budget, and the largest micro-batch that fits it
        budget, top = budget_and_largest(job["model"], job["caps"])
        result = {"budget": budget, "largest": top}
    else:
        result = cold_run(job["model"], job["caps"], job["budget"], job["batches"])
    print("RESULT " + json.dumps(result))


# -- the parent -----------------------------------------------------------------------------------

def ask(job: dict, checkout: pathlib.Path):
    env = dict(os.environ, PYTHONPATH=str(checkout), TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], env=env,
                          capture_output=True, text=True, cwd=checkout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"child {job} in {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def extract(ref: str, repo: pathlib.Path) -> pathlib.Path:
    target = pathlib.Path(tempfile.mkdtemp(prefix="autofit-before-"))
    archive = subprocess.run(["git", "archive", ref, "autofit"], cwd=repo, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="00ef491")
    parser.add_argument("--repo", default=str(ROOT), help="the git repository holding --before")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--caps", nargs="+", default=["allocated", "reserved"])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, str(HERE))
    from common import print_environment, table
    print_environment("calibrated, guided micro-batch search: cold starts on held-out models")
    before = extract(args.before, pathlib.Path(args.repo))
    print(f"before: autofit of {args.before} (git archive into {before}); after: this checkout\n")
    rows = []
    for name in args.models:
        for caps in args.caps:
            measured = ask({"do": "measure", "model": name, "caps": caps}, ROOT)
            budget, top = measured["budget"], measured["largest"]
            for label, checkout in (("before", before), ("after", ROOT)):
                run = ask({"do": "run", "model": name, "caps": caps, "budget": budget,
                           "batches": args.batches}, checkout)
                seq = " ".join(f"{s}:{m}{'x' if o == 'oom' else ''}" for s, m, o in run["attempts"])
                rows.append([name, caps, f"{budget / 2**20:.2f} MiB", label, run["ooms"], run["second"],
                             run["final"], top, f"{run['second'] / top:.2f}", f"{run['final'] / top:.2f}",
                             seq])
                print("  ".join(str(c) for c in rows[-1]), flush=True)
    print()
    print(table(["model", "caps", "budget", "code", "OOM attempts", "micro at batch 2", "final micro",
                 "largest that fits", "ratio at batch 2", "final ratio", "attempts (step:micro, x = OOM)"],
                rows))


if __name__ == "__main__":
    main()
