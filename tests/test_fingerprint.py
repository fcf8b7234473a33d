import hashlib
import json

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification
from transformers.tokenization_utils_base import BatchEncoding

from autofit.cache.fingerprint import DeviceKey, batch_signature, job_key, model_fingerprint


def tiny_bert(**overrides):
    torch.manual_seed(0)
    config = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                  vocab_size=100, max_position_embeddings=64)
    config.update(overrides)
    return BertForSequenceClassification(BertConfig(**config))


def bert_batch(batch_size=4, seq_len=16):
    return {
        "input_ids": torch.zeros(batch_size, seq_len, dtype=torch.int64),
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.int64),
        "labels": torch.zeros(batch_size, dtype=torch.int64),
    }


DEVICE = dict(device_name="NVIDIA H200", device_total=150_000_000_000, budget=2 * 2**30)
BASE = dict(optimizer_name="AdamW", global_batch=32, precision="fp32", device=DeviceKey(**DEVICE))


def key_of(model=None, batch=None, **changes):
    device = {k: changes.pop(k) for k in list(changes) if k in DEVICE}
    args = {**BASE, **changes}
    if device:
        args["device"] = DeviceKey(**{**DEVICE, **device})
    return job_key(model=model if model is not None else tiny_bert(),
                   batch=batch if batch is not None else bert_batch(), **args)[0]


def test_model_fingerprint_exact_values():
    model = tiny_bert()
    fp = model_fingerprint(model)
    assert fp["class"] == ("transformers.models.bert.modeling_bert."
                           "BertForSequenceClassification")
    assert fp["n_params"] == sum(p.numel() for p in model.parameters())
    layout = [["param", n, list(p.shape), str(p.dtype)[6:], p.requires_grad]
              for n, p in model.named_parameters()]
    layout += [["buffer", n, list(b.shape), str(b.dtype)[6:]] for n, b in model.named_buffers()]
    text = json.dumps(layout, sort_keys=True, separators=(",", ":"))
    assert fp["params"] == hashlib.sha256(text.encode()).hexdigest()


def test_same_model_rebuilt_gives_same_key():
    key1, fields1 = job_key(model=tiny_bert(), batch=bert_batch(), **BASE)
    torch.manual_seed(123)  # other weights, same layout
    key2, fields2 = job_key(model=BertForSequenceClassification(BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        vocab_size=100, max_position_embeddings=64)), batch=bert_batch(), **BASE)
    assert key1 == key2
    assert fields1 == fields2
    assert len(key1) == 64 and int(key1, 16) >= 0
    # The key is the hash of the fields it returns, and they are plain JSON.
    text = json.dumps(fields1, sort_keys=True, separators=(",", ":"))
    assert key1 == hashlib.sha256(text.encode()).hexdigest()
    assert json.loads(json.dumps(fields1)) == fields1
    assert fields1["torch"] == torch.__version__
    assert isinstance(fields1["autofit"], str) and fields1["autofit"]
    assert fields1["optimizer"] == "AdamW"
    assert fields1["global_batch"] == 32
    assert fields1["precision"] == "fp32"
    assert fields1["device"] == {"name": "NVIDIA H200", "total": 150_000_000_000}
    assert fields1["budget"] == 2 * 2**30


def test_each_field_changes_the_key():
    base = key_of()
    half = tiny_bert()
    half.classifier.to(torch.float16)
    frozen = tiny_bert()
    frozen.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    variants = {
        "parameter shape": key_of(model=tiny_bert(intermediate_size=38)),
        "parameter dtype": key_of(model=half),
        "frozen parameter": key_of(model=frozen),
        "model class": key_of(model=torch.nn.Linear(3, 4)),
        "seq len": key_of(batch=bert_batch(seq_len=17)),
        "batch dtype": key_of(batch={**bert_batch(), "input_ids": torch.zeros(4, 16, dtype=torch.int32)}),
        "batch field": key_of(batch={**bert_batch(), "token_type_ids": torch.zeros(4, 16, dtype=torch.int64)}),
        "optimizer": key_of(optimizer_name="SGD"),
        "global batch": key_of(global_batch=64),
        "precision": key_of(precision="bf16"),
        "budget": key_of(budget=3 * 2**30),
        "no budget": key_of(budget=None),
        "device name": key_of(device_name="simulated"),
        "device total": key_of(device_total=80_000_000_000),
    }
    for what, key in variants.items():
        assert key != base, f"changing the {what} kept the key"
    assert len(set(variants.values())) == len(variants)


