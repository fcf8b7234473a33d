import gc
import weakref

import pytest
import torch

from autofit.gpu.device import CpuDevice, SimulatedDevice
from autofit.gpu.oom import collect, is_oom, release, summarize
from autofit.gpu.simulate import simulate_gpu

# Written out here, not read from the module, so dropping one from OOM_MESSAGES fails a test.
@pytest.fixture(autouse=True)
def _quick_gc():
    """release() runs gc.collect(); with everything made before the test frozen it takes ms, not 0.2 s."""
    with simulate_gpu():  # the first backward under a dispatch mode imports sympy: before the freeze
        torch.ones(1, requires_grad=True).sum().backward()
    gc.freeze()
    yield
    gc.unfreeze()


KNOWN_MESSAGES = [
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 1.95 GiB total capacity)",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "HIP out of memory. Tried to allocate 2.00 GiB",
    "HIP error: hipErrorOutOfMemory",
    "XPU out of memory. Tried to allocate 1.00 GiB",
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)",
    "DefaultCPUAllocator: not enough memory: you tried to allocate 1099511627776 bytes.",
]


def raised(make):
    """The exception `make` raises, with its chain set up by a real raise."""
    try:
        make()
    except BaseException as e:  # noqa: BLE001
        return e
    raise AssertionError("nothing was raised")


def test_out_of_memory_error_is_oom():
    assert is_oom(torch.OutOfMemoryError("anything at all"))
    assert is_oom(torch.cuda.OutOfMemoryError("x"))


@pytest.mark.parametrize("message", KNOWN_MESSAGES)
def test_each_known_allocator_message_is_oom(message):
    assert is_oom(RuntimeError(message))
    assert is_oom(torch.AcceleratorError(message))  # what CUDA errors are raised as in torch >= 2.8


@pytest.mark.parametrize("message", KNOWN_MESSAGES)
def test_oom_is_found_through_cause_and_context(message):
    def from_():
        try:
            raise RuntimeError(message)
        except RuntimeError as e:
            raise ValueError("wrapped by a library") from e

    def during():
        try:
            raise RuntimeError(message)
        except RuntimeError:
            raise KeyError("while handling it")

    def deep():
        try:
            from_()
        except ValueError as e:
            raise TypeError("twice removed") from e

    def cause_only():
        raise ValueError("built from an error that was never raised here") from RuntimeError(message)

    for make in (from_, during, deep, cause_only):
        error = raised(make)
        assert not isinstance(error, torch.OutOfMemoryError)
        assert is_oom(error), make.__name__


@pytest.mark.parametrize("error", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("out of range"),
    RuntimeError(""),
    ValueError("bad value"),
    KeyError("input_ids"),
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    ValueError("CUDA out of memory"),              # only RuntimeErrors are read for allocator messages
    KeyError("CUBLAS_STATUS_ALLOC_FAILED"),
    KeyboardInterrupt(),
    None,
], ids=repr)
def test_other_errors_are_not_oom(error):
    assert is_oom(error) is False


def test_a_non_oom_chain_is_not_oom_and_cycles_end():
    error = raised(lambda: (_ for _ in ()).throw(ValueError("a")))
    error.__context__ = KeyError("b")
    assert not is_oom(error)
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert is_oom(a) is False


def test_a_real_simulated_oom_is_oom():
    with simulate_gpu(512):
        error = raised(lambda: torch.zeros(1000))
    assert type(error) is torch.OutOfMemoryError and is_oom(error)


def test_summarize_keeps_the_first_line():
    assert summarize(RuntimeError("CUDA out of memory. Tried 2 MiB\nmore\nlines")) == "CUDA out of memory. Tried 2 MiB"
    assert summarize(RuntimeError("  \n")) == "RuntimeError"
    assert summarize(torch.OutOfMemoryError("")) == "OutOfMemoryError"


class RecordingDevice(CpuDevice):
    def __init__(self):
        self.calls = []

    def empty_cache(self):
        self.calls.append("empty_cache")


def trained_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    return model


def test_release_drops_gradients_through_the_optimizer_and_empties_the_cache():
    model = trained_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    device = RecordingDevice()
    release(device, optimizer=optimizer)
    assert [p.grad for p in model.parameters()] == [None] * 4
    assert device.calls == ["empty_cache"]


