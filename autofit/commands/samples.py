"""The probe's sample batch: the inputs a model really takes, shaped from its config.

The main input is the one the model class names (`main_input_name`, as transformers' pipelines read
it), shaped from the config:
- `input_ids` [batch, seq] token ids below `vocab_size`, without an `attention_mask`: the rows are
  unpadded, and a model given an all-ones mask on a card drops it (transformers reads its values and
  takes the causal or maskless attention kernel), which fake tensors, without values, cannot see:
  with the mask they would price a [batch, 1, seq, seq] mask per layer that no card holds (40% of a
  long-context decoder's peak at 4096 tokens);
- `pixel_values` [batch, num_channels, H, W], H and W from `image_size` (an int or a pair);
- `input_features` [batch, num_mel_bins, frames] (channels first, as the model's Conv1d takes them)
  when the config has `num_mel_bins`, else [batch, frames, input_feat_per_channel * input_channels];
  frames is the encoder's window, `max_source_positions` times the total stride of the model's
  Conv1d layers (Whisper pads every clip to it), or seq when the config has no window;
- `input_values` [batch, seq] raw samples.
The labels follow the task (the transformers Auto mapping the model class is in): one class per row
(sequence, image and audio classification), the input ids (causal and masked LM), one class per
token (token classification), or target token ids [batch, seq] with the `decoder_input_ids` they
shift to (sequence-to-sequence: the decoder's inputs are the labels shifted right behind the
decoder start token). A size the config lacks is read from its sub-configs (CLIP's vision_config).

`describe(batch, model)` names what a batch is, by its main input's kind, for the probe's header:
"32 x 128 tokens", "32 images of 3 x 224 x 224", "8 x 3000 frames of 80 mel bins", with ", 8 x 128
target tokens" for a sequence-to-sequence batch, and where each row's length comes from: --seq-len
(tokens, raw samples, features without an encoder window) or the model's config (an image's size,
the encoder's window of frames), which decides whether a shorter --seq-len is advice at all.
"""

from __future__ import annotations

import math

import torch

from autofit.errors import ModelSpecError

SEED = 0
MAIN_INPUTS = ("input_ids", "pixel_values", "input_features", "input_values")
TASKS = ("classification", "causal", "masked", "token-classification", "seq2seq")


def sample_batch(model: torch.nn.Module, config, task: str, batch_size: int, seq_len: int) -> dict:
    """The batch one training step of `model` takes (see the module docstring), from a fixed seed."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)} but got {task!r}.")
    gen = torch.Generator().manual_seed(SEED)
    main = main_input(model)
    batch = {main: _main_input(main, model, config, batch_size, seq_len, gen)}
    if task == "classification":
        batch["labels"] = torch.randint(0, _labels(config), (batch_size,), generator=gen, dtype=torch.int64)
    elif task in ("causal", "masked"):
        batch["labels"] = batch["input_ids"].clone()
    elif task == "token-classification":
        batch["labels"] = torch.randint(0, _labels(config), (batch_size, seq_len), generator=gen,
                                        dtype=torch.int64)
    else:
        labels = _token_ids(config, batch_size, seq_len, gen)
        start = torch.full((batch_size, 1), decoder_start(config), dtype=torch.int64)
        batch["decoder_input_ids"] = torch.cat([start, labels[:, :-1]], dim=1)
        batch["labels"] = labels
    return batch


def main_input(model: torch.nn.Module) -> str:
    name = getattr(model, "main_input_name", "input_ids")
    if name not in MAIN_INPUTS:
        raise ModelSpecError(f"{type(model).__name__} takes {name!r} as its main input, which the probe "
                             f"cannot shape from a config (it shapes {', '.join(MAIN_INPUTS)}); give "
                             f"module:function returning the model and a sample batch.")
    return name


def decoder_start(config) -> int:
    """The token the decoder's inputs begin with: the config's decoder start, else its pad token."""
    for attr in ("decoder_start_token_id", "pad_token_id"):
        value = _value(config, attr)
        if isinstance(value, int) and value >= 0:
            return value
    return 0


def _main_input(name, model, config, batch_size, seq_len, gen) -> torch.Tensor:
    if name == "input_ids":
        return _token_ids(config, batch_size, seq_len, gen)
    if name == "pixel_values":
        return torch.randn(batch_size, _positive(config, "num_channels", 3), *_image_size(config),
                           generator=gen)
    if name == "input_features":
        frames = _frames(model, config, seq_len)
        mels = _value(config, "num_mel_bins")
        if mels is not None:
            return torch.randn(batch_size, _positive(config, "num_mel_bins"), frames, generator=gen)
        width = _positive(config, "input_feat_per_channel") * _positive(config, "input_channels", 1)
        return torch.randn(batch_size, frames, width, generator=gen)
    return torch.randn(batch_size, seq_len, generator=gen)  # input_values: raw audio samples


def _value(config, attr: str, default=None):
    """`attr` of the config, else of its first sub-config holding it (a composite model's
    vision_config, audio_config, text_config carry their tower's sizes)."""
    value = getattr(config, attr, None)
    if value is not None:
        return value
    for name in sorted(vars(config)):
        sub = getattr(config, name, None)
        if name.endswith("_config") and hasattr(sub, "to_dict") and getattr(sub, attr, None) is not None:
            return getattr(sub, attr)
    return default


def _token_ids(config, batch_size, seq_len, gen) -> torch.Tensor:
    vocab = int(_value(config, "vocab_size", 0) or 2)
    return torch.randint(0, vocab, (batch_size, seq_len), generator=gen, dtype=torch.int64)


def _labels(config) -> int:
    return int(_value(config, "num_labels", 2) or 2)


def _image_size(config) -> tuple[int, int]:
    size = _value(config, "image_size")
    if isinstance(size, int) and size > 0:
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size):
        return tuple(size)
    raise ModelSpecError(f"the config's image_size is {size!r}; the probe needs an int or a pair of ints "
                         f"to shape pixel_values.")


