"""`autofit probe` on 7B-class models: which plan each card gets, its predicted peaks, and the
seconds one probe takes.

Configs: Llama-2-7B, Llama-3-8B, Mistral-7B-v0.1, Qwen2-7B and Llama-2-70B, written out below from
the values of their published config.json files (nothing downloaded; built on meta, fake tensors
only). Fine-tunes: the whole model (fp32 weights, AdamW), a frozen base with LoRA rank-16 adapters on
every linear layer (fp32 base), and the whole model with bf16 weights. Cards: 16, 24 and 80 GiB
total (the probe subtracts its 0.4 GiB context reserve). Global batch 4 x 512 tokens, causal-LM
labels. Each probe runs in this process through `autofit.cli.main([... "--json"])`.

    python benchmarks/probe_7b.py       # all 45 probes: 147 s idle, 868 s on 2 shared cores
    python benchmarks/probe_7b.py --models llama-2-7b,qwen2-7b --cards 24 --setups full,lora
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import time

from common import print_environment, setup, table

from autofit.cli import main  # noqa: E402
from autofit.commands.finetune import precision_text  # noqa: E402
from autofit.sizes import format_size  # noqa: E402

_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    # meta-llama/Llama-2-7b-hf
    "llama-2-7b": dict(_LLAMA, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                       num_hidden_layers=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=4096, rope_theta=10000.0),
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_hidden_layers=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, bos_token_id=128000,
                       eos_token_id=128001),
    # mistralai/Mistral-7B-v0.1
    "mistral-7b": dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_act="silu",
                       hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_hidden_layers=32, num_key_value_heads=8, vocab_size=32000,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0,
                       sliding_window=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # Qwen/Qwen2-7B
    "qwen2-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu",
                     hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                     num_hidden_layers=28, num_key_value_heads=4, vocab_size=152064,
                     max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643),
    # meta-llama/Llama-2-70b-hf
    "llama-2-70b": dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                        num_hidden_layers=80, num_key_value_heads=8, vocab_size=32000,
                        max_position_embeddings=4096, rope_theta=10000.0),
}
SETUPS = {
    "full": [],
    "lora": ["--trainable", "lora", "--lora-rank", "16"],
    "bf16": ["--weights", "bf16"],
}
CARDS = (16, 24, 80)
BATCH = ["--batch-size", "4", "--seq-len", "512"]


def probe(config_dir: str, card: int, options: list[str]) -> tuple[dict, float]:
    """The probe's JSON result and the seconds it took."""
    stdout, stderr = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["probe", "--gpu-mem", f"{card}GiB", "--model", config_dir, *BATCH, *options, "--json"])
    seconds = time.perf_counter() - start
    if code not in (0, 1) or not stdout.getvalue().strip():
        raise RuntimeError(f"probe exited {code}: {stderr.getvalue().strip()}")
    return json.loads(stdout.getvalue()), seconds


def plan_text(result: dict) -> str:
    plan = result["plan"]
    if plan is None:
        return "none fits"
    # the precision as the step runs it: the autocast on fp32 weights, "bf16 weights" on bf16 ones
    switched = (("ckpt", plan["checkpointing"]), ("offload", plan["offload_optimizer"]))
    moves = [precision_text(plan["precision"], result["weights"])] + [name for name, on in switched if on]
    return f"{plan['micro_batch_size']} x {plan['accumulation_steps']}, {', '.join(moves)}"


def size(value) -> str:
    return "-" if value is None else format_size(value)


def run(models: list[str], cards: list[int], setups: list[str]) -> None:
    rows, verdicts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            folder = os.path.join(tmp, name)
            os.makedirs(folder)
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(CONFIGS[name], f)
            for setup_name in setups:
                for card in cards:
                    result, seconds = probe(folder, card, SETUPS[setup_name])
                    rows.append([name, setup_name, f"{card} GiB", plan_text(result),
                                 size(result["predicted_peak_bytes"]), size(result["predicted_reserved_bytes"]),
                                 f"{seconds:.1f}"])
                    verdicts.append(f"{name}, {setup_name}, {card} GiB: {result.get('verdict')}")
                    print(" | ".join(str(c) for c in rows[-1]), flush=True)
    print()
    # The peaks are the chosen plan's, or the smallest plan's when none fits.
    print(table(["model", "fine-tune", "card", "plan chosen", "allocated peak", "reserved peak", "s/probe"],
                rows, align="llllrrr"))
    print()
    for line in verdicts:
        print(line)


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    parser.add_argument("--cards", default=",".join(map(str, CARDS)), help="GiB, comma-separated")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, of " + ", ".join(SETUPS))
    args = parser.parse_args()
    setup()
    print_environment("autofit probe on 7B-class configs (batch 4 x 512; fake tensors, no GPU)")
    run(args.models.split(","), [int(c) for c in args.cards.split(",")], args.setups.split(","))


if __name__ == "__main__":
    main_()
