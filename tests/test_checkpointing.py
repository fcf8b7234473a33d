import random
import re

import numpy
import pytest
import torch

import autofit

from autofit.engine.checkpointing import Checkpointing, hf_checkpointing_state, hf_switch_checkpointing, largest_block_list
from autofit.integrations import transformers_internals as hf_internals
from models import bert_batch, gpt2_batch, tiny_bert, tiny_gpt2


def grads_of(model, run):
    model.zero_grad(set_to_none=True)
    run(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a, b):
    assert a.keys() == b.keys() and a
    worst = max(float((a[n] - b[n]).abs().max()) for n in a)
    assert worst <= 1e-6, worst


class Counted(torch.nn.Module):
    calls = 0

    def __init__(self, width=16):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x, scale=1.0):
        type(self).calls += 1
        return torch.tanh(self.linear(x)) * scale


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # More entries but fewer parameters than the blocks: the blocks are chosen by parameters.
        self.stem = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Identity(),
                                        torch.nn.Identity())
        self.blocks = torch.nn.ModuleList(Counted() for _ in range(3))
        self.lonely = torch.nn.ModuleList([torch.nn.Linear(16, 64)])                # len 1: not blocks
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h, scale=0.5)
        return self.head(h)


def net_loss(model):
    torch.manual_seed(1)
    return model(torch.randn(4, 8)).square().mean()


def calls_per_step(model):
    Counted.calls = 0
    net_loss(model).backward()
    return Counted.calls


# -- plain modules -------------------------------------------------------------------------------

def test_largest_block_list():
    net = Net()
    assert largest_block_list(net) is net.blocks
    assert largest_block_list(torch.nn.Linear(2, 2)) is None
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert largest_block_list(seq) is seq


def test_plain_model_blocks_are_wrapped_and_gradients_do_not_change():
    net = Net()
    reference = grads_of(net, net_loss)
    assert calls_per_step(net) == 3
    ck = Checkpointing(net)
    assert (ck.hf, ck.initial, ck.on, ck.available) == (False, False, False, True)
    assert ck.blocks is net.blocks
    ck.set(True)
    assert ck.on
    assert all("forward" in vars(b) and b.forward.__autofit_checkpoint__ for b in net.blocks)
    assert "forward" not in vars(net.stem[0]) and "forward" not in vars(net.head)
    assert calls_per_step(net) == 6                 # every block's forward runs again in backward
    assert_same_grads(grads_of(net, net_loss), reference)
    ck.set(True)                                    # already on: not wrapped twice
    assert calls_per_step(net) == 6
    with torch.no_grad():
        Counted.calls = 0
        net(torch.randn(2, 8))
        assert Counted.calls == 3                   # nothing to recompute without grad
    ck.restore()
    assert not ck.on
    assert all("forward" not in vars(b) for b in net.blocks)
    assert calls_per_step(net) == 3
    assert_same_grads(grads_of(net, net_loss), reference)


def test_without_grad_blocks_run_directly(monkeypatch):
    import autofit.engine.checkpointing as module

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint() called without grad")
    net = Net()
    Checkpointing(net).set(True)
    monkeypatch.setattr(module, "checkpoint", refuse)
    with torch.no_grad():
        out = net(torch.randn(2, 8))
    assert out.shape == (2, 1)
    with pytest.raises(AssertionError, match="without grad"):  # with grad it is called
        net(torch.randn(2, 8))


def test_plain_model_switched_off_and_on_again():
    net = Net()
    ck = Checkpointing(net)
    ck.set(True)
    ck.set(False)
    assert all("forward" not in vars(b) for b in net.blocks)
    ck.set(True)
    assert calls_per_step(net) == 6
    ck.restore()
    assert calls_per_step(net) == 3


def test_restore_keeps_a_forward_that_was_set_on_the_instance_before():
    # BUG (autofit/engine/checkpointing.py:77-91, Checkpointing.set): switching off does `del block.forward`,
    # which drops every instance-level forward, not only autofit's wrapper. A forward patched on the
    # instance before autofit came (accelerate's hooks, a user's wrapper) is lost after restore().
    # Fix: remember each block's previous `vars(block).get("forward")` and put it back (or delete the
    # attribute only when there was none).
    net = Net()
    seen = []
    for block in net.blocks:
        original = block.forward

        def patched(*args, _original=original, **kwargs):
            seen.append(1)
            return _original(*args, **kwargs)
        block.forward = patched
    ck = Checkpointing(net)
    ck.set(True)
    ck.restore()
    seen.clear()
    net_loss(net)
    assert len(seen) == 3


