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
  of each hit (and stamps it), flushes, fences, and reads the entries again:
  only entries still READY at the version first read are hits (R3 then R4:
  pin, then re-check).  `unpin` takes the pins back.
- **Evict** (`evict`, and on allocation pressure): under the lock, the
  stalest unpinned READY entries of a window of slots are marked EVICTING
  (version + 1), flushed and fenced; then every live node's pin word is read
  fresh: an entry nobody pins becomes a tombstone and its payload is freed
  after the release, a pinned one goes back to READY.  Pin-then-recheck on
  the reader's side and mark-then-check-pins on the evictor's cannot both
  pass.  Pins of a node whose lease lapsed are ignored (R6); a node's new
  incarnation starts with its pins cleared.

Rules relied on (DESIGN.md): R2 — entries are written only under the lock,
pin words only by their node; R3, R4 as above; R5 — entries carry a check
word (a torn one is not a hit), payload offsets and lengths are
range-checked; R6 — the lock's fencing epoch, writers' and pins' leases.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from tract._kernels import probe
from tract._kernels.probe import (BUSY, CONTINUE, EVICTING, FREE, HIT, READY, TOMBSTONE,
                                  WRITING)
from tract.errors import CorruptionError, PoolFull
from tract.lease import LINE

__all__ = ["Hit", "Index", "Reservation", "STAMP_HZ"]

