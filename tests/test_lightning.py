"""A LightningModule made OOM-proof with the Autofit callback: on a simulated GPU where Lightning's own
fit runs out of memory, it trains to the parameters, learning rate and global_step of Lightning's own
run accumulating at autofit's final split; step-based checkpoints resume; what Lightning would add on
top of autofit is refused with the fix."""

import warnings

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
import torch.nn.functional as F  # noqa: E402

import autofit  # noqa: E402
from autofit.integrations.lightning import Autofit, autofit_evaluate, autofit_step  # noqa: E402

ROWS, GLOBAL = 96, 32  # 3 global batches an epoch
BUDGET = "232KiB"  # Lightning's batch of 32 does not fit; 16 rows do, 17 do not once AdamW has state


def halve(plan):
    return plan.replace(micro_batch_size=plan.micro_batch_size // 2) if plan.micro_batch_size > 1 else None


class Net(L.LightningModule):
    """Tokens through a per-token MLP, pooled, classified: activations grow with the rows, the
    weights are small. `interval`: None (no scheduler), "step" or "epoch"."""

    def __init__(self, interval=None, seed=0):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(8, 64)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.head(torch.relu(self.embed(x)).mean(dim=1))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:  # Lightning's own run, the reference
            return self.loss(batch)
        out = autofit_step(self, batch)
        self.log("train_loss", out.loss)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.hparams.interval is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.hparams.interval}}