def test_a_model_without_blocks_cannot_be_checkpointed():
    model = torch.nn.Linear(4, 4)
    ck = Checkpointing(model)
    assert (ck.available, ck.blocks, ck.hf) == (False, None, False)
    with pytest.raises(ValueError, match=re.escape(
            "Linear has no repeated blocks to checkpoint (no ModuleList/Sequential); leave checkpointing off "
            "in the ladder.")):
        ck.set(True)
    assert not ck.on
    ck.set(False)                                   # off is always possible
    ck.restore()


# -- Hugging Face models -------------------------------------------------------------------------

def bert_loss(model):
    return model(**bert_batch(rows=4, seq=8)).loss


def gpt2_loss(model):
    return model(**gpt2_batch(rows=4, seq=8)).loss


@pytest.mark.parametrize("make, loss, inner", [
    (tiny_bert, bert_loss, lambda m: m.bert.encoder.layer[0].attention),
    (tiny_gpt2, gpt2_loss, lambda m: m.transformer.h[0].attn),
], ids=["bert", "gpt2"])
def test_hugging_face_switch_on_off_and_restore(make, loss, inner):
    model = make().train()
    reference = grads_of(model, loss)
    calls = []
    # A module inside a layer: the layer's own hooks run outside the checkpoint, its insides twice.
    inner(model).register_forward_pre_hook(lambda *_: calls.append(1))

    def layer_calls():
        calls.clear()
        loss(model).backward()
        return len(calls)
    assert layer_calls() == 1
    ck = Checkpointing(model)
    assert (ck.hf, ck.initial, ck.blocks, ck.available) == (True, False, None, True)
    ck.set(True)
    assert hf_checkpointing_state(model)
    assert layer_calls() == 2                       # recomputed in backward
    assert_same_grads(grads_of(model, loss), reference)
    ck.restore()
    assert not hf_checkpointing_state(model) and not ck.on
    assert layer_calls() == 1
    assert_same_grads(grads_of(model, loss), reference)


def test_hugging_face_model_that_came_with_checkpointing_on_gets_it_back(tiny_bert):  # the conftest fixture
    model = tiny_bert.train()
    hf_switch_checkpointing(model, True)
    ck = Checkpointing(model)
    assert (ck.initial, ck.on) == (True, True)
    ck.set(False)
    assert not hf_checkpointing_state(model)
    ck.restore()
    assert hf_checkpointing_state(model)


# -- a wrapper of a Hugging Face model (peft's LoRA) ---------------------------------------------

def lora(model, seed=3):
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)  # LoRA's A matrices are drawn at random
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj", "c_fc"],
                                                      fan_in_fan_out=True))


def test_a_lora_wrapper_uses_the_wrapped_models_switch():
    model = lora(tiny_gpt2()).train()
    inner = model.get_base_model()
    reference = grads_of(model, gpt2_loss)
    assert set(reference) == {n for n, p in model.named_parameters() if p.requires_grad} and all(
        "lora_" in n for n in reference)
    ck = Checkpointing(model)
    # PeftModel is no transformers class: its model's switch, not wrapped blocks from outside
    assert (ck.hf, ck.initial, ck.blocks, ck.available) == (True, False, None, True)
    calls = []
    inner.transformer.h[0].attn.register_forward_pre_hook(lambda *_: calls.append(1))
    ck.set(True)
    assert hf_checkpointing_state(inner)
    calls.clear()
    grads = grads_of(model, gpt2_loss)
    assert len(calls) == 2                          # recomputed in backward
    assert grads.keys() == reference.keys()
    assert all(torch.equal(grads[n], reference[n]) for n in grads)
    ck.restore()
    assert not hf_checkpointing_state(inner) and not ck.on
    assert hf_internals.require_grads_hooks(inner) == []  # the input hooks the switch made are gone


