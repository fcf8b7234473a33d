"""CUDA's own bytes on a device: the library workspaces that live in the caching allocator.

No tensor of the user's holds them, so no count of tensors sees them, but a card's allocator hands
them out and counts them as allocated (PyTorch's `aten/src/ATen/cuda/CublasHandlePool.cpp`):
- cuBLAS: one workspace per handle and stream, made the first time a thread runs a cuBLAS kernel and
  kept for the rest of the process. A training step runs kernels on two threads, the forward thread
  and autograd's device thread (backward), so two workspaces exist from the first backward on. Each
  is `CUBLAS_WORKSPACE_CONFIG`'s sum of `:SIZE:COUNT` pairs (SIZE in KiB) when set, else 32 MiB on
  compute capability 9.x-12.x (Hopper, Blackwell) and 8 MiB + 128 KiB (":4096:2:16:8") before.
- cuBLASLt: a workspace of `CUBLASLT_WORKSPACE_SIZE` KiB (default 1024). The H200 held 65 MiB
  allocated after a finished run with the model moved off (64 of them the two cuBLAS workspaces)
  and 33 MiB after a run that died before its first backward: one such workspace, not one per thread.
- cuDNN: a convolution's workspace is taken for the call and given back, and cuDNN picks an
  algorithm whose workspace fits what is free; `cudnn` is headroom kept for it on models with
  convolutions (a cuBLAS workspace's size: room for a fast algorithm, not a requirement).

`Workspaces.of_device(device)` is what a device holds: a CUDA card's from its compute capability, a
simulated GPU's the ones it was made with (`simulate_gpu(..., capability=(9, 0))`), none elsewhere.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

MiB = 1 << 20
KiB = 1 << 10
LARGE_WORKSPACE = 32 * MiB                       # capability 9.x-12.x
SMALL_WORKSPACE = 4096 * KiB * 2 + 16 * KiB * 8  # ":4096:2:16:8", before Hopper
LT_WORKSPACE = 1024 * KiB
KERNEL_THREADS = ("forward", "backward")        # the forward thread, autograd's device thread
NEWEST = (9, 0)  # the capability assumed where no card is at hand (the larger workspaces)


@dataclass(frozen=True)
class Workspaces:
    """Bytes of one device's library workspaces: `cublas` per kernel thread, `cublaslt` once,
    `cudnn` headroom for models with convolutions."""

    cublas: int = 0
    cublaslt: int = 0
    cudnn: int = 0

    @property
    def resident(self) -> int:
        """What stays allocated from the first backward on (both threads' cuBLAS workspaces)."""
        return self.cublas * len(KERNEL_THREADS) + self.cublaslt

    def first(self, thread: str) -> list[int]:
        """The allocations a thread's first cuBLAS kernel makes (the forward thread's also makes
        cuBLASLt's)."""
        if not self.cublas and not self.cublaslt:
            return []
        made = [self.cublas] if self.cublas else []
        return made + [self.cublaslt] if thread == KERNEL_THREADS[0] and self.cublaslt else made

    def reserve(self, model=None) -> int:
        """Bytes to keep free for what an estimate cannot place: cuDNN's convolution workspaces,
        on a model with convolutions (any model when `model` is None: not known yet)."""
        if not self.cudnn:
            return 0
        return self.cudnn if model is None or has_convolutions(model) else 0

    @classmethod
    def of_capability(cls, capability: tuple[int, int] | None = None, environ=None) -> "Workspaces":
        """A card's of this compute capability (None: `NEWEST`), honouring the environment's
        CUBLAS_WORKSPACE_CONFIG and CUBLASLT_WORKSPACE_SIZE as PyTorch does."""
        environ = os.environ if environ is None else environ
        major = (capability or NEWEST)[0]
        cublas = cublas_workspace(environ.get("CUBLAS_WORKSPACE_CONFIG"), major)
        lt = lt_workspace(environ.get("CUBLASLT_WORKSPACE_SIZE"))
        return cls(cublas=cublas, cublaslt=lt, cudnn=cublas)

    @classmethod
    def of_device(cls, device) -> "Workspaces":
        """What `device` (autofit.gpu.device) holds: a card's by its capability, a simulated GPU's
        as it was made, none on a plain CPU."""
        if device.type == "cuda":
            capability = getattr(device, "capability", None)
            return cls.of_capability(capability() if callable(capability) else None)
        gpu = getattr(device, "gpu", None)
        return getattr(gpu, "workspaces", None) or NONE


NONE = Workspaces()
CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
                torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)
BLAS_OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "_addmm_activation", "_scaled_mm")


def cublas_workspace(config: str | None, major: int) -> int:
    """One cuBLAS handle's workspace: the sum of SIZE KiB x COUNT over `config`'s ":SIZE:COUNT"
    pairs, else (unset or unreadable, as PyTorch falls back) the default for compute capability
    `major`."""
    default = LARGE_WORKSPACE if 9 <= major <= 12 else SMALL_WORKSPACE
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if not pairs:
        return default
    return sum(int(size) * KiB * int(count) for size, count in pairs)


def lt_workspace(size: str | None) -> int:
    """cuBLASLt's workspace: CUBLASLT_WORKSPACE_SIZE KiB, else 1 MiB."""
    try:
        return int(size) * KiB if size is not None else LT_WORKSPACE
    except ValueError:
        return LT_WORKSPACE


def has_convolutions(model) -> bool:
    """Whether `model` runs convolutions (cuDNN kernels with workspaces of their own)."""
    return any(isinstance(m, CONVOLUTIONS) for m in model.modules())
