"""Every exception class autofit raises on purpose is defined in autofit.errors and exported."""

import importlib
import inspect
import pkgutil

import autofit
import autofit.errors


def _exception_classes_by_module():
    found = {}
    for info in pkgutil.walk_packages(autofit.__path__, "autofit."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_public_exception_class_lives_in_errors():
    # Private ones (a leading underscore) are control flow caught inside their own module.
    # Two are the estimator's own control flow, raised and caught inside autofit.estimator (never
    # seen by a user): a model to measure on real rows, a cut walk that does not stand for the model.
    internal = {"autofit.estimator.eager_only.EagerOnly", "autofit.estimator.traced.Untileable"}
    outside = sorted(path for path, cls in _exception_classes_by_module().items()
                     if cls.__module__ != "autofit.errors" and not cls.__name__.startswith("_")
                     and path not in internal)
    assert outside == []


def test_every_exception_class_of_errors_is_exported():
    defined = sorted(name for name, value in vars(autofit.errors).items()
                     if inspect.isclass(value) and issubclass(value, BaseException)
                     and value.__module__ == "autofit.errors")
    assert defined == ["AllocationFailed", "DoesNotFit", "LockstepError", "MemoryNotReleased", "MetricError",
                       "MissingInternal", "ModelSpecError", "NoLossError", "PartialUpdateError", "PeerOutOfMemory", "RankFailed",
                       "UsageError"]
    assert [name for name in defined if name not in autofit.__all__] == []
    assert all(getattr(autofit, name) is getattr(autofit.errors, name) for name in defined)


def test_old_import_paths_still_work():
    from autofit.gpu.allocator import AllocationFailed
    from autofit.commands import UsageError
    from autofit.errors import LockstepError, PeerOutOfMemory, RankFailed
    from autofit.recipes.evaluate import MetricError
    from autofit.commands.models import ModelSpecError
    from autofit.engine.step import NoLossError

    assert (AllocationFailed, UsageError, LockstepError, PeerOutOfMemory, RankFailed, MetricError,
            ModelSpecError, NoLossError) == (
        autofit.AllocationFailed, autofit.UsageError, autofit.LockstepError, autofit.PeerOutOfMemory,
        autofit.RankFailed, autofit.MetricError, autofit.ModelSpecError, autofit.NoLossError)
