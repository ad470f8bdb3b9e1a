"""`tract pool fsck`: prove a pool's metadata consistent, or repair it.

What is checked (every read fresh, R4; nothing trusted, R5):

- the header (at open), the node table (states), the lock area (grant lines
  whole and in range, the manager line in range);
- the allocator: the cursor; no bit past the last chunk; every chunk is
  exactly one of *free* (bit clear, no owner), *owned* (bit set, a live
  owner, nothing references it) or *referenced* (bit set, an object record
  points into it); extents whole (a head whose tails point back at it);
- the object directory and the prefix index: every record and entry whole,
  in range and pointing at allocated chunks;
- the slab heaps of the live nodes on this host: every slab is the node's
  in the pool.

What needs a repair is a *problem* (``ok`` is False while one is left).
Memory whose owner is gone and that nothing references is *reclaimable*,
not a problem: the allocator takes it back by itself when it needs room
(dead owners' chunks, `Allocator.reclaimable`; blocks of a live node's slab
whose process is gone, `Allocator.reclaim_dead_blocks`).

Owners are judged dead as the allocator judges them (`Allocator.dead_owner`):
a node epoch that is not current, a node that left or whose heartbeat stood
still for a lease (fsck watches the heartbeats for one lease first), or, on
this host, an extent's process that is gone.

``--repair`` (as node K, under the ``alloc``, ``objects`` and ``index``
locks) clears stale owner records, returns leaked chunks, frees what is
reclaimable now, tombstones torn object records and index entries and ones pointing
at free chunks.
"""

from __future__ import annotations

import contextlib

import numpy as np

from tract._native._localmutex import LocalMutex
from tract._native._nodeheap import NodeHeap
from tract.alloc import FREE, HEAD, KINDS, OWNER_BYTES, SLAB, TAIL, pid_alive
from tract.errors import CorruptionError
from tract.lock import GRANT_STATES, grant_check
from tract.pool import MEMBERS, SLAB_MIN_BLOCK, Pool, NodeLocal
from tract.region import open_region

__all__ = ["fsck"]


def fsck(path: str, *, repair: bool = False, node: int | None = None,
         watch: bool = True) -> dict:
    """Check the pool at ``path``; with ``repair``, fix what can be fixed
    (needs ``node``, the node id to act as).  ``watch``: observe heartbeats
    for one lease before judging who is dead.  Returns ``{"ok", "chunks",
    "problems", "reclaimable", "repaired"}``; ``ok`` is True when nothing
    left needs a repair."""
    if repair and node is None:
        raise ValueError("fsck --repair takes locks, so it needs the node id to act as (--node)")
    pool = Pool.open(path, node, manager=True) if repair else Pool.observe(path)
    try:
        return _Check(pool, repair, watch).run()
    finally:
        pool.close()


