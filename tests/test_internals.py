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
