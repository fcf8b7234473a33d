"""The kinds of leak autofit.diagnosis.leaks reports, each with its fix, and the words that name a
culprit (what holds it, how many tensors, their shapes, the graph they keep)."""

from __future__ import annotations

import torch

from autofit.sizes import format_size

KINDS = ("batch-on-device", "graph-kept", "tensor-kept", "previous-optimizer", "memory-growth")

FIX_BATCH = ("keep the DataLoader on the CPU (no .to('cuda') in the dataset, the collate_fn or before "
             "calling autofit; pin_memory=True makes the copy fast); autofit moves each micro-batch to "
             "the device and frees it after the step")
FIX_LOSS = ("append loss.item() (a Python float), not loss: a tensor with a grad_fn keeps its autograd "
            "graph, and the device memory behind it, alive")
FIX_OUTPUT = ("keep out.detach() (or out.detach().cpu(), or .item() for a number) instead of the output "
              "itself, and run forwards you only read under torch.no_grad(): a tensor with a grad_fn "
              "keeps its autograd graph alive")
FIX_NODE = ("do not keep grad_fn objects or outputs of forwards you never backward; run such forwards "
            "under torch.no_grad()")
FIX_TENSOR = ("keep Python numbers (.item()) or CPU copies (.cpu()) of what you collect across steps, "
              "and drop references you no longer need")
FIX_OPTIMIZER = ("`del` the earlier optimizer and its scheduler (and anything else referencing them, a "
                 "saved state_dict included), then gc.collect() and torch.cuda.empty_cache(), before "
                 "the next phase; pass autofit.run an optimizer factory so it owns and frees the state")
FIX_GROWTH = ("no tensor Python can see holds it: look for what your loss_fn, hooks or model keep from "
              "step to step (a graph kept through a hook, a cache keyed by step, a C++ extension); "
              "gc.collect() does not free it")



def shape_of(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def culprit_text(root, outer: str, container, tensors, nodes, saved: int, optimizer) -> str:
    where = root or "an object autofit could not name"
    if outer and optimizer is None:
        where += f", at {outer}"
    if optimizer is not None:
        shapes = sorted({shape_of(t) for t in tensors})
        shown = ", ".join(shapes[:3]) + (", ..." if len(shapes) > 3 else "")
        return f"the state of {optimizer}, held by {where}: {len(tensors)} tensor(s) ({shown})"
    what = []
    if tensors:
        fns = sorted({type(t.grad_fn).__name__ for t in tensors if t.grad_fn is not None})
        shapes = sorted({shape_of(t) for t in tensors})
        n = len(tensors)
        listed = container in ("a list", "a tuple")
        noun = f"{n} tensors" if n > 1 else "1 tensor" if listed else "a tensor"
        with_fn = f" with grad_fn={', '.join(f'<{f}>' for f in fns)}" if fns else ""
        if len(shapes) == 1:
            shape = f" ({shapes[0]}{' each' if n > 1 else ''})"
        else:
            shape = f" ({', '.join(shapes[:3])}{', ...' if len(shapes) > 3 else ''})"
        what.append(f"{noun}{with_fn}{shape}")
    if nodes:
        names = ", ".join(f"<{x}>" for x in sorted({type(n).__name__ for n in nodes}))
        what.append(f"{len(nodes)} autograd nodes {names}" if len(nodes) > 1 else
                    f"1 autograd node {names}" if container in ("a list", "a tuple") else
                    f"an autograd node {names}")
    body = " and ".join(what)
    if container in ("a list", "a tuple"):
        body = f"{container} of {body}"
    elif container is not None:
        body = f"{container} holding {body}"
    text = f"{where}: {body}"
    if saved:
        text += f", keeping {format_size(saved)} saved for a backward that never ran"
    return text


def fix_for(kind: str, tensors) -> str:
    if kind == "graph-kept":
        if tensors and all(t.dim() == 0 for t in tensors):
            return FIX_LOSS
        return FIX_OUTPUT if tensors else FIX_NODE
    return {"tensor-kept": FIX_TENSOR, "previous-optimizer": FIX_OPTIMIZER,
            "memory-growth": FIX_GROWTH, "batch-on-device": FIX_BATCH}[kind]
