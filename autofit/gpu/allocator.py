"""A model of CUDA's caching allocator: which segments it reserves for a sequence of allocations.

The rules are those of PyTorch's `c10/cuda/CUDACachingAllocator.cpp` (default configuration, one
stream), re-stated here:
- a request is rounded up to a multiple of 512 bytes;
- requests of at most 1 MiB are served from the small pool, whose segments are 2 MiB; larger ones
  from the large pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded up
  to 2 MiB otherwise;
- a request takes the smallest cached free block of its pool that is large enough (best fit; equal
  sizes: the lowest address), else a new segment;
- the block is split when the remainder is at least 512 bytes (small pool) or more than 1 MiB (large
  pool); otherwise the whole block is handed out;
- a freed block merges with free neighbours of its segment and stays cached (still reserved);
- the memory limit (`set_per_process_memory_fraction`) caps *reserved* bytes: when a new segment
  would go over it, every cached segment that is wholly free is released and the segment is tried
  once more before the allocation fails.

`expandable=True` models `expandable_segments:True`: each pool has one segment that grows by mapping
pages (2 MiB in the small pool, 20 MiB in the large one) at the lowest address where the request
fits; any remainder of 512 bytes or more is split off; releasing unmaps the whole pages of free blocks.

`RecordingAllocator` also writes down every call in order, and `replay_capped` replays such a record
through an allocator capped at a limit: what a card of that limit does with the same allocations
(the estimator records its walk once, uncapped, and asks any limit of the record).

Not modelled: several streams and their events, CUDA graphs' private pools, `max_split_size_mb`,
`roundup_power2_divisions`, garbage-collection thresholds; segment addresses are made up (each new
segment lies above the previous one), which only decides ties between equal-size free blocks.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from autofit.errors import AllocationFailed

MIN_BLOCK = 512              # every request is rounded up to a multiple of this
SMALL_REQUEST = 1 << 20      # requests up to 1 MiB go to the small pool
SMALL_SEGMENT = 2 << 20      # the small pool's segments (and its expandable pages)
LARGE_SEGMENT = 20 << 20     # segments for 1-10 MiB requests (and the large pool's expandable pages)
MIN_LARGE_ALLOC = 10 << 20   # from here a request gets its own segment, rounded up to ...
ROUND_LARGE = 2 << 20        # ... a multiple of 2 MiB
_ADDRESS_SPACE = 1 << 48     # an expandable segment's virtual size: never the limit


def round_size(nbytes: int) -> int:
    """The bytes a request of `nbytes` occupies (at least 512, a multiple of 512)."""
    return max(-(-nbytes // MIN_BLOCK) * MIN_BLOCK, MIN_BLOCK)


def segment_size(size: int) -> int:
    """The size of the segment a rounded request of `size` bytes makes when no cached block fits."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class Block:
    """A range of a segment: allocated, free (cached) or, in an expandable segment, unmapped."""

    __slots__ = ("addr", "size", "small", "state", "prev", "next")

    def __init__(self, addr, size, small, state, prev=None, next=None):
        self.addr, self.size, self.small, self.state = addr, size, small, state
        self.prev, self.next = prev, next

    @property
    def whole_segment(self) -> bool:
        return self.prev is None and self.next is None

    def __repr__(self):
        return f"Block({self.state}, {self.size} B at {self.addr:#x})"


