"""`autofit probe --attn`: the attention implementation a transformers model is priced with."""

import json

import pytest
import torch

from autofit.cli import main
from autofit.commands import models
from autofit.estimator.estimate import estimate
from autofit.gpu.workspaces import Workspaces
from autofit.integrations import transformers_internals as hf
from autofit.plans.plan import Plan

ROWS, SEQ, HEADS = 4, 64, 2


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def gpt2_config(tmp_path):
    import transformers
    transformers.GPT2Config(n_embd=32, n_layer=1, n_head=HEADS, vocab_size=100, n_positions=SEQ,
                            architectures=["GPT2LMHeadModel"]).to_json_file(str(tmp_path / "config.json"))
    return str(tmp_path)


def probe(capsys, spec, *attn):
    code = main(["probe", "--gpu-mem", "1GiB", "--model", spec, "--batch-size", str(ROWS), "--seq-len",
                 str(SEQ), "--precision", "fp32", *attn, "--json"])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if captured.out else None), captured.err


def whole_batch_peak(got) -> int:
    return next(r["peak_bytes"] for r in got["table"] if r["micro_batch_size"] == ROWS
                and not r["checkpointing"] and not r["offload_optimizer"])


def estimated_with(spec, name) -> int:
    """The whole batch's peak estimated here for the model built with `name` attention."""
    model, batch = models.load(spec, batch_size=ROWS, seq_len=SEQ)
    model.set_attn_implementation(name)
    return estimate(model, batch, Plan(ROWS, precision="fp32"), device_type="cuda",
                    workspaces=Workspaces.of_capability()).peak_bytes


def test_the_probe_prices_the_attention_implementation_asked_for(capsys, gpt2_config):
    code, default, _ = probe(capsys, gpt2_config)
    assert code == 0 and default["attention"] == "sdpa"  # GPT-2's own, as transformers builds it
    for name in ("eager", "sdpa"):
        code, got, err = probe(capsys, gpt2_config, "--attn", name)
        assert code == 0 and err == ""
        assert got["attention"] == name
        assert whole_batch_peak(got) == estimated_with(gpt2_config, name)
    eager = whole_batch_peak(probe(capsys, gpt2_config, "--attn", "eager")[1])
    # Eager attention keeps each layer's probabilities (rows x heads x seq x seq, fp32) for backward;
    # SDPA's kernels on a card keep none of that size.
    assert eager - whole_batch_peak(default) >= ROWS * HEADS * SEQ * SEQ * 4
    assert whole_batch_peak(default) == estimated_with(gpt2_config, "sdpa")


def test_an_attention_transformers_does_not_know_is_bad_usage(capsys, gpt2_config):
    code, got, err = probe(capsys, gpt2_config, "--attn", "bogus")
    assert code == 2 and got is None
    assert err.startswith("autofit: error: --attn bogus: GPT2LMHeadModel cannot use it: ValueError: Specified "
                          "`attn_implementation=\"bogus\"` is not supported.")


def test_attn_on_a_model_of_the_users_own_code_is_bad_usage(capsys, user_module):
    user_module("own_model", """
        import torch

        class Regressor(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(8, 1)

            def forward(self, x, y):
                return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

        def build(batch_size):
            return Regressor(), {"x": torch.randn(batch_size, 8), "y": torch.randn(batch_size)}
    """)
    code, got, err = probe(capsys, "own_model:build", "--attn", "eager")
    assert code == 2 and got is None
    assert err.startswith("autofit: error: --attn eager: Regressor is not a transformers model, so its attention is "
                          "priced as its own code runs it; drop --attn.")
    code, got, _ = probe(capsys, "own_model:build")
    assert code == 0 and got["attention"] is None


def test_a_transformers_that_does_not_say_its_attention_degrades_with_one_line(capsys, gpt2_config, monkeypatch,
                                                                                caplog):
    lacks = "PretrainedConfig._not_in_this_transformers"
    monkeypatch.setitem(hf.FEATURES, hf.ATTENTION, (("PretrainedConfig", lacks.split(".")[1]),))
    hf.supported.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="autofit"):
            code, got, _ = probe(capsys, gpt2_config, "--attn", "eager")
            code_again, again, _ = probe(capsys, gpt2_config)
        assert (code, code_again) == (0, 0)
        assert got["attention"] is None and again["attention"] is None
        # Still priced with the implementation asked for: setting it is transformers' public API.
        assert whole_batch_peak(got) == estimated_with(gpt2_config, "eager")
        assert [r.getMessage() for r in caplog.records if "attention" in r.getMessage()] == [
            f"autofit: {hf.ATTENTION} skipped in part: this transformers {hf._found_version()} lacks "
            f"{lacks}; the probe prices the model's attention as built and names no implementation."]
    finally:
        hf.supported.cache_clear()
