"""Check autofit's memory models against a real card: one command, under 5 minutes on one GPU.

    python benchmarks/gpu_check.py

With CUDA, for BERT-base and GPT-2 (built from their configs, random weights), fp32 and bf16,
checkpointing off and on, two batch sizes, two training steps each (AdamW):
- the estimator's predicted peak against `torch.cuda.max_memory_allocated()`;
- the caching-allocator model (autofit/gpu/allocator.py) replaying the step's own allocation trace
  (`torch.cuda.memory._record_memory_history`) against `torch.cuda.max_memory_reserved()`;
then a run that runs out of memory under a memory fraction, recovered by autofit, against the same
run on the simulated GPU (`caps="reserved"`): same final plan, same losses; and
`autofit probe --verify`. One table, ratios = model / real.

Without CUDA it runs the same table on small configs with the simulated GPU standing in for the
card (real CPU tensors, `caps="reserved"`), and says what it skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time

import torch
from common import print_environment, setup, table

import autofit
from autofit.gpu.allocator import CachingAllocator
from autofit.gpu.device import CudaDevice, SimulatedDevice
from autofit.plans.plan import Plan
from autofit.sizes import format_size
from autofit.engine.step import StepRunner

MiB = 2**20


def configs(cuda: bool):
    """(name, model factory, batch factory, two batch sizes) per model."""
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
    seq, vocab = (256, None) if cuda else (32, 1000)
    small = {} if cuda else {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                             "intermediate_size": 256, "vocab_size": vocab}
    small_gpt = {} if cuda else {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": vocab}

    def bert():
        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(**small))

    def gpt2():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(**small_gpt))

    def bert_batch(rows):
        v = vocab or BertConfig().vocab_size
        g = torch.Generator().manual_seed(1)
        return {"input_ids": torch.randint(0, v, (rows, seq), generator=g),
                "attention_mask": torch.ones(rows, seq, dtype=torch.long),
                "labels": torch.randint(0, 2, (rows,), generator=g)}

    def gpt_batch(rows):
        v = vocab or GPT2Config().vocab_size
        ids = torch.randint(0, v, (rows, seq), generator=torch.Generator().manual_seed(2))
        return {"input_ids": ids, "labels": ids.clone()}

    name = "" if cuda else " (small)"
    return [(f"BERT-base{name}", bert, bert_batch, (8, 16)),
            (f"GPT-2{name}", gpt2, gpt_batch, (4, 8))]


def replay(trace) -> int:
    """The reserved peak of the allocator model replaying a CUDA allocation trace."""
    allocator, blocks = CachingAllocator(), {}
    for event in trace:
        if event["action"] == "alloc":
            blocks[event["addr"]] = allocator.malloc(event["size"], enforce=False)
        elif event["action"] == "free_completed" and event["addr"] in blocks:
            allocator.free(blocks.pop(event["addr"]))
    return allocator.max_reserved


def two_steps(build, batch, plan, cuda: bool):
    """(peak allocated, peak reserved, the model's replayed reserved peak or None) of two steps."""
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(context=None, max_entries=1_000_000,
                                                  clear_history=True)
        context = contextlib.nullcontext(None)
    else:
        context = autofit.simulate_gpu(caps="reserved")
    with context as gpu:
        device = CudaDevice(torch.cuda.current_device()) if cuda else SimulatedDevice(gpu)
        # The step resets the peaks around optimizer.step() (for its own diagnostics); here the
        # peaks must span both steps, as the estimate does.
        device.reset_peak_memory_stats = lambda: None
        model = build()
        device.place_model(model)
        optimizer = torch.optim.AdamW(model.parameters())
        runner = StepRunner(model, optimizer, device)
        runner.prepare(plan)
        try:
            for _ in range(2):
                runner.run(device.to_device(batch), plan)
        finally:
            runner.close()
        allocated, reserved = device.max_memory_allocated(), device.max_memory_reserved()
        del model, optimizer, runner
    replayed = None
    if cuda:
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        torch.cuda.memory._record_memory_history(enabled=None)
        replayed = replay(trace)
    return allocated, reserved, replayed


def card_workspaces(cuda: bool):
    """The card's cuBLAS/cuBLASLt workspaces the estimate adds (autofit.gpu.workspaces); none for the
    simulated stand-in, which holds none."""
    from autofit.gpu.workspaces import Workspaces
    return Workspaces.of_capability(torch.cuda.get_device_capability()) if cuda else None


def measured_workspaces() -> tuple[int, int]:
    """Bytes allocated beyond the tensors after a first matrix product's forward, then its backward
    (the forward thread's and autograd's device thread's workspaces); run before any other kernel."""
    x = torch.ones(64, 64, device="cuda", requires_grad=True)
    tensors = torch.cuda.memory_allocated()
    y = x @ x
    forward = torch.cuda.memory_allocated() - tensors - y.untyped_storage().nbytes()
    y.sum().backward()
    del y
    backward = torch.cuda.memory_allocated() - tensors - x.grad.untyped_storage().nbytes()
    return forward, backward


def ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def failed(error: BaseException) -> str:
    """A row's or a section's error, in one cell: the check goes on with the next one."""
    return f"FAILED {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"


def memory_row(build, batch, plan, cuda: bool) -> list:
    predicted = autofit.estimate(build(), batch, plan, workspaces=card_workspaces(cuda)).peak_bytes
    allocated, reserved, replayed = two_steps(build, batch, plan, cuda)
    return [mib(predicted), mib(allocated), ratio(predicted, allocated),
            mib(reserved), mib(replayed), ratio(replayed, reserved)]


def memory_table(cuda: bool) -> list[list]:
    rows = []
    for name, build, make_batch, sizes in configs(cuda):
        for precision in ("fp32", "bf16"):
            for checkpointing in (False, True):
                for size in sizes:
                    plan = Plan(size, precision=precision, checkpointing=checkpointing)
                    try:
                        cells = memory_row(build, make_batch(size), plan, cuda)
                    except Exception as error:  # noqa: BLE001  (each row's error is reported in its row)
                        cells = [failed(error)] + [""] * 5
                    rows.append([name, precision, "on" if checkpointing else "off", size, *cells])
    return rows


def recovery(cuda: bool) -> list[str]:
    """A run whose global batch does not fit, on the card and on the simulated GPU alike."""
    from common import bert, cls_batches
    build = lambda: bert(hidden=256, layers=4, seq=128, vocab=1000)  # noqa: E731
    batches = cls_batches(3, rows=32, seq=128, vocab=1000)
    budget = int(autofit.estimate(build(), batches[0], Plan(32)).peak_bytes * 0.6)
    results = {}
    kinds = ["simulated"] + (["cuda"] if cuda else [])
    for kind in kinds:
        quiet = contextlib.redirect_stderr(io.StringIO())
        context = autofit.simulate_gpu(budget, caps="reserved") if kind == "simulated" \
            else contextlib.nullcontext()
        with quiet, context:
            result = autofit.run(build(), batches, budget=None if kind == "simulated" else budget,
                                 precision="fp32", progress=False, cache=False)
        results[kind] = result
    sim = results["simulated"]
    line = [f"OOM recovery under {format_size(budget)}: simulated GPU final plan "
            f"{sim.plan.describe()}, {sim.oom_attempts} OOM attempt(s)"]
    if cuda:
        real = results["cuda"]
        diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(sim.history, real.history))
        line.append(f"  CUDA final plan {real.plan.describe()}, {real.oom_attempts} OOM attempt(s); "
                    f"same plan: {real.plan == sim.plan}; max loss diff {diff:.2e}")
    return line


