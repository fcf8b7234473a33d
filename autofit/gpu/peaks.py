"""The user's peak-memory readings, kept through autofit's own measurements.

autofit measures each attempt and each optimizer step in a window of its own: it resets the
device's peak counters at the window's start (`reset_peak_memory_stats`), which is the only way to
read the peak of a window on CUDA. Each reset would wipe the maximum a user reads after the run
(`torch.cuda.max_memory_allocated()` would give autofit's last window, not the run's peak). So a
device folds its peaks into the run's maxima before every reset (`Device.run_peaks`), and when the
device is closed the allocated-peak counter is raised back to the run's maximum by a transient
allocation of the difference, freed at once (`restore_peak`): the user reads what they would have
read had autofit never reset anything. On CUDA the difference is allocated as whole 2 MiB segments
plus blocks of at most 1 MiB, which the caching allocator hands out at their exact size after the
cache is emptied. The simulated GPU's counter is autofit's own and is set instead
(`Device.keep_peak`): an allocation there would be one more for fault injection to count.
"""

from __future__ import annotations

import logging

import torch

from autofit.gpu.oom import is_oom

log = logging.getLogger("autofit")

SEGMENT = 2 << 20  # CUDA's large blocks come in segments of a multiple of this
SMALL = 1 << 20    # at most this: a block of the small pool, split to its exact (512-byte) size


def pieces(delta: int, cuda: bool) -> list[int]:
    """Sizes whose allocation raises the allocated bytes by exactly `delta`."""
    if not cuda:
        return [delta]
    whole = delta - delta % SEGMENT
    rest = delta - whole
    return ([whole] if whole else []) + [min(SMALL, rest - i) for i in range(0, rest, SMALL)]


def restore_peak(device, peak: int) -> bool:
    """Raise `device`'s allocated-peak counter to `peak` (a run's maximum) when it reads less; True
    when it reads `peak` afterwards. An allocation that does not fit now (another process took the
    memory) leaves the counter as it is, said at debug level."""
    if device.max_memory_allocated() >= peak:
        return device.max_memory_allocated() == peak
    cuda = device.type == "cuda"
    if cuda:
        device.empty_cache()  # fresh segments: each piece is counted at its own size
    delta = peak - device.memory_allocated()  # held on top of what is allocated now
    try:
        held = [torch.empty(size, dtype=torch.uint8, device=device.torch_device)
                for size in pieces(delta, cuda)]
        del held
    except Exception as error:  # diagnostics of the user's own readings never stop a run's end
        if not is_oom(error):
            raise
        log.debug("the peak-memory counter could not be raised back to the run's %d bytes: %s", peak, error)
        return False
    return device.max_memory_allocated() == peak
