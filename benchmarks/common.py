"""Helpers shared by the benchmark scripts: environment, tiny models, batches, plain loops, clocks.

Nothing here imports autofit's internals: the plain loops are written out by hand, so a benchmark
compares autofit against code that does not share its bugs. Tables are printed with
`autofit.diagnosis.report.table` (plain text, no dependency).
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import statistics
import sys
import time
import warnings
import weakref

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # `python benchmarks/x.py` from a checkout works without installing
    sys.path.insert(0, ROOT)

from autofit.diagnosis.report import key_values, table  # noqa: E402  (after the path fix)

THREADS = 1
IGNORE_INDEX = -100


def setup() -> None:
    """One intra-op thread (stable timings on a shared box), quiet libraries."""
    torch.set_num_threads(THREADS)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    logging.getLogger("autofit").setLevel(logging.ERROR)
    try:
        import transformers
        transformers.logging.set_verbosity_error()
    except Exception:
        pass


def environment() -> list[tuple[str, object]]:
    import transformers
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = f"{names[0]} ({len(names)} logical cores visible)"
    except OSError:
        pass
    pairs = [
        ("date", datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")),
        ("autofit", autofit_version()),
        ("machine", f"{platform.system()} {platform.release()}, {cpu}"),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("transformers", transformers.__version__),
    ]
    try:
        import accelerate
        pairs.append(("accelerate", accelerate.__version__))
    except ImportError:
        pairs.append(("accelerate", "not installed"))
    pairs.append(("torch threads", f"{torch.get_num_threads()} (torch.set_num_threads({THREADS}))"))
    pairs.append(("cuda", "available" if torch.cuda.is_available() else "not available (CPU run)"))
    return pairs


def autofit_version() -> str:
    """The package version and, in a git checkout, the commit and whether autofit/ has uncommitted
    changes (read-only git queries; the tables belong to the code that produced them)."""
    import subprocess

    import autofit
    text = autofit.__version__
    try:
        def git(*args):
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "autofit")
        text += f", checkout {commit}" + (" + uncommitted changes in autofit/" if dirty else "")
    except Exception:
        pass
    return text


def print_environment(title: str) -> None:
    print(title)
    print(key_values(environment(), indent="  "))
    print()


# -- models and batches (random init, dropout 0, nothing downloaded) ------------------------------

def bert(hidden: int = 64, layers: int = 2, seq: int = 64, vocab: int = 1000, seed: int = 0,
         num_labels: int = 2):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=seq,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        num_labels=num_labels)
    return BertForSequenceClassification(config)


def gpt2(hidden: int = 64, layers: int = 2, seq: int = 64, vocab: int = 1000, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=2, vocab_size=vocab, n_positions=seq,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    return GPT2LMHeadModel(config)


def cls_batches(n: int, rows: int, seq: int, vocab: int = 1000, seed: int = 1,
                num_labels: int = 2) -> list[dict]:
    """Sequence-classification global batches: input_ids, attention_mask, one label per row."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (rows, seq), generator=g),
             "attention_mask": torch.ones(rows, seq, dtype=torch.long),
             "labels": torch.randint(0, num_labels, (rows,), generator=g)} for _ in range(n)]


def lm_batches(n: int, rows: int, seq: int, vocab: int = 1000, seed: int = 2) -> list[dict]:
    """Causal-LM global batches; row r has its last (r % 7) * 3 labels set to -100, so rows carry
    different numbers of label tokens and micro-batches must be weighted by tokens, not rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        labels = ids.clone()
        for r in range(rows):
            pad = (r % 7) * 3
            if pad:
                labels[r, seq - pad:] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


def rows(batch: dict) -> int:
    return int(next(iter(batch.values())).shape[0])


def concat(batches: list[dict]) -> dict:
    """All global batches as one dataset-like dict of tensors (for peers that rebatch the data)."""
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def take(data: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] for k, v in data.items()}


# -- the plain training step (hand-written; no autofit code) --------------------------------------

def is_causal_lm(model) -> bool:
    name = type(model).__name__
    return name.endswith("LMHeadModel") or name.endswith("ForCausalLM")


def label_tokens(batch: dict, causal: bool) -> int:
    labels = batch["labels"]
    if causal:
        labels = labels[:, 1:]  # causal LMs shift labels by one: the first never counts
    return int((labels != IGNORE_INDEX).sum())


def shares(batch: dict, parts: list[dict], causal: bool) -> list[float]:
    """Each micro-batch's weight: its share of label tokens for a token-level loss, else of rows."""
    if batch["labels"].dim() >= 2:
        total = label_tokens(batch, causal)
        return [label_tokens(p, causal) / total for p in parts]
    n = rows(batch)
    return [rows(p) / n for p in parts]


