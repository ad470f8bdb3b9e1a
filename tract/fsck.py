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

Each mechanism owns its layout, its checks and its repairs (the lock area:
`LockSpace.check`; the chunks: `Allocator.check` and its repairs; records
and entries: `ObjectStore.scan`, `Index.scan`); fsck only orchestrates, and
issues no cache control of its own: every fresh read (R4) and every
flushed, fenced repair (R3) is the mechanism's.

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

from tract._native._localmutex import LocalMutex
from tract._native._nodeheap import NodeHeap
from tract.alloc import KINDS, SLAB, Reference, pid_alive
from tract.errors import CorruptionError
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
        self.header = pool.header
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
        for offset, text in self.pool.space.check():
            self.problem("lock area", offset, text)

    # ------------------------------------------------------------ allocator

    def _references(self) -> dict[int, list[Reference]]:
        """chunk -> the object records and index entries that point into
        it; torn ones and short reaches are problems."""
        referenced: dict[int, list[Reference]] = {}

        def refer(offset, size, area, where, what, fix):
            for chunk in range(self.allocator.chunk_of(offset),
                               self.allocator.chunk_of(offset + size - 1) + 1):
                referenced.setdefault(chunk, []).append(Reference(area, where, what, fix))

        objects = self.pool.objects
        for index, state, record, problem in objects.scan():
            where = objects.record_offset(index)
            if state == "bad":
                self.problem("objects", where, problem,
                             lambda index=index: self._tombstone(index, "torn record cleared"))
            elif state == "live":
                refer(record.offset, record.size, "objects", where, f"object {record.name!r}",
                      lambda i=index: self._tombstone(i, "dangling record removed"))
        index = self.pool.index
        for slot, state, payload, problem in index.scan():
            where = index.entry_offset(slot)
            fix = lambda s=slot: self._clear_entry(s)  # noqa: E731
            if state == "bad":
                self.problem("index", where, problem, fix)
            elif payload is not None:
                refer(*payload, "index", where, f"index entry {slot} ({state})", fix)
        for home, reach, farthest in index.short_reaches():
            self.problem("index", index.entry_offset(home),
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
        """The object records and index entries, then every chunk
        (`Allocator.check`)."""
        counts, findings = self.allocator.check(self._references(),
                                                self.pool.nodes_on_this_host())
        for finding in findings:
            record = self.reclaim if finding.reclaimable else self.problem
            record(finding.area, finding.offset, finding.text, finding.repair)
        return counts

    # --------------------------------------------------------------- slabs

    def _slabs(self) -> None:
        """The node heaps of this host's nodes (their node-local files)."""
        header, pool = self.header, self.pool
        referenced = {record.offset for record in pool.objects.list()} | \
            set(pool.index.referenced()[:, 0].tolist())
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
            owner = allocator.owner_fresh(chunk)
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
