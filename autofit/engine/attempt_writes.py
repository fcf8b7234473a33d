"""What a failed attempt wrote into the model, undone before memory is checked.

A plain loop never sees a failed attempt: whatever its forward kept in the model (a tensor
attribute holding an autograd graph, `self.l_aux = aux_loss` as mixture-of-experts layers keep
theirs; running statistics; a counter) is overwritten at the next forward. autofit replays instead,
and checks that a failed attempt's memory is gone before it does, so the attempt's writes are
undone first: the modules' buffers and public attributes go back to the start state, and public
tensor attributes the attempt added are dropped. What still holds memory after that is named by
module and attribute (`holders`), with a fix that applies to it.
"""

from __future__ import annotations

import torch

# Module attributes that are torch's own bookkeeping, never a forward's writes.
_TORCH_OWN = frozenset(vars(torch.nn.Module()))


def undo(attributes, buffers) -> None:
    """Put the model's buffers and public attributes back as `buffers` and `attributes` (a
    StartState's parts) captured them, and drop public tensor attributes added since."""
    buffers.restore()
    attributes.restore()
    for module, before in attributes.saved:  # (module, its attributes at the capture)
        added = [name for name, value in vars(module).items()
                 if not name.startswith("_") and type(value) is torch.Tensor and name not in before]
        for name in added:
            delattr(module, name)


def _tensors_in(value, depth: int = 2) -> list:
    """Tensors in `value`: itself, the items of a list, tuple or dict, or an object's attributes,
    `depth` levels down (a cache object holding lists of tensors)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
        items = list(vars(value).values())
    else:
        return []
    return [t for item in items for t in _tensors_in(item, depth - 1)]


def holders(model, held: list) -> list[str]:
    """"module.attribute" of each module attribute (outside torch's bookkeeping) that holds one of
    the `held` tensors (by storage) or a tensor with an autograd graph, which pins the activations
    of the forward that made it."""
    storages = {id(t.untyped_storage()) for t in held}
    found = []
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            if name in _TORCH_OWN:
                continue
            tensors = _tensors_in(value)
            if any(t.grad_fn is not None or id(t.untyped_storage()) in storages for t in tensors):
                found.append(f"{path or type(model).__name__}.{name}")
    return found


def fix_for(names: list[str]) -> str:
    """The fix that applies to attributes autofit could not undo."""
    return (f"the model keeps them in {', '.join(names)}: autofit puts back public tensor attributes "
            f"and drops those a failed attempt added, but not a private one or one inside a container "
            f"or object. Keep a detached value there (value.detach(), or a float with .item()), or "
            f"clear it at the start of forward.")
