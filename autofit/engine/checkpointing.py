"""Activation checkpointing switched on and off for a plan, leaving the model as it was found.

Hugging Face models use their own switch (non-reentrant, so it composes with autocast and frozen
inputs), and so does a wrapper of one that adds no parameters of its own (peft's PeftModel: its
adapters live inside the wrapped model's layers), as peft users switch it on the wrapped model:
wrapping its blocks from outside would recompute them with the key/value cache on, which the
recompute appends to a second time. Other models get the blocks of their largest
ModuleList/Sequential wrapped: each block's forward is recomputed in backward by
`torch.utils.checkpoint`.

A recompute runs a forward a second time, and a batch-coupled layer's forward writes its running
statistics. A block's recompute runs inside a context that copies its coupled layers' buffers before
it and puts back those it moved, so they move once per forward, as in a plain loop, also when a
BatchNorm layer is itself a block (its recompute calls its forward, not its hooks). Hugging Face's
switch recomputes a layer through its `__call__`: the coupling guard (plans/coupling) sees those.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from autofit.integrations import transformers_internals as hf_internals
from autofit.plans.coupling import coupled_modules

_KWARGS = {"use_reentrant": False}


def _hf_state(model):
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return None


def _hf_switch(model, on: bool) -> None:
    if on:
        # Its layers are recomputed through their __call__: the coupling guard's pre-hooks see it.
        kwargs = dict(_KWARGS)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        if hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()


def _is_hf(model) -> bool:
    return getattr(model, "supports_gradient_checkpointing", False) and _hf_state(model) is not None


def hf_model(model: torch.nn.Module):
    """The Hugging Face model whose switch checkpoints `model`: the model itself, or the outermost
    one inside it that holds every parameter of it (a wrapper such as peft's PeftModel); None."""
    if _is_hf(model):
        return model
    total = sum(1 for _ in model.parameters())
    for module in model.modules():
        if module is not model and _is_hf(module):
            return module if sum(1 for _ in module.parameters()) == total else None
    return None


def largest_block_list(model: torch.nn.Module):
    """The ModuleList/Sequential with the most parameters: the repeated blocks worth recomputing."""
    best, best_size = None, 0
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) > 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = module, size
    return best


@contextlib.contextmanager
def _statistics_kept(module):
    """Around a recompute: the buffers of `module`'s batch-coupled layers come back as they were."""
    buffers = [b for _, m in coupled_modules(module) for b in m.buffers(recurse=False) if b is not None]
    with torch.no_grad():
        saved = [(b, b.clone()) for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in saved:
                # Only what the recompute moved: a buffer it did not touch may be saved for the
                # backward by the first forward, and an in-place write would void that.
                if not torch.equal(b, copy):
                    b.copy_(copy)


def recompute_context(module):
    """`torch.utils.checkpoint`'s context_fn: nothing around the forward, `_statistics_kept` around
    the recompute."""
    return lambda: (contextlib.nullcontext(), _statistics_kept(module))


def _checkpointed(forward, block):
    kwargs = dict(_KWARGS)
    if coupled_modules(block):  # only blocks with running statistics pay for the context
        kwargs["context_fn"] = recompute_context(block)

    @functools.wraps(forward)
    def run(*args, **kw):
        if not torch.is_grad_enabled():
            return forward(*args, **kw)
        return checkpoint(forward, *args, **kw, **kwargs)
    run.__autofit_checkpoint__ = True
    return run


class Checkpointing:
    """Tracks the model's own setting so the run can switch per plan and restore at the end."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._hf_model = hf_model(model)
        self.hf = self._hf_model is not None
        self.initial = _hf_state(self._hf_model) if self.hf else False
        self.blocks = None if self.hf else largest_block_list(model)
        self.on = self.initial
        self._own_forward = {}

    @property
    def available(self) -> bool:
        return self.hf or self.blocks is not None

    def set(self, on: bool) -> None:
        if on == self.on:
            return
        if on and not self.available:
            raise ValueError(f"{type(self.model).__name__} has no repeated blocks to checkpoint "
                             f"(no ModuleList/Sequential); leave checkpointing off in the ladder.")
        if self.hf:
            # transformers' enable also hooks the input embeddings (inputs require grad) and its
            # disable leaves them unless PEFT is loaded: remove the ones autofit's switch made.
            hf_internals.require("activation checkpointing of a transformers model")
            before = {id(h) for h in hf_internals.require_grads_hooks(self._hf_model)}
            _hf_switch(self._hf_model, on)
            if on:
                self._own_hooks = [h for h in hf_internals.require_grads_hooks(self._hf_model)
                                   if id(h) not in before]
            else:
                self._remove_own_hooks()
        else:
            for block in self.blocks:
                if on:
                    # Remember a forward set on the instance (hooks, user wrappers) to put back.
                    self._own_forward[block] = vars(block).get("forward")
                    block.forward = _checkpointed(block.forward, block)
                elif getattr(block.forward, "__autofit_checkpoint__", False):
                    previous = self._own_forward.pop(block, None)
                    if previous is None:
                        del block.forward  # back to the class's forward
                    else:
                        block.forward = previous
        self.on = on

    def _remove_own_hooks(self) -> None:
        own = getattr(self, "_own_hooks", [])
        for hook in own:
            hook.remove()
        if own:
            hf_internals.forget_require_grads_hooks(self._hf_model, own)
        self._own_hooks = []

    def restore(self) -> None:
        self.set(self.initial)


def step_hook(runner, plan) -> None:
    """Checkpointing's switch (plans/switches.py): on or off for `runner`'s (a StepRunner's) model."""
    runner.checkpointing.set(plan.checkpointing)
