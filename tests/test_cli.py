"""The command line, in-process through `main(argv)`: exit codes and the lines people read."""

import json

import pytest
import torch
from versions import cuda_here

from autofit.gpu.workspaces import Workspaces

from autofit import cli
from autofit.commands import probe
from autofit.cache.store import PlanCache
from autofit.cli import main
from autofit.plans.plan import Plan

KNOWN = "bert-base, distilbert, gpt2, tiny-bert, tiny-gpt2"
TINY = ["--model", "tiny-bert", "--batch-size", "8", "--seq-len", "16"]


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch, tmp_path):
    """Every case runs as on a CPU-only machine with its own empty plan cache."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))


USER_MODULE = """
    import torch
    from autofit.commands.models import load
    def boom():
        raise RuntimeError("boom")
    def wrong():
        return 42
    def bad_batch(batch_size, seq_len):
        model, batch = load("tiny-bert", batch_size=batch_size, seq_len=seq_len)
        return model, {"input_ids": batch["input_ids"], "pixel_values": torch.zeros(batch_size, 3)}
"""


# -- bad usage: one line on stderr, exit 2, nothing on stdout -----------------------------------

@pytest.mark.parametrize("argv, message", [
    (["probe", "--gpu-mem", "banana"],
     "--gpu-mem 'banana': cannot read the size 'banana'; use a number with an optional unit, e.g. "
     "'2GiB', '512MiB', '2GB' or '1073741824'."),
    (["probe", "--gpu-mem=-2GiB"],
     "--gpu-mem '-2GiB': cannot read the size '-2GiB'; use a number with an optional unit, e.g. "
     "'2GiB', '512MiB', '2GB' or '1073741824'."),
    (["probe", "--gpu-mem", "0"], "--gpu-mem '0': size must be at least 1 byte but got '0'."),
    (["probe", "--gpu-mem", "2GiB", "--model", "nope"],
     f"unknown model 'nope'; built-in models are {KNOWN}; or give a config.json path or module:function."),
    (["probe", "--gpu-mem", "2GiB", "--model", "no/such/config.json"],
     f"no config file at 'no/such/config.json'; give a transformers config.json (or its directory), a "
     f"built-in name ({KNOWN}), or module:function."),
    (["probe", "--gpu-mem", "2GiB", "--model", "af_cli_user:boom"], "af_cli_user:boom() raised RuntimeError: boom"),
    (["probe", "--gpu-mem", "2GiB", "--model", "af_cli_user:wrong"],
     "af_cli_user:wrong() must return (model, sample_batch) with model a torch.nn.Module but returned int."),
    (["probe", "--gpu-mem", "2GiB", "--model", "af_cli_missing:build"],
     "cannot import 'af_cli_missing' for 'af_cli_missing:build': ModuleNotFoundError: No module named "
     "'af_cli_missing'"),
    (["probe", "--gpu-mem", "2GiB", "--batch-size", "0"], "--batch-size must be a positive integer but got 0."),
    (["probe", "--gpu-mem", "2GiB", "--seq-len", "-5"], "--seq-len must be a positive integer but got -5."),
    (["probe", "--gpu-mem", "2GiB", "--model", "bert-base", "--seq-len", "600"],
     "seq_len 600 is longer than BertForSequenceClassification takes (512 positions); pass --seq-len 512 "
     "or less."),
    (["probe", "--gpu-mem", "2GiB", "--context-reserve", "lots"],
     "--context-reserve 'lots': cannot read the size 'lots'; use a number with an optional unit, e.g. "
     "'2GiB', '512MiB', '2GB' or '1073741824'."),
    (["probe", "--gpu-mem", "2GiB", "--verify"],
     "--verify trains real steps on a CUDA device and this machine has none; drop --verify to get the "
     "prediction alone."),
    # argparse's own errors, in the same one-line shape
    (["probe"], "the following arguments are required: --gpu-mem (see 'autofit probe --help')"),
    (["probe", "--gpu-mem", "2GiB", "--batch-size", "many"],
     "argument --batch-size: invalid int value: 'many' (see 'autofit probe --help')"),
    (["probe", "--gpu-mem", "2GiB", "--precision", "int8"],
     "argument --precision: invalid choice: 'int8' (choose from 'auto', 'fp32', 'bf16', 'fp16') "
     "(see 'autofit probe --help')"),
    (["train"], "argument COMMAND: invalid choice: 'train' (choose from 'probe', 'demo', 'cache') "
                "(see 'autofit --help')"),
    (["demo", "--steps", "0"], "--steps must be a positive integer but got 0."),
    (["demo", "--budget", "lots"],
     "--budget 'lots': cannot read the size 'lots'; use a number with an optional unit, e.g. '2GiB', "
     "'512MiB', '2GB' or '1073741824'."),
    (["cache", "show"], "the following arguments are required: KEY (see 'autofit cache show --help')"),
])
def test_bad_usage(capsys, user_module, argv, message):
    user_module("af_cli_user", USER_MODULE)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err == f"autofit: error: {message}\n"
    assert out == ""


@pytest.mark.parametrize("argv", [[], ["cache"]])
def test_no_command_prints_help_and_exits_2(capsys, argv):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"usage: autofit {' '.join(argv)}".rstrip() + " [-h]")


@pytest.mark.parametrize("argv, first", [
    (["--help"], "usage: autofit [-h] [--debug] [--version] COMMAND ..."),
    (["probe", "--help"], "usage: autofit probe [-h] [--debug] --gpu-mem SIZE [--model SPEC]"),
    (["--version"], "autofit 0.1.0"),
])
def test_help_and_version_exit_0(capsys, argv, first):
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == first
    assert err == ""


def test_debug_shows_the_traceback(capsys):
    assert main(["probe", "--gpu-mem", "2GiB", "--model", "nope", "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n")
    assert err.endswith(f"autofit: error: unknown model 'nope'; built-in models are {KNOWN}; or give a "
                        f"config.json path or module:function.\n")


def test_unexpected_errors_exit_3_without_a_traceback(capsys, monkeypatch):
    monkeypatch.setattr(cli, "cmd_cache_list", lambda args: 1 / 0)
    assert main(["cache", "list"]) == 3
    assert capsys.readouterr().err == ("autofit: error: unexpected ZeroDivisionError: division by zero; "
                                       "rerun with --debug for the traceback\n")


# -- probe ----------------------------------------------------------------------------------------

def probe_json(capsys, *argv):
    code = main(["probe", *argv, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


PLAN_FIELDS = ["micro_batch_size", "accumulation_steps", "precision", "checkpointing", "offload_optimizer",
               "per_parameter_step", "reshard_after_forward", "reduce_each_micro_batch"]
ROW_FIELDS = PLAN_FIELDS + ["compute_dtype", "peak_bytes", "reserved_bytes", "fits", "cost", "chosen"]
KINDS = ["params", "grads", "optimizer", "activations", "other"]
JSON_FIELDS = ["model", "model_class", "parameters", "trainable", "trained_parameters", "optimizer", "weights", "attention",
               "batch_size", "seq_len", "batch", "missing_kernels", "precision", "gpu_mem_bytes",
               "context_reserve_bytes", "context_reserve_source", "budget_bytes", "workspace_bytes", "workspace_reserve_bytes",
               "usable_bytes", "fits", "plan", "compute_dtype", "predicted_peak_bytes", "predicted_reserved_bytes",
               "table", "breakdown", "host_optimizer_bytes", "reason", "verdict"]


def test_probe_json_fits(capsys):
    code, got, err = probe_json(capsys, "--gpu-mem", "1GiB", *TINY)
    assert code == 0
    assert err == ""
    assert list(got) == JSON_FIELDS
    assert got["gpu_mem_bytes"] == 2**30
    assert got["context_reserve_bytes"] == probe.DEFAULT_CONTEXT_RESERVE == 429496729
    assert got["context_reserve_source"] == "assumed: no CUDA here to measure it"
    assert got["budget_bytes"] == 2**30 - 429496729
    # A current card's cuBLAS workspaces (two 32 MiB ones, cuBLASLt's 1 MiB in a 2 MiB segment) are in
    # the estimates; nothing is kept back for cuDNN on a model without convolutions.
    assert (got["workspace_bytes"], got["workspace_reserve_bytes"], got["usable_bytes"]) == (
        66 * 2**20, 0, 2**30 - 429496729)
    assert (got["model"], got["model_class"], got["parameters"]) == ("tiny-bert",
                                                                     "BertForSequenceClassification", 168258)
    assert (got["batch_size"], got["seq_len"], got["precision"]) == (8, 16, "auto")
    assert got["batch"] == {"main_input": "input_ids", "shapes": {"input_ids": [8, 16],
                                                                  "labels": [8]},
                            "text": "8 x 16 tokens", "row": "16 tokens", "row_length": "seq_len"}
    assert (got["trainable"], got["trained_parameters"], got["optimizer"], got["weights"]) == (
        "full", 168258, "adamw", "fp32")
    assert got["fits"] is True and got["reason"] is None
    assert got["host_optimizer_bytes"] is None  # the chosen plan keeps its state on the device
    assert list(got["plan"]) == PLAN_FIELDS
    assert Plan.from_dict(got["plan"]).global_batch >= 8
    rows = got["table"]
    assert rows and all(list(r) == ROW_FIELDS for r in rows)
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1 and chosen[0]["fits"] is True
    assert {k: chosen[0][k] for k in PLAN_FIELDS} == got["plan"]
    assert chosen[0]["compute_dtype"] == got["compute_dtype"] == got["plan"]["precision"]  # fp32 weights
    assert chosen[0]["peak_bytes"] == got["predicted_peak_bytes"]
    # The reserved peak decides: the tensors' allocated peak in whole 2 MiB segments (tiny-bert's
    # tensors are small-pool requests) and the workspaces' segments.
    assert chosen[0]["reserved_bytes"] == got["predicted_reserved_bytes"] <= got["usable_bytes"]
    tensors = got["predicted_peak_bytes"] - 65 * 2**20
    assert got["predicted_reserved_bytes"] == -(-tensors // (2 * 2**20)) * 2 * 2**20 + 66 * 2**20
    assert list(got["breakdown"]) == KINDS
    assert sum(got["breakdown"].values()) == got["predicted_peak_bytes"]
    assert got["breakdown"]["params"] >= 168258 * 4  # fp32 master weights


def test_probe_text_fits(capsys):
    assert main(["probe", "--gpu-mem", "1GiB", "--context-reserve", "0.5GiB", *TINY]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[:7] == [
        "model            tiny-bert (BertForSequenceClassification, 0.17M parameters)",
        "fine-tune        the whole model, AdamW, fp32 weights (0.17M trained parameters)",
        "global batch     8 x 16 tokens",
        "attention        sdpa",
        "gpu memory       1.00 GiB",
        "context reserve  512.00 MiB (given)",
        "budget           512.00 MiB for tensors; a plan fits when its reserved peak (66.00 MiB of cuBLAS "
        "workspaces included) is within 512.00 MiB",
    ]
    assert lines[8] == ("plans estimated, fastest first (* chosen; time relative to one fp32 pass over the "
                        "whole batch):")
    assert lines[9].split() == ["micro", "accum", "precision", "checkpointing", "offload", "time", "allocated",
                                "peak", "reserved", "peak", "fits"]
    # Plenty of room: the whole batch at once in fp32, the fastest plan, is the first row and chosen.
    assert lines[11].split() == ["*", "8", "1", "fp32", "no", "no", "1.00", *lines[11].split()[7:11], "yes"]
    chosen = [line for line in lines if line.startswith("*")]
    assert len(chosen) == 1 and chosen[0].endswith("yes")
    assert any(line.startswith("chosen plan: micro ") for line in lines)
    assert any(line.startswith("predicted peak: ") and "of a 512.00 MiB budget (params " in line
               for line in lines)
    assert any(line.startswith("predicted reserved peak: 70.00 MiB of 512.00 MiB usable (") for line in lines)
    assert err == ""


def test_probe_does_not_fit(capsys):
    # 0.5 MiB beyond the 66 MiB of workspaces: less than tiny-bert's parameters alone (0.64 MiB in fp32).
    code = main(["probe", "--gpu-mem", "66.5MiB", "--context-reserve", "0", *TINY])
    out, err = capsys.readouterr()
    assert code == 1
    assert "no plan fits" in out.splitlines()
    assert any(line.startswith("predicted peak: ") and "of a 66.50 MiB budget (params " in line
               for line in out.splitlines())
    assert "*" not in [line[:1] for line in out.splitlines()]
    assert err.startswith("autofit: does not fit: ")
    assert len(err.splitlines()) == 1


def test_probe_json_does_not_fit(capsys):
    code, got, err = probe_json(capsys, "--gpu-mem", "66.5MiB", "--context-reserve", "0", *TINY)
    assert code == 1
    assert got["fits"] is False and got["plan"] is None
    assert isinstance(got["reason"], str) and got["reason"]
    assert err == f"autofit: does not fit: {got['reason']}\n"
    assert all(r["fits"] is False and r["chosen"] is False for r in got["table"])
    assert list(got["breakdown"]) == KINDS
    assert got["breakdown"]["params"] > got["usable_bytes"] - got["workspace_bytes"]
    assert got["predicted_reserved_bytes"] == min(r["reserved_bytes"] for r in got["table"])


def test_probe_card_smaller_than_the_context_reserve(capsys):
    code, got, err = probe_json(capsys, "--gpu-mem", "256MiB", *TINY)
    assert code == 1
    assert (got["fits"], got["plan"], got["table"], got["budget_bytes"]) == (False, None, [], 0)
    assert err == ("autofit: does not fit: the card's 256.00 MiB is all taken by the CUDA context reserve "
                   "(409.60 MiB); nothing is left for tensors.\n")


def test_probe_a_batch_the_model_cannot_take(capsys, user_module):
    user_module("af_cli_user", USER_MODULE)
    code = main(["probe", "--gpu-mem", "2GiB", "--model", "af_cli_user:bad_batch", "--batch-size", "4",
                 "--seq-len", "8"])
    out, err = capsys.readouterr()
    # transformers' models take extra keyword arguments and ignore them: without labels, no loss
    assert code == 2
    assert out == ""
    assert err == ("autofit: error: BertForSequenceClassification computes no loss from the batch "
                   "af_cli_user:bad_batch returned (BertForSequenceClassification, 0.17M parameters; batch "
                   "input_ids[4, 8], pixel_values[4, 3]), so there is no training step to price: return a batch "
                   "with the labels it takes, or a model whose forward returns its loss.\n")


ESTIMATOR_CANNOT = """
    import torch

    class ReadsValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x):
            loss = self.linear(x).pow(2).mean()
            loss.detach().numpy()  # a value read on the host: fake tensors have none
            return loss

    def build(batch_size, seq_len):
        with torch.device("meta"):  # no values: it cannot be measured on real rows either
            return ReadsValues(), torch.zeros(batch_size, 4)
