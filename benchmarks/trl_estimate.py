"""TRL's SFTTrainer: the capacity check's prediction against the measured peak, plan by plan, and
what `fit_trainer` picks at a 40 MiB budget with SFTConfig's defaults (bf16 and checkpointing on)
and with both off.

A tiny random-init Llama (hidden 64, 2 layers, vocabulary 100), 32 rows of 8-33 token ids, a
word-level tokenizer built here (nothing downloaded), 16 rows per optimizer step. Predicted: the
estimator as the Trainer integration runs it (the Trainer's own compute_loss on fake tensors, this
CPU's kernels); measured: the simulated GPU's peak over two real steps of `trainer.train()`.

    python benchmarks/trl_estimate.py     # about 2 minutes on 2 shared cores
"""

from __future__ import annotations

import tempfile

import torch

from common import print_environment, setup, table

import autofit  # noqa: E402
from autofit.integrations import hf_trainer as hf  # noqa: E402
from autofit.integrations.transformers import fit_trainer  # noqa: E402
from autofit.sizes import format_size  # noqa: E402

VOCAB, LONGEST, ROWS, STEP = 100, 33, 32, 16
PLANS = [(16, 1, "fp32", False), (8, 2, "fp32", False), (16, 1, "bf16", False), (16, 1, "bf16", True),
         (8, 2, "bf16", True)]


def sft(out, per, accum, **flags):
    import datasets
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token=f"t{VOCAB - 2}",
                                        eos_token=f"t{VOCAB - 1}")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB - 3, (ROWS, LONGEST), generator=g).tolist()
    lengths = torch.randint(LONGEST // 4, LONGEST + 1, (ROWS,), generator=g).tolist()
    data = datasets.Dataset.from_dict({"input_ids": [r[:n] for r, n in zip(ids, lengths)]})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                         max_position_embeddings=64, bos_token_id=VOCAB - 1,
                                         eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2))
    args = SFTConfig(output_dir=out, per_device_train_batch_size=per, gradient_accumulation_steps=accum,
                     max_steps=2, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                     **flags)
    return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)


def main() -> None:
    setup()
    print_environment("TRL SFTTrainer: predicted vs measured peak per plan, and the fit at 40 MiB")
    out = tempfile.mkdtemp()
    rows = []
    for per, accum, precision, checkpointing in PLANS:
        plan = autofit.Plan(per, accum, precision=precision, checkpointing=checkpointing)
        source = sft(out, STEP, 1, bf16=False, gradient_checkpointing=False)
        predicted = autofit.estimate(source.model, hf.sample_batch(source, STEP), plan,
                                     optimizer=hf._optimizer(source), loss_fn=hf._loss_fn(source),
                                     device_type="cpu").peak_bytes
        trainer = sft(out, per, accum, bf16=precision == "bf16", gradient_checkpointing=checkpointing)
        with autofit.simulate_gpu("4GiB") as gpu:
            gpu.track(list(trainer.model.parameters()))
            trainer.train()
            measured = gpu.max_memory_allocated()
        rows.append([plan.describe(), format_size(predicted), format_size(measured),
                     f"{(predicted - measured) / measured:+.1%}"])
    print(table(["plan", "predicted", "measured", "error"], rows, align="lrrr"))
    print()
    fits = []
    for name, flags in (("SFTConfig defaults (bf16, checkpointing on)", {}),
                        ("bf16=False, gradient_checkpointing=False", dict(bf16=False, gradient_checkpointing=False))):
        fitted = fit_trainer(sft(out, STEP, 1, **flags), budget="40MiB")
        fits.append([name, fitted.plan.describe(), format_size(fitted.predicted_peak)])
    print(table(["arguments", "fit at 40 MiB (precision='auto')", "fit's quoted peak"], fits, align="llr"))


if __name__ == "__main__":
    main()
