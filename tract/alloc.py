"""The shared allocator: a global chunk bitmap, per-chunk owners, node heaps.

The heap is ``nchunks`` chunks of ``chunk_size`` bytes.  Objects of more than
half a chunk take whole chunks (an *extent*: a run of chunks) from the global
path; smaller objects come from the node's slab heap
(`tract._native._nodeheap`, node-local memory), whose slabs are chunks taken
from the global path, so the common alloc and free touch no pool memory.

Global path (every step under the pool's ``alloc`` lock; over a real
mapping with a manager-mode lock the same steps run natively,
`tract._native._allocfast`, which hands every case but the common one back
to the Python steps here):

- the cursor line (next-fit position), the bitmap (bit set = chunk taken) and
  the owner records are written only by the lock holder (R2); the holder
  reads them after invalidating them (R4: the last holder was another host);
- alloc: find a run with the bitmap kernel (`tract._kernels.bitmap`), check
  the lock's epoch (fencing), write the owner records (node, epoch, pid,
  kind, run), flush, fence, then set the bits, flush, fence (R3): a crash
  between the two leaves owner records on free chunks, which `fsck` clears;
- free (from any node): check the owner records (R5: a head record whose run
  fits, tails pointing at it), clear the bits, flush, fence, then clear the
  records;
- reclaim (when a run is not found and a node's standing changed or a
  lease passed since the last walk, `Allocator.reclaim`, and in `fsck
  --repair`; the owner records read in one batch): chunks whose
  owner is dead — a node epoch that is not the node's current one, a node
  that left or whose lease lapsed (R6), or, for extents of a live node on
  this host, a process that is gone — and that nothing references (the
  object directory; the index later) are freed.  A slab chunk is reclaimed
  only with its node; the blocks in a live node's slabs of a process that
  is gone, by that node's own processes, once nothing referenced them at
  two looks a lease apart (`Allocator.reclaim_dead_blocks`; a look walks
  the node's heap only after one of its processes came, went or died, or
  a node's lease changed: nothing else leaves a block to a dead process
  and to no reference);
- fsck (`Allocator.check`, under the lock for ``--repair``): the cursor,
  the bitmap and every owner record read fresh and range-checked, each
  chunk classed free, owned or referenced, extents checked whole; its
  repairs (`set_cursor`, `clear_owner`, `release_chunks`) are the
  allocator's own, flushed and fenced here;
- a free of memory whose reference was dropped just before (eviction)
  names the owner record read while the reference stood
  (`Allocator.payload_owners`, `Allocator.free_of`): memory reclaimed in
  between is not freed again, nor another allocation made in it since.

A block of a gone node's slab (left, lapsed, dead, or a past incarnation of
this node) is freed by *adopting* the slab (`Allocator._adopt`, under the
lock, its grant checked: R6): the freeing node's heap lists it with every
block held (`ADOPTED`), then its owner record names that node and keeps the
gone owner's tag, so a free that read the old record follows it to the
adopter.  Each later free of a block of it gives the block to the adopter:
a gone node's memory flows to the nodes that evict its blocks, one record
write per chunk.  The blocks no reference named at the adoption (free in the
gone heap, queued to it) come back by the adopted-block sweep, unreferenced
at two looks a lease apart (`Allocator.reclaim_dead_blocks`, heartbeat).

A block of another node's slab is freed through a *remote-free ring* from the
freeing node to the slab's node (one writer per line: the sender writes the
slots and its head, the receiver its tail), drained by the receiver on its
next slow path and from its heartbeat thread.  A node that is gone drains
nothing: its slabs return with its chunks.  A node is several processes, each
with a heartbeat thread, so each end of a ring has one writer only because a
node's ring steps take turns (`RingTurn`: a node-local mutex): two drainers
would free a block twice, two senders fill one slot.  A drainer that dies in
its turn after moving the tail leaks what it had not freed yet (until the
blocks' processes are gone), never frees a block twice.

Rules relied on (DESIGN.md): R2, R3, R4 as above; R5 — cursor, owner records
and ring entries are range-checked, a bad one is a `CorruptionError` naming
the structure and offset; R6 — owners carry (node, epoch), reclaimed once
dead, and the lock's epoch is checked before any allocation is published.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import struct
import threading
import typing

import numpy as np

from tract._kernels import bitmap
from tract._native._allocfast import ChunkFastPath
from tract._native._nodeheap import ADOPTED, NOT_HELD, NOT_MINE
from tract._native._region import Region
from tract.errors import CorruptionError, LockTimeout, PoolFull
from tract.lease import ALIVE
from tract.lines import LINE
from tract import _failpoints as faults

__all__ = ["AllocLayout", "Allocator", "Finding", "FreeRing", "KINDS", "Reference", "RingTurn"]

OWNER_BYTES = 32
_RECORD = struct.Struct("<4Q")  # owner word (node + 1 | kind << 16 | pid << 32), epoch, run
RING_SLOTS = 32
# a free-ring entry: the offset, and the receiver's epoch's low bits above it
OFFSET_BITS, TAG_BITS = 48, 16
OFFSET_MASK, TAG_MASK = (1 << OFFSET_BITS) - 1, (1 << TAG_BITS) - 1
BITS_PER_LINE = LINE * 8

# owner record kinds
FREE, SLAB, HEAD, TAIL = 0, 1, 2, 3
KINDS = ("free", "slab", "extent", "extent-tail")


@dataclasses.dataclass(frozen=True)
class AllocLayout:
    """Where the allocator's metadata lies, from ``offset``: sized for
    ``capacity`` chunks (the pool size over the chunk size; the heap holds
    fewer, after the metadata)."""

    offset: int
    capacity: int
    max_nodes: int

    @property
    def cursor_line(self) -> int:
        return self.offset

    @functools.cached_property
    def bitmap(self) -> int:
        return self.offset + LINE

    @functools.cached_property
    def bitmap_bytes(self) -> int:
        return -(-self.capacity // BITS_PER_LINE) * LINE

    @functools.cached_property
    def owners(self) -> int:
        return self.bitmap + self.bitmap_bytes

    def owner(self, chunk: int) -> int:
        return self.owners + chunk * OWNER_BYTES

    @functools.cached_property
    def rings(self) -> int:
        return self.owners + -(-self.capacity * OWNER_BYTES // LINE) * LINE

    @functools.cached_property
    def ring_bytes(self) -> int:
        return 2 * LINE + RING_SLOTS * 8

    def ring(self, sender: int, receiver: int) -> int:
        return self.rings + (sender * self.max_nodes + receiver) * self.ring_bytes

    @property
    def nbytes(self) -> int:
        return self.rings + self.max_nodes ** 2 * self.ring_bytes - self.offset


class FreeRing:
    """The remote-free ring from ``sender`` to ``receiver``: slots and head
    written by the sender, tail by the receiver; counters only grow.

    Each entry names the receiver's incarnation it was meant for (its epoch's
    low `TAG_BITS` bits above the offset): a node that died and came back
    drops what was queued for its last incarnation, whose slabs went with it
    (the chunks may since be slabs again, of the new incarnation, whose
    blocks a stale free would free while in use)."""

    def __init__(self, region, layout: AllocLayout, sender: int, receiver: int):
        self.region = region
        base = layout.ring(sender, receiver)
        self.head_line, self.slots, self.tail_line = base, base + LINE, base + LINE + RING_SLOTS * 8
        self.where = f"free ring {sender}->{receiver} at offset {base}"

    def _counters(self) -> tuple[int, int]:
        self.region.invalidate(self.head_line, LINE)
        self.region.invalidate(self.tail_line, LINE)
        self.region.fence()
        head, tail = self.region.load_u64(self.head_line), self.region.load_u64(self.tail_line)
        if not 0 <= head - tail <= RING_SLOTS:
            raise CorruptionError(f"{self.where}: head {head}, tail {tail}")
        return head, tail

    @staticmethod
    def pending(region, layout: AllocLayout, receiver: int) -> list[int]:
        """The senders whose ring to ``receiver`` holds entries: every ring's
        head line invalidated in one batch, one fence (R4), read against its
        tail, the receiver's own line (R2).  A ring named is then drained,
        its counters checked (R5)."""
        senders = np.array([sender for sender in range(layout.max_nodes) if sender != receiver],
                           dtype=np.int64)
        heads = layout.rings + (senders * layout.max_nodes + receiver) * layout.ring_bytes
        region.invalidate_lines(heads)
        region.fence()
        tail = LINE + RING_SLOTS * 8
        return [sender for sender, head in zip(senders.tolist(), heads.tolist())
                if region.load_u64(head) != region.load_u64(head + tail)]

    def push(self, offset: int, epoch: int) -> bool:
        """Queue ``offset`` for the receiver's incarnation ``epoch``; False
        when the ring is full."""
        if not 0 < offset < 1 << OFFSET_BITS:
            raise ValueError(f"offset {offset} does not fit a free-ring entry "
                             f"({OFFSET_BITS} bits)")
        head, tail = self._counters()
        if head - tail == RING_SLOTS:
            return False
        slot = self.slots + (head % RING_SLOTS) * 8
        self.region.store_u64(slot, offset | (epoch & TAG_MASK) << OFFSET_BITS)
        self.region.flush(slot, 8)
        self.region.fence()  # the slot is in memory before the head says so (R3)
        self.region.store_u64(self.head_line, head + 1)
        self.region.flush(self.head_line, LINE)
        self.region.fence()
        return True

    def drain(self, epoch: int) -> list[int]:
        """Take every queued entry (receiver side); returns the offsets
        queued for incarnation ``epoch`` (the others are dropped)."""
        head, tail = self._counters()
        if head == tail:
            return []
        self.region.invalidate(self.slots, RING_SLOTS * 8)
        self.region.fence()
        words = [self.region.load_u64(self.slots + (seq % RING_SLOTS) * 8)
                 for seq in range(tail, head)]
        tag = epoch & TAG_MASK
        offsets = [word & OFFSET_MASK for word in words if word >> OFFSET_BITS == tag]
        self.region.store_u64(self.tail_line, head)
        self.region.flush(self.tail_line, LINE)
        self.region.fence()
        return offsets


class RingTurn:
    """One process of a node at a time at the node's ends of its free rings
    (R2): the node-local ``mutex`` (a `LocalMutex`), or, for a node's only
    process (no node-local file), a lock between its threads."""

    def __init__(self, mutex=None):
        self.mutex = mutex
        self._thread_lock = threading.Lock() if mutex is None else None

    @contextlib.contextmanager
    def taken(self, timeout: float | None):
        """Hold the turn; `TimeoutError` after ``timeout`` seconds (0: only
        if it is free now)."""
        if self.mutex is None:
            if not self._thread_lock.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError("the free rings' turn stayed taken")
            try:
                yield
            finally:
                self._thread_lock.release()
            return
        died = self.mutex.try_acquire() if timeout == 0 else self.mutex.acquire(timeout)
        if died is None:
            raise TimeoutError("the free rings' turn is taken")
        if died:  # the holder died: the rings' counters are whole (see the module docstring)
            self.mutex.consistent()
        try:
            yield
        finally:
            self.mutex.release()


class Owner(typing.NamedTuple):
    """One chunk's owner record."""

    node: int | None
    kind: int
    pid: int
    epoch: int
    run: int  # head: chunks in the extent; tail: the head's chunk; slab: 1
    adopted: int = 0  # a slab taken over from a gone owner: that owner's `adoption_tag`