class _Check:
    def __init__(self, pool: Pool, repair: bool, watch: bool):
        self.pool, self.repair, self.watch = pool, repair, watch
        self.region, self.header = pool.region, pool.header
        self.allocator = pool.allocator
        self.problems: list[dict] = []
        self.reclaimable: list[dict] = []
        self.repaired: list[dict] = []

    def problem(self, area: str, offset: int, text: str, fix=None) -> None:
        entry = {"area": area, "offset": offset, "problem": text}
        self.problems.append(entry)
        if fix is not None and self.repair:
            entry["repair"] = fix()
            self.repaired.append(entry)

    def reclaim(self, area: str, offset: int, text: str, fix) -> None:
        """Memory of owners that are gone, which the allocator takes back by
        itself when it needs room (no repair needed); ``--repair`` frees it
        now."""
        entry = {"area": area, "offset": offset, "reclaimable": text}
        self.reclaimable.append(entry)
        if self.repair:
            entry["repair"] = fix()
            self.repaired.append(entry)

    def run(self) -> dict:
        self._nodes()
        self._locks()
        if self.watch:  # judge liveness after a lease of watching the heartbeats
            self.pool.clock.sleep(self.header.lease_timeout * 1.25)
            self._observe()
        if self.repair:
            names = {name for _, name in self.header.lock_names}
            with contextlib.ExitStack() as held:  # the index lock where the pool has one
                for name in ("alloc", "objects", "index"):
                    if name in names:
                        held.enter_context(self.pool.lock(name)(self.header.lease_timeout * 4))
                chunks = self._allocator()
        else:
            chunks = self._allocator()
        self._slabs()
        left = [p for p in self.problems if p not in self.repaired]
        return {"ok": not left, "chunks": chunks, "problems": self.problems,
                "reclaimable": self.reclaimable, "repaired": self.repaired}

    # ---------------------------------------------------------------- nodes

    def _observe(self) -> None:
        for node in range(self.header.max_nodes):
            try:
                self.pool.space.liveness.live(node)
            except CorruptionError:
                pass

    def _nodes(self) -> None:
        for node in range(self.header.max_nodes):
            try:
                self.pool.nodes.read(node)
            except CorruptionError as error:
                self.problem("node table", self.pool.nodes.line(node), str(error))
        self._observe()

    def _locks(self) -> None:
        layout, region = self.pool.layout, self.region
        line = layout.manager_line
        region.invalidate(layout.offset, layout.nbytes)
        region.fence()
        manager = region.load_u64(line)
        if manager > self.header.max_nodes:
            self.problem("lock area", line, f"manager line names node {manager - 1}")
        for lock in range(self.header.max_locks + 1):
            for owner in range(self.header.max_nodes):
                grant = layout.grant_line(lock, owner)
                *fields, check = region.load_u64s(grant, 6)
                if not any(fields) and not check:
                    continue
                if check != grant_check(fields):
                    self.problem("lock area", grant, f"grant line of lock {lock} by manager "
                                 f"{owner} is torn (check word)")
                elif fields[1] not in GRANT_STATES or fields[0] > self.header.max_nodes:
                    self.problem("lock area", grant, f"grant line of lock {lock} by manager "
                                 f"{owner} has holder {fields[0] - 1}, state {fields[1]}")

    # ------------------------------------------------------------ allocator

    def _references(self) -> dict[int, list]:
        """chunk -> [(area, record offset, what, fix)] of the object records
        and index entries that point into it."""
        referenced: dict[int, list] = {}

        def refer(offset, size, area, where, what, fix):
            for chunk in range(self.allocator.chunk_of(offset),
                               self.allocator.chunk_of(offset + size - 1) + 1):
                referenced.setdefault(chunk, []).append((area, where, what, fix))

        objects = self.pool.objects
        for index, state, record, problem in objects.scan():
            where = objects.offset + index * 128
            if state == "bad":
                self.problem("objects", where, problem,
                             lambda index=index: self._tombstone(index, "torn record cleared"))
            elif state == "live":
                refer(record.offset, record.size, "objects", where, f"object {record.name!r}",
                      lambda i=index: self._tombstone(i, "dangling record removed"))
        index = self.pool.index
        for slot, state, payload, problem in index.scan():
            where = index.base + slot * 64
            fix = lambda s=slot: self._clear_entry(s)  # noqa: E731
            if state == "bad":
                self.problem("index", where, problem, fix)
            elif payload is not None:
                refer(*payload, "index", where, f"index entry {slot} ({state})", fix)
        for home, reach, farthest in index.short_reaches():
            self.problem("index", index.base + home * 64,
                         f"index slot {home} reaches {reach} slots but an entry homed there "
                         f"lies {farthest} past it",
                         lambda h=home, f=farthest: self._raise_reach(h, f))
        return referenced

    def _raise_reach(self, slot: int, reach: int) -> str:
        self.pool.index.raise_reach(slot, reach)
        return f"reach raised to {reach}"

    def _clear_entry(self, slot: int) -> str:
        self.pool.index.clear(slot)
        return "entry made a tombstone"

    def _tombstone(self, index: int, what: str) -> str:
        self.pool.objects.clear(index)
        return what

    def _allocator(self) -> dict:
        allocator, region, layout = self.allocator, self.region, self.allocator.layout
        nchunks = allocator.nchunks
        region.invalidate(layout.cursor_line, 64)
        words = allocator._bitmap()
        allocator._fresh_owners(0, nchunks)
        region.fence()
        cursor = region.load_u64(layout.cursor_line)
        if cursor >= nchunks:
            self.problem("allocator", layout.cursor_line, f"cursor {cursor} is past the last "
                         f"chunk ({nchunks - 1})", lambda: self._store(layout.cursor_line, 0))
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        beyond = np.flatnonzero(bits[nchunks:]) + nchunks
        if beyond.size:
            self.problem("allocator", layout.bitmap, f"bits set past the last chunk: "
                         f"{beyond[:8].tolist()}")
        referenced = self._references()
        local = self.pool.nodes_on_this_host()
        counts = dict(free=0, owned=0, referenced=0, slab=0, reclaimable=0, leaked=0)
        owners = {}
        for chunk in range(nchunks):
            where = layout.owner(chunk)
            try:
                owners[chunk] = allocator.owner(chunk)
            except CorruptionError as error:
                owners[chunk] = None
                fix = None if bits[chunk] else (lambda c=chunk: self._clear_owner(c))
                self.problem("allocator", where, str(error), fix)
        chunk = 0
        while chunk < nchunks:
            owner, taken = owners[chunk], bool(bits[chunk])
            where = layout.owner(chunk)
            if not taken:
                if owner is not None and owner.kind != FREE:
                    self.problem("allocator", where, f"chunk {chunk} is free in the bitmap but "
                                 f"its owner record says {KINDS[owner.kind]} of node "
                                 f"{owner.node}", lambda c=chunk: self._clear_owner(c))
                for area, where_ref, what, fix in referenced.get(chunk, []):
                    self.problem(area, where_ref, f"{what} points into free chunk {chunk}", fix)
                counts["free"] += 1
                chunk += 1
                continue
            if owner is None or owner.kind == FREE:
                if chunk in referenced:
                    self.problem("allocator", where, f"chunk {chunk} is taken and referenced "
                                 f"but has no owner record")
                else:
                    counts["leaked"] += 1
                    self.problem("allocator", where, f"chunk {chunk} is taken in the bitmap with "
                                 f"no owner (leaked)", lambda c=chunk: self._free(c, 1))
                chunk += 1
                continue
            if owner.kind == TAIL:
                fix = None if chunk in referenced else (lambda c=chunk: self._free(c, 1))
                self.problem("allocator", where, f"chunk {chunk} is a tail of chunk {owner.run} "
                             f"whose extent does not cover it", fix)
                chunk += 1
                continue
            count = owner.run if owner.kind == HEAD else 1
            broken = [c for c in range(chunk + 1, chunk + count)
                      if not bits[c] or owners[c] is None or owners[c].kind != TAIL
                      or owners[c].run != chunk]
            if broken:
                self.problem("allocator", where, f"extent at chunk {chunk} ({count} chunks) has "
                             f"broken tails {broken[:8]}")
                chunk += 1
                continue
            span = range(chunk, chunk + count)
            is_referenced = any(c in referenced for c in span)
            if owner.kind == SLAB:
                counts["slab"] += count
            elif is_referenced:
                counts["referenced"] += count
            else:
                counts["owned"] += count
            if not is_referenced and allocator.dead_owner(owner, owner.node in local):
                counts["reclaimable"] += count
                self.reclaim("allocator", where, f"{KINDS[owner.kind]} at chunk {chunk} "
                             f"({count} chunks) of node {owner.node} epoch {owner.epoch} pid "
                             f"{owner.pid}, which is gone, is referenced by nothing",
                             lambda c=chunk, n=count: self._free(c, n))
            chunk += count
        counts["total"] = nchunks
        return counts

    def _store(self, offset: int, value: int) -> str:
        self.region.store_u64(offset, value)
        self.region.flush(offset, 8)
        self.region.fence()
        return f"set offset {offset} to {value}"

    def _clear_owner(self, chunk: int) -> str:
        self.region.fill(self.allocator.layout.owner(chunk), OWNER_BYTES, 0)
        self.region.flush(self.allocator.layout.owner(chunk), OWNER_BYTES)
        self.region.fence()
        return f"cleared the owner record of chunk {chunk}"

    def _free(self, chunk: int, count: int) -> str:
        self.allocator._release(chunk, count)
        return f"returned chunks {chunk}..{chunk + count - 1} to the pool"

    # --------------------------------------------------------------- slabs

    def _slabs(self) -> None:
        """The node heaps of this host's nodes (their node-local files)."""
        header, pool = self.header, self.pool
        referenced = {record.offset for record in pool.objects.list()} | \
            {offset for offset, _ in pool.index.referenced()}
        members, heap_offset, size = NodeLocal.shape(header)
        for node in sorted(pool.nodes_on_this_host()):
            path = NodeLocal.path_of(header, node)
            try:
                local = open_region(path, coherence="hardware", size=size)
            except (OSError, ValueError) as error:
                self.problem("node heap", 0, f"node {node}'s local file {path}: {error}")
                continue
            try:
                if not any(pid_alive(pid) for pid in local.load_u64s(members, MEMBERS)):
                    continue  # no process of the node is left: its heap is a past one
                heap = NodeHeap(local, LocalMutex(local, heap_offset), heap_offset,
                                header.nchunks, header.chunk_size, SLAB_MIN_BLOCK, header.heap)
                self._slab_heap(node, heap, referenced)
                heap = None
            finally:
                local.close()

    def _slab_heap(self, node: int, heap: NodeHeap, referenced: set[int]) -> None:
        allocator = self.allocator
        _, epoch, _ = self.pool.nodes.read(node)
        if heap.epoch != epoch or not self.pool.space.liveness.live(node):
            # a past incarnation's heap, or a node that left or lapsed: its file is no
            # longer the truth (the pool may have reclaimed its slabs); its chunks are
            # judged in the pool, as a dead owner's
            return
        for chunk, size, used in heap.slabs():
            allocator._fresh_owners(chunk, 1)
            self.region.fence()
            owner = allocator.owner(chunk)
            where = allocator.layout.owner(chunk)
            if owner.kind != SLAB or owner.node != node:
                self.problem("node heap", where, f"node {node}'s heap has a slab at chunk "
                             f"{chunk} the pool gives to {KINDS[owner.kind]} of node "
                             f"{owner.node}", lambda c=chunk: self._forget(heap, c))
                continue
            dead = [(offset, pid) for offset, pid in used
                    if offset not in referenced and not pid_alive(pid)]
            if dead:
                self.reclaim("node heap", where, f"{len(dead)} block(s) of {size} bytes in "
                             f"node {node}'s slab at chunk {chunk} belong to processes that "
                             f"are gone and are referenced by nothing",
                             lambda d=dead: self._release_blocks(heap, d))

    @staticmethod
    def _forget(heap: NodeHeap, chunk: int) -> str:
        heap.forget_slab(chunk)
        return f"slab at chunk {chunk} forgotten"

    @staticmethod
    def _release_blocks(heap: NodeHeap, blocks: list[tuple[int, int]]) -> str:
        return f"freed {heap.release_blocks(blocks)} blocks"
