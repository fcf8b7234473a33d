"""Guarantee 1 on real jobs: with OOMs injected in forward, backward and the optimizer step, the
parameters and buffers are bit-identical to a plain loop using each global batch's final split
(dropout, a shuffled DataLoader with workers, BatchNorm, every torch optimizer, a subclass)."""

import copy
import random

import numpy as np
import pytest
import torch
import torch.optim.optimizer as torch_optimizer

import autofit
from autofit.plans.ladder import offload_optimizer
from reference import bert, plain_loop, plain_loop_fn

# Many runs, each ending (and recovering from an OOM) with a full gc.collect(): see frozen_heap.
pytestmark = pytest.mark.usefixtures("frozen_heap")


def halve(plan):
    return plan.replace(micro_batch_size=plan.micro_batch_size // 2) if plan.micro_batch_size > 1 else None


def splits(result, epoch=None):
    return [h["plan"].micro_batch_size for h in result.history if epoch is None or h["epoch"] == epoch]


def assert_same(model, reference):
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(a, b), name


class OomAt:
    """Injects one OOM into global step `step` (0-based; no split before it): in its forward (the
    first allocation), its backward (the first allocation once backward starts), or its optimizer
    step (raised by a post-step hook once the whole update is applied, the worst case to undo; a
    fault is armed meanwhile, so the step runs guarded as on a card with no room to spare)."""

    def __init__(self, model, gpu, step, phase):
        self.gpu, self.step, self.phase, self.forwards, self.fired = gpu, step, phase, 0, False
        self.handles = [model.register_forward_pre_hook(self._forward),
                        model.register_forward_hook(self._output),
                        torch_optimizer.register_optimizer_step_post_hook(self._stepped)]

    def _now(self):
        return not self.fired and self.forwards == self.step + 1

    def _forward(self, *_):
        self.forwards += 1
        if self._now() and self.phase == "forward":
            self.fired = True
            self.gpu.fail_at(self.gpu.allocation_count)
        elif self._now() and self.phase == "step":
            self.gpu.fail_at(10 ** 12)

    def _output(self, module, args, out):
        if self._now() and self.phase == "backward":
            loss = out if isinstance(out, torch.Tensor) else out.loss

            def arm(grad):
                self.fired = True
                self.gpu.fail_at(self.gpu.allocation_count)
            loss.register_hook(arm)

    def _stepped(self, *_):
        if self._now() and self.phase == "step":
            self.fired = True
            self.gpu.fail_at(None)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")

    def close(self):
        for h in self.handles:
            h.remove()


def faulted(make, run, step, phase):
    """(model, result) of `run` with an OOM injected in `phase` of global step `step`."""
    model = make()
    with autofit.simulate_gpu() as gpu:
        oom = OomAt(model, gpu, step, phase)
        try:
            result = run(model, gpu)
        finally:
            oom.close()
    assert oom.fired
    return model, result


# -- a Hugging Face encoder with dropout, fed by a shuffled DataLoader with workers ---------------

class Rows(torch.utils.data.Dataset):
    def __init__(self, n=24, seq=8, vocab=100):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def shuffled():
    return torch.utils.data.DataLoader(Rows(), batch_size=8, shuffle=True, num_workers=2)


def dropout_bert():
    return bert(seed=0, layers=1, hidden=32, dropout=0.1)


def test_bert_with_dropout_and_a_shuffled_loader_matches_the_plain_loop():
    """OOMs in step 1's forward, backward and optimizer step, and a budget so the capacity check
    runs its estimator first: every run trains in the plain loop's order, bit for bit."""
    def train(model, gpu):
        return autofit.run(model, shuffled(), epochs=2, precision="fp32", progress=False, cache=False,
                           ladder=halve)
    wheres = []
    for step, phase in ((0, "forward"), (1, "backward"), (1, "step")):
        model, result = faulted(dropout_bert, train, step, phase)
        oom = [a for a in result.attempts if a.outcome == "oom"]
        assert [a.step for a in oom] == [step]
        wheres.append(oom[0].where)
        reference = dropout_bert()
        opt = torch.optim.AdamW(reference.parameters())
        loader = shuffled()
        for epoch in range(2):
            plain_loop(reference, loader, splits(result, epoch), optimizer=opt)
        assert_same(model, reference)
    assert wheres == ["forward", "backward", "optimizer.step"]


def test_no_oom_trains_in_the_plain_loops_order_with_the_capacity_check():
    """With a budget the capacity check estimates plans on fake tensors before the first step and
    the first batch is read before it: neither moves the RNG the loader and dropout draw from."""
    model = dropout_bert()
    result = autofit.run(model, shuffled(), epochs=2, budget="1GiB", precision="fp32",
                         progress=False, cache=False, eval_data=shuffled())
    assert result.attempts[0].reason.startswith("estimated")
    assert splits(result) == [8] * 6
    reference = dropout_bert()
    opt = torch.optim.AdamW(reference.parameters())
    loader, eval_loader = shuffled(), shuffled()
    for _ in range(2):
        plain_loop(reference, loader, [8] * 3, optimizer=opt)
        list(eval_loader)  # a plain loop's evaluation reads the eval loader once per epoch
    assert_same(model, reference)


# -- a model that draws from Python's `random` and numpy's global generator ------------------------

class LayerDrop(torch.nn.Module):
    """Layer-drop written with `random.random()` and input noise from `np.random`, as people write
    them: a replay must draw the same numbers as the failed attempt did."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(4))
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        noise = np.random.normal(0.0, 0.5, size=tuple(x.shape)).astype("float32")
        x = x + torch.from_numpy(noise)
        for layer in self.layers:
            if not self.training or random.random() >= 0.5:
                x = torch.relu(layer(x))
        return self.head(x)


def layer_drop():
    torch.manual_seed(0)
    return LayerDrop()


def seeded(seed=5):
    random.seed(seed)
    np.random.seed(seed)


def test_a_replay_draws_pythons_and_numpys_random_numbers_again():
    """An OOM in step 1's forward and in its backward, and a budget so the capacity check traces the
    forward (its Python code draws too) before the first step: the plain loop's parameters, bit for bit."""
    batches = mlp_batches(n=3, rows=8)

    def train(model, gpu):
        seeded()
        return autofit.run(model, batches, loss_fn=mlp_loss, optimizer=sgd, precision="fp32",
                           progress=False, cache=False, ladder=halve)

    def matches(model, result):
        reference = layer_drop()
        seeded()
        plain_loop_fn(reference, batches, splits(result), mlp_loss, sgd(reference.parameters()))
        assert_same(model, reference)

    for phase in ("forward", "backward"):
        model, result = faulted(layer_drop, train, 1, phase)
        assert [(a.step, a.outcome) for a in result.attempts if a.outcome == "oom"] == [(1, "oom")]
        assert splits(result) == [8, 4, 6]  # halved, then probed up
        matches(model, result)
    model = layer_drop()
    seeded()
    result = autofit.run(model, batches, loss_fn=mlp_loss, optimizer=sgd, budget="1GiB", precision="fp32",
                         progress=False, cache=False)
    assert result.attempts[0].reason.startswith("estimated")
    matches(model, result)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# -- every torch optimizer, and a subclass ---------------------------------------------------------

class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def mlp():
    torch.manual_seed(0)
    return Mlp()


def mlp_loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def mlp_batches(n=3, rows=8):
    g = torch.Generator().manual_seed(4)
    return [{"x": torch.randn(rows, 6, generator=g), "y": torch.randint(0, 3, (rows,), generator=g)}
            for _ in range(n)]


def test_odd_splits_on_the_simulated_gpu_equal_a_plain_loop_fed_device_copies():
    """Micro-batches of 3 and 5 rows of 6 floats start at row offsets that are not multiples of 16
    bytes; the simulated GPU copies each micro-batch (as `.to("cuda")` does), so the plain loop that
    checks it bit for bit feeds copies too (reference.device_copy): equal to the last bit. (Fed views,
    this CPU's gemm for Linear(6, 16) on 3 rows differs in the last ulp: a plain loop on the device
    gets copies, so copies are the reference.)"""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def loss(model, batch):
        return torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"].float())

    def oom_once(model, batch, fired=[]):
        if len(batch["x"]) == 8 and not fired:  # the first whole-batch attempt
            fired.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. (test)")
        return loss(model, batch)

    def three_first(plan):
        return plan.with_micro_batch(3, 8) if plan.micro_batch_size > 3 else None
    model, data = net(), mlp_batches()  # host batches: the simulated GPU copies each micro-batch
    with autofit.simulate_gpu():
        result = autofit.run(model, data, loss_fn=oom_once, optimizer=sgd, precision="fp32",
                             progress=False, cache=False, capacity_check=False, ladder=three_first)
    assert splits(result) == [3, 5, 6]  # the upward probe after the first step
    reference = net()
    plain_loop_fn(reference, mlp_batches(), splits(result), loss, sgd(reference.parameters()))
    assert_same(model, reference)


class CountingClipSGD(torch.optim.SGD):
    """A subclass people write: its own constructor argument and a step counter in param_groups."""

    def __init__(self, params, lr=0.1, max_norm=1.0, foreach=None):
        super().__init__(params, lr=lr, momentum=0.9, nesterov=True, foreach=foreach)
        self.max_norm = max_norm

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.clamp_(-self.max_norm, self.max_norm).div_(group["count"])
        return super().step()


OPTIMIZERS = {  # name: (class, arguments)
    "SGD": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "Adam": (torch.optim.Adam, dict(lr=0.01)),
    "AdamW": (torch.optim.AdamW, dict(lr=0.01)),
    "Adamax": (torch.optim.Adamax, dict(lr=0.01)),
    "NAdam": (torch.optim.NAdam, dict(lr=0.01)),
    "RAdam": (torch.optim.RAdam, dict(lr=0.01)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5)),
    "Rprop": (torch.optim.Rprop, dict(lr=0.01)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=0.1)),
    "Adadelta": (torch.optim.Adadelta, dict()),
    "ASGD": (torch.optim.ASGD, dict(lr=0.01)),
    "Adafactor": (torch.optim.Adafactor, dict(lr=0.01)),
    "CountingClipSGD": (CountingClipSGD, dict(lr=0.1, max_norm=0.002)),
}