def test_release_drops_gradients_of_the_model():
    model = trained_model()
    device = RecordingDevice()
    release(device, model=model)
    assert [p.grad for p in model.parameters()] == [None] * 4
    assert device.calls == ["empty_cache"]
    release(device)  # nothing to drop: still empties the cache
    assert device.calls == ["empty_cache", "empty_cache"]


def test_release_frees_tensors_pinned_by_reference_cycles():
    class Frame:  # a stand-in for a frame/traceback cycle that keeps activations alive
        pass

    torch.manual_seed(0)
    model = torch.nn.Linear(100, 10)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with simulate_gpu() as gpu:
            device = SimulatedDevice(gpu)
            device.place_model(model)
            model(torch.randn(2, 100)).sum().backward()
            node = Frame()
            node.self, node.activation = node, torch.zeros(1000)
            del node
            assert gpu.memory_allocated() == 4608 + 4608 + 4096  # params, grads, the pinned tensor
            release(device, model=model)
            assert gpu.memory_allocated() == 4608                # back to the parameters
    finally:
        if was_enabled:
            gc.enable()


def fail_backward_at(k, model, x, gpu):
    """Run a branching forward, then a backward whose k-th allocation fails; True if it failed."""
    lin, a, b = model
    try:
        h = torch.tanh(lin(x))
        loss = (torch.tanh(a(h)) * torch.tanh(b(h))).square().mean()
        gpu.fail_at(gpu.allocation_count + k)
        loss.backward()
    except torch.OutOfMemoryError:
        return True
    gpu.fail_at(None)
    return False


def test_release_after_an_oom_anywhere_in_backward_returns_to_the_baseline():
    # A branching graph: when backward fails, the other branch's nodes (and what they saved) are
    # still queued in the autograd engine; release() must make it let go (on torch 2.13 allocation
    # indices 7-10 and 15 leave 24 KiB / 512 bytes behind without the drain).
    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(3)])
    x = torch.randn(32, 64)
    with simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        baseline = gpu.memory_allocated()
        k = 0
        while fail_backward_at(k, model, x, gpu):
            release(device, model=model)
            assert gpu.memory_allocated() == baseline, f"allocation {k} of backward"
            k += 1
        assert k > 15                                   # every allocation of backward was tried


@pytest.mark.parametrize("message", KNOWN_MESSAGES)
def test_raise_from_none_inside_an_oom_handler_is_not_an_oom(message):
    """`raise X from None` replaces the OOM on purpose: X is a new error, as Python prints it."""
    def suppressed():
        try:
            raise RuntimeError(message)
        except RuntimeError:
            raise ValueError("a deliberate new error") from None

    def suppressed_then_wrapped():
        try:
            suppressed()
        except ValueError:
            raise KeyError("while handling it")

    def explicit_cause_wins():
        try:
            raise KeyError("unrelated")
        except KeyError:
            raise ValueError("built from the OOM") from RuntimeError(message)

    assert is_oom(raised(suppressed)) is False
    assert is_oom(raised(suppressed_then_wrapped)) is False
    assert is_oom(raised(explicit_cause_wins)) is True


def test_a_partial_update_is_never_an_oom():
    from autofit.engine.atomic import PartialUpdateError
    error = PartialUpdateError("the optimizer step ran out of memory part-way (CUDA out of memory. "
                               "Tried to allocate 2.00 MiB)")
    assert is_oom(error) is False
    wrapped = raised(lambda: (_ for _ in ()).throw(error))
    try:
        raise RuntimeError("a library wrapped it") from wrapped
    except RuntimeError as outer:
        assert is_oom(outer) is False


def test_a_buffer_the_model_registers_during_a_failed_attempt_belongs_to_the_model():
    """A model that makes a buffer on its first forward, then runs out of memory: the buffer is the
    model's (kept, not reported as memory the attempt failed to release)."""
    import autofit

    failed = []  # outside the model: a replay puts the model's own attributes back

    class LazyTable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, x):
            if not hasattr(self, "table"):
                self.register_buffer("table", torch.ones(4096))  # 16 KiB made on the device
            if not failed and torch.is_grad_enabled():  # training, not the reduction probe
                failed.append(True)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
            return self.fc(x) * self.table[:3]

    torch.manual_seed(0)
    model = LazyTable()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g))]
    result = autofit.run(model, data, loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                         budget="64MiB", cache=False, progress=False, capacity_check=False,
                         ladder=lambda p: p.replace(micro_batch_size=2, accumulation_steps=2)
                         if p.micro_batch_size > 2 else None)
    assert [(a.outcome, a.plan.micro_batch_size) for a in result.attempts] == [("oom", 4), ("ok", 2)]
    assert model.table.shape == (4096,)


