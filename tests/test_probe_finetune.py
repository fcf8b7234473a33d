"""The probe's fine-tunes: any config.json the transformers Auto classes know (the batch follows the
model's inputs), bitsandbytes' 8-bit AdamW, and the verdict sentence that ends the output."""

import json
import logging
import sys
import types

import pytest
import torch
from versions import cuda_here
import transformers

from autofit import torch_internals as ti

from autofit.cli import main
from autofit.commands import finetune, models, verdict
from autofit.estimator.capacity import Candidate
from autofit.estimator.estimate import MemoryEstimate
from autofit.plans.plan import Plan

MiB, GiB = 2**20, 2**30
SMALL = ["--batch-size", "2", "--seq-len", "8"]


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))


def vit(tmp_path):
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=64, image_size=32, patch_size=8, num_channels=3,
                                    architectures=["ViTForImageClassification"])
    return _saved(tmp_path / "vit", config)


def t5(tmp_path):
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                   num_decoder_layers=1, num_heads=2, architectures=["T5ForConditionalGeneration"])
    return _saved(tmp_path / "t5", config)


def whisper(tmp_path):
    config = transformers.WhisperConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=16, max_target_positions=32, pad_token_id=1, bos_token_id=2, eos_token_id=3,
        decoder_start_token_id=2, begin_suppress_tokens=None, suppress_tokens=None,
        architectures=["WhisperForConditionalGeneration"])
    return _saved(tmp_path / "whisper", config)


def _saved(folder, config) -> str:
    folder.mkdir()
    config.save_pretrained(str(folder))
    return str(folder)


def shapes(batch):
    return {k: (list(v.shape), v.dtype) for k, v in batch.items()}


# -- config.json: the class from architectures, the batch from its inputs ---------------------------

def test_vit_config_builds_image_classification_with_pixel_values(tmp_path):
    model, batch = models.load(vit(tmp_path), batch_size=2, seq_len=8, device="cpu")
    assert type(model) is transformers.ViTForImageClassification
    assert shapes(batch) == {"pixel_values": ([2, 3, 32, 32], torch.float32), "labels": ([2], torch.int64)}
    assert set(batch["labels"].tolist()) <= {0, 1}
    assert torch.isfinite(model(**batch).loss)  # the batch is what the model takes


def test_t5_config_builds_conditional_generation_with_decoder_inputs(tmp_path):
    model, batch = models.load(t5(tmp_path), batch_size=2, seq_len=8, device="cpu")
    assert type(model) is transformers.T5ForConditionalGeneration
    assert shapes(batch) == {"input_ids": ([2, 8], torch.int64),
                             "decoder_input_ids": ([2, 8], torch.int64), "labels": ([2, 8], torch.int64)}
    # the decoder reads the labels shifted right behind its start token (T5: the pad token, 0)
    assert batch["decoder_input_ids"][:, 0].tolist() == [0, 0]
    assert torch.equal(batch["decoder_input_ids"][:, 1:], batch["labels"][:, :-1])
    assert torch.isfinite(model(**batch).loss)


def test_whisper_config_builds_speech_seq2seq_with_input_features(tmp_path):
    model, batch = models.load(whisper(tmp_path), batch_size=2, seq_len=8, device="cpu")
    assert type(model) is transformers.WhisperForConditionalGeneration
    # 16 encoder positions behind convolutions of total stride 2: 32 mel frames, as Whisper checks
    assert shapes(batch) == {"input_features": ([2, 8, 32], torch.float32),
                             "decoder_input_ids": ([2, 8], torch.int64), "labels": ([2, 8], torch.int64)}
    assert batch["decoder_input_ids"][:, 0].tolist() == [2, 2]
    assert torch.isfinite(model(**batch).loss)


