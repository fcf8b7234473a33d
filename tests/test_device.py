import collections
import contextlib
import re

import pytest
import torch
from transformers import BatchEncoding

from autofit.gpu.device import CpuDevice, Device, SimulatedDevice, describe_tensors, open_device
from autofit.gpu.simulate import active_gpu, simulate_gpu

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="open_device picks the CUDA card here")

Pair = collections.namedtuple("Pair", ["inputs", "targets"])


@no_cuda
def test_without_budget_or_simulation_the_plain_cpu():
    with open_device() as device:
        assert type(device) is CpuDevice
        assert active_gpu() is None
        assert (device.name, device.type, device.budget, device.counts) == ("cpu", "cpu", None, False)
        assert device.torch_device == torch.device("cpu")
        t = torch.zeros(1000)
        assert device.memory_allocated() == 0 and device.max_memory_allocated() == 0
        assert device.free_bytes() is None and device.fault_armed is False and device.supports_bf16()
        batch = {"x": t}
        assert device.to_device(batch) is batch
        assert isinstance(device.host(), contextlib.nullcontext)
        assert device.live_tensors() == [] and device.describe() == "cpu"
        device.reset_peak_memory_stats()
        device.empty_cache()


@no_cuda
def test_a_budget_without_cuda_opens_a_new_simulated_gpu():
    with open_device("1MiB") as device:
        assert type(device) is SimulatedDevice
        assert active_gpu() is device.gpu
        assert (device.budget, device.gpu.budget, device.counts, device.name) == (2**20, 2**20, True, "simulated")
        assert device.describe() == "simulated GPU (1.00 MiB)"
        t = torch.zeros(1000)
        assert device.memory_allocated() == 4096 and device.free_bytes() == 2**20 - 4096
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(2**20)
        del t
    assert active_gpu() is None


@no_cuda
def test_a_bad_budget_is_refused():
    with pytest.raises(ValueError, match=re.escape("'lots'")):
        with open_device("lots"):
            pass
    assert active_gpu() is None


def test_inside_simulate_gpu_the_enclosing_gpu_is_used():
    with simulate_gpu("2GiB") as gpu:
        with open_device() as device:
            assert type(device) is SimulatedDevice and device.gpu is gpu
            assert device.budget == 2**31 and device.describe() == "simulated GPU (2.00 GiB)"
        with open_device(2**31) as device:                  # the same budget, said another way
            assert device.gpu is gpu
        with open_device("2GiB") as device:
            assert device.gpu is gpu
        assert active_gpu() is gpu                           # leaving open_device does not end it
    with simulate_gpu() as gpu:
        with open_device() as device:
            assert device.gpu is gpu and device.budget is None
            assert device.describe() == "simulated GPU (no limit)"


@pytest.mark.parametrize("outer, inner, shown", [
    ("2GiB", "2GB", "budget='2GB' was given inside simulate_gpu(2147483648); pass one or the other."),
    ("2GiB", 1024, "budget=1024 was given inside simulate_gpu(2147483648); pass one or the other."),
    (None, "1GiB", "budget='1GiB' was given inside simulate_gpu(None); pass one or the other."),
])
def test_a_budget_conflicting_with_simulate_gpu_is_refused(outer, inner, shown):
    with simulate_gpu(outer) as gpu:
        with pytest.raises(ValueError, match=re.escape(shown)):
            with open_device(inner):
                pass
        assert active_gpu() is gpu


def test_to_device_copies_are_counted_and_freed():
    batch = {"x": torch.arange(1000, dtype=torch.float32), "ids": torch.zeros(2, 3, dtype=torch.long), "name": "b"}
    with simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        moved = device.to_device(batch)
        assert gpu.memory_allocated() == 4096 + 512
        assert moved["x"] is not batch["x"] and torch.equal(moved["x"], batch["x"])
        assert moved["x"].data_ptr() != batch["x"].data_ptr()
        assert moved["name"] == "b" and list(moved) == ["x", "ids", "name"]
        assert gpu.holds(moved["x"]) and not gpu.holds(batch["x"])
        again = device.to_device(moved)                      # already on the device: not copied
        assert again["x"] is moved["x"] and gpu.memory_allocated() == 4608
        del moved, again
        assert gpu.memory_allocated() == 0


def test_to_device_copies_only_what_a_view_shows():
    big = torch.zeros(10_000)
    with simulate_gpu() as gpu:
        moved = SimulatedDevice(gpu).to_device(big[:1000])
        assert gpu.memory_allocated() == 4096
        del moved


