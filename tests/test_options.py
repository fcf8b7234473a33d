"""One options object for autofit.run, autofit.stepper and Training: a field is an option of each."""

import dataclasses
import inspect

import pytest
import torch

import autofit
from autofit.recipes.options import Options


def test_every_option_is_a_keyword_of_run_and_stepper_with_its_default():
    fields = {f.name: f.default for f in dataclasses.fields(Options)}
    for entry, own in ((autofit.run, ["model", "data", "epochs", "batch_size", "eval_data", "metric_fn", "tune"]),
                       (autofit.stepper, ["model"])):
        parameters = inspect.signature(entry).parameters
        assert list(parameters)[:len(own)] == own
        assert {n: p.default for n, p in parameters.items() if n in fields} == fields
        assert set(parameters) == set(own) | set(fields)


def test_an_unknown_option_is_refused_by_name_with_the_options_listed():
    with pytest.raises(TypeError, match=r"^autofit.run got unknown option\(s\) 'budgt'; its options are "
                                        r"allow_split, batch_dim, budget, cache, .*, shard\.$"):
        autofit.run(torch.nn.Linear(2, 2), [torch.zeros(2, 2)], budgt="2GiB")
    with pytest.raises(TypeError, match=r"^autofit.stepper got unknown option\(s\) 'clip', 'lr'; its options "
                                        r"are allow_split, .*, shard\.$"):
        with autofit.stepper(torch.nn.Linear(2, 2), lr=0.1, clip=1.0):
            pass


@pytest.mark.parametrize("options, error, message", [
    (dict(precision="fp4"), ValueError, r"^precision must be one of auto, fp32, bf16, fp16 but got 'fp4'\.$"),
    (dict(loss_fn=3), TypeError, r"^loss_fn must be a callable \(model, batch\) -> scalar loss but got 3\.$"),
    (dict(max_grad_norm=0), ValueError, r"^max_grad_norm must be a positive number .* but got 0\.$"),
    (dict(allow_split="no"), TypeError, r"^allow_split must be True or False but got 'no'\.$"),
    (dict(shard=1), TypeError, r"^shard must be True or False but got 1\.$"),
    (dict(shard=True, optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)), ValueError,
     r"^shard=True replaces the model's parameters by their shards"),
])
def test_bad_options_are_refused_alike_by_run_and_stepper(options, error, message):
    with pytest.raises(error, match=message):
        autofit.run(torch.nn.Linear(2, 2), [torch.zeros(2, 2)], **options)
    with pytest.raises(error, match=message):
        with autofit.stepper(torch.nn.Linear(2, 2), **options):
            pass
