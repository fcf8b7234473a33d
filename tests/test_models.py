"""autofit.commands.models: spec strings -> (model, sample batch); built on meta, errors in one line."""


import pytest
import torch
import transformers

from autofit.commands.models import BUILTINS, DEFAULT, ModelSpecError, load

KNOWN = "bert-base, distilbert, gpt2, tiny-bert, tiny-gpt2"


def shapes(batch):
    return {k: (list(v.shape), v.dtype, v.device.type) for k, v in batch.items()}


def test_default_is_bert_base():
    assert DEFAULT == "bert-base"
    model, batch = load()
    assert type(model) is transformers.BertForSequenceClassification
    default = transformers.BertConfig()
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size", "max_position_embeddings", "num_labels"):
        assert getattr(model.config, name) == getattr(default, name)
    assert model.config.hidden_size == 768 and model.config.num_hidden_layers == 12
    # unpadded rows: no attention mask, as a card drops an all-ones one (commands/samples)
    assert shapes(batch) == {"input_ids": ([32, 128], torch.int64, "cpu"),
                             "labels": ([32], torch.int64, "cpu")}


@pytest.mark.parametrize("name, cls, n_params, labels", [
    ("bert-base", transformers.BertForSequenceClassification, 109_483_778, [4]),
    ("distilbert", transformers.DistilBertForSequenceClassification, 66_955_010, [4]),
    ("gpt2", transformers.GPT2LMHeadModel, 124_439_808, [4, 16]),
    ("tiny-bert", transformers.BertForSequenceClassification, 168_258, [4]),
    ("tiny-gpt2", transformers.GPT2LMHeadModel, 196_864, [4, 16]),
])
def test_builtins_build_on_meta(name, cls, n_params, labels):
    # Speed is the probe benchmark's to measure, not a unit test's: here, what is built, and where.
    model, batch = load(name, batch_size=4, seq_len=16)
    assert type(model) is cls
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert {p.device.type for p in model.parameters()} == {"meta"}  # no memory spent
    assert shapes(batch) == {"input_ids": ([4, 16], torch.int64, "cpu"),
                             "labels": (labels, torch.int64, "cpu")}
    assert int(batch["input_ids"].max()) < model.config.vocab_size
    if labels == [4, 16]:
        assert torch.equal(batch["labels"], batch["input_ids"])
    else:
        assert set(batch["labels"].tolist()) <= {0, 1}


def test_sample_batch_is_deterministic():
    _, a = load("tiny-bert", batch_size=3, seq_len=5)
    _, b = load("tiny-bert", batch_size=3, seq_len=5)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cpu_device_gives_a_real_model_that_trains_on_its_batch():
    model, batch = load("tiny-gpt2", batch_size=2, seq_len=8, device="cpu")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    loss = model(**batch).loss
    assert loss.dim() == 0 and torch.isfinite(loss)


def write_config(path, **kwargs):
    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 vocab_size=100, max_position_embeddings=64)
    transformers.BertConfig(**{**small, **kwargs}).to_json_file(str(path))
    return path


def test_config_json_with_architectures(tmp_path):
    path = write_config(tmp_path / "config.json", architectures=["BertForSequenceClassification"],
                        num_labels=5)
    model, batch = load(str(path), batch_size=6, seq_len=10)
    assert type(model) is transformers.BertForSequenceClassification
    assert model.config.hidden_size == 32 and model.config.num_labels == 5
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert shapes(batch)["labels"] == ([6], torch.int64, "cpu")
    assert set(batch["labels"].tolist()) <= set(range(5))
    # The directory holding config.json works too.
    model2, _ = load(str(tmp_path), batch_size=6, seq_len=10)
    assert type(model2) is transformers.BertForSequenceClassification


def test_config_json_masked_lm_architecture(tmp_path):
    path = write_config(tmp_path / "mlm.json", architectures=["BertForMaskedLM"])
    model, batch = load(str(path), batch_size=2, seq_len=8)
    assert type(model) is transformers.BertForMaskedLM
    assert shapes(batch)["labels"] == ([2, 8], torch.int64, "cpu")


def test_config_json_without_architectures_is_a_causal_lm(tmp_path):
    path = write_config(tmp_path / "plain.json")
    model, batch = load(str(path), batch_size=2, seq_len=8)
    assert type(model) is transformers.BertLMHeadModel
    assert model.config.is_decoder is True
    assert torch.equal(batch["labels"], batch["input_ids"])
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100).to_json_file(
        str(gpt / "config.json"))
    model, _ = load(str(gpt), batch_size=2, seq_len=8)
    assert type(model) is transformers.GPT2LMHeadModel


def test_builtins_table_names():
    assert ", ".join(BUILTINS) == KNOWN


# -- module:function ---------------------------------------------------------------------------


