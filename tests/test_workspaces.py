"""CUDA's own bytes: the cuBLAS/cuBLASLt workspaces a card's allocator holds from each kernel
thread's first matrix product on, blocks handed out whole counted whole, and the estimate, the
simulated GPU and the calibration agreeing about them (autofit.gpu.workspaces)."""

from __future__ import annotations

import pytest
import torch

import autofit
from autofit.engine.step import StepRunner
from autofit.estimator.guide import Guide
from autofit.estimator.estimate import MemoryEstimate
from autofit.gpu.device import SimulatedDevice, open_device
from autofit.gpu.simulate import SimulatedGPU
from autofit.gpu.workspaces import Workspaces, cublas_workspace, lt_workspace
from autofit.plans.plan import Plan

MiB, KiB = 2**20, 2**10
HOPPER = Workspaces(cublas=32 * MiB, cublaslt=MiB, cudnn=32 * MiB)
AMPERE = Workspaces(cublas=8 * MiB + 128 * KiB, cublaslt=MiB, cudnn=8 * MiB + 128 * KiB)


@pytest.mark.parametrize("config, major, expected", [
    (None, 9, 32 * MiB), (None, 10, 32 * MiB), (None, 12, 32 * MiB),
    (None, 8, 8 * MiB + 128 * KiB), (None, 7, 8 * MiB + 128 * KiB),
    (":4096:8", 8, 32 * MiB), (":16:8", 9, 128 * KiB), (":4096:2:16:8", 9, 8 * MiB + 128 * KiB),
    ("garbage", 9, 32 * MiB),  # unreadable: PyTorch warns and keeps its default
])
def test_the_cublas_workspace_follows_the_capability_and_the_environment(config, major, expected):
    assert cublas_workspace(config, major) == expected


def test_a_card_of_a_capability_holds_its_workspaces():
    assert Workspaces.of_capability((9, 0), environ={}) == HOPPER
    assert Workspaces.of_capability((8, 6), environ={}) == AMPERE
    assert Workspaces.of_capability((9, 0), environ={"CUBLAS_WORKSPACE_CONFIG": ":4096:2",
                                                     "CUBLASLT_WORKSPACE_SIZE": "2048"}) == \
        Workspaces(cublas=8 * MiB, cublaslt=2 * MiB, cudnn=8 * MiB)
    assert lt_workspace("x") == MiB
    assert HOPPER.resident == 65 * MiB and AMPERE.resident == 2 * (8 * MiB + 128 * KiB) + MiB
    assert HOPPER.reserve(torch.nn.Linear(2, 2)) == 0
    assert HOPPER.reserve(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3))) == 32 * MiB


