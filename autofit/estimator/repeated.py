"""Repeated blocks: a model's list of alike blocks, and fake copies of it cut to a few of them.

A model whose blocks are alike (an `nn.ModuleList`/`nn.Sequential` whose children have the same
class, the same parameter and buffer names, shapes, dtypes and trainability, and the same plain
attributes but for their own index, such as `layer_idx`) spends the same memory in every block. The
estimator walks a copy cut to a few blocks and derives the rest (`autofit.estimator.tiling`). What
is alike is read from the modules themselves, never from a model's name or config fields; whether
the cut copy really behaves like the whole is checked by walking one more block.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict

import torch

from autofit.estimator.fakes import fake_memo

MIN_BLOCKS = 5  # fewer: the walks the derivation needs (3 and 4 blocks) are not cheaper


def _signature(module: torch.nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                   for n, p in module.named_parameters(remove_duplicate=False))
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers(remove_duplicate=False))
    return type(module), params, buffers, tuple((n, type(m)) for n, m in module.named_modules())


def _same_value(a, b) -> bool:
    if a is b:
        return True
    try:
        same = a == b
    except Exception:
        return False
    return same if isinstance(same, bool) else False


def _plain_attributes(module: torch.nn.Module) -> dict:
    """A module's own attributes other than torch's bookkeeping (parameters, hooks, children)."""
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and not isinstance(v, (torch.Tensor, torch.nn.Module))}


def alike(blocks) -> bool:
    """Whether every child of `blocks` is a distinct module built the same way as the first: the
    same structure, tensors' metadata and plain attributes (an int equal to the child's own index,
    such as a layer index, may differ)."""
    children = list(blocks)
    if len({id(c) for c in children}) != len(children):
        return False  # one module used several times: its parameters are shared, not repeated
    first = _signature(children[0])
    first_modules = [m for _, m in children[0].named_modules()]
    for index, child in enumerate(children[1:], start=1):
        if _signature(child) != first:
            return False
        for a, b in zip(first_modules, (m for _, m in child.named_modules())):
            attrs_a, attrs_b = _plain_attributes(a), _plain_attributes(b)
            if attrs_a.keys() != attrs_b.keys():
                return False
            for k, va in attrs_a.items():
                vb = attrs_b[k]
                if type(va) is int and type(vb) is int and va == 0 and vb == index:
                    continue  # the block's own index
                if not _same_value(va, vb):
                    return False
    return True


def repeated_blocks(model: torch.nn.Module) -> tuple[str, int] | None:
    """(the path of the list of alike blocks with the most parameters, its length), or None."""
    best, best_size = None, 0
    for name, module in model.named_modules():
        # The lists themselves, not subclasses: the cut copy is a new list of the same type.
        if type(module) in (torch.nn.ModuleList, torch.nn.Sequential) and len(module) >= MIN_BLOCKS:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size and alike(module):
                best, best_size = (name, len(module)), size
    return best


def cut_fake_model(model: torch.nn.Module, path: str, keep: int) -> tuple[torch.nn.Module, dict]:
    """A fake copy of `model` (call under a FakeTensorMode) whose block list at `path` holds its
    first `keep` blocks only; {id(real tensor): fake} for the tensors the copy holds. The model is
    read, never changed: a new list of the copied blocks is given to deepcopy through its memo."""
    blocks = model.get_submodule(path)
    memo, fakes = fake_memo(model, cut=(blocks, keep))
    kept = [(name, copy.deepcopy(child, memo))
            for name, child in itertools.islice(blocks.named_children(), keep)]
    cut = torch.nn.Sequential(OrderedDict(kept)) if type(blocks) is torch.nn.Sequential \
        else torch.nn.ModuleList(child for _, child in kept)
    cut.training = blocks.training
    memo[id(blocks)] = cut
    copied = copy.deepcopy(model, memo)
    held = {id(t) for t in itertools.chain(copied.parameters(), copied.buffers())}
    return copied, {k: v for k, v in fakes.items() if id(v) in held}
