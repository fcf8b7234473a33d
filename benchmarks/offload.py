"""What optimizer offload saves on the device and costs in time, on a BERT-base-size model.

    python benchmarks/offload.py [--steps 2] [--rows 2] [--seq 32] [--layers 12]

A BERT-base-size classifier (hidden 768, 12 layers, vocab 30522: 110 M parameters), AdamW
(foreach, as CUDA runs it), fp32, on the simulated GPU (no budget), trained through `autofit.stepper`
twice: once on the device, once with the ladder forced to offload (an OOM injected at the first
allocation, `ladder=offload_optimizer()`). One warm-up step, then `--steps` measured steps; figures
are medians over the measured steps.

- device peak: the simulated GPU's peak of live bytes during one `step(batch)` (forward, backward
  and the optimizer step), and during `optimizer.step()` alone (its pre and post hooks);
- step time: the wall time of `step(batch)`, and of `optimizer.step()` alone (under offload that is
  the host update; staging the parameters and gradients to the host and writing them back, and the
  host snapshot of the state that guards an offloaded step, are in the step time, not in it);
- bytes moved: host <-> device bytes of one offloaded step (`Offload.bytes_moved`: values and
  gradient to the host, values back).

On the simulated GPU "host" and "device" are both this CPU: the copies cost memory bandwidth, not a
PCIe transfer, and the update runs at the same speed in both rows. On a card the device update is
far faster than the host's; the ratio here is a floor of what offload costs, not a forecast.
torch.set_num_threads(1), as every benchmark here.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import print_environment, setup, table

import torch  # noqa: E402

import autofit  # noqa: E402  (common put the checkout on sys.path)
from autofit.plans.ladder import offload_optimizer  # noqa: E402
from autofit.sizes import format_size  # noqa: E402


def build(layers: int, seq: int):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=layers, max_position_embeddings=max(seq, 512),
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def batches(n: int, rows: int, seq: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 30522, (rows, seq), generator=g),
             "labels": torch.randint(0, 2, (rows,), generator=g)} for _ in range(n)]


def measure(offload: bool, args) -> dict:
    model = build(args.layers, args.seq)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    data = batches(1 + args.steps, args.rows, args.seq)
    update, update_peak, steps, peaks, moved = [], [], [], [], []
    with autofit.simulate_gpu() as gpu:
        marks = {}

        def before(*_):
            marks["allocated"] = gpu.memory_allocated()
            marks["peak"] = gpu.max_memory_allocated()
            gpu.reset_peak_memory_stats()
            marks["t"] = time.perf_counter()

        def after(*_):
            update.append(time.perf_counter() - marks["t"])
            update_peak.append(gpu.max_memory_allocated())
        hooks = [opt.register_step_pre_hook(before), opt.register_step_post_hook(after)]
        ladder = offload_optimizer() if offload else (lambda plan: None)
        with autofit.stepper(model, opt, precision="fp32", ladder=ladder, cache=False) as step:
            if offload:
                gpu.fail_at(gpu.allocation_count)
            for i, batch in enumerate(data):
                update.clear(), update_peak.clear()
                gpu.reset_peak_memory_stats()
                start = time.perf_counter()
                out = step(batch)
                took = time.perf_counter() - start
                assert out.plan.offload_optimizer == offload, out.plan
                if i == 0:
                    continue  # warm-up (offloaded: its failed first attempt)
                steps.append(took)
                peaks.append(max(gpu.max_memory_allocated(), marks["peak"]))
                offloaded = step._training.runner.offloaded
                moved.append(offloaded.bytes_moved if offloaded is not None else 0)
                last_update, last_update_peak = update[-1], update_peak[-1]
        for h in hooks:
            h.remove()
    return {"params": params, "step": statistics.median(steps), "peak": statistics.median(peaks),
            "update": last_update, "update_peak": last_update_peak, "moved": statistics.median(moved)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args(argv)
    setup()
    print_environment("optimizer offload: device peak and step time")
    device, offloaded = measure(False, args), measure(True, args)
    print(f"BERT-base-size classifier ({args.layers} layers, {device['params'] / 1e6:.1f} M parameters), "
          f"batch {args.rows} x {args.seq}, AdamW foreach, fp32, simulated GPU; medians of {args.steps} steps\n")
    rows = []
    for name, r in (("on the device", device), ("offloaded", offloaded)):
        rows.append([name, format_size(r["peak"]), format_size(r["update_peak"]), f"{r['step']:.2f} s",
                     f"{r['update']:.2f} s", format_size(r["moved"])])
    rows.append(["offloaded / device", f"{offloaded['peak'] / device['peak']:.2f}",
                 f"{offloaded['update_peak'] / device['update_peak']:.2f}",
                 f"{offloaded['step'] / device['step']:.2f}", f"{offloaded['update'] / device['update']:.2f}", ""])
    print(table(["", "device peak (step)", "device peak (optimizer.step)", "step time",
                 "optimizer.step time", "bytes moved / step"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
