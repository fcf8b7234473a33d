"""A quantized frozen base priced as bitsandbytes stores it (autofit.commands.quantized): QLoRA's
NF4 with double quantization, LLM.int8's int8; its weight dequantized only inside a layer's kernel."""

import json

import pytest
import torch

import autofit
from autofit.cli import main
from autofit.commands import finetune
from autofit.commands.quantized import QuantizedLinear, parameter_count, quantize
from autofit.errors import UsageError
from autofit.plans.plan import Plan


def storages(module):
    return {name: b.untyped_storage().nbytes() for name, b in module.named_buffers()}


def test_the_formats_hold_what_bitsandbytes_holds():
    layer = torch.nn.Linear(512, 256)
    # 131072 values: two a byte, a uint8 absmax per 64, its fp32 absmax per 256 blocks, the code.
    assert storages(QuantizedLinear(layer, "nf4")) == {"packed": 65536, "absmax": 2048, "nested_absmax": 32,
                                                        "code": 1024}
    assert storages(QuantizedLinear(layer, "int8")) == {"packed": 131072, "absmax": 1024}  # a scale per row
    with pytest.raises(ValueError, match=r"^kind must be one of nf4, int8 but got 'fp4'\.$"):
        QuantizedLinear(layer, "fp4")


class Adapted(torch.nn.Module):
    """A trainable adapter before a frozen base of two wide layers and a trainable head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.adapter = torch.nn.Linear(64, 512)
        self.base = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
        self.base.requires_grad_(False)
        self.head = torch.nn.Linear(512, 4)

    def forward(self, x):
        return self.head(self.base(self.adapter(x)))


def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_a_quantized_base_trains_and_its_dequantized_weights_are_never_kept():
    model = Adapted()
    assert quantize(model, "nf4") == 2 and isinstance(model.base[0], QuantizedLinear)
    assert parameter_count(model) == sum(p.numel() for p in Adapted().parameters())
    batch = (torch.randn(8, 64), torch.randint(0, 4, (8,)))
    loss_fn(model, batch).backward()  # the input's gradient flows back through the base
    assert model.adapter.weight.grad.shape == (512, 64)
    plan = Plan(8, 1)
    est = autofit.estimate(model, batch, plan, optimizer=torch.optim.SGD, loss_fn=loss_fn, device_type="cpu")
    nf4 = 2 * (2048 * 512 // 2 + 2048 * 512 // 64 + 512 + 1024)  # each buffer at least one 512 B block
    trainable = sum(-(-p.numel() * 4 // 512) * 512 for p in model.parameters())
    assert est.breakdown["params"] == nf4 + trainable
    # A dequantized fp32 weight is 4 MiB; the step's activations and temporaries hold at most one.
    assert est.peak_bytes - est.breakdown["params"] - est.breakdown["grads"] < 4 * 2**20 + 2**20


def test_the_probe_prices_a_4bit_base_under_lora(capsys):
    argv = ["probe", "--gpu-mem", "1GiB", "--model", "tiny-gpt2", "--trainable", "lora", "--json", "--weights"]
    pytest.importorskip("peft")
    got = {}
    for weights in ("fp32", "nf4", "int8"):
        assert main(argv + [weights]) == 0
        got[weights] = json.loads(capsys.readouterr().out)
    assert got["nf4"]["parameters"] == got["int8"]["parameters"] == got["fp32"]["parameters"]
    assert got["nf4"]["compute_dtype"] == "fp32" and got["nf4"]["weights"] == "nf4"
    params = {w: got[w]["breakdown"]["params"] for w in got}
    assert params["nf4"] < params["int8"] < params["fp32"]


def test_a_quantized_base_is_not_trained_whole():
    with pytest.raises(UsageError) as info:
        finetune.prepare(Adapted(), trainable="full", lora_rank=4, weights="nf4")
    assert str(info.value) == ("--weights nf4 quantizes the base, which cannot then be trained whole; use "
                               "--trainable lora (QLoRA) or frozen-base.")
