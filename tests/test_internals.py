"""The one adapter of torch.distributed's private names (autofit.distributed.internals) and its
check walked together: every private name the adapter uses is one the check looks for, and no other
module of autofit.distributed reaches a private name of torch's itself."""

from __future__ import annotations

import ast
import pathlib

import autofit.distributed as package
from autofit.distributed import internals

HERE = pathlib.Path(package.__file__).parent
DOCUMENTED = {"_fields", "_asdict", "_replace", "_make",  # namedtuple's public API
              "_no_split_modules"}  # Hugging Face's (transformers), not torch's


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in DOCUMENTED


def _foreign_private_names(path: pathlib.Path, own: set[str]) -> set[str]:
    """Private names reached on objects other than `self`/`cls` and not autofit's own, and private
    modules or names imported."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and node.attr not in own:
                found.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and \
                _private(node.args[1].value) and node.args[1].value not in own:
            found.add(node.args[1].value)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {part for part in node.module.split(".") if _private(part)}
            found |= {a.name for a in node.names if _private(a.name)}
    return found


def _own_private_names() -> set[str]:
    """Private attributes and functions autofit defines (self._x = ..., def _x, class attributes)."""
    own = set()
    root = HERE.parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _private(node.name):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self" and _private(node.attr):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                own.add(node.id)
    return own


def _checked_names() -> set[str]:
    return {part for names in internals.CHECKED.values() for path in names for part in path.split(".")}


def test_every_private_name_the_adapter_uses_is_checked_at_startup():
    used = _foreign_private_names(HERE / "internals.py", own=set())
    assert used, "the walk found nothing: it is broken"
    assert used - _checked_names() == set()


def test_no_other_distributed_module_reaches_a_private_name_of_torch():
    own = _own_private_names()
    reached = {path.name: _foreign_private_names(path, own) for path in sorted(HERE.glob("*.py"))
               if path.name != "internals.py"}
    assert {name: names for name, names in reached.items() if names} == {}


def test_the_module_level_internals_are_all_in_this_torch_and_a_missing_one_is_named(monkeypatch):
    import pytest
    import torch
    assert internals.missing(sharded=True) == []
    monkeypatch.delattr(torch.distributed.ProcessGroup, "_get_backend")
    assert internals.missing() == ["torch.distributed.ProcessGroup._get_backend"]
    with pytest.raises(RuntimeError, match=r"this torch .* lacks torch\.distributed\.ProcessGroup\._get_backend: "
                                           r"install torch 2\.13"):
        internals.refuse_missing()


def test_the_scalers_check_on_shards_unscales_them_and_reports_found_inf_without_reducing_it(tmp_path):
    """local_found_inf: GradScaler.unscale_ on DTensor gradients unscales each rank's shard in place
    and leaves found-inf local (in `found`), for the clipping agreement to combine."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        outcomes = []
        for last in (3.0, float("inf")):
            param = torch.nn.Parameter(DTensor.from_local(torch.zeros(2), mesh, [Shard(0)], run_check=False))
            param.grad = DTensor.from_local(torch.tensor([1024.0 * 0.5, 1024.0 * last]), mesh, [Shard(0)],
                                            run_check=False)
            optimizer = torch.optim.SGD([param], lr=0.1)
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            scaler.scale(torch.ones(()))  # the scale is made lazily
            found = []
            with internals.local_found_inf(found):
                scaler.unscale_(optimizer)
            outcomes.append((param.grad.to_local().tolist(), [t.item() for t in found]))
        assert outcomes == [([0.5, 3.0], [0.0]), ([0.5, float("inf")], [1.0])]
        # handed back: DTensor's own handler again
        op = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
        assert DTensor._op_dispatcher._custom_op_handlers[op].__name__ == "found_inf_reduce_handler"
    finally:
        dist.destroy_process_group()