# -- collecting no further than needed (gpu.oom.collect) ----------------------------------------

class Cycle:  # a stand-in for a frame/traceback cycle that keeps activations alive
    pass


class Collections:
    """The generations the garbage collector collected while open, in order."""

    def __enter__(self):
        self.generations = []
        gc.callbacks.append(self._seen)
        return self

    def _seen(self, phase, info):
        if phase == "start":
            self.generations.append(info["generation"])

    def __exit__(self, *exc):
        gc.callbacks.remove(self._seen)


@pytest.fixture
def no_automatic_gc():
    was_enabled = gc.isenabled()
    gc.disable()
    yield
    if was_enabled:
        gc.enable()


def _pinned(n):
    """A cycle holding an n-float tensor, unreachable once returned (its weak reference only)."""
    node = Cycle()
    node.self, node.activation = node, torch.zeros(n)
    return weakref.ref(node)


@pytest.mark.usefixtures("no_automatic_gc")
def test_collect_stops_at_the_young_generations_when_they_free_the_memory():
    with simulate_gpu() as gpu:
        base = gpu.memory_allocated()
        pinned = _pinned(1000)
        assert gpu.memory_allocated() == base + 4096 and pinned() is not None
        with Collections() as seen:
            assert collect(lambda: gpu.memory_allocated() <= base) == 1
        assert seen.generations == [1] and gpu.memory_allocated() == base
        with Collections() as seen:  # nothing above the baseline: nothing collected
            assert collect(lambda: gpu.memory_allocated() <= base) == -1
        assert seen.generations == []


@pytest.mark.usefixtures("no_automatic_gc")
def test_collect_goes_on_to_the_full_collection_for_an_old_cycle():
    with simulate_gpu() as gpu:
        base = gpu.memory_allocated()
        node = Cycle()
        node.self, node.activation = node, torch.zeros(1000)
        gc.collect()  # it survives (still referenced): now in the oldest generation
        del node      # unreachable, but only a full collection sees it
        with Collections() as seen:
            assert collect(lambda: gpu.memory_allocated() <= base) == 2
        assert seen.generations == [1, 2] and gpu.memory_allocated() == base
        with Collections() as seen:  # nothing to read: the full collection, as before
            assert collect() == 2
        assert seen.generations == [2]


@pytest.mark.usefixtures("no_automatic_gc")  # only autofit's own collections are seen
def test_an_attempt_freed_by_refcounts_and_young_cycles_costs_no_full_collection():
    # An attempt that fails in backward leaves its tensors to its frames (and a cycle through the
    # error, kept by the work): memory is back at the baseline, with no walk of the whole heap.
    from autofit.engine.attempt import Attempter
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    x = torch.randn(32, 64)
    with simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        baseline = gpu.memory_allocated()

        def work():
            kept = Cycle()
            kept.self, kept.out = kept, model(x)
            gpu.fail_at(gpu.allocation_count + 2)
            try:
                kept.out.square().mean().backward()
            except torch.OutOfMemoryError as error:
                kept.error = error  # error -> traceback -> this frame -> kept -> error
                raise
        with Collections() as seen:
            outcome = Attempter(device, lambda: (model, None))(work)
        assert not outcome.ok and gpu.memory_allocated() == baseline
        assert 2 not in seen.generations and seen.generations[-1:] == [1]


@pytest.mark.usefixtures("no_automatic_gc")
def test_a_run_ends_and_recovers_without_a_full_collection():
    import autofit
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                torch.nn.Linear(64, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g))]
    with Collections() as seen, simulate_gpu("64MiB") as gpu:
        gpu.fail_at(gpu.allocation_count + 3)
        result = autofit.run(model, data, loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), cache=False,
                             progress=False, capacity_check=False)
        assert gpu.memory_allocated() == 4096 + 512 + 1024 + 512  # the parameters: the run's own optimizer state went to the host
    assert [a.outcome for a in result.attempts] == ["oom", "ok"]
    assert 2 not in seen.generations