def _frames(model, config, seq_len) -> int:
    window = _value(config, "max_source_positions")
    if not (isinstance(window, int) and window > 0):
        return seq_len
    strides = [m.stride[0] for m in model.modules() if isinstance(m, torch.nn.Conv1d)]
    return window * math.prod(strides)


def _positive(config, attr: str, default: int | None = None) -> int:
    value = _value(config, attr, default)
    if not (isinstance(value, int) and value > 0):
        raise ModelSpecError(f"the config's {attr} is {value!r}; the probe needs a positive int to shape "
                             f"the model's inputs.")
    return value


def describe(batch, model) -> dict:
    """{"main_input", "shapes", "text", "row", "row_length"} of a batch of `model` (see the module
    docstring): `row` is one row of the main input in words, `row_length` "seq_len" or "config"
    (None, and `text` the shapes, for a batch of no kind this module knows, as a module:function may
    return). The main input is the model's `main_input_name` where the batch has it."""
    shapes = {str(k): list(v.shape) for k, v in _items(batch) if isinstance(v, torch.Tensor)}
    config = getattr(model, "config", None)
    known = [k for k in MAIN_INPUTS if isinstance(batch, dict) and len(shapes.get(k, ())) == _DIMS[k]]
    main = getattr(model, "main_input_name", None)
    main = main if main in known else next(iter(known), None)
    if main is None:
        listed = ", ".join(f"{k}{v}" for k, v in shapes.items())
        return {"main_input": None, "shapes": shapes, "text": f"{_rows(batch)} rows: {listed}", "row": None,
                "row_length": None}
    rows, *size = shapes[main]
    if main == "input_ids":
        row, length, text = f"{size[0]} tokens", "seq_len", f"{rows} x {size[0]} tokens"
    elif main == "pixel_values":
        image = " x ".join(map(str, size))
        row, length, text = f"an image of {image}", "config", f"{rows} images of {image}"
    elif main == "input_values":
        row, length, text = f"{size[0]} audio samples", "seq_len", f"{rows} x {size[0]} audio samples"
    else:  # input_features: channels first when the config counts mel bins (as sample_batch builds it)
        mels = config is not None and _value(config, "num_mel_bins") is not None
        frames, width = (size[1], size[0]) if mels else size
        row = f"{frames} frames of {width} {'mel bins' if mels else 'features'}"
        window = config is not None and isinstance(_value(config, "max_source_positions"), int)
        length, text = "config" if window else "seq_len", f"{rows} x {row}"
    targets = shapes.get("decoder_input_ids")
    if targets is not None and len(targets) == 2:
        text += f", {targets[0]} x {targets[1]} target tokens"
    return {"main_input": main, "shapes": shapes, "text": text, "row": row, "row_length": length}


_DIMS = {"input_ids": 2, "pixel_values": 4, "input_features": 3, "input_values": 2}


def _items(batch):
    if isinstance(batch, dict):
        return list(batch.items())
    if isinstance(batch, (list, tuple)):
        return list(enumerate(batch))
    return [("batch", batch)]


def _rows(batch) -> int:
    from autofit.engine.batches import rows_of
    return rows_of(batch)
