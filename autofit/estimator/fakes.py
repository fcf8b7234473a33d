"""Fake copies for the estimator: a model, an optimizer (with its state) and a batch made of fake
tensors (shapes, strides and dtypes, no data), sharing nothing with the user's objects."""

from __future__ import annotations

import copy
import inspect
import itertools

import torch

def fake_like(t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor with t's shape, strides, dtype and requires_grad (call under the mode)."""
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else fake


def fake_model(model: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """A copy of `model` whose tensors are fake (call under a FakeTensorMode); {id(real): fake}.

    The copy shares nothing with the model, and no tensor data is copied: a deepcopy whose memo
    already maps every tensor of the model to its fake stand-in.
    """
    memo, fakes = fake_memo(model)
    return copy.deepcopy(model, memo), fakes


def fake_memo(model: torch.nn.Module, cut=None) -> tuple[dict, dict]:
    """(a deepcopy memo mapping every tensor of `model` to its fake stand-in, {id(real): fake}):
    every parameter, buffer and plain tensor attribute of its modules (call under a FakeTensorMode).
    `cut` = (a module list of `model`, n): a copy keeping only its first n children, whose other
    children need no fakes (those also reached another way get them)."""
    memo: dict = {}
    fakes: dict = {}
    modules = list(_modules(model, cut))
    tensors = itertools.chain((t for m in modules for t in m.parameters(recurse=False)),
                              (t for m in modules for t in m.buffers(recurse=False)),
                              (v for m in modules for v in vars(m).values() if isinstance(v, torch.Tensor)))
    for t in tensors:
        if id(t) not in fakes:
            fakes[id(t)] = memo[id(t)] = fake_like(t)
    return memo, fakes


def _modules(model: torch.nn.Module, cut):
    """`model`'s modules, each once, in `model.modules()` order; with `cut` = (list, n), the
    list's children past the first n are not gone into from the list."""
    seen, stack = set(), [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield module
        children = list(module.children())
        if cut is not None and module is cut[0]:
            children = children[:cut[1]]
        stack.extend(reversed(children))


# -- the optimizer ------------------------------------------------------------------------------

def _group_options(groups) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _same_kind(optimizer, groups) -> torch.optim.Optimizer:
    """An optimizer of the same class and options over `groups`.

    Only the defaults its constructor accepts are passed (AdamW's defaults hold
    `decoupled_weight_decay`, which AdamW() refuses); all of them are set afterwards.
    """
    cls = type(optimizer)
    parameters = inspect.signature(cls.__init__).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if open_ended or k in parameters}
    built = cls(groups, **kwargs)
    built.defaults.update(optimizer.defaults)
    for g, options in zip(built.param_groups, _group_options(groups)):
        g.update(options)
    return built


def check_optimizer(optimizer, model) -> None:
    """Raise when `optimizer` is no optimizer argument, or holds tensors that are not the model's."""
    if isinstance(optimizer, torch.optim.Optimizer):
        own = {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
        missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
        if missing:
            raise ValueError(f"the optimizer holds {len(missing)} tensor(s) that are not parameters of "
                             f"the model (e.g. {list(missing[0].shape)}); build it over "
                             f"model.parameters().")
    elif optimizer is not None and not callable(optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, a factory params -> Optimizer, or "
                        f"None but got {type(optimizer).__name__}.")


def fake_optimizer(optimizer, model, fakes: dict, device_type: str,
                   partial: bool = False) -> torch.optim.Optimizer:
    """The optimizer the step would use, over the fake parameters (call under the mode).
    `partial`: `fakes` holds some of the model's parameters only (a copy cut to fewer blocks);
    the optimizer is over those.

    None: AdamW; an Optimizer: its class, groups and options, with its state made fake; a factory:
    called with the fake parameters. For CUDA, an implementation left to the default becomes
    foreach, as CUDA would pick (fake tensors would otherwise get the single-tensor loop).
    """
    own = [fakes[id(p)] for p in model.parameters() if not partial or id(p) in fakes]
    if optimizer is None:
        built = torch.optim.AdamW(own)
    elif isinstance(optimizer, torch.optim.Optimizer):
        missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in fakes]
        if missing and not partial:
            raise ValueError(f"the optimizer holds {len(missing)} tensor(s) that are not parameters of "
                             f"the model (e.g. {list(missing[0].shape)}); build it over "
                             f"model.parameters().")
        groups = [{**options, "params": [fakes[id(p)] for p in g["params"] if id(p) in fakes]}
                  for g, options in zip(optimizer.param_groups, _group_options(optimizer.param_groups))]
        built = _same_kind(optimizer, groups)
        for p, state in optimizer.state.items():
            if id(p) in fakes:
                built.state[fakes[id(p)]] = {k: fake_like(v) if isinstance(v, torch.Tensor) else v
                                             for k, v in state.items()}
    elif callable(optimizer):
        built = optimizer(own)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(built).__name__}; it must return a "
                            f"torch.optim.Optimizer built over the parameters it is given.")
    else:
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, a factory params -> Optimizer, or "
                        f"None but got {type(optimizer).__name__}.")
    if device_type == "cuda":
        for g in built.param_groups:
            if "foreach" in g and g["foreach"] is None and not g.get("fused"):
                g["foreach"] = True
    return built


