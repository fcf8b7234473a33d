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
from autofit.integrations.lightning import Autofit, autofit_step  # noqa: E402

ROWS, GLOBAL = 96, 32  # 3 global batches an epoch
BUDGET = "280KiB"  # Lightning's batch of 32 does not fit; 16 rows do, 17 do not once AdamW has state


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
    with autofit.simulate_gpu(BUDGET), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on workers and manual-optimization checkpoints
        fitter.fit(module, loader(GLOBAL), ckpt_path=ckpt_path)
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


# the attempts at 280 KiB: each global batch's upward probe fails and is replayed at 16 rows
ATTEMPTS = [(32, "oom"), (16, "ok"), (24, "oom"), (16, "ok"), (20, "oom"), (16, "ok"), (18, "oom"), (16, "ok"),
            (17, "oom"), (16, "ok"), (16, "ok")]


def test_lightnings_own_fit_runs_out_of_memory_on_the_budget():
    with autofit.simulate_gpu(BUDGET), warnings.catch_warnings(), pytest.raises(torch.OutOfMemoryError):
        warnings.simplefilter("ignore")
        trainer().fit(Net(), loader(GLOBAL))


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
