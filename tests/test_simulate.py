import gc
import re

import pytest
import torch

from autofit.gpu.oom import is_oom
from autofit.gpu.simulate import ROUNDING, SimulatedGPU, active_gpu, round_bytes, simulate_gpu


@pytest.mark.parametrize("nbytes, rounded", [(0, 0), (1, 512), (511, 512), (512, 512), (513, 1024),
                                             (4000, 4096), (4096, 4096), (4100, 4608)])
def test_round_bytes(nbytes, rounded):
    assert ROUNDING == 512
    assert round_bytes(nbytes) == rounded


@pytest.mark.parametrize("make, counted", [
    (lambda: torch.zeros(1000), 4096),                       # 4000 bytes
    (lambda: torch.zeros(1024), 4096),
    (lambda: torch.zeros(1025), 4608),                       # 4100 bytes
    (lambda: torch.zeros(1, dtype=torch.int8), 512),
    (lambda: torch.zeros(3, 5, dtype=torch.float64), 512),   # 120 bytes
    (lambda: torch.ones(256, 256, dtype=torch.bfloat16), 131072),
    (lambda: torch.empty(0), 0),
])
def test_new_storages_are_counted_rounded_to_512_bytes(make, counted):
    with simulate_gpu() as gpu:
        t = make()
        assert gpu.memory_allocated() == counted
        assert gpu.max_memory_allocated() == counted
        assert gpu.holds(t) or not counted
        del t
        assert gpu.memory_allocated() == 0
        assert gpu.max_memory_allocated() == counted


def test_views_share_the_count_of_their_storage():
    with simulate_gpu() as gpu:
        x = torch.zeros(1000)
        views = [x.view(10, 100), x[10:20], x.view(10, 100).t(), *x.chunk(4), *x.view(10, 100).unbind(0),
                 x.unsqueeze(0), x.as_strided((5,), (2,))]
        x.add_(1)
        x.mul_(2)
        torch.add(x, 1, out=x)
        assert gpu.memory_allocated() == 4096
        assert all(gpu.holds(v) for v in views)
        del x
        assert gpu.memory_allocated() == 4096  # the views keep the storage alive
        copy = views[2].contiguous()            # a transposed view made contiguous is a new storage
        assert gpu.memory_allocated() == 8192
        del views
        assert gpu.memory_allocated() == 4096
        del copy
        assert gpu.memory_allocated() == 0
        assert gpu.max_memory_allocated() == 8192


def test_views_and_in_place_ops_on_tensors_made_outside_are_not_counted():
    outside = torch.zeros(1000)
    with simulate_gpu() as gpu:
        views = [outside.view(10, 100), outside[0:5], outside.unsqueeze(0), *outside.chunk(2)]
        outside.add_(1)
        outside.zero_()
        outside[3] = 7.0
        assert gpu.memory_allocated() == 0
        assert gpu.allocation_count == 0
        assert not gpu.holds(outside) and not any(gpu.holds(v) for v in views)
        result = outside + 1      # a new tensor computed from it is device memory
        assert gpu.memory_allocated() == 4096
        assert gpu.holds(result)
        assert gpu.allocation_count == 1
        # ops whose schema does not say they alias (the `unsafe` ones) are still seen to
        unsafe = [torch.ops.aten._unsafe_view(outside, [10, 100]), *torch.ops.aten.unsafe_split(outside, 500)]
        assert gpu.memory_allocated() == 4096 and gpu.allocation_count == 1
        assert not any(gpu.holds(v) for v in unsafe)


def test_freeing_peak_and_reset_peak():
    with simulate_gpu() as gpu:
        a = torch.zeros(1024)
        b = torch.zeros(2048)
        assert (gpu.memory_allocated(), gpu.max_memory_allocated()) == (12288, 12288)
        del b
        assert (gpu.memory_allocated(), gpu.max_memory_allocated()) == (4096, 12288)
        gpu.reset_peak_memory_stats()
        assert gpu.max_memory_allocated() == 4096
        c = torch.zeros(512)
        del c
        assert (gpu.memory_allocated(), gpu.max_memory_allocated()) == (4096, 6144)
        del a
        assert (gpu.memory_allocated(), gpu.max_memory_allocated()) == (0, 6144)


def test_in_place_growth_of_a_counted_tensor_is_counted():
    with simulate_gpu() as gpu:
        x = torch.empty(10)                 # 40 bytes -> 512
        assert gpu.memory_allocated() == 512
        x.resize_(1000)                     # 4000 bytes -> 4096
        assert gpu.memory_allocated() == 4096
        assert gpu.allocation_count == 2    # the growth is an allocation too
        del x
        assert gpu.memory_allocated() == 0