class CachingAllocator:
    """Blocks and segments of one device. `malloc(nbytes) -> Block`, `free(block)`, `empty_cache()`;
    `reserved` / `max_reserved` as torch.cuda's `memory_reserved()` / `max_memory_reserved()`."""

    def __init__(self, limit: int | None = None, expandable: bool = False):
        self.limit = limit
        self.expandable = expandable
        self.reserved = 0
        self.max_reserved = 0
        self.segments = 0
        self._free = {True: [], False: []}   # per pool (small?): sorted (size, addr) of free blocks
        self._by_addr: dict[int, Block] = {}   # free blocks by address
        self._heads: list[Block] = []          # first block of every segment, by address
        self._next_addr = 1 << 40
        self._grown: dict[bool, Block] = {}    # expandable: each pool's segment, by its first block

    # -- the public moves ------------------------------------------------------------------------
    def malloc(self, nbytes: int, enforce: bool = True) -> Block:
        """A block for `nbytes`; raises AllocationFailed when the limit leaves no room (never when
        `enforce` is False: memory that was already there, such as a model before the limit)."""
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST
        block = self._best_fit(small, size)
        if block is None:
            block = self._new_memory(small, size, enforce)
            if block is None:
                self.release_cached()
                block = self._new_memory(small, size, enforce)
                if block is None:
                    raise AllocationFailed(size)
        self._take(block)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if (small or self.expandable) else remaining > SMALL_REQUEST:
            rest = Block(block.addr + size, remaining, small, "free", block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._put(rest)
        block.state = "allocated"
        return block

    def free(self, block: Block) -> None:
        """Return a block to the cache, merged with its free neighbours (it stays reserved)."""
        block.state = "free"
        after, before = block.next, block.prev
        if after is not None and after.state == "free":
            self._take(after)
            self._merge(block, after)
        if before is not None and before.state == "free":
            self._take(before)
            self._merge(before, block)
            block = before
        self._put(block)

    def release_cached(self) -> None:
        """Give back to the device every cached segment that is wholly free (`empty_cache()`); in an
        expandable segment, every whole page of the free blocks."""
        if self.expandable:
            for small in (True, False):
                for block in [b for b in self._blocks_of(small) if b.state == "free"]:
                    self._unmap_pages(block)
            return
        for head in [h for h in self._heads if h.state == "free" and h.whole_segment]:
            self._take(head)
            self._heads.remove(head)
            self.reserved -= head.size
            self.segments -= 1

    def reset_peak(self) -> None:
        self.max_reserved = self.reserved

    def layout(self) -> list[list[tuple[str, int]]]:
        """[(state, size), ...] per segment in address order (mapped blocks only): for tests and
        diagnostics."""
        out = []
        heads = list(self._grown.values()) if self.expandable else self._heads
        for head in sorted(heads, key=lambda h: h.addr):
            blocks, b = [], head
            while b is not None:
                if b.state != "unmapped":
                    blocks.append((b.state, b.size))
                b = b.next
            out.append(blocks)
        return out

    # -- free lists ------------------------------------------------------------------------------
    def _put(self, block: Block) -> None:
        insort(self._free[block.small], (block.size, block.addr))
        self._by_addr[block.addr] = block

    def _take(self, block: Block) -> None:
        pool = self._free[block.small]
        del pool[bisect_left(pool, (block.size, block.addr))]
        del self._by_addr[block.addr]

    def _best_fit(self, small: bool, size: int) -> Block | None:
        pool = self._free[small]
        i = bisect_left(pool, (size, 0))
        return self._by_addr[pool[i][1]] if i < len(pool) else None

    @staticmethod
    def _merge(low: Block, high: Block) -> None:
        """`low` absorbs `high`, the block after it (the lower block, a segment's head, stays)."""
        low.next = high.next
        if high.next is not None:
            high.next.prev = low
        low.size += high.size

    # -- new memory from the device --------------------------------------------------------------
    def _fits(self, nbytes: int, enforce: bool) -> bool:
        return not enforce or self.limit is None or self.reserved + nbytes <= self.limit

    def _new_memory(self, small: bool, size: int, enforce: bool) -> Block | None:
        """A free block of at least `size` made from new device memory (None: over the limit)."""
        if self.expandable:
            return self._grow(small, size, enforce)
        nbytes = segment_size(size)
        if not self._fits(nbytes, enforce):
            return None
        head = Block(self._next_addr, nbytes, small, "free")
        self._next_addr += nbytes
        self._heads.append(head)
        self.reserved += nbytes
        self.max_reserved = max(self.max_reserved, self.reserved)
        self.segments += 1
        self._put(head)
        return head

    # -- expandable segments ---------------------------------------------------------------------
    def _blocks_of(self, small: bool):
        b = self._grown.get(small)
        while b is not None:
            yield b
            b = b.next

    def _grow(self, small: bool, size: int, enforce: bool) -> Block | None:
        """Map pages at the lowest address where a run of free and unmapped blocks holds `size`."""
        if small not in self._grown:
            self._grown[small] = Block(self._next_addr, _ADDRESS_SPACE, small, "unmapped")
            self._next_addr += _ADDRESS_SPACE
            self.segments += 1
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        run: list[Block] = []
        for b in self._blocks_of(small):
            if b.state == "allocated":
                run = []
                continue
            run.append(b)
            if sum(x.size for x in run) < size:
                continue
            plan, left = [], size  # bytes to map per unmapped block: whole pages, no more than needed
            for x in run:
                take = x.size if x.state == "free" else min(x.size, -(-left // page) * page)
                plan.append(take)
                left -= take
            mapped = sum(t for x, t in zip(run, plan) if x.state == "unmapped")
            if not self._fits(mapped, enforce):
                return None
            return self._map(run, plan)
        return None

    def _map(self, run: list[Block], plan: list[int]) -> Block:
        """Map the run's unmapped blocks (`plan`: bytes of each), then merge the run into one free
        block."""
        merged = None
        for b, nbytes in zip(run, plan):
            if b.state == "unmapped":
                if b.size > nbytes:  # the unmapped rest stays behind
                    rest = Block(b.addr + nbytes, b.size - nbytes, b.small, "unmapped", b, b.next)
                    if b.next is not None:
                        b.next.prev = rest
                    b.next, b.size = rest, nbytes
                self.reserved += nbytes
                b.state = "free"
            else:
                self._take(b)
            if merged is None:
                merged = b
            else:
                self._merge(merged, b)
        self.max_reserved = max(self.max_reserved, self.reserved)
        self._put(merged)
        return merged

    def _unmap_pages(self, block: Block) -> None:
        """Unmap the whole pages inside a free block of an expandable segment."""
        page = SMALL_SEGMENT if block.small else LARGE_SEGMENT
        base = self._grown[block.small].addr
        lo = base + -(-(block.addr - base) // page) * page
        hi = base + (block.addr + block.size - base) // page * page
        if hi <= lo:
            return
        self._take(block)
        end = block.addr + block.size
        pieces = [(block.addr, lo, "free"), (lo, hi, "unmapped"), (hi, end, "free")]
        prev, first = block.prev, None
        after = block.next
        for a, z, state in pieces:
            if z <= a:
                continue
            piece = Block(a, z - a, block.small, state, prev)
            if prev is not None:
                prev.next = piece
            prev = piece
            first = first or piece
            if state == "free":
                self._put(piece)
        prev.next = after
        if after is not None:
            after.prev = prev
        if block is self._grown[block.small]:
            self._grown[block.small] = first
        self.reserved -= hi - lo
        # neighbouring unmapped ranges become one
        b = self._grown[block.small]
        while b is not None and b.next is not None:
            if b.state == "unmapped" and b.next.state == "unmapped":
                self._merge(b, b.next)
            else:
                b = b.next
