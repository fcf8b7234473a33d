"""The two user reports of shared/seeds/, reproduced: what failed, and what autofit chooses instead.

    python benchmarks/seeds.py          # about 1-2 minutes on 2 shared cores

Part 1, full size on fake tensors through the estimator (no GPU, no download, random weights):
  A. SciBERT (BERT-base: `BertConfig(vocab_size=31090)`, 110 M parameters), batch 10 x 512, AdamW
     lr 2e-5, on a 15 GiB card (14.75 GiB total as in the report, less a 0.4 GiB CUDA context).
     The report ran transformers' eager attention (its failing allocation, 120 MiB, is exactly one
     10 x 12 x 512 x 512 fp32 attention-score matrix), so the model is built with it.
  B. A language-model fine-tune in two phases on a 2 GiB card (less 0.4 GiB of context): GPT-2 at
     DistilGPT2's size (6 layers, 82 M parameters), batch 4 x 256, AdamW lr 1e-4 then a new AdamW
     lr 2e-6 with a linear warm-up schedule, as in the report's code.
  For each: the naive loop's predicted peak (the whole batch, fp32) against the budget, what autofit
  chooses (`autofit.estimator.capacity.rank`: the fastest plan predicted to fit within 90% of the budget) and
  the memory by kind at the predicted peak.
Part 2, small size with real compute on the simulated GPU (`autofit.simulate_gpu(budget)`: CPU
  tensors count against the budget and raise the real torch.OutOfMemoryError): the user's original
  loops failing, and the same jobs (same model, data, optimizer settings) running to the end under
  `autofit.run`, with every attempt printed.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time

import torch

from common import bert, cls_batches, gpt2, lm_batches, print_environment, setup, table

import autofit  # noqa: E402  (common put the checkout on sys.path)
from autofit.estimator.capacity import Fit, choose, make_estimator, needs_message, rank  # noqa: E402
from autofit.gpu.device import SimulatedDevice  # noqa: E402
from autofit.plans.plan import Plan  # noqa: E402
from autofit.sizes import format_size, parse_size  # noqa: E402
from autofit.engine.step import StepRunner  # noqa: E402

CONTEXT = parse_size("0.4GiB")  # the CUDA context: outside any tensor budget
# On a card the check compares the reserved peak, the card's cuBLAS workspaces included, with the
# budget (autofit.estimator.start.headroom on CUDA; a Hopper-class card's workspaces).
from autofit.gpu.workspaces import Workspaces  # noqa: E402
WORKSPACES = Workspaces.of_capability()
ON_CARD = {"caps": "reserved", "reserve": 0, "workspaces": WORKSPACES}
KINDS = ("params", "grads", "optimizer", "activations", "other")


def gib(n: int) -> str:
    return format_size(n)


def breakdown_row(what, plan, est, budget, note=""):
    b = est.breakdown
    return [what, plan, gib(est.peak_bytes)] + [gib(b[k]) for k in KINDS] + [
        "yes" if est.peak_bytes <= budget else "NO", note]


HEADERS = ["what", "plan", "peak", *KINDS, "fits", "note"]


# -- loss functions that make the estimator measure the users' loops ---------------------------------

def validation_without_no_grad(model, batch):
    """The report's validation loop, as a step the estimator can measure: `validation_output =
    model(...)` with autograd on keeps the previous batch's output (and its graph) alive while the
    next forward runs. Measured as one micro-batch of an accumulating plan, so the gradients of the
    last training step are allocated too, as they are in the report (model.zero_grad() comes at the
    start of the next training step)."""
    previous = model(**batch)
    current = model(**batch)
    del previous
    return current.loss


def inference_forward(model, batch):
    """autofit's evaluation forward: inference mode, no graph, no gradients."""
    with torch.inference_mode():
        loss = model(**batch).loss
    return torch.zeros((), requires_grad=True) + 0 * loss.clone()  # a leaf-free scalar to "backward"


def scibert_full():
    from transformers import BertConfig, BertForSequenceClassification
    print("Part 1A. SciBERT, batch 10 x 512, on a 15 GiB card (14.75 GiB total) -- estimator, fake "
          "tensors")
    config = BertConfig(vocab_size=31090)
    config._attn_implementation = "eager"  # as in the report (its 120 MiB allocation is one score matrix)
    with torch.device("meta"):
        model = BertForSequenceClassification(config)
    budget = parse_size("14.75GiB") - CONTEXT
    g = torch.Generator().manual_seed(0)
    rows, seq = 10, 512

    def batch(n):
        return {"input_ids": torch.randint(0, 31090, (n, seq), generator=g),
                "attention_mask": torch.ones(n, seq, dtype=torch.long),
                "labels": torch.randint(0, 2, (n,), generator=g)}

    optimizer = lambda p: torch.optim.AdamW(p, lr=2e-5, eps=1e-8)  # noqa: E731
    train = batch(rows)
    naive = autofit.estimate(model, train, Plan(rows), optimizer=optimizer)
    # two micro-batches of 10: the measured one runs on existing gradients (the last step's)
    validation = autofit.estimate(model, batch(2 * rows), Plan.for_batch(2 * rows, rows),
                                  optimizer=optimizer, loss_fn=validation_without_no_grad)
    started = time.perf_counter()
    candidates = rank(make_estimator(model, train, optimizer, workspaces=WORKSPACES), train, budget,
                      fit=Fit(**ON_CARD))
    chosen = choose(candidates)
    seconds = time.perf_counter() - started
    evaluation = autofit.estimate(model, batch(4 * rows), Plan(4 * rows), optimizer=optimizer,
                                  loss_fn=inference_forward)
    rows_ = [
        breakdown_row("naive training step (2nd iteration on)", Plan(rows).describe(), naive, budget),
        breakdown_row("naive validation (autograd on, no no_grad)", "batch 10", validation, budget,
                      "2 forward graphs + last step's grads"),
        breakdown_row("autofit training", chosen.plan.describe(), chosen.estimate, budget,
                      f"{len(candidates)} plan(s) estimated in {seconds:.1f} s"),
        breakdown_row("autofit evaluation (inference_mode)", "batch 40 (4x micro)", evaluation, budget,
                      "optimizer state still resident"),
    ]
    print(table(HEADERS, rows_))
    print(f"  budget: 14.75 GiB - {gib(CONTEXT)} CUDA context = {gib(budget)}; autofit plans the reserved "
          f"peak, {gib(WORKSPACES.resident)} of cuBLAS workspaces included, within it.")
    print(f"  autofit chose {chosen.plan.describe()}: {needs_message(candidates, budget, **ON_CARD)}")
    print(f"  why the report failed in validation, not training: without torch.no_grad() the loop "
          f"keeps two forward graphs (the previous output is alive while the next forward runs) and "
          f"the last step's gradients: {gib(validation.peak_bytes)} against {gib(naive.peak_bytes)} "
          f"for a training step. The report's failing allocation, 120.00 MiB, is exactly "
          f"10 x 12 x 512 x 512 x 4 bytes ({format_size(10 * 12 * 512 * 512 * 4)}): one attention-score "
          f"matrix of eager attention.")
    print(f"  autofit evaluates in torch.inference_mode() after freeing gradients (set to None after "
          f"every step), so 4x the training batch needs {gib(evaluation.peak_bytes)}; an OOM there "
          f"would halve the evaluation batch, never touch the training plan.")
    print()


def lm_two_phase_full():
    from transformers import GPT2Config, GPT2LMHeadModel
    print("Part 1B. LM fine-tune in two phases (GPT-2, DistilGPT2 size: 6 layers), batch 4 x 256, "
          "on a 2 GiB card -- estimator, fake tensors")
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=6))
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    budget = parse_size("2GiB") - CONTEXT
    g = torch.Generator().manual_seed(1)
    rows, seq = 4, 256
    ids = torch.randint(0, 50257, (rows, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    phase1 = lambda p: torch.optim.AdamW(p, lr=1e-4)  # noqa: E731
    phase2 = lambda p: torch.optim.AdamW(p, lr=2e-6)  # noqa: E731
    naive = autofit.estimate(model, batch, Plan(rows), optimizer=phase1)  # a 2nd iteration: state exists
    # A first iteration: forward/backward before AdamW has state (an optimizer without state
    # measures it), then the step that creates the state.
    stateless = autofit.estimate(model, batch, Plan(rows),
                                 optimizer=lambda p: torch.optim.SGD(p, lr=1e-4))
    first = max(stateless.peak_bytes, naive.step_bytes or 0)
    state = naive.resident["optimizer"]
    started = time.perf_counter()
    one = rank(make_estimator(model, batch, phase1, workspaces=WORKSPACES), batch, budget, fit=Fit(**ON_CARD))
    two = rank(make_estimator(model, batch, phase2, workspaces=WORKSPACES), batch, budget, fit=Fit(**ON_CARD))
    seconds = time.perf_counter() - started
    a, b = choose(one), choose(two)
    rows_ = [
        ["naive, 1st iteration (no AdamW state yet)", Plan(rows).describe(), gib(first)]
        + ["-"] * 5 + ["yes" if first <= budget else "NO", "max(fwd/bwd w/o state, 1st step)"],
        breakdown_row("naive, 2nd iteration on", Plan(rows).describe(), naive, budget),
        ["naive phase 2, phase 1's AdamW still alive", Plan(rows).describe(),
         gib(naive.peak_bytes + state)] + ["-"] * 5
        + ["yes" if naive.peak_bytes + state <= budget else "NO", f"+ {gib(state)} of phase-1 state"],
        breakdown_row("autofit phase 1 (AdamW lr 1e-4)", a.plan.describe(), a.estimate, budget),
        breakdown_row("autofit phase 2 (new AdamW lr 2e-6)", b.plan.describe(), b.estimate, budget,
                      f"{len(one) + len(two)} plans estimated in {seconds:.1f} s"),
    ]
    print(table(HEADERS, rows_))
    print(f"  model: {millions:.1f} M parameters; resident per plan (params, grads, AdamW state): "
          f"{', '.join(gib(naive.resident[k]) for k in ('params', 'grads', 'optimizer'))}; budget "
          f"2 GiB - {gib(CONTEXT)} context = {gib(budget)}.")
    print(f"  phase 1: {needs_message(one, budget, **ON_CARD)}")
    print(f"  phase 2: {needs_message(two, budget, **ON_CARD)}")
    print("  why the plain loop fails at its second iteration: AdamW allocates its two moments "
          f"({gib(state)}) at the first optimizer.step(), so from the second iteration on they sit "
          "next to the activations. autofit estimates a second iteration before training and runs "
          "phase 2 from the same clean memory as phase 1 (it drops its own optimizer's state when a "
          "run ends), so phase 2 gets the same plan.")
    print()


# -- part 2: real compute on the simulated GPU ---------------------------------------------------------

def second_step_peak(build, batch, plan, optimizer):
    """The peak of a real second step (the optimizer's state exists)."""
    model = build()
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        runner = StepRunner(model, optimizer(model.parameters()), device)
        runner.run(batch, plan)
        runner.run(batch, plan)
        return runner.attempt_peak()


def attempts_table(phases):
    """Every attempt; consecutive steps that kept the same plan with the same peak share a row."""
    rows_ = []
    for phase, result in phases:
        for a in result.attempts:
            row = [phase, str(a.step), a.plan.describe(), a.outcome, gib(a.peak_bytes), a.reason[:64]]
            last = rows_[-1] if rows_ else None
            if last is not None and last[0] == phase and last[2:] == row[2:] and row[5].startswith("kept"):
                last[1] = f"{last[1].split('-')[0]}-{a.step}"
                continue
            rows_.append(row)
        for e in result.eval_attempts:
            rows_.append([phase + " eval", f"batch {e.batch}", f"evaluation batch {e.batch_size}",
                          e.outcome, gib(e.peak_bytes), e.reason[:64]])
    return table(["run", "step", "plan", "outcome", "peak", "why this plan"], rows_)


def leaks_line(result) -> str:
    leaks = getattr(result, "leaks", None)
    if leaks is None:
        return "  leaks: (this build of autofit.run does not report leaks yet)"
    return "  leaks: " + ("none" if not leaks else "; ".join(f"{x['kind']}: {x['culprit']}" for x in leaks))


def scibert_small():
    print("Part 2A. SciBERT report at small size (BERT hidden 64, 2 layers, batch 10 x 128), real "
          "compute on the simulated GPU")
    build = lambda: bert(hidden=64, layers=2, seq=128, vocab=1000)  # noqa: E731
    train = cls_batches(4, rows=10, seq=128, seed=1)
    validation = cls_batches(4, rows=10, seq=128, seed=2)
    optimizer = lambda p: torch.optim.AdamW(p, lr=2e-5, eps=1e-8)  # noqa: E731
    budget = second_step_peak(build, train[0], Plan(10), optimizer) + (16 << 10)
    print(f"  budget {gib(budget)}: the measured peak of the report's training step (batch 10, "
          f"fp32, AdamW state present) + 16 KiB.")
    # The user's original loop, verbatim in spirit: no model.eval(), no torch.no_grad().
    model = build()
    failure = "ran to the end"
    with autofit.simulate_gpu(budget) as gpu:
        SimulatedDevice(gpu).place_model(model)
        optim = optimizer(model.parameters())
        where = "training"
        try:
            for epoch in range(2):
                epoch_losses, validation_loss = [], []
                where = f"epoch {epoch + 1} training"
                for i, batch in enumerate(train):
                    model.zero_grad()
                    out = model(**batch)
                    epoch_losses.append(out.loss.item())
                    out.loss.backward()
                    optim.step()
                for i, batch in enumerate(validation):
                    where = f"epoch {epoch + 1} validation batch {i}"
                    validation_output = model(**batch)
                    validation_loss.append(validation_output.loss.item())
        except torch.OutOfMemoryError as error:
            failure = f"torch.OutOfMemoryError in {where}: {str(error).splitlines()[0]}"
    print(f"  the user's loop: {failure}")
    del model, optim
    gc.collect()
    # The same job under autofit: same model, data and optimizer settings; no no_grad, no empty_cache.
    model = build()
    with autofit.simulate_gpu(budget) as gpu:
        result = autofit.run(model, train, eval_data=validation, epochs=2, optimizer=optimizer,
                             progress=False)
        held = gpu.memory_allocated()
    print(f"  autofit.run(model, train, eval_data=validation, epochs=2): ran to the end, "
          f"{len(result.history)} steps, {result.oom_attempts} OOM attempt(s); evaluation "
          f"{[(round(e['loss'], 4), e['batch_size']) for e in result.eval_history]} (loss, batch).")
    print(f"  after the run the simulated GPU holds {gib(held)} (the model's parameters and buffers).")
    exact = autofit.run(build(), train, eval_data=validation, epochs=2, optimizer=optimizer,
                        budget=budget, precision="fp32", progress=False)
    print(f"  with precision='fp32' (the user's numerics kept): {len(exact.history)} steps, "
          f"{exact.oom_attempts} OOM attempt(s), finished with {exact.plan.describe()}.")
    print(attempts_table([("auto", result), ("fp32", exact)]))
    print(leaks_line(result))
    print()


def users_two_phase_loop(model, train, epochs, record=None):
    """The report's code: pretrain with AdamW lr 1e-4, then a new AdamW lr 2e-6, each with a linear
    warm-up schedule; a plain loop (no accumulation, no AMP). `record(where)` after each iteration."""
    from transformers import get_linear_schedule_with_warmup
    steps_per_epoch = len(train)
    for phase, lr, warmup in (("pretraining", 1e-4, 1), ("training", 2e-6, 2)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=steps_per_epoch * warmup,
                                                    num_training_steps=steps_per_epoch * epochs)
        for epoch in range(epochs):
            model.train()
            for step, batch in enumerate(train):
                where = f"{phase}, epoch {epoch + 1}, iteration {step + 1}"
                try:
                    outputs = model(**batch)
                    loss = outputs.loss
                    loss.backward()
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                except torch.OutOfMemoryError as error:
                    return f"torch.OutOfMemoryError in {where}: {str(error).splitlines()[0]}"
                if record is not None:
                    record(where)
    return "ran to the end"


def lm_two_phase_small():
    from transformers import get_linear_schedule_with_warmup
    print("Part 2B. 2 GiB report at small size (GPT-2 hidden 64, 2 layers, vocab 1000, batch 8 x 64), "
          "two phases, real compute on the simulated GPU")
    build = lambda: gpt2(hidden=64, layers=2, seq=64, vocab=1000)  # noqa: E731
    train = lm_batches(4, rows=8, seq=64)
    steps_per_epoch, epochs = len(train), 2
    peaks = []
    with autofit.simulate_gpu() as gpu:  # the user's loop measured, without a budget
        model = build()
        SimulatedDevice(gpu).place_model(model)

        def record(where):
            peaks.append(gpu.max_memory_allocated())
            gpu.reset_peak_memory_stats()
        users_two_phase_loop(model, train, epochs, record)
    del model
    budget = (peaks[0] + peaks[1]) // 2
    print(f"  budget {gib(budget)}: between the measured peaks of the user's loop at its first "
          f"iteration ({gib(peaks[0])}, before AdamW has state) and its second ({gib(peaks[1])}).")
    model = build()
    with autofit.simulate_gpu(budget) as gpu:
        SimulatedDevice(gpu).place_model(model)
        failure = users_two_phase_loop(model, train, epochs)
    print(f"  the user's loop: {failure}")
    del model
    gc.collect()
    model = build()
    phases = []
    with autofit.simulate_gpu(budget) as gpu:
        for phase, lr, warmup in (("pretraining", 1e-4, 1), ("training", 2e-6, 2)):
            result = autofit.run(
                model, train, epochs=epochs, progress=False,
                optimizer=lambda p, lr=lr: torch.optim.AdamW(p, lr=lr),
                scheduler=lambda o, w=warmup: get_linear_schedule_with_warmup(
                    o, steps_per_epoch * w, steps_per_epoch * epochs))
            phases.append((phase, result))
            print(f"  autofit phase {phase!r}: {len(result.history)} steps to the end, "
                  f"{result.oom_attempts} OOM attempt(s), finished with {result.plan.describe()}; "
                  f"then the simulated GPU holds {gib(gpu.memory_allocated())} (parameters only).")
    print(attempts_table(phases))
    print(leaks_line(phases[-1][1]))
    print()


def leaks_small():
    """The answers' last suspicion: batches already on the GPU and tensors kept across steps."""
    from autofit.diagnosis.leaks import LeakWatch
    from autofit.recipes.run import RunResult
    print("Part 2C. The leaks the answers suspect (a DataLoader that put the data on the GPU; the loss "
          "kept without .item()), named by autofit (tiny BERT, 6 steps, simulated GPU)")
    kept = []

    def loss_fn(model, batch):
        loss = model(**batch).loss
        kept.append(loss)  # the bug: kept.append(loss.item())
        return loss

    build = lambda: bert(hidden=32, layers=1, seq=16, vocab=100)  # noqa: E731
    wired = "leaks" in getattr(RunResult, "__dataclass_fields__", {})
    with autofit.simulate_gpu() as gpu:
        data = cls_batches(6, rows=4, seq=16, vocab=100)  # made on the (simulated) device
        if wired:
            findings = autofit.run(build(), data, loss_fn=loss_fn, progress=False).leaks
            how = "autofit.run(...).leaks"
        else:  # drive the watch as autofit.run will, one StepRunner step at a time
            model = build()
            device = SimulatedDevice(gpu)
            device.place_model(model)
            runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device, loss_fn=loss_fn)
            watch = LeakWatch(runner)
            watch.check_batch(data[0], data)
            for step, batch in enumerate(data):
                runner.run(batch, Plan(4))
                watch.after_step(step, Plan(4), batch)
            findings = watch.findings
            how = "autofit.diagnosis.leaks.LeakWatch driven after each step (autofit.run does not wire it yet)"
    print(f"  {how}:")
    for f in findings:
        print(f"  - {f['kind']} ({gib(f['bytes'])}): {f['culprit']}")
        print(f"    fix: {f['fix']}")
    print()


def main() -> None:
    setup()
    os.environ["AUTOFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="autofit-seeds-")  # never the user's cache
    print_environment("benchmarks/seeds.py: the two user reports of shared/seeds/")
    started = time.perf_counter()
    scibert_full()
    lm_two_phase_full()
    scibert_small()
    lm_two_phase_small()
    leaks_small()
    print(f"total wall time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
