"""What a kept tensor costs on the device: its storage (key and rounded bytes) and the activations
its autograd graph still holds saved for a backward that never ran. Used by autofit.diagnosis.leaks."""

from __future__ import annotations

import torch

from autofit.gpu.memory import storage_key
from autofit.gpu.simulate import round_bytes

MAX_GRAPH_NODES = 20_000


def _key(t: torch.Tensor) -> int:
    return storage_key(t.untyped_storage())


def _nbytes(t: torch.Tensor) -> int:
    return round_bytes(t.untyped_storage().nbytes())


def graph_bytes(nodes, on_device, skip: set) -> int:
    """Device bytes saved for backward by the autograd graph reachable from `nodes` (not yet freed)."""
    seen, keep, counted, total = set(), [], set(skip), 0
    todo = [n for n in nodes if n is not None]
    while todo and len(seen) < MAX_GRAPH_NODES:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)  # ids stay unique while the walk runs
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except Exception:  # freed by a backward already
                continue
            values = value if isinstance(value, (list, tuple)) else (value,)
            for v in values:
                if isinstance(v, torch.Tensor) and on_device(v):
                    k = _key(v)
                    if k not in counted:
                        counted.add(k)
                        total += _nbytes(v)
        try:
            todo.extend(n for n, _ in node.next_functions if n is not None)
        except Exception:
            pass
    return total