def optimizer_factory(name, foreach):
    """foreach=True is what a CUDA card runs."""
    cls, kwargs = OPTIMIZERS[name]
    return lambda params: cls(params, foreach=foreach, **kwargs)


def train_mlp(factory, ladder=halve):
    batches = mlp_batches()
    return lambda model, gpu: autofit.run(model, batches, loss_fn=mlp_loss, optimizer=factory,
                                          precision="fp32", progress=False, cache=False, ladder=ladder)


def matches_plain_loop(model, result, factory):
    reference = mlp()
    plain_loop_fn(reference, mlp_batches(), splits(result), mlp_loss, factory(reference.parameters()))
    assert_same(model, reference)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_replays_bit_identically(name):
    """An OOM once the second optimizer.step has applied its whole update (state, parameters and
    any counter in param_groups), and one in the third step's backward: rolled back, replayed."""
    factory = optimizer_factory(name, foreach=True)
    for step, phase, where in ((1, "step", "optimizer.step"), (2, "backward", "backward")):
        model, result = faulted(mlp, train_mlp(factory), step, phase)
        assert [(a.step, a.where) for a in result.attempts if a.outcome == "oom"] == [(step, where)]
        matches_plain_loop(model, result, factory)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_under_offload_matches_the_plain_loop(name):
    """An OOM in the second step's forward moves the optimizer to the host (its state and
    param_groups stay the optimizer's); the run goes on there as the plain loop does."""
    factory = optimizer_factory(name, foreach=True)
    model, result = faulted(mlp, train_mlp(factory, offload_optimizer()), 1, "forward")
    assert [(a.step, a.plan.offload_optimizer, a.outcome) for a in result.attempts] == [
        (0, False, "ok"), (1, False, "oom"), (1, True, "ok"), (2, True, "ok")]
    matches_plain_loop(model, result, factory)