def test_blocks_wrapped_from_outside_a_cached_decoder_fail_where_its_switch_does_not():
    # Why the wrapper's model is switched: torch's checkpoint around GPT-2's blocks recomputes them with
    # the key/value cache on, and the recompute appends the keys a second time: 16 keys against a
    # padded row's mask of 8.
    batch = gpt2_batch(rows=4, seq=8)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][0, -2:] = 0
    model = lora(tiny_gpt2()).train()
    outside = Checkpointing(model.get_base_model().transformer.h)  # a ModuleList: wrapped from outside
    outside.set(True)
    with pytest.raises(RuntimeError, match=re.escape("The size of tensor a (16) must match the size of "
                                                     "tensor b (8) at non-singleton dimension 3")):
        model(**batch).loss.backward()
    outside.release()  # the cache its calls kept holds the failed graph (see checkpointing._Call)
    model = lora(tiny_gpt2()).train()
    Checkpointing(model).set(True)
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_a_wrapper_with_parameters_of_its_own_has_its_blocks_wrapped():
    class Headed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = tiny_bert().bert
            self.head = torch.nn.Linear(32, 1)

        def forward(self, input_ids):
            return self.head(self.bert(input_ids=input_ids).last_hidden_state).mean()

    model = Headed()
    ck = Checkpointing(model)
    assert (ck.hf, ck.blocks) == (False, model.bert.encoder.layer)


def test_a_lora_run_steps_down_to_checkpointing_with_the_plain_loops_parameters():
    import autofit
    from autofit.plans.ladder import checkpointing
    from reference import lm_batches, plain_loop
    batches = lm_batches(2, rows=4, seq=8)
    model = lora(tiny_gpt2())
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count)  # the first plan's first allocation: checkpointing is next
        result = autofit.run(model, batches, precision="fp32", progress=False, ladder=checkpointing())
    assert [(a.step, a.plan.checkpointing, a.outcome) for a in result.attempts] == [
        (0, False, "oom"), (0, True, "ok"), (1, True, "ok")]
    reference = lora(tiny_gpt2())
    plain_loop(reference, batches, [4, 4], tokens=True,
               optimizer=torch.optim.AdamW(p for p in reference.parameters() if p.requires_grad))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert not hf_checkpointing_state(model.get_base_model())  # handed back as it came