def test_module_function_gets_the_sizes_it_accepts(user_module):
    name = user_module("af_user_ok", """
        import torch
        def build(batch_size, seq_len=7):
            return torch.nn.Linear(seq_len, 1), torch.zeros(batch_size, seq_len)
        def fixed():
            return torch.nn.Linear(3, 1), (torch.zeros(2, 3),)
        def anything(**kwargs):
            return torch.nn.Linear(kwargs["seq_len"], 1), {"x": torch.zeros(kwargs["batch_size"], 1)}
    """)
    model, batch = load(f"{name}:build", batch_size=5, seq_len=9)
    assert isinstance(model, torch.nn.Linear) and model.in_features == 9
    assert list(batch.shape) == [5, 9]
    model, batch = load(f"{name}:fixed", batch_size=5, seq_len=9)
    assert model.in_features == 3 and list(batch[0].shape) == [2, 3]
    model, batch = load(f"{name}:anything", batch_size=4, seq_len=6)
    assert model.in_features == 6 and list(batch["x"].shape) == [4, 1]


BAD_MODULE = """
    import torch
    def boom():
        raise RuntimeError("no weights here\\nsecond line")
    def not_a_pair():
        return torch.nn.Linear(2, 2)
    def not_a_module():
        return "model", torch.zeros(2, 2)
    def unsplittable():
        return torch.nn.Linear(2, 2), {"x": torch.zeros(2, 2), "y": torch.zeros(3, 2)}
    VALUE = 3
"""


@pytest.mark.parametrize("spec, message", [
    ("nope", f"unknown model 'nope'; built-in models are {KNOWN}; or give a config.json path or "
             f"module:function."),
    ("missing/config.json", f"no config file at 'missing/config.json'; give a transformers "
                            f"config.json (or its directory), a built-in name ({KNOWN}), or "
                            f"module:function."),
    ("af_no_such_module:build", "cannot import 'af_no_such_module' for 'af_no_such_module:build': "
                                "ModuleNotFoundError: No module named 'af_no_such_module'"),
    ("af_user_bad:missing", "module 'af_user_bad' has no 'missing'; 'af_user_bad:missing' must name a "
                            "function returning (model, sample_batch)."),
    ("af_user_bad:VALUE", "'af_user_bad:VALUE' is a int, not a function returning (model, sample_batch)."),
    ("af_user_bad:boom", "af_user_bad:boom() raised RuntimeError: no weights here"),
    ("af_user_bad:not_a_pair", "af_user_bad:not_a_pair() must return (model, sample_batch) with model a "
                               "torch.nn.Module but returned Linear."),
    ("af_user_bad:not_a_module", "af_user_bad:not_a_module() must return (model, sample_batch) with "
                                 "model a torch.nn.Module but returned a tuple of 2 starting with str."),
    ("af_user_bad:unsplittable", "af_user_bad:unsplittable() returned a sample batch autofit cannot "
                                 "split: ValueError: cannot split the batch along dimension 0: its "
                                 "tensors disagree (batch['x'] has 2, batch['y'] has 3); make every "
                                 "tensor's dimension 0 the batch dimension."),
    ("af_user_bad:", "'af_user_bad:' is not module:function; write e.g. mypkg.models:build."),
    ("", "a model spec must be a non-empty string but got ''; use one of "
         f"{KNOWN}, a config.json path, or module:function."),
])
def test_spec_errors(user_module, spec, message):
    user_module("af_user_bad", BAD_MODULE)
    with pytest.raises(ModelSpecError) as info:
        load(spec)
    assert str(info.value) == message
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_import_error_inside_the_module(user_module):
    user_module("af_user_broken", "import af_dependency_that_is_missing\n")
    with pytest.raises(ModelSpecError, match=r"^cannot import 'af_user_broken' for 'af_user_broken:f': "
                                             r"ModuleNotFoundError: No module named "
                                             r"'af_dependency_that_is_missing'$"):
        load("af_user_broken:f")


def test_config_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSpecError, match=r"^the directory '.*empty' holds no config.json; give the "
                                             r"file itself or a directory with one.$"):
        load(str(tmp_path / "empty"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModelSpecError, match=r"^cannot read the transformers config '.*bad.json': "):
        load(str(bad))


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=0), "batch_size must be a positive int but got 0."),
    (dict(seq_len=-3), "seq_len must be a positive int but got -3."),
    (dict(batch_size=True), "batch_size must be a positive int but got True."),
    (dict(seq_len=513), "seq_len 513 is longer than BertForSequenceClassification takes (512 "
                        "positions); pass --seq-len 512 or less."),
])
def test_size_errors(kwargs, message):
    with pytest.raises(ModelSpecError) as info:
        load("bert-base", **kwargs)
    assert str(info.value) == message
