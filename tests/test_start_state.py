"""Every attempt starts from everything a step can write: frozen parameters written in forward
(running statistics kept as parameters), an EMA copy updated by a forward hook through `.data`, a
generator the model holds, gradients present when the step is called, and gradients the failed
backward put on leaves outside the model. Each case: one OOM injected, then the result is compared
bit for bit (fp32) with the plain loop using the same splits."""

import copy

import pytest
import torch
import torch.nn.functional as F

import autofit
from reference import device_copy

pytestmark = pytest.mark.usefixtures("frozen_heap")


def halve(plan):
    return plan.replace(micro_batch_size=plan.micro_batch_size // 2) if plan.micro_batch_size > 1 else None


class Stateful(torch.nn.Module):
    """Running statistics as frozen parameters (written by batch_norm's kernel, `_version` unmoved),
    a counter written through `.data`, noise from its own generator, an EMA copy of its head."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        self.mean = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
        self.var = torch.nn.Parameter(torch.ones(8), requires_grad=False)
        self.seen = torch.nn.Parameter(torch.zeros(()), requires_grad=False)
        self.proj = torch.nn.Linear(8, 8).requires_grad_(False)  # frozen, only read
        self.noise = torch.Generator().manual_seed(7)
        self.ema = copy.deepcopy(self.head)  # not trained: the optimizer gets the others
        self.register_forward_hook(Stateful._average)

    def trained(self):
        return list(self.lin.parameters()) + list(self.head.parameters())

    @staticmethod
    def _average(module, args, out):
        for e, p in zip(module.ema.parameters(), module.head.parameters()):
            e.data.mul_(0.9).add_(p.data, alpha=0.1)

    def forward(self, x):
        h = F.batch_norm(self.lin(x), self.mean, self.var, training=self.training, momentum=0.1)
        self.seen.data += 1
        h = self.proj(h) + 0.1 * torch.randn(h.shape, generator=self.noise)
        return self.head(torch.relu(h))


def make():
    torch.manual_seed(0)
    return Stateful()


def batches(n=3, rows=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 4, generator=g), torch.randint(0, 2, (rows,), generator=g)) for _ in range(n)]


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def state(model):
    return {**{k: v.detach().clone() for k, v in model.state_dict().items()},
            **{f"{k}.grad": p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def oom_in_backward(model, gpu, forward):
    """Fail the first allocation of the backward of the model's `forward`-th forward (1-based):
    its forward has written everything it writes."""
    calls = [0]

    def hook(module, args, out):
        calls[0] += 1
        if calls[0] == forward:
            out.register_hook(lambda grad: gpu.fail_at(gpu.allocation_count))
    return model.register_forward_hook(hook)


def test_frozen_parameters_an_ema_and_a_generator_are_restored_for_the_replay():
    model = make()
    opt = torch.optim.SGD(model.trained(), lr=0.1, momentum=0.9)
    with autofit.simulate_gpu() as gpu:
        handle = oom_in_backward(model, gpu, 2)  # step 1's first (whole-batch) attempt
        result = autofit.run(model, batches(), loss_fn=loss_fn, optimizer=opt, precision="fp32",
                             progress=False, cache=False, ladder=halve)
        handle.remove()
    assert [a.outcome for a in result.attempts] == ["ok", "oom", "ok", "ok"]
    assert result.attempts[1].where == "backward"
    splits = [h["plan"].micro_batch_size for h in result.history]
    assert splits[:2] == [8, 4]
    reference = make()
    ref_opt = torch.optim.SGD(reference.trained(), lr=0.1, momentum=0.9)
    for batch, micro in zip(batches(), splits):
        x, y = batch
        for i in range(0, len(x), micro):
            part = device_copy((x[i:i + micro], y[i:i + micro]))  # as the simulated GPU copies it
            (loss_fn(reference, part) * (len(part[0]) / len(x))).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert_same(state(model), state(reference))
    assert torch.equal(model.noise.get_state(), reference.noise.get_state())
    assert float(model.seen) == 1 + 2 + 2  # one whole forward, then two micro-batches twice


class Generator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3, 4)

    def forward(self, z):
        return self.net(z)


def gan():
    torch.manual_seed(0)
    return Generator(), torch.nn.Linear(4, 1)


def gan_batches(n=3, rows=8):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(rows, 3, generator=g) for _ in range(n)]


def test_entry_gradients_are_kept_and_a_failed_backward_leaves_nothing_outside_the_model():
    """A generator step whose loss reaches the discriminator, after a regulariser the user
    backpropagated before calling step(): the regulariser's gradient is part of the step, and the
    discriminator's gradients are what the plain loop leaves, with an OOM in the first backward."""
    gen, disc = gan()
    opt = torch.optim.SGD(gen.parameters(), lr=0.1)

    def generator_loss(model, z):
        return -disc(model(z)).mean()

    splits = []
    with autofit.simulate_gpu() as gpu:
        fired = []

        def arm(grad):
            if not splits and not fired:
                fired.append(True)
                gpu.fail_at(gpu.allocation_count)
            return grad
        disc.weight.register_hook(arm)
        with autofit.stepper(gen, opt, loss_fn=generator_loss, precision="fp32", ladder=halve,
                             cache=False) as step:
            for z in gan_batches():
                (0.01 * gen.net.weight.square().sum()).backward()  # the user's regulariser
                splits.append(step(z).plan.micro_batch_size)
    assert fired and splits[0] == 4
    after = {"gen": state(gen), "disc": state(disc)}
    gen_r, disc_r = gan()
    opt_r = torch.optim.SGD(gen_r.parameters(), lr=0.1)
    for z, micro in zip(gan_batches(), splits):
        (0.01 * gen_r.net.weight.square().sum()).backward()
        for i in range(0, len(z), micro):
            part = z[i:i + micro].clone()  # as the simulated GPU copies it (reference.device_copy)
            (-disc_r(gen_r(part)).mean() * (len(part) / len(z))).backward()
        opt_r.step()
        opt_r.zero_grad(set_to_none=True)
    assert_same(after["gen"], state(gen_r))
    assert_same(after["disc"], state(disc_r))
    assert disc.weight.grad is not None  # accumulated over three steps, as in the plain loop


def test_frozen_parameters_no_step_writes_are_copied_once():
    from autofit.engine.replay import StartState
    from autofit.gpu.device import CpuDevice
    model = make()
    opt = torch.optim.SGD(model.trained(), lr=0.1)
    start = StartState(model, opt, CpuDevice())
    frozen = len([p for p in model.parameters() if id(p) not in {id(q) for q in model.trained()}])
    start.capture(batches()[0])
    assert start.untrained.copies == frozen  # the first captures copy every one
    for _ in range(2):
        model(batches()[0][0])
        start.capture(batches()[0])
    assert start.untrained.copies == 2 * frozen + 5  # learned from two steps: 5 are written
    names = {(id(m), n): f"{prefix}.{n}".lstrip(".") for prefix, m in model.named_modules()
             for n in m._parameters}
    written = {names[key] for key in start.untrained.written}
    assert written == {"mean", "var", "seen", "ema.weight", "ema.bias"}  # not proj: only read
    for _ in range(2):
        model(batches()[0][0])
        start.capture(batches()[0])
    assert start.untrained.copies == 2 * frozen + 3 * 5


class Noisy(torch.nn.Module):
    """Noise from a generator the model holds, and an ActNorm-style layer: buffers initialised from
    the first batch, the flag that says so (a uint8 buffer) and a step counter written through
    `.data`, which moves no `_version`."""

    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(5)
        self.lin, self.head = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)
        self.register_buffer("loc", torch.zeros(16))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))
        self.register_buffer("steps", torch.tensor(0))

    def forward(self, x):
        h = self.lin(x + 0.1 * torch.randn(x.shape, generator=self.gen))
        self.steps.data += 1
        if not self.initialized:
            with torch.no_grad():
                self.loc.copy_(-h.mean(0))
            self.initialized.data.fill_(1)
        return self.head(torch.tanh(h + self.loc))


