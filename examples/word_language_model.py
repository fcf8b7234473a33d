"""pytorch/examples' word_language_model training loop (LSTM, truncated BPTT), converted to
`autofit.stepper`. Lines changed from the original are marked `# autofit`.

The batches are time-first, `(bptt, batch_size)`, as `batchify` makes them: `batch_dim=1` says the
rows are along dimension 1. The hidden state carried from one batch to the next travels in the batch
(split with its rows) and comes back from the loss as `out.kept`, joined over the micro-batches from
the attempt that succeeded, so a split or a replay hands on the plain loop's state.

    python examples/word_language_model.py    # a random corpus, 2 epochs of 32 batches

It takes about half a minute on an idle 2-core CPU box (imports included), and several minutes
when other jobs share the cores.
"""

import math

import torch
from torch import nn

import autofit


class RNNModel(nn.Module):
    """Encoder, LSTM, decoder: the example's model (its 'LSTM' choice)."""

    def __init__(self, ntoken, ninp=32, nhid=32, nlayers=2, dropout=0.2):
        super().__init__()
        self.ntoken, self.nlayers, self.nhid = ntoken, nlayers, nhid
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)  # batch_first=False: (time, batch)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def batchify(data, bsz):
    """The corpus as `bsz` columns, time along dimension 0."""
    nbatch = data.size(0) // bsz
    return data[:nbatch * bsz].view(bsz, -1).t().contiguous()


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len]  # autofit: targets keep their columns (was .view(-1))


def loss_fn(model, batch):  # autofit: the loop's forward and loss, returning the new hidden state
    tokens, targets, h, c = batch
    output, hidden = model(tokens, (h, c))
    return nn.functional.cross_entropy(output.view(-1, model.ntoken), targets.reshape(-1)), hidden


def train(model, corpus, *, epochs=2, batch_size=8, bptt=16, lr=20.0, clip=0.25, eval_corpus=None,
          **autofit_options):
    """Train as the example does (SGD at `lr`, gradients clipped to `clip`, lr / 4 when the
    validation loss stops improving). Returns (training losses per batch, validation losses per epoch,
    the micro-batch each batch was trained with)."""
    train_data = batchify(corpus, batch_size)
    val_data = None if eval_corpus is None else batchify(eval_corpus, batch_size)
    losses, val_losses, splits, best = [], [], [], None
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)  # autofit: the example's manual update, as SGD
    with autofit.stepper(model, optimizer, loss_fn=loss_fn, max_grad_norm=clip, batch_dim=1,  # autofit
                         **autofit_options) as step:
        for epoch in range(epochs):
            hidden = model.init_hidden(batch_size)
            for i in range(0, train_data.size(0) - 1, bptt):
                tokens, targets = get_batch(train_data, i, bptt)
                out = step((tokens, targets, *hidden))  # autofit: forward, backward, clip, update
                hidden = out.kept  # autofit: the state the plain loop's repackage_hidden hands on
                losses.append(out.loss)
                splits.append(out.plan.micro_batch_size)
            if val_data is None:
                continue
            val_loss = evaluate(step, model, val_data, batch_size, bptt)
            val_losses.append(val_loss)
            if best is None or val_loss < best:
                best = val_loss
            else:
                for group in step.optimizer.param_groups:
                    group["lr"] /= 4.0
    return losses, val_losses, splits


def evaluate(step, model, data_source, batch_size, bptt):
    """The example's evaluate(): the mean loss over the corpus, the hidden state carried."""
    total, hidden = 0.0, model.init_hidden(batch_size)
    for i in range(0, data_source.size(0) - 1, bptt):
        tokens, targets = get_batch(data_source, i, bptt)
        done = step.evaluate([(tokens, targets, *hidden)])  # autofit: its own evaluation batch size
        total += len(tokens) * done.loss
        hidden = done.kept
    return total / (len(data_source) - 1)


if __name__ == "__main__":
    torch.manual_seed(0)
    vocab = 100
    corpus, valid = torch.randint(0, vocab, (4000,)), torch.randint(0, vocab, (800,))
    losses, val_losses, splits = train(RNNModel(vocab), corpus, eval_corpus=valid, budget="64MiB")
    print(f"{len(losses)} steps, last loss {losses[-1]:.3f} (ppl {math.exp(losses[-1]):.1f}); "
          f"validation {', '.join(f'{v:.3f}' for v in val_losses)}")