def test_each_kernel_thread_takes_its_workspace_at_its_first_matrix_product(monkeypatch):
    """As the H200 measured: 33 MiB after a forward (the forward thread's cuBLAS workspace and
    cuBLASLt's), 65 MiB from the first backward on (autograd's device thread's too), for good."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    with autofit.simulate_gpu(caps="reserved", capability=(9, 0)) as gpu:
        x = torch.ones(4, 64, requires_grad=True)
        w = torch.ones(64, 64, requires_grad=True)
        tensors = gpu.memory_allocated()
        assert tensors == 2 * 512 + 64 * 64 * 4  # no kernel yet: no workspace
        y = (x * 2).sum()
        assert gpu.memory_allocated() - tensors == 512  # y alone: no matrix product, no workspace
        del y
        y = x @ w
        assert gpu.memory_allocated() - tensors == 512 * 2 + 33 * MiB  # y (1 KiB) and the forward's
        y.sum().backward()
        del y
        grads = 2 * 512 + 64 * 64 * 4
        assert gpu.memory_allocated() - tensors - grads == 65 * MiB
        (x @ w).sum().backward()  # later kernels take nothing more
        assert gpu.memory_allocated() - tensors - grads == 65 * MiB
    with autofit.simulate_gpu(caps="reserved") as plain:  # a budget, not a card: tensors only
        x = torch.ones(4, 64, requires_grad=True)
        (x @ torch.ones(64, 64)).sum().backward()
        assert plain.memory_allocated() == 2 * 512 + 2 * 512


def test_a_block_handed_out_whole_counts_whole_on_a_card():
    """A large-pool request whose remainder would be at most 1 MiB gets the whole block, which c10
    counts as allocated: 19.5 MiB takes a 20 MiB segment whole."""
    nbytes = 19 * MiB + MiB // 2
    with autofit.simulate_gpu(caps="reserved", capability=(9, 0)) as card:
        t = torch.empty(nbytes, dtype=torch.uint8)
        assert card.memory_allocated() == 20 * MiB and card.memory_reserved() == 20 * MiB
        del t
        assert card.memory_allocated() == 0
        t = torch.empty(17 * MiB, dtype=torch.uint8)  # 3 MiB left over: split, the request counts
        assert card.memory_allocated() == 17 * MiB
    with autofit.simulate_gpu(caps="reserved") as plain:
        t = torch.empty(nbytes, dtype=torch.uint8)
        assert plain.memory_allocated() == nbytes


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 4))


def loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


BATCH = (torch.randn(64, 256), torch.randint(0, 4, (64,)))


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_the_estimate_holds_what_the_card_holds_on_a_steady_step(capability, monkeypatch):
    """The second step of a plan on a simulated card and the estimate with that card's workspaces:
    the same allocated peak, to the byte; the reserved peak the same, or above by no more than the
    segments the card shares between a workspace and tensors (the estimate's upper bound)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    workspaces = Workspaces.of_capability(capability)
    for micro in (64, 16):
        plan = Plan.for_batch(64, micro)
        est = autofit.estimate(net(), BATCH, plan, loss_fn=loss, device_type="cpu", workspaces=workspaces)
        bare = autofit.estimate(net(), BATCH, plan, loss_fn=loss, device_type="cpu")
        with autofit.simulate_gpu(caps="reserved", capability=capability) as gpu, open_device() as device:
            model = net()
            device.place_model(model)
            runner = StepRunner(model, torch.optim.AdamW(model.parameters()), device, loss_fn=loss)
            runner.run(BATCH, plan)
            gpu.reset_peak_memory_stats()
            runner.run(BATCH, plan)
            runner.close()
            allocated, reserved = gpu.max_memory_allocated(), gpu.max_memory_reserved()
        assert est.peak_bytes == allocated == bare.peak_bytes + workspaces.resident
        assert est.workspace_bytes == workspaces.resident
        assert est.breakdown["other"] == bare.breakdown["other"] + workspaces.resident
        shared = 2 * MiB + (2 * 20 * MiB if capability < (9, 0) else 0)  # cuBLASLt's small segment
        assert 0 <= est.reserved_bytes - reserved <= shared


class Linear:
    """A stand-in estimator whose estimates hold a card's 65 MiB of workspaces: 10 MiB + 1 MiB per
    row of tensors on top of them."""

    rows, resident = 32, {"params": 1, "grads": 1, "optimizer": 1}
    model = torch.nn.Linear(2, 2)

    def measure(self, plan, after=None, limit=None):
        m = plan.micro_batch_size
        peak = (65 + 10 + m) * MiB
        return MemoryEstimate(plan, peak, {}, reserved_bytes=peak, workspace_bytes=65 * MiB)

    def forget_source(self):
        pass


def test_the_calibration_learns_no_constant_as_a_factor():
    """A card that measures 25% more than predicted on the tensors, at micro-batch 1: the factor is
    learned on the tensors alone (1.25, not (65 + 11 x 1.25) / 76), so at micro-batch 32 the
    calibrated peak adds 25% of the tensors and nothing for the workspaces."""
    gpu = SimulatedGPU(caps="reserved")
    guide = Guide(SimulatedDevice(gpu), "reserved", 200 * MiB, constant=65 * MiB)
    guide.attach(Linear(), [], 8)
    guide.observe(Plan.for_batch(32, 1), 0, 8, first=True)
    gpu.allocator.max_reserved = 65 * MiB + 11 * MiB * 5 // 4  # what the card reserved at its peak
    guide.observe(Plan.for_batch(32, 1), 0, 8)
    assert guide.measured == 1.25
    at_32 = guide.predicted(Plan.for_batch(32, 32))
    assert at_32 == (65 + 42) * MiB
    assert guide.calibrated(at_32) == 65 * MiB + 42 * MiB * 5 // 4
    # The largest micro-batch fitting 200 MiB: 65 + (10 + m) x 1.25 <= 200 -> m = 98, past the rows.
    assert guide.largest(Plan.for_batch(32, 1), 1, 33, length=8) == 32
    tight = Guide(SimulatedDevice(gpu), "reserved", 100 * MiB, calibration=1.05, constant=65 * MiB)
    tight.attach(Linear(), [], 8)
    # 65 + (10 + m) x 1.05 <= 100 -> m <= 23.33: 23 (a factor on the whole estimate would say 20).
    assert tight.largest(Plan.for_batch(32, 1), 1, 33, length=8) == 23


class TensorsOnly:
    """A stand-in estimator that holds no workspaces (as FSDP2's sharded one): 10 MiB + 1 MiB a row."""

    rows, resident = 16, {"params": 1, "grads": 1, "optimizer": 1}
    model = torch.nn.Linear(2, 2)

    def measure(self, plan):
        m = plan.micro_batch_size
        return MemoryEstimate(plan, (10 + m) * MiB, {}, reserved_bytes=(10 + m) * MiB)


def test_what_an_estimator_does_not_hold_is_kept_back_from_the_budget():
    from autofit.estimator.capacity import Fit, Space, choose, rank, unplaced
    holder = type("Holder", (), {"workspaces": HOPPER})()
    assert unplaced(TensorsOnly(), HOPPER, "reserved") == 66 * MiB  # two 32 MiB segments, cuBLASLt's 2 MiB
    assert unplaced(TensorsOnly(), HOPPER, "allocated") == 65 * MiB
    assert unplaced(holder, HOPPER, "reserved") == 0 and unplaced(TensorsOnly(), None, "reserved") == 0
    # 96 MiB less the 66 MiB the estimates lack: 30 MiB, where 10 + 16 rows fit (the whole batch).
    chosen = choose(rank(TensorsOnly(), torch.zeros(16, 2), 96 * MiB, fit=Fit(caps="reserved", workspaces=HOPPER),
                         space=Space("fp32", allow_offload=False)))
    assert chosen.plan.micro_batch_size == 16
    chosen = choose(rank(TensorsOnly(), torch.zeros(16, 2), 84 * MiB, fit=Fit(caps="reserved", workspaces=HOPPER),
                         space=Space("fp32", allow_offload=False)))
    assert chosen.plan.micro_batch_size == 8  # 18 MiB left: 10 + 8 (micro_batch_sizes(16): 16, 8, 6, ...)
