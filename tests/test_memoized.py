"""A fake walk leaves no fake tensor in the model's memoized functions: transformers' BEiT caches its
relative position index (an lru_cache inside a decorator's closure), and a model of the user's may
memoize at its module's level; after an estimate, real steps of such a model still run."""

import functools

import torch
import transformers

import autofit
from autofit.estimator.memoized import memoized_of
from autofit.plans.plan import Plan


@functools.lru_cache(maxsize=4)
def _positions(n: int) -> torch.Tensor:
    return torch.arange(n)


class Memoizing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return (self.lin(x) + _positions(8).float()).pow(2).mean()


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


def test_a_cache_at_the_models_module_level_is_emptied_when_the_walk_filled_it():
    _positions.cache_clear()
    model = Memoizing()
    assert _positions in memoized_of(model)
    est = autofit.estimate(model, torch.randn(4, 8), Plan(4), device_type="cpu")
    assert est.method == "fake"
    assert _positions.cache_info().currsize == 0  # it held a fake tensor
    model(torch.randn(4, 8)).backward()  # a real step after the estimate
    assert torch.equal(_positions(8), torch.arange(8))


def test_a_cache_the_walk_did_not_touch_is_kept():
    _positions.cache_clear()
    _positions(3)
    model = Plain()  # of this module too, but it does not call _positions
    assert _positions in memoized_of(model)
    autofit.estimate(model, torch.randn(4, 8), Plan(4), device_type="cpu")
    assert _positions.cache_info().currsize == 1


def test_beit_trains_after_an_estimate():
    torch.manual_seed(0)
    config = transformers.BeitConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, image_size=32, patch_size=8,
                                     use_relative_position_bias=True, num_labels=2)
    model = transformers.BeitForImageClassification(config)
    batch = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 1])}
    autofit.estimate(model, batch, Plan(2), device_type="cpu")
    out = model(**batch)  # before: "Please convert all Tensors to FakeTensors first"
    out.loss.backward()
    assert torch.isfinite(out.loss)
