"""The training and evaluation loop of Hugging Face's `run_glue_no_trainer.py` (Accelerate), and the
same loop converted to `autofit.stepper`. `diff -w` between `train_plain` and `train_autofit` is the
conversion: one line added (the stepper block), the 6 lines of forward, backward, step, schedule and
zero_grad replaced by one `step(batch)`, and the evaluation loop with its gathering (8 lines) replaced
by one `step.evaluate` (optional: the script's own evaluation loop runs inside the block too, where
memory allows; `step.evaluate` is what keeps it within the budget).

- What `accelerator.prepare` returns is passed as it is: autofit steps the optimizer and scheduler the
  wrappers wrap (see docs/stepper.md, "Accelerate loops").
- Evaluation: `step.evaluate(eval_dataloader, metric_fn=accuracy)` runs the model in inference mode
  with its own batch size (an OOM halves it), and under several processes combines every process's
  rows as one process would (each sample once): what `accelerator.gather_for_metrics` gives the
  script's metric. `metric_fn` returns per-batch means; the result is their row-weighted mean.

    python examples/accelerate_glue.py      # a tiny random BERT on random data

It takes about 20 s on an idle 2-core CPU box (imports included: torch, transformers and accelerate),
and a few minutes when other jobs share the cores.
"""

import torch
from accelerate import Accelerator
from transformers import BertConfig, BertForSequenceClassification, get_scheduler

import autofit


def setup(train_rows, eval_rows, *, batch_size=8, lr=1e-3, epochs=2, seed=0, accelerator=None):
    """run_glue_no_trainer's setup, small: a BERT classifier, AdamW with the usual no-decay groups, a
    linear schedule built on the optimizer before prepare, the loaders prepared."""
    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(seed)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100, max_position_embeddings=64, num_labels=3)
    model = BertForSequenceClassification(config)
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    train_dataloader = torch.utils.data.DataLoader(train_rows, batch_size=batch_size, shuffle=False)
    eval_dataloader = torch.utils.data.DataLoader(eval_rows, batch_size=batch_size, shuffle=False)
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=1,
                                 num_training_steps=epochs * len(train_dataloader))
    return (accelerator, *accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader, lr_scheduler))


def train_plain(accelerator, model, optimizer, train_dataloader, eval_dataloader, lr_scheduler, epochs=2):
    """The script's loop (its progress bar, checkpointing and tracking left out)."""
    accuracies = []
    for epoch in range(epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        model.eval()
        correct = total = 0
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct, total = correct + int((predictions == references).sum()), total + len(references)
        accuracies.append(correct / total)
    return accuracies


def accuracy(outputs, batch):
    """The script's metric as a `metric_fn`: this evaluation batch's mean."""
    return {"accuracy": (outputs.logits.argmax(dim=-1) == batch["labels"]).float().mean()}


def train_autofit(accelerator, model, optimizer, train_dataloader, eval_dataloader, lr_scheduler, epochs=2,
                  **autofit_options):
    """The same loop under autofit: OOM-proof steps and evaluation. Returns the accuracies and, for
    comparison, the micro-batch each global batch was trained with."""
    accuracies = []
    with autofit.stepper(model, optimizer, scheduler=lr_scheduler, **autofit_options) as step:
        for epoch in range(epochs):
            model.train()
            for _, batch in enumerate(train_dataloader):
                step(batch)
            accuracies.append(step.evaluate(eval_dataloader, metric_fn=accuracy).metrics["accuracy"])
    return accuracies, [a.plan.micro_batch_size for a in step.attempts if a.outcome == "ok"]


def random_rows(n, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 100, (seq,), generator=g),
             "attention_mask": torch.ones(seq, dtype=torch.long),
             "labels": torch.randint(0, 3, (), generator=g)} for _ in range(n)]


if __name__ == "__main__":
    train_rows, eval_rows = random_rows(64), random_rows(32, seed=2)
    print("plain:  ", train_plain(*setup(train_rows, eval_rows)))
    print("autofit:", train_autofit(*setup(train_rows, eval_rows), precision="fp32")[0])
