"""Activation checkpointing switched on and off for a plan, leaving the model as it was found.

Hugging Face models use their own switch (non-reentrant, so it composes with autocast and frozen
inputs), and so does a wrapper of one that adds no parameters of its own (peft's PeftModel: its
adapters live inside the wrapped model's layers), as peft users switch it on the wrapped model:
wrapping its blocks from outside would recompute them with the key/value cache on, which the
recompute appends to a second time. Other models get the blocks of their largest
ModuleList/Sequential wrapped: each block's forward is recomputed in backward by
`torch.utils.checkpoint`.

A recompute runs a forward a second time. A block autofit wraps is recomputed from the state its
forward found (`_Recompute`: the buffers it wrote, the generators torch's checkpoint does not fork),
so spectral norm vectors, tracked InstanceNorm statistics and counters move once per forward, as in
a plain loop. Batch-coupled layers' running statistics are the coupling guard's (plans/coupling):
it sees every recompute through the layer's pre-hook, Hugging Face's switch's included, and puts
them back when the backward ends. The block's modules' public number attributes (a call counter, a
schedule's step) are set to what the forward found for the recompute and put back after it, so
`self.calls += 1` moves once per forward. Other side effects (a forward hook that counts calls, a
mutable container) happen twice under any checkpointing, as in a plain loop that checkpoints.

A failed attempt must leave nothing held. A block autofit wraps keeps its arguments with the call
(`_Call`), not in torch's checkpoint frame, and they are dropped after a failed attempt: an object a
block writes its activations into (a key/value cache, a list of hidden states) would otherwise hold
the attempt's graph in a cycle through autograd's C++ nodes that no collection frees. Transformers'
switch sets flags on the model and its layers; those are the plan's, so a replay's restore of the
start state leaves them (`model_state.switch_writes`): half put back, GPT-2's model would pass its
cache to layers that checkpoint it. autofit still calls a model as the plain loop does (no
`use_cache=False` of its own): with the switch whole, transformers' models drop the cache under
checkpointing themselves, and without checkpointing no frame holds it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from autofit.engine.model_state import immutable, module_generators, switch_writes
from autofit.engine.module_tree import registrations
from autofit.engine.replay import python_rng_state, set_python_rng_state
from autofit.integrations import transformers_internals as hf_internals
from autofit.plans.coupling import coupled_modules

_KWARGS = {"use_reentrant": False}


def hf_checkpointing_state(model):
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return None


def hf_switch_checkpointing(model, on: bool) -> None:
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
    return getattr(model, "supports_gradient_checkpointing", False) and hf_checkpointing_state(model) is not None


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


class _Recompute:
    """One checkpointed call of a block: what its forward wrote, put back for the recompute.

    The forward may write state beyond its output: running statistics (BatchNorm, InstanceNorm with
    tracked statistics), spectral norm's power-iteration vectors, a counter buffer, and it may draw
    from generators torch's checkpoint does not fork (a generator the block holds, Python's
    `random`, numpy's; torch's own are forked by the checkpoint). Before the recompute the buffers
    (every one: which changed is not read on the host) and those generators are set to what the
    forward found, so it computes the same activations (a spectral norm recomputed from the vectors
    it already moved would give another weight, hence wrong gradients); after it, they are put back
    to what they were when the recompute began (as torch forks its own generators): the state moves
    once per forward, as in a plain loop.
    """

    def __init__(self, block):
        self.block = block
        self.found: list = []  # (buffer, a copy on the device of it as the forward found it)
        self.changed_attributes: list = []  # (module, name, value as the forward found it)

    def forward_context(self):
        return self._forward()

    def recompute_context(self):
        return self._recompute()

    @contextlib.contextmanager
    def _forward(self):
        modules, buffers, self.generators = _parts(self.block)
        with torch.no_grad():  # copies on the device: the host waits for nothing
            self.found = [(b, b.clone()) for b in buffers]
        self.found_rng = _rng(self.generators)
        found_attributes = plain_attributes(modules)
        yield
        self.changed_attributes = [(m, name, value) for m, name, value in found_attributes
                                   if vars(m).get(name, _ABSENT) != value]

    @contextlib.contextmanager
    def _recompute(self):
        # Every buffer goes back to what the forward found, not only those it changed: telling
        # which changed would read them on the host (native kernels write without moving
        # `_version`), a wait for the device per buffer in the middle of the forward.
        now_rng = _rng(self.generators)
        with torch.no_grad():
            now = [(b, b.clone()) for b, _ in self.found]
            for b, before in self.found:
                b.copy_(before)
        _set_rng(self.generators, self.found_rng)
        now_attributes = [(m, name, vars(m).get(name, _ABSENT)) for m, name, _ in self.changed_attributes]
        _set_attributes(self.changed_attributes)
        try:
            yield
        finally:
            _set_rng(self.generators, now_rng)
            _set_attributes(now_attributes)
            with torch.no_grad():
                for b, value in now:
                    # Written through `.data`, whose writes do not move `_version`: where the
                    # recompute wrote the same again (it starts from the same state), a buffer
                    # it saved for its backward is left as it saved it; elsewhere it is put back
                    # to what it was when the recompute began.
                    b.data.copy_(value)
            self.found = []


# block -> (registrations at its walk, its modules, its buffers, its generators): every checkpointed
# call of a block reads these, every step; the block is walked again only after a module or a
# buffer was registered somewhere (engine/module_tree).
_WALKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _parts(block) -> tuple[list, list, list]:
    """(the block's modules, `_buffers(block)`, its generators), from the block's last walk."""
    key = registrations()
    walked = _WALKED.get(block)
    if walked is None or walked[0] != key:
        walked = (key, list(block.modules()), _buffers(block), module_generators(block))
        _WALKED[block] = walked
    return walked[1:]


def _buffers(block) -> list:
    """The block's buffers but those of the batch-coupled layers inside it: the coupling guard
    (plans/coupling) puts theirs back when the backward ends, for any checkpointing (a coupled
    block's own are here: its recompute calls its forward, which its pre-hook does not see)."""
    coupled = {id(b) for _, m in coupled_modules(block) if m is not block for b in m.buffers(recurse=False)}
    return list({id(b): b for b in block.buffers() if b is not None and id(b) not in coupled}.values())


_ABSENT = object()  # an attribute the forward found missing


def plain_attributes(modules) -> list:
    """(module, name, value) of the public attributes of `modules` that hold a number, a string or
    a tuple of them (a call counter, a temperature schedule's step): what a forward may move with
    `self.calls += 1`. Values of these kinds are immutable, so no copy is needed."""
    return [(m, name, value) for m in modules for name, value in vars(m).items()
            if not name.startswith("_") and immutable(value)]


def _set_attributes(saved) -> None:
    for module, name, value in saved:
        if value is _ABSENT:
            vars(module).pop(name, None)
        else:
            vars(module)[name] = value


def _rng(generators) -> tuple:
    """The block's generators and Python's and numpy's (torch's own the checkpoint forks)."""
    return [g.get_state() for g in generators], python_rng_state()


def _set_rng(generators, state) -> None:
    own, python = state
    for g, value in zip(generators, own):
        g.set_state(value)
    set_python_rng_state(python)


def _checkpointed(forward, block, calls):
    """`forward` run by torch's checkpoint. Only its positional tensors are given to torch (which
    reads their devices for the random state); every other argument stays with the call (`calls`
    holds this attempt's calls weakly), so a failed attempt's arguments can be dropped (`release`)."""
    @functools.wraps(forward)
    def run(*args, **kw):
        if not torch.is_grad_enabled():
            return forward(*args, **kw)
        call = _Call(forward, block, args, kw)
        calls.add(call)
        return checkpoint(call.run, *call.tensors(), **_KWARGS,
                          context_fn=lambda: (call.forward_context(), call.recompute_context()))
    run.__autofit_checkpoint__ = True
    return run


class _Call(_Recompute):
    """One checkpointed call: the block's arguments, held here rather than by torch's checkpoint.

    A block may be given an object it writes its activations into (a key/value cache, a list of
    hidden states for a deep-supervision loss). Torch's checkpoint keeps a block's arguments for
    the recompute, in a frame that only the saved-tensor hooks of the attempt's graph reach; the
    object's tensors hold that graph (their `grad_fn`). That is a cycle through autograd's C++
    nodes, which Python's garbage collector cannot see: after a failed attempt (whose backward never
    ran to free the graph) it would hold the attempt's activations for good. Dropping the arguments
    kept here breaks it, with no private name of torch."""

    def __init__(self, forward, block, args, kw):
        super().__init__(block)
        self.forward = forward
        self.places = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.inputs = (list(args), kw)

    def tensors(self) -> list:
        args = self.inputs[0]
        return [args[i] for i in self.places]

    def run(self, *tensors):
        args, kw = self.inputs
        args = list(args)
        for i, t in zip(self.places, tensors):
            args[i] = t
        return self.forward(*args, **kw)

    def release(self) -> None:
        """Drop what the call holds of a failed attempt: its arguments and the buffers' copies."""
        self.inputs, self.found = None, []


class Checkpointing:
    """Tracks the model's own setting so the run can switch per plan and restore at the end."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._hf_model = hf_model(model)
        self.hf = self._hf_model is not None
        # whether the input hooks transformers' switch adds can be told apart and removed when the
        # switch goes back off: decided here, when the run is set up, never inside a recovery
        self._hooks_readable = self.hf and hf_internals.supported(hf_internals.CHECKPOINTING)
        self.initial = hf_checkpointing_state(self._hf_model) if self.hf else False
        self.blocks = None if self.hf else largest_block_list(model)
        self.on = self.initial
        self._own_forward = {}
        self.calls = weakref.WeakSet()  # the checkpointed calls alive (engine/checkpointing._Call)

    @property
    def available(self) -> bool:
        return self.hf or self.blocks is not None

    def set(self, on: bool) -> None:
        """Checkpointing on or off for the coming attempt (set before each one)."""
        self.calls.clear()  # a graph an earlier attempt left alive keeps its calls' arguments
        if on == self.on:
            return
        if on and not self.available:
            raise ValueError(f"{type(self.model).__name__} has no repeated blocks to checkpoint "
                             f"(no ModuleList/Sequential); leave checkpointing off in the ladder.")
        if self.hf:
            # transformers' enable also hooks the input embeddings (inputs require grad) and its
            # disable leaves them unless PEFT is loaded: remove the ones autofit's switch made.
            # (where the hooks cannot be read they stay as transformers' switch leaves them)
            before = {id(h) for h in hf_internals.require_grads_hooks(self._hf_model)}
            with switch_writes(self._hf_model):  # its flags are the plan's: a replay keeps them
                hf_switch_checkpointing(self._hf_model, on)
            if self._hooks_readable and on:
                self._own_hooks = [h for h in hf_internals.require_grads_hooks(self._hf_model)
                                   if id(h) not in before]
            elif self._hooks_readable:
                self._remove_own_hooks()
        else:
            for block in self.blocks:
                if on:
                    # Remember a forward set on the instance (hooks, user wrappers) to put back.
                    self._own_forward[block] = vars(block).get("forward")
                    block.forward = _checkpointed(block.forward, block, self.calls)
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

    def release(self) -> None:
        """After a failed attempt: the arguments its checkpointed calls kept go (see `_Call`)."""
        for call in list(self.calls):
            call.release()
        self.calls.clear()


def step_hook(runner, plan) -> None:
    """Checkpointing's switch (plans/switches.py): on or off for `runner`'s (a StepRunner's) model."""
    runner.checkpointing.set(plan.checkpointing)


def checkpointing_applies(plan, model, optimizer, device, checkpointing) -> str | None:
    """Checkpointing's `applies` (plans/switches.py): the model has blocks or a Hugging Face switch."""
    if plan.checkpointing:
        checkpointing = checkpointing or Checkpointing(model)
        if not checkpointing.available and not checkpointing.initial:
            return (f"activation checkpointing does not apply to {type(model).__name__}: it has no "
                    f"repeated blocks (ModuleList/Sequential) and no Hugging Face switch")
    return None
