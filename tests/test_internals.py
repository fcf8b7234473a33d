"""The adapters of outside libraries' private names, walked together with their checks: one per
library (autofit.torch_internals, autofit.distributed.internals, autofit.integrations.
transformers_internals, autofit.integrations.accelerate). On the versions autofit is written
against every name resolves; a name taken away is named by the check, with the version found and
the feature; and no module outside the adapters reaches a private name of those libraries."""

from __future__ import annotations

import ast
import re
import pathlib

import autofit.distributed as package
from autofit.distributed import internals

HERE = pathlib.Path(package.__file__).parent
DOCUMENTED = {"_fields", "_asdict", "_replace", "_make",  # namedtuple's public API
              "_getframe"}  # CPython's sys._getframe (documented), not an outside library's


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in DOCUMENTED


def _foreign_private_names(path: pathlib.Path, own: set[str]) -> set[str]:
    """Private names reached on objects other than `self`/`cls` and not autofit's own, and private
    modules or names imported (the walk of `_reached`, below)."""
    return _reached(path, own)


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


# -- every adapter: all there on the versions autofit is written against, a missing one named ----

ADAPTERS = {"torch_internals.py", "distributed/internals.py", "integrations/transformers_internals.py",
            "integrations/accelerate.py"}
# Files another change holds at the moment: their private accesses have adapter functions already
# (the names on the right), and are switched to them next. Tighten this to {} then.
NOT_YET_SWITCHED: dict = {}  # every module outside the adapters goes through them
OUTSIDE_ROOTS = ("torch", "transformers", "accelerate")


def _outside_names() -> set[str]:
    """Private names outside libraries put on the objects autofit handles, which autofit also
    happens to define for itself (so the own-name filter must not hide them)."""
    import torch
    objects = (torch.nn.Module(), torch.nn.Module, torch.Tensor, torch.UntypedStorage, torch.optim.Optimizer)
    return {n for o in objects for n in set(dir(o)) | set(getattr(o, "__dict__", {})) if _private(n)}


def _reached(path: pathlib.Path, own: set[str]) -> set[str]:
    """Private names of outside libraries `path` reaches: attributes on objects other than
    self/cls, getattr-family and dict-key strings, private modules of torch/transformers/accelerate
    imported."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and node.attr not in own:
                found.add(node.attr)
        elif isinstance(node, ast.Call) and len(node.args) > 1 - isinstance(node.func, ast.Attribute) \
                and ((isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr", "delattr"))
                     or (isinstance(node.func, ast.Attribute) and node.func.attr in ("pop", "get"))):
            key = node.args[1] if isinstance(node.func, ast.Name) else node.args[0]
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and _private(key.value) \
                    and key.value not in own:
                found.add(key.value)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if module.split(".")[0] in OUTSIDE_ROOTS:
                    found |= {part for part in module.split(".") if _private(part)}
                    if isinstance(node, ast.ImportFrom):
                        found |= {a.name for a in node.names if _private(a.name)}
    return found


def test_no_module_outside_the_adapters_reaches_a_private_name_of_torch_transformers_or_accelerate():
    root = HERE.parent
    own = _own_private_names() - _outside_names()
    reached = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name in ADAPTERS:
            continue
        names = _reached(path, own) - NOT_YET_SWITCHED.get(name, set())
        if names:
            reached[name] = names
    assert reached == {}


def test_the_walk_finds_a_private_name_outside_the_adapters(tmp_path):
    """The walk above is not vacuous: each kind of access it looks for is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nfrom torch._C import DispatchKey\nimport torch.testing._internal.x\n"
                     "torch._C._current_graph_task_id()\nm._buffers\ngetattr(t, '_tr_loss', None)\n"
                     "m.__dict__.pop('_is_accelerate_prepared', None)\nself._mine\n")
    own = _own_private_names() - _outside_names()
    assert _reached(probe, own) == {"_C", "_internal", "_current_graph_task_id", "_buffers", "_tr_loss",
                                    "_is_accelerate_prepared"}


