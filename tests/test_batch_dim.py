"""batch_dim: batches whose rows are not along dimension 0, and state kept from batch to batch.

The model is the word-language-model loop's: time-first batches `(time, batch)`, an LSTM built with
batch_first=False, and its hidden state carried from one batch to the next (truncated BPTT).
"""

import copy

import pytest
import torch
from torch import nn

import autofit
from autofit.engine.layout import Layout
from autofit.engine.kept import join
from reference import device_copy

VOCAB, EMB, HID, LAYERS, T, B = 50, 16, 16, 2, 7, 8


class WordLM(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = nn.Embedding(VOCAB, EMB)
        self.rnn = nn.LSTM(EMB, HID, LAYERS)  # batch_first=False: (time, batch, features)
        self.decoder = nn.Linear(HID, VOCAB)

    def forward(self, tokens, hidden):
        out, hidden = self.rnn(self.encoder(tokens), hidden)
        return self.decoder(out), hidden


def lm_loss(model, batch):
    tokens, targets, h, c = batch
    out, (h, c) = model(tokens, (h, c))
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1)), (h, c)


def time_first_batches(n, seed=1, time=T):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (time, B), generator=g), torch.randint(0, VOCAB, (time, B), generator=g))
            for _ in range(n)]


def zero_state():
    return torch.zeros(LAYERS, B, HID), torch.zeros(LAYERS, B, HID)