def test_a_closure_optimizer_is_refused_before_training():
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"^LBFGS\.step needs a closure"):
        autofit.run(model, mlp_batches(), loss_fn=mlp_loss, optimizer=torch.optim.LBFGS, progress=False,
                    cache=False)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_sparse_adam_trains_sparse_embeddings_like_the_plain_loop():
    """SparseAdam is handled (its sparse gradients accumulate over micro-batches); the simulated GPU
    cannot count sparse tensors, so the OOM is raised by the loss of the first attempt."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Embedding(20, 4, sparse=True)

    def loss(model, batch):
        return (model(batch["i"]).sum(1) - batch["t"]).pow(2).mean()
    calls = []

    def oom_once(model, batch):
        if not torch.is_grad_enabled():
            return loss(model, batch)  # the reduction probe, before training
        calls.append(len(batch["i"]))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. (test)")
        return loss(model, batch)
    g = torch.Generator().manual_seed(5)
    batches = [{"i": torch.randint(0, 20, (8,), generator=g), "t": torch.randn(8, generator=g)}
               for _ in range(3)]
    factory = lambda p: torch.optim.SparseAdam(list(p), lr=0.1)  # noqa: E731
    model = make()
    result = autofit.run(model, batches, loss_fn=oom_once, optimizer=factory, precision="fp32",
                         progress=False, cache=False, ladder=halve)
    assert calls[:3] == [8, 4, 4] and splits(result)[0] == 4
    reference = make()
    plain_loop_fn(reference, batches, splits(result), loss, factory(reference.parameters()))
    assert_same(model, reference)


def test_state_an_optimizer_allocates_when_built_counts_and_its_oom_is_reported():
    model = mlp()
    states = sum(p.numel() * 4 for p in model.parameters())
    with autofit.simulate_gpu() as gpu:
        gpu.track(list(model.parameters()) + list(model.buffers()))
        before = gpu.memory_allocated()
        opt = torch.optim.Adagrad(model.parameters())
        assert gpu.memory_allocated() - before >= states  # Adagrad's `sum`, made in its constructor
        del opt
    model, batches = mlp(), mlp_batches()
    with autofit.simulate_gpu() as gpu:
        gpu.fail_at(gpu.allocation_count + 2)  # inside Adagrad's constructor
        with pytest.raises(autofit.DoesNotFit, match="the optimizer factory ran out of memory while "
                                                     "building the optimizer"):
            autofit.run(model, batches, loss_fn=mlp_loss, optimizer=torch.optim.Adagrad,
                        progress=False, cache=False)