def test_the_files_not_yet_switched_still_reach_exactly_what_is_allowed_for_them():
    """The allow-list is no wider than what those files reach (remove an entry once switched)."""
    root = HERE.parent
    own = _own_private_names() - _outside_names()
    assert {name: _reached(root / name, own) for name in NOT_YET_SWITCHED} == NOT_YET_SWITCHED


def test_each_torch_internal_is_here_exactly_on_the_torches_said_to_have_it_and_a_missing_one_is_named(monkeypatch):
    """Run on every torch of the version matrix: the features this torch lacks are exactly those
    whose first torch (`SINCE`) is newer, and a required feature's missing name is refused with the
    torch found and the one to install."""
    import pytest
    import torch
    from autofit import torch_internals as ti
    lacking = {feature for feature in ti.FEATURES if ti.missing(feature)}
    assert lacking == {f for f, since in ti.SINCE.items() if ti.TORCH_VERSION < ti.version_tuple(since)}
    feature = "batch-coupled layers under activation checkpointing"
    monkeypatch.setattr(ti, "_checked", set())
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    assert ti.missing(feature) == ["torch._C._current_graph_task_id"]
    with pytest.raises(ti.MissingInternal, match=rf"autofit's {feature} needs torch internals: this torch "
                                                 rf"{re.escape(torch.__version__)} lacks "
                                                 rf"torch\._C\._current_graph_task_id \(torch 2\.13 has it\); "
                                                 rf"install torch 2\.13 or newer"):
        ti.batch_norm_base()