def test_versions_change_the_key(monkeypatch):
    base = key_of()
    monkeypatch.setattr("autofit.cache.fingerprint.autofit_version", lambda: "99.0")
    assert key_of() != base


def test_batch_signature_ignores_batch_size_only():
    assert batch_signature(bert_batch(batch_size=4)) == batch_signature(bert_batch(batch_size=8))
    assert batch_signature(bert_batch(seq_len=16)) != batch_signature(bert_batch(seq_len=32))
    assert batch_signature(bert_batch(batch_size=4, seq_len=16)) == {
        "attention_mask": {"shape": [16], "dtype": "int64"},
        "input_ids": {"shape": [16], "dtype": "int64"},
        "labels": {"shape": [], "dtype": "int64"},
    }


def test_batch_signature_structures():
    x = torch.zeros(8, 3, 5, dtype=torch.float32)
    y = torch.zeros(8, dtype=torch.int64)
    assert batch_signature(x) == {"shape": [3, 5], "dtype": "float32"}
    assert batch_signature((x, y)) == [{"shape": [3, 5], "dtype": "float32"},
                                       {"shape": [], "dtype": "int64"}]
    assert batch_signature([x, y]) == batch_signature((x, y))
    assert batch_signature((y, x)) != batch_signature((x, y))  # by position
    assert batch_signature(torch.tensor(1.0)) == {"shape": [], "dtype": "float32", "scalar": True}
    assert batch_signature({"b": y, "a": [x, "text", 3]}) == {
        "a": [{"shape": [3, 5], "dtype": "float32"}, "str", "int"],
        "b": {"shape": [], "dtype": "int64"},
    }
    # Key order does not matter.
    assert list(batch_signature({"b": y, "a": x})) == ["a", "b"]
    encoding = BatchEncoding(bert_batch(batch_size=2))
    assert batch_signature(encoding) == batch_signature(bert_batch(batch_size=8))


@pytest.mark.parametrize("changes, error, words", [
    ({"optimizer_name": ""}, ValueError,
     "optimizer_name must be a non-empty string but got ''; pass the optimizer class name, e.g. 'AdamW'."),
    ({"optimizer_name": torch.optim.AdamW}, TypeError, "optimizer_name must be a string but got type"),
    ({"global_batch": 0}, ValueError,
     "global_batch must be at least 1 but got 0; pass the samples per optimizer step."),
    ({"global_batch": 8.0}, TypeError, "global_batch must be an int but got float 8.0;"),
    ({"global_batch": True}, TypeError, "global_batch must be an int but got bool True;"),
    ({"precision": None}, TypeError, "precision must be a string but got NoneType None;"),
    ({"device_name": " "}, ValueError, "device_name must be a non-empty string but got ' '; "
                                       "pass the GPU name or 'simulated'."),
    ({"device_total": -1}, ValueError, "device_total must be at least 0 but got -1; pass bytes, "
                                       "e.g. autofit.parse_size('2GiB'), or None when unknown."),
    ({"budget": "2GiB"}, TypeError, "budget must be an int or None but got str '2GiB'; pass bytes, "
                                    "e.g. autofit.parse_size('2GiB'), or None for no budget."),
    ({"budget": 0}, ValueError, "budget must be at least 1 but got 0;"),
])
def test_bad_arguments(changes, error, words):
    with pytest.raises(error) as info:
        key_of(model=torch.nn.Linear(2, 2), batch=torch.zeros(1, 2), **changes)
    assert words in str(info.value)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module but got dict"):
        model_fingerprint({"weight": torch.zeros(2)})