def loader(batch_size):
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(ROWS, 16, 8, generator=g),
                                          torch.randint(0, 4, (ROWS,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def trainer(**options):
    options = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
               "enable_model_summary": False, "max_epochs": 2, **options}
    return L.Trainer(**options)


def autofit_fit(module, callback=None, ckpt_path=None, **options):
    callback = callback or Autofit(loss_fn=Net.loss, precision="fp32", ladder=halve, capacity_check=False)
    fitter = trainer(callbacks=[callback, *options.pop("callbacks", [])], **options)
    data = loader(GLOBAL)  # host memory: made outside the simulated GPU
    with autofit.simulate_gpu(BUDGET), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on workers and manual-optimization checkpoints
        fitter.fit(module, data, ckpt_path=ckpt_path)
    return fitter, callback


def lightning_fit(module, micro, **options):
    """Lightning's own run: automatic optimization accumulating GLOBAL // micro loader batches."""
    fitter = trainer(accumulate_grad_batches=GLOBAL // micro, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitter.fit(module, loader(micro))
    return fitter


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def splits(callback):
    return [(a.plan.micro_batch_size, a.outcome) for a in callback.attempts]


# the attempts at 232 KiB: each global batch's upward probe fails and is replayed at 16 rows
ATTEMPTS = [(32, "oom"), (16, "ok"), (24, "oom"), (16, "ok"), (20, "oom"), (16, "ok"), (18, "oom"), (16, "ok"),
            (17, "oom"), (16, "ok"), (16, "ok")]


def test_lightnings_own_fit_runs_out_of_memory_on_the_budget():
    data = loader(GLOBAL)
    with autofit.simulate_gpu(BUDGET), warnings.catch_warnings(), pytest.raises(torch.OutOfMemoryError):
        warnings.simplefilter("ignore")
        trainer().fit(Net(), data)


@pytest.mark.parametrize("interval", [None, "step", "epoch"])
def test_autofit_trains_as_lightning_accumulating_at_the_final_split(interval):
    module = Net(interval)
    fitter, callback = autofit_fit(module)
    assert splits(callback) == ATTEMPTS
    reference = Net(interval)
    plain = lightning_fit(reference, 16)  # accumulate_grad_batches=2 of 16-row loader batches
    assert same(module, reference) and not same(module, Net(interval))  # trained, exactly as Lightning
    assert fitter.global_step == plain.global_step == 6
    assert module.automatic_optimization is False
    lrs = [fitter.optimizers[0].param_groups[0]["lr"], plain.optimizers[0].param_groups[0]["lr"]]
    assert lrs == {None: [1e-2] * 2, "step": [1e-2 / 8] * 2, "epoch": [1e-2 / 2] * 2}[interval]


def test_max_steps_stops_at_the_same_step_as_lightning():
    module = Net("step")
    fitter, callback = autofit_fit(module, max_epochs=5, max_steps=4)
    reference = Net("step")
    plain = lightning_fit(reference, 16, max_epochs=5, max_steps=4)
    assert fitter.global_step == plain.global_step == 4
    assert len([a for a in callback.attempts if a.outcome == "ok"]) == 4
    assert same(module, reference)


def test_a_step_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    """ModelCheckpoint(every_n_train_steps=3) writes at global steps 3 and 6; a new Trainer fitting
    from the first ends where the uninterrupted fit ended, starting from the checkpoint's plan (the
    callback's state; the plan cache is off): no OOM attempt. load_from_checkpoint gives Lightning's
    own run at step 3."""
    tmp_path = tmp_path / "checkpoints"
    every = L.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    uncached = dict(loss_fn=Net.loss, precision="fp32", ladder=halve, capacity_check=False, cache=False)
    whole, _ = autofit_fit(Net("step"), Autofit(**uncached), callbacks=[every], enable_checkpointing=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
    first = str(tmp_path / "epoch=0-step=3.ckpt")

    loaded = Net.load_from_checkpoint(first)
    at_three = Net("step")
    lightning_fit(at_three, 16, max_steps=3)
    assert same(loaded, at_three) and loaded.hparams.interval == "step"

    resumed = Net("step", seed=5)  # other initial weights: the checkpoint's must replace them
    fitter, callback = autofit_fit(resumed, Autofit(**uncached), ckpt_path=first)
    assert splits(callback) == [(16, "ok")] * 3  # settled from the checkpoint's plan (no plan cache here)
    assert fitter.global_step == whole.global_step == 6
    assert same(resumed, whole.lightning_module)
    assert fitter.optimizers[0].state_dict()["state"][0]["step"] == 6
    assert fitter.lr_scheduler_configs[0].scheduler.get_last_lr() == [1e-2 / 8]


@pytest.mark.parametrize("options, text", [
    ({"accumulate_grad_batches": 4}, "Trainer(accumulate_grad_batches=4) accumulates in Lightning's loop; autofit "
     "chooses the accumulation itself and each batch of the loader is one global batch. Create the Trainer "
     "without accumulate_grad_batches and give the DataLoader batch_size 4 times larger (the global batch of "
     "the accumulated run)."),
    ({"gradient_clip_val": 1.0}, "Trainer(gradient_clip_val=1.0) clips in Lightning's optimizer step, which "
     "autofit replaces; create the Trainer without it and pass Autofit(max_grad_norm=1.0) (autofit clips the "
     "norm of the whole accumulated gradient; clipping by value is not offered)."),
    ({"precision": "bf16-mixed"}, "Trainer(precision='bf16-mixed') wraps training_step in Lightning's own "
     "precision plugin, around autofit's plan, which owns autocast and the fp16 grad scaler. Create the "
     "Trainer with precision='32-true' and pass Autofit(precision='bf16') (or 'auto')."),
    ({"precision": "bf16-true"}, "Trainer(precision='bf16-true') wraps training_step in Lightning's own "
     "precision plugin, around autofit's plan, which owns autocast and the fp16 grad scaler. Create the "
     "Trainer with precision='32-true' (autofit's plans train fp32 parameters, with bf16 or fp16 autocast "
     "when they choose it)."),
    ({"precision": "64-true"}, "Trainer(precision='64-true') wraps training_step in Lightning's own "
     "precision plugin, around autofit's plan, which owns autocast and the fp16 grad scaler. Create the "
     "Trainer with precision='32-true' (autofit's plans train fp32 parameters, with bf16 or fp16 autocast "
     "when they choose it)."),
])
def test_what_lightning_would_add_on_top_of_autofit_is_refused_with_the_fix(options, text):
    module = Net()
    with pytest.raises(ValueError) as info:
        autofit_fit(module, **options)
    assert str(info.value) == text
    assert module.automatic_optimization  # refused before anything was switched


class TwoOptimizers(Net):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.embed.parameters()), torch.optim.SGD(self.head.parameters(), lr=0.1)


class EverySecondStep(Net):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}


@pytest.mark.parametrize("module, text", [
    (TwoOptimizers(), "configure_optimizers returned 2 optimizers; the Autofit callback steps exactly one (the "
     "stepper's one optimizer step per global batch)."),
    (EverySecondStep(), "the StepLR is configured with interval='step', frequency=2; the Autofit callback steps "
     "a scheduler every optimizer step (interval='step') or every epoch (interval='epoch'), frequency 1."),
])
def test_optimizers_and_schedulers_autofit_cannot_step_as_lightning_would_are_refused(module, text):
    with pytest.raises(ValueError) as info:
        autofit_fit(module)
    assert str(info.value) == text


def test_a_strategy_on_several_devices_is_refused():
    from types import SimpleNamespace
    from autofit.integrations.lightning import check_trainer
    several = SimpleNamespace(accumulate_grad_batches=1, gradient_clip_val=None, precision="32-true",
                              strategy=L.strategies.DDPStrategy())
    with pytest.raises(ValueError, match=r"^the Trainer's strategy is DDPStrategy; the Autofit callback trains on "
                                         r"one device \(strategy='auto' with devices=1, or SingleDeviceStrategy\)"):
        check_trainer(several)


def test_autofit_step_without_the_callback_says_how_to_add_it():
    module = Net()
    module.automatic_optimization = False
    with pytest.raises(RuntimeError, match=r"^autofit_step needs one Autofit callback on the Trainer but found 0; "
                                           r"create it with L.Trainer\(callbacks=\[Autofit\(loss_fn=\.\.\.\)\], "):
        trainer().fit(module, loader(GLOBAL))


class Validated(Net):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", autofit_evaluate(self, batch).loss)


def test_validation_batches_too_large_for_the_budget_are_evaluated_in_parts():
    """The sanity check (before training starts) and each epoch's validation take one batch of 96
    rows, which runs out of memory as it is; autofit_evaluate halves it and gives the whole batch's loss."""
    module = Validated()
    callback = Autofit(loss_fn=Net.loss, precision="fp32", ladder=halve, capacity_check=False)
    fitter = trainer(callbacks=[callback], max_epochs=1)
    train, valid = loader(GLOBAL), loader(ROWS)
    whole_batch = next(iter(valid))
    with autofit.simulate_gpu(BUDGET), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(torch.OutOfMemoryError):
            with torch.inference_mode():
                Net.loss(module, whole_batch)  # the validation batch as it is
        fitter.fit(module, train, valid)
    assert fitter.global_step == 3
    with torch.inference_mode():
        whole = Net.loss(module, whole_batch).item()
    assert fitter.callback_metrics["val_loss"].item() == pytest.approx(whole, rel=1e-6)
    assert callback._sizer.size < ROWS  # the sanity check's evaluation (no stepper yet) halved too
    with autofit.simulate_gpu(BUDGET), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        validated = fitter.validate(module, valid, verbose=False)  # no stepper: autofit.evaluate
    assert validated[0]["val_loss"] == pytest.approx(whole, rel=1e-6)


def test_the_mnist_style_example_runs():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "examples" / "lightning_mnist_style.py"
    spec = importlib.util.spec_from_file_location("lightning_mnist_style", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    done = example.main(["--rows", "128", "--epochs", "1"])
    assert done["global_step"] == 2
    assert done["plan"].describe() == "micro 22 x 3, fp32"
    assert [(a.plan.micro_batch_size, a.outcome) for a in done["attempts"]] == [(22, "ok"), (23, "oom"), (22, "ok")]


class ManualAlready(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False  # Lightning's documented switch, set by the user: accepted


def test_with_the_capacity_check_the_fit_starts_where_16_rows_fit():
    """autofit's defaults but fp32: the estimator picks 16 rows for the first batch (no OOM there),
    one upward probe (17) fails and the search settles; still Lightning's own run at 16 x 2."""
    module = ManualAlready()
    fitter, callback = autofit_fit(module, Autofit(loss_fn=Net.loss, precision="fp32"))
    assert splits(callback) == [(16, "ok"), (17, "oom")] + [(16, "ok")] * 5
    assert callback.attempts[0].reason.startswith("estimated: fastest plan predicted to fit")
    reference = Net()
    plain = lightning_fit(reference, 16)
    assert same(module, reference) and fitter.global_step == plain.global_step == 6


def test_a_lightning_without_the_step_counter_is_refused():
    """The one internal the callback uses, checked at setup (before training) on the Trainer given."""
    from types import SimpleNamespace
    from autofit.integrations.lightning import step_progress
    other = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(manual_loop=None)))
    with pytest.raises(RuntimeError, match=r"^this Lightning \(.+\) has no trainer\.fit_loop\.epoch_loop\."
                                           r"manual_optimization\.optim_step_progress with increment_ready/"):
        step_progress(other)
    assert step_progress(trainer()).total.completed == 0  # this Lightning has it


def test_a_batch_that_fits_no_plan_ends_the_fit_with_does_not_fit_and_the_stepper_closed():
    module = Net()
    callback = Autofit(loss_fn=Net.loss, precision="fp32", ladder=halve, capacity_check=False)
    data = loader(GLOBAL)
    with autofit.simulate_gpu("30KiB"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(autofit.DoesNotFit, match=r"^no plan of the ladder fits global batch 32 at step 0"):
            trainer(callbacks=[callback]).fit(module, data)
    assert callback.step is None  # the stepper's block was left (on_exception)
    assert [a.plan.micro_batch_size for a in callback.attempts] == [32, 16, 8, 4, 2, 1]
    assert same(module, Net())  # no step was applied


def test_an_option_the_stepper_refuses_ends_the_fit_with_its_own_error():
    module = Net()
    callback = Autofit(loss_fn=Net.loss, precision="fp8")
    with pytest.raises(ValueError, match=r"^precision must be one of auto, fp32, bf16, fp16 but got 'fp8'\.$"):
        autofit_fit(module, callback)
    assert callback.step is None and same(module, Net())


class Watched(Net):
    def training_step(self, batch, batch_idx):
        out = autofit_step(self, batch)
        seen = [(a.plan.micro_batch_size, a.outcome) for a in self.trainer.callbacks[0].attempts]
        assert seen[-len(out.attempts):] == [(a.plan.micro_batch_size, a.outcome) for a in out.attempts]
        self.seen = len(seen)


def test_the_callbacks_attempts_grow_during_the_fit():
    module = Watched()
    _, callback = autofit_fit(module)
    assert module.seen == len(callback.attempts) == len(ATTEMPTS)


def test_a_checkpoint_of_lightnings_own_run_resumes_under_autofit_at_its_step(tmp_path):
    """Lightning's automatic run (16 x 2) writes a checkpoint at step 3; the fit under autofit resumes
    from it, counts on from step 3 (its checkpoint is named step=6) and ends as Lightning's own run."""
    plain_dir, autofit_dir = tmp_path / "plain", tmp_path / "autofit"
    reference = Net("step")
    every = L.callbacks.ModelCheckpoint(dirpath=plain_dir, every_n_train_steps=3, save_top_k=-1)
    lightning_fit(reference, 16, callbacks=[every], enable_checkpointing=True)
    resumed = Net("step", seed=5)
    every = L.callbacks.ModelCheckpoint(dirpath=autofit_dir, every_n_train_steps=3, save_top_k=-1)
    fitter, callback = autofit_fit(resumed, ckpt_path=str(plain_dir / "epoch=0-step=3.ckpt"), callbacks=[every],
                                   enable_checkpointing=True)
    assert fitter.global_step == 6 and [p.name for p in autofit_dir.iterdir()] == ["epoch=1-step=6.ckpt"]
    assert splits(callback) == [(32, "oom"), (16, "ok"), (24, "oom"), (16, "ok"), (20, "oom"), (16, "ok")]
    assert same(resumed, reference)
