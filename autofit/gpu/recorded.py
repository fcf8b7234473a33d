"""A walk's allocator calls recorded, and replayed under a cap: what a card whose memory limit is the
cap would reserve for the same step (the capacity check's "fits", autofit.estimator.estimate)."""

from __future__ import annotations

from autofit.gpu.allocator import AllocationFailed, CachingAllocator, round_size, segment_size


class RecordingAllocator(CachingAllocator):
    """An unlimited allocator that records every call, for `replay_capped`; `recording = False`
    stops the record (the figures of the step have been read)."""

    def __init__(self, expandable: bool = False):
        super().__init__(None, expandable)
        # ("m", nbytes, enforce, id) | ("f", id) | ("r",): `begin` | ("c",): `release_cached`
        # | ("s",): `mark_step`
        self.events: list[tuple] = []
        self.recording = True

    def malloc(self, nbytes: int, enforce: bool = True) -> Block:
        block = super().malloc(nbytes, enforce)
        if self.recording:
            self.events.append(("m", nbytes, enforce, id(block)))
        return block

    def free(self, block: Block) -> None:
        if self.recording:
            self.events.append(("f", id(block)))
        super().free(block)

    def release_cached(self) -> None:
        if self.recording:
            self.events.append(("c",))
        super().release_cached()

    def mark_step(self) -> None:
        """The optimizer's update begins: where a run's first step makes the optimizer state
        (autofit.estimator.replayed lays the state's blocks there). A replay ignores it."""
        if self.recording:
            self.events.append(("s",))

    def begin(self) -> None:
        """The measured step begins: a replay's peak counts from here. The step's own resets of the
        peak statistics are not recorded (a capped allocator's reserved bytes fall when it releases
        its cache, so a reset would drop the peak before it)."""
        self.reset_peak()
        if self.recording:
            self.events.append(("r",))


def replay_capped(events: list, limit: int, expandable: bool = False) -> tuple[int, bool]:
    """(reserved peak, True) of `events` (a `RecordingAllocator`'s) replayed by an allocator whose
    reserved bytes are capped at `limit`, which releases its cached segments when it reaches the cap
    and retries, as a card's does; (what it reserved when a request failed anyway plus the segment
    that request needed, over the limit, False) when it cannot stay under the cap."""
    allocator = CachingAllocator(limit, expandable)
    blocks: dict[int, Block] = {}
    for e in events:
        op = e[0]
        if op == "m":
            try:
                blocks[e[3]] = allocator.malloc(e[1], e[2])
            except AllocationFailed:
                return allocator.reserved + segment_size(round_size(e[1])), False
        elif op == "f":
            allocator.free(blocks.pop(e[1]))
        elif op == "r":
            allocator.reset_peak()
        elif op == "c":
            allocator.release_cached()
    return allocator.max_reserved, True
