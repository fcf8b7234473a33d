"""A step that does not run out of memory costs what a plain loop costs (guarantee 10): the same
host-device synchronisations, counted op by op on the simulated GPU (diagnosis/syncs), and none of
the start state's walks once it has learned the job: the module tree is walked once, the autograd
graph only while learning (or for a job whose graphs reach leaves outside the model), attributes
are taken by reference. Counts, not timings."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import autofit
from autofit.diagnosis.syncs import SyncCounter
from autofit.engine.controller import Controller, Policy
from autofit.engine.model_state import LEARN_STEPS
from autofit.engine.step import StepRunner
from autofit.gpu.device import SimulatedDevice
from models import bert_batch, tiny_bert

STEPS = 5
COUNTED = 3  # the step whose synchronisations are counted: after the steps the start state learns from


class Block(torch.nn.Module):
    """A block with buffers: one read (a scale), one written in place by every forward (a count)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.calls.add_(1)
        return torch.tanh(self.lin(x) * self.scale)


class Blocks(torch.nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(4)])
        self.head = torch.nn.Linear(8, 2)
        self.checkpointed = checkpointed  # the plain loop's own checkpointing

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def blocks_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def block_batches(on_device):
    g = torch.Generator().manual_seed(1)
    return [tuple(on_device(t) for t in (torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)))
            for _ in range(STEPS)]


def bert_batches(on_device):
    return [{k: on_device(v) for k, v in bert_batch(seed=i).items()} for i in range(STEPS)]


def bert_loss(model, batch):
    return model(**batch).loss


def step_counters(optimizer) -> list:
    """AdamW's step counters: host tensors on a card, counted as device memory by the simulation."""
    return [s["step"] for s in optimizer.state.values() if "step" in s]


def plain_syncs(make, loss_fn, data, device, optimizer, copy):
    """Synchronisations of the plain loop's step COUNTED: forward, backward, step, zero_grad and
    the loss read once (`copy`: the copy of a host batch to the device, or none)."""
    model = make()
    device.place_model(model)
    opt = optimizer(model.parameters())
    for i, batch in enumerate(data):
        counter = SyncCounter(device, step_counters(opt)) if i == COUNTED else None
        with counter if counter is not None else _nothing():
            loss = loss_fn(model, copy(batch))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
        if counter is not None:
            counted = dict(counter.counts)
    return counted


def autofit_syncs(make, loss_fn, data, device, optimizer, plan):
    model = make()
    opt = optimizer(model.parameters())
    with autofit.stepper(model, opt, loss_fn=loss_fn, precision="fp32", cache=False) as step:
        step.load_state_dict({"version": 1, "plan": plan.to_dict(), "sizes": {"fits": [], "fails": []}})
        for i, batch in enumerate(data):
            counter = SyncCounter(device, step_counters(opt)) if i == COUNTED else None
            with counter if counter is not None else _nothing():
                out = step(batch)
            assert out.plan == plan and [a.outcome for a in out.attempts] == ["ok"]
            if counter is not None:
                counted = dict(counter.counts)
    return counted


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