# torch's optimizers whose state for a parameter is made from that parameter and its group's
# options alone (no state shared between parameters, as LBFGS has).
_PER_PARAMETER = ("Adam", "AdamW", "SGD", "RMSprop", "NAdam", "RAdam", "Adamax")


def warm(optimizer) -> None:
    """One step on zero gradients: the optimizer's state now exists, as from a real run's 2nd step."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(not optimizer.state.get(p) for p in params):
        if not _warm_alike(optimizer, params):
            _step_on_zeros(optimizer, params)
    optimizer.zero_grad(set_to_none=True)


def _step_on_zeros(optimizer, params) -> None:
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
    optimizer.step()


def _signature(p) -> tuple:
    return tuple(p.shape), p.stride(), p.storage_offset(), p.dtype, p.device


def _warm_alike(optimizer, params) -> bool:
    """Warm one parameter of each group and kind (shape, strides, dtype) in an optimizer of the same
    class and options, and give every alike parameter a copy of its state (a model's repeated
    blocks: BERT-base's 201 parameters are 12 kinds; a fake op costs the same for any size, so the
    step is most of an estimator's set-up). Only for torch's optimizers whose state is each
    parameter's own, and one with no state yet; False: warm it whole."""
    cls = type(optimizer)
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or cls.__name__ not in _PER_PARAMETER \
            or optimizer.state:
        return False
    kinds: dict = {}  # (group, signature) -> the parameter warmed for them
    for i, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if p.requires_grad:
                kinds.setdefault((i, _signature(p)), p)
    if len(kinds) == len(params):
        return False  # nothing alike: the step itself is as cheap
    groups = [{**options, "params": [p for (i, _), p in kinds.items() if i == index]}
              for index, options in enumerate(_group_options(optimizer.param_groups))]
    small = _same_kind(optimizer, [g for g in groups if g["params"]])
    _step_on_zeros(small, list(kinds.values()))
    small.zero_grad(set_to_none=True)
    for i, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if p.requires_grad:
                made = small.state[kinds[(i, _signature(p))]]
                optimizer.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                                      for k, v in made.items()}
    return True


def on_device_state(optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors that live on the device.

    The scalar `step` counters stay in host memory (CUDA keeps them on the CPU unless the
    optimizer is capturable or fused; on the simulated GPU they are made outside its counter).
    """
    out = []
    for group in optimizer.param_groups:
        device_steps = bool(group.get("capturable") or group.get("fused"))
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and (device_steps or not (k == "step" and v.dim() == 0)):
                    out.append(v)
    return out
