"""autofit against the ways people make training fit today, side by side, in one run.

    python benchmarks/peers.py [--steps 4] [--global-batch 32] [--seq 64] [--hidden 64] [--no-injected]
                               [--models bert,gpt2,vit,bart] [--methods autofit,Lightning]

Every method trains the same tiny model from the same initial weights on the same global batches,
on the same simulated GPU (`autofit.simulate_gpu(budget)`: CPU tensors count against the budget and
raise the real `torch.OutOfMemoryError`, message "CUDA out of memory. ..."). Budgets are chosen per
model from measured peaks so that the full global batch does not fit and stepping down is needed.

Methods (each builds its model at its own start; the clock starts before that build):
- autofit cold: `autofit.run` with a fresh, empty plan cache (AUTOFIT_CACHE_DIR) and its defaults:
  the capacity check where autofit has one (start from the fastest plan an estimate predicts to
  fit), the default ladder, precision="auto" (micro-batch down to 8, then bf16, then checkpointing,
  then smaller, then optimizer offload).
- autofit cached: the same call again with the same cache directory.
- autofit cold, fp32: `precision="fp32"` (the ladder never changes the numerics).
- autofit cold, capacity_check=False (when autofit.run has that option): no fake-tensor estimate
  before the first step; the run starts from the whole global batch and the ladder finds the plan.
- Accelerate find_executable_batch_size: the real `accelerate.utils.find_executable_batch_size`,
  used as its docs show: the inner function builds the model and optimizer and trains an epoch over
  the data with the batch size it is given; on OOM the decorator shrinks the batch (accelerate 1.15:
  x0.9, earlier releases halved) and calls it again from scratch.
- Lightning BatchSizeFinder (algorithm re-implemented, from before Lightning was installed here): mode
  "binsearch" (double from init_val=2 until an OOM, then binary search between the last success and
  the first failure), steps_per_trial=3, max_trials=25, model and optimizer restored from a host
  checkpoint after the search, then one epoch over the data at the batch size found.
- Lightning BatchSizeFinder (lightning's own callback, when lightning is installed): the same settings
  on `lightning.pytorch.callbacks.BatchSizeFinder`, the model wrapped in a LightningModule whose
  training_step returns its loss and whose DataLoader reads `self.batch_size`; `trainer.fit` runs the
  search (its checkpoint a file in a temporary folder), then one epoch at the batch size found.
- Composer-style auto microbatching (re-implemented): device_train_microbatch_size="auto": start with
  the micro-batch = the global batch, halve it on OOM (zero_grad, retry the same global batch),
  micro-batch losses weighted by label tokens (accumulate_train_batch_on_tokens=True, its best mode).
  Like Composer, the OOM is caught around the whole step, optimizer.step() included.
- fixed batch: a plain loop at the full global batch; fails when it does not fit.

Models (random init from transformers configs, dropout 0): BERT sequence classification and GPT-2
causal LM (as the tests use), and two the repo uses nowhere else: a ViT image classifier (32x32
images, 8x8 patches: 17 tokens) and a BART encoder-decoder (token loss over labels with padding).
Table 2 also gives each method's peak allocated and peak *reserved* bytes: the simulated GPU runs
every storage through its model of CUDA's caching allocator, so "reserved" is what a card's
`torch.cuda.max_memory_reserved()` would report for the same allocations (peaks are kept across the
resets autofit makes between attempts).

All optimizers are AdamW(lr=1e-3, foreach=True) (what CUDA would run). torch.set_num_threads(1).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import os
import tempfile
import time

import torch

from common import (StepClock, adamw, bert, cls_batches, concat, gpt2, is_causal_lm, label_tokens,
                    lm_batches, max_abs_diff, plain_step, print_environment, reference, rows,
                    setup, simulated_copy, split, table, take)

import autofit  # noqa: E402  (common put the checkout on sys.path)

TOLERANCE = 1e-4
TARGETS = (0.6, 0.3, 0.15)  # budgets aim at a largest fitting micro-batch of these shares of the batch


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def is_oom_message(error: BaseException) -> bool:
    """What the peers check (Lightning's is_oom_error, Composer's _is_cuda_oom): a RuntimeError
    whose message says CUDA ran out of memory."""
    return isinstance(error, RuntimeError) and "CUDA out of memory" in str(error)


# -- the harness ---------------------------------------------------------------------------------

class Job:
    """One model and its data; builds fresh models with the same initial weights."""

    def __init__(self, name, build, batches):
        self.name, self.build, self.batches = name, build, batches
        self.global_batch = rows(batches[0])
        self.data = concat(batches)  # made here, on the host: peers that rebatch slice from it

    def __repr__(self):
        return self.name


class Run:
    """What one method did; filled by the method and the harness."""

    def __init__(self):
        self.ooms = 0
        self.first_step = None      # seconds from the start to the first optimizer step that was kept
        self.micro = None           # the micro-batch the method finished with
        self.effective = None       # the batch one optimizer step saw at the end
        self.plan = ""              # precision / checkpointing etc., or what the method changed
        self.model = None
        self.error = ""
        self.peak_allocated = None  # the simulated GPU's peaks over the whole method
        self.peak_reserved = None


def counted_bytes(gpu, tensors) -> int:
    """Simulated-GPU bytes of these tensors' storages, each storage once, 512-byte rounded."""
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and gpu.holds(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(-(-n // 512) * 512 for n in storages.values())


def state_tensors(optimizer):
    return [v for entry in optimizer.state.values() for v in entry.values()
            if isinstance(v, torch.Tensor)]


class RetryProbe:
    """Watches one run on the simulated GPU: every OOM it raises (and whether autograd's backward
    was running), and at the first model forward after each OOM, the device bytes held beyond the
    weights, the live optimizer's state and that forward's inputs: what the failed attempt left
    behind when the retry starts (stale .grad, activations pinned by frames or by autograd's queue).

    It wraps the simulated GPU's private `_oom` (the one place that builds its OOM error); without
    that attribute the probe records nothing and the columns read "-"."""

    def __init__(self, gpu, clock, inject_at: int | None = None):
        self.gpu, self.clock = gpu, clock
        self.inject_at = inject_at  # allocations after backward reaches the loss; None: no fault
        self.ooms = self.backward_ooms = 0
        self.pending = False
        self.held_at_retry: list[tuple[int, int]] = []  # (bytes held, of which .grad)
        self.peaks = (0, 0)  # (allocated, reserved) maxima before each reset of the GPU's peaks
        reset = gpu.reset_peak_memory_stats

        def keep_peaks_then_reset():
            self.peaks = self.peak()
            reset()
        gpu.reset_peak_memory_stats = keep_peaks_then_reset
        self.works = hasattr(gpu, "_oom")
        if self.works:
            raise_oom = gpu._oom

            def oom(*args, **kwargs):
                self.ooms += 1
                self.backward_ooms += torch._C._current_autograd_node() is not None
                self.pending = True
                return raise_oom(*args, **kwargs)
            gpu._oom = oom

    def peak(self) -> tuple[int, int]:
        """The most bytes allocated and reserved since the probe started."""
        return (max(self.peaks[0], self.gpu.max_memory_allocated()),
                max(self.peaks[1], self.gpu.max_memory_reserved()))

    def watch(self, model) -> None:
        def after_forward(module, args, kwargs, output):
            loss = getattr(output, "loss", None)
            if self.inject_at is None or loss is None or not loss.requires_grad:
                return
            k, self.inject_at = self.inject_at, None  # the first backward of the run gets the fault

            def arm(_grad):
                self.gpu.fail_at(self.gpu.allocation_count + k)
            loss.register_hook(arm)

        def before_forward(module, args, kwargs):
            if not self.pending:
                return
            self.pending = False
            opt = self.clock.optimizer
            legit = counted_bytes(self.gpu, list(module.parameters()) + list(module.buffers()))
            legit += counted_bytes(self.gpu, state_tensors(opt)) if opt is not None else 0
            legit += counted_bytes(self.gpu, list(args) + list(kwargs.values()))
            grads = counted_bytes(self.gpu, [p.grad for p in module.parameters()])
            self.held_at_retry.append((self.gpu.memory_allocated() - legit, grads))
        model.register_forward_pre_hook(before_forward, with_kwargs=True)
        model.register_forward_hook(after_forward, with_kwargs=True)


def run_method(method, job, budget, inject_at=None, **kwargs) -> Run:
    """Run `method(job, make_model, clock, run)` on a simulated GPU of `budget` bytes; measure the
    time to the first kept step, what a failed attempt leaves held when the retry starts, and the
    device memory still held when the method has returned."""
    run = Run()
    clock = StepClock()
    holder = {}

    with autofit.simulate_gpu(budget) as gpu:
        probe = RetryProbe(gpu, clock, inject_at)

        def make_model():
            holder.pop("model", None)  # the previous one dies first, as it would in the user's frame
            model = job.build()
            model.train()
            probe.watch(model)
            holder["model"] = model
            return model

        start = time.perf_counter()
        failure = None
        try:
            method(job, make_model, clock, run, **kwargs)
        except Exception as error:
            if not is_oom_message(error):
                raise
            failure = str(error).splitlines()[0][:60]
        if failure is not None:
            run.error = failure
        # A kept step is one whose update survives: methods that restart clear the clock.
        run.first_step = clock.times[0] - start if clock.times else None
        model = holder.get("model")
        run.model = model
        weights = counted_bytes(gpu, list(model.parameters()) + list(model.buffers())) if model is not None else 0
        run.held = gpu.memory_allocated() - weights
        gc.collect()
        run.held_gc = gpu.memory_allocated() - weights
        run.held_grads = counted_bytes(gpu, [p.grad for p in model.parameters()]) if model is not None else 0
        run.device_ooms = probe.ooms if probe.works else None
        run.backward_ooms = probe.backward_ooms if probe.works else None
        run.held_at_retry, run.grads_at_retry = max(probe.held_at_retry, default=(None, None))
        run.peak_allocated, run.peak_reserved = probe.peak()
        gpu.fail_at(None)
        del model, probe
    return run


# -- the methods -----------------------------------------------------------------------------------

def autofit_run(job, make_model, clock, run, precision="auto", **options):
    model = make_model()
    result = autofit.run(model, job.batches, precision=precision, progress=False,
                         optimizer=lambda params: clock.attach(adamw(params, foreach=True)),
                         **options)
    run.ooms = result.oom_attempts
    run.micro = result.plan.micro_batch_size
    run.effective = job.global_batch
    run.plan = result.plan.describe().split(", ", 1)[1]


def accelerate_feb(job, make_model, clock, run):
    from accelerate.utils import find_executable_batch_size

    data, n = job.data, rows(job.data)
    tried = []

    @find_executable_batch_size(starting_batch_size=job.global_batch)
    def train(batch_size):
        tried.append(batch_size)
        clock.times.clear()  # a restart throws away the steps before it
        model = make_model()
        optimizer = clock.attach(adamw(model.parameters(), foreach=True))
        for i in range(0, n, batch_size):
            plain_step(model, optimizer, take(data, i, i + batch_size), to_device=simulated_copy)
        return batch_size

    try:
        final = train()
    finally:
        run.ooms = len(tried) - 1
    run.micro = run.effective = final
    run.plan = f"batch {job.global_batch} -> {final}, {-(-n // final)} steps"


def lightning_bsf(job, make_model, clock, run, init_val=2, steps_per_trial=3, max_trials=25):
    data, n = job.data, rows(job.data)
    model = make_model()
    optimizer = clock.attach(adamw(model.parameters(), foreach=True))
    gpu = autofit.gpu.simulate.active_gpu()
    with torch.no_grad(), gpu.untracked():  # Lightning saves a checkpoint file: host memory
        saved_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
        saved_opt = optimizer.state_dict()

    def gc_cuda():  # lightning.pytorch.utilities.memory.garbage_collection_cuda
        gc.collect()

    def trial(size):
        """Lightning's fit loop for steps_per_trial steps: forward, zero_grad, backward, step."""
        cursor = 0
        for _ in range(steps_per_trial):
            batch = take(data, cursor, min(cursor + size, n))
            cursor = 0 if cursor + size >= n else cursor + size
            part = simulated_copy(batch)
            loss = model(**part).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            del loss, part

    def adjust(value):  # _adjust_batch_size, capped at the dataset length as Lightning does
        return min(value, n)

    # _run_binary_scaling
    new_size = adjust(init_val)
    low, high, count = 1, None, 0
    while True:
        gc_cuda()
        try:
            trial(new_size)
            count += 1
            if count > max_trials:
                break
            low = new_size
            if high:
                if high - low <= 1:
                    break
                changed_to = adjust((high + low) // 2)
            else:
                changed_to = adjust(new_size * 2)
            if changed_to == new_size:
                break
            new_size = changed_to
        except RuntimeError as exception:
            if is_oom_message(exception):
                run.ooms += 1
                gc_cuda()  # inside the except block, as Lightning does
                high = new_size
                new_size = adjust((high + low) // 2)
                if high - low <= 1:
                    break
            else:
                raise
    gc_cuda()
    with torch.no_grad():  # restore the checkpoint taken before the search
        model.load_state_dict(saved_model)
        optimizer.load_state_dict(saved_opt)
    optimizer.zero_grad(set_to_none=True)
    del saved_model, saved_opt
    clock.times.clear()  # the search's steps were undone
    for i in range(0, n, new_size):  # trainer.fit at the batch size found
        batch = simulated_copy(take(data, i, i + new_size))
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        del loss, batch
    optimizer.zero_grad(set_to_none=True)
    run.micro = run.effective = new_size
    run.plan = f"batch {job.global_batch} -> {new_size}, {-(-n // new_size)} steps"


def lightning_real_bsf(job, make_model, clock, run, init_val=2, steps_per_trial=3, max_trials=25):
    """Lightning's own BatchSizeFinder callback (mode "binsearch", the re-implementation's settings)
    on a LightningModule wrapping the model: the search runs at fit start, restores the model and
    optimizer from its checkpoint file, then the Trainer fits one epoch at the batch size found."""
    import logging

    import lightning.pytorch as L

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # its notes on each restore and stop
    data, n = job.data, rows(job.data)
    samples = [{k: v[i] for k, v in data.items()} for i in range(n)]  # views: no allocation
    gpu = autofit.gpu.simulate.active_gpu()
    ooms = []
    raise_oom = gpu._oom  # the simulated GPU's one place that builds its OOM (as RetryProbe wraps it)

    def counted(*args, **kwargs):
        ooms.append(1)
        return raise_oom(*args, **kwargs)
    gpu._oom = counted

    class Wrapped(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make_model()
            self.batch_size = init_val  # what BatchSizeFinder scales

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return clock.attach(adamw(self.model.parameters(), foreach=True))

        def train_dataloader(self):
            return torch.utils.data.DataLoader(samples, batch_size=self.batch_size, shuffle=False)

    class FitStarts(L.Callback):
        def on_train_start(self, trainer, module):  # after the search: its steps were undone
            clock.times.clear()

    finder = L.callbacks.BatchSizeFinder(mode="binsearch", steps_per_trial=steps_per_trial, init_val=init_val,
                                         max_trials=max_trials)
    module = Wrapped()
    with tempfile.TemporaryDirectory(prefix="autofit-peers-lightning-") as root:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision="32-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, default_root_dir=root, callbacks=[finder, FitStarts()])
        try:
            trainer.fit(module)
        finally:
            gpu._oom = raise_oom
            run.ooms = len(ooms)
    module.model.zero_grad(set_to_none=True)
    found = finder.optimal_batch_size
    run.micro = run.effective = found
    run.plan = f"batch {job.global_batch} -> {found}, {-(-n // found)} steps"


def composer_auto(job, make_model, clock, run):
    model = make_model()
    optimizer = clock.attach(adamw(model.parameters(), foreach=True))
    causal = is_causal_lm(model)
    micro = job.global_batch  # "auto" starts at the device batch size
    for batch in job.batches:
        while True:
            oom = False
            try:
                optimizer.zero_grad(set_to_none=True)
                parts = split(batch, micro)
                total = label_tokens(batch, causal) if batch["labels"].dim() >= 2 else rows(batch)
                for part in parts:
                    share = (label_tokens(part, causal) if batch["labels"].dim() >= 2
                             else rows(part)) / total
                    part = simulated_copy(part)
                    (model(**part).loss * share).backward()
                    del part
                optimizer.step()
            except RuntimeError as error:
                if not is_oom_message(error):
                    raise
                oom = True
            if not oom:
                break
            # _adjust_device_train_microbatch_size, after the except block
            run.ooms += 1
            if micro == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. The train loop failed with an "
                                             "internal microbatch of size 1.")
            micro = max(micro // 2, 1)
            optimizer.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    run.micro = micro
    run.effective = job.global_batch
    run.plan = f"micro {micro} x {-(-job.global_batch // micro)}, fp32"


def fixed_batch(job, make_model, clock, run):
    model = make_model()
    optimizer = clock.attach(adamw(model.parameters(), foreach=True))
    run.micro = run.effective = job.global_batch
    run.plan = f"micro {job.global_batch} x 1, fp32"
    try:
        for batch in job.batches:
            plain_step(model, optimizer, batch, to_device=simulated_copy)
    except torch.OutOfMemoryError:
        run.ooms += 1
        raise


# -- budgets and the largest micro-batch that fits -------------------------------------------------

def plain_fits(job, budget, micro) -> tuple[bool, int]:
    """Two plain global steps (the second has optimizer state) at this micro-batch; (fits, peak)."""
    with autofit.simulate_gpu(budget) as gpu:
        model = job.build()
        model.train()
        optimizer = adamw(model.parameters(), foreach=True)
        ok = True
        try:
            for batch in job.batches[:2]:
                plain_step(model, optimizer, batch, micro, to_device=simulated_copy)
        except torch.OutOfMemoryError:
            ok = False
        peak = gpu.max_memory_allocated()
        del model, optimizer
    gc.collect()
    return ok, peak


def largest_fitting_micro(job, budget) -> int:
    """Binary search with the plain step (memory grows with the micro-batch); 0 when none fits."""
    low, high = 0, job.global_batch + 1  # low fits (0: trivially), high does not
    while high - low > 1:
        mid = (low + high) // 2
        if plain_fits(job, budget, mid)[0]:
            low = mid
        else:
            high = mid
    return low


def budgets_for(job) -> tuple[list[int], dict]:
    """Budgets whose largest fitting fp32 micro-batch is about TARGETS of the global batch, from the
    measured peaks of the plain step at a quarter of the batch and at the full batch."""
    g = job.global_batch
    _, quarter = plain_fits(job, None, g // 4)
    _, full = plain_fits(job, None, g)
    slope = (full - quarter) / (g - g // 4)
    base = full - slope * g
    budgets = [int(base + slope * (t * g + 0.5)) // 4096 * 4096 for t in TARGETS]
    return budgets, {"full": full, "quarter": quarter}


def retaining_fault_index(job, rows_=2, run_length=4) -> tuple[int, int]:
    """An allocation index, counted from the moment backward reaches the loss (a hook on the loss
    tensor), at which an OOM leaves memory held after the exception is gone (torch 2.13: autograd's
    engine keeps the failed graph's queued nodes until the next backward on the device). Counting
    from the loss makes the point the same for every method, whatever it does before backward (a
    loss weight adds a node). The index of an op does not depend on the batch size, so a 2-row
    batch finds it cheaply. Returns (index, bytes held there for the 2-row batch): the middle of the
    first run of `run_length` or more such indices."""
    batch = take(job.data, 0, rows_)
    model = job.build()
    model.train()

    def attempt(k):
        with autofit.simulate_gpu() as gpu:
            gpu.track(list(model.parameters()) + list(model.buffers()))
            base = gpu.memory_allocated()
            start = []
            loss = model(**batch).loss

            def arm(_grad):
                start.append(gpu.allocation_count)
                if k is not None:
                    gpu.fail_at(gpu.allocation_count + k)
            loss.register_hook(arm)
            try:
                loss.backward()
            except torch.OutOfMemoryError:
                pass
            loss = None
            model.zero_grad(set_to_none=True)
            gc.collect()
            held, used = gpu.memory_allocated() - base, gpu.allocation_count - start[0]
            gpu.fail_at(None)
        return held, used

    _, total = attempt(None)
    found = []
    for k in range(total):
        held, _ = attempt(k)
        if held > 0:
            found.append((k, held))
            continue
        if len(found) >= run_length:
            break
        found = []
    if len(found) < run_length:
        raise RuntimeError(f"{job}: no OOM point in backward leaves memory held on this torch; the "
                           f"injected-fault tables have nothing to show.")
    return found[len(found) // 2]


# -- the models ------------------------------------------------------------------------------------

def vit(hidden: int = 64, layers: int = 2, image: int = 32, patch: int = 8, labels: int = 10, seed: int = 0):
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                       intermediate_size=4 * hidden, image_size=image, patch_size=patch,
                       num_labels=labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(config)


def image_batches(n: int, rows_: int, image: int = 32, labels: int = 10, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"pixel_values": torch.randn(rows_, 3, image, image, generator=g),
             "labels": torch.randint(0, labels, (rows_,), generator=g)} for _ in range(n)]


def bart(hidden: int = 64, seq: int = 64, vocab: int = 1000, seed: int = 0):
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(seed)
    config = BartConfig(vocab_size=vocab, d_model=hidden, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=4 * hidden, decoder_ffn_dim=4 * hidden,
                        max_position_embeddings=seq, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        decoder_start_token_id=2, forced_eos_token_id=None)
    return BartForConditionalGeneration(config)


def seq2seq_batches(n: int, rows_: int, seq: int, vocab: int = 1000, seed: int = 4) -> list[dict]:
    """Encoder-decoder global batches: targets half as long as the sources, row r's last
    (r % 5) * 2 target tokens padded (-100), so micro-batches must be weighted by label tokens."""
    g = torch.Generator().manual_seed(seed)
    out, target = [], seq // 2
    for _ in range(n):
        ids = torch.randint(3, vocab, (rows_, seq), generator=g)
        labels = torch.randint(3, vocab, (rows_, target), generator=g)
        for r in range(rows_):
            pad = (r % 5) * 2
            if pad:
                labels[r, target - pad:] = -100
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


JOBS = {
    "bert": lambda a: Job("BERT cls", lambda: bert(hidden=a.hidden, layers=2, seq=a.seq),
                          cls_batches(a.steps, a.global_batch, a.seq)),
    "gpt2": lambda a: Job("GPT-2 LM", lambda: gpt2(hidden=a.hidden, layers=2, seq=a.seq),
                          lm_batches(a.steps, a.global_batch, a.seq)),
    "vit": lambda a: Job("ViT image cls", lambda: vit(hidden=a.hidden),
                         image_batches(a.steps, a.global_batch)),
    "bart": lambda a: Job("BART seq2seq", lambda: bart(hidden=a.hidden, seq=a.seq),
                          seq2seq_batches(a.steps, a.global_batch, a.seq)),
}


# -- the run -------------------------------------------------------------------------------------

METHODS = [
    ("autofit cold", autofit_run, {}),
    ("autofit cached", autofit_run, {}),
    ("autofit cold, precision=fp32", autofit_run, {"precision": "fp32"}),
]
if "capacity_check" in inspect.signature(autofit.run).parameters:  # the estimator's start, off
    METHODS.append(("autofit cold, capacity_check=False", autofit_run, {"capacity_check": False}))
METHODS += [
    ("Accelerate find_executable_batch_size", accelerate_feb, {}),
    ("Lightning BatchSizeFinder (algorithm re-implemented)", lightning_bsf, {}),
    ("Composer-style auto microbatching (re-implemented)", composer_auto, {}),
    ("fixed batch (plain loop)", fixed_batch, {}),
]
if importlib.util.find_spec("lightning") is not None:  # beside the re-implementation
    METHODS.insert(METHODS.index(("Lightning BatchSizeFinder (algorithm re-implemented)", lightning_bsf, {})) + 1,
                   ("Lightning BatchSizeFinder (lightning's own callback)", lightning_real_bsf, {}))


def run_all(job, budget, ref, largest, cache_root, inject_at=None, methods=METHODS):
    """Every method once on this job and budget; (result rows, memory rows)."""
    g = job.global_batch
    results, memory = [], []
    cache_dir = tempfile.mkdtemp(dir=cache_root)
    for name, method, kwargs in methods:
        if name.startswith("autofit cold"):
            cache_dir = tempfile.mkdtemp(dir=cache_root)  # fresh: nothing learned yet
        os.environ["AUTOFIT_CACHE_DIR"] = cache_dir
        run = run_method(method, job, budget, inject_at=inject_at, **kwargs)
        failed = bool(run.error)
        diff = None if failed else max_abs_diff(run.model, ref)
        share = None if failed or not largest else run.micro / largest
        where = [name, job.name, "none" if budget is None else mib(budget)]
        results.append(where + [
            run.ooms,
            None if run.first_step is None else round(run.first_step, 2),
            "-" if failed else run.micro,
            "failed: OOM" if failed else run.plan,
            None if share is None else f"{share:.2f}",
            "-" if failed else run.effective == g,
            "failed" if failed else (f"yes ({diff:.1e})" if diff <= TOLERANCE else f"no ({diff:.1e})"),
            mib(run.peak_allocated), mib(run.peak_reserved),
        ])
        memory.append(where + [run.device_ooms, run.backward_ooms, run.held_at_retry,
                               run.grads_at_retry, run.held, run.held_gc, run.held_grads])
        del run
        gc.collect()
    return results, memory


RESULT_HEADERS = ["method", "model", "budget", "OOMs", "s to 1st step", "final micro", "plan",
                  "share of largest", "global batch kept", "params = reference (max diff)",
                  "peak allocated", "peak reserved"]
MEMORY_HEADERS = ["method", "model", "budget", "OOMs raised", "in backward", "held at retry (B)",
                  "of which .grad", "held after return (B)", "after gc.collect()", "of which .grad"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="global batches each method trains on")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--no-injected", action="store_true", help="skip table 4 (the injected OOM)")
    parser.add_argument("--models", default="bert,gpt2,vit,bart",
                        help=f"comma-separated, from {','.join(JOBS)}")
    parser.add_argument("--methods", default="",
                        help="comma-separated words; only the methods whose name contains one of them "
                             "(default: all)")
    args = parser.parse_args(argv)
    setup()
    started = time.perf_counter()
    print_environment("autofit vs peers on a simulated GPU")
    g = args.global_batch
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in JOBS]
    if unknown or not names:
        parser.error(f"--models takes names from {','.join(JOBS)} but got {args.models!r}")
    jobs = [JOBS[n](args) for n in names]
    for job in jobs:  # warm up imports and kernels outside any clock
        job.build()
    layers = "2 layers" + (" (BART: 1 encoder + 1 decoder)" if "bart" in names else "")
    print(f"models: {', '.join(j.name for j in jobs)}; hidden {args.hidden}, {layers}, "
          f"seq {args.seq}, vocab 1000, random init, dropout 0; global batch "
          f"{g}, {args.steps} global batches per method; AdamW(lr=1e-3, foreach=True); "
          f"torch.set_num_threads(1)\n")

    with tempfile.TemporaryDirectory(prefix="autofit-peers-") as cache_root:
        tables = measure_all(jobs, args, cache_root)
    print_tables(*tables, args)
    print(f"\ntotal wall time {time.perf_counter() - started:.1f} s")
    return 0


def chosen_methods(words: str) -> list:
    """METHODS whose name contains one of the comma-separated words (all of them for none)."""
    wanted = [w.strip() for w in words.split(",") if w.strip()]
    chosen = [m for m in METHODS if not wanted or any(w in m[0] for w in wanted)]
    if not chosen:
        raise SystemExit(f"--methods {words!r} matches none of: {'; '.join(m[0] for m in METHODS)}")
    return chosen


def measure_all(jobs, args, cache_root):
    g = jobs[0].global_batch
    methods = chosen_methods(args.methods)
    fit_rows, result_rows, memory_rows, inj_results, inj_memory, inj_rows = [], [], [], [], [], []
    for job in jobs:
        ref = reference(job.build, job.batches, foreach=True)  # full batch, unlimited device
        budgets, peaks = budgets_for(job)
        for budget in budgets:
            largest = largest_fitting_micro(job, budget)
            fit_rows.append([job.name, mib(budget), mib(peaks["full"]), largest, f"{largest / g:.0%}"])
            results, memory = run_all(job, budget, ref, largest, cache_root, methods=methods)
            result_rows += results
            memory_rows += memory
        if not args.no_injected:
            index, held = retaining_fault_index(job)
            inj_rows.append([job.name, index, held])
            results, memory = run_all(job, None, ref, g, cache_root, inject_at=index, methods=methods)
            inj_results += results
            inj_memory += memory
    return fit_rows, result_rows, memory_rows, inj_rows, inj_results, inj_memory


def print_tables(fit_rows, result_rows, memory_rows, inj_rows, inj_results, inj_memory, args):
    g = args.global_batch
    print("Table 1. budgets and the largest fp32 micro-batch that fits (direct search: two plain "
          "steps, the second with AdamW state, under simulate_gpu)")
    print(table(["model", "budget", "full-batch peak", "largest micro", "of the global batch"],
                fit_rows))
    print()
    print(f"Table 2. methods side by side ({args.steps} global batches of {g}; params vs a "
          f"full-batch plain loop on an unlimited device, tolerance {TOLERANCE:g})")
    print(table(RESULT_HEADERS, result_rows))
    print()
    print("Table 3. memory a failed attempt leaves behind. 'held at retry': the most bytes allocated "
          "at the first forward after an OOM beyond the weights, the live optimizer's state and that "
          "forward's inputs. 'held after return': bytes allocated when the method has returned, "
          "weights subtracted (the model is still referenced, as a user's script holds it).")
    print(table(MEMORY_HEADERS, memory_rows))
    if inj_rows:
        print()
        print("Table 4. one OOM injected in the first backward, no budget: N allocations after "
              "backward reaches the loss, a point where an OOM leaves memory held after the "
              "exception is gone (found by a scan with a 2-row batch)")
        print(table(["model", "N", "held there, 2-row batch (B)"], inj_rows))
        print()
        print(table(RESULT_HEADERS, inj_results))
        print()
        print(table(MEMORY_HEADERS, inj_memory))


if __name__ == "__main__":
    raise SystemExit(main())
