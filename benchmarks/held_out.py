"""Held-out-style models on a simulated card: how close a cold run gets to the largest micro-batch that
fits, with how many OOMs, and whether a warm run makes any.

    python benchmarks/held_out.py [--steps 3] [--models ViT "BatchNorm CNN" ...]

Per model (built here from configs, random weights; a ViT, a recurrent LM, a GPT-2, a BatchNorm CNN,
a T5), on a simulated GPU capping reserved bytes (`caps="reserved"`) at half the whole batch's
estimated reserved peak, fp32 (precision "fp32": the sweep is of micro-batch sizes alone):
- sweep: the largest micro-batch m whose plan (fp32, no other move) runs `--steps` global batches
  (the first one makes the optimizer state) without running out of memory, each m on a fresh
  simulated GPU (a run may go past it with checkpointing or offload);
- cold: `autofit.run` with an empty plan cache: its last plan's micro-batch, its share of the sweep's
  and its OOM attempts;
- warm: the same run again with the cache the cold run left: its OOM attempts and its plan.
The issue's targets: cold >= 95% of the sweep with at most one OOM, warm with none.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from common import print_environment, setup, table

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autofit  # noqa: E402  (common put the checkout on sys.path)
from autofit.engine.batches import rows_of  # noqa: E402
from autofit.engine.step import StepRunner  # noqa: E402
from autofit.gpu.device import open_device  # noqa: E402
from autofit.plans.plan import Plan  # noqa: E402


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
        patch_size=4, num_labels=10))
    g = torch.Generator().manual_seed(3)
    return model, lambda: {"pixel_values": torch.randn(64, 3, 32, 32, generator=g),
                           "labels": torch.randint(0, 10, (64,), generator=g)}, None


class RecurrentLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.lstm = torch.nn.Embedding(2000, 64), torch.nn.LSTM(64, 128, batch_first=True)
        self.head = torch.nn.Linear(128, 2000)

    def forward(self, ids):
        return self.head(self.lstm(self.embed(ids))[0])


def lstm():
    g = torch.Generator().manual_seed(4)

    def loss(model, batch):
        return F.cross_entropy(model(batch[:, :-1]).reshape(-1, 2000), batch[:, 1:].reshape(-1))
    return RecurrentLM(), lambda: torch.randint(0, 2000, (32, 65), generator=g), loss


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=2000, n_positions=128))
    g = torch.Generator().manual_seed(5)

    def batch():
        ids = torch.randint(0, 2000, (16, 128), generator=g)
        return {"input_ids": ids, "labels": ids}
    return model, batch, None


def cnn():
    torch.manual_seed(0)

    def block(i, o):
        return [torch.nn.Conv2d(i, o, 3, padding=1), torch.nn.BatchNorm2d(o), torch.nn.ReLU()]
    model = torch.nn.Sequential(*block(3, 32), *block(32, 32), torch.nn.MaxPool2d(2), *block(32, 64),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    g = torch.Generator().manual_seed(6)

    def loss(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])
    return model, lambda: (torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)), loss


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2,
                                                num_heads=2, d_kv=32, vocab_size=2000, decoder_start_token_id=0,
                                                pad_token_id=0))
    g = torch.Generator().manual_seed(7)
    return model, lambda: {"input_ids": torch.randint(0, 2000, (16, 64), generator=g),
                           "labels": torch.randint(0, 2000, (16, 32), generator=g)}, None


CASES = {"ViT": vit, "recurrent LM": lstm, "GPT-2": gpt2, "BatchNorm CNN": cnn, "T5": t5}


def fits(build, data, micro: int, budget: int) -> bool:
    model, _, loss = build()
    with autofit.simulate_gpu(budget, caps="reserved"), open_device() as device:
        device.place_model(model)
        runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device, loss_fn=loss)
        try:
            for batch in data:
                runner.run(batch, Plan.for_batch(rows_of(batch), micro))
            return True
        except torch.OutOfMemoryError:
            runner.abandon()
            return False
        finally:
            runner.close()


def sweep(build, data, budget: int) -> int:
    rows = rows_of(data[0])
    return max((m for m in range(1, rows + 1) if fits(build, data, m, budget)), default=0)


def run(build, data, budget: int):
    model, _, loss = build()
    with autofit.simulate_gpu(budget, caps="reserved"):
        result = autofit.run(model, data, loss_fn=loss, precision="fp32", progress=False)
    return result.plan, sum(a.outcome == "oom" for a in result.attempts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", nargs="*", choices=list(CASES), default=list(CASES))
    args = parser.parse_args(argv)
    setup()
    print_environment("held_out.py: cold and warm runs against a sweep of micro-batch sizes")
    rows = []
    for name in args.models:
        build = CASES[name]
        os.environ["AUTOFIT_CACHE_DIR"] = tempfile.mkdtemp()
        model, batch, loss = build()
        data = [batch() for _ in range(args.steps)]
        whole = autofit.estimate(model, data[0], Plan(rows_of(data[0])), loss_fn=loss, device_type="cpu")
        budget = whole.reserved_bytes // 2
        best = sweep(build, data, budget)
        cold, cold_ooms = run(build, data, budget)
        warm, warm_ooms = run(build, data, budget)
        rows.append([name, rows_of(data[0]), f"{budget / 2**20:.0f}", best, cold.describe(),
                     f"{cold.micro_batch_size / best:.0%}", cold_ooms, warm.describe(), warm_ooms])
        print(" ", rows[-1], flush=True)  # as it goes: the table comes at the end
    print(table(["model", "rows", "budget MiB", "sweep", "cold", "cold/sweep", "cold OOMs", "warm",
                 "warm OOMs"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
