"""The user's peak-memory readings survive a run: autofit resets the device's peak counters to
measure each attempt and optimizer step, and raises the allocated one back to the run's maximum
when it is done, so `max_memory_allocated()` after a run reads the run's true peak (or the user's
own earlier one, when that was higher); `RunResult.peak_allocated` reports it."""

import pytest
import torch

import autofit
from autofit.gpu.peaks import pieces
from autofit import torch_internals as ti
from models import bert_batch, tiny_bert


class Sampler(ti.TorchDispatchMode):
    """The simulated GPU's allocated bytes read after every op: the true peak, whatever resets."""

    def __init__(self, gpu):
        super().__init__()
        self.gpu, self.peak = gpu, gpu.memory_allocated()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.gpu.memory_allocated())
        return out


def test_after_a_run_the_users_peak_reading_is_the_runs_true_peak():
    data = [bert_batch(seed=i) for i in range(3)]
    with autofit.simulate_gpu() as gpu:
        gpu.reset_peak_memory_stats()
        with Sampler(gpu) as sampler:
            result = autofit.run(tiny_bert(), data, precision="fp32", progress=False, cache=False)
        read = gpu.max_memory_allocated()
    assert sampler.peak > gpu.memory_allocated()
    assert read == sampler.peak == result.peak_allocated
    assert result.peak_reserved >= result.peak_allocated


def test_a_higher_peak_the_user_reached_before_the_run_is_still_read_after_it():
    data = [bert_batch(seed=i) for i in range(2)]
    with autofit.simulate_gpu() as gpu:
        big = torch.empty(64 << 20, dtype=torch.uint8)
        before = gpu.max_memory_allocated()
        del big
        result = autofit.run(tiny_bert(), data, precision="fp32", progress=False, cache=False)
        assert result.peak_allocated < before
        assert gpu.max_memory_allocated() == before


def test_the_pieces_raising_a_cuda_peak_are_whole_segments_and_small_blocks():
    mib = 1 << 20
    assert pieces(5 * mib + 1536, cuda=True) == [4 * mib, mib, 1536]
    assert pieces(3 * mib, cuda=False) == [3 * mib]
    assert sum(pieces(7 * mib + 512, cuda=True)) == 7 * mib + 512


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_users_peak_reading_after_a_run_is_the_runs():
    model = tiny_bert().cuda()
    data = [bert_batch(seed=i) for i in range(3)]
    torch.cuda.reset_peak_memory_stats()
    result = autofit.run(model, data, precision="fp32", progress=False, cache=False)
    assert torch.cuda.max_memory_allocated() == result.peak_allocated > torch.cuda.memory_allocated()
