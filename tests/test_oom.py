import gc

import pytest
import torch

from autofit.gpu.device import CpuDevice, SimulatedDevice
from autofit.gpu.oom import is_oom, release, summarize
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

    class LazyTable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 3)
            self.failed = False

        def forward(self, x):
            if not hasattr(self, "table"):
                self.register_buffer("table", torch.ones(4096))  # 16 KiB made on the device
            if not self.failed:
                self.failed = True
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