def test_an_optional_feature_this_torch_lacks_is_said_once_and_skipped(monkeypatch, caplog):
    import torch
    from autofit import torch_internals as ti
    for name in ("_accelerator_getAllocatorSettings", "_accelerator_setAllocatorSettings"):
        monkeypatch.delattr(torch._C, name, raising=False)  # torch 2.6 has neither, 2.11 the setter only
    ti.supported.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="autofit"):
            assert [ti.supported(ti.ALLOCATOR_SETTINGS) for _ in range(3)] == [False] * 3
        assert [r.getMessage() for r in caplog.records] == [
            f"autofit: expandable segments after fragmentation skipped: this torch {torch.__version__} lacks "
            f"torch._C._accelerator_getAllocatorSettings, torch._C._accelerator_setAllocatorSettings "
            f"(torch >= 2.12 has them); after a fragmented OOM the "
            f"cache is emptied and the plan replayed without switching segments to expandable; set "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the run to have them."]
    finally:
        ti.supported.cache_clear()


def test_a_missing_nn_module_slot_is_named(monkeypatch):
    import torch
    from autofit import torch_internals as ti
    original = torch.nn.Module.__init__

    def without_buffers(self, *args, **kwargs):
        original(self, *args, **kwargs)
        del self.__dict__["_buffers"]
    monkeypatch.setattr(torch.nn.Module, "__init__", without_buffers)
    assert ti.missing("replaying a global batch from the same state") == ["torch.nn.Module()._buffers"]


def test_the_sharded_estimates_fake_world_internals_are_in_this_torch_and_a_missing_one_is_named(monkeypatch):
    import pytest
    import torch.distributed.distributed_c10d as c10d
    internals.refuse_missing_for_estimate()
    monkeypatch.delattr(c10d, "_World")
    with pytest.raises(RuntimeError, match=r"sharded estimate .* lacks torch\.distributed\.distributed_c10d\._World: "
                                           r"install torch 2\.13"):
        internals.new_world()


def _tiny_trainer(tmp_path):
    import torch
    import transformers
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    return transformers.Trainer(model=torch.nn.Linear(2, 1), args=args)


def test_each_transformers_internal_is_here_exactly_on_the_versions_said_to_have_it_and_a_missing_one_is_named(
        tmp_path, monkeypatch):
    """Run on every transformers of the version matrix: the features it lacks are exactly those whose
    first version (`SINCE`) is newer, and the Trainer's refusal names the names, the version found
    and the one to install."""
    import pytest
    transformers = pytest.importorskip("transformers")
    from autofit import torch_internals as ti
    from autofit.integrations import transformers_internals as hf
    trainer = _tiny_trainer(tmp_path)
    found = ti.version_tuple(transformers.__version__)
    lacking = {f for f in hf.FEATURES if hf.missing(f, trainer)}
    assert lacking == {f for f, since in hf.SINCE.items() if found < ti.version_tuple(since)}
    monkeypatch.setattr(hf, "_checked", set())
    monkeypatch.delattr(transformers.Trainer, "_get_collator_with_removed_columns")
    monkeypatch.delattr(trainer, "_train_batch_size")
    expected = ["trainer._train_batch_size", "Trainer._get_collator_with_removed_columns"]
    assert hf.missing(hf.TRAINER, trainer) == expected + [f"Trainer source.{n}" for n in ("_tr_loss",)
                                                          if hf.TRAINER in lacking]
    with pytest.raises(hf.MissingInternal, match=rf"autofit's {re.escape(hf.TRAINER)} needs transformers internals: "
                                                 rf"this transformers {re.escape(transformers.__version__)} lacks "
                                                 rf"trainer\._train_batch_size, Trainer\._get_collator_with_removed_"
                                                 rf"columns.* \(transformers >= 5\.3 has them\); install "
                                                 rf"transformers 5\.3 or newer"):
        hf.set_train_batch_size(trainer, 8)


def test_before_its_first_step_the_trainer_integration_refuses_a_transformers_without_its_names(tmp_path, monkeypatch):
    """What a transformers older than 5.3 meets (no `_tr_loss` in the Trainer's loop): fit_trainer
    refuses before anything runs, and the Trainer's arguments are as they were."""
    import pytest
    pytest.importorskip("transformers")
    from autofit.integrations import transformers as integration
    from autofit.integrations import transformers_internals as hf
    trainer = _tiny_trainer(tmp_path)
    monkeypatch.setattr(hf, "_checked", set())
    monkeypatch.setattr(hf, "_source", lambda obj: "")  # the loop sets none of the names read from it
    before = trainer.args.to_dict()
    with pytest.raises(hf.MissingInternal, match=r"lacks Trainer source\._total_loss_scalar, Trainer source\._tr_loss, "
                                                 r"Trainer source\._eval_dataloaders \(transformers >= 5\.3"):
        integration.fit_trainer(trainer, budget="1GiB")
    assert trainer.args.to_dict() == before


def test_every_accelerate_internal_autofit_uses_is_in_this_accelerate_and_a_missing_one_is_named(monkeypatch):
    import pytest
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from autofit.integrations import accelerate as adapter
    accelerator = Accelerator(cpu=True)
    try:
        assert adapter.private_missing(accelerator) == []
        adapter.forget_prepared(accelerator)
        assert (accelerator._models, accelerator._optimizers, accelerator._schedulers,
                accelerator._dataloaders) == ([], [], [], [])
        monkeypatch.delattr(AcceleratorState, "_reset_state")
        assert adapter.private_missing() == ["AcceleratorState._reset_state"]
        with pytest.raises(RuntimeError, match=r"uses AcceleratorState\._reset_state of accelerate 1\.16 for a new "
                                               r"Accelerator after the precision changes, and this accelerate "
                                               r"\S+ lacks it: install accelerate 1\.16"):
            adapter.reset_state()
    finally:
        monkeypatch.undo()
        from accelerate.state import GradientState
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_each_torch_feature_is_checked_when_first_used(monkeypatch):
    """The simulated GPU and the replay of a global batch refuse, at their first use, a torch that
    lacks one of their names (one more name asked for stands in for a torch without it)."""
    import pytest
    import torch
    from autofit import torch_internals as ti
    from autofit.engine.replay import StartState
    from autofit.gpu.simulate import SimulatedGPU
    monkeypatch.setattr(ti, "_checked", set())
    for feature in (ti.SIMULATED, ti.REPLAY):
        monkeypatch.setitem(ti.FEATURES, feature, ti.FEATURES[feature] + ("torch.Tensor._not_in_this_torch",))
    with pytest.raises(ti.MissingInternal, match=r"simulated GPU .* lacks torch\.Tensor\._not_in_this_torch"):
        SimulatedGPU("1GiB")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ti.MissingInternal, match=r"replaying a global batch .* lacks torch\.Tensor\._not_in_this_torch"):
        StartState(model, torch.optim.SGD(model.parameters(), lr=0.1), None)