def test_empty_tensors_made_inside_and_grown_later_are_counted():
    # BUG (autofit/gpu/simulate.py:123-128): a 0-byte storage is never entered in `_live` (`if nbytes`),
    # so when it grows in place (resize_, or any `out=` op, which resizes an empty out tensor) its
    # storage is an input of the op, and `key in given` takes it for memory made outside the
    # simulation: the 4096 bytes below are never counted and never checked against the budget.
    with simulate_gpu() as gpu:
        out = torch.empty(0)
        a = torch.ones(1000)
        torch.add(a, a, out=out)
        assert gpu.memory_allocated() == 8192
        grown = torch.empty(0)
        grown.resize_(1000)
        assert gpu.memory_allocated() == 12288


def test_a_training_step_is_counted_exactly():
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 10)       # weight 4000 -> 4096, bias 40 -> 512
    x = torch.randn(4, 100)
    with simulate_gpu() as gpu:
        gpu.track(model.parameters())
        assert gpu.memory_allocated() == 4608
        loss = model(x).square().mean()
        loss.backward()
        del loss
        assert gpu.memory_allocated() == 4608 * 2   # parameters and their gradients
        for p in model.parameters():
            p.grad = None
        assert gpu.memory_allocated() == 4608


# -- budget ------------------------------------------------------------------------------------

def test_budget_raises_the_real_out_of_memory_error():
    with simulate_gpu("8KiB") as gpu:
        assert gpu.budget == 8192 and gpu.free_bytes() == 8192
        a = torch.zeros(1024)
        b = torch.zeros(1024)               # exactly the budget: fits
        assert gpu.memory_allocated() == 8192 and gpu.free_bytes() == 0
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.zeros(1)
        assert type(info.value) is torch.OutOfMemoryError
        assert str(info.value) == (
            "CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has a total capacity of 8.00 KiB of which "
            "0 bytes is free. Of the allocated memory 8.00 KiB is allocated by PyTorch (simulated GPU), and "
            "1.99 MiB is reserved by PyTorch but unallocated.")  # 2 MiB small segment less 8 KiB
        assert is_oom(info.value)
        assert gpu.memory_allocated() == 8192 and gpu.max_memory_allocated() == 8192
        del info, b
        c = torch.zeros(1024)               # freed memory can be used again
        assert gpu.memory_allocated() == 8192
        del a, c


def test_out_of_memory_message_says_what_was_asked_and_what_is_free():
    with simulate_gpu(10_000) as gpu:
        a = torch.zeros(1000)
        with pytest.raises(torch.OutOfMemoryError, match=re.escape(
                "CUDA out of memory. Tried to allocate 8.00 KiB. GPU 0 has a total capacity of 9.77 KiB of which "
                "5.77 KiB is free. Of the allocated memory 4.00 KiB is allocated by PyTorch (simulated GPU), and "
                "2.00 MiB is reserved by PyTorch but unallocated.")):
            torch.zeros(2000)               # 8000 bytes, rounded to 8192: the rounded size is asked
        del a
    assert gpu.memory_allocated() == 0


def test_no_budget_never_fails_and_reports_no_free_bytes():
    with simulate_gpu() as gpu:
        assert gpu.budget is None and gpu.free_bytes() is None
        big = torch.zeros(4, 2**20)
        assert gpu.memory_allocated() == 16 * 2**20
        del big


@pytest.mark.parametrize("budget", ["banana", 0, "-1GiB"])
def test_a_bad_budget_is_refused_and_leaves_no_simulation_behind(budget):
    with pytest.raises(ValueError, match=re.escape(repr(budget))):
        with simulate_gpu(budget):
            pass
    assert active_gpu() is None


# -- fault injection ---------------------------------------------------------------------------

def test_fail_at_fails_exactly_that_allocation_once():
    with simulate_gpu() as gpu:
        assert not gpu.fault_armed
        gpu.fail_at(2)
        assert gpu.fault_armed
        kept = [torch.zeros(1), torch.zeros(1)]       # allocations 0 and 1
        kept.append(kept[0].view(1, 1))               # a view is no allocation
        assert gpu.allocation_count == 2
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.zeros(1000)                         # allocation 2
        assert str(info.value) == (
            "CUDA out of memory. Tried to allocate 4.00 KiB. GPU 0 has a total capacity of unlimited of which "
            "unlimited is free. Of the allocated memory 1.00 KiB is allocated by PyTorch (simulated GPU) "
            "(injected fault), and 2.00 MiB is reserved by PyTorch but unallocated.")
        assert not gpu.fault_armed and gpu.allocation_count == 3
        assert gpu.memory_allocated() == 1024         # the failed allocation is not counted
        kept.append(torch.zeros(1000))                # allocation 3: the fault fired once only
        assert gpu.allocation_count == 4 and gpu.memory_allocated() == 5120


def test_fail_at_zero_and_disarming():
    with simulate_gpu() as gpu:
        gpu.fail_at(0)
        with pytest.raises(torch.OutOfMemoryError, match=r"\(injected fault\)"):
            torch.ones(3)
        gpu.fail_at(1)
        gpu.fail_at(None)
        assert not gpu.fault_armed
        a, b = torch.ones(3), torch.ones(3)
        assert gpu.allocation_count == 3 and gpu.memory_allocated() == 1024
        gpu.fail_at(0)                                # an index already passed never fires
        c = torch.ones(3)
        assert gpu.fault_armed and gpu.memory_allocated() == 1536
        with pytest.raises(ValueError, match=re.escape("fail_at index must be >= 0 but got -1.")):
            gpu.fail_at(-1)
        del a, b, c