def plain_bptt(model, batches, micro_sizes, lr=0.1):
    """The plain loop at the same splits: columns [i, i+m) of every field (each micro-batch a device
    copy), weighted by rows, one SGD step per batch, the new hidden state joined along dimension 1."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    h, c = zero_state()
    for (tokens, targets), m in zip(batches, micro_sizes):
        new_h, new_c = [], []
        for i in range(0, B, m):
            part = device_copy((tokens[:, i:i + m], targets[:, i:i + m], h[:, i:i + m], c[:, i:i + m]))
            loss, (ph, pc) = lm_loss(model, part)
            (loss * (part[0].shape[1] / B)).backward()
            new_h.append(ph.detach())
            new_c.append(pc.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        h, c = torch.cat(new_h, 1), torch.cat(new_c, 1)
    return model, (h, c)


def train_bptt(model, batches, state, loss_fn=lm_loss, **options):
    h, c = state
    outs = []
    with autofit.stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                         batch_dim=1, precision="fp32", cache=False, **options) as step:
        for tokens, targets in batches:
            out = step((tokens, targets, h, c))
            h, c = out.kept
            outs.append(out)
    return outs, (h, c)


def test_time_first_batches_split_by_rows_replay_and_carry_the_state_as_the_plain_loop():
    batches = time_first_batches(3)
    model, state = WordLM(), zero_state()
    armed = []

    def failing_in_backward(model, batch):  # the first whole-batch loss keeps its state, then the next allocation OOMs
        loss, kept = lm_loss(model, batch)
        if not armed and batch[0].shape[1] == B:
            armed.append(True)
            gpu.fail_at(gpu.allocation_count)  # the weighting of this loss, after kept was taken
        return loss, kept
    with autofit.simulate_gpu() as gpu:
        outs, (h, c) = train_bptt(model, batches, state, capacity_check=False, loss_fn=failing_in_backward)
    assert [[(a.plan.micro_batch_size, a.outcome, a.where) for a in o.attempts] for o in outs] == [
        [(8, "oom", "forward"), (4, "ok", "")], [(6, "ok", "")], [(7, "ok", "")]]
    assert h.shape == c.shape == (LAYERS, B, HID) and not h.requires_grad
    reference, (ref_h, ref_c) = plain_bptt(WordLM(), batches, [o.plan.micro_batch_size for o in outs])
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(h, ref_h) and torch.equal(c, ref_c)  # the failed attempt's state was dropped


def test_the_capacity_check_runs_on_time_first_batches_and_the_split_equals_the_plain_loop():
    batches = time_first_batches(2, time=64)  # activations, not the weights, decide the split
    model, state = WordLM(), zero_state()
    with autofit.simulate_gpu():
        whole, _ = train_bptt(WordLM(), batches[:1], state, capacity_check=False)
    peak = whole[0].attempts[0].peak_bytes
    with autofit.simulate_gpu(budget=int(peak * 0.8)):
        outs, (h, c) = train_bptt(model, batches, state)
    assert whole[0].plan.micro_batch_size == B
    sizes = [o.plan.micro_batch_size for o in outs]
    assert outs[0].attempts[0].reason.startswith("estimated: ")  # the capacity check ran on the batch
    assert [o.attempts[-1].outcome for o in outs] == ["ok", "ok"] and max(sizes) < B
    reference, (ref_h, _) = plain_bptt(WordLM(), batches, sizes)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(h, ref_h)


class RowsFirstLM(WordLM):
    """Reads (rows, time) tokens and transposes them for its time-first LSTM itself."""

    def forward(self, tokens, targets):
        out, _ = self.rnn(self.encoder(tokens.T))
        return nn.functional.cross_entropy(self.decoder(out).reshape(-1, VOCAB), targets.T.reshape(-1))


def test_a_model_reading_time_first_inputs_is_refused_without_batch_dim():
    with pytest.raises(ValueError, match=r"^rnn \(LSTM\) was built with batch_first=False: .*batch_dim=1"):
        with autofit.stepper(WordLM(), loss_fn=lm_loss):
            pass
    with pytest.raises(ValueError, match=r"^rnn \(LSTM\) was built with batch_first=False"):
        autofit.evaluate(WordLM(), [time_first_batches(1)[0]])
    tokens, targets = time_first_batches(1)[0]
    batch = (tokens.T.contiguous(), targets.T.contiguous())  # (rows, time)
    with autofit.simulate_gpu():  # batch_dim=0 says the rows are along dimension 0 anyway
        with autofit.stepper(RowsFirstLM(), torch.optim.SGD, batch_dim=0, cache=False,
                             capacity_check=False) as step:
            out = step(batch)
    assert out.plan.micro_batch_size == B and out.kept is None


@pytest.mark.parametrize("batch_dim, message", [
    (-1, r"batch_dim must be a dimension index >= 0 .* but got -1"),
    (True, r"batch_dim must be a dimension index >= 0 .* but got True"),
    ({0: "1"}, r"batch_dim\[0\] must be a dimension index >= 0 .* but got '1'"),
])
def test_bad_batch_dims_are_refused_by_value(batch_dim, message):
    with pytest.raises(ValueError, match=message):
        Layout(batch_dim)


def test_per_field_dims_move_only_the_fields_named_and_name_what_is_wrong():
    tokens, lengths = torch.arange(12).reshape(3, 4), torch.arange(4)
    layout = Layout({"tokens": 1})
    rows = layout.rows_first({"tokens": tokens, "lengths": lengths})
    assert torch.equal(rows["tokens"], tokens.T) and rows["lengths"] is lengths
    back = layout.as_given({"tokens": rows["tokens"][1:3], "lengths": lengths[1:3]})
    assert torch.equal(back["tokens"], tokens[:, 1:3]) and back["tokens"].is_contiguous()
    with pytest.raises(ValueError, match=r"batch_dim names \['ids'\], which the batch does not have "
                                         r"\(its fields: \['tokens', 'lengths'\]\)"):
        Layout({"ids": 1}).rows_first({"tokens": tokens, "lengths": lengths})
    with pytest.raises(ValueError, match=r"batch\[1\] has shape \(4,\), no dimension 1 to hold the rows"):
        Layout(1).rows_first((tokens, lengths))
    assert torch.equal(Layout({0: 1}).rows_first((tokens, lengths))[0], tokens.T)


def test_kept_outputs_join_in_row_order_and_must_cover_every_row():
    a, b = torch.arange(6).reshape(2, 3), torch.arange(6, 12).reshape(2, 3)
    joined = join([{"h": a, "n": (a[:, 0],)}, {"h": b, "n": (b[:, 0],)}])
    assert torch.equal(joined["h"], torch.cat([a, b])) and torch.equal(joined["n"][0], torch.tensor([0, 3, 6, 9]))
    with pytest.raises(ValueError, match=r"kept outputs of different structures"):
        join([(a,), (a, b)])

    def short(model, batch):  # keeps one row of each micro-batch only
        loss, (h, c) = lm_loss(model, batch)
        return loss, h[:, :1]
    tokens, targets = time_first_batches(1)[0]
    with autofit.simulate_gpu():
        with autofit.stepper(WordLM(), torch.optim.SGD, loss_fn=short, batch_dim=1, cache=False,
                             capacity_check=False) as step:
            with pytest.raises(ValueError, match=r"kept outputs have 1 rows for a batch of 8"):
                step((tokens, targets, *zero_state()))


def test_evaluate_with_batch_dim_equals_a_plain_no_grad_pass_and_keeps_the_state():
    model, batches = WordLM(), time_first_batches(2, seed=3)
    h, c = zero_state()
    data = [(tokens, targets, h, c) for tokens, targets in batches]
    done = autofit.evaluate(model, data, loss_fn=lm_loss, batch_dim=1, batch_size=3)
    assert [(a.batch_size, a.outcome) for a in done.attempts] == [(3, "ok")]
    assert done.samples == 2 * B
    plain_loss, plain_h = 0.0, []
    with torch.no_grad():  # the same evaluation batches: columns [0, 3), [3, 6), [6, 8) of each
        for batch in data:
            for i in range(0, B, 3):
                part = device_copy(tuple(t[:, i:i + 3] for t in batch))
                loss, (ph, _) = lm_loss(model, part)
                plain_loss += loss.item() * part[0].shape[1]
                plain_h.append(ph)
    assert done.loss == pytest.approx(plain_loss / (2 * B), rel=1e-12, abs=0)
    kept_h, kept_c = done.kept  # every row evaluated, in order: both batches' columns
    assert kept_h.shape == (LAYERS, 2 * B, HID) and not kept_h.is_inference()
    assert torch.equal(kept_h, torch.cat(plain_h, 1))
    with pytest.raises(ValueError, match=r"batch_dim=1 with a map-style Dataset"):
        autofit.evaluate(model, torch.utils.data.TensorDataset(batches[0][0]), batch_dim=1)


def test_run_with_batch_dim_refuses_what_collates_rows_first():
    data = torch.utils.data.TensorDataset(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"batch_dim=1 needs data given as batches laid out that way"):
        autofit.run(WordLM(), data, batch_size=2, loss_fn=lm_loss, batch_dim=1, progress=False)


def test_time_first_batches_through_offload_with_a_scheduler_a_shuffled_loader_and_a_saved_state():
    """The user's job as run: SGD with momentum, StepLR, a shuffled DataLoader of time-first chunks,
    dropout on, the optimizer's state_dict saved mid-run; an OOM in the first step
    steps to offload: the same parameters, hidden state, learning rate and
    saved state as the plain loop at the same plans."""
    chunks = time_first_batches(4, seed=5)

    def loader():
        return torch.utils.data.DataLoader(chunks, batch_size=None, shuffle=True,
                                           generator=torch.Generator().manual_seed(7))

    def model():
        m = WordLM()
        m.dropout = nn.Dropout(0.2)
        return m

    def loss_with_dropout(m, batch):
        tokens, targets, h, c = batch
        out, (h, c) = m.rnn(m.dropout(m.encoder(tokens)), (h, c))
        return nn.functional.cross_entropy(m.decoder(out).reshape(-1, VOCAB), targets.reshape(-1)), (h, c)

    def build(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    ladder = [lambda p: None if p.offload_optimizer else p.replace(offload_optimizer=True),
              lambda p: p.with_micro_batch(p.micro_batch_size // 2, B) if p.micro_batch_size > 1 else None]
    torch.manual_seed(3)
    trained, (h, c) = model(), zero_state()
    opt, sched = build(trained)
    saved = None
    with autofit.simulate_gpu() as gpu:
        with autofit.stepper(trained, opt, scheduler=sched, loss_fn=loss_with_dropout, batch_dim=1,
                             precision="fp32", cache=False, capacity_check=False, ladder=ladder) as step:
            plans = []
            for i, (tokens, targets) in enumerate(loader()):
                if i == 0:
                    gpu.fail_at(gpu.allocation_count)  # the first step's first allocation: offload
                out = step((tokens, targets, h, c))
                h, c = out.kept
                plans.append(out.plan)
                if i == 1:
                    saved = copy.deepcopy(opt.state_dict())
    assert [(p.offload_optimizer, p.micro_batch_size) for p in plans] == [(True, 8)] * 4
    torch.manual_seed(3)
    reference, (ref_h, ref_c) = model(), zero_state()
    ref_opt, ref_sched = build(reference)
    ref_saved = None
    for i, ((tokens, targets), plan) in enumerate(zip(loader(), plans)):
        m, new_h, new_c = plan.micro_batch_size, [], []
        for j in range(0, B, m):
            part = device_copy((tokens[:, j:j + m], targets[:, j:j + m], ref_h[:, j:j + m], ref_c[:, j:j + m]))
            loss, (ph, pc) = loss_with_dropout(reference, part)
            (loss * (part[0].shape[1] / B)).backward()
            new_h.append(ph.detach())
            new_c.append(pc.detach())
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_h, ref_c = torch.cat(new_h, 1), torch.cat(new_c, 1)
        if i == 1:
            ref_saved = copy.deepcopy(ref_opt.state_dict())
    for p, q in zip(trained.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(h, ref_h) and torch.equal(c, ref_c)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.025
    assert saved["state"].keys() == ref_saved["state"].keys() and all(
        torch.equal(saved["state"][k]["momentum_buffer"], ref_saved["state"][k]["momentum_buffer"])
        for k in saved["state"])