class Writes(torch.nn.Module):
    """A block whose forward writes state besides its output, or draws from a source torch's
    checkpoint does not fork: what its recompute must not do a second time."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, torch.nn.Linear(16, 16)
        if kind == "spectral-norm":  # power-iteration vectors, updated in every training forward
            self.lin = torch.nn.utils.parametrizations.spectral_norm(self.lin)
        self.norm = torch.nn.InstanceNorm1d(4, track_running_stats=True)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.gen = torch.Generator().manual_seed(123)

    def forward(self, x):
        if self.kind == "counter":
            self.calls += 1
        elif self.kind == "own-generator":
            x = x + 0.1 * torch.randn(x.shape, generator=self.gen)
        elif self.kind == "python-random":
            x = x * (1 + 0.2 * random.random())
        elif self.kind == "numpy-random":
            x = x * (1 + 0.2 * float(numpy.random.rand()))
        h = self.lin(x)
        if self.kind == "instance-norm":
            h = self.norm(h.view(-1, 4, 4)).view(-1, 16)
        return torch.tanh(h)


def _writer(kind):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), *[Writes(kind) for _ in range(3)], torch.nn.Linear(16, 3))


@pytest.mark.parametrize("kind", ["spectral-norm", "counter", "instance-norm", "own-generator", "python-random",
                                  "numpy-random"])
def test_a_recompute_starts_from_what_the_forward_found_and_leaves_what_it_left(kind):
    """Checkpointed blocks give the plain loop's parameters, buffers and generators: a spectral
    norm recomputed from vectors its forward already moved would compute another weight (wrong
    gradients), a counter or tracked statistics would move twice, a draw would differ."""
    import autofit
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    def train(checkpointed):
        model = _writer(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        random.seed(7)
        numpy.random.seed(7)
        if checkpointed:
            plan = autofit.Plan(micro_batch_size=8, checkpointing=True)
            with autofit.stepper(model, opt, loss_fn=loss_fn, precision="fp32", cache=False) as step:
                step.load_state_dict({"version": 1, "plan": plan.to_dict(), "sizes": {"fits": [], "fails": []}})
                assert [step(b).plan for b in data] == [plan] * 3
        else:
            for b in data:
                loss_fn(model, b).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return model, (random.random(), float(numpy.random.rand()))
    got, got_draws = train(True)
    want, want_draws = train(False)
    for (name, a), b in zip(list(got.state_dict().items()), want.state_dict().values()):
        assert torch.equal(a, b), name
    assert [m.gen.get_state().tolist() for m in got[1:4]] == [m.gen.get_state().tolist() for m in want[1:4]]
    assert got_draws == want_draws
    if kind == "counter":
        assert [int(m.calls) for m in got[1:4]] == [3, 3, 3]


def test_a_transformers_whose_checkpointing_hooks_cannot_be_read_switches_all_the_same(tiny_bert, monkeypatch, caplog):
    """An optional internal missing (transformers' record of the input hooks its switch adds): the
    switch still turns checkpointing on and off; one line, said once, when the runs are set up."""
    from autofit.integrations import transformers_internals as hf_internals
    monkeypatch.setattr(hf_internals, "_source", lambda obj: "")  # enable_input_require_grads sets no record
    hf_internals.supported.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="autofit"):
            switches = [Checkpointing(tiny_bert), Checkpointing(tiny_bert)]
            states = []
            for on in (True, False):
                switches[0].set(on)
                states.append(hf_checkpointing_state(tiny_bert))
    finally:
        hf_internals.supported.cache_clear()
    assert states == [True, False]
    assert [r.getMessage().split(":")[1] for r in caplog.records] == [
        " activation checkpointing of a transformers model skipped in part"]


def test_a_checkpointed_batchnorm_model_is_estimated_on_fake_tensors():
    """The recompute's guard compares a block's buffers by value; fake tensors have none, so the
    estimate of a checkpointed BatchNorm CNN is made on fake tensors (not sampled on real rows), and
    its running statistics are put back as they are in a real step."""
    import autofit
    from autofit.plans.plan import Plan
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    batch = (torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,)))

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])
    est = autofit.estimate(model, batch, Plan(8, checkpointing=True), loss_fn=loss, device_type="cpu")
    assert est.method == "fake"


class Annealed(torch.nn.Module):
    """Scales its output by a schedule of its own call count (annealed noise, a router temperature)."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x) * (1.0 + 0.5 / self.calls))  # tanh saves what the scale made


class CountingNet(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList(Annealed(8) for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _counting_loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_a_forward_counter_moves_once_per_forward_under_checkpointing():
    """Every forward without checkpointing runs out of memory: the ladder turns checkpointing on. The recompute in backward sees the counter the forward found, so the run ends
    as the plain loop with the same splits (no checkpointing), counters included."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)) for _ in range(3)]
    model = CountingNet()

    def needs_checkpointing(module, args):
        if not getattr(module.blocks[0].forward, "__autofit_checkpoint__", False):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    model.register_forward_pre_hook(needs_checkpointing)
    sgd = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    result = autofit.run(model, data, loss_fn=_counting_loss, optimizer=sgd, precision="fp32", progress=False,
                         cache=False, capacity_check=False)
    assert [(a.step, a.plan.micro_batch_size, a.plan.checkpointing, a.outcome) for a in result.attempts] == [
        (0, 16, False, "oom"), (0, 16, True, "ok"), (1, 16, True, "ok"), (2, 16, True, "ok")]
    finals = [h["plan"].micro_batch_size for h in result.history]
    plain = CountingNet()
    opt = sgd(plain.parameters())
    for (x, y), micro in zip(data, finals):
        for i in range(0, 16, micro):
            (_counting_loss(plain, (x[i:i + micro], y[i:i + micro])) * (min(micro, 16 - i) / 16)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert [b.calls for b in model.blocks] == [b.calls for b in plain.blocks] == [sum(16 // m for m in finals)] * 3
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert (mine - theirs).abs().max().item() <= 1e-6
