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
        "abandon", "atomic", "attempt_peak", "before_backward", "close", "device", "distributed", "grad_norm",
        "kept", "model", "not_applicable", "optimizer", "phase", "phase_steers_ladder", "run"]
    assert members(interfaces.Guide) == ["largest", "measured", "observe"]


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
