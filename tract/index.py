"""The rack-wide prefix index: block hash -> KV payload (DESIGN.md §3).

A fixed table of ``capacity`` (a power of two) one-line entries at the
header's ``index`` offset, probed linearly from ``key_low % capacity``; the
entry format and the probing decisions are `tract._kernels.probe`'s (key,
version, state, writer (node, epoch), payload offset and length, tokens,
payload checksum, check word).  Per node, one u64 per entry at
``index_nodes + node * node_bytes``: a u32 pin count (low half) and a u32
access stamp (high half), written only by that node's processes (atomics
among them: one host is coherent).

Protocols (every step batched: one fence per batch of lines):

- **Reserve** (`reserve`): payloads are allocated first, outside the lock
  (allocation pressure evicts); then under the ``index`` lock each key's
  probe window is invalidated, fenced and read, each key gets its existing
  entry (nothing to do) or the first reusable slot (empty, tombstone, torn,
  or WRITING by a writer whose lease lapsed, R6), the lock's epoch is
  checked, and the WRITING entries are written and flushed (the release
  fences them).
- **Publish** (`publish`): the caller has copied and flushed the payloads;
  the lock's acquire fences those flushes (R3).  Under the lock the entries
  are read fresh, and those still WRITING
  by this node at the reserved version become READY (version + 1) and are
  flushed.  One that was reclaimed meanwhile is reported, its payload freed.
- **Lookup** (`lookup`, `pin`): no lock.  Windows of entries are
  invalidated, fenced and read (R4), growing until each key is found or an
  empty entry ends its chain.  `pin` then adds one to this node's pin word
  of each hit (and stamps it), flushes, fences, and only then drops and
  reads the entries again: only entries still READY at the version first
  read are hits (R3 then R4: pin, then re-check).  `unpin` takes the pins
  back.
- **Evict** (`evict`, and on allocation pressure; `remove` for named
  keys): under the lock, the stalest (or the named) unpinned READY
  entries of a window of slots are marked EVICTING
  (version + 1), flushed and fenced; only then is every live node's pin
  word dropped and read: an entry nobody pins becomes a tombstone and its payload is freed
  after the release, a pinned one goes back to READY.  Pin-then-recheck on
  the reader's side and mark-then-check-pins on the evictor's cannot both
  pass, provided each side drops the lines it checks only after its own
  write is in memory (a line dropped earlier may be refilled by a prefetch
  before the other side's write lands).  Pins of a node whose lease lapsed
  are ignored (R6); a node's new incarnation starts with its pins cleared
  (`forget_node`).
- **Demotion** (a cluster tier's write-back): after an eviction for room
  (not a `remove`) releases the lock, and before it frees the payloads,
  each of `demoters` is handed the entries it took (as they were before
  they became tombstones).  A payload stays allocated until that free, so
  a demoter reads it fresh (R4) and whole; if its owner died meanwhile, the
  bytes may be another allocation's, which the block's checksum catches.
  A demoter that fails does not stop the frees.

Rules relied on (DESIGN.md): R2 — entries are written only under the lock,
pin words only by their node; R3, R4 as above; R5 — entries carry a check
word (a torn one is not a hit), payload offsets and lengths are
range-checked; R6 — the lock's fencing epoch, writers' and pins' leases.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from tract._kernels import indexfast, probe
from tract._kernels.probe import EMPTY as EMPTY_STATE
from tract._kernels.probe import (CONTINUE, EVICTING, FREE, HIT, READY, TOKENS_MAX, TOMBSTONE,
                                  UNKNOWN, WRITING)
from tract.errors import CorruptionError, PoolFull
from tract.lines import LINE
from tract._native._region import INSTRUCTIONS, Region
from tract import _failpoints as faults

__all__ = ["Hit", "Hits", "Index", "Reservation", "Reservations", "STAMP_HZ"]

log = logging.getLogger(__name__)

ENTRY_BYTES = 64
STAMP_HZ = 4  # access stamps: quarter seconds of wall time since 2020
_STAMP_EPOCH = 1_577_836_800
_PIN_MAX = 0xFFFFFFFF
EVICT_RUN = 16  # eviction samples runs of this many slots


@dataclasses.dataclass(frozen=True)
class Hit:
    """A pinned READY entry: its payload may be read until `Index.unpin`."""

    key: tuple[int, int]
    slot: int
    version: int
    offset: int
    length: int
    tokens: int
    checksum: int


class Hits:
    """Pinned READY entries (`Index.pin`), in key order, as arrays; ``hits[i]``
    is a `Hit`.  Their payloads may be read until `Index.unpin`.  ``epoch``:
    the pinning node's incarnation (its pins go with it, `Pool.renew`; None:
    the current one)."""

    __slots__ = ("entries", "epoch", "slots")

    def __init__(self, slots: np.ndarray, entries: np.ndarray, epoch: int | None = None):
        self.slots, self.entries, self.epoch = slots, entries, epoch

    def __len__(self) -> int:
        return self.slots.size

    def __getitem__(self, row: int) -> Hit:
        entry = self.entries[row]
        return Hit((int(entry[0]), int(entry[1])), int(self.slots[row]), int(entry[2]),
                   int(entry[4]), int(entry[5]), int(entry[3] >> np.uint64(40)),
                   int(entry[6] >> np.uint64(32)))

    def __iter__(self):
        return (self[row] for row in range(len(self)))

    @property
    def keys(self) -> np.ndarray:
        """Block keys, (n, 2) uint64 (low, high)."""
        return self.entries[:, :2]

    @property
    def offsets(self) -> np.ndarray:
        return self.entries[:, 4].astype(np.int64)

    @property
    def lengths(self) -> np.ndarray:
        return self.entries[:, 5].astype(np.int64)

    @property
    def checksums(self) -> np.ndarray:
        """Payload checksums (uint64; word 6's high half)."""
        return self.entries[:, 6] >> np.uint64(32)


@dataclasses.dataclass(frozen=True)
class Reservation:
    """A WRITING entry and its payload: copy the payload to ``offset``, then
    `Index.publish` (or `Index.abort`)."""

    key: tuple[int, int]
    slot: int
    version: int
    offset: int
    length: int
    tokens: int


class Reservations:
    """The outcome of `Index.reserve`, one row per key: ``taken[row]`` when
    the key got a WRITING entry (else it was present or being written);
    ``reservations[row]`` is its `Reservation` or None.  Copy each taken
    row's payload to its offset, then `Index.publish` (or `Index.abort`)."""

    __slots__ = ("entries", "slots", "taken")

    def __init__(self, taken: np.ndarray, slots: np.ndarray, entries: np.ndarray):
        self.taken, self.slots, self.entries = taken, slots, entries

    def __len__(self) -> int:
        return self.taken.size

    def __getitem__(self, row):
        if isinstance(row, slice):
            return Reservations(self.taken[row], self.slots[row], self.entries[row])
        if not self.taken[row]:
            return None
        entry = self.entries[row]
        return Reservation((int(entry[0]), int(entry[1])), int(self.slots[row]), int(entry[2]),
                           int(entry[4]), int(entry[5]), int(entry[3] >> np.uint64(40)))

    def __iter__(self):
        return (self[row] for row in range(len(self)))

    @property
    def offsets(self) -> np.ndarray:
        """Payload offsets (0 where not taken)."""
        return self.entries[:, 4].astype(np.int64)


class _IndexFull(Exception):
    def __init__(self, message: str, missing: int):
        super().__init__(message)
        self.missing = missing


def _keys(keys) -> np.ndarray:
    keys = np.asarray(keys)
    if keys.ndim != 2 or keys.shape[1] != 2 or keys.dtype != np.uint64:
        raise ValueError(f"keys must be an (n, 2) uint64 array of block hashes, got shape "
                         f"{keys.shape} dtype {keys.dtype}")
    return np.ascontiguousarray(keys)


class Index:
    """One node's view of a pool's prefix index (`pool.index`)."""

    def __init__(self, pool, fast: bool = True):
        header = pool.header
        self.pool = pool
        self.region = pool.region
        self.base = header.index
        self.capacity = header.index_capacity
        self.mask = self.capacity - 1
        self.node_bytes = header.index_node_bytes
        self.node_base = header.index_nodes
        self.max_nodes = header.max_nodes
        self.heap = (header.heap, header.heap_end)
        clock = pool.clock
        self.stamp = lambda: max(0, int((clock.wall() - _STAMP_EPOCH) * STAMP_HZ)) & _PIN_MAX
        # eviction samples runs of slots at random (holes stay spread out)
        self._sample = np.random.default_rng([int.from_bytes(header.hash_key[:8], "little"),
                                              pool.node or 0])
        self._live: tuple[float, np.ndarray] | None = None
        #: callables given the (n, 8) entries an eviction for room took, before
        #: their payloads are freed; each returns which it took (a bool array),
        #: and the next is given the rest (see Demotion above)
        self.demoters: list = []
        #: callables told of every eviction (for room or named) as
        #: ``watcher(phase, keys)``, ``keys`` an (n, 2) uint64 array: phase
        #: ``"evicting"`` under the lock before the chosen entries are marked,
        #: ``"evicted"`` once those evicted are tombstones in memory (a
        #: process that dies between the two may have evicted any of the
        #: first); `tract.testing.history` records them
        self.watchers: list = []
        # on a real mapping, the batch steps run as one kernel call each
        # (`tract._kernels.indexfast`); on the simulator, as Python steps
        self._fast = fast and isinstance(self.region, Region)
        if self._fast:
            control = self.region.cache_control
            self._read_insn = INSTRUCTIONS[control.payload]
            self._flush_insn = INSTRUCTIONS[control.flush]
            if (self.base + self.capacity * ENTRY_BYTES > self.region.size
                    or self.node_bytes < self.capacity * 8
                    or self.node_base + self.max_nodes * self.node_bytes > self.region.size):
                raise CorruptionError(f"prefix index areas at {self.base} and {self.node_base}"
                                      f" do not fit the {self.region.size}-byte mapping")

    # ------------------------------------------------------------ layout

    def _entries(self, slots: np.ndarray) -> np.ndarray:
        return self.base + slots.astype(np.int64) * ENTRY_BYTES

    def entry_offset(self, slot: int) -> int:
        """Where entry ``slot`` lies in the pool."""
        return self.base + slot * ENTRY_BYTES

    def forget_node(self, node: int) -> None:
        """Zero ``node``'s pin words and access stamps as its new
        incarnation joins (the last one's processes are gone, and their
        pins with them): written, flushed and fenced (R3) before the node
        takes part; only ``node`` writes them (R2)."""
        pins = self.node_base + node * self.node_bytes
        self.region.fill(pins, self.node_bytes, 0)
        self.region.flush(pins, self.node_bytes)
        self.region.fence()

    def _own_pins(self) -> int:
        """Where this node's pin words begin."""
        return self.node_base + self.pool.node * self.node_bytes

    def _pin_words(self, slots: np.ndarray, node: int | None = None) -> np.ndarray:
        node = self.pool.node if node is None else node
        return self.node_base + node * self.node_bytes + slots.astype(np.int64) * 8

    def _read(self, offsets: np.ndarray) -> np.ndarray:
        """The lines at ``offsets``, fresh (R4): (n, 8) uint64.  Dropped with
        the payload instruction (clflushopt where the CPU has it): these are
        reads, ordered by the fence that follows; every write-back of an
        entry or a pin word uses the metadata flush."""
        self.region.invalidate_lines(offsets, payload=True)
        self.region.fence()
        lines = np.empty((offsets.size, LINE), dtype=np.uint8)
        self.region.gather_lines(offsets, lines)
        return lines.view(np.uint64)

    @staticmethod
    def _set_state(entries: np.ndarray, state: int) -> None:
        entries[:, 3] = (entries[:, 3] & ~np.uint64(0xFF)) | np.uint64(state)

    @staticmethod
    def _tombstone(entries: np.ndarray) -> None:
        """Tombstones in place: the version and the slot's reach kept, key
        and payload gone."""
        entries[:, [0, 1, 4, 5, 6]] = 0
        entries[:, 3] = (entries[:, 3] & probe.REACH_BITS) | np.uint64(TOMBSTONE)

    @staticmethod
    def _set_reach(entries: np.ndarray, reaches) -> None:
        probe.with_reaches(entries, np.ascontiguousarray(reaches, dtype=np.int64))

    @staticmethod
    def _reach(entries: np.ndarray) -> np.ndarray:
        out = np.empty(entries.shape[0], dtype=np.int64)
        probe.reach(entries, out)
        return out

    @staticmethod
    def _whole(entries: np.ndarray) -> np.ndarray:
        ok = np.empty(entries.shape[0], dtype=np.bool_)
        probe.whole(entries, ok)
        return ok

    def _write(self, slots: np.ndarray, entries: np.ndarray) -> None:
        """Sealed entries to their slots, flushed (the caller fences: R3)."""
        if self._fast:
            indexfast.write(self.region.base, self.base, self.mask, self._flush_insn, slots,
                            entries)
            return
        probe.seal(entries)
        offsets = self._entries(slots)
        self.region.scatter_lines(offsets, entries.view(np.uint8))
        self.region.flush_lines(offsets)

    # ------------------------------------------------------------ lookup

    def _probe(self, keys: np.ndarray, leading: bool):
        """(codes, slots, entries) of each key's lookup.  Windows grow
        2, 8, 32... lines, each round reading only the keys still probing.
        ``leading``: only the keys before the first miss matter."""
        if self._fast:
            return self._probe_fast(keys, leading)[:3]
        count = keys.shape[0]
        codes = np.full(count, CONTINUE, dtype=np.int64)
        slots = np.full(count, -1, dtype=np.int64)
        entries = np.zeros((count, 8), dtype=np.uint64)
        start = (keys[:, 0] & np.uint64(self.mask)).astype(np.int64)
        reaches = np.empty(count, dtype=np.int64)
        pending, left, scanned, width = np.arange(count), count, 0, 2
        while left:
            if scanned >= self.capacity:  # a table of tombstones: nothing more to find
                codes[pending[:left]] = probe.MISS
                break
            width = min(width, self.capacity - scanned)
            window = (start[pending[:left], None] + (scanned + np.arange(width))) & self.mask
            lines = self._read(self._entries(window.ravel())).reshape(left, width, 8)
            left = probe.collect(keys, pending, left, lines, scanned, start, self.mask, leading,
                                 reaches, codes, slots, entries)
            scanned += width
            width *= 4
        return codes, slots, entries

    def _probe_fast(self, keys: np.ndarray, leading: bool):
        """`_probe` in one kernel call (which sets every output), and how
        many keys lead with HIT."""
        count = keys.shape[0]
        codes, slots = np.empty(count, np.int64), np.empty(count, np.int64)
        entries = np.empty((count, 8), np.uint64)
        hits = indexfast.lookup(self.region.base, self.base, self.mask, self.capacity,
                                self._read_insn, keys, leading, codes, slots, entries)
        return codes, slots, entries, hits

    @staticmethod
    def _leading(codes: np.ndarray) -> int:
        misses = np.flatnonzero(codes != HIT)
        return int(misses[0]) if misses.size else codes.size

    def lookup(self, keys) -> int:
        """How many of ``keys`` (a chain, in order) are READY from the first on."""
        keys = _keys(keys)
        if self._fast:
            return self._probe_fast(keys, True)[3]
        codes, _, _ = self._probe(keys, leading=True)
        return self._leading(codes)

    def present(self, keys) -> np.ndarray:
        """Whether each of ``keys`` (not a chain: each on its own) is READY."""
        return self._probe(_keys(keys), leading=False)[0] == HIT

    def pin(self, keys) -> Hits:
        """Pin the leading READY entries of ``keys``: their payloads stay
        until `unpin`.  `LeaseLost` when this node's own lease lapsed
        (its pins may be ignored already: R6)."""
        keys = _keys(keys)
        self.pool.self_fence("a pin")
        if self._fast:
            slots = np.empty(keys.shape[0], dtype=np.int64)
            entries = np.empty((keys.shape[0], 8), dtype=np.uint64)
            valid = indexfast.pin(self.region.base, self.base, self.mask, self.capacity,
                                  self._own_pins(), self._read_insn, self._flush_insn, keys,
                                  self.stamp(), slots, entries)
            if valid < 0:
                self._full(self._pin_words(slots[-1 - valid:-valid]))
            slots, entries = slots[:valid], entries[:valid]
        else:
            slots, entries = self._pin(keys)
        hits = Hits(slots, entries, self.pool.epoch)
        if len(hits):
            self.pool.stats.add(pins=len(hits))
        low, high = self.heap
        bad = probe.outside(entries, low, high)
        if bad >= 0:
            self.unpin(hits)
            slot, offset, length = int(slots[bad]), int(entries[bad, 4]), int(entries[bad, 5])
            raise CorruptionError(f"index entry {slot} at offset {self.entry_offset(slot)}"
                                  f" names payload [{offset}, {offset + length}) outside the "
                                  f"heap [{low}, {high})")
        return hits

    def _pin(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`pin`'s steps up to the payload check: (slots, entries) of the
        leading hits, pinned and validated."""
        codes, slots, entries = self._probe(keys, leading=True)
        count = self._leading(codes)
        slots, entries = slots[:count], entries[:count]
        if not count:
            return slots, entries
        words = self._pin_words(slots)
        found = self.region.local_add_u32s(words, 1)
        if (found == _PIN_MAX).any():
            self._unpin_words(words[found != _PIN_MAX])
            self._full(words[found == _PIN_MAX])
        self.region.store_u32s(words + 4, self.stamp())
        self.region.flush_lines(words & ~(LINE - 1))
        # the pins are in memory before the entries are dropped and read
        # again: an entry dropped earlier could be refilled (a prefetch)
        # before the pins land, and read stale
        self.region.fence()
        fresh = self._read(self._entries(slots))
        ok = np.empty(count, dtype=np.bool_)
        probe.validate(entries, fresh, ok)
        valid = self._leading(np.where(ok, HIT, probe.MISS))
        if valid < count:
            self._unpin_words(words[valid:])
        return slots[:valid], entries[:valid]

    def _full(self, words: np.ndarray):
        raise CorruptionError(f"index pin word at offset {int(words[0])} of node "
                              f"{self.pool.node} is full")

    def unpin(self, hits: Hits | list[Hit]) -> None:
        """Take back the pins of `pin` (all of them, or some `Hit` of them).
        Pins of an incarnation this node has left (`Pool.renew`) went with
        it: nothing to take back."""
        if isinstance(hits, Hits) and hits.epoch not in (None, self.pool.epoch):
            return
        slots = hits.slots if isinstance(hits, Hits) else \
            np.array([hit.slot for hit in hits], dtype=np.int64)
        if not slots.size:
            return
        if self._fast:
            first = indexfast.unpin(self.region.base, self._own_pins(), self.mask,
                                    self._flush_insn, slots)
        else:
            first = self._unpin_words(self._pin_words(slots))
        if first >= 0:
            raise ValueError(f"unpin of index slot {int(slots[first])} that node "
                             f"{self.pool.node} had not pinned")

    def _unpin_words(self, words: np.ndarray) -> int:
        """One off each pin word, written back; the first row whose word was
        not pinned (it stays at 0), or -1."""
        found = self.region.local_add_u32s(words, -1)
        # no fence: the write-backs land on their own, and an unpin seen late
        # only delays an eviction
        self.region.flush_lines(words & ~(LINE - 1))
        unpinned = np.flatnonzero(found == 0)
        return int(unpinned[0]) if unpinned.size else -1

    def _stamp_words(self, slots: np.ndarray, now: int) -> None:
        """This node's access stamps of ``slots`` set to ``now``, written
        back (the caller fences)."""
        if self._fast:
            indexfast.stamp(self.region.base, self._own_pins(), self.mask, self._flush_insn,
                            slots, now)
            return
        words = self._pin_words(slots)
        self.region.store_u32s(words + 4, now)
        self.region.flush_lines(words & ~(LINE - 1))

    # ------------------------------------------------------------ writes

    def _live_epochs(self) -> np.ndarray:
        """Each node's epoch (low 32 bits) when it is live, else all ones;
        judged again after a quarter lease (a lapsed lease only makes a
        writer's reservation reclaimable, which its publish reports)."""
        now = self.pool.clock.now()
        if self._live is None or now - self._live[0] > self.pool.header.lease_timeout / 4:
            epochs = np.full(self.max_nodes, np.uint64(2**64 - 1), dtype=np.uint64)
            for node in range(self.max_nodes):
                _, epoch, _ = self.pool.nodes.read(node)
                if self.pool.space.liveness.live(node):
                    epochs[node] = epoch & 0xFFFFFFFF
            self._live = (now, epochs)
        return self._live[1]

    def _make_room(self, count: int, timeout: float | None) -> int:
        """Evict up to ``count`` entries for a reserve that lacks room,
        sampling a window 4 times wider each time one holds nothing to
        evict, up to the whole table; returns how many (0: nothing in the
        table can be evicted)."""
        window = 64
        while True:
            evicted = self.evict(count, window=window, timeout=timeout)
            if evicted or window >= self.capacity:
                return evicted
            window *= 4

    def alloc(self, size: int, timeout: float | None = None) -> int:
        """`Pool.alloc`, evicting to make room when the pool is full: a
        whole run of chunks for a multi-chunk extent (`_make_run`), else
        the stalest entries sampled (`PoolFull` only when nothing in the
        index can be evicted)."""
        run = self.pool.allocator.extent_chunks(size)
        for _ in range(8):
            try:
                return self.pool.alloc(size, timeout)
            except PoolFull:
                if not (run > 1 and self._make_run(run, timeout)) \
                        and not self._make_room(8, timeout):
                    raise
        return self.pool.alloc(size, timeout)

    def reserve(self, keys, sizes, tokens=0, timeout: float | None = None) -> Reservations:
        """WRITING entries and payloads of ``sizes`` bytes for ``keys``
        (none where the key is already present or being written)."""
        keys = _keys(keys)
        count = keys.shape[0]
        if isinstance(sizes, int) and isinstance(tokens, int):  # one size and count for all
            if sizes <= 0 or not 0 <= tokens <= TOKENS_MAX:
                raise ValueError(f"sizes must be positive and tokens in 0..{TOKENS_MAX}")
            each, uniform = [sizes] * count, sizes
            sizes, tokens = np.full(count, sizes, np.int64), np.full(count, tokens, np.int64)
        else:
            sizes = np.broadcast_to(np.asarray(sizes, dtype=np.int64), (count,))
            tokens = np.broadcast_to(np.asarray(tokens, dtype=np.int64), (count,))
            if (sizes <= 0).any() or (tokens < 0).any() or (tokens > TOKENS_MAX).any():
                raise ValueError(f"sizes must be positive and tokens in 0..{TOKENS_MAX}")
            each, uniform = sizes.tolist(), None
        payloads = []
        try:
            if uniform is not None:
                try:
                    payloads = self.pool.alloc_many(uniform, count, timeout)
                except PoolFull:  # make room below, one at a time
                    pass
            for size in each[len(payloads):]:
                payloads.append(self.alloc(size, timeout))
        except BaseException:
            for offset in payloads:
                self.pool.free(offset)
            raise
        payloads = np.array(payloads, dtype=np.uint64)
        for attempt in range(4):
            try:
                reserved = self._reserve_locked(keys, payloads, sizes, tokens, timeout)
                break
            except _IndexFull as full:  # make room: evict, then try again
                if attempt == 3 or not self._make_room(full.missing, timeout):
                    for offset in payloads.tolist():
                        self.pool.free(offset)
                    raise PoolFull(str(full)) from None
        if not reserved.taken.all():
            for offset in payloads[~reserved.taken].tolist():
                self.pool.free(offset)
        return reserved

    def _reserve_locked(self, keys, payloads, sizes, tokens, timeout) -> Reservations:
        with self.pool.lock("index")(timeout) as lock:
            codes, slots, targets, homes = self._reserve_slots(keys)
            lock.check()  # fencing: still ours before anything is published (R6)
            rows, written = self._reserve_entries(keys, codes, slots, targets, homes, payloads,
                                                  sizes, tokens)
        entries = np.zeros((keys.shape[0], 8), dtype=np.uint64)
        entries[rows] = written
        return Reservations(codes == FREE, slots, entries)

    def _reserve_entries(self, keys, codes, slots, targets, homes, payloads, sizes, tokens):
        """Under the lock, its grant checked: the WRITING entries of the
        keys whose code is FREE, written back (the caller fences), each
        with its slot's reach carried over and raised where its home is
        among the slots; homes elsewhere whose reach falls short are raised
        first (`_raise_reaches`).  Returns (rows, written): which keys, and
        their entries."""
        count = keys.shape[0]
        rows, written = np.empty(count, np.int64), np.empty((count, 8), dtype=np.uint64)
        word3 = np.uint64(WRITING | (self.pool.node + 1) << 8)
        epoch = np.uint64(self.pool.epoch & 0xFFFFFFFF)
        if self._fast:
            taken = indexfast.reserve_entries(self.region.base, self.base, self.mask,
                                              self._flush_insn, keys, codes, slots, targets,
                                              homes, payloads, sizes, tokens, word3, epoch,
                                              rows, written)
            return rows[:taken], written[:taken]
        reaches = np.empty(count, np.int64)
        taken = probe.reserved_entries(keys, codes, targets, payloads, sizes, tokens, word3,
                                       epoch, rows, written, reaches)
        rows, written, reaches = rows[:taken], written[:taken], reaches[:taken]
        # reaches: the slots' own, carried over (raised here where a home is among them)
        self._raise_reaches(keys[rows], slots[rows], homes[rows], reaches)
        probe.with_reaches(written, reaches)
        self._write(slots[rows], written)
        return rows, written

    def _raise_reaches(self, keys, slots, homes, reaches) -> None:
        """Before entries are written at ``slots``, each key's home slot
        (its line ``homes``) reaches them: homes among ``slots`` get it in
        ``reaches`` (of the entries to write); the others are written now
        and fenced, so that no entry is ever in memory past its home's
        reach."""
        raised_slots = np.empty(slots.size, dtype=np.int64)
        raised = np.empty((slots.size, 8), dtype=np.uint64)
        count = probe.raise_reaches(keys, slots, homes, self.mask, reaches, raised_slots, raised)
        if count:
            self._write(raised_slots[:count], raised[:count])
            self.region.fence()

    def _reserve_slots(self, keys: np.ndarray):
        """Under the lock: (codes, slots, slot lines, home lines) of each
        key (FREE: the slot to take; EXISTS: present).  Each key's window grows
        until it decides, reading only the lines not read yet (nobody else
        writes under the lock): 2 lines, then up to its home's reach, then
        twice as wide (`probe.next_widths`); the kernel sees each key's window
        up to its width."""
        count = keys.shape[0]
        live = self._live_epochs()
        codes = np.full(count, CONTINUE, np.int64)
        if self._fast:
            slots = np.empty(count, np.int64)
            targets, homes = (np.empty((count, 8), np.uint64) for _ in range(2))
            left = indexfast.reserve_slots(self.region.base, self.base, self.mask,
                                           self.capacity, self._read_insn, keys, live, codes,
                                           slots, targets, homes)
            if left:
                raise _IndexFull(f"prefix index of {self.capacity} entries is full: no free "
                                 f"slot for {left} of {count} keys", left)
            return codes, slots, targets, homes
        start = (keys[:, 0] & np.uint64(self.mask)).astype(np.int64)
        widths = np.zeros(count, dtype=np.int64)
        wants = np.full(count, min(2, self.capacity), dtype=np.int64)
        lines = np.empty((count, min(self.capacity, 32), 8), dtype=np.uint64)
        where = np.empty(count, np.int64)
        pending, widest = np.arange(count), min(2, self.capacity)
        grown = np.zeros(count, np.bool_)  # whose windows grew since the last probe
        while True:
            if widest > lines.shape[1]:
                wider = np.empty((count, widest, 8), dtype=np.uint64)
                wider[:, :lines.shape[1]] = lines
                lines = wider
            room = int((wants[pending] - widths[pending]).sum())
            offsets, rows, positions = (np.empty(room, np.int64) for _ in range(3))
            new = probe.grow_windows(pending, widths, wants, start, self.mask, self.base,
                                     offsets, rows, positions)
            probe.place(lines, self._read(offsets[:new]), rows, positions, new)
            grown[pending] = True
            probe.probe_reserve(keys, lines, start, self.mask, widths, live, grown, codes, where)
            grown[:] = False
            pending = np.flatnonzero(codes == CONTINUE)
            if not pending.size:
                break
            if (widths[pending] >= self.capacity).all():
                raise _IndexFull(f"prefix index of {self.capacity} entries is full: no free "
                                 f"slot for {pending.size} of {count} keys", pending.size)
            widest = probe.next_widths(lines, widths, pending, pending.size, self.capacity,
                                       wants)
        return codes, (start + where) & self.mask, lines[np.arange(count), where], lines[:, 0]

    def publish(self, reserved: Reservations, checksums=None,
                timeout: float | None = None) -> list[bool]:
        """Make reserved entries READY once their payloads are copied (and
        flushed: non-temporal copies are); False for one reclaimed meanwhile
        (its payload is freed) and for rows not taken.  ``checksums``: the
        payloads' (u32, one per row), kept in the entries for readers."""
        taken = np.flatnonzero(reserved.taken)
        published = np.zeros(len(reserved), dtype=np.bool_)
        if not taken.size:
            return published.tolist()
        sums = np.zeros(taken.size, dtype=np.uint64) if checksums is None else \
            np.asarray(checksums, dtype=np.uint64)[taken] & np.uint64(0xFFFFFFFF)
        # a fresh block counts as just used (this node's stamp words)
        self._stamp_words(reserved.slots[taken], self.stamp())
        ours = self._finish(reserved, taken, READY, sums, timeout)
        if not ours.all():
            for offset in reserved.offsets[taken[~ours]].tolist():
                self.pool.free(offset)
        published[taken] = ours
        return published.tolist()

    def abort(self, reserved: Reservations, timeout: float | None = None) -> None:
        """Give up reserved entries (tombstones) and their payloads."""
        taken = np.flatnonzero(reserved.taken)
        if taken.size:
            ours = self._finish(reserved, taken, TOMBSTONE, None, timeout)
            for offset in reserved.offsets[taken[ours]].tolist():
                self.pool.free(offset)

    def _finish(self, reserved: Reservations, taken: np.ndarray, state: int, checksums,
                timeout) -> np.ndarray:
        """Under the lock: the ``taken`` rows' entries still as reserved
        (WRITING by this node at their version) become ``state``; returns
        which did."""
        slots, expected = reserved.slots[taken], reserved.entries[taken]
        sums = np.zeros(taken.size, np.uint64) if checksums is None else checksums
        ours = np.empty(taken.size, dtype=np.bool_)
        done = np.empty((taken.size, 8), dtype=np.uint64)
        # the lock's acquire fences: the caller's payload flushes complete first (R3)
        with self.pool.lock("index")(timeout) as lock:
            count = self._finished(slots, expected, state, sums, ours, done)
            faults.point("publish.locked")
            lock.check()  # the last check before the write (R6): nothing may come between
            self._write(slots[ours], done[:count])
        return ours

    def _finished(self, slots, expected, state, checksums, ours, done) -> int:
        """Under the lock: the entries of ``slots`` read fresh (R4); those
        still as reserved (``expected``, but for the slot's reach, which
        other keys' reserves raise) are ``ours``, moved on to ``state`` in
        ``done`` (`probe.finished`).  Returns how many."""
        if self._fast:
            return indexfast.finish_entries(self.region.base, self.base, self.mask,
                                            self._read_insn, slots, expected, state, checksums,
                                            ours, done)
        entries = self._read(self._entries(slots))
        return probe.finished(entries, expected, state, checksums, ours, done)

    # ---------------------------------------------------------- eviction

    def evict(self, count: int = 1, window: int = 64, timeout: float | None = None) -> int:
        """Evict up to ``count`` of the stalest unpinned READY entries among
        ``window`` slots, in runs of `EVICT_RUN` at random (sampled LRU: the
        holes left stay spread over the table); returns how many.  The
        runs' reaches are then lowered to the entries left
        (`_lower_reaches`), so chains stay short."""
        run = min(EVICT_RUN, self.capacity)
        runs = self._sample.choice(self.capacity // run, size=max(1, min(window, self.capacity)
                                                                 // run), replace=False)

        def stalest(slots, entries, candidates, stamps):
            # ties (stamps are quarter seconds) broken at random, not by
            # position: holes spread over the runs, not whole runs emptied
            ties = self._sample.random(candidates.size)
            return candidates[np.lexsort((ties, stamps))[:count]]
        return len(self._evict(runs, stalest, timeout, demote=True))

    def remove(self, keys, timeout: float | None = None) -> np.ndarray:
        """Evict the READY entries of ``keys`` that no live node pins (an
        engine's explicit delete); returns which keys were removed.  A
        pinned entry stays: a reader may be copying it."""
        keys = _keys(keys)
        removed = np.zeros(keys.shape[0], dtype=np.bool_)
        codes, found, _ = self._probe(keys, leading=False)
        hit = codes == HIT
        if not hit.any():
            return removed
        gone = set(self._evict_named(found[hit], keys[hit], timeout))
        removed[hit] = [slot in gone for slot in found[hit].tolist()]
        return removed

    def _evict_named(self, slots: np.ndarray, keys: np.ndarray, timeout: float | None,
                     demote: bool = False) -> list[int]:
        """Evict the entries at ``slots`` that still hold ``keys`` and that
        no live node pins (for room: ``demote``); returns the slots evicted."""
        run = min(EVICT_RUN, self.capacity)
        wanted = {int(slot): (int(key[0]), int(key[1])) for slot, key in zip(slots.tolist(), keys)}

        def named(slots, entries, candidates, stamps):
            return np.array([i for i in candidates.tolist()
                             if wanted.get(int(slots[i])) == (int(entries[i, 0]),
                                                              int(entries[i, 1]))],
                            dtype=np.int64)
        return self._evict(np.unique(slots // run), named, timeout, demote)

    def _make_run(self, count: int, timeout: float | None) -> int:
        """Evict the entries whose payloads fill a run of ``count`` chunks,
        for an extent that finds no free run in a fragmented heap (sampled
        eviction frees chunks scattered over it); returns how many were
        evicted (0: no run holds only free chunks and unpinned READY
        extents).  Of the runs that would do, the one whose newest access
        stamp is oldest is freed, the one with the most free chunks on a
        tie.  The table and the bitmap are read without a lock, as a plan:
        the run's owner records are checked against it, the eviction
        re-checks each entry under the ``index`` lock, and the allocation
        that follows decides under its own."""
        allocator = self.pool.allocator
        nchunks = allocator.nchunks
        if count > nchunks:
            return 0
        slots, entries = self._ready_extents()
        live = self.pool.space.liveness.live_nodes()
        pins, stamps = self._pins(slots, live)
        slots, entries, stamps = slots[pins == 0], entries[pins == 0], stamps[pins == 0]
        offsets = entries[:, 4].astype(np.int64)
        firsts = (offsets - allocator.base) // allocator.chunk_size
        spans = (offsets + entries[:, 5].astype(np.int64) - 1 - allocator.base) \
            // allocator.chunk_size - firsts + 1
        # per chunk: -1 free, the stamp of the entry whose extent holds it, or
        # `blocked` (slabs, pinned or unfinished entries, other objects)
        blocked = np.int64(2**62)
        cost = np.where(allocator.taken_chunks(), blocked, np.int64(-1))
        holder = np.full(nchunks, -1, dtype=np.int64)
        rows = np.repeat(np.arange(slots.size), spans)
        held = np.repeat(firsts - np.cumsum(spans) + spans, spans) + np.arange(rows.size)
        cost[held], holder[held] = stamps[rows], rows
        starts = nchunks - count + 1
        for _ in range(4):  # a run whose records disagree with the plan: the next one
            newest = np.max([cost[i:i + starts] for i in range(count)], axis=0)
            taken = np.sum([holder[i:i + starts] >= 0 for i in range(count)], axis=0)
            best = int(np.lexsort((taken, newest))[0])
            if newest[best] >= blocked:
                return 0
            chosen = np.unique(holder[best:best + count][holder[best:best + count] >= 0])
            planned = set(zip(firsts[chosen].tolist(), spans[chosen].tolist()))
            extents = allocator.extents_in(best, count)
            if extents is not None and set(extents) <= planned:
                return len(self._evict_named(slots[chosen], entries[chosen, :2], timeout,
                                             demote=True))
            cost[best:best + count] = blocked
        return 0

    def _ready_extents(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots, entries) of every whole READY entry whose payload is an
        extent of the heap (whole chunks: more than half a chunk, starting
        at a chunk), fresh."""
        allocator = self.pool.allocator
        low, high = self.heap
        found_slots, found = [np.zeros(0, np.int64)], [np.zeros((0, LINE // 8), np.uint64)]
        for slots, entries in self._table():
            offsets, lengths = entries[:, 4].astype(np.int64), entries[:, 5].astype(np.int64)
            keep = (self._whole(entries) & ((entries[:, 3] & np.uint64(0xFF)) == READY)
                    & (offsets >= low) & (lengths > allocator.chunk_size // 2)
                    & (lengths <= high - offsets)
                    & ((offsets - allocator.base) % allocator.chunk_size == 0))
            found_slots.append(slots[keep])
            found.append(entries[keep].copy())
        return np.concatenate(found_slots), np.concatenate(found)

    def _evict(self, runs: np.ndarray, choose, timeout: float | None,
               demote: bool = False) -> list[int]:
        """Evict, among the runs of `EVICT_RUN` slots numbered ``runs``,
        the unpinned READY entries ``choose(slots, entries, candidates,
        stamps)`` picks (indices into the window, from ``candidates``),
        handing them to the `demoters` when ``demote``; returns the slots
        evicted."""
        run = min(EVICT_RUN, self.capacity)
        slots = (runs[:, None] * run + np.arange(run)).ravel()
        freed, sizes, owners, evicted_slots = [], [], [], []
        victims = np.zeros((0, 8), np.uint64)
        with self.pool.lock("index")(timeout) as lock:
            entries = self._read(self._entries(slots)).copy()
            low, high = self.heap
            offsets, lengths = entries[:, 4].astype(np.int64), entries[:, 5].astype(np.int64)
            # an entry naming a payload outside the heap is fsck's to clear (R5)
            ready = (self._whole(entries) & ((entries[:, 3] & np.uint64(0xFF)) == READY)
                     & (offsets >= low) & (lengths > 0) & (lengths <= high - offsets))
            if ready.any():
                live = self.pool.space.liveness.live_nodes()
                pins, stamps = self._pins(slots[ready], live)
                chosen = choose(slots, entries, np.flatnonzero(ready)[pins == 0],
                                stamps[pins == 0])
            else:
                chosen = np.zeros(0, dtype=np.int64)
            if chosen.size:
                lock.check()
                marked = entries[chosen]
                for watcher in self.watchers:
                    watcher("evicting", marked[:, :2])
                marked[:, 2] += np.uint64(1)
                self._set_state(marked, EVICTING)
                self._write(slots[chosen], marked)
                self.region.fence()  # EVICTING is in memory before the pins are dropped and read
                faults.point("evict.marked")
                pins, _ = self._pins(slots[chosen], live)
                marked[:, 2] += np.uint64(1)
                evicted = pins == 0
                freed = marked[evicted, 4].astype(np.int64).tolist()
                sizes = marked[evicted, 5].astype(np.int64).tolist()
                # each payload's owner record, read while its entry still names it: if
                # the owner (an extent's process, a slab's node) dies, the allocator may
                # reclaim it once the entry is a tombstone, before the free below, and
                # give it to another allocation
                owners = self.pool.allocator.payload_owners(freed)
                evicted_slots = slots[chosen[evicted]].tolist()
                gone, kept = marked[evicted], marked[~evicted]
                victims = gone.copy()  # keys and payloads, before they become tombstones
                self._tombstone(gone)
                self._set_state(kept, READY)
                marked[evicted], marked[~evicted] = gone, kept
                probe.seal(marked)  # whole, as the reaches below read them
                entries[chosen] = marked
                lock.check()
                self._write(slots[chosen], entries[chosen])
                for watcher in self.watchers:
                    watcher("evicted", victims[:, :2])
            self._lower_reaches(slots, entries, run, lock)
        try:
            if demote and victims.shape[0]:
                self._demote(victims)
        finally:
            for offset, size, owner in zip(freed, sizes, owners):  # tombstones in memory
                self.pool.allocator.free_of(offset, owner, size=size)
        if freed:
            self.pool.stats.add(evictions=len(freed))
        return evicted_slots

    def _demote(self, entries: np.ndarray) -> None:
        """Hand evicted ``entries`` to each demoter in turn, the ones the
        earlier demoters did not take; a demoter that raises is logged and
        skipped."""
        left = entries
        for demoter in list(self.demoters):
            if not left.shape[0]:
                return
            try:
                taken = np.asarray(demoter(left), dtype=np.bool_)
            except Exception:  # noqa: BLE001 - a demotion is best effort: the frees go on
                log.exception("a demotion of %d evicted blocks failed", left.shape[0])
                continue
            left = left[~taken]

    def _lower_reaches(self, slots: np.ndarray, entries: np.ndarray, run: int, lock) -> None:
        """Lower the reach of each slot of the windows of ``run`` slots
        (``entries``, as just written) to the farthest entry still homed
        there, reading in one batch the lines after each window that its
        reaches cover.  The entries are in memory first (the epoch check
        fences), so no entry is ever past its home's reach."""
        reaches = self._reach(entries)
        known = reaches.reshape(-1, run) != UNKNOWN  # a reach may wrap past its window
        covered = np.where(known, np.arange(run) + reaches.reshape(-1, run), -1).max(axis=1) + 1
        extras = np.maximum(covered - run, 0)
        total = int(extras.sum())
        tails = np.zeros((0, 8), dtype=np.uint64)
        if total:
            after = np.arange(total) - np.repeat(np.cumsum(extras) - extras, extras)
            tails = self._read(self._entries((np.repeat(slots[::run] + run, extras) + after)
                                             & self.mask))
        lowered = np.empty(slots.size, dtype=np.int64)
        probe.window_reaches(entries, tails, extras, run, self.mask, slots, lowered)
        changed = np.flatnonzero(lowered < reaches)
        if changed.size:
            rows = entries[changed]
            self._set_reach(rows, lowered[changed])
            # check() reads the grant fresh, so it fences: the tombstones
            # are in memory before the lowered reaches are written
            lock.check()
            self._write(slots[changed], rows)

    def _pins(self, slots: np.ndarray, nodes: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(total pins, newest stamp) of each slot over ``nodes``, fresh."""
        if not nodes:
            return np.zeros(slots.size, np.int64), np.zeros(slots.size, np.int64)
        words = np.concatenate([self._pin_words(slots, node) for node in nodes])
        line_offsets, row = np.unique(words & ~(LINE - 1), return_inverse=True)
        values = self._read(line_offsets)[row, (words % LINE) // 8].reshape(len(nodes),
                                                                             slots.size)
        pins = (values & np.uint64(0xFFFFFFFF)).astype(np.int64).sum(axis=0)
        stamps = (values >> np.uint64(32)).astype(np.int64).max(axis=0)
        return pins, stamps

    def pins_held(self, node: int) -> int:
        """How many pins node ``node`` holds now, over every slot, read
        fresh (R4): 0 once every load of the node has unpinned."""
        if not 0 <= node < self.pool.header.max_nodes:
            raise ValueError(f"node {node} is beyond this pool's max_nodes "
                             f"({self.pool.header.max_nodes})")
        pins, _ = self._pins(np.arange(self.capacity), [node])
        return int(pins.sum())

    # ------------------------------------------------------------- scans

    def _table(self, batch: int = 4096):
        """(slots, entries) of the whole table, ``batch`` slots at a time,
        fresh (R4)."""
        for first in range(0, self.capacity, batch):
            slots = np.arange(first, min(first + batch, self.capacity))
            yield slots, self._read(self._entries(slots))

    def scan(self) -> list[tuple[int, str, tuple[int, int] | None, str | None]]:
        """(slot, state name, payload (offset, length) or None, problem) of
        every non-empty entry, for fsck and the allocator's reclaim; a torn
        entry, or one whose payload is outside the heap, is reported (R5)."""
        names = {WRITING: "writing", READY: "ready", EVICTING: "evicting",
                 TOMBSTONE: "tombstone"}
        low, high = self.heap
        found = []
        for slots, entries in self._table():
            for slot, entry, sealed in zip(slots.tolist(), entries, self._whole(entries)):
                where = f"index entry {slot} at offset {self.entry_offset(slot)}"
                state = int(entry[3]) & 0xFF
                offset, length = int(entry[4]), int(entry[5])
                if not entry.any():
                    continue
                if not sealed:
                    found.append((slot, "bad", None, f"{where} is torn (check word)"))
                elif state == EMPTY_STATE:
                    continue  # a trimmed tombstone
                elif state not in names:
                    found.append((slot, "bad", None, f"{where} has state {state}"))
                elif state == TOMBSTONE:
                    found.append((slot, "tombstone", None, None))
                elif not (low <= offset and 0 < length <= high - offset):
                    found.append((slot, "bad", None, f"{where} names payload [{offset}, "
                                  f"{offset + length}) outside the heap [{low}, {high})"))
                else:
                    found.append((slot, names[state], (offset, length), None))
        return found

    def short_reaches(self) -> list[tuple[int, int, int]]:
        """(home slot, its reach, the farthest whole live entry homed there)
        for every slot whose known reach falls short of one of its entries,
        for fsck (a lookup would miss that entry, a reserve duplicate it)."""
        farthest = np.zeros(self.capacity, dtype=np.int64)
        reaches = np.empty(self.capacity, dtype=np.int64)
        for slots, entries in self._table():
            reaches[slots] = self._reach(entries)
            state = entries[:, 3] & np.uint64(0xFF)
            live = self._whole(entries) & (state >= WRITING) & (state <= EVICTING)
            home = (entries[live, 0] & np.uint64(self.mask)).astype(np.int64)
            np.maximum.at(farthest, home, (slots[live] - home) & self.mask)
        short = np.flatnonzero((reaches != UNKNOWN) & (farthest > reaches))
        return [(int(h), int(reaches[h]), int(farthest[h])) for h in short]

    def raise_reach(self, slot: int, reach: int) -> None:
        """Raise ``slot``'s reach to at least ``reach`` (fsck --repair,
        under the ``index`` lock)."""
        entry = self._read(self._entries(np.array([slot]))).copy()
        self._set_reach(entry, np.maximum(self._reach(entry), reach))
        self._write(np.array([slot]), entry)  # the lock's release fences it

    def referenced(self) -> np.ndarray:
        """(offset, length) rows of every payload an entry keeps (WRITING,
        READY, EVICTING), for the allocator's reclaim: the entries `scan`
        names a payload for (whole, live, inside the heap: R5), read in
        batches and judged as arrays, at memory speed."""
        low, high = self.heap
        found = []
        for _, entries in self._table():
            state = entries[:, 3] & np.uint64(0xFF)
            offset, length = entries[:, 4], entries[:, 5]
            keep = self._whole(entries) & ((state == WRITING) | (state == READY)
                                           | (state == EVICTING))
            # as `scan`: low <= offset and 0 < length <= high - offset (an offset
            # past the heap's end wraps the unsigned difference: it is refused first)
            keep &= (offset >= low) & (offset <= high) & (length > 0) \
                & (length <= np.uint64(high) - offset)
            found.append(entries[keep][:, 4:6])
        return np.concatenate(found).astype(np.int64) if found else np.empty((0, 2), np.int64)

    def clear(self, slot: int) -> None:
        """Make ``slot`` a tombstone whatever it held (fsck --repair, under
        the ``index`` lock); its payload is left to the allocator's reclaim."""
        entry = self._read(self._entries(np.array([slot]))).copy()
        reach = self._reach(entry)
        entry[:, 2] += np.uint64(1)
        self._tombstone(entry)
        if reach[0] == UNKNOWN:  # a torn line: measure the slot's reach again
            reach[0] = self._measure_reach(slot)
        self._set_reach(entry, reach)
        self._write(np.array([slot]), entry)  # the lock's release fences it

    def _measure_reach(self, slot: int) -> int:
        """The farthest whole live entry homed at ``slot``, probing from it
        to an empty slot (UNKNOWN past a torn line)."""
        farthest, read = 0, 1
        while read < self.capacity:
            step = min(256, self.capacity - read)
            lines = self._read(self._entries((slot + read + np.arange(step)) & self.mask))
            empty, whole = np.empty(step, dtype=np.bool_), self._whole(lines)
            probe.empty(lines, empty)
            end = int(np.argmax(empty)) if empty.any() else step
            if not whole[:end].all():
                return UNKNOWN
            state = lines[:end, 3] & np.uint64(0xFF)
            homed = np.flatnonzero(((lines[:end, 0] & np.uint64(self.mask)) == slot)
                                   & (state >= WRITING) & (state <= EVICTING))
            if homed.size:
                farthest = read + int(homed[-1])
            if end < step:
                break
            read += step
        return min(farthest, UNKNOWN)

    def stats(self) -> dict[str, int]:
        """Entries by state (`scan`'s; "torn": torn or corrupt)."""
        counts = dict.fromkeys(["empty", "writing", "ready", "evicting", "tombstone", "torn"], 0)
        found = self.scan()
        for _, state, _, _ in found:
            counts["torn" if state == "bad" else state] += 1
        counts["empty"] = self.capacity - len(found)
        return counts