def noisy_batches(n=3, rows=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]


def plain_noisy(splits, aux=None):
    torch.manual_seed(0)
    model = Noisy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for (x, y), micro in zip(noisy_batches(), splits):
        for i in range(0, len(x), micro):
            part = device_copy((x[i:i + micro], y[i:i + micro]))
            (loss_fn(model, part) * (len(part[0]) / len(x))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def test_a_flag_written_through_data_in_the_failed_first_forward_is_put_back():
    """An OOM in the first step's backward, after the forward initialised the layer: the replay
    must initialise it again (the flag back at 0), as the plain loop's only forward did."""
    torch.manual_seed(0)
    model = Noisy()
    with autofit.simulate_gpu() as gpu:
        handle = oom_in_backward(model, gpu, 1)
        with autofit.stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                             precision="fp32", ladder=halve, cache=False) as step:
            outs = [step(b) for b in noisy_batches()]
        handle.remove()
    assert [(a.outcome, a.where) for a in outs[0].attempts] == [("oom", "backward"), ("ok", "")]
    splits = [o.plan.micro_batch_size for o in outs]
    reference = plain_noisy(splits)
    assert_same(state(model), state(reference))
    assert int(model.steps) == sum(-(-8 // m) for m in splits)  # the failed forward left no count
    assert torch.equal(model.gen.get_state(), reference.gen.get_state())


def test_the_capacity_check_leaves_a_generator_the_model_holds_as_it_was():
    """With a budget the check walks the model's forward on fake tensors before the first step: the
    noise the model then draws is the plain loop's."""
    torch.manual_seed(0)
    model = Noisy()
    with autofit.stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                         budget="64MiB", cache=False) as step:
        outs = [step(b) for b in noisy_batches()]
    assert outs[0].attempts[0].reason.startswith("estimated")
    assert [o.plan.micro_batch_size for o in outs] == [8, 8, 8]
    reference = plain_noisy([8, 8, 8])
    assert_same(state(model), state(reference))


def test_a_leaf_outside_the_model_reached_by_a_later_micro_batch_only_keeps_its_entry_gradient():
    """An auxiliary head outside the model scores the flagged rows only, all in the second
    micro-batch; an OOM after the backward (in clipping) must take back the gradient that
    micro-batch put on it, not only what the first one reached."""
    torch.manual_seed(5)
    aux = torch.nn.Linear(3, 1)
    aux_ref = copy.deepcopy(aux)

    def loss_for(head):
        def loss(model, batch):
            x, y, flagged = batch
            out = model(x)
            value = F.cross_entropy(out, y)
            if flagged.any():
                value = value + head(out[flagged]).pow(2).mean() * flagged.float().mean()
            return value
        return loss
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g), torch.arange(8) >= 7)
            for _ in range(2)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    clips, real_clip = [], torch.nn.utils.clip_grad_norm_
    with autofit.simulate_gpu() as gpu:
        def clip(*args, **kwargs):  # the first clipping (step 0's first attempt) runs out of memory
            clips.append(1)
            if len(clips) == 1:
                gpu.fail_at(gpu.allocation_count)
            return real_clip(*args, **kwargs)
        plan = autofit.Plan(micro_batch_size=4, accumulation_steps=2)
        try:
            torch.nn.utils.clip_grad_norm_ = clip
            with autofit.stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_for(aux),
                                 precision="fp32", max_grad_norm=1.0, cache=False) as step:
                step.load_state_dict({"version": 1, "plan": plan.to_dict(), "sizes": {"fits": [], "fails": []}})
                outs = [step(b) for b in data]
        finally:
            torch.nn.utils.clip_grad_norm_ = real_clip
    assert [(a.outcome, a.where, a.plan.micro_batch_size) for a in outs[0].attempts] == [
        ("oom", "optimizer.step", 4), ("ok", "", 4)]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch, out in zip(data, outs):
        micro = out.plan.micro_batch_size
        for i in range(0, 8, micro):
            part = device_copy(tuple(t[i:i + micro] for t in batch))
            (loss_for(aux_ref)(reference, part) * (len(part[0]) / 8)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_same(state(model), state(reference))
    assert torch.equal(aux.weight.grad, aux_ref.weight.grad) and torch.equal(aux.bias.grad, aux_ref.bias.grad)


class Counting(torch.nn.Module):
    """State kept in plain attributes: a running input scale (a tensor, not a buffer) written in
    place, a Python counter and a dict of counts."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.scale = torch.ones(6)
        self.forwards = 0
        self.seen = {"rows": 0}

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.5).add_(0.5 * x.abs().mean(0))
        self.forwards += 1
        self.seen["rows"] += len(x)
        return self.body(x / self.scale)


def test_plain_attributes_a_forward_writes_are_restored_for_the_replay_and_after_the_probe():
    data = noisy_batches()
    torch.manual_seed(0)
    model = Counting()
    with autofit.simulate_gpu() as gpu:
        handle = oom_in_backward(model, gpu, 2)  # step 1's first attempt
        with autofit.stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                             precision="fp32", ladder=halve, cache=False) as step:
            outs = [step(b) for b in data]
        handle.remove()
    assert [[a.outcome for a in o.attempts] for o in outs][1] == ["oom", "ok"]
    splits = [o.plan.micro_batch_size for o in outs]
    torch.manual_seed(0)
    reference = Counting()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for (x, y), micro in zip(data, splits):
        for i in range(0, len(x), micro):
            part = device_copy((x[i:i + micro], y[i:i + micro]))
            (loss_fn(reference, part) * (len(part[0]) / len(x))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_same(state(model), state(reference))
    assert torch.equal(model.scale, reference.scale)
    # the failed attempt's forward and the reduction probe's are not counted, as in the plain loop
    assert (model.forwards, model.seen) == (reference.forwards, reference.seen) == (
        sum(-(-8 // m) for m in splits), {"rows": 24})
