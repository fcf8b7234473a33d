"""Every private name of transformers that autofit uses, in this one module: each a small named
function saying what it is and why autofit needs it. `FEATURES` lists them by the autofit feature
that needs them; `require(feature, trainer)` (called when that feature is first used, never at
import: transformers is optional and is not imported here) refuses a transformers that lacks one,
naming it, the version found and the oldest that has it; `supported(feature)` (asked once when a run
is set up) degrades an optional one with one log line. Written against transformers 5.24; the
versions CI runs are in README's "Supported versions". Imports nothing of autofit but its
exceptions: the engine's checkpointing switch uses it too."""

from __future__ import annotations

import functools
import inspect
import logging
import sys

from autofit.errors import MissingInternal  # errors imports nothing of autofit

TESTED_WITH = "5.24"

# What each feature reads: ("Trainer", name) a method of the class, ("trainer", name) an attribute
# Trainer.__init__ sets, ("Trainer source", name) one Trainer's training loop sets while training,
# ("PreTrainedModel.enable_input_require_grads", name) one that method sets on the model.
FEATURES = {
    "the Trainer callback (autofit.integrations.hf_trainer)": (
        ("trainer", "_train_batch_size"),               # the batch size the Trainer cached
        ("trainer", "_created_lr_scheduler"),           # the Trainer made the scheduler itself
        ("Trainer", "_remove_unused_columns"),          # the columns it drops before collating
        ("Trainer", "_get_collator_with_removed_columns"),
        ("Trainer source", "_total_loss_scalar"),       # its running loss total
        ("Trainer source", "_tr_loss"),
        ("Trainer source", "_eval_dataloaders"),        # evaluation loaders it keeps
    ),
    "activation checkpointing of a transformers model": (
        ("PreTrainedModel.enable_input_require_grads", "_require_grads_hooks"),
        ("PreTrainedModel.enable_input_require_grads", "_require_grads_hook"),
    ),
    "the probe's report of a model's attention implementation": (
        ("PretrainedConfig", "_attn_implementation"),   # the implementation the model's layers call
    ),
}

_checked: set[str] = set()
TRAINER = "the Trainer callback (autofit.integrations.hf_trainer)"
CHECKPOINTING = "activation checkpointing of a transformers model"
ATTENTION = "the probe's report of a model's attention implementation"
# The oldest transformers that has each feature's names, for the refusal's advice (the Trainer's
# running loss `_tr_loss` came in 5.3).
SINCE = {TRAINER: "5.3"}
# What a run does instead when an optional feature's names are missing (said in its one line).
OPTIONAL = {
    CHECKPOINTING: "the input-embedding hooks transformers' gradient checkpointing adds stay on the model "
                   "when autofit switches checkpointing back off (inputs keep requiring grad)",
    ATTENTION: "the probe prices the model's attention as built and names no implementation",
}
log = logging.getLogger("autofit")


def _found_version() -> str:
    module = sys.modules.get("transformers")
    return getattr(module, "__version__", "(not loaded)")


def missing(feature: str, trainer=None) -> list[str]:
    """What this transformers lacks of `feature`'s private names; [] when all are there.
    `trainer`: a Trainer, for the attributes its __init__ sets (skipped without one)."""
    import transformers
    out = []
    for kind, name in FEATURES[feature]:
        if kind == "trainer":
            found = trainer is None or hasattr(trainer, name)
        elif kind == "Trainer":
            found = hasattr(transformers.Trainer, name)
        elif kind == "Trainer source":
            found = f"self.{name}" in _source(transformers.Trainer)
        elif kind == "PretrainedConfig":
            found = hasattr(transformers.PretrainedConfig, name)
        else:
            found = f"self.{name}" in _source(transformers.PreTrainedModel.enable_input_require_grads)
        if not found:
            out.append(f"{kind}.{name}")
    return out


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def require(feature: str, trainer=None) -> None:
    """Refuse `feature` on a transformers that lacks one of its private names (checked once)."""
    if feature in _checked:
        return
    lacking = missing(feature, trainer)
    if lacking:
        since = SINCE.get(feature, TESTED_WITH)
        raise MissingInternal(
            f"autofit's {feature} needs transformers internals: this transformers {_found_version()} "
            f"lacks {', '.join(lacking)} (transformers >= {since} has {'it' if len(lacking) == 1 else 'them'}); "
            f"install transformers {since} or newer")
    _checked.add(feature)