def adoption_tag(owner: Owner) -> int:
    """What an adopted slab's record keeps of the owner it was taken from
    (its node and the low 48 bits of its epoch): a free that read that
    owner before the adoption finds its block's new owner by it."""
    return (owner.node + 1) | (owner.epoch & 0xFFFF_FFFF_FFFF) << 16


class Reference(typing.NamedTuple):
    """A record of another mechanism that points into the heap, for
    `Allocator.check`: its area and offset, what it is, and the repair that
    drops it (returns what it did)."""

    area: str
    offset: int
    what: str
    repair: typing.Callable[[], str] | None


class Finding(typing.NamedTuple):
    """What `Allocator.check` found at ``offset`` of ``area``: a problem,
    or (``reclaimable``) memory of an owner that is gone which nothing
    references, which the allocator takes back by itself when it needs
    room.  ``repair`` (None: there is none) fixes it, under the ``alloc``
    lock, and returns what it did."""

    area: str
    offset: int
    text: str
    repair: typing.Callable[[], str] | None
    reclaimable: bool = False


class Allocator:
    """One node's allocator over a pool (`Pool.alloc` / `Pool.free`)."""

    def __init__(self, pool, layout: AllocLayout, heap=None, rings: RingTurn | None = None,
                 members: typing.Callable[[], tuple[int, ...]] | None = None):
        self.pool = pool
        self.members = members  # the pids of the node's processes (its node-local list)
        self.rings = rings or RingTurn()  # this node's turn at its free rings
        self.region = pool.region
        self.layout = layout
        self.heap = heap  # the node's slab heap, or None (then every object takes chunks)
        self.base = pool.header.heap
        self.chunk_size = pool.header.chunk_size
        self.nchunks = pool.header.nchunks
        self.node = pool.node
        self.pid = os.getpid()
        self._referrers = []  # callables returning (offset, size) ranges in use
        # the native critical sections over a real mapping, with a manager-mode
        # lock's fast path; the Python steps (the reference) run otherwise
        self.fast = ChunkFastPath(
            self.region, layout.cursor_line, layout.bitmap, layout.bitmap_bytes, layout.owners,
            self.nchunks, layout.max_nodes, bitmap.first_free_run_address()
        ) if isinstance(self.region, Region) else None
        self.rejected: list[str] = []
        self._alloc_lock = None  # remote frees that named no block of ours
        # blocks of this node's slabs held by dead processes (of adopted
        # slabs: True): when looked at last, and when each was first seen
        self._dead_seen: dict[bool, tuple[float, dict[tuple[int, int], float]]] = {}
        # what `_block_standing` was when a walk of the heap left nothing to wait for
        self._blocks_walked: tuple | None = None
        # the last reclaim walk: when, and every node's standing then (`_reclaim_due`)
        self._walked: tuple[float, bytes | None] = (float("-inf"), None)
        self._dead_referenced: set[tuple[int, Owner]] = set()  # what the last walk left

    # ------------------------------------------------------------ records

    def chunk_of(self, offset: int) -> int:
        relative = offset - self.base
        if not 0 <= relative < self.nchunks * self.chunk_size:
            raise ValueError(f"offset {offset} is outside the heap "
                             f"[{self.base}, {self.base + self.nchunks * self.chunk_size})")
        return relative // self.chunk_size

    def offset_of(self, chunk: int) -> int:
        return self.base + chunk * self.chunk_size

    def owner(self, chunk: int) -> Owner:
        """Chunk ``chunk``'s owner record as this host sees it now (R5)."""
        line = self.layout.owner(chunk)
        word, epoch, run, adopted = self.region.load_u64s(line, 4)
        node_field, kind, pid = word & 0xFFFF, (word >> 16) & 0xFF, word >> 32
        if kind > TAIL:
            problem = f"has kind {kind}; expected 0..{TAIL}"
        elif node_field > self.layout.max_nodes or (kind != FREE) != (node_field != 0):
            problem = (f"names node {node_field - 1} with kind {KINDS[kind]}; the pool has "
                       f"{self.layout.max_nodes} nodes")
        elif kind == HEAD and not 1 <= run <= self.nchunks - chunk:
            problem = f"holds an extent of {run} chunks, which does not fit"
        elif kind == TAIL and not 0 <= run < chunk:
            problem = f"is a tail of chunk {run}, which is not before it"
        else:
            return Owner(node_field - 1 if node_field else None, kind, pid, epoch, run, adopted)
        raise CorruptionError(f"owner record of chunk {chunk} at offset {line} {problem}")

    def owner_fresh(self, chunk: int) -> Owner:
        """Chunk ``chunk``'s owner record, read after an invalidate (R4)."""
        self._fresh_owners(chunk, 1)
        self.region.fence()
        return self.owner(chunk)

    def _fresh_owners(self, first: int, count: int) -> None:
        """Invalidate owner records (the caller fences); bulk ranges with
        the payload instruction."""
        self.region.invalidate(self.layout.owner(first), count * OWNER_BYTES,
                               payload=count > 16)

    def _fresh_partial_lines(self, first: int, count: int) -> None:
        """Before records [first, first + count) are written: fresh copies of
        the lines they share with neighbours, which other hosts wrote under
        the lock (R2, R4; a line written whole needs none), fenced."""
        start = self.layout.owner(first)
        end = start + count * OWNER_BYTES
        partial = {line for line in (start // LINE, (end - 1) // LINE)
                   if line * LINE < start or (line + 1) * LINE > end}
        for line in sorted(partial):
            self.region.invalidate(line * LINE, LINE)
        if partial:
            self.region.fence()

    def _bitmap(self) -> np.ndarray:
        """The whole bitmap, fresh (one bulk invalidate, one fence)."""
        layout = self.layout
        self.region.invalidate(layout.bitmap, layout.bitmap_bytes, payload=True)
        self.region.fence()
        return np.frombuffer(bytearray(self.region.read(layout.bitmap, layout.bitmap_bytes)),
                             dtype=np.uint64)

    def _set_bits(self, first: int, count: int, value: bool, words: np.ndarray | None = None
                  ) -> None:
        """Set or clear bits [first, first + count) in memory (and in
        ``words``, a fresh copy of the bitmap, when given; else the words
        are read fresh here); flush the lines written (the caller fences)."""
        bitmap, end = self.layout.bitmap, first + count
        low_word, high_word = first // 64, (end - 1) // 64
        lines = range(low_word // 8, high_word // 8 + 1)
        if words is None:
            self.region.invalidate(bitmap + lines[0] * LINE, len(lines) * LINE)
            self.region.fence()
        for index in range(low_word, high_word + 1):
            low = max(first, index * 64) - index * 64
            high = min(end, index * 64 + 64) - index * 64
            mask = ((1 << (high - low)) - 1) << low
            word = self.region.load_u64(bitmap + index * 8) if words is None else int(words[index])
            word = word | mask if value else word & ~mask
            if words is not None:
                words[index] = word
            self.region.store_u64(bitmap + index * 8, word)
        for line in lines:
            self.region.flush(bitmap + line * LINE, LINE)

    # ---------------------------------------------------------- global path

    def alloc_chunks(self, count: int, kind: int = HEAD, timeout: float | None = None) -> int:
        """Take a run of ``count`` chunks; returns the first chunk."""
        if not 1 <= count <= self.nchunks:
            raise PoolFull(f"{count} chunks of {self.chunk_size} bytes requested; the pool has "
                           f"{self.nchunks}")
        owner = (self.node + 1) | self.pid << 32
        lock = self._lock()
        lock.acquire(timeout)
        try:
            faults.point("alloc.locked")
            first = -1 if self.fast is None or lock.fast is None else \
                self.fast.alloc(count, kind, owner, self.pool.epoch, lock.fast)
            if first < 0:
                first = self._find(count, lock)
                lock.check()  # fencing: still ours before anything is published (R6)
                self._publish(first, count, kind, owner)
        finally:
            lock.release()
        return first

    def _lock(self):
        """The pool's ``alloc`` lock (taken without ``with``: the global
        path is a hot path)."""
        if self._alloc_lock is None:
            self._alloc_lock = self.pool.lock("alloc")
        return self._alloc_lock

    def _find(self, count: int, lock) -> int:
        """First chunk of a free run of ``count`` from the cursor, reclaiming
        dead allocations when there is none (under ``lock``)."""
        region, layout = self.region, self.layout
        region.invalidate(layout.cursor_line, LINE)
        words = self._bitmap()
        cursor = region.load_u64(layout.cursor_line)
        if cursor >= self.nchunks:
            raise CorruptionError(f"allocator cursor at offset {layout.cursor_line} is "
                                  f"{cursor}; the pool has {self.nchunks} chunks")
        if count == 1 and not (int(words[cursor // 64]) >> (cursor % 64)) & 1:
            return cursor  # next fit: the cursor's chunk is free
        first = bitmap.first_free_run(words, self.nchunks, count, cursor)
        if first < 0 and self._reclaim_due() and self._reclaim_locked(words, lock):
            first = bitmap.first_free_run(words, self.nchunks, count, 0)
        if first < 0:
            free = bitmap.count_free(words, self.nchunks)
            raise PoolFull(f"no run of {count} free chunks ({count * self.chunk_size} "
                           f"bytes) in pool {region.path!r}: {free} of {self.nchunks} "
                           f"chunks free, none reclaimable")
        return first

    def _publish(self, first: int, count: int, kind: int, owner: int) -> None:
        """Owner records, then bits and cursor (under the lock, after the
        fencing check)."""
        region, layout = self.region, self.layout
        records = _RECORD.pack(owner | kind << 16, self.pool.epoch, count if kind == HEAD else 1,
                               0)
        records += _RECORD.pack(owner | TAIL << 16, self.pool.epoch, first, 0) * (count - 1)
        self._put_records(first, records)
        # the bits are read fresh, after a fence: it puts the records in memory first (R3)
        self._set_bits(first, count, True)
        region.store_u64(layout.cursor_line, (first + count) % self.nchunks)
        region.flush(layout.cursor_line, LINE)  # fenced by the lock's release (R3)

    def _put_records(self, first: int, records: bytes) -> None:
        """Write owner records from chunk ``first`` (under the lock, R2),
        written back; the caller fences."""
        self._fresh_partial_lines(first, len(records) // OWNER_BYTES)
        self.region.copy_in(self.layout.owner(first), records, nontemporal=False)
        self.region.flush(self.layout.owner(first), len(records))

    def free_chunks(self, first: int, timeout: float | None = None, kind: int = HEAD,
                    owner: Owner | None = None) -> int:
        """Give back the extent (or, ``kind=SLAB``, the slab chunk) starting
        at ``first``; returns its length in chunks.  ``owner``: the record
        the caller read when it was handed the extent; the free happens only
        if the chunk still holds that allocation (a dead owner's extent may
        have been reclaimed and given to another node meanwhile), else
        `ValueError`."""
        lock = self._lock()
        lock.acquire(timeout)
        try:
            faults.point("free.locked")
            count = -1 if self.fast is None or lock.fast is None or owner is not None else \
                self.fast.free(first, kind, lock.fast)
            if count < 0:
                try:
                    count = self._extent(first, kind, owner)
                except ValueError:
                    # read under a grant lost meanwhile (this node stalled past its
                    # lease, and its extent was reclaimed): `LeaseLost`, not misuse
                    lock.check()
                    raise
                lock.check()
                self._release(first, count)
        finally:
            lock.release()
        return count

    def _extent(self, first: int, kind: int, owner: Owner | None = None) -> int:
        """Chunks of the extent or slab chunk (``kind``) starting at
        ``first``, its records checked (R5; under the lock) and, when
        ``owner`` is given, still that allocation."""
        if kind not in (HEAD, SLAB):
            named = KINDS[kind] if 0 <= kind < len(KINDS) else f"kind {kind}"
            raise ValueError(f"a free of chunk {first} as {named!r}: only an extent or a slab "
                             f"chunk is freed")
        region = self.region
        head = self.owner_fresh(first)
        if head.kind != kind:
            raise ValueError(f"chunk {first} (offset {self.offset_of(first)}) does not start "
                             f"{'an extent' if kind == HEAD else 'a slab chunk'}: its owner "
                             f"record says {KINDS[head.kind]}")
        if owner is not None and head != owner:
            raise ValueError(f"chunk {first} (offset {self.offset_of(first)}) no longer holds "
                             f"the allocation {owner}: it was reclaimed and now holds {head}")
        count = head.run if kind == HEAD else 1
        if count > 1:
            self._fresh_owners(first + 1, count - 1)
            region.fence()
            tails = np.frombuffer(region.read(self.layout.owner(first + 1),
                                              (count - 1) * OWNER_BYTES), dtype=np.uint64)
            tails = tails.reshape(count - 1, OWNER_BYTES // 8)
            broken = np.flatnonzero(((tails[:, 0] >> np.uint64(16)) & np.uint64(0xFF) != TAIL)
                                    | (tails[:, 2] != first))
            if broken.size:
                chunk = first + 1 + int(broken[0])
                raise CorruptionError(f"extent at chunk {first} ({count} chunks): chunk "
                                      f"{chunk}'s owner record is {self.owner(chunk)}")
        return count

    def _release(self, first: int, count: int, words: np.ndarray | None = None) -> None:
        """Bits, then owner records (under the lock)."""
        self._set_bits(first, count, False, words)
        self.region.fence()
        self.region.fill(self.layout.owner(first), count * OWNER_BYTES, 0)
        # the caller holds the alloc lock: its release fences this flush (R3)
        self.region.flush(self.layout.owner(first), count * OWNER_BYTES)

    # -------------------------------------------------------------- reclaim

    def add_referrer(self, referrer) -> None:
        """``referrer()`` returns the (offset, size) ranges it keeps alive."""
        self._referrers.append(referrer)

    def referenced_chunks(self, ranges=None) -> np.ndarray:
        """Whether each chunk is touched by one of the referrers' ranges (or
        of ``ranges``: (offset, size) rows), as a bool per chunk."""
        spans = self._references() if ranges is None else _spans(ranges)
        relative = spans[:, 0] - self.base
        ends = relative + np.maximum(spans[:, 1], 1) - 1
        outside = np.flatnonzero((relative < 0) | (ends >= self.nchunks * self.chunk_size))
        if outside.size:  # the ValueError that names it
            offset, size = spans[outside[0]].tolist()
            self.chunk_of(offset)
            self.chunk_of(offset + max(size, 1) - 1)
        edges = np.zeros(self.nchunks + 1, np.int64)
        np.add.at(edges, relative // self.chunk_size, 1)
        np.add.at(edges, ends // self.chunk_size + 1, -1)
        return np.cumsum(edges[:-1]) > 0

    def _references(self) -> np.ndarray:
        """The referrers' (offset, size) rows."""
        return np.concatenate([_spans(referrer()) for referrer in self._referrers]
                              or [np.empty((0, 2), np.int64)])

    def _references_whole(self, timeout: float | None = None) -> np.ndarray | None:
        """The referrers' (offset, size) ranges, read under the pool's
        ``objects`` and ``index`` locks (after ``alloc``, the order fsck
        takes them too), so no record or entry is half-written as it is
        read (a torn one would refer to nothing, and its memory would look
        free to reclaim); None when a lock is not had within a lease (no
        reclaim this time)."""
        names = {name for _, name in self.pool.header.lock_names}
        held = []
        try:
            for name in ("objects", "index"):
                if name in names:
                    lock = self.pool.lock(name)
                    lock.acquire(timeout or self.pool.header.lease_timeout)
                    held.append(lock)
            return self._references()
        except LockTimeout:
            return None
        finally:
            for lock in reversed(held):
                lock.release()

    def dead_owner(self, owner: Owner, local_pids: bool) -> bool:
        """Whether ``owner`` is gone for good (R6).  ``local_pids``: the
        owner's node runs on this host, so its pids can be checked.  This
        node's own incarnation is never judged by its lease (this process
        is alive: a stall that let its heartbeat stand still must not make
        it free its own node's memory), only an extent by its process."""
        if owner.node == self.node and owner.epoch == self.pool.epoch:
            return owner.kind == HEAD and local_pids and not pid_alive(owner.pid)
        heartbeat, epoch, state = self.pool.nodes.read(owner.node)
        if state != ALIVE or epoch != owner.epoch:
            return True
        if not self.pool.space.liveness.live(owner.node):
            return True
        return owner.kind == HEAD and local_pids and not pid_alive(owner.pid)

    def _reclaim_due(self) -> bool:
        """Whether a reclaim walk may find what the last one did not: a
        node's epoch or state changed since (one left, joined or rejoined),
        or a lease passed (a node whose lease lapsed, a local process that
        died and left its extents).  The walk reads the whole pool's
        records; a full pool asks at every allocation, so it runs only then
        (and on `reclaim`)."""
        when, standing = self._walked
        return self.pool.clock.now() - when >= self.pool.header.lease_timeout \
            or self.pool.nodes.standing() != standing

    def reclaimable(self, words: np.ndarray | None = None, every: bool = True
                    ) -> list[tuple[int, int, Owner]]:
        """(first chunk, count, owner) of every allocation whose owner is dead
        and that nothing references: the owner records read in one batch,
        one verdict per distinct owner, its record checked (R5).  Not
        ``every``: none when each dead allocation is one the last walk found
        referenced (its reference goes only by a free, which frees or
        adopts it), so the references, the whole index, are read only when
        something died since."""
        self._walked = (self.pool.clock.now(), self.pool.nodes.standing())
        words = self._bitmap() if words is None else words
        local_nodes = self.pool.nodes_on_this_host()
        self._fresh_owners(0, self.nchunks)
        self.region.fence()
        records = np.frombuffer(self.region.read(self.layout.owners, self.nchunks * OWNER_BYTES),
                                dtype=np.uint64).reshape(self.nchunks, OWNER_BYTES // 8)
        taken = np.unpackbits(words.view(np.uint8), bitorder="little")[:self.nchunks]
        kinds = (records[:, 0] >> np.uint64(16)) & np.uint64(0xFF)
        chunks = np.flatnonzero(taken.astype(np.bool_) & ((kinds == HEAD) | (kinds == SLAB)))
        if not chunks.size:
            return []
        _, firsts, inverse = np.unique(records[chunks, :2], axis=0, return_index=True,
                                       return_inverse=True)
        verdicts = np.zeros(firsts.size, dtype=np.bool_)
        # A record read again that is no longer a head or a slab changed since the walk
        # read it: only a holder of the alloc lock changes one, so this holder's lease
        # lapsed and it was overtaken (R6: `lock.check` fences what it would release).
        # It is not judged (a free record names no node), and the next walk sees it.
        for row, first in enumerate(firsts.tolist()):
            owner = self.owner(int(chunks[first]))
            verdicts[row] = owner.kind in (HEAD, SLAB) and \
                self.dead_owner(owner, owner.node in local_nodes)
        dead = []
        for chunk in chunks[verdicts[inverse.reshape(-1)]].tolist():
            owner = self.owner(chunk)
            if owner.kind in (HEAD, SLAB):
                dead.append((chunk, owner.run if owner.kind == HEAD else 1, owner))
        if not dead or not every and {(chunk, owner) for chunk, _, owner in dead} \
                <= self._dead_referenced:  # the common cases under pressure: no reference scan
            return []
        ranges = self._references_whole()
        if ranges is None:
            return []
        referenced = self.referenced_chunks(ranges)
        free = [(chunk, count, owner) for chunk, count, owner in dead
                if not referenced[chunk:chunk + count].any()]
        self._dead_referenced = {(chunk, owner) for chunk, _, owner in dead} \
            - {(chunk, owner) for chunk, _, owner in free}
        return free

    def _reclaim_locked(self, words: np.ndarray, lock) -> int:
        reclaimed = self.reclaimable(words, every=False)
        if reclaimed:
            lock.check()
        for chunk, count, _ in reclaimed:
            self._release(chunk, count, words)
        return len(reclaimed)

    def reclaim(self, timeout: float | None = None) -> list[tuple[int, int, Owner]]:
        """Free every dead, unreferenced allocation; returns what was freed."""
        with self.pool.lock("alloc")(timeout) as lock:
            words = self._bitmap()
            reclaimed = self.reclaimable(words)
            lock.check()
            for chunk, count, _ in reclaimed:
                self._release(chunk, count, words)
        return reclaimed

    # --------------------------------------------------------------- fsck

    def check(self, referenced: dict[int, list[Reference]], local_nodes: set[int]
              ) -> tuple[dict[str, int], list[Finding]]:
        """Prove every chunk exactly one of free (bit clear, no owner),
        owned (bit set, a live owner) or referenced (bit set, something in
        ``referenced``, chunk -> the records pointing into it), and every
        extent whole (a head whose tails point back at it), for fsck.  The
        cursor, the bitmap and every owner record are read fresh (R4, one
        fence) and range-checked (R5): a cursor past the last chunk, bits
        set past it, owner records that are not valid, taken chunks with no
        owner (leaked), owners of free chunks and references into them are
        problems; an unreferenced allocation of a dead owner (`dead_owner`;
        ``local_nodes``: the nodes whose pids are this host's, R6) is
        reclaimable.  Returns the chunk counts by class and the findings,
        in chunk order; their repairs are the ones below."""
        region, layout, nchunks = self.region, self.layout, self.nchunks
        region.invalidate(layout.cursor_line, LINE)
        words = self._bitmap()
        self._fresh_owners(0, nchunks)
        region.fence()
        found: list[Finding] = []

        def problem(where, text, repair=None):
            found.append(Finding("allocator", where, text, repair))

        cursor = region.load_u64(layout.cursor_line)
        if cursor >= nchunks:
            problem(layout.cursor_line, f"cursor {cursor} is past the last chunk "
                    f"({nchunks - 1})", lambda: self.set_cursor(0))
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        beyond = np.flatnonzero(bits[nchunks:]) + nchunks
        if beyond.size:
            problem(layout.bitmap, f"bits set past the last chunk: {beyond[:8].tolist()}")
        counts = dict(free=0, owned=0, referenced=0, slab=0, reclaimable=0, leaked=0)
        owners = {}
        for chunk in range(nchunks):
            try:
                owners[chunk] = self.owner(chunk)
            except CorruptionError as error:
                owners[chunk] = None
                problem(layout.owner(chunk), str(error),
                        None if bits[chunk] else (lambda c=chunk: self.clear_owner(c)))
        chunk = 0
        while chunk < nchunks:
            owner, taken = owners[chunk], bool(bits[chunk])
            where = layout.owner(chunk)
            if not taken:
                if owner is not None and owner.kind != FREE:
                    problem(where, f"chunk {chunk} is free in the bitmap but its owner record "
                            f"says {KINDS[owner.kind]} of node {owner.node}",
                            lambda c=chunk: self.clear_owner(c))
                for reference in referenced.get(chunk, []):
                    found.append(Finding(reference.area, reference.offset,
                                         f"{reference.what} points into free chunk {chunk}",
                                         reference.repair))
                counts["free"] += 1
                chunk += 1
                continue
            if owner is None or owner.kind == FREE:
                if chunk in referenced:
                    problem(where, f"chunk {chunk} is taken and referenced but has no owner "
                            f"record")
                else:
                    counts["leaked"] += 1
                    problem(where, f"chunk {chunk} is taken in the bitmap with no owner "
                            f"(leaked)", lambda c=chunk: self.release_chunks(c, 1))
                chunk += 1
                continue
            if owner.kind == TAIL:
                problem(where, f"chunk {chunk} is a tail of chunk {owner.run} whose extent "
                        f"does not cover it",
                        None if chunk in referenced else
                        (lambda c=chunk: self.release_chunks(c, 1)))
                chunk += 1
                continue
            count = owner.run if owner.kind == HEAD else 1
            broken = [c for c in range(chunk + 1, chunk + count)
                      if not bits[c] or owners[c] is None or owners[c].kind != TAIL
                      or owners[c].run != chunk]
            if broken:
                problem(where, f"extent at chunk {chunk} ({count} chunks) has broken tails "
                        f"{broken[:8]}")
                chunk += 1
                continue
            is_referenced = any(c in referenced for c in range(chunk, chunk + count))
            if owner.kind == SLAB:
                counts["slab"] += count
            elif is_referenced:
                counts["referenced"] += count
            else:
                counts["owned"] += count
            if not is_referenced and self.dead_owner(owner, owner.node in local_nodes):
                counts["reclaimable"] += count
                found.append(Finding(
                    "allocator", where, f"{KINDS[owner.kind]} at chunk {chunk} ({count} "
                    f"chunks) of node {owner.node} epoch {owner.epoch} pid {owner.pid}, which "
                    f"is gone, is referenced by nothing",
                    lambda c=chunk, n=count: self.release_chunks(c, n), reclaimable=True))
            chunk += count
        counts["total"] = nchunks
        return counts, found

    def set_cursor(self, chunk: int) -> str:
        """Point the cursor at ``chunk`` (fsck --repair, under the ``alloc``
        lock): stored, flushed, fenced (R3); returns what it did."""
        line = self.layout.cursor_line
        self.region.store_u64(line, chunk)
        self.region.flush(line, 8)
        self.region.fence()
        return f"set offset {line} to {chunk}"

    def clear_owner(self, chunk: int) -> str:
        """Zero chunk ``chunk``'s owner record (fsck --repair, under the
        ``alloc`` lock, for a chunk whose bit is clear): written, flushed,
        fenced (R3); returns what it did."""
        record = self.layout.owner(chunk)
        self.region.fill(record, OWNER_BYTES, 0)
        self.region.flush(record, OWNER_BYTES)
        self.region.fence()
        return f"cleared the owner record of chunk {chunk}"

    def release_chunks(self, first: int, count: int) -> str:
        """Return chunks [first, first + count) to the pool whatever their
        records say (fsck --repair, under the ``alloc`` lock, whose release
        fences the last flush, R3): bits, then owner records; returns what
        it did."""
        self._release(first, count)
        return f"returned chunks {first}..{first + count - 1} to the pool"

    # ------------------------------------------------------------ objects

    def extent_chunks(self, size: int) -> int:
        """How many chunks an allocation of ``size`` bytes takes (0: it is a
        block of a slab)."""
        if self.heap is not None and size <= self.heap.max_size:
            return 0
        return -(-size // self.chunk_size)

    def taken_chunks(self) -> np.ndarray:
        """Which chunks are taken (one bool per chunk), read fresh without
        the lock: a hint (eviction looking for a run to free), never a
        decision to allocate."""
        bits = np.unpackbits(self._bitmap().view(np.uint8), bitorder="little")
        return bits[:self.nchunks].astype(np.bool_)

    def extents_in(self, first: int, count: int) -> list[tuple[int, int]] | None:
        """(first chunk, chunk count) of each extent that holds a chunk of
        run [first, first + count), by the owner records read fresh (R4);
        None when a chunk of it is a slab (only its node frees those), or
        when a record reads as no valid one: read without the lock, it may
        be mid-write (the caller only plans by it)."""
        extents = []
        try:
            for chunk in range(first, first + count):
                owner = self.owner_fresh(chunk)
                if owner.kind == SLAB:
                    return None
                if owner.kind == HEAD:
                    extents.append((chunk, owner.run))
                elif owner.kind == TAIL and not (extents and extents[-1][0] == owner.run):
                    extents.append((owner.run, self.owner_fresh(owner.run).run))
        except CorruptionError:
            return None
        return extents

    def alloc(self, size: int, timeout: float | None = None) -> int:
        """Pool offset of ``size`` fresh bytes (a slab block, or whole chunks)."""
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        heap = self.heap
        count = self.extent_chunks(size)
        if not count:
            offset = heap.alloc(size)
            if offset >= 0:
                return offset
            self.drain()
            offset = heap.alloc(size)
            if offset >= 0:
                return offset
            try:
                chunk = self.alloc_chunks(1, SLAB, timeout)
            except PoolFull:
                if not (self.trim(timeout) or self.reclaim_dead_blocks(timeout)):
                    raise
                offset = heap.alloc(size)  # a block a dead process held
                if offset >= 0:
                    return offset
                chunk = self.alloc_chunks(1, SLAB, timeout)
            heap.add_slab(chunk, size)
            offset = heap.alloc(size)
            if offset < 0:  # another process of this node took the whole slab
                return self.alloc(size, timeout)
            return offset
        try:
            return self.offset_of(self.alloc_chunks(count, HEAD, timeout))
        except PoolFull:
            if not (self.trim(timeout) or self.reclaim_dead_blocks(timeout)):
                raise
            return self.offset_of(self.alloc_chunks(count, HEAD, timeout))

    def alloc_many(self, size: int, count: int, timeout: float | None = None) -> list[int]:
        """Pool offsets of ``count`` allocations of ``size`` bytes (slab
        blocks taken under one hold of the node heap's mutex)."""
        if count < 0:
            raise ValueError(f"allocation count must not be negative, got {count}")
        offsets: list[int] = []
        if self.heap is not None and 0 < size <= self.heap.max_size and count > 0:
            out = np.empty(count, dtype=np.int64)
            offsets = out[:self.heap.alloc_many(size, out)].tolist()
        try:
            while len(offsets) < count:
                offsets.append(self.alloc(size, timeout))
        except BaseException:
            for offset in offsets:
                self.free(offset)
            raise
        return offsets

    def payload_owners(self, offsets: list[int]) -> list[Owner]:
        """The owner record of the chunk that holds each allocation at
        ``offsets``, read fresh (R4: all dropped, one fence): read while
        something still references the allocation, it lets `free_of` free
        it later only if it is still that allocation.  For a block of this
        node's own slab, ``pid`` is the process that holds the block (0:
        none), so that `free_of` frees it only while that process still
        holds it."""
        if not offsets:
            return []
        chunks = [self.chunk_of(offset) for offset in offsets]
        records = self.layout.owner(np.array(chunks, dtype=np.int64))
        lines = np.unique(np.concatenate([records, records + OWNER_BYTES - 1]) & ~(LINE - 1))
        self.region.invalidate_lines(lines)
        self.region.fence()
        owners = []
        for offset, chunk in zip(offsets, chunks):
            owner = self.owner(chunk)
            if owner.kind == SLAB and self.heap is not None \
                    and (owner.node, owner.epoch) == (self.node, self.pool.epoch):
                holder = self.heap.holder(offset)
                if holder != NOT_MINE:
                    owner = owner._replace(pid=holder)
            owners.append(owner)
        return owners

    def free_of(self, offset: int, owner: Owner, timeout: float | None = None,
                size: int | None = None) -> bool:
        """Free the allocation at ``offset`` if its chunk still holds what
        ``owner`` (from `payload_owners`) named; False when the pool
        reclaimed it meanwhile: its owner (an extent's process, a slab's
        node) died and the reference was dropped before this free, so the
        reclaim freed it, and it may hold another allocation now.  With
        ``size`` (the allocation's bytes), a block of a gone node's slab is
        freed here by adopting the slab (`_adopt`)."""
        chunk = self.chunk_of(offset)
        if owner.kind == HEAD and offset == self.offset_of(chunk):
            try:
                self.free_chunks(chunk, timeout, HEAD, owner)
            except ValueError:
                if self.owner_fresh(chunk) == owner:
                    raise  # still that allocation: the refusal was another matter
                return False
            return True
        if owner.kind == SLAB and (owner.node, owner.epoch) != (self.node, self.pool.epoch):
            return self._free_foreign(offset, chunk, owner, size, timeout)
        if owner.kind not in (HEAD, SLAB):
            return False  # named a chunk no allocation held: nothing of its to free
        if owner.kind == SLAB and self.heap is not None:
            # this node's own slab: a killed process's block is given back by
            # `reclaim_dead_blocks` once nothing references it, which may come
            # first (and the block be given out again): free it only while the
            # process that held it at `payload_owners` still does
            if owner.pid == 0:
                return False
            found = self.heap.free(offset, owner.pid)
            if found != NOT_MINE:
                return found != NOT_HELD
        self.free(offset, timeout)
        return True

    def _free_foreign(self, offset: int, chunk: int, owner: Owner, size: int | None,
                      timeout: float | None) -> bool:
        """`free_of` of a block of another node's slab, or of a past
        incarnation's of this node (``owner``, read while the block was
        referenced): to that node's free ring while it lives; a gone node's
        slab is adopted by this node (`_adopt`), so that the block is memory
        this node can allocate now; a slab adopted since ``owner`` was read
        is followed to its adopter.  False when nothing is to free: the
        slab was reclaimed whole, or cannot be adopted (no heap here, no
        ``size``), and returns with its chunk once nothing references it."""
        current = self.owner_fresh(chunk)
        if current != owner:
            if current.kind != SLAB or current.adopted != adoption_tag(owner):
                return False  # reclaimed whole: its memory may be another's now
            owner = current  # the block is held (ADOPTED) in its adopter's heap
            if (owner.node, owner.epoch) == (self.node, self.pool.epoch):
                return self.heap is not None and self.heap.free(offset, ADOPTED) >= 0
        if not self.dead_owner(owner, False) and self._free_remote(owner, offset):
            return True  # tagged with its epoch: a next incarnation drops it
        if self.heap is None or size is None or size > self.heap.max_size \
                or not self._adopt(chunk, owner, offset, size, timeout):
            return False
        return self.heap.free(offset, ADOPTED) >= 0

    def _adopt(self, chunk: int, owner: Owner, offset: int, size: int,
               timeout: float | None) -> bool:
        """Take ``chunk``, a slab of ``owner`` (a node, or an incarnation of
        this one, that is gone: its claim is void, R6), as a slab of this
        node, every block held (`ADOPTED`) until the reference to it is
        dropped and the block freed here; ``offset`` (a block of ``size``
        bytes) must start a block of it (R5).  Under the ``alloc`` lock,
        its grant checked: the heap lists the slab before the record names
        this node (a free routed here finds it), and the record keeps the
        gone owner's tag (`adoption_tag`), so that a free that read the
        old record follows it here.  False when the record changed
        meanwhile (adopted or reclaimed by another node)."""
        _, block = self.heap.size_class(size)
        if (offset - self.offset_of(chunk)) % block:
            raise CorruptionError(f"a {size}-byte block at offset {offset} does not start a "
                                  f"{block}-byte block of the slab at chunk {chunk}")
        lock = self._lock()
        lock.acquire(timeout)
        try:
            if self.owner_fresh(chunk) != owner:
                return False
            self.heap.add_slab(chunk, size, ADOPTED)
            try:
                lock.check()  # fencing: still ours before the record names this node (R6)
                self._put_records(chunk, _RECORD.pack(  # fenced by the lock's release (R3)
                    (self.node + 1) | SLAB << 16 | self.pid << 32, self.pool.epoch, 1,
                    adoption_tag(owner)))
            except BaseException:
                self.heap.forget_slab(chunk)
                raise
        finally:
            lock.release()
        return True

    def free(self, offset: int, timeout: float | None = None) -> None:
        """Give back what `alloc` returned, from any node."""
        chunk = self.chunk_of(offset)
        if self.heap is not None and self.heap.free(offset) != NOT_MINE:
            return
        if self.fast is not None and offset == self.base + chunk * self.chunk_size \
                and self.fast.fresh_kind(chunk) == HEAD:
            self.free_chunks(chunk, timeout)  # the common case; checked under the lock
            return
        owner = self.owner_fresh(chunk)
        if owner.kind == SLAB:
            if owner.node == self.node and owner.epoch == self.pool.epoch:
                raise ValueError(f"offset {offset} is in chunk {chunk}, a slab of this node, "
                                 f"but not a block its heap has given out")
            if owner.node == self.node or self.dead_owner(owner, False):
                return  # a slab of an incarnation that is gone: it returns with its chunks
            self._free_remote(owner, offset)
            return
        if owner.kind != HEAD or self.offset_of(chunk) != offset:
            raise ValueError(f"offset {offset} (chunk {chunk}, {KINDS[owner.kind]}) is not the "
                             f"start of an allocation")
        self.free_chunks(chunk, timeout)

    def forget_lost_slabs(self) -> list[int]:
        """Forget the slabs this node's heap lists whose chunk the pool no
        longer gives to this node's incarnation (reclaimed while the node
        was judged gone, R6), so that no block is ever carved from another
        owner's memory; returns their chunks.  A heap lists a slab only
        after the pool's records name it (`alloc`), and forgets it before
        they are cleared (`trim`), so a listed slab the records disown was
        reclaimed."""
        if self.heap is None:
            return []
        lost = []
        for chunk, _, _ in self.heap.slabs():
            owner = self.owner_fresh(chunk)
            if (owner.kind, owner.node, owner.epoch) != (SLAB, self.node, self.pool.epoch):
                self.heap.forget_slab(chunk)
                lost.append(chunk)
        return lost

    def reclaim_dead_blocks(self, timeout: float | None = None, adopted: bool = False) -> int:
        """Free the blocks of this node's slabs whose process is gone and
        that nothing referenced at two looks a lease apart, then trim;
        returns how many blocks were freed.  A block that a live process
        unlinked to free after a lock's release (an evictor's deferred
        free) is freed by it right after, far within a lease (a stall past
        its lease is what R6's self-fencing stops), and a free here takes
        only a block its dead process still holds.  Looks at most every
        quarter lease: this is the allocation slow path.  ``adopted``: the
        blocks of adopted slabs instead (`ADOPTED`), which a free of their
        reference gives back one by one; those that no reference named
        when their slab was adopted (free in the gone node's heap, or
        queued to it) come back here, off the allocation path (the
        heartbeat's, every few leases), ``timeout`` bounding each lock."""
        if self.heap is None or adopted and not self.heap.adopted_blocks:  # a counter
            return 0
        now, lease = self.pool.clock.now(), self.pool.header.lease_timeout
        looked, seen = self._dead_seen.get(adopted, (float("-inf"), {}))
        if now - looked < lease / 4:
            return 0
        standing = None if adopted else self._block_standing()
        if standing is not None and not seen and standing == self._blocks_walked:
            return 0  # the heap's walk (its every block) finds nothing new: not run
        blocks = [block for _, _, used in self.heap.slabs() for block in used
                  if block[1] != self.heap.pid and (block[1] == ADOPTED) == adopted]
        alive = {pid: pid_alive(pid) for pid in {pid for _, pid in blocks}}
        dead = [block for block in blocks if not alive[block[1]]]
        if dead:
            ranges = self._references_whole(timeout)
            if ranges is None:
                return 0
            referenced = set(ranges[:, 0].tolist())
            dead = [block for block in dead if block[0] not in referenced]
        seen = {block: seen.get(block, now) for block in dead}
        ripe = [block for block, first in seen.items() if now - first >= lease]
        for block in ripe:
            del seen[block]
        self._dead_seen[adopted] = (now, seen)
        if not adopted:
            self._blocks_walked = standing if not seen else None
        if not ripe:
            return 0
        freed = self.heap.release_blocks(ripe)
        self.trim(timeout)
        return freed

    def _block_standing(self) -> tuple | None:
        """What a new block held by a dead process of this node and
        referenced by nothing comes with: each process of the node and
        whether it lives (one died holding blocks it had not published, or
        as an evictor between a reference's drop and its free), and the
        live nodes (another node's evictor died between the drop and its
        free-ring push).  A block whose process died and whose reference an
        eviction drops later is freed by that eviction.  None without the
        node's process list (each walk then runs)."""
        if self.members is None:
            return None
        return (tuple((pid, pid_alive(pid)) for pid in self.members()),
                tuple(self.pool.space.liveness.live_nodes()))

    def trim(self, timeout: float | None = None) -> int:
        """Give this node's empty slabs back to the pool; returns how many."""
        if self.heap is None or not self.heap.empty_slabs:  # the common case: a counter
            return 0
        trimmed = 0
        for chunk in self.heap.empty_chunks():
            if self.heap.drop_slab(chunk):
                self.free_chunks(chunk, timeout, SLAB)
                trimmed += 1
        return trimmed

    def _free_remote(self, owner: Owner, offset: int) -> bool:
        """Queue the free of ``offset`` on ``owner``'s node's ring; False when
        that node is gone before its ring has room (its slab is a gone
        owner's: adopted, or reclaimed with its chunk)."""
        ring = FreeRing(self.region, self.layout, self.node, owner.node)
        backoff = self.pool.space.backoff()
        start, lease = self.pool.clock.now(), self.pool.header.lease_timeout
        while True:
            try:  # the turn is taken per try: a wait holding it could stall the node's drains
                with self.rings.taken(lease):
                    if ring.push(offset, owner.epoch):
                        return True
            except TimeoutError:
                pass
            if self.dead_owner(owner, False):
                return False
            if self.pool.clock.now() - start > 4 * lease:
                raise PoolFull(f"free of offset {offset}: node {owner.node}'s free ring from "
                               f"node {self.node} stayed full for {4 * lease} s")
            backoff.wait()

    def drain(self, timeout: float | None = 0) -> int:
        """Free the blocks other nodes queued for this node's slabs; 0 when
        another process of the node is at it and stays so ``timeout``
        seconds (0: is at it now).  An entry that is no block of them (R5: a
        double free, a bad offset) is set aside in ``rejected`` with the
        reason, never freed and never raised: the heartbeat thread drains
        too, and must keep beating."""
        if self.heap is None:
            return 0
        taken = []
        try:
            with self.rings.taken(timeout):  # the blocks are freed after the turn
                for sender in FreeRing.pending(self.region, self.layout, self.node):
                    ring = FreeRing(self.region, self.layout, sender, self.node)
                    try:
                        taken.append((sender, ring.drain(self.pool.epoch)))
                    except CorruptionError as error:
                        self.rejected.append(str(error))
        except TimeoutError:
            return 0
        drained = 0
        for sender, offsets in taken:
            for offset in offsets:
                try:
                    if self.heap.free(offset) == NOT_MINE:
                        raise ValueError(f"offset {offset} is in no slab of node {self.node}")
                except ValueError as error:
                    self.rejected.append(f"free ring {sender}->{self.node}: {error}")
                    continue
                drained += 1
        return drained


def _spans(ranges) -> np.ndarray:
    """(offset, size) pairs as int64 rows."""
    return np.asarray(ranges, dtype=np.int64).reshape(-1, 2)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists."""
    if pid <= 0 or pid > 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
