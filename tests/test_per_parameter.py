"""The per-parameter step (the groups' `foreach` off) keeps the user's optimizer: a group added
mid-run gets its own `foreach` back, a state_dict saved under the plan holds the user's values, and
one loaded under it is taken as the user's."""

import torch

import autofit
from autofit.plans.plan import Plan

PLAN = Plan(micro_batch_size=8, accumulation_steps=1, per_parameter_step=True)


def _net():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"body": torch.nn.Linear(6, 16), "head": torch.nn.Linear(16, 3),
                                 "extra": torch.nn.Linear(6, 3)})
    model["extra"].requires_grad_(False)  # trained once its group is added
    return model


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model["head"](torch.tanh(model["body"](x))) + model["extra"](x), y)


def _data(n=4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _params(model, *names):
    return [p for n in names for p in model[n].parameters()]


def _train(model, opt, data, inside):
    """Four global steps under the per-parameter plan; `inside(i, step)` after step i."""
    with autofit.stepper(model, opt, loss_fn=_loss, precision="fp32", cache=False) as step:
        step.load_state_dict({"version": 1, "plan": PLAN.to_dict(), "sizes": {"fits": [], "fails": []}})
        for i, batch in enumerate(data):
            out = step(batch)
            assert out.plan == PLAN
            inside(i, step)


def test_a_group_added_mid_run_and_a_state_dict_saved_under_the_plan_keep_the_users_foreach():
    data, saved = _data(), []
    model = _net()
    opt = torch.optim.AdamW(_params(model, "body", "head"), lr=0.01, foreach=True)

    def inside(i, step):
        assert [g["foreach"] for g in opt.param_groups] == [False] * len(opt.param_groups)  # the plan's
        if i == 1:
            model["extra"].requires_grad_(True)
            opt.add_param_group({"params": _params(model, "extra"), "foreach": None})
        if i == 2:
            saved.append(opt.state_dict())
    _train(model, opt, data, inside)
    assert [g["foreach"] for g in opt.param_groups] == [True, None]
    assert [g["foreach"] for g in saved[0]["param_groups"]] == [True, None]
    # the plain loop, for the values: the same mathematics
    ref = _net()
    ref_opt = torch.optim.AdamW(_params(ref, "body", "head"), lr=0.01, foreach=True)
    for i, batch in enumerate(data):
        ref_opt.zero_grad(set_to_none=True)
        _loss(ref, batch).backward()
        ref_opt.step()
        if i == 1:
            ref["extra"].requires_grad_(True)
            ref_opt.add_param_group({"params": _params(ref, "extra"), "foreach": None})
    assert all(torch.allclose(p, q, atol=1e-6, rtol=0) for p, q in zip(model.parameters(), ref.parameters()))


def test_a_state_dict_loaded_under_the_plan_is_the_users():
    data = _data()
    donor = torch.optim.AdamW(_params(_net(), "body", "head"), lr=0.01, foreach=True)
    loaded = donor.state_dict()
    model = _net()
    opt = torch.optim.AdamW(_params(model, "body", "head"), lr=0.02, foreach=None)

    def inside(i, step):
        if i == 0:
            opt.load_state_dict(loaded)  # new group dicts, foreach True from the checkpoint
        assert [g["foreach"] for g in opt.param_groups] == [False]
    _train(model, opt, data, inside)
    assert [(g["foreach"], g["lr"]) for g in opt.param_groups] == [(True, 0.01)]