@functools.cache
def supported(feature: str) -> bool:
    """Whether this transformers has the names of optional `feature`; decided once per process
    (ask it when a run is set up, never inside a recovery). Where it has not, one log line says what
    is skipped and what the run does instead."""
    lacking = missing(feature)
    if lacking:
        log.warning("autofit: %s skipped in part: this transformers %s lacks %s; %s.", feature,
                    _found_version(), ", ".join(lacking), OPTIONAL[feature])
    return not lacking


# -- the Trainer ---------------------------------------------------------------------------------
def set_train_batch_size(trainer, size: int) -> None:
    """The Trainer caches its training batch size at __init__; a new plan changes it."""
    require(TRAINER, trainer)
    trainer._train_batch_size = size


def created_lr_scheduler(trainer) -> bool:
    """Whether the Trainer made its scheduler for the user's optimizer (its own flag)."""
    require(TRAINER, trainer)
    return getattr(trainer, "_created_lr_scheduler", False)


def loss_so_far(trainer) -> tuple:
    """(the running loss total, the loss pending since the last log) of the current train() call,
    each None when this Trainer keeps none (before its first train())."""
    return getattr(trainer, "_total_loss_scalar", None), getattr(trainer, "_tr_loss", None)


def drop_eval_loaders(trainer) -> None:
    """Forget the evaluation loaders the Trainer keeps (with persistent workers), so the next
    evaluation builds them with its new batch size."""
    getattr(trainer, "_eval_dataloaders", {}).clear()


def training_columns(trainer, dataset, collator) -> tuple:
    """(dataset, collator) with the columns the model's forward does not take removed, as the
    Trainer removes them before collating its training batches."""
    require(TRAINER, trainer)
    if "datasets" in sys.modules and isinstance(dataset, sys.modules["datasets"].Dataset):
        return trainer._remove_unused_columns(dataset, description="training"), collator
    if hasattr(trainer, "_get_collator_with_removed_columns"):
        return dataset, trainer._get_collator_with_removed_columns(collator, description="training")
    return dataset, collator


# -- PreTrainedModel's input hooks (gradient checkpointing) --------------------------------------
def require_grads_hooks(model) -> list:
    """The hooks `enable_input_require_grads` put on the input embeddings (inputs require grad)."""
    return list(getattr(model, "_require_grads_hooks", None) or [])


def forget_require_grads_hooks(model, own: list) -> None:
    """Drop `own` (hooks already removed) from the model's record of them, so its disable does not
    remove them again."""
    hooks = getattr(model, "_require_grads_hooks", None)
    if hooks is None:
        return
    model._require_grads_hooks = [h for h in hooks if h not in own]
    if getattr(model, "_require_grads_hook", None) in own:
        del model._require_grads_hook


# -- PreTrainedModel's block classes ----------------------------------------------------------
def no_split_modules(model) -> list:
    """The class names a Hugging Face model says are never split across devices (its transformer
    blocks): what `shard=True` wraps in fully_shard. [] for a model that names none."""
    return list(getattr(model, "_no_split_modules", None) or ())


# -- a model's attention implementation -----------------------------------------------------------
def attention_implementation(model) -> str | None:
    """The attention implementation a Hugging Face model's layers call ("eager", "sdpa", ...), or
    None for another model or where this transformers does not say (one line, once)."""
    config = getattr(model, "config", None)
    if config is None or not supported(ATTENTION):
        return None
    found = getattr(config, "_attn_implementation", None)
    return found if isinstance(found, str) else None