ENTRY_BYTES = 64
STAMP_HZ = 4  # access stamps: quarter seconds of wall time since 2020
_STAMP_EPOCH = 1_577_836_800
_PIN_MAX = 0xFFFFFFFF


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

    def __init__(self, pool):
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
        self.stamp = lambda: max(0, int((time.time() - _STAMP_EPOCH) * STAMP_HZ)) & _PIN_MAX
        self._hand = int.from_bytes(header.hash_key[:4], "little") & self.mask
        self._live: tuple[float, np.ndarray] | None = None

    # ------------------------------------------------------------ layout

    def _entries(self, slots: np.ndarray) -> np.ndarray:
        return self.base + slots.astype(np.int64) * ENTRY_BYTES

    def _pin_words(self, slots: np.ndarray, node: int | None = None) -> np.ndarray:
        node = self.pool.node if node is None else node
        return self.node_base + node * self.node_bytes + slots.astype(np.int64) * 8

    def _read(self, offsets: np.ndarray) -> np.ndarray:
        """The lines at ``offsets``, fresh (R4): (n, 8) uint64."""
        self.region.invalidate_lines(offsets)
        self.region.fence()
        lines = np.empty((offsets.size, LINE), dtype=np.uint8)
        self.region.gather_lines(offsets, lines)
        return lines.view(np.uint64)

    @staticmethod
    def _whole(entries: np.ndarray) -> np.ndarray:
        ok = np.empty(entries.shape[0], dtype=np.bool_)
        probe.whole(entries, ok)
        return ok

    def _write(self, slots: np.ndarray, entries: np.ndarray) -> None:
        """Sealed entries to their slots, flushed (the caller fences: R3)."""
        probe.seal(entries)
        offsets = self._entries(slots)
        self.region.scatter_lines(offsets, entries.view(np.uint8))
        self.region.flush_lines(offsets)

    def pin_area(self) -> tuple[int, int]:
        """(offset, length) of this node's pin words."""
        return self.node_base + self.pool.node * self.node_bytes, self.node_bytes

    # ------------------------------------------------------------ lookup

    def _probe(self, keys: np.ndarray, leading: bool):
        """(codes, slots, entries) of each key's lookup.  ``leading``: only
        the keys before the first miss matter."""
        count = keys.shape[0]
        codes = np.full(count, CONTINUE, dtype=np.int64)
        slots = np.full(count, -1, dtype=np.int64)
        entries = np.zeros((count, 8), dtype=np.uint64)
        start = (keys[:, 0] & np.uint64(self.mask)).astype(np.int64)
        pending, width, scanned = np.arange(count), 1, 0
        while pending.size:
            if scanned >= self.capacity:  # a table of tombstones: nothing more to find
                codes[pending] = probe.MISS
                break
            window = (start[pending, None] + scanned + np.arange(width)) & self.mask
            lines = self._read(self._entries(window.ravel())).reshape(pending.size, width, 8)
            found, where = np.empty(pending.size, np.int64), np.empty(pending.size, np.int64)
            probe.probe_lookup(keys[pending], lines, found, where)
            done = found != CONTINUE
            rows = pending[done]
            codes[rows] = found[done]
            hit = done & (found != probe.MISS)
            slots[pending[hit]] = window[hit, where[hit]]
            entries[pending[hit]] = lines[hit, where[hit]]
            pending = pending[~done]
            if leading:
                stop = np.flatnonzero((codes != CONTINUE) & (codes != HIT))
                if stop.size:
                    pending = pending[pending < stop[0]]
            scanned += width
            width = min(width * 2, self.capacity - scanned) if scanned < self.capacity else 1
        return codes, slots, entries

    @staticmethod
    def _leading(codes: np.ndarray) -> int:
        misses = np.flatnonzero(codes != HIT)
        return int(misses[0]) if misses.size else codes.size

    def lookup(self, keys) -> int:
        """How many of ``keys`` (a chain, in order) are READY from the first on."""
        keys = _keys(keys)
        codes, _, _ = self._probe(keys, leading=True)
        return self._leading(codes)

    def pin(self, keys) -> list[Hit]:
        """Pin the leading READY entries of ``keys``: their payloads stay
        until `unpin`.  Returns one `Hit` per pinned entry, in order."""
        keys = _keys(keys)
        codes, slots, entries = self._probe(keys, leading=True)
        count = self._leading(codes)
        if not count:
            return []
        slots, entries = slots[:count], entries[:count]
        words = self._pin_words(slots)
        found = self.region.local_add_u32s(words, 1)
        if (found == _PIN_MAX).any():
            raise CorruptionError(f"index pin word at offset {int(words[found == _PIN_MAX][0])} "
                                  f"of node {self.pool.node} is full")
        self.region.store_u32s(words + 4, self.stamp())
        self.region.flush_lines(words & ~(LINE - 1))
        # one fence for both: the pins are in memory before the entries are read again
        fresh = self._read(self._entries(slots))
        ok = np.empty(count, dtype=np.bool_)
        probe.validate(keys[:count], entries[:, 2].copy(), fresh, ok)
        valid = self._leading(np.where(ok, HIT, probe.MISS))
        if valid < count:
            self._unpin_words(words[valid:])
        return [self._hit(int(slots[row]), entries[row]) for row in range(valid)]

    def _hit(self, slot: int, entry: np.ndarray) -> Hit:
        offset, length = int(entry[4]), int(entry[5])
        low, high = self.heap
        if not (low <= offset and 0 < length <= high - offset):
            raise CorruptionError(f"index entry {slot} at offset {self.base + slot * ENTRY_BYTES}"
                                  f" names payload [{offset}, {offset + length}) outside the "
                                  f"heap [{low}, {high})")
        return Hit((int(entry[0]), int(entry[1])), slot, int(entry[2]), offset, length,
                   int(entry[3] >> np.uint64(32)), int(entry[6] >> np.uint64(32)))

    def unpin(self, hits: list[Hit]) -> None:
        """Take back the pins of `pin`."""
        if hits:
            self._unpin_words(self._pin_words(np.array([hit.slot for hit in hits])))

    def _unpin_words(self, words: np.ndarray) -> None:
        found = self.region.local_add_u32s(words, -1)
        # no fence: the write-backs land on their own, and an unpin seen late
        # only delays an eviction
        self.region.flush_lines(words & ~(LINE - 1))
        if (found == 0).any():
            raise ValueError(f"unpin of index slot {int((words[found == 0][0] - words[0]) // 8)}"
                             f" that node {self.pool.node} had not pinned")

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

    def _alloc(self, size: int, timeout: float | None) -> int:
        for _ in range(8):
            try:
                return self.pool.alloc(size, timeout)
            except PoolFull:
                if not self.evict(8, timeout=timeout):
                    raise
        return self.pool.alloc(size, timeout)

    def reserve(self, keys, sizes, tokens=0, timeout: float | None = None
                ) -> list[Reservation | None]:
        """WRITING entries and payloads of ``sizes`` bytes for ``keys``
        (None where the key is already present or being written)."""
        keys = _keys(keys)
        sizes = np.broadcast_to(np.asarray(sizes, dtype=np.int64), keys.shape[:1])
        tokens = np.broadcast_to(np.asarray(tokens, dtype=np.int64), keys.shape[:1])
        if (sizes <= 0).any() or (tokens < 0).any() or (tokens > _PIN_MAX).any():
            raise ValueError("sizes must be positive and tokens in 0..2**32-1")
        codes, _, _ = self._probe(keys, leading=False)
        wanted = np.flatnonzero((codes != HIT) & (codes != BUSY))
        payloads = []
        try:
            for row in wanted:
                payloads.append(self._alloc(int(sizes[row]), timeout))
        except BaseException:
            for offset in payloads:
                self.pool.free(offset)
            raise
        for attempt in range(4):
            try:
                result, unused = self._reserve_locked(keys, wanted, payloads, sizes, tokens,
                                                      timeout)
                break
            except _IndexFull as full:  # make room: evict, then try again
                if attempt == 3 or not self.evict(full.missing, timeout=timeout):
                    for offset in payloads:
                        self.pool.free(offset)
                    raise PoolFull(str(full)) from None
        for offset in unused:
            self.pool.free(offset)
        return result

    def _reserve_locked(self, keys, wanted, payloads, sizes, tokens, timeout):
        result: list[Reservation | None] = [None] * keys.shape[0]
        with self.pool.lock("index")(timeout) as lock:
            slots, versions, codes = self._reserve_slots(keys[wanted])
            lock.check()  # fencing: still ours before anything is published (R6)
            free = np.flatnonzero(codes == FREE)
            entries = np.zeros((free.size, 8), dtype=np.uint64)
            node_word = np.uint64(WRITING | (self.pool.node + 1) << 8)
            for out, row in enumerate(free):
                source = wanted[row]
                entries[out, :2] = keys[source]
                entries[out, 2] = versions[row] + np.uint64(1)
                entries[out, 3] = node_word | np.uint64(int(tokens[source]) << 32)
                entries[out, 4], entries[out, 5] = payloads[row], sizes[source]
                entries[out, 6] = self.pool.epoch & 0xFFFFFFFF
                result[source] = Reservation((int(keys[source, 0]), int(keys[source, 1])),
                                             int(slots[row]), int(versions[row]) + 1,
                                             payloads[row], int(sizes[source]),
                                             int(tokens[source]))
            self._write(slots[free], entries)
        return result, [payloads[row] for row in np.flatnonzero(codes != FREE)]

    def _reserve_slots(self, keys: np.ndarray):
        """Under the lock: (slots, versions, codes) of each key (FREE: the
        slot to take; EXISTS: present)."""
        count = keys.shape[0]
        start = (keys[:, 0] & np.uint64(self.mask)).astype(np.int64)
        live = self._live_epochs()
        width = 4
        while True:
            width = min(width, self.capacity)
            window = (start[:, None] + np.arange(width)) & self.mask
            lines = self._read(self._entries(window.ravel())).reshape(count, width, 8)
            codes, where = np.empty(count, np.int64), np.empty(count, np.int64)
            probe.probe_reserve(keys, lines, window, live, width == self.capacity, codes, where)
            if not (codes == CONTINUE).any():
                break
            if width == self.capacity:
                missing = int((codes == CONTINUE).sum())
                raise _IndexFull(f"prefix index of {self.capacity} entries is full: no free "
                                 f"slot for {missing} of {count} keys", missing)
            width *= 2
        rows = np.arange(count)
        slots = window[rows, where]
        versions = lines[rows, where, 2]
        return slots, versions, codes

    def publish(self, reservations: list[Reservation | None], checksums=None,
                timeout: float | None = None) -> list[bool]:
        """Make reserved entries READY once their payloads are copied; False
        for one reclaimed meanwhile (its payload is freed)."""
        mine = [r for r in reservations if r is not None]
        if checksums is None:
            checksums = [0] * len(reservations)
        if mine:  # a fresh block counts as just used (this node's stamp words)
            words = self._pin_words(np.array([r.slot for r in mine]))
            self.region.store_u32s(words + 4, self.stamp())
            self.region.flush_lines(words & ~(LINE - 1))
        by_slot = {r.slot: checksums[i] for i, r in enumerate(reservations) if r is not None}
        published = self._finish(mine, READY, by_slot, timeout)
        return [r is not None and published[r.slot] for r in reservations]

    def abort(self, reservations: list[Reservation | None], timeout: float | None = None
              ) -> None:
        """Give up reserved entries (tombstones) and their payloads."""
        mine = [r for r in reservations if r is not None]
        done = self._finish(mine, TOMBSTONE, {}, timeout)
        for r in mine:
            if done[r.slot]:
                self.pool.free(r.offset)

    def _finish(self, mine: list[Reservation], state: int, checksums: dict, timeout
                ) -> dict[int, bool]:
        if not mine:
            return {}
        slots = np.array([r.slot for r in mine], dtype=np.int64)
        # the lock's acquire fences: the caller's payload flushes complete first (R3)
        with self.pool.lock("index")(timeout) as lock:
            entries = self._read(self._entries(slots)).copy()
            ours = np.array([self._still_mine(entries[row], r) for row, r in enumerate(mine)],
                            dtype=np.bool_)
            lock.check()
            for row in np.flatnonzero(ours):
                entry = entries[row]
                entry[2] += np.uint64(1)
                if state == READY:
                    entry[3] = (entry[3] & ~np.uint64(0xFF)) | np.uint64(READY)
                    entry[6] = (entry[6] & np.uint64(0xFFFFFFFF)) | \
                        np.uint64(int(checksums.get(mine[row].slot, 0)) << 32)
                else:
                    entry[:] = [0, 0, entry[2], TOMBSTONE, 0, 0, 0, 0]
            self._write(slots[ours], entries[ours])
        result = {r.slot: bool(ok) for r, ok in zip(mine, ours)}
        if state == READY:
            for r in mine:
                if not result[r.slot]:
                    self.pool.free(r.offset)
        return result

    def _still_mine(self, entry: np.ndarray, r: Reservation) -> bool:
        return (self._whole(entry[None])[0] and int(entry[0]) == r.key[0]
                and int(entry[1]) == r.key[1] and int(entry[2]) == r.version
                and int(entry[3]) & 0xFFFF == WRITING | (self.pool.node + 1) << 8
                and int(entry[6]) & 0xFFFFFFFF == self.pool.epoch & 0xFFFFFFFF
                and int(entry[4]) == r.offset)

    # ---------------------------------------------------------- eviction

    def evict(self, count: int = 1, window: int = 64, timeout: float | None = None) -> int:
        """Evict up to ``count`` of the stalest unpinned READY entries among
        ``window`` slots from a moving hand (sampled LRU); returns how many."""
        window = min(window, self.capacity)
        freed = []
        with self.pool.lock("index")(timeout) as lock:
            slots = (self._hand + np.arange(window)) & self.mask
            self._hand = (self._hand + window) & self.mask
            entries = self._read(self._entries(slots)).copy()
            ready = self._whole(entries) & ((entries[:, 3] & np.uint64(0xFF)) == READY)
            if not ready.any():
                return 0
            live = [node for node in range(self.max_nodes)
                    if self.pool.space.liveness.live(node)]
            pins, stamps = self._pins(slots[ready], live)
            unpinned = np.flatnonzero(ready)[pins == 0]
            chosen_rows = unpinned[np.argsort(stamps[pins == 0], kind="stable")[:count]]
            if not chosen_rows.size:
                return 0
            chosen, marked = slots[chosen_rows], entries[chosen_rows]
            lock.check()
            marked[:, 2] += np.uint64(1)
            marked[:, 3] = (marked[:, 3] & ~np.uint64(0xFF)) | np.uint64(EVICTING)
            self._write(chosen, marked)
            # the pins' read fences: EVICTING is in memory before they are read
            pins, _ = self._pins(chosen, live)
            lock.check()
            marked[:, 2] += np.uint64(1)
            evicted = pins == 0
            for row in np.flatnonzero(evicted):
                freed.append(int(marked[row, 4]))
                marked[row] = [0, 0, marked[row, 2], TOMBSTONE, 0, 0, 0, 0]
            marked[~evicted, 3] = (marked[~evicted, 3] & ~np.uint64(0xFF)) | np.uint64(READY)
            self._write(chosen, marked)
        for offset in freed:  # tombstones are in memory (the release fenced them)
            self.pool.free(offset)
        return len(freed)

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

    # ------------------------------------------------------------- scans

    def scan(self) -> list[tuple[int, str, tuple[int, int] | None, str | None]]:
        """(slot, state name, payload (offset, length) or None, problem) of
        every non-empty entry, for fsck and the allocator's reclaim; a torn
        entry, or one whose payload is outside the heap, is reported (R5)."""
        names = {WRITING: "writing", READY: "ready", EVICTING: "evicting",
                 TOMBSTONE: "tombstone"}
        low, high = self.heap
        found = []
        for first in range(0, self.capacity, 4096):
            slots = np.arange(first, min(first + 4096, self.capacity))
            entries = self._read(self._entries(slots))
            for slot, entry, sealed in zip(slots.tolist(), entries, self._whole(entries)):
                where = f"index entry {slot} at offset {self.base + slot * ENTRY_BYTES}"
                state = int(entry[3]) & 0xFF
                offset, length = int(entry[4]), int(entry[5])
                if not entry.any():
                    continue
                if not sealed:
                    found.append((slot, "bad", None, f"{where} is torn (check word)"))
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

    def referenced(self) -> list[tuple[int, int]]:
        """(offset, length) of every payload an entry keeps (WRITING, READY,
        EVICTING), for the allocator's reclaim."""
        return [payload for _, _, payload, _ in self.scan() if payload is not None]

    def clear(self, slot: int) -> None:
        """Make ``slot`` a tombstone whatever it held (fsck --repair, under
        the ``index`` lock); its payload is left to the allocator's reclaim."""
        entry = self._read(self._entries(np.array([slot]))).copy()
        entry[0] = [0, 0, entry[0, 2] + np.uint64(1), TOMBSTONE, 0, 0, 0, 0]
        self._write(np.array([slot]), entry)  # the lock's release fences it

    def stats(self) -> dict[str, int]:
        """Entries by state (a torn one counts as torn)."""
        names = {0: "empty", WRITING: "writing", READY: "ready", EVICTING: "evicting",
                 TOMBSTONE: "tombstone"}
        counts = dict.fromkeys([*names.values(), "torn"], 0)
        for first in range(0, self.capacity, 4096):
            entries = self._read(self._entries(np.arange(first, min(first + 4096,
                                                                     self.capacity))))
            for entry, sealed in zip(entries, self._whole(entries)):
                if not entry.any():
                    counts["empty"] += 1
                else:
                    counts[names.get(int(entry[3]) & 0xFF, "torn") if sealed else "torn"] += 1
        return counts
