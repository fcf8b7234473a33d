"""The converted scripts in examples/: each trains under a budget the plain loop runs out of, and
ends equal to the plain loop at the same splits."""

import importlib.util
import pathlib

import pytest
import torch

import autofit
from reference import device_copy

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def example(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_word_language_model(wlm, model, corpus, splits, *, batch_size, bptt, lr, clip):
    """The example's original loop (one epoch), each batch split into `splits` columns: micro-batches
    weighted by rows, the accumulated gradient clipped, one SGD update, the hidden state joined."""
    train_data = wlm.batchify(corpus, batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    h, c = model.init_hidden(batch_size)
    batches = list(range(0, train_data.size(0) - 1, bptt))
    assert len(batches) == len(splits)
    for i, micro in zip(batches, splits):
        tokens, targets = wlm.get_batch(train_data, i, bptt)
        new_h, new_c = [], []
        for j in range(0, batch_size, micro):
            part = device_copy((tokens[:, j:j + micro], targets[:, j:j + micro], h[:, j:j + micro], c[:, j:j + micro]))
            loss, (ph, pc) = wlm.loss_fn(model, part)
            (loss * (part[0].shape[1] / batch_size)).backward()
            new_h.append(ph.detach())
            new_c.append(pc.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        h, c = torch.cat(new_h, 1), torch.cat(new_c, 1)
    return model


def test_word_language_model_trains_under_a_budget_the_plain_loop_exceeds_and_equals_it():
    wlm = example("word_language_model")
    setting = dict(batch_size=8, bptt=24, lr=20.0, clip=0.25)
    corpus = torch.randint(0, 60, (8 * 24 * 3 + 1,), generator=torch.Generator().manual_seed(0))

    def model():
        torch.manual_seed(1)
        return wlm.RNNModel(60, dropout=0.2)
    with autofit.simulate_gpu() as gpu:  # the plain loop's whole batch: its peak
        plain_peak_model = model()
        plain_word_language_model(wlm, plain_peak_model, corpus, [8, 8, 8], **setting)
        whole = gpu.max_memory_allocated()
    budget = int(whole * 0.75)
    with autofit.simulate_gpu(budget):
        with pytest.raises(torch.OutOfMemoryError):
            plain_word_language_model(wlm, model(), corpus, [8, 8, 8], **setting)
    trained = model()
    with autofit.simulate_gpu(budget):
        losses, _, splits = wlm.train(trained, corpus, epochs=1, cache=False, precision="fp32", **setting)
    assert len(losses) == 3 and splits[0] < 8  # the first batch was split
    reference = plain_word_language_model(wlm, model(), corpus, splits, **setting)
    for p, q in zip(trained.parameters(), reference.parameters()):
        assert torch.equal(p, q)
