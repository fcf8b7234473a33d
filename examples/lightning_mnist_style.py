"""Lightning's MNIST-style classifier, made OOM-proof with autofit's Lightning callback.

    python examples/lightning_mnist_style.py [--budget 3MiB] [--epochs 2] [--batch-size 64]

Random 28x28 images stand in for MNIST (no download). On a machine without a GPU the budget is a
simulated GPU of that size: the batch of 64 does not fit in it, and autofit trains each batch in
micro-batches instead. The lines changed from the plain Lightning script:

    +from autofit.integrations.lightning import Autofit, autofit_evaluate, autofit_step

         def training_step(self, batch, batch_idx):
    -        loss = self.loss(batch)
    -        self.log("train_loss", loss)
    -        return loss
    +        out = autofit_step(self, batch)          # one global batch, split and replayed on OOM
    +        self.log("train_loss", out.loss)

         def validation_step(self, batch, batch_idx):
    -        self.log("val_loss", self.loss(batch))
    +        self.log("val_loss", autofit_evaluate(self, batch).loss)  # its own batch size and OOM ladder

    -trainer = L.Trainer(max_epochs=2)
    +trainer = L.Trainer(max_epochs=2, callbacks=[Autofit(loss_fn=LitClassifier.loss, budget=args.budget)])
"""

from __future__ import annotations

import argparse
import warnings

import lightning.pytorch as L
import torch
import torch.nn.functional as F

from autofit.integrations.lightning import Autofit, autofit_evaluate, autofit_step


class LitClassifier(L.LightningModule):
    def __init__(self, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.conv = torch.nn.Conv2d(1, 16, 3)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.head(F.relu(self.conv(x)).mean(dim=(2, 3)))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        out = autofit_step(self, batch)
        self.log("train_loss", out.loss)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", autofit_evaluate(self, batch).loss)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def images(rows: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(rows, 1, 28, 28, generator=g),
                                          torch.randint(0, 10, (rows,), generator=g))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="3MiB", help="device memory for training (a simulated GPU on CPU)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rows", type=int, default=256, help="training images")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = LitClassifier()
    train = torch.utils.data.DataLoader(images(args.rows, 1), batch_size=args.batch_size, shuffle=True)
    valid = torch.utils.data.DataLoader(images(64, 2), batch_size=args.batch_size)
    callback = Autofit(loss_fn=LitClassifier.loss, budget=args.budget)
    trainer = L.Trainer(max_epochs=args.epochs, callbacks=[callback], accelerator="auto", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
        trainer.fit(model, train, valid)
    ooms = sum(a.outcome == "oom" for a in callback.attempts)
    plan = callback.attempts[-1].plan
    print(f"global_step {trainer.global_step}, plan {plan.describe()}, {ooms} OOM attempt(s), "
          f"val_loss {trainer.callback_metrics['val_loss'].item():.4f}")
    return {"global_step": trainer.global_step, "plan": plan, "ooms": ooms, "attempts": callback.attempts}


if __name__ == "__main__":
    main()