# The header names what a row is, by the main input's kind: only tokens are sized by --seq-len.
CONFIGS = [
    (vit, "ViTForImageClassification", "2 images of 3 x 32 x 32",
     {"main_input": "pixel_values", "shapes": {"pixel_values": [2, 3, 32, 32], "labels": [2]},
      "text": "2 images of 3 x 32 x 32", "row": "an image of 3 x 32 x 32", "row_length": "config"}),
    (t5, "T5ForConditionalGeneration", "2 x 8 tokens, 2 x 8 target tokens",
     {"main_input": "input_ids", "shapes": {"input_ids": [2, 8],
                                            "decoder_input_ids": [2, 8], "labels": [2, 8]},
      "text": "2 x 8 tokens, 2 x 8 target tokens", "row": "8 tokens", "row_length": "seq_len"}),
    (whisper, "WhisperForConditionalGeneration", "2 x 32 frames of 8 mel bins, 2 x 8 target tokens",
     {"main_input": "input_features", "shapes": {"input_features": [2, 8, 32], "decoder_input_ids": [2, 8],
                                                 "labels": [2, 8]},
      "text": "2 x 32 frames of 8 mel bins, 2 x 8 target tokens", "row": "32 frames of 8 mel bins",
      "row_length": "config"}),
]


@pytest.mark.parametrize("build, cls, header, described", CONFIGS, ids=["vit", "t5", "whisper"])
def test_probe_plans_each_config(capsys, tmp_path, build, cls, header, described):
    assert main(["probe", "--gpu-mem", "1GiB", "--model", build(tmp_path), *SMALL]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith(f"model            {tmp_path / build.__name__} ({cls}, ")
    assert lines[2] == f"global batch     {header}"
    assert "chosen plan: micro 2 x 1, fp32" in lines  # plenty of room: the whole batch at once
    # 2 MiB of tensors beside the card's 66 MiB of cuBLAS workspaces; of the 614.40 MiB left by the
    # context, models with convolutions keep 32 MiB for cuDNN's.
    usable = "614.40" if cls.startswith("T5") else "582.40"
    assert lines[-1].startswith(f"The fastest plan fits: micro 2 x 1, fp32 reserves 68.00 MiB of the {usable} MiB "
                                f"usable, optimizer state the largest part")
    assert err == ""
    assert main(["probe", "--gpu-mem", "1GiB", "--model", str(tmp_path / build.__name__), *SMALL, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["batch"] == described
    assert [r["compute_dtype"] for r in got["table"]] == ["fp32"] and got["compute_dtype"] == "fp32"


def test_a_batch_of_no_known_kind_is_named_by_its_shapes():
    import torch
    from autofit.commands import samples
    assert samples.describe((torch.zeros(4, 3), torch.zeros(4)), None) == {
        "main_input": None, "shapes": {"0": [4, 3], "1": [4]}, "text": "4 rows: 0[4, 3], 1[4]", "row": None,
        "row_length": None}
    # features without an encoder window in the config are as long as --seq-len makes them
    config = types.SimpleNamespace(input_feat_per_channel=8, input_channels=1)
    model = types.SimpleNamespace(config=config, main_input_name="input_features")
    assert samples.describe({"input_features": torch.zeros(2, 16, 8)}, model) == {
        "main_input": "input_features", "shapes": {"input_features": [2, 16, 8]},
        "text": "2 x 16 frames of 8 features", "row": "16 frames of 8 features", "row_length": "seq_len"}


def test_probe_feeds_float_inputs_in_the_weights_dtype(capsys, tmp_path):
    # Whisper's first convolution takes its features in its own dtype: bf16 weights, bf16 features.
    code = main(["probe", "--gpu-mem", "1GiB", "--model", whisper(tmp_path), *SMALL, "--weights", "bf16", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert code == 0 and got["model_class"] == "WhisperForConditionalGeneration" and got["fits"] is True


def test_decoder_longer_than_its_positions_is_refused(tmp_path):
    with pytest.raises(models.ModelSpecError) as info:
        models.load(whisper(tmp_path), batch_size=2, seq_len=33)
    assert str(info.value) == ("seq_len 33 is longer than WhisperForConditionalGeneration's decoder takes "
                               "(32 target positions); pass --seq-len 32 or less.")


def test_a_class_outside_the_mappings_falls_back_to_the_model_type(tmp_path, caplog):
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=64, image_size=32, patch_size=8, architectures=["ViTModel"])
    with caplog.at_level(logging.WARNING, logger="autofit"):
        model, batch = models.load(_saved(tmp_path / "vitmodel", config), batch_size=2, seq_len=8)
    assert type(model) is transformers.ViTForImageClassification
    assert list(batch) == ["pixel_values", "labels"]
    # the class named has no head to train: what is priced instead is said, not silent
    assert [r.getMessage() for r in caplog.records if r.name == "autofit"] == [
        "the config's architectures name ViTModel, which has no task head the probe trains; it prices "
        "ViTForImageClassification, the image classification class of model_type 'vit', instead"]


def test_composite_config_sizes_come_from_its_sub_config(tmp_path):
    config = transformers.CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           image_size=24, patch_size=8, num_channels=3))
    model, batch = models.load(_saved(tmp_path / "clip", config), batch_size=2, seq_len=8, device="cpu")
    assert type(model) is transformers.CLIPForImageClassification
    assert shapes(batch)["pixel_values"] == ([2, 3, 24, 24], torch.float32)
    assert torch.isfinite(model(**batch).loss)


# -- 8-bit AdamW -----------------------------------------------------------------------------------

def test_adamw8bit_without_bitsandbytes_is_bad_usage(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    code = main(["probe", "--gpu-mem", "1GiB", "--model", "tiny-bert", *SMALL, "--optimizer", "adamw8bit"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == "autofit: error: --optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes.\n"


def _storage_bytes(tensors) -> int:
    """Bytes the CUDA allocator would give these tensors: each storage once, in 512-byte blocks."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(-(-n // 512) * 512 for n in storages.values())


@pytest.mark.slow  # importing bitsandbytes takes seconds
def test_adamw8bit_state_is_priced_as_bitsandbytes_allocates_it(capsys):
    bnb = pytest.importorskip("bitsandbytes")
    code = main(["probe", "--gpu-mem", "1GiB", "--model", "tiny-bert", "--batch-size", "8", "--seq-len", "16",
                 "--optimizer", "adamw8bit", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert code == 0 and got["optimizer"] == "adamw8bit" and got["plan"]["offload_optimizer"] is False
    # A real step of bitsandbytes' AdamW8bit on the real model: the state it made.
    model, batch = models.load("tiny-bert", batch_size=8, seq_len=16, device="cpu")
    optimizer = bnb.optim.AdamW8bit(model.parameters())
    model(**batch).loss.backward()
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert got["breakdown"]["optimizer"] == _storage_bytes(state) == 377856
    # Its rule: uint8 moments and an fp32 absmax per 256 values, fp32 moments under 4096 values, one
    # pair of 256-entry quantization maps shared by every tensor.
    rule = sum(2 * -(-4 * n // 512) * 512 if n < 4096 else 2 * (-(-n // 512) * 512 + -(-4 * -(-n // 256) // 512) * 512)
               for n in (p.numel() for p in model.parameters())) + 2 * 256 * 4
    assert rule == 377856


# -- the verdict -----------------------------------------------------------------------------------

def candidate(plan, fits, *, params, grads, state, activations, reserved, cost=1.0):
    on_device = 0 if plan.offload_optimizer else state
    breakdown = {"params": params, "grads": grads, "optimizer": on_device, "activations": activations, "other": 0}
    estimate = MemoryEstimate(plan, sum(breakdown.values()), breakdown, reserved_bytes=reserved,
                              resident={"params": params, "grads": grads, "optimizer": state})
    return Candidate(plan, estimate, fits, cost)


TOKENS = {"main_input": "input_ids", "row": "128 tokens", "row_length": "seq_len"}


def result(usable, optimizer="adamw", trainable="full", weights="fp32", trained=0, batch=TOKENS):
    return {"usable_bytes": usable, "optimizer": optimizer, "trainable": trainable, "weights": weights,
            "trained_parameters": trained, "batch": batch}


@pytest.fixture
def every_package(monkeypatch):
    """The verdict's options as where bitsandbytes and peft are installed (the sentences below are
    exact whatever this machine has)."""
    monkeypatch.setattr(verdict, "installed", lambda package: True)


@pytest.mark.usefixtures("every_package")
def test_verdict_when_the_optimizer_state_alone_exceeds_the_card():
    # 1000M parameters in fp32: 3.73 GiB each of weights and gradients, 7.45 GiB of AdamW state.
    n = 1000 * 10**6
    offloaded = candidate(Plan(4, 2, offload_optimizer=True), True, params=4 * n, grads=4 * n, state=8 * n,
                          activations=1 * GiB, reserved=9 * GiB)
    # The options follow from the breakdown: 9 GiB on the card without the state, 16.45 GiB with it;
    # LoRA drops the gradients and the state (5.27 GiB), bf16 weights halve all three (9.00 GiB), an
    # optimizer its state by bytes per parameter (8-bit AdamW 1.89 GiB, momentum 3.73 GiB, SGD none).
    assert verdict.sentence(result(7 * GiB, trained=n), [offloaded], offloaded) == (
        "AdamW state alone (7.45 GiB) exceeds the card's 7.00 GiB usable: every fitting plan offloads the "
        "state to host memory; by this breakdown, --trainable lora would fit without offload.")
    assert verdict.sentence(result(12 * GiB, trained=n), [offloaded], offloaded) == (
        "AdamW state (7.45 GiB) with parameters and gradients (7.45 GiB) exceeds the card's 12.00 GiB "
        "usable: every fitting plan offloads the state to host memory; by this breakdown, --optimizer "
        "adamw8bit, --trainable lora or --weights bf16 would fit without offload.")
    assert verdict.sentence(result(10 * GiB, trained=n), [offloaded], offloaded) == (
        "AdamW state (7.45 GiB) with parameters and gradients (7.45 GiB) exceeds the card's 10.00 GiB "
        "usable: every fitting plan offloads the state to host memory; by this breakdown, --optimizer sgd, "
        "--trainable lora or --weights bf16 would fit without offload.")


def test_an_option_whose_package_is_missing_says_which_to_install(monkeypatch):
    asked = []
    monkeypatch.setattr(verdict, "installed", lambda package: asked.append(package) or package == "peft")
    n = 1000 * 10**6
    offloaded = candidate(Plan(4, 2, offload_optimizer=True), True, params=4 * n, grads=4 * n, state=8 * n,
                          activations=1 * GiB, reserved=9 * GiB)
    assert verdict.sentence(result(12 * GiB, trained=n), [offloaded], offloaded) == (
        "AdamW state (7.45 GiB) with parameters and gradients (7.45 GiB) exceeds the card's 12.00 GiB "
        "usable: every fitting plan offloads the state to host memory; by this breakdown, --optimizer "
        "adamw8bit (with bitsandbytes installed), --trainable lora or --weights bf16 would fit without "
        "offload.")
    assert asked == ["bitsandbytes", "peft"]  # asked for the options that need one, not for bf16 weights
    monkeypatch.setattr(verdict, "installed", lambda package: False)
    assert verdict.sentence(result(10 * GiB, trained=n), [offloaded], offloaded).endswith(
        "by this breakdown, --optimizer sgd, --trainable lora (with peft installed) or --weights bf16 would "
        "fit without offload.")


def test_installed_finds_a_package_without_importing_it(monkeypatch):
    assert finetune.installed("torch") and not finetune.installed("autofit_no_such_package")
    monkeypatch.delitem(sys.modules, "json.tool", raising=False)
    assert finetune.installed("json.tool") and "json.tool" not in sys.modules


SMALL_STATES = dict(params=100 * MiB, grads=100 * MiB, state=200 * MiB)  # of a small model


@pytest.mark.usefixtures("every_package")
def test_verdict_when_activations_decide():
    whole = candidate(Plan(32, 1), False, **SMALL_STATES,
                      activations=2 * GiB, reserved=2600 * MiB)
    split = candidate(Plan(8, 4, checkpointing=True), True, **SMALL_STATES,
                      activations=100 * MiB, reserved=520 * MiB, cost=1.4)
    assert verdict.sentence(result(1 * GiB), [whole, split], split) == (
        "Activations decide the plan: micro 32 x 1, fp32 would hold 2.00 GiB of them and reserve 2.54 GiB "
        "of the 1.00 GiB usable, so it runs micro 8 x 4, fp32, checkpointing; a shorter --seq-len or a "
        "smaller --batch-size would let a faster plan fit.")
    # Rows the model's config sizes (an image, an encoder's window of frames): --seq-len is no advice.
    frames = {"main_input": "input_features", "row": "3000 frames of 80 mel bins", "row_length": "config"}
    assert verdict.sentence(result(1 * GiB, batch=frames), [whole, split], split) == (
        "Activations decide the plan: micro 32 x 1, fp32 would hold 2.00 GiB of them and reserve 2.54 GiB "
        "of the 1.00 GiB usable, so it runs micro 8 x 4, fp32, checkpointing; a smaller --batch-size would "
        "let a faster plan fit (the model's config, not --seq-len, sizes each row's main input: 3000 frames "
        "of 80 mel bins).")
    # A batch of no known kind (module:function): fewer rows, nothing said of their length.
    unknown = {"main_input": None, "row": None, "row_length": None}
    assert verdict.sentence(result(1 * GiB, batch=unknown), [whole, split], split).endswith(
        "so it runs micro 8 x 4, fp32, checkpointing; a smaller --batch-size would let a faster plan fit.")
    # On bf16 weights a plan without autocast computes in bf16, and says so.
    assert verdict.sentence(result(1 * GiB, weights="bf16"), [whole, split], split) == (
        "Activations decide the plan: micro 32 x 1, bf16 weights would hold 2.00 GiB of them and reserve "
        "2.54 GiB of the 1.00 GiB usable, so it runs micro 8 x 4, bf16 weights, checkpointing; a shorter "
        "--seq-len or a smaller --batch-size would let a faster plan fit.")


def test_verdict_when_the_fastest_plan_fits():
    whole = candidate(Plan(32, 1), True, **SMALL_STATES,
                      activations=300 * MiB, reserved=720 * MiB)
    assert verdict.sentence(result(1 * GiB), [whole], whole) == (
        "The fastest plan fits: micro 32 x 1, fp32 reserves 720.00 MiB of the 1.00 GiB usable, activations "
        "the largest part (300.00 MiB); nothing needs to change.")


@pytest.mark.usefixtures("every_package")
def test_verdict_when_the_model_states_decide_and_when_nothing_fits():
    whole = candidate(Plan(8, 1), False, params=400 * MiB, grads=400 * MiB, state=800 * MiB,
                      activations=100 * MiB, reserved=1800 * MiB)
    bf16 = candidate(Plan(8, 1, "bf16"), True, params=400 * MiB, grads=400 * MiB, state=800 * MiB,
                     activations=50 * MiB, reserved=1700 * MiB, cost=1.2)
    assert verdict.sentence(result(1750 * MiB, trained=100 * 2**20), [whole, bf16], bf16) == (
        "The model's states decide the plan: parameters, gradients and AdamW state take 1.56 GiB of the "
        "1.71 GiB usable, so it runs micro 8 x 1, bf16; by this breakdown, --optimizer sgd-momentum, "
        "--trainable lora or --weights bf16 would let a faster plan fit.")
    smallest = candidate(Plan(1, 8, offload_optimizer=True), False, params=400 * MiB, grads=400 * MiB,
                         state=800 * MiB, activations=10 * MiB, reserved=820 * MiB)
    assert verdict.sentence(result(300 * MiB, weights="bf16"), [smallest], None) == (
        "Parameters alone (400.00 MiB) exceed the 300.00 MiB usable: no plan fits; by this breakdown no one "
        "change of --optimizer, --trainable or --weights fits.")
    assert verdict.sentence(result(600 * MiB), [smallest], None) == (
        "Parameters and gradients (800.00 MiB) exceed the 600.00 MiB usable even with the AdamW state "
        "offloaded: no plan fits; by this breakdown, --trainable lora would fit.")
    # LoRA checkpoints as the full model does: a checkpointed plan is as good a guide.
    checkpointed = candidate(Plan(1, 8, checkpointing=True, offload_optimizer=True), False, params=400 * MiB,
                             grads=400 * MiB, state=800 * MiB, activations=10 * MiB, reserved=820 * MiB)
    assert verdict.sentence(result(600 * MiB), [checkpointed], None) == (
        "Parameters and gradients (800.00 MiB) exceed the 600.00 MiB usable even with the AdamW state "
        "offloaded: no plan fits; by this breakdown, --trainable lora would fit.")
    # Not from a LoRA fine-tune itself (its gradients are the adapters' already).
    assert verdict.sentence(result(600 * MiB, trainable="lora"), [checkpointed], None) == (
        "Parameters and gradients (800.00 MiB) exceed the 600.00 MiB usable even with the AdamW state "
        "offloaded: no plan fits; by this breakdown no one change of --optimizer, --trainable or --weights "
        "fits.")


def test_the_probe_ends_with_the_verdict_in_text_and_json(capsys):
    argv = ["probe", "--gpu-mem", "1GiB", "--model", "tiny-bert", "--batch-size", "8", "--seq-len", "16"]
    assert main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert main(argv + ["--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["verdict"] == last == (
        "The fastest plan fits: micro 8 x 1, fp32 reserves 70.00 MiB of the 614.40 MiB usable, optimizer "
        "state the largest part (1.29 MiB); nothing needs to change.")


def test_a_config_with_no_class_the_probe_trains_is_refused(tmp_path):
    config = transformers.CLIPVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=64, architectures=["CLIPVisionModel"])
    with pytest.raises(models.ModelSpecError) as info:
        models.load(_saved(tmp_path / "tower", config))
    assert str(info.value) == (
        "transformers has no model the probe can train for model_type 'clip_vision_model' (architectures: "
        "CLIPVisionModel); the probe trains the classes of CAUSAL_LM, MASKED_LM, SEQ_TO_SEQ_CAUSAL_LM, "
        "SPEECH_SEQ_2_SEQ, SEQUENCE_CLASSIFICATION, IMAGE_CLASSIFICATION, AUDIO_CLASSIFICATION, "
        "TOKEN_CLASSIFICATION: name one in the config's \"architectures\" or use module:function.")


# -- what a plan runs in on bf16 weights -------------------------------------------------------------

def test_plans_on_bf16_weights_say_they_run_in_bf16(capsys, monkeypatch):
    """A plan's precision is its autocast; on bf16 weights one without autocast computes in bf16."""
    from autofit.estimator import capacity
    ranked = [candidate(Plan(8, 1), False, **SMALL_STATES, activations=600 * MiB, reserved=1000 * MiB),
              candidate(Plan(8, 1, "bf16"), False, **SMALL_STATES, activations=500 * MiB, reserved=900 * MiB,
                        cost=1.15),
              candidate(Plan(8, 1, checkpointing=True), True, **SMALL_STATES, activations=100 * MiB,
                        reserved=500 * MiB, cost=1.33)]
    monkeypatch.setattr(capacity, "rank", lambda *args, **kwargs: ranked)
    argv = ["probe", "--gpu-mem", "1GiB", "--model", "tiny-bert", "--batch-size", "8", "--seq-len", "16",
            "--weights", "bf16"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "fine-tune        the whole model, AdamW, bf16 weights (0.17M trained parameters)"
    assert lines[9:16] == [
        "   micro  accum  precision                    checkpointing  offload  time  allocated peak  reserved peak  fits",
        "-  -----  -----  ---------------------------  -------------  -------  ----  --------------  -------------  ----",
        "       8      1  bf16 weights                 no             no       1.00     1000.00 MiB    1000.00 MiB  no",
        "       8      1  bf16 weights, bf16 autocast  no             no       1.15      900.00 MiB     900.00 MiB  no",
        "*      8      1  bf16 weights                 yes            no       1.33      500.00 MiB     500.00 MiB  yes",
        "",
        "chosen plan: micro 8 x 1, bf16 weights, checkpointing",
    ]
    assert lines[-1] == (
        "Activations decide the plan: micro 8 x 1, bf16 weights would hold 600.00 MiB of them and reserve "
        "1000.00 MiB of the 614.40 MiB usable, so it runs micro 8 x 1, bf16 weights, checkpointing; a shorter "
        "--seq-len or a smaller --batch-size would let a faster plan fit.")
    assert main(argv + ["--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    # the plan's fields keep their meaning (precision: the autocast); compute_dtype says what runs
    assert [(r["precision"], r["compute_dtype"]) for r in got["table"]] == [
        ("fp32", "bf16"), ("bf16", "bf16"), ("fp32", "bf16")]
    assert (got["plan"]["precision"], got["compute_dtype"], got["weights"]) == ("fp32", "bf16", "bf16")


# -- LoRA with checkpointing -----------------------------------------------------------------------

@pytest.mark.slow  # four estimates of a LoRA model, peft imported: ~7 s
def test_lora_plans_with_checkpointing_are_priced(capsys):
    pytest.importorskip("peft")
    # 32 MiB usable beside the card's 66 MiB of cuBLAS workspaces: the whole batch fits only with its
    # blocks recomputed (or at half the rows)
    code = main(["probe", "--gpu-mem", "98MiB", "--context-reserve", "0", "--model", "tiny-gpt2", "--batch-size",
                 "8", "--seq-len", "128", "--trainable", "lora", "--lora-rank", "4", "--json"])
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert code == 0 and err == ""  # no plan left out, none of peft's notes
    assert [(r["micro_batch_size"], r["precision"], r["checkpointing"], r["offload_optimizer"],
             r["reserved_bytes"] // MiB, r["fits"], r["chosen"]) for r in got["table"]] == [
        (8, "fp32", False, False, 66 + 40, False, False),
        (8, "bf16", False, False, 66 + 36, False, False),
        (8, "fp32", True, False, 66 + 32, True, True),
        (4, "fp32", False, False, 66 + 30, True, False)]
    # rank-4 adapters on each block's four Conv1D layers (peft's all-linear leaves the output layer)
    assert got["trained_parameters"] == 2 * 4 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64)) == 8192


def test_a_model_peft_refuses_lora_on_is_a_usage_error(tmp_path, capsys):
    pytest.importorskip("peft")
    # peft refuses LoRA on Mamba's out_proj, which "all-linear" picks: exit 2, with peft's reason
    config = transformers.MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=64, state_size=4,
                                      architectures=["MambaForCausalLM"])
    code = main(["probe", "--gpu-mem", "1GiB", "--model", _saved(tmp_path / "mamba", config), *SMALL,
                 "--trainable", "lora"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("autofit: error: --trainable lora: peft cannot put LoRA on every linear layer of "
                          "MambaForCausalLM: [PEFT:PeftType.LORA] Module 'out_proj' is incompatible")
    assert err.rstrip().endswith("Use --trainable frozen-base or full, or build the LoRA model yourself and "
                                 "pass it as --model module:function.")


def test_verify_trains_the_fine_tune_the_probe_priced(capsys, monkeypatch):
    """--verify on a CUDA machine; here autofit.run gets a simulated card of the budget's size."""
    import autofit
    real_run, calls = autofit.run, []

    def run_on_a_simulated_card(model, data, *, budget, optimizer, **kwargs):
        calls.append(({n for n, p in model.named_parameters() if p.requires_grad},
                      {p.dtype for p in model.parameters()}, data[0]["input_ids"].dtype, optimizer.func,
                      optimizer.keywords))
        with autofit.simulate_gpu(budget):
            return real_run(model, data, optimizer=optimizer, **kwargs)

    cuda_here(monkeypatch)
    monkeypatch.setattr(autofit, "run", run_on_a_simulated_card)
    code = main(["probe", "--gpu-mem", "68MiB", "--context-reserve", "0", "--verify", "--model", "tiny-bert",
                 "--batch-size", "8", "--seq-len", "16", "--trainable", "frozen-base", "--weights", "bf16",
                 "--optimizer", "sgd-momentum"])
    out, err = capsys.readouterr()
    assert code == 0, err
    # the head alone trained, on bf16 weights, by SGD with momentum: what the prediction priced
    assert calls == [({"classifier.weight", "classifier.bias"}, {torch.bfloat16}, torch.int64, torch.optim.SGD,
                      {"lr": 1e-3, "momentum": 0.9})]
    assert out.splitlines()[-1].startswith("verified plan: micro 8 x 1, bf16 weights, measured peak ")


# -- relative positions ------------------------------------------------------------------------------

def _deberta(tmp_path, name, biased):
    return _saved(tmp_path / name, transformers.DebertaV2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=128,
        max_position_embeddings=512, position_biased_input=biased, relative_attention=True,
        position_buckets=256, pos_att_type=["p2c", "c2p"], architectures=["DebertaV2ForSequenceClassification"]))


def test_a_model_of_relative_positions_takes_rows_longer_than_max_position_embeddings(tmp_path):
    """DeBERTa-v2/v3 without absolute positions (position_biased_input=False) trains on 1024
    tokens; with them, its position table bounds the rows at 512."""
    model, batch = models.load(_deberta(tmp_path, "relative", False), batch_size=2, seq_len=1024)
    assert type(model) is transformers.DebertaV2ForSequenceClassification
    assert list(batch["input_ids"].shape) == [2, 1024]
    assert not models.has_position_table(model)
    with pytest.raises(models.ModelSpecError) as info:
        models.load(_deberta(tmp_path, "absolute", True), batch_size=2, seq_len=1024)
    assert str(info.value) == ("seq_len 1024 is longer than DebertaV2ForSequenceClassification takes (512 "
                               "positions); pass --seq-len 512 or less.")


# Before transformers 5.23 DeBERTa-v2's log-bucket relative positions are TorchScript functions,
# which fake tensors cannot run (nor can the sampled fallback at these sizes): the probe says so.
DEBERTA_SCRIPTED = ti.version_tuple(transformers.__version__) < (5, 23)


def test_the_probe_prices_deberta_at_1024_tokens(capsys, tmp_path):
    code = main(["probe", "--gpu-mem", "2GiB", "--model", _deberta(tmp_path, "relative", False),
                 "--batch-size", "2", "--seq-len", "1024", "--json"])
    got = json.loads(capsys.readouterr().out)
    if DEBERTA_SCRIPTED:
        assert (code, got["fits"]) == (1, False)
        assert got["reason"].endswith("failed: RuntimeError: The following operation failed in the TorchScript "
                                      "interpreter.")
        return
    assert code == 0 and got["fits"] is True
    assert got["batch"]["shapes"] == {"input_ids": [2, 1024], "labels": [2]}


# -- kernels transformers falls back from -------------------------------------------------------------

def test_a_price_on_transformers_torch_fallback_says_so(capsys, tmp_path):
    """Mamba-2 takes mamba_ssm's and causal_conv1d's kernels where installed; here neither is, so its
    step is priced on the torch fallback, and the probe says so (a BERT needs no such kernel)."""
    config = transformers.Mamba2Config(hidden_size=64, num_hidden_layers=1, num_heads=4, head_dim=32,
                                       state_size=16, n_groups=1, vocab_size=128, chunk_size=16,
                                       architectures=["Mamba2ForCausalLM"])
    spec = _saved(tmp_path / "mamba2", config)
    assert main(["probe", "--gpu-mem", "1GiB", "--model", spec, "--batch-size", "2", "--seq-len", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3:5] == ["attention        eager",  # transformers' own name for a model without attention
                          "slow path        priced on transformers' torch fallback: causal_conv1d, mamba_ssm not "
                          "installed (with its kernels a step holds less)"]
    assert main(["probe", "--gpu-mem", "1GiB", "--model", spec, "--batch-size", "2", "--seq-len", "32",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_kernels"] == ["causal_conv1d", "mamba_ssm"]
    assert main(["probe", "--gpu-mem", "1GiB", "--model", "tiny-bert", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_kernels"] == []
