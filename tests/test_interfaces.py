"""Every implementation of an engine interface has every member its Protocol names."""

import ast
import inspect
import textwrap

import pytest
import torch

import autofit
from autofit.distributed.local import Local
from autofit.distributed.lockstep import Lockstep
from autofit.distributed.runner import DistributedStepRunner
from autofit.engine import interfaces
from autofit.engine.controller import Unguided
from autofit.engine.step import StepRunner
from autofit.estimator.guide import Guide
from autofit.gpu.device import CpuDevice, CudaDevice, SimulatedDevice


def members(protocol) -> list[str]:
    """The names a protocol asks for: its annotated attributes and its methods."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return sorted(names)


def missing(protocol, obj) -> list:
    return [name for name in members(protocol) if not hasattr(obj, name)]


def assigned(cls) -> set:
    """Attributes a class sets on self anywhere in its own methods (for one built only on ranks)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for t in (t.elts if isinstance(t, ast.Tuple) else [t])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_the_protocols_name_what_the_engine_reads():
    assert members(interfaces.Runner) == [
        "abandon", "atomic", "attempt_peak", "close", "device", "distributed", "grad_norm",
        "kept", "model", "not_applicable", "optimizer", "phase", "phase_steers_ladder", "run"]
    assert members(interfaces.Guide) == ["failed", "largest", "measured", "observe"]


def test_runners_devices_guides_and_locksteps_meet_their_protocols():
    model = torch.nn.Linear(2, 2)
    device = CpuDevice()
    runner = StepRunner(model, torch.optim.SGD(model.parameters(), lr=0.1), device)
    ranked = DistributedStepRunner(model, torch.optim.SGD(model.parameters(), lr=0.1), device, lockstep=Local(model))
    assert missing(interfaces.Runner, runner) == missing(interfaces.Runner, ranked) == []
    assert missing(interfaces.Atomic, runner.atomic) == []
    with autofit.simulate_gpu() as gpu:
        assert missing(interfaces.Device, SimulatedDevice(gpu)) == []
    assert missing(interfaces.Device, device) == missing(interfaces.Device, CudaDevice) == []
    assert missing(interfaces.Guide, Guide(device, "allocated", 1.0)) == missing(interfaces.Guide, Unguided()) == []
    assert missing(interfaces.Lockstep, Local(model)) == []
    lockstep_has = assigned(Lockstep) | set(dir(Lockstep))
    assert [n for n in members(interfaces.Lockstep) if n not in lockstep_has] == []


def test_the_check_finds_a_member_taken_away(monkeypatch):
    model = torch.nn.Linear(2, 2)
    runner = StepRunner(model, torch.optim.SGD(model.parameters(), lr=0.1), CpuDevice())
    monkeypatch.delattr(StepRunner, "not_applicable")
    assert missing(interfaces.Runner, runner) == ["not_applicable"]


def public_callables():
    """(name, function) for every function autofit exports and every public method of its classes
    (errors aside: they are exceptions, built with a message)."""
    out = []
    for name in autofit.__all__:
        obj = getattr(autofit, name)
        if inspect.isclass(obj):
            if issubclass(obj, BaseException):
                continue
            for member, value in vars(obj).items():
                if member != "__init__" and member.startswith("_"):
                    continue
                function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                if inspect.isfunction(function):
                    out.append((f"{name}.{member}", function))
        elif callable(obj):
            out.append((name, obj))
    return out


def unannotated(name, function) -> list[str]:
    signature = inspect.signature(function)
    missing = [f"{name}({p})" for p in signature.parameters if p not in ("self", "cls")
               and signature.parameters[p].annotation is inspect.Parameter.empty]
    if signature.return_annotation is inspect.Signature.empty and not name.endswith("__init__"):
        missing.append(f"{name} -> ?")
    return missing


def test_every_public_callable_of_autofit_is_fully_annotated():
    found = public_callables()
    assert {"run", "stepper", "evaluate", "estimate", "tune", "explain", "parse_size", "simulate_gpu",
            "Plan.replace", "EvalSizer.__init__"} <= {name for name, _ in found}
    assert [m for name, function in found for m in unannotated(name, function)] == []
    import typing
    for name, function in found:  # each annotation names something real
        typing.get_type_hints(function)
    hints = typing.get_type_hints(autofit.evaluate)
    assert (hints["device"], hints["pace"]) == (interfaces.Device | None, interfaces.Pace | None)
    assert inspect.signature(autofit.run).parameters["optimizer"].annotation == interfaces.OptimizerArg


def test_the_annotation_check_finds_a_parameter_left_bare():
    def step(batch, plan: int) -> None: ...
    assert unannotated("step", step) == ["step(batch)"]
    assert unannotated("bare", lambda x: x) == ["bare(x)", "bare -> ?"]


def test_evaluation_paces_meet_their_protocol():
    from autofit.distributed.eval_lockstep import ShardedEvaluation
    from autofit.recipes.eval_pace import Alone
    assert missing(interfaces.Pace, Alone()) == []
    assert [n for n in members(interfaces.Pace) if not hasattr(ShardedEvaluation, n)] == []