def split(batch: dict, micro: int) -> list[dict]:
    n = rows(batch)
    return [take(batch, i, min(i + micro, n)) for i in range(0, n, micro)]


def plain_step(model, optimizer, batch: dict, micro: int | None = None, to_device=None) -> float:
    """One optimizer step on `batch`, split into micro-batches of `micro` rows (None: no split),
    micro-batch losses weighted by their share; returns the batch loss (one .item(), as a loop that
    logs its loss does)."""
    causal = is_causal_lm(model)
    micro = micro or rows(batch)
    parts = split(batch, micro)
    weights = [1.0] if len(parts) == 1 else shares(batch, parts, causal)
    total = 0.0
    for part, w in zip(parts, weights):
        if to_device is not None:
            part = to_device(part)
        loss = model(**part).loss
        (loss * w if w != 1.0 else loss).backward()
        total = total + loss.detach() * w
        del loss, part
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


def adamw(params, foreach: bool | None = None):
    """The optimizer every loop of a benchmark uses (lr 1e-3, PyTorch defaults otherwise)."""
    return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)


def reference(build, batches: list[dict], micro: int | None = None, foreach: bool | None = None):
    """A plain loop on an unlimited device: the parameters every method is compared against."""
    model = build()
    model.train()
    opt = adamw(model.parameters(), foreach=foreach)
    for b in batches:
        plain_step(model, opt, b, micro)
    return model


def max_abs_diff(a, b) -> float:
    return max((pa.detach() - pb.detach()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()))


def simulated_copy(batch: dict) -> dict:
    """A host-to-device copy on the simulated GPU: a clone made inside simulate_gpu is counted."""
    return {k: v.clone() for k, v in batch.items()}


# -- clocks --------------------------------------------------------------------------------------

class StepClock:
    """Timestamps of every optimizer.step() that returned normally (a post-step hook): wall time
    (perf_counter) and this thread's CPU time (thread_time). With one intra-op thread all of a
    step's work runs on the calling thread, so CPU time is what a step costs even when other
    processes share the cores; wall time is what a user waits."""

    def __init__(self):
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.armed = True
        self._latest = None  # a weak reference: the clock must not keep a dropped optimizer alive

    @property
    def optimizer(self):
        """The optimizer attached last, while it is alive (else None)."""
        return None if self._latest is None else self._latest()

    def attach(self, optimizer):
        self._latest = weakref.ref(optimizer)
        def hook(_opt, _args, _kwargs):
            if self.armed:
                self.times.append(time.perf_counter())
                self.cpu.append(time.thread_time())
        optimizer.register_step_post_hook(hook)
        return optimizer

    def intervals(self, skip: int = 0, cpu: bool = False) -> list[float]:
        t = (self.cpu if cpu else self.times)[skip:]
        return [b - a for a, b in zip(t, t[1:])]


def median(values) -> float:
    return statistics.median(values)


__all__ = [
    "StepClock", "adamw", "bert", "cls_batches", "concat", "environment", "gpt2", "is_causal_lm",
    "key_values", "lm_batches", "max_abs_diff", "median", "plain_step", "print_environment",
    "reference", "rows", "setup", "shares", "simulated_copy", "split", "table", "take",
]