def test_fault_injection_during_backward():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with simulate_gpu() as gpu:
        gpu.track(model.parameters())
        loss = model(x).sum()
        gpu.fail_at(gpu.allocation_count)
        with pytest.raises(torch.OutOfMemoryError):
            loss.backward()
        del loss
        assert all(p.grad is None for p in model.parameters())


# -- track and untracked -----------------------------------------------------------------------

def test_track_counts_tensors_made_before_once_and_never_fails():
    w = torch.zeros(1000)
    b = torch.zeros(10)
    with simulate_gpu(1024) as gpu:
        gpu.track([w, w.view(10, 100), b, "not a tensor", None])
        assert gpu.memory_allocated() == 4608         # over the budget: tracking never raises
        assert gpu.allocation_count == 0              # and is no allocation for fault injection
        gpu.track([w, b])
        assert gpu.memory_allocated() == 4608
        assert gpu.holds(w) and gpu.holds(b)
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(1)                            # but the budget is spent
        w.add_(1)                                     # in place on a tracked tensor: no change
        assert gpu.memory_allocated() == 4608
        del w
        assert gpu.memory_allocated() == 512          # freed when its last reference goes
        del b
        assert gpu.memory_allocated() == 0


def test_untracked_allocations_are_host_memory():
    with simulate_gpu(1024) as gpu:
        gpu.fail_at(0)
        with gpu.untracked():
            host = torch.zeros(10_000)                # over the budget and the armed fault: nothing
            with gpu.untracked():
                more = host + 1
            again = host * 2
        assert gpu.memory_allocated() == 0 and gpu.allocation_count == 0 and gpu.fault_armed
        assert not gpu.holds(host)
        view = host.view(100, 100)                    # a view of host memory is no allocation
        assert gpu.memory_allocated() == 0
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            torch.zeros(1)                            # counting resumes after the block
        del more, again, view


def test_untracked_resumes_counting_after_an_error():
    with simulate_gpu() as gpu:
        with pytest.raises(KeyError):
            with gpu.untracked():
                raise KeyError("x")
        t = torch.zeros(1)
        assert gpu.memory_allocated() == 512
        del t


# -- the context -------------------------------------------------------------------------------

def test_context_sets_and_clears_the_active_gpu():
    assert active_gpu() is None
    with simulate_gpu("1GiB") as gpu:
        assert isinstance(gpu, SimulatedGPU) and gpu.name == "simulated"
        assert active_gpu() is gpu and gpu.budget == 2**30
    assert active_gpu() is None
    after = torch.zeros(1000)                         # nothing is counted outside
    assert gpu.memory_allocated() == 0
    del after


def test_context_is_cleared_after_an_error_inside():
    with pytest.raises(torch.OutOfMemoryError):
        with simulate_gpu(512):
            torch.zeros(1000)
    assert active_gpu() is None


def test_nesting_is_refused_and_the_outer_simulation_goes_on():
    with simulate_gpu() as outer:
        with pytest.raises(RuntimeError, match=re.escape(
                "simulate_gpu contexts cannot be nested; use the GPU you already have.")):
            with simulate_gpu("1GiB"):
                pass
        assert active_gpu() is outer
        t = torch.zeros(1000)
        assert outer.memory_allocated() == 4096
        del t
    assert active_gpu() is None


def test_live_storages_lists_what_is_held():
    with simulate_gpu() as gpu:
        a = torch.zeros(1000)
        b = torch.zeros(10)
        c = torch.zeros(1)
        del c
        gc.collect()
        held = sorted(n for _, n in gpu.live_storages())
        assert held == [512, 4096]
        assert {s.data_ptr() for s, _ in gpu.live_storages()} == {a.untyped_storage().data_ptr(),
                                                                 b.untyped_storage().data_ptr()}


def test_inner_tensors_reads_a_generator_once_and_keeps_every_tensor():
    from autofit.gpu.simulate import inner_tensors
    a, b = torch.zeros(3), torch.ones(2)
    assert [t is x for t, x in zip(inner_tensors(t for t in (a, b)), (a, b))] == [True, True]
    assert len(inner_tensors(iter([a, b]))) == 2


def test_a_sparse_gradient_is_counted_by_its_indices_and_values():
    with simulate_gpu() as gpu:
        emb = torch.nn.Embedding(12, 3, sparse=True)
        emb(torch.tensor([[1, 2, 3]])).sum().backward()
        grad = emb.weight.grad
        assert grad.is_sparse and gpu.holds(grad)
        held = gpu.memory_allocated()
        emb.weight.grad = None
        del grad
        assert held - gpu.memory_allocated() == 2 * 512  # int64 [1, 3] indices, float32 [3, 3] values
