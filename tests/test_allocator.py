"""The caching-allocator model replays traces whose segment layouts were worked out by hand from the
rules in autofit/gpu/allocator.py (PyTorch's CUDACachingAllocator, default configuration)."""

import pytest
import torch

from autofit import simulate_gpu
from autofit.gpu.allocator import AllocationFailed, CachingAllocator, round_size, segment_size

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("nbytes, rounded, segment", [
    (0, 512, 2 * MiB), (1, 512, 2 * MiB), (512, 512, 2 * MiB), (513, 1024, 2 * MiB),
    (MiB, MiB, 2 * MiB),                          # 1 MiB is still small
    (MiB + 1, MiB + 512, 20 * MiB),               # over 1 MiB: the large pool's 20 MiB segments
    (10 * MiB - 512, 10 * MiB - 512, 20 * MiB),   # under 10 MiB: still 20 MiB
    (10 * MiB, 10 * MiB, 10 * MiB),               # from 10 MiB: rounded up to 2 MiB
    (11 * MiB, 11 * MiB, 12 * MiB),
])
def test_request_rounding_and_segment_sizes(nbytes, rounded, segment):
    assert round_size(nbytes) == rounded
    assert segment_size(rounded) == segment


def test_small_pool_trace():
    a = CachingAllocator()
    first = a.malloc(1)                    # 512 B from a new 2 MiB segment; the rest is split off
    assert (a.reserved, a.layout()) == (2 * MiB, [[("allocated", 512), ("free", 2 * MiB - 512)]])
    a.malloc(MiB)                          # 1 MiB is small: best fit in that segment
    a.malloc(MiB + 1)                      # large pool: a 20 MiB segment, split
    assert a.reserved == 22 * MiB
    assert a.layout() == [[("allocated", 512), ("allocated", MiB), ("free", MiB - 512)],
                          [("allocated", MiB + 512), ("free", 19 * MiB - 512)]]
    a.free(first)                          # cached, not merged: its neighbour is allocated
    a.malloc(MiB - 512)                    # exact fit: no split
    assert a.layout()[0] == [("free", 512), ("allocated", MiB), ("allocated", MiB - 512)]
    a.malloc(600)                          # 1024 B: the 512 B block is too small -> new segment
    assert a.reserved == 24 * MiB and a.segments == 3
    assert a.layout()[2] == [("allocated", 1024), ("free", 2 * MiB - 1024)]


def test_large_pool_trace_splits_only_remainders_over_1_mib_and_merges_free_neighbours():
    a = CachingAllocator()
    a.malloc(19 * MiB + 1)                 # 19 MiB + 512 -> 20 MiB segment; 1 MiB - 512 left: no split
    assert a.layout() == [[("allocated", 20 * MiB)]]
    a.malloc(18 * MiB)                     # its own 18 MiB segment
    x = a.malloc(3 * MiB)                  # under 10 MiB: a 20 MiB segment, 17 MiB split off
    y = a.malloc(12 * MiB)                 # best fit: the cached 17 MiB block, 5 MiB split off
    assert a.reserved == 58 * MiB
    assert a.layout()[2] == [("allocated", 3 * MiB), ("allocated", 12 * MiB), ("free", 5 * MiB)]
    a.free(x)
    assert a.layout()[2] == [("free", 3 * MiB), ("allocated", 12 * MiB), ("free", 5 * MiB)]
    a.free(y)                              # merges with both free neighbours
    assert a.layout()[2] == [("free", 20 * MiB)]
    a.malloc(16 * MiB + 512 * KiB)         # a cached 20 MiB block serves a >= 10 MiB request
    assert a.layout()[2] == [("allocated", 16 * MiB + 512 * KiB), ("free", 3 * MiB + 512 * KiB)]
    assert (a.reserved, a.max_reserved, a.segments) == (58 * MiB, 58 * MiB, 3)


def test_best_fit_takes_the_smallest_block_that_fits():
    a = CachingAllocator()
    big, small = a.malloc(30 * MiB), a.malloc(14 * MiB)   # two segments of their own sizes
    a.free(big), a.free(small)
    a.malloc(13 * MiB)                     # 14 MiB fits best; 1 MiB left is not split off
    assert a.layout() == [[("free", 30 * MiB)], [("allocated", 14 * MiB)]]


def test_a_failed_reservation_releases_wholly_free_segments_then_retries():
    a = CachingAllocator(limit=48 * MiB)
    x = a.malloc(12 * MiB)                 # segment 12 MiB
    pinned = a.malloc(2 * MiB)             # segment 20 MiB: [2 allocated, 18 free]
    a.free(x)                              # 32 MiB reserved, 2 MiB allocated
    a.malloc(25 * MiB)                     # 32 + 26 > 48: the free 12 MiB segment is released
    assert a.layout() == [[("allocated", 2 * MiB), ("free", 18 * MiB)], [("allocated", 26 * MiB)]]
    assert (a.reserved, a.max_reserved) == (46 * MiB, 46 * MiB)
    with pytest.raises(AllocationFailed) as info:  # 46 + 20 > 48, and no segment is wholly free
        a.malloc(19 * MiB)
    assert info.value.size == 19 * MiB
    assert a.reserved == 46 * MiB          # nothing changed by the failure
    a.free(pinned)                         # the 20 MiB segment is one free block again ...
    a.malloc(19 * MiB)                     # ... which serves 19 MiB (1 MiB left: not split off)
    assert a.layout()[0] == [("allocated", 20 * MiB)]


