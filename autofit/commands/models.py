"""Models for the CLI: a spec string -> (model, sample batch).

A spec is one of
- a built-in name (`BUILTINS`): "bert-base" (the default), "distilbert", "gpt2", and the tiny
  "tiny-bert" / "tiny-gpt2" used by the demo and the tests; built from transformers' default
  configs, random weights, nothing downloaded;
- a path to a transformers `config.json`, or to a directory holding one;
- "module:function", a function returning `(model, sample_batch)`; it is called with the keyword
  arguments `batch_size` and `seq_len` that its signature accepts.

Built-in and config models are built on the meta device by default (`device="meta"`): their
parameters have shapes and dtypes but no storage, so BERT-base costs no memory and builds in
milliseconds; the estimator turns them into fake tensors. Pass `device="cpu"` for a real model
(training, `probe --verify`). Sample batches are real CPU tensors shaped for the model's own inputs
(token ids, pixel values, audio features, decoder inputs: autofit.commands.samples), drawn from a
fixed seed so every call gives the same batch.

Which class a config.json builds (a decision, in this order):
1. the first entry of the config's `architectures` that names a transformers class in one of the
   Auto mappings the probe trains (`_TASK_MAPPINGS`: causal LM, masked LM, sequence-to-sequence LM,
   speech sequence-to-sequence, sequence / image / audio classification, token classification); the
   mapping holding it gives the task, hence the labels;
2. otherwise the model_type's class in those mappings, causal LM first (labels are the input ids:
   every token is a target, the costliest common fine-tune), then sequence-to-sequence, then
   classification; an encoder family's causal head (BertLMHeadModel) is built with
   `is_decoder=True`, as transformers asks;
3. otherwise ModelSpecError naming the model type.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import logging
import os
import pathlib
import re
import sys
from collections.abc import Mapping

import torch

from autofit.commands import samples
from autofit.errors import ModelSpecError

DEFAULT = "bert-base"


# name -> (config class name, config keyword arguments, model class name, task)
BUILTINS: dict[str, tuple[str, dict, str, str]] = {
    "bert-base": ("BertConfig", {}, "BertForSequenceClassification", "classification"),
    "distilbert": ("DistilBertConfig", {}, "DistilBertForSequenceClassification", "classification"),
    "gpt2": ("GPT2Config", {}, "GPT2LMHeadModel", "causal"),
    "tiny-bert": ("BertConfig", dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=128,
                                     max_position_embeddings=512, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0),
                  "BertForSequenceClassification", "classification"),
    "tiny-gpt2": ("GPT2Config", dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=2, n_positions=512,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0),
                  "GPT2LMHeadModel", "causal"),
}

# The transformers Auto mappings whose classes the probe trains, and the labels each takes (see
# autofit.commands.samples); a class's task is the first mapping that holds it.
_TASK_MAPPINGS = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "seq2seq"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "classification"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "classification"),
    ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "classification"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token-classification"),
)
# Without architectures: the model_type's class in these, in this order (costliest common fine-tune
# first: a causal LM, where every token is a target).
_BY_MODEL_TYPE = tuple(m for m in _TASK_MAPPINGS if m[1] != "masked" and m[1] != "token-classification")
_TASK_NAMES = ", ".join(m.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES") for m, _ in _TASK_MAPPINGS)


def known() -> str:
    return ", ".join(BUILTINS)


def load(spec: str | None = None, *, batch_size: int = 32, seq_len: int = 128,
         device: str | torch.device = "meta"):
    """(model, sample batch) for a spec (see the module docstring); ModelSpecError when it cannot."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelSpecError(f"{name} must be a positive int but got {value!r}.")
    spec = DEFAULT if spec is None else spec
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"a model spec must be a non-empty string but got {spec!r}; use one of "
                             f"{known()}, a config.json path, or module:function.")
    spec = spec.strip()
    if spec in BUILTINS:
        config_name, kwargs, class_name, task = BUILTINS[spec]
        import transformers
        config = getattr(transformers, config_name)(**kwargs)
        return _build(getattr(transformers, class_name), config, task, batch_size, seq_len, device)
    path = pathlib.Path(spec).expanduser()
    if path.exists():
        return _from_config(path, batch_size, seq_len, device)
    if is_function_spec(spec):
        return _from_function(spec, batch_size, seq_len)
    if _looks_like_path(spec):
        raise ModelSpecError(f"no config file at {spec!r}; give a transformers config.json (or its "
                             f"directory), a built-in name ({known()}), or module:function.")
    raise ModelSpecError(f"unknown model {spec!r}; built-in models are {known()}; or give a "
                         f"config.json path or module:function.")