"""


@pytest.mark.parametrize("as_json", [False, True])
def test_probe_a_model_the_estimator_cannot_follow_exits_1(capsys, user_module, as_json):
    user_module("af_cli_values", ESTIMATOR_CANNOT)
    argv = ["probe", "--gpu-mem", "2GiB", "--model", "af_cli_values:build", "--batch-size", "4"]
    code = main(argv + ["--json"] if as_json else argv)
    out, err = capsys.readouterr()
    reason = ("cannot estimate this model: a training step of af_cli_values:build on its sample batch "
              "(ReadsValues, 0.00M parameters; batch batch[4, 4]) failed: RuntimeError: .numpy() is not "
              "supported for tensor subclasses.")
    assert code == 1
    assert err == f"autofit: {reason}\n"
    if as_json:
        got = json.loads(out)
        assert (got["fits"], got["plan"], got["table"], got["reason"]) == (False, None, [], reason)
    else:
        assert out == ""


def test_probe_config_json(capsys, tmp_path):
    import transformers
    transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                            vocab_size=100, architectures=["BertForSequenceClassification"]
                            ).to_json_file(str(tmp_path / "config.json"))
    code, got, _ = probe_json(capsys, "--gpu-mem", "1GiB", "--model", str(tmp_path), "--batch-size", "4",
                              "--seq-len", "8")
    assert code == 0
    assert (got["model"], got["model_class"]) == (str(tmp_path), "BertForSequenceClassification")


def test_probe_rows_too_short_for_the_model_name_seq_len(capsys, tmp_path):
    # a wav2vec2's feature convolutions need longer rows of raw samples than 32: the error is the
    # model's, the way out is a larger --seq-len, and with one the same config is estimated
    import transformers
    transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                conv_dim=(8,) * 7, architectures=["Wav2Vec2ForSequenceClassification"]
                                ).to_json_file(str(tmp_path / "config.json"))
    argv = ["probe", "--gpu-mem", "2GiB", "--model", str(tmp_path), "--batch-size", "2"]
    assert main(argv + ["--seq-len", "32"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"autofit: cannot estimate this model: a training step of {tmp_path} on its sample batch "
                   f"(Wav2Vec2ForSequenceClassification, 0.03M parameters; batch input_values[2, 32], labels[2]) "
                   f"failed: RuntimeError: Calculated padded input size per channel: (2). Kernel size: (3). "
                   f"Kernel size can't be greater than actual input size. With --seq-len 8192 it is estimated "
                   f"(2048 failed too): pass a larger --seq-len.\n")
    assert main(argv + ["--seq-len", "8192"]) == 0


def test_probe_a_failure_longer_rows_do_not_cure_names_no_seq_len(capsys, tmp_path):
    # a sequence classifier without a pad token refuses batches of more than one row at any length
    import transformers
    transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             vocab_size=100, pad_token_id=None, architectures=["LlamaForSequenceClassification"]
                             ).to_json_file(str(tmp_path / "config.json"))
    assert main(["probe", "--gpu-mem", "2GiB", "--model", str(tmp_path), "--batch-size", "2", "--seq-len", "8"]) == 1
    out, err = capsys.readouterr()
    assert err.endswith("failed: ValueError: Cannot handle batch sizes > 1 if no padding token is defined.\n")


def test_probe_rows_from_the_config_get_no_seq_len_hint(capsys, user_module):
    # an image's size comes from the config: --seq-len cannot help, so the reason does not name it
    user_module("af_cli_vit", """
        import torch, transformers

        def build(batch_size):
            config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=64, image_size=32, patch_size=8)
            model = transformers.ViTForImageClassification(config)
            return model, {"pixel_values": torch.zeros(batch_size, 3, 16, 16), "labels": torch.zeros(batch_size, dtype=torch.long)}
    """)
    assert main(["probe", "--gpu-mem", "2GiB", "--model", "af_cli_vit:build", "--batch-size", "2"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("autofit: cannot estimate this model: a training step of af_cli_vit:build on its "
                          "sample batch (ViTForImageClassification, ")
    assert "--seq-len" not in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_probe_bert_base_on_2gib(capsys):
    """The design's headline: BERT-base (the default), 32 x 128, on a 2 GiB card, no GPU."""
    code, got, _ = probe_json(capsys, "--gpu-mem", "2GiB")
    assert code == 0
    assert (got["model"], got["parameters"], got["batch_size"], got["seq_len"]) == ("bert-base", 109483778,
                                                                                    32, 128)
    assert got["budget_bytes"] == 2 * 2**30 - 429496729
    assert got["predicted_peak_bytes"] <= got["usable_bytes"]
    # fp32 parameters (418 MiB), their gradients (418 MiB) and AdamW's two moments (835 MiB) need
    # 1.63 GiB, more than the 1.44 GiB usable: the optimizer state has to leave the card.
    assert got["plan"]["offload_optimizer"] is True
    assert got["breakdown"]["params"] >= 109483778 * 4
    assert got["breakdown"]["optimizer"] == 0
    # AdamW's two moments, shaped as the gradients (fp32 under bf16 autocast too), on the host: two
    # fp32 copies of every parameter, each rounded to 512 bytes as the allocator rounds a request.
    from autofit.commands import models
    rounded = sum(-(-p.numel() * 4 // 512) * 512 for p in models.load("bert-base")[0].parameters())
    assert got["host_optimizer_bytes"] == 2 * rounded == 875871232
    # The gradients on the device, counted as c10 counts them: a block handed out whole (a remainder
    # of at most 1 MiB left unsplit) counts whole, so the layout at the peak may add to the requests
    # (here 1.08 MiB at the peak of the chosen plan, micro 8 x 4 bf16 with offload).
    assert rounded <= got["breakdown"]["grads"] < rounded + 2**21
    assert all(r["offload_optimizer"] for r in got["table"])


MiB = 2**20


def candidate(micro, accum, precision, peak_mib, fits, cost, activations_mib, offload=False):
    from autofit.estimator.capacity import Candidate
    from autofit.estimator.estimate import MemoryEstimate
    plan = Plan(micro, accum, precision, offload_optimizer=offload)
    state = 0 if offload else 200 * MiB  # an offloaded plan's state is host memory
    breakdown = {"params": 100 * MiB, "grads": 100 * MiB, "optimizer": state,
                 "activations": activations_mib * MiB, "other": (peak_mib - 200 - state // MiB - activations_mib) * MiB}
    resident = {"params": 100 * MiB, "grads": 100 * MiB, "optimizer": 200 * MiB}
    return Candidate(plan, MemoryEstimate(plan, peak_mib * MiB, breakdown, reserved_bytes=(peak_mib + 20) * MiB,
                                          resident=resident), fits, cost)


def test_probe_prints_what_capacity_ranked(capsys, monkeypatch):
    """The CLI's own part, exactly: the table, the mark on the fastest fitting plan, its breakdown."""
    from autofit.estimator import capacity
    calls = []
    ranked = [candidate(32, 1, "fp32", 900, False, 1.0, 480), candidate(16, 2, "fp32", 700, True, 1.0303, 290),
              candidate(8, 4, "bf16", 500, True, 1.2545, 96)]

    def make_estimator(model, batch, optimizer=None, **kwargs):
        return model, optimizer, kwargs

    def rank(estimator, batch, budget, *, fit, space):
        model, optimizer, made = estimator
        kwargs = {"precision": space.precision, "caps": fit.caps, "reserve": fit.reserve,
                  "device_type": made["device_type"], "optimizer": optimizer, "workspaces": fit.workspaces}
        calls.append((type(model).__name__, {k: list(v.shape) for k, v in batch.items()}, budget, kwargs))
        return ranked

    monkeypatch.setattr(capacity, "make_estimator", make_estimator)
    monkeypatch.setattr(capacity, "rank", rank)
    argv = ["probe", "--gpu-mem", "1GiB", "--context-reserve", "200MiB", *TINY]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert calls == [("BertForSequenceClassification", {"input_ids": [8, 16],
                                                        "labels": [8]}, 824 * MiB,
                      {"precision": "auto", "caps": "reserved", "reserve": 0, "device_type": "cuda",
                       "optimizer": torch.optim.AdamW, "workspaces": Workspaces.of_capability()})]
    assert out.splitlines()[8:] == [
        "plans estimated, fastest first (* chosen; time relative to one fp32 pass over the whole batch):",
        "   micro  accum  precision  checkpointing  offload  time  allocated peak  reserved peak  fits",
        "-  -----  -----  ---------  -------------  -------  ----  --------------  -------------  ----",
        "      32      1  fp32       no             no       1.00      900.00 MiB     920.00 MiB  no",
        "*     16      2  fp32       no             no       1.03      700.00 MiB     720.00 MiB  yes",
        "       8      4  bf16       no             no       1.25      500.00 MiB     520.00 MiB  yes",
        "",
        "chosen plan: micro 16 x 2, fp32",
        "predicted peak: 700.00 MiB of a 824.00 MiB budget (params 100.00 MiB, grads 100.00 MiB, "
        "optimizer 200.00 MiB, activations 290.00 MiB, other 10.00 MiB)",
        "predicted reserved peak: 720.00 MiB of 824.00 MiB usable (20.00 MiB of segments and cached blocks "
        "above the allocated peak)",
        "Activations decide the plan: micro 32 x 1, fp32 would hold 480.00 MiB of them and reserve 920.00 MiB "
        "of the 824.00 MiB usable, so it runs micro 16 x 2, fp32; a shorter --seq-len or a smaller --batch-size "
        "would let a faster plan fit.",
    ]
    assert err == ""
    assert main(argv + ["--json", "--precision", "bf16"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert calls[-1][3] == {"precision": "bf16", "caps": "reserved", "reserve": 0, "device_type": "cuda",
                            "optimizer": torch.optim.AdamW, "workspaces": Workspaces.of_capability()}
    assert [r["chosen"] for r in got["table"]] == [False, True, False]
    assert got["plan"] == Plan(16, 2).to_dict()
    assert (got["predicted_peak_bytes"], got["predicted_reserved_bytes"]) == (700 * MiB, 720 * MiB)
    assert [r["reserved_bytes"] for r in got["table"]] == [920 * MiB, 720 * MiB, 520 * MiB]
    assert got["breakdown"] == {"params": 100 * MiB, "grads": 100 * MiB, "optimizer": 200 * MiB,
                                "activations": 290 * MiB, "other": 10 * MiB}
    assert [r["cost"] for r in got["table"]] == [1.0, 1.0303, 1.2545]
    assert got["host_optimizer_bytes"] is None  # the state stays on the device
    # An offloaded plan says where its optimizer state went.
    ranked[:] = [candidate(8, 4, "bf16", 300, True, 1.5, 96, offload=True)]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-5:-2] == [
        "chosen plan: micro 8 x 4, bf16, offload",
        "predicted peak: 300.00 MiB of a 824.00 MiB budget (params 100.00 MiB, grads 100.00 MiB, "
        "optimizer 0 bytes, activations 96.00 MiB, other 4.00 MiB)",
        "offloaded: 200.00 MiB of optimizer state in host memory, where the optimizer steps (none of it "
        "on the device)"]
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_optimizer_bytes"] == 200 * MiB


@pytest.mark.slow
def test_probe_compares_the_reserved_peak_with_what_the_workspaces_leave(capsys):
    # tiny-bert 8 x 16 in fp32 is predicted at 3.25 MiB allocated, 4 MiB reserved (two 2 MiB
    # segments), on top of the workspaces' 65 MiB allocated, 66 MiB reserved: 69.5 MiB holds the
    # allocated peak but not the reserved.
    code, got, _ = probe_json(capsys, "--gpu-mem", f"{66 * MiB + 3.5 * MiB:.0f}", "--context-reserve", "0", *TINY)
    first = got["table"][0]
    assert (first["micro_batch_size"], first["precision"], first["offload_optimizer"]) == (8, "fp32", False)
    assert got["usable_bytes"] == 69.5 * MiB
    assert first["peak_bytes"] <= 69.5 * MiB < first["reserved_bytes"] == 70 * MiB
    assert first["fits"] is False
    assert code == 0 and got["plan"] != Plan(8, 1).to_dict()
    assert got["predicted_reserved_bytes"] <= 69.5 * MiB


def test_probe_measures_the_context_reserve_where_cuda_is(capsys, monkeypatch):
    cuda_here(monkeypatch)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 * 2**30 - 517 * MiB, 80 * 2**30))
    code, got, _ = probe_json(capsys, "--gpu-mem", "1GiB", *TINY)
    assert code == 0
    assert got["context_reserve_bytes"] == 517 * MiB
    assert got["context_reserve_source"] == "measured: total - free after CUDA initialised, nothing allocated"
    assert got["budget_bytes"] == 2**30 - 517 * MiB


def test_probe_verify_trains_real_steps_under_the_budget(capsys, monkeypatch):
    """--verify on a CUDA machine; here autofit.run gets a simulated card of the budget's size."""
    import autofit
    real_run, calls = autofit.run, []

    def run_on_a_simulated_card(model, data, *, budget, **kwargs):
        calls.append((type(model).__name__, {p.device.type for p in model.parameters()}, len(data), budget,
                      kwargs))
        with autofit.simulate_gpu(budget, caps="reserved", capability=(9, 0)):
            return real_run(model, data, **kwargs)

    cuda_here(monkeypatch)
    monkeypatch.setattr(autofit, "run", run_on_a_simulated_card)
    # 4 MiB reserved for tensors beside the workspaces' 66 MiB.
    code = main(["probe", "--gpu-mem", "70MiB", "--context-reserve", "0", "--verify", *TINY])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert calls == [("BertForSequenceClassification", {"cpu"}, 3, 70 * 2**20,
                      {"precision": "auto", "optimizer": torch.optim.AdamW, "progress": False, "cache": False})]
    lines = out.splitlines()
    start = lines.index("verifying: 3 real steps on CUDA under a 70.00 MiB budget")
    assert lines[start + 1].split() == ["step", "plan", "outcome", "peak", "reason"]
    assert [line.split()[:7] for line in lines[start + 3:start + 6]] == [
        [str(step), "micro", "8", "x", "1,", "fp32", "ok"] for step in range(3)]
    assert lines[-1].startswith("verified plan: micro 8 x 1, fp32, measured peak ")
    assert lines[-1].endswith(" (predicted 68.25 MiB for micro 8 x 1, fp32)")
    assert err == ""


def test_probe_verify_that_does_not_fit_exits_1(capsys, monkeypatch):
    import autofit
    from autofit.errors import DoesNotFit

    def nothing_fits(model, data, **kwargs):
        raise DoesNotFit("no plan of the ladder fits global batch 8 at step 0 on a card.\nmore")

    cuda_here(monkeypatch)
    monkeypatch.setattr(autofit, "run", nothing_fits)
    assert main(["probe", "--gpu-mem", "1GiB", "--context-reserve", "0.5GiB", "--verify", *TINY]) == 1
    out, err = capsys.readouterr()
    assert "verifying: 3 real steps on CUDA under a 512.00 MiB budget" in out.splitlines()
    assert err == "autofit: does not fit: no plan of the ladder fits global batch 8 at step 0 on a card.\n"


# -- demo -----------------------------------------------------------------------------------------

def test_demo_steps_down_and_finishes(capsys):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["demo"]) == 0
        assert torch.get_num_threads() == 2  # the demo's one thread is given back
    finally:
        torch.set_num_threads(before)
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == ("model: tiny-bert (BertForSequenceClassification, 0.17M parameters, random weights), "
                        "global batch 64 x 64 tokens, 4 step(s)")
    assert lines[1].startswith("simulated GPU: 8.00 MiB ")
    assert lines[2].startswith("capacity check off: every plan below is found by running out of memory")
    assert lines[4].split() == ["step", "plan", "outcome", "peak", "reason"]
    rows = [line.split("  ") for line in lines[6:lines.index("", 6)]]
    rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert rows[0][:3] == ["0", "micro 64 x 1, fp32", "oom"]
    assert rows[0][4] == "start: the whole global batch at once"
    outcomes = [row[2] for row in rows]
    assert outcomes.count("oom") >= 1
    assert {row[0] for row in rows if row[2] == "ok"} == {"0", "1", "2", "3"}  # every step trained
    final = rows[-1][1]
    assert rows[-1][2] == "ok"
    assert f"final plan: {final} (global batch 64 unchanged)" in lines
    assert lines[-1].startswith(f"{outcomes.count('oom')} out-of-memory attempt(s) caught and replayed; "
                                f"4 step(s) trained, loss ")
    assert err == ""


def test_demo_that_cannot_fit_exits_1(capsys):
    assert main(["demo", "--budget", "1MiB", "--steps", "1"]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines()[0].startswith("autofit: does not fit: no plan of the ladder fits global batch 64 "
                                          "at step 0 on simulated GPU (1.00 MiB)")
    assert "oom" in out and " ok " not in out


# -- cache ----------------------------------------------------------------------------------------

FIELDS = {"model": {"class": "transformers.models.bert.modeling_bert.BertForSequenceClassification",
                    "params": "ab" * 32, "n_params": 10},
          "global_batch": 32, "device": {"name": "NVIDIA GeForce GTX 1050", "total": 2 * 2**30}}


def put(key, micro, fields=FIELDS, **more):
    plan = Plan.for_batch(32, micro, precision="bf16", checkpointing=micro < 8)
    PlanCache().put(key, fields, {"plan": plan.to_dict(), "peak_bytes": 1536 * 2**20,
                                  "calibration": 1.05, "throughput": None, **more})


def test_cache_list_show_clear(capsys, tmp_path):
    path = tmp_path / "cache" / "plans.sqlite"
    assert main(["cache", "list"]) == 0
    assert capsys.readouterr().out == f"plan cache: {path}\nno cached plans\n"
    put("a1b2c3d4e5f6a7b8c9", 8, proven_row_elements=385)
    put("ffee0011", 4, fields={"global_batch": 16})
    assert main(["cache", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"plan cache: {path}"
    assert lines[1].split() == ["key", "model", "global", "batch", "device", "plan", "peak", "row", "elements",
                                "when", "(UTC)"]
    assert lines[3].split()[:10] == ["ffee0011", "-", "16", "-", "micro", "4", "x", "8,", "bf16,", "checkpointing"]
    assert lines[3].split()[10:13] == ["1.50", "GiB", "any"]
    assert lines[4].split()[:11] == ["a1b2c3d4e5f6", "BertForSequenceClassification", "32", "NVIDIA",
                                     "GeForce", "GTX", "1050", "micro", "8", "x", "4,"]
    assert lines[4].split()[12:15] == ["1.50", "GiB", "385"]
    assert len(lines) == 5

    assert main(["cache", "show", "a1b2"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == {"key": "a1b2c3d4e5f6a7b8c9", "fields": FIELDS,
                     "entry": {**PlanCache().get("a1b2c3d4e5f6a7b8c9")}}
    assert shown["entry"]["plan"] == Plan(8, 4, "bf16").to_dict()

    for key in ("0000", "b2c3"):  # a prefix, not any substring
        assert main(["cache", "show", key]) == 1
        assert capsys.readouterr().err == (f"autofit: error: no cached plan has a key starting with "
                                           f"'{key}' in {path}; `autofit cache list` shows the keys.\n")

    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out == f"removed 2 cached plan(s) from {path}\n"
    assert PlanCache().entries() == []


def test_cache_show_ambiguous_prefix_is_bad_usage(capsys):
    put("abc1", 8)
    put("abc2", 4)
    assert main(["cache", "show", "abc"]) == 2
    assert capsys.readouterr().err == ("autofit: error: 2 cached plans have a key starting with 'abc'; give "
                                       "more of the key.\n")
    assert main(["cache", "show", "abc2"]) == 0
    assert json.loads(capsys.readouterr().out)["key"] == "abc2"


def test_corrupt_cache_is_reported_not_trusted(capsys, tmp_path):
    path = tmp_path / "cache" / "plans.sqlite"
    path.parent.mkdir()
    path.write_bytes(b"this is not sqlite at all" * 100)
    assert main(["cache", "list"]) == 0
    out, err = capsys.readouterr()
    assert out == f"plan cache: {path}\nno cached plans\n"
    assert err.startswith(f"autofit: warning: plan cache {path}: ")


# -- the table formatter the CLI prints with ------------------------------------------------------

def test_table_aligns_numbers_right_and_text_left():
    from autofit.diagnosis.report import key_values, table
    assert table(["plan", "micro", "peak", "fits"],
                 [["micro 8 x 4", 8, 1.5, True], ["micro 16 x 2", 16, None, False]]).splitlines() == [
        "plan          micro  peak  fits",
        "------------  -----  ----  ----",
        "micro 8 x 4       8   1.5  yes",
        "micro 16 x 2     16     -  no",
    ]
    assert table(["a", "b"], [["x", 1]], align="rl", indent="  ").splitlines() == [
        "  a  b", "  -  -", "  x  1"]
    assert key_values([("gpu", "2 GiB"), ("context reserve", 0.4)]).splitlines() == [
        "gpu              2 GiB", "context reserve  0.4"]


@pytest.mark.parametrize("headers, rows, align, message", [
    (["a", "b"], [["x"]], None, "row 0 has 1 cells but there are 2 headers (['a', 'b'])."),
    (["a", "b"], [["x", 1]], "lx", "align must have one 'l' or 'r' per column (2) but got 'lx'."),
])
def test_table_errors(headers, rows, align, message):
    from autofit.diagnosis.report import table
    with pytest.raises(ValueError) as info:
        table(headers, rows, align=align)
    assert str(info.value) == message


def _resident(capsys, *options):
    """The chosen plan's resident bytes by kind (what the fine-tune holds whatever the batch)."""
    code, got, _ = probe_json(capsys, "--gpu-mem", "1GiB", *TINY, *options)
    assert code == 0
    return got


def test_probe_prices_the_optimizer_the_part_trained_and_the_weights(capsys):
    from autofit.commands import finetune, models
    full = _resident(capsys)
    model, _ = models.load("tiny-bert", batch_size=8, seq_len=16)
    params = sum(p.numel() for p in model.parameters())
    assert full["trained_parameters"] == params == 168258
    # AdamW: two fp32 moments per trained parameter; SGD with momentum one; plain SGD none
    sgd = _resident(capsys, "--optimizer", "sgd")
    momentum = _resident(capsys, "--optimizer", "sgd-momentum")
    assert (sgd["optimizer"], momentum["optimizer"]) == ("sgd", "sgd-momentum")
    state = {name: _state_bytes(got) for name, got in (("adamw", full), ("sgd", sgd), ("momentum", momentum))}
    assert state["sgd"] == 0 < state["momentum"] < state["adamw"]
    # a frozen base trains the classifier only: 64 x 2 weights + 2 biases
    frozen = _resident(capsys, "--trainable", "frozen-base")
    assert frozen["trained_parameters"] == 130 and frozen["breakdown"]["grads"] <= 2 * 512
    # bf16 weights: the parameters take half the bytes
    bf16 = _resident(capsys, "--weights", "bf16")
    assert bf16["breakdown"]["params"] < 0.6 * full["breakdown"]["params"]
    assert finetune.OPTIMIZERS == ("adamw", "sgd", "sgd-momentum", "adafactor", "adamw8bit")


def _state_bytes(got) -> int:
    """The optimizer state the chosen plan keeps (offloaded or not), from its estimate's resident."""
    return got["host_optimizer_bytes"] or got["breakdown"]["optimizer"]


def test_probe_refuses_a_frozen_base_with_nothing_left_to_train(capsys):
    code = main(["probe", "--gpu-mem", "1GiB", "--model", "tiny-gpt2", "--batch-size", "4", "--seq-len", "16",
                 "--trainable", "frozen-base"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--trainable frozen-base leaves nothing to train in GPT2LMHeadModel" in err


def test_probe_prices_lora_adapters(capsys):
    pytest.importorskip("peft")
    from autofit.commands import models
    model, _ = models.load("tiny-bert", batch_size=8, seq_len=16)
    # rank 4 on every linear layer (peft's "all-linear"; the classifier too, for a model peft is not
    # told the task of)
    lora = _resident(capsys, "--trainable", "lora", "--lora-rank", "4")
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert lora["trained_parameters"] == sum(4 * (m.in_features + m.out_features) for m in linear) == 7944
    assert lora["model_class"] == "PeftModel"


def test_probe_a_class_that_computes_no_loss_is_bad_usage(capsys, tmp_path):
    import transformers
    transformers.DeiTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                            image_size=32, patch_size=8, architectures=["DeiTForImageClassificationWithTeacher"]
                            ).to_json_file(str(tmp_path / "config.json"))
    assert main(["probe", "--gpu-mem", "2GiB", "--model", str(tmp_path), "--batch-size", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("autofit: error: DeiTForImageClassificationWithTeacher computes no loss from the probe's labels, "
                   "so there is no training step to price: name a class with a task head that trains in the config's "
                   "architectures (e.g. a *ForSequenceClassification, *ForCausalLM, *ForImageClassification), or give "
                   "module:function returning a model whose forward returns its loss.\n")


def test_probe_a_card_left_with_less_than_the_workspace_reserve(capsys):
    code, got, err = probe_json(capsys, "--gpu-mem", "450MiB", *TINY)
    assert code == 1
    assert (got["fits"], got["plan"], got["table"]) == (False, None, [])
    assert err == ("autofit: does not fit: the card's 450.00 MiB less the CUDA context reserve (409.60 MiB) leaves "
                   "40.40 MiB, not more than the 66.00 MiB of cuBLAS/cuDNN workspaces; nothing is left for "
                   "tensors.\n")