def test_release_cached_keeps_segments_that_hold_a_block():
    a = CachingAllocator()
    kept, gone = a.malloc(3 * MiB), a.malloc(12 * MiB)
    a.free(gone)
    a.release_cached()
    assert (a.reserved, a.layout()) == (20 * MiB, [[("allocated", 3 * MiB), ("free", 17 * MiB)]])
    a.free(kept)
    a.release_cached()
    assert (a.reserved, a.layout(), a.segments) == (0, [], 0)


def test_expandable_segments_trace():
    a = CachingAllocator(expandable=True)
    first = a.malloc(30 * MiB)             # maps two 20 MiB pages; 10 MiB split off
    assert (a.reserved, a.layout()) == (40 * MiB, [[("allocated", 30 * MiB), ("free", 10 * MiB)]])
    a.malloc(2 * MiB)                      # any remainder >= 512 B is split off
    a.free(first)
    assert a.layout() == [[("free", 30 * MiB), ("allocated", 2 * MiB), ("free", 8 * MiB)]]
    a.release_cached()                     # unmaps the whole page [0, 20) only
    assert (a.reserved, a.layout()) == (20 * MiB, [[("free", 10 * MiB), ("allocated", 2 * MiB),
                                                     ("free", 8 * MiB)]])
    a.malloc(25 * MiB)                     # lowest address: remaps the hole and joins the 10 MiB
    assert (a.reserved, a.layout()) == (40 * MiB, [[("allocated", 25 * MiB), ("free", 5 * MiB),
                                                     ("allocated", 2 * MiB), ("free", 8 * MiB)]])
    a.malloc(100)                          # the small pool grows in 2 MiB pages
    assert a.reserved == 42 * MiB and a.layout()[1] == [("allocated", 512), ("free", 2 * MiB - 512)]


def test_expandable_segments_avoid_the_fragmentation_of_fixed_segments():
    fixed, grown = CachingAllocator(limit=40 * MiB), CachingAllocator(limit=40 * MiB, expandable=True)
    for a in (fixed, grown):
        first, kept, third = (a.malloc(8 * MiB) for _ in range(3))
        a.free(first), a.free(third)
    # fixed: [8 free, 8 kept, 4 free] and [20 free]; 24 MiB needs a new segment: 40 + 24 > 40,
    # the free 20 MiB segment is released, 20 + 24 > 40 still: out of memory with 8 MiB allocated.
    assert fixed.layout() == [[("free", 8 * MiB), ("allocated", 8 * MiB), ("free", 4 * MiB)],
                              [("free", 20 * MiB)]]
    with pytest.raises(AllocationFailed):
        fixed.malloc(24 * MiB)
    assert fixed.reserved == 20 * MiB
    # expandable: the third block went into the same segment (4 free + a new 20 MiB page), so the
    # freed tail is one 24 MiB block.
    assert grown.layout() == [[("free", 8 * MiB), ("allocated", 8 * MiB), ("free", 24 * MiB)]]
    grown.malloc(24 * MiB)
    assert grown.reserved == 40 * MiB


# -- on the simulated GPU --------------------------------------------------------------------------

def test_simulated_gpu_reports_reserved_memory_and_empties_its_cache():
    with simulate_gpu("64MiB") as gpu:
        x = torch.empty(256)                                   # 1 KiB: a 2 MiB small segment
        assert (gpu.memory_allocated(), gpu.memory_reserved()) == (1024, 2 * MiB)
        y = torch.empty(3 * MiB // 4)                          # 3 MiB: a 20 MiB segment
        assert (gpu.memory_allocated(), gpu.memory_reserved()) == (3 * MiB + 1024, 22 * MiB)
        del y
        assert (gpu.memory_allocated(), gpu.memory_reserved()) == (1024, 22 * MiB)  # cached
        gpu.empty_cache()
        assert (gpu.memory_reserved(), gpu.max_memory_reserved()) == (2 * MiB, 22 * MiB)
        gpu.reset_peak_memory_stats()
        assert gpu.max_memory_reserved() == 2 * MiB
        del x


def test_the_budget_caps_reserved_bytes_with_cudas_message():
    with simulate_gpu("16MiB", caps="reserved") as gpu:
        keep = torch.empty(256)
        with pytest.raises(torch.OutOfMemoryError) as info:    # 3 MiB needs a 20 MiB segment
            torch.empty(3 * MiB // 4)
        assert str(info.value) == (
            "CUDA out of memory. Tried to allocate 3.00 MiB. GPU 0 has a total capacity of 16.00 MiB "
            "of which 14.00 MiB is free. Of the allocated memory 1.00 KiB is allocated by PyTorch "
            "(simulated GPU), and 2.00 MiB is reserved by PyTorch but unallocated.")
        big = torch.empty(12 * MiB // 4)                       # >= 10 MiB: its own 12 MiB segment
        assert gpu.memory_reserved() == 14 * MiB
        del big, keep


def test_simulated_gpu_releases_its_cache_before_failing():
    with simulate_gpu("24MiB", caps="reserved") as gpu:
        a = torch.empty(12 * MiB // 4)
        del a                                                   # 12 MiB cached
        b = torch.empty(14 * MiB // 4)                          # 12 + 14 > 24: cache released first
        assert (gpu.memory_reserved(), gpu.max_memory_reserved()) == (14 * MiB, 14 * MiB)
        del b


def test_expandable_segments_switch_on_the_simulated_gpu():
    with simulate_gpu("64MiB", expandable_segments=True) as gpu:
        x = torch.empty(3 * MiB // 4)                           # one 20 MiB page of the large pool
        y = torch.empty(3 * MiB // 4)                           # the same page
        assert gpu.memory_reserved() == 20 * MiB
        del x, y
    with pytest.raises(TypeError, match="expandable_segments must be True or False but got 'yes'"):
        with simulate_gpu(expandable_segments="yes"):
            pass