def is_function_spec(spec: str) -> bool:
    """Whether `spec` names a module:function (which builds the model and its batch itself)."""
    return ":" in spec and not _looks_like_path(spec) and not pathlib.Path(spec).expanduser().exists()


def _looks_like_path(spec: str) -> bool:
    return spec.endswith(".json") or "/" in spec or os.sep in spec or spec.startswith((".", "~"))


# -- built-in and config models ---------------------------------------------------------------------

def _from_config(path: pathlib.Path, batch_size, seq_len, device):
    import transformers
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelSpecError(f"the directory {str(path)!r} holds no config.json; give the file itself "
                             f"or a directory with one.")
    try:
        with quiet_transformers():  # its checks of token ids are noise for a random-init model
            config = transformers.AutoConfig.from_pretrained(str(path))
    except Exception as e:  # bad JSON, no model_type, unknown model_type
        raise ModelSpecError(f"cannot read the transformers config {str(path)!r}: {_one_line(e)}") from e
    cls, task = _class_for(config)
    if task == "causal" and not getattr(config, "is_decoder", True):
        from transformers.models.auto import modeling_auto as auto
        if config.model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            config.is_decoder = True  # an encoder family's causal head (BertLMHeadModel) asks for it
    return _build(cls, config, task, batch_size, seq_len, device)


def _class_for(config):
    """(model class, task) for a config: its architectures first, else its model_type's mappings."""
    import transformers
    for arch in getattr(config, "architectures", None) or ():
        task = _task_of(arch)
        if task is not None and hasattr(transformers, arch):
            return getattr(transformers, arch), task
    from transformers.models.auto import modeling_auto as auto
    for mapping, task in _BY_MODEL_TYPE:
        names = getattr(auto, mapping).get(config.model_type)
        for name in (names,) if isinstance(names, str) else names or ():
            if hasattr(transformers, name):
                named = getattr(config, "architectures", None)
                if named:  # the class named is not one the probe trains: say what is built instead
                    logging.getLogger("autofit").warning(
                        "the config's architectures name %s, which has no task head the probe trains; it "
                        "prices %s, the %s class of model_type %r, instead", ", ".join(named), name,
                        mapping.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES").lower().replace("_", " "),
                        config.model_type)
                return getattr(transformers, name), task
    named = ", ".join(getattr(config, "architectures", None) or ()) or "none"
    raise ModelSpecError(f"transformers has no model the probe can train for model_type "
                         f"{config.model_type!r} (architectures: {named}); the probe trains the classes of "
                         f"{_TASK_NAMES}: name one in the config's \"architectures\" or use "
                         f"module:function.")


def _task_of(class_name: str) -> str | None:
    """The task of a transformers class: the first Auto mapping (of `_TASK_MAPPINGS`) that holds it."""
    from transformers.models.auto import modeling_auto as auto
    for mapping, task in _TASK_MAPPINGS:
        for names in getattr(auto, mapping).values():
            if class_name == names or (not isinstance(names, str) and class_name in names):
                return task
    return None


def _max_positions(config) -> int | None:
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _build(cls, config, task, batch_size, seq_len, device):
    if task == "seq2seq":
        _check_decoder_length(cls, config, seq_len)
    try:
        with torch.device(device), quiet_transformers():
            model = cls(config)
    except Exception as e:
        raise ModelSpecError(f"cannot build {cls.__name__} from its config: {_one_line(e)}") from e
    limit = _max_positions(config)
    if limit is not None and seq_len > limit and getattr(cls, "main_input_name", None) == "input_ids" \
            and has_position_table(model):
        raise ModelSpecError(f"seq_len {seq_len} is longer than {cls.__name__} takes "
                             f"({limit} positions); pass --seq-len {limit} or less.")
    return model, samples.sample_batch(model, config, task, batch_size, seq_len)


# Names Hugging Face gives a table of absolute positions (BERT, GPT-2, BART/OPT/Whisper, ViT-likes):
# a model without one (relative positions: DeBERTa-v2 with position_biased_input=False, T5's
# buckets; rotary or ALiBi positions) takes rows longer than max_position_embeddings.
POSITION_TABLES = ("position_embeddings", "wpe", "embed_positions", "position_embedding")


def has_position_table(model) -> bool:
    """Whether `model` looks its rows' positions up in a table of absolute positions (an Embedding
    named as Hugging Face names them), which bounds the rows it takes."""
    return any(isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLES
               for name, module in model.named_modules())


def _check_decoder_length(cls, config, seq_len) -> None:
    limit = getattr(config, "max_target_positions", None)
    if isinstance(limit, int) and 0 < limit < seq_len:
        raise ModelSpecError(f"seq_len {seq_len} is longer than {cls.__name__}'s decoder takes "
                             f"({limit} target positions); pass --seq-len {limit} or less.")