def test_to_device_keeps_container_types():
    with simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        enc = device.to_device(BatchEncoding({"input_ids": torch.zeros(2, 4, dtype=torch.long)}))
        assert type(enc) is BatchEncoding and gpu.holds(enc.input_ids)
        pair = device.to_device(Pair(torch.zeros(2), torch.ones(2)))
        assert type(pair) is Pair and gpu.holds(pair.targets)
        seq = device.to_device([torch.zeros(2), (torch.zeros(2), 3)])
        assert type(seq) is list and type(seq[1]) is tuple and seq[1][1] == 3 and gpu.holds(seq[1][0])
        single = device.to_device(torch.zeros(2))
        assert gpu.holds(single)
        assert gpu.memory_allocated() == 6 * 512


def test_to_device_over_budget_raises_out_of_memory():
    batch = [torch.zeros(1024), torch.zeros(1024)]
    with simulate_gpu(4096) as gpu:
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 4.00 KiB"):
            SimulatedDevice(gpu).to_device(batch)
        assert gpu.memory_allocated() == 0


def test_place_model_and_host_memory():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 10), torch.nn.BatchNorm1d(10))
    with simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        device.place_model(model)
        # weight 4096, bias 512; BatchNorm weight/bias/running_mean/running_var/num_batches_tracked 512 each
        assert gpu.memory_allocated() == 4096 + 512 + 5 * 512
        with device.host():
            kept_on_host = torch.zeros(10_000)
        assert gpu.memory_allocated() == 7168 and not gpu.holds(kept_on_host)


def test_simulated_device_mirrors_its_gpu():
    with simulate_gpu("1MiB") as gpu:
        device = SimulatedDevice(gpu)
        t = torch.zeros(1000)
        assert (device.memory_allocated(), device.max_memory_allocated()) == (4096, 4096)
        del t
        device.reset_peak_memory_stats()
        assert device.max_memory_allocated() == 0
        assert device.free_bytes() == 2**20
        assert device.fault_armed is False
        gpu.fail_at(5)
        assert device.fault_armed is True
        device.empty_cache()


def test_simulated_device_reports_reserved_memory_and_empties_the_cache():
    mib = 2**20
    with simulate_gpu("64MiB", caps="reserved") as gpu:
        device = SimulatedDevice(gpu)
        kept, dropped = torch.zeros(1000), torch.zeros(3 * mib // 4)   # 2 MiB + 20 MiB segments
        assert (device.memory_reserved(), device.max_memory_reserved()) == (22 * mib, 22 * mib)
        del dropped
        assert device.memory_reserved() == 22 * mib                     # cached by the allocator
        device.empty_cache()
        assert (device.memory_reserved(), device.max_memory_reserved()) == (2 * mib, 22 * mib)
        device.reset_peak_memory_stats()
        assert device.max_memory_reserved() == 2 * mib
        del kept


def test_live_tensors_largest_first_one_per_storage():
    outside = torch.zeros(100_000)
    with simulate_gpu() as gpu:
        device = SimulatedDevice(gpu)
        small = torch.zeros(100)
        big = torch.zeros(5000)
        view = big.view(50, 100)
        live = device.live_tensors()
        assert len(live) == 2
        assert live[0].untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
        assert live[1] is small
        del view, outside


def test_describe_tensors():
    tensors = [torch.zeros(1000), torch.zeros(2, 3, dtype=torch.long)]
    assert describe_tensors(tensors) == "2 tensor(s), 4.50 KiB: float32[1000], int64[2, 3]"
    seven = [torch.zeros(i + 1, dtype=torch.bfloat16) for i in range(7)]
    assert describe_tensors(seven) == (
        "7 tensor(s), 3.50 KiB: bfloat16[1], bfloat16[2], bfloat16[3], bfloat16[4], bfloat16[5] and 2 more")
    assert describe_tensors(seven, limit=1) == "7 tensor(s), 3.50 KiB: bfloat16[1] and 6 more"
    assert describe_tensors(iter([torch.zeros(1, 2)])) == "1 tensor(s), 512 bytes: float32[1, 2]"
    assert describe_tensors([]) == "0 tensor(s), 0 bytes: "


def test_base_device_defaults():
    device = Device()
    assert (device.memory_allocated(), device.max_memory_allocated(), device.free_bytes()) == (0, 0, None)
    assert (device.memory_reserved(), device.max_memory_reserved()) == (0, 0)
    model = torch.nn.Linear(2, 2)
    device.place_model(model)
    assert model.weight.device.type == "cpu"