CASES = {
    # name: (model, loss_fn, batches, optimizer, plan, plain loop's model, batch on the device)
    "transformer": (tiny_bert, bert_loss, bert_batches, adamw, dict(checkpointing=False), tiny_bert, False),
    "buffer per block, checkpointed": (Blocks, blocks_loss, block_batches, sgd, dict(checkpointing=True),
                                       lambda: Blocks(checkpointed=True), False),
    "batch on the device": (tiny_bert, bert_loss, bert_batches, adamw, dict(checkpointing=False), tiny_bert, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_steady_step_makes_the_plain_loops_synchronisations_and_no_more(case):
    make, loss_fn, batches, optimizer, switches, plain_model, resident = CASES[case]
    plan = autofit.Plan(micro_batch_size=8, accumulation_steps=1, **switches)
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        on_device = (lambda t: t.clone()) if resident else (lambda t: t)  # made inside: on the device
        copy = (lambda b: b) if resident else device.to_device
        plain = plain_syncs(plain_model, loss_fn, batches(on_device), device, optimizer, copy)
        ours = autofit_syncs(make, loss_fn, batches(on_device), device, optimizer, plan)
    assert plain.get("_local_scalar_dense") == 1 + (case != "buffer per block, checkpointed")  # + BERT's mask.all()
    assert ours == plain


def controller_run(make, loss_fn, batches, steps=STEPS):
    """A controller on the simulated GPU training `steps` batches under one plan; returns it."""
    model = make()
    with autofit.simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        runner = StepRunner(model, torch.optim.SGD(model.parameters(), lr=0.1), device, loss_fn=loss_fn)
        plan = autofit.Plan(micro_batch_size=4, accumulation_steps=2)
        controller = Controller(runner, lambda p: None, plan, policy=Policy(quiet=True, probe_up=False))
        for i, batch in enumerate(batches[:steps]):
            controller.train(batch, i)
            if i == 2:
                model.late = torch.nn.Identity()  # a module registered mid-run: the tree is walked again
        runner.close()
    return controller


def test_the_start_state_walks_the_tree_once_a_change_and_graphs_only_while_learning():
    """Every capture of a steady run: the module list is the one walk's (walked again after a module
    is registered), attributes are references (nothing of BERT's is copied), and each micro-batch's
    graph is walked at the learning captures only."""
    controller = controller_run(tiny_bert, bert_loss, bert_batches(lambda t: t))
    start = controller.start
    assert start.tree.walks == 2  # the first capture's, and after `late` was registered
    assert start.attributes.scans == LEARN_STEPS + 1  # the learning captures, and after the new walk
    # numbers, strings and tuples are taken by reference: BERT's only mutable attributes are copied
    assert [(type(m).__name__, name, kind) for m, name, _v, kind, _c in start.attributes.contents] == [
        ("BertForSequenceClassification", "all_tied_weights_keys", "contents"),
        ("BertModel", "all_tied_weights_keys", "contents")]
    assert start.gradients.walks == LEARN_STEPS * 2  # two micro-batches a step, while learning
    assert start.buffers.copies == 2 * STEPS  # BERT's two buffers, at every capture


class Discriminator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Linear(8, 8)


def test_a_job_whose_graphs_reach_leaves_outside_the_model_keeps_walking_them():
    """A loss reaching a discriminator's parameters: those leaves keep their entry gradients at
    every step, so every micro-batch's graph is walked at every capture."""
    disc = Discriminator()

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(disc.net(x)), y)
    controller = controller_run(Blocks, loss_fn, block_batches(lambda t: t))
    assert controller.start.gradients.walks == STEPS * 2
    assert disc.net.weight.grad is not None


def halve(plan):
    return plan.replace(micro_batch_size=plan.micro_batch_size // 2) if plan.micro_batch_size > 1 else None


class Late(torch.nn.Module):
    """Keeps the row counts it sees in a list it creates at its fourth forward, after the captures
    the start state learns from."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 3)
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        if self.forwards == 4:
            self.seen = []
        if hasattr(self, "seen"):
            self.seen.append(len(x))
        return self.body(x)


def test_an_attribute_created_after_the_learning_captures_is_copied_before_a_failure_changes_it():
    """The module gains an attribute: the next capture walks the attributes again, so the failed
    attempt's append is undone and the list is what the plain loop leaves."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)]
    model = Late()
    with autofit.simulate_gpu() as gpu:
        fired = []  # once: the fifth forward, step 4's first attempt (the list exists since step 3)

        def hook(module, args, out):
            if module.forwards == 5 and not fired:
                fired.append(True)
                out.register_hook(lambda grad: gpu.fail_at(gpu.allocation_count))
        model.register_forward_hook(hook)
        with autofit.stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=blocks_loss,
                             precision="fp32", ladder=halve, cache=False) as step:
            outs = [step(b) for b in data]
    # a size this run proved is replayed once before the failure counts: step 4 is whole again
    assert [(a.outcome, a.plan.micro_batch_size) for a in outs[4].attempts] == [("oom", 8), ("ok", 8)]
    assert model.seen == [8, 8, 8]  # steps 3, 4 and 5; the failed attempt's append undone


class Rebound(Late):
    """As Late, but the list's name exists from the start (None): no attribute is gained."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def forward(self, x):
        self.forwards += 1
        if self.forwards == 4:
            self.seen = []
        if self.seen is not None:
            self.seen.append(len(x))
        return self.body(x)


def test_an_attribute_rebound_to_a_list_after_the_last_walk_is_said_and_copied_from_then_on(caplog):
    """What the walks cannot see without looking at every value: a name that held None at the last
    walk, rebound to a list that the failed attempt appends to. It is put back by reference (the
    append stays), autofit says so, and the list is copied from the next capture on."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(7)]
    model = Rebound()
    fired = []
    with autofit.simulate_gpu() as gpu:
        def hook(module, args, out):
            if module.forwards in (5, 7) and len(fired) < (1 if module.forwards == 5 else 2):
                fired.append(module.forwards)
                out.register_hook(lambda grad: gpu.fail_at(gpu.allocation_count))
        model.register_forward_hook(hook)
        with caplog.at_level("WARNING", logger="autofit"):
            with autofit.stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=blocks_loss,
                                 precision="fp32", ladder=halve, cache=False) as step:
                outs = [step(b) for b in data]
    assert fired == [5, 7] and [len(o.attempts) for o in outs] == [1, 1, 1, 1, 2, 1, 2]
    assert model.seen == [8] * 5  # steps 3-6 once each, and step 4's failed append (step 6's is undone)
    said = [r.getMessage() for r in caplog.records if "was rebound to a list" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("Rebound.seen was rebound to a list")