@contextlib.contextmanager
def quiet_transformers():
    """transformers' config warnings (token ids, is_decoder) are noise for a random-init model."""
    from transformers.utils import logging as hf_logging
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


# Where transformers' modeling code takes an outside package's kernel when it is installed and its
# own torch code otherwise: `use_kernel_func_from_hub_with_fallback("<function>", "<package>")`.
_FALLBACK = re.compile(r"use_kernel_func_from_hub_with_fallback\(\s*[\"'][^\"']+[\"']\s*,\s*[\"']([\w.]+)[\"']")


def missing_kernels(model) -> list[str]:
    """The kernel packages `model`'s code would take (mamba_ssm, causal_conv1d, ...) that are not
    installed here: its step is then priced on the torch fallback, which holds more than the
    kernels (Mamba-2's chunked scan keeps its chunks' states)."""
    wanted = set()
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        try:
            source = inspect.getsource(module) if module is not None else ""
        except (OSError, TypeError):  # no source to read (a compiled or dynamic module)
            continue
        wanted.update(_FALLBACK.findall(source))
    return sorted(p for p in wanted if importlib.util.find_spec(p.split(".")[0]) is None)


def set_attention(model, name: str | None) -> str | None:
    """Switch a transformers model's attention to `name` ("eager", "sdpa", ...: transformers'
    `set_attn_implementation`, which checks it) when given; the implementation its layers then call,
    or None where that is not known (a model of the user's own code)."""
    from autofit.integrations.transformers_internals import attention_implementation
    if name is not None:
        setter = getattr(model, "set_attn_implementation", None)
        if setter is None:
            raise ModelSpecError(f"--attn {name}: {type(model).__name__} is not a transformers model, so its "
                                 f"attention is priced as its own code runs it; drop --attn.")
        try:
            setter(name)
        except (ValueError, ImportError) as e:  # unknown to transformers, or its kernel package missing
            raise ModelSpecError(f"--attn {name}: {type(model).__name__} cannot use it: {_one_line(e)}") from e
    return attention_implementation(model)


# -- module:function ----------------------------------------------------------------------------------

def _from_function(spec: str, batch_size, seq_len):
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise ModelSpecError(f"{spec!r} is not module:function; write e.g. mypkg.models:build.")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, and whatever the module raises while importing
        raise ModelSpecError(f"cannot import {module_name!r} for {spec!r}: {_one_line(e)}") from e
    fn = module
    for part in func_name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ModelSpecError(f"module {module_name!r} has no {func_name!r}; {spec!r} must name a "
                                 f"function returning (model, sample_batch).")
    if not callable(fn):
        raise ModelSpecError(f"{spec!r} is a {type(fn).__name__}, not a function returning "
                             f"(model, sample_batch).")
    try:
        result = fn(**_accepted(fn, batch_size=batch_size, seq_len=seq_len))
    except Exception as e:
        raise ModelSpecError(f"{spec}() raised {_one_line(e)}") from e
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        got = (f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__)
        raise ModelSpecError(f"{spec}() must return (model, sample_batch) with model a torch.nn.Module "
                             f"but returned {got}"
                             + (f" starting with {type(result[0]).__name__}" if isinstance(result, tuple)
                                and result else "") + ".")
    model, batch = result
    _check_batch(spec, batch)
    return model, batch


def _accepted(fn, **kwargs) -> dict:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items()
            if k in params and params[k].kind in (params[k].POSITIONAL_OR_KEYWORD, params[k].KEYWORD_ONLY)}


def _check_batch(spec: str, batch) -> None:
    from autofit.engine.batches import rows_of
    try:
        rows_of(batch)
    except ValueError as e:
        raise ModelSpecError(f"{spec}() returned a sample batch autofit cannot split: {_one_line(e)}") from e


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    name = type(error).__name__
    return f"{name}: {first}" if first else name


def describe(model: torch.nn.Module, batch) -> str:
    """'BertForSequenceClassification, 109.48M parameters; batch input_ids[32, 128], ...'."""
    n = sum(p.numel() for p in model.parameters())
    shapes = []
    if isinstance(batch, Mapping):
        items = batch.items()
    elif isinstance(batch, (list, tuple)):
        items = enumerate(batch)
    else:
        items = [("batch", batch)]
    for k, v in items:
        if isinstance(v, torch.Tensor):
            shapes.append(f"{k}{list(v.shape)}")
    return f"{type(model).__name__}, {n / 1e6:.2f}M parameters; batch {', '.join(shapes)}"
