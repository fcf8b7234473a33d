"""The estimator's shortcuts change no estimate: the optimizer warmed one parameter per kind, the
dispatch cache shared by the plans of one search, a fake tensor's prim.device answered in the
counting mode, and cut copies that make fakes only for the blocks they keep."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, in_kernel_invocation_manager

from autofit import torch_internals as ti
from autofit.estimator import fakes
from autofit.estimator.estimate import Estimator
from autofit.estimator.repeated import cut_fake_model
from autofit.plans.plan import Plan


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(5)] + [torch.nn.Linear(8, 3, bias=False)]
    model = torch.nn.Sequential(*layers)
    model[1].weight = torch.nn.Parameter(torch.randn(8, 8).t())  # alike shape, other strides
    return model


def _state(optimizer) -> list:
    """Every parameter's state, as metadata and the constants fake tensors keep (step counters)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state[p].items():
                if isinstance(v, torch.Tensor):
                    constant = getattr(v, "constant", None)
                    out.append((k, tuple(v.shape), v.stride(), v.dtype,
                                None if constant is None else constant.item()))
                else:
                    out.append((k, v))
    return out


def _warmed(make, alike: bool):
    with FakeTensorMode():
        model, _ = fakes.fake_model(_model())
        optimizer = make([{"params": list(model.parameters())[:6]},
                          {"params": list(model.parameters())[6:], "lr": 0.5}])
        if alike:
            fakes.warm(optimizer)
        else:  # every parameter stepped, as before the shortcut
            params = [p for g in optimizer.param_groups for p in g["params"]]
            fakes._step_on_zeros(optimizer, params)
            optimizer.zero_grad(set_to_none=True)
    return _state(optimizer), optimizer


def test_warming_one_parameter_per_kind_gives_every_parameter_the_state_a_full_step_makes():
    for make in (lambda g: torch.optim.AdamW(g, foreach=True),
                 lambda g: torch.optim.Adam(g, amsgrad=True),
                 lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9)):
        alike, optimizer = _warmed(make, alike=True)
        whole, _ = _warmed(make, alike=False)
        assert alike == whole
        assert len(optimizer.state) == 11  # 6 layers: 11 parameters, each with its own state
        params = optimizer.param_groups[0]["params"]  # layers 0 and 2: weights of one kind
        assert all(optimizer.state[params[0]][k] is not v for k, v in optimizer.state[params[4]].items())
        assert all(p.grad is None for g in optimizer.param_groups for p in g["params"])
    # Strides are part of a kind: the transposed weight's state keeps its own strides.
    _, optimizer = _warmed(lambda g: torch.optim.AdamW(g), True)
    transposed = optimizer.param_groups[0]["params"][2]
    assert transposed.stride() == optimizer.state[transposed]["exp_avg"].stride() == (1, 8)


def test_an_optimizer_outside_torchs_per_parameter_ones_is_stepped_whole(monkeypatch):
    class Mine(torch.optim.AdamW):
        pass
    stepped = []
    monkeypatch.setattr(Mine, "step", lambda self, closure=None: stepped.append(
        len([p for g in self.param_groups for p in g["params"] if p.grad is not None])))
    _warmed(Mine, alike=True)
    assert stepped == [11]  # one step, on every parameter


def test_one_search_shares_the_dispatch_cache_and_drops_it_at_the_end():
    model = _model()
    batch = torch.randn(8, 8)
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    est, alone = Estimator(model, batch, loss_fn=loss), Estimator(model, batch, loss_fn=loss)
    plans = [Plan(8), Plan(4, 2), Plan(8, precision="bf16")]
    expected = [alone.measure(p) for p in plans]
    cache = FakeTensorMode.cache
    before = len(cache)
    with est.sharing_dispatch_cache():
        shared = [est.measure(p) for p in plans]
        assert len(cache) > before  # kept for the next plan
    assert len(cache) == before
    assert [(e.peak_bytes, e.reserved_bytes, e.breakdown) for e in shared] == \
        [(e.peak_bytes, e.reserved_bytes, e.breakdown) for e in expected]
    est.measure(plans[0])
    assert len(cache) == before  # outside a search, each measure drops its own entries


def test_prim_device_is_answered_as_the_fake_mode_answers_it():
    with FakeTensorMode() as mode:
        fake = torch.empty(2, 3)
        assert ti.fake_device((fake,)) == torch.ops.prim.device.default(fake) == torch.device("cpu")
        with in_kernel_invocation_manager(mode):
            assert ti.fake_device((fake,)) is None  # inside a kernel: left to the fake mode
    assert ti.fake_device((torch.empty(2),)) is None  # a real tensor: dispatched as ever


def test_a_cut_copy_makes_fakes_for_the_blocks_it_keeps_and_for_a_dropped_one_held_elsewhere():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(6))
            self.head = torch.nn.Linear(4, 1)

    net = Net()
    with FakeTensorMode():
        cut, made = cut_fake_model(net, "blocks", 3)
    kept = [p for b in list(net.blocks)[:3] for p in b.parameters()] + list(net.head.parameters())
    assert set(made) == {id(p) for p in kept} and len(cut.blocks) == 3
    net.extra = net.blocks[5]  # a dropped block that the model holds another way too
    with FakeTensorMode():
        cut, made = cut_fake_model(net, "blocks", 3)
    assert set(made) == {id(p) for p in kept + list(net.blocks[5].parameters())}
    assert {id(p) for p in cut.parameters()} == {id(f) for f in made.values()}