def probe_verify(cuda: bool) -> list[str]:
    if not cuda:
        return []
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = autofit.cli.main(["probe", "--gpu-mem", str(total), "--verify"])
    return [f"autofit probe --gpu-mem {format_size(total)} --verify: exit {code}",
            *("  " + line for line in out.getvalue().splitlines()[-6:])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    setup()
    import autofit.cli  # noqa: F401  (probe_verify calls it)
    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    print_environment("autofit GPU check")
    if cuda:
        forward, backward = measured_workspaces()
        expected = card_workspaces(True)
        print(f"workspaces measured: {forward / MiB:.3f} MiB after a first forward, {backward / MiB:.3f} MiB "
              f"after its backward (autofit.gpu.workspaces expects {(expected.cublas + expected.cublaslt) / MiB:.3f} "
              f"and {expected.resident / MiB:.3f})\n")
    if not cuda:
        print("No CUDA device: small configs, the simulated GPU (caps='reserved') stands in for the "
              "card.\nSkipped: real max_memory_allocated/max_memory_reserved, the replay of a real "
              "allocation trace, the OOM recovery on a card, `autofit probe --verify`.\n")
    headers = ["model", "precision", "ckpt", "batch", "estimate MiB", "allocated MiB",
               "est/alloc", "reserved MiB", "replayed MiB", "replay/res"]
    print(table(headers, memory_table(cuda)))
    print("allocated/reserved: " + ("torch.cuda's peaks over two steps" if cuda else
                                    "the simulated GPU's peaks over two steps (CPU tensors)"))
    for section in (recovery, probe_verify):
        try:
            lines = section(cuda)
        except Exception as error:  # noqa: BLE001  (a failed section is reported, the next one runs)
            lines = [f"{section.__name__}: {failed(error)}"]
        for line in lines:
            print(line)
    print(f"\ntotal wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
