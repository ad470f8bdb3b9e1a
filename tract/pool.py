"""A pool: layout and lifecycle.

Layout (every area line-aligned, in this order, none overlapping; all of it
follows from the creation parameters, so `Header` recomputes it and refuses a
header that disagrees):

    0        header      magic, layout version, uuid, size, limits, modes,
                         area offsets, hash key; written once at creation
    4096     node table  one line per node (`tract.lease`)
             lock names  32 bytes per lock, written once at creation
             lock area   `tract.lock.LockLayout`
             allocator   `tract.alloc.AllocLayout`: cursor line, chunk bitmap,
                         per-chunk owner records, remote-free rings
             objects     `tract.objects`: the directory of named roots
             index       reserved for the prefix index: 64-byte entries, then
                         per node one 8-byte word per entry (pins, stamps)
             stats       per node two lines of counters (`tract.stats`)
             heap        chunk-aligned; ``nchunks`` chunks of ``chunk_size``

Node-local state (tier-1 mutexes, cohort words, the free rings' turn, the
node's own lease, its live processes and its slab heap) lives in one file
per node in /dev/shm (`NodeLocal`), never in the pool.

Rules relied on (DESIGN.md): R1 — areas are named by offset; R3 — the
header is written, flushed and fenced before anyone can open the pool (magic
last); R5 — every field read from the header is range-checked at open, and a
foreign magic, another layout version or areas that overlap or leave the
pool are refused with what was expected and what was found; R6 — every
process beats its node's heartbeat from a native thread (`Heartbeat`,
without the GIL), and fences itself: before each write that depends on a
claim it checks its node's own lease (`self_fence`, `tract.lease.OwnLease`),
and a node whose lease lapsed rejoins as a new incarnation (`renew`)
before it does anything else.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
import uuid

import numpy as np

from tract import platform
from tract._native._localmutex import LocalMutex
from tract._native._lockfast import Heartbeat, ManagerFastPath
from tract._native._nodeheap import NodeHeap, heap_bytes
from tract.alloc import OFFSET_BITS, AllocLayout, Allocator, RingTurn, pid_alive
from tract.errors import ConfigError, CorruptionError, TractError
from tract.lease import (ALIVE, BEATEN, CURRENT, HELD, LEASE_WORDS, Clock, Liveness, NodeTable,
                         OwnLease)
from tract.lines import LINE
from tract.lock import (COHORT_PASSES, LOCK_MODES, SLOT_BYTES, Lock, LockLayout, LockManager,
                        LockSpace, read_manager)
from tract.index import ENTRY_BYTES, Index
from tract.objects import RECORD_BYTES, ObjectStore
from tract.region import create_region, is_dax_path, open_region
from tract.stats import COUNTERS, STATS_BYTES, NodeStats, read_stats

__all__ = ["DEFAULT_LOCKS", "Pool", "format_pool", "unpublish"]

MAGIC = int.from_bytes(b"TRACTPL\x01", "little")
LAYOUT_VERSION = 5  # 5: four lines of counters per node (the cluster tier's)
HEADER_BYTES = 4096
NAME_BYTES = 32
INDEX_NODE_WORD = 8  # per node, per index entry: its pin count and access stamp
DEFAULT_LOCKS = ("alloc", "objects", "index")
DEFAULT_CHUNK = 2 << 20
SLAB_MIN_BLOCK = 4096  # the smallest slab block: objects up to 4 KiB take one
MEMBERS = 512  # processes of one node that may have a pool open at once
MAX_NODES = 256
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,30}$")
_LOCAL_DIR = "/dev/shm"  # node-local: tier-1 mutexes and node heaps never live in the pool

# header field offsets
_F = dict(magic=0, version=8, uuid=16, size=32, max_nodes=40, max_locks=48, lock_mode=56,
          coherence=64, flush=72, lease_us=80, node_table=88, names=96, lock_area=104,
          lock_area_size=112, heap=120, hash_key=128, created_ns=144, chunk_size=152,
          nchunks=160, alloc=168, objects=176, max_objects=184, index=192, index_capacity=200,
          index_nodes=208, stats=216)
# the fields that follow from the creation parameters (checked at open)
_DERIVED = ("node_table", "names", "lock_area", "lock_area_size", "alloc", "objects", "index",
            "index_nodes", "stats", "heap", "nchunks")


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _areas(size: int, max_nodes: int, max_locks: int, chunk_size: int, max_objects: int,
           index_capacity: int) -> dict[str, int]:
    """Every area's offset for these parameters.  The allocator's metadata
    is sized for every chunk the pool could hold, so the heap start (and the
    chunk count) follow in one pass."""
    node_table = HEADER_BYTES
    names = node_table + max_nodes * LINE
    lock_area = _round_up(names + max_locks * NAME_BYTES, LINE)
    lock_area_size = LockLayout(lock_area, max_nodes, max_locks).nbytes
    alloc = lock_area + lock_area_size
    objects = alloc + AllocLayout(alloc, size // chunk_size, max_nodes).nbytes
    index = objects + max_objects * RECORD_BYTES
    index_nodes = index + index_capacity * ENTRY_BYTES
    stats = index_nodes + max_nodes * _round_up(index_capacity * INDEX_NODE_WORD, LINE)
    heap = _round_up(stats + max_nodes * STATS_BYTES, chunk_size)
    return dict(node_table=node_table, names=names, lock_area=lock_area,
                lock_area_size=lock_area_size, alloc=alloc, objects=objects, index=index,
                index_nodes=index_nodes, stats=stats, heap=heap,
                nchunks=max(0, (size - heap) // chunk_size))


def default_index_capacity(size: int) -> int:
    """One entry per 64 KiB of pool, a power of two in 64..2**24."""
    return min(1 << 24, max(64, 1 << max(0, (size // 65536).bit_length() - 1)))


def format_pool(region, *, max_nodes: int = 16, locks=DEFAULT_LOCKS, max_locks: int = 16,
                lock_mode: str = "manager", lease_timeout: float = 2.0,
                chunk_size: int = DEFAULT_CHUNK, max_objects: int = 256,
                index_capacity: int | None = None, hash_key: bytes | None = None) -> None:
    """Write a fresh pool header and zeroed metadata into ``region``.

    ``hash_key``: the 16 secret bytes every block key and checksum of the
    pool is keyed with; random when None.  Pools that must make the same
    keys for the same blocks (racks sharing one cluster tier) are created
    with the same key; whoever knows it can compute a pool's keys."""
    if hash_key is None:
        hash_key = os.urandom(16)
    elif not isinstance(hash_key, bytes) or len(hash_key) != 16:
        raise ConfigError(f"hash_key must be 16 bytes, got {hash_key!r:.40}")
    if not 1 <= max_nodes <= MAX_NODES:
        raise ConfigError(f"max_nodes must be in 1..{MAX_NODES}, got {max_nodes}")
    if not 1 <= max_locks <= 1024 or len(locks) > max_locks:
        raise ConfigError(f"max_locks must be in 1..1024 and hold the {len(locks)} lock "
                          f"names, got {max_locks}")
    if lock_mode not in LOCK_MODES:
        raise ConfigError(f"lock mode must be one of {LOCK_MODES}, got {lock_mode!r}")
    control = region.cache_control
    if lock_mode == "atomic" and control.coherence != "hardware":
        raise ConfigError("lock mode 'atomic' needs coherence='hardware'")
    if not 0 < lease_timeout < 3600:
        raise ConfigError(f"lease_timeout must be in (0, 3600) seconds, got {lease_timeout}")
    if chunk_size < 8192 or chunk_size & (chunk_size - 1) or chunk_size > 1 << 30:
        raise ConfigError(f"chunk_size must be a power of two in 8 KiB..1 GiB, got {chunk_size}")
    if not 1 <= max_objects <= 1 << 20:
        raise ConfigError(f"max_objects must be in 1..{1 << 20}, got {max_objects}")
    if index_capacity is None:
        index_capacity = default_index_capacity(region.size)
    if not 1 <= index_capacity <= 1 << 28 or index_capacity & (index_capacity - 1):
        raise ConfigError(f"index_capacity must be a power of two in 1..2**28, got "
                          f"{index_capacity}")
    for name in locks:
        if not _NAME.match(name):
            raise ConfigError(f"lock name {name!r} must match {_NAME.pattern}")
    if len(set(locks)) != len(locks):
        raise ConfigError(f"lock names repeat: {list(locks)}")
    for name in ("alloc", "objects"):
        if name not in locks:
            raise ConfigError(f"the pool needs a lock named {name!r}; locks are {list(locks)}")
    if region.size > 1 << OFFSET_BITS:
        raise ConfigError(f"a pool holds at most {1 << OFFSET_BITS} bytes (offsets in free-ring "
                          f"entries have {OFFSET_BITS} bits), got {region.size}")
    areas = _areas(region.size, max_nodes, max_locks, chunk_size, max_objects, index_capacity)
    if areas["nchunks"] < 1:
        raise ConfigError(f"a pool for {max_nodes} nodes, {max_locks} locks, {max_objects} "
                          f"objects and {index_capacity} index entries, with {chunk_size}-byte "
                          f"chunks, needs at least {areas['heap'] + chunk_size} bytes, got "
                          f"{region.size}")
    region.fill(0, areas["heap"], 0)
    fields = dict(areas, magic=0, version=LAYOUT_VERSION, size=region.size, max_nodes=max_nodes,
                  max_locks=max_locks, lock_mode=LOCK_MODES.index(lock_mode),
                  coherence=platform.COHERENCE_MODES.index(control.coherence),
                  flush=_flush_code(control), lease_us=int(lease_timeout * 1e6),
                  created_ns=time.time_ns(), chunk_size=chunk_size, max_objects=max_objects,
                  index_capacity=index_capacity)
    for field, value in fields.items():
        region.store_u64(_F[field], value)
    region.copy_in(_F["uuid"], uuid.uuid4().bytes, nontemporal=False)
    region.copy_in(_F["hash_key"], hash_key, nontemporal=False)
    for index, name in enumerate(locks):
        region.copy_in(areas["names"] + index * NAME_BYTES, name.encode(), nontemporal=False)
    region.flush(0, areas["heap"])
    region.fence()
    region.store_u64(_F["magic"], MAGIC)  # published last: a half-made pool is foreign
    region.flush(0, LINE)
    region.fence()


def unpublish(region) -> None:
    """Wipe the magic, flushed and fenced (R3): from then on no host opens
    the memory as a pool (`format_pool` publishes it again)."""
    region.store_u64(_F["magic"], 0)
    region.flush(0, LINE)
    region.fence()


def _flush_code(control) -> int:
    return platform.FLUSH_CHOICES.index(control.chosen) if control.chosen in \
        platform.FLUSH_CHOICES else len(platform.FLUSH_CHOICES)


class Header:
    """The header's fields, read fresh and checked (R5)."""

    def __init__(self, region):
        where = getattr(region, "path", "<pool>")
        if region.size < HEADER_BYTES:
            raise CorruptionError(f"{where!r} is {region.size} bytes, smaller than a pool "
                                  f"header ({HEADER_BYTES}): not a tract pool, or truncated")
        region.invalidate(0, HEADER_BYTES)
        region.fence()
        read = {field: region.load_u64(offset) for field, offset in _F.items()
                if field not in ("uuid", "hash_key")}
        if read["magic"] != MAGIC:
            raise CorruptionError(f"{where!r} is not a tract pool: magic {read['magic']:#x} at "
                                  f"offset 0, expected {MAGIC:#x}")
        if read["version"] != LAYOUT_VERSION:
            raise CorruptionError(f"{where!r} has pool layout version {read['version']}, this "
                                  f"tract reads version {LAYOUT_VERSION}")
        if read["size"] != region.size:
            raise CorruptionError(f"{where!r} header says {read['size']} bytes, the mapping has "
                                  f"{region.size} (truncated or grown?)")
        for field, low, high in (("max_nodes", 1, MAX_NODES), ("max_locks", 1, 1024),
                                 ("lock_mode", 0, len(LOCK_MODES) - 1),
                                 ("coherence", 0, len(platform.COHERENCE_MODES) - 1),
                                 ("lease_us", 1, 3600 * 10**6), ("chunk_size", 8192, 1 << 30),
                                 ("max_objects", 1, 1 << 20), ("index_capacity", 1, 1 << 28)):
            if not low <= read[field] <= high:
                raise CorruptionError(f"{where!r} header field {field} at offset {_F[field]} is "
                                      f"{read[field]}, expected {low}..{high}")
        for field in ("chunk_size", "index_capacity"):
            if read[field] & (read[field] - 1):
                raise CorruptionError(f"{where!r} header field {field} at offset {_F[field]} is "
                                      f"{read[field]}, expected a power of two")
        expected = _areas(read["size"], read["max_nodes"], read["max_locks"],
                          read["chunk_size"], read["max_objects"], read["index_capacity"])
        for field in _DERIVED:
            if read[field] != expected[field]:
                raise CorruptionError(f"{where!r} header field {field} at offset {_F[field]} is "
                                      f"{read[field]}, expected {expected[field]} for this "
                                      f"pool's size and limits (areas overlap or leave the pool)")
        if expected["heap"] > region.size:
            raise CorruptionError(f"{where!r}: its areas end at {expected['heap']}, past the pool "
                                  f"size {region.size}")
        self.__dict__.update(read)
        self.uuid = uuid.UUID(bytes=region.read(_F["uuid"], 16))
        self.hash_key = region.read(_F["hash_key"], 16)
        self.lock_mode_name = LOCK_MODES[self.lock_mode]
        self.coherence_name = platform.COHERENCE_MODES[self.coherence]
        self.lease_timeout = self.lease_us / 1e6
        self.heap_end = self.heap + self.nchunks * self.chunk_size
        self.index_node_bytes = _round_up(self.index_capacity * INDEX_NODE_WORD, LINE)
        self.lock_names = []
        region.invalidate(self.names, self.max_locks * NAME_BYTES)  # outside the header (R4)
        region.fence()
        for index in range(self.max_locks):
            raw = region.read(self.names + index * NAME_BYTES, NAME_BYTES).rstrip(b"\0")
            if not raw:
                continue
            name = raw.decode("ascii", "replace")
            if not _NAME.match(name):
                raise CorruptionError(f"{where!r} lock name {index} at offset "
                                      f"{self.names + index * NAME_BYTES} is {raw!r}")
            self.lock_names.append((index, name))

    def areas(self) -> dict[str, tuple[int, int]]:
        """Name -> (offset, bytes) of every area, in pool order."""
        bounds = [("header", 0), ("node table", self.node_table), ("lock names", self.names),
                  ("lock area", self.lock_area), ("allocator", self.alloc),
                  ("objects", self.objects), ("index", self.index),
                  ("index per node", self.index_nodes), ("stats", self.stats),
                  ("heap", self.heap)]
        ends = [offset for _, offset in bounds[1:]] + [self.heap_end]
        return {name: (offset, end - offset) for (name, offset), end in zip(bounds, ends)}


class Pool:
    """One node's handle on a pool: `Pool.create`, then `Pool.open` per process."""

    def __init__(self, region, node: int | None, *, clock: Clock | None = None,
                 manager: bool = False, heartbeat: bool = True, local_locks: bool = True,
                 fencing: bool | None = None):
        """``local_locks=False``: no node-local file (no tier-1 mutexes, no
        slab heap): this process is its node's only one, as under the
        simulator.  ``fencing`` (default: with the heartbeat thread):
        judge this process's own lease before every write that depends on
        a claim (`self_fence`); a process without the thread that turns it
        on beats by `beat` (the simulator's heartbeat threads)."""
        self.region = region
        self.header = header = Header(region)
        if node is None:  # an observer (`Pool.observe`): joins nothing, takes no locks
            heartbeat = manager = local_locks = False
        elif not 0 <= node < header.max_nodes:
            raise ConfigError(f"node {node} is beyond this pool's max_nodes "
                              f"({header.max_nodes}): expected 0..{header.max_nodes - 1}")
        self.node = node
        self.clock = clock or Clock()
        self.nodes = NodeTable(region, header.node_table, header.max_nodes)
        self.layout = LockLayout(header.lock_area, header.max_nodes, header.max_locks)
        self.alloc_layout = AllocLayout(header.alloc, header.size // header.chunk_size,
                                        header.max_nodes)
        self.fencing = heartbeat if fencing is None else fencing
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._heartbeat = None
        self._local = NodeLocal(header, node) if local_locks else None
        try:
            words = self._local.lease_words() if self._local is not None else \
                np.zeros(LEASE_WORDS, np.uint64)
            self.own = OwnLease(self.clock, header.lease_timeout, words)
            self.space = self._space()
            # every node's heartbeat watched from here on (and by the heartbeat
            # thread every beat): a node that stopped is judged gone a lease after
            # this look at most, not a lease after a step first asks about it
            self.space.liveness.live_nodes()
            self.index = Index(self)  # before the join, which clears a past incarnation's pins
            first = self._local.first if self._local is not None else None
            self.epoch = self._join(first) if node is not None else 0
            if heartbeat and self.fencing:
                # from the join on, without the GIL: only a stall of the whole process stops it
                self._heartbeat = Heartbeat(region, self.nodes.line(node), self.own.words,
                                            header.lease_timeout / 8, self.own.limit_ns / 1e9)
                self._heartbeat.start()
            heap = None
            if self._local is not None:
                heap = self._local.heap
                if heap.epoch != self.epoch:  # a new incarnation: its slabs went with the last
                    heap.format(self.epoch)
        except BaseException:
            self._stop_threads()
            raise
        finally:
            if self._local is not None:
                self._local.unlock()
        try:
            self._open_mechanisms(heap, heartbeat, manager)
        except BaseException:  # no thread outlives a failed open (the region closes next)
            self._stop_threads()
            raise

    def _open_mechanisms(self, heap, heartbeat: bool, manager: bool) -> None:
        header, region, node = self.header, self.region, self.node
        self._names = {name: index for index, name in header.lock_names}
        self._locks: dict[str, Lock] = {}
        self._fast_paths: dict[int, ManagerFastPath] = {}
        local = self._local
        self.allocator = Allocator(self, self.alloc_layout, heap,
                                   local.rings() if local is not None else None,
                                   local.member_pids if local is not None else None)
        if heap is not None:  # a heap kept from a running incarnation may list lost slabs
            self.allocator.forget_lost_slabs()
        self.objects = ObjectStore(self, header.objects, header.max_objects,
                                   (header.heap, header.heap_end))
        self.allocator.add_referrer(lambda: [(r.offset, r.size) for r in self.objects.list()])
        self.stats = NodeStats(region, header.stats, node) if node is not None else None
        self.allocator.add_referrer(self.index.referenced)
        if heartbeat:
            self._start(self._beat, "heartbeat")
        if manager:
            lock_manager = self.manager()
            self._start(lambda: lock_manager.run(self._stop), "lock-manager")
            self._await_take_over(lock_manager)

    # --------------------------------------------------------- lifecycle

    @classmethod
    def create(cls, path: str, size: int | None, *, flush: str | None = None,
               coherence: str = "none", mode: int = 0o600, **layout) -> None:
        """Create a pool file of ``size`` bytes, or format a device-DAX
        instance (``/dev/daxX.Y``: ``size`` bytes of it, or all of it when
        None); see `format_pool` for ``layout`` options."""
        if is_dax_path(path):
            region = open_region(path, size=size, flush=flush, coherence=coherence)
            try:
                format_pool(region, **layout)
            finally:
                region.close()
            return
        if size is None:
            raise ConfigError(f"a pool file needs a size; {path!r} is not a DAX device")
        region = create_region(path, size, mode=mode, flush=flush, coherence=coherence)
        try:
            format_pool(region, **layout)
        except BaseException:
            region.close()
            os.unlink(path)
            raise
        region.close()

    @classmethod
    def open(cls, path: str, node: int, *, manager: bool = False, flush: str | None = None,
             coherence: str | None = None, populate: bool = False,
             allow_other_owner: bool = False) -> Pool:
        """Map a pool as node ``node``; ``manager=True`` runs a lock manager
        (active or standby) in a daemon thread; ``populate`` maps every page
        now (no page faults on first touch later).  A pool file owned by
        another user is refused unless ``allow_other_owner`` (or the
        environment's ``TRACT_ALLOW_OTHER_OWNER=1``): whoever owns it can
        rewrite every byte this process will trust as metadata.  (Device-DAX
        nodes belong to root; who may open them is their group's matter.)"""
        _check_owner(path, allow_other_owner)
        region = open_region(path, flush=flush, coherence=coherence or "none",
                             populate=populate)
        try:
            declared = Header(region).coherence_name
            if coherence is None and declared != "none":
                region.close()
                region = open_region(path, flush=flush, coherence=declared, populate=populate)
            return cls(region, node, manager=manager)
        except BaseException:
            if not region.closed:
                region.close()
            raise

    @classmethod
    def observe(cls, path: str) -> Pool:
        """Map a pool without joining it (no node id, no locks, no writes):
        what `tract pool info` and a read-only fsck use."""
        region = open_region(path)
        try:
            return cls(region, None)
        except BaseException:
            region.close()
            raise

    @staticmethod
    def destroy(path: str) -> None:
        """Remove a pool file and the node-local files of every node on this
        host.  A pool whose header is corrupt past its magic still names its
        node-local files by the uuid it holds; a file without the magic is
        not a pool, and is removed alone."""
        try:
            region = open_region(path)
            try:
                pool_uuid = Header(region).uuid
            finally:
                region.close()
        except (OSError, CorruptionError, ConfigError):
            pool_uuid = None
            try:
                with open(path, "rb") as raw:
                    start = raw.read(_F["uuid"] + 16)
                if len(start) == _F["uuid"] + 16 and \
                        int.from_bytes(start[_F["magic"]:_F["magic"] + 8], "little") == MAGIC:
                    pool_uuid = uuid.UUID(bytes=start[_F["uuid"]:])
            except OSError:
                pass
        if pool_uuid is not None:
            for name in os.listdir(_LOCAL_DIR):
                if name.startswith(f"tract-{pool_uuid.hex}-node") and name.endswith(".local"):
                    os.unlink(os.path.join(_LOCAL_DIR, name))
        if is_dax_path(path):  # a device is not removed: its magic is wiped
            region = open_region(path, size=HEADER_BYTES)
            try:
                unpublish(region)
            finally:
                region.close()
            return
        os.unlink(path)

    def _space(self, liveness: Liveness | None = None) -> LockSpace:
        # an observer's space only judges leases and backs off: it never
        # beats or takes a lock, so the node it names is never written
        node = 0 if self.node is None else self.node
        space = LockSpace(self.region, self.layout, self.nodes, node,
                          self.header.lease_timeout, self.clock, liveness)
        if self.node is not None and self.fencing:  # its waits beat through the own lease
            space.own, space.fencing = self.own, self.self_fence
        return space

    def _join(self, first: bool | None) -> int:
        """Join the node table.  ``first``: no other process of this node
        is alive (from the node-local member list), so this is a new
        incarnation; None without a node-local file: judge by the pid the
        node table recorded."""
        heartbeat, epoch, state = self.nodes.read(self.node)
        if first is None:
            pid = self.region.load_u64(self.nodes.line(self.node) + 24)
            first = state == ALIVE and not pid_alive(pid)
        # a live node whose lease lapsed comes back as a new incarnation too
        # (its claims may be reclaimed already); private words know no lapse
        lapsed = self._local is not None and not first and self.own.state(epoch) != HELD
        joined = self.nodes.join(self.node, first or lapsed)
        if joined != epoch:  # a new incarnation: drop claims the last one left
            self.space.forget_node(self.node)
            # the last incarnation's processes are gone, and their index pins
            self.index.forget_node(self.node)
        if joined != int(self.own.words[CURRENT]) or first or lapsed or self._local is None:
            self.own.joined(joined)
        else:  # the join beat the node's line: a good beat of a held lease
            self.own.words[BEATEN] = max(int(self.own.words[BEATEN]), self.own.now_ns())
        return joined

    # ----------------------------------------------------- self-fencing

    def self_fence(self, what: str) -> None:
        """Raise `LeaseLost` unless this process's node still holds its
        lease (R6, `tract.lease.OwnLease`): call it right before a write
        that depends on a claim (a grant, a slab or chunk this node owns,
        a WRITING reservation, a pin); ``what`` names that write.  The
        next operation rejoins first (`renew`)."""
        if self.fencing and self.own.now(self.epoch):
            self.own.check(self.node, self.epoch, what)

    def lease_held(self) -> bool:
        """Whether this process's node holds its lease now (always, without fencing)."""
        return not self.fencing or self.own.now(self.epoch) == HELD

    def beat(self) -> bool:
        """Beat this node's heartbeat now, unless the beat is late (the
        heartbeat thread does this every quarter lease); whether it beat.
        Without fencing, every beat is written."""
        if not self.fencing:
            self.nodes.beat(self.node)
            return True
        return self.own.beat(self.nodes, self.node)

    def renew(self) -> bool:
        """Before an operation: when this node's lease is not held (a
        stall past half the lease: `self_fence`), rejoin the pool as a new
        incarnation, dropping every claim the lapsed one had (as a node
        restarted after a crash: others reclaim them, R6); whether it
        rejoined.  `tract.connector.Connector`'s operations call it; code
        that drives the pool's mechanisms directly calls it between its
        operations, never inside one (a rejoin drops this node's pins and
        lock requests)."""
        if self.lease_held():
            return False
        if self._local is not None:
            self._local.lock()
        try:
            if int(self.own.words[CURRENT]) == self.epoch:  # nobody of the node rejoined yet
                joined = self.nodes.join(self.node, True)
                self.space.forget_node(self.node)
                self.index.forget_node(self.node)
                if self.allocator.heap is not None:
                    self.allocator.heap.format(joined)
                self.own.joined(joined)
            self.epoch = int(self.own.words[CURRENT])
        finally:
            if self._local is not None:
                self._local.unlock()
        self.stats.add(rejoins=1)
        return True

    def nodes_on_this_host(self) -> set[int]:
        """Nodes of this pool with a node-local file here: their pids are
        this host's (the emulated pool keeps every node on one host)."""
        prefix = f"tract-{self.header.uuid.hex}-node"
        found = set()
        for name in os.listdir(_LOCAL_DIR):
            if name.startswith(prefix) and name.endswith(".local"):
                number = name[len(prefix):-len(".local")]
                if number.isdigit() and int(number) < self.header.max_nodes:
                    found.add(int(number))
        return found

    def alloc(self, size: int, timeout: float | None = None) -> int:
        """Pool offset of ``size`` fresh bytes (`tract.alloc.Allocator.alloc`);
        `LeaseLost` when this node's lease is not held (its slabs may be
        another's already)."""
        self.self_fence("an allocation")
        return self.allocator.alloc(size, timeout)

    def alloc_many(self, size: int, count: int, timeout: float | None = None) -> list[int]:
        """Offsets of ``count`` allocations of ``size`` bytes
        (`tract.alloc.Allocator.alloc_many`); `LeaseLost` as `alloc`."""
        self.self_fence("an allocation")
        return self.allocator.alloc_many(size, count, timeout)

    def free(self, offset: int, timeout: float | None = None) -> None:
        """Give back what `alloc` returned, from any node; `LeaseLost`
        when this node's lease lapsed: what it allocated before may be
        another's allocation now (R6), and is not freed from here."""
        self.self_fence("a free")
        self.allocator.free(offset, timeout)

    def _start(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=f"tract-{name}-node{self.node}",
                                  daemon=True)
        thread.start()
        self._threads.append(thread)

    def _fast_path(self, index: int) -> ManagerFastPath:
        fast = self._fast_paths.get(index)
        if fast is None:
            fast = self._fast_paths[index] = self._local.fast_path(index, self)
        return fast

    def _beat(self) -> None:
        """Every quarter lease: beat (unless the native `Heartbeat` does,
        every eighth), publish the counters, look at every node's heartbeat
        (`Liveness.live_nodes`: one batch of the node table), drain the free rings (and every
        4 leases take back the blocks of adopted slabs that nothing
        references, `Allocator.reclaim_dead_blocks`), and
        sweep each cohort lock: give back the
        tier-2 hold of a local process that died holding tier 1 (when no
        other local process takes that lock again, nothing else would), and a
        hand-off that no local process took for a whole beat (its waiter
        timed out or died)."""
        nodes = NodeTable(self.region, self.header.node_table, self.header.max_nodes)
        cohorting = self._local is not None and self.header.lock_mode_name == "manager"
        seen: dict[int, tuple[int, int, int]] = {}
        beats = 0
        while not self._stop.wait(self.header.lease_timeout / 4):
            beats += 1
            if self._heartbeat is None:
                nodes.beat(self.node)
            self.stats.publish()
            self.space.liveness.live_nodes()
            try:
                self.allocator.drain()
                if beats % 16 == 0:  # each lock waited for an eighth of a lease at most
                    self.allocator.reclaim_dead_blocks(self.header.lease_timeout / 8, True)
            except TractError as error:  # a corrupt ring must not stop the heartbeat
                self.allocator.rejected.append(str(error))
            if cohorting:  # a hand-off that stood still a whole beat is stale
                for index in self._names.values():
                    fast = self._fast_path(index)
                    words = fast.slot_words()
                    fast.sweep(stale=bool(words[0]) and seen.get(index) == words)
                    seen[index] = words

    def _await_take_over(self, lock_manager: LockManager) -> None:
        """When the manager line names this node, the manager it names is a
        former incarnation's (or another process's of this one): wait, a
        lease at most, until this process's manager has taken over or
        stands by, so that no lock of this incarnation starts on a sticky
        grant its predecessor left (the take-over revokes those, and the
        holder's next `check` would fail)."""
        deadline = self.clock.now() + self.header.lease_timeout
        while not (lock_manager.active or lock_manager.deferred) and \
                self.clock.now() < deadline:
            self.space.fresh(self.layout.manager_line)
            if read_manager(self.space)[0] != self.node:
                return
            self.clock.sleep(1e-3)

    def manager(self) -> LockManager:
        """A lock manager for this node (run it with ``.run(stop_event)``)."""
        local = self._local.mutex(self.header.max_locks) if self._local is not None else None
        # the pool's view of the leases: a node its manager judged stale is stale
        # to this process's frees and reclaims at the same moment
        return LockManager(self._space(self.space.liveness), self.header.max_locks, local)

    def lock(self, name: str) -> Lock:
        """The named lock; use as ``with pool.lock(name):`` or
        ``with pool.lock(name)(timeout=2.0):``."""
        lock = self._locks.get(name)
        if lock is None:
            if self.node is None:
                raise ConfigError("a pool opened with Pool.observe takes no locks; open it "
                                  "with Pool.open(path, node)")
            if name not in self._names:
                raise ConfigError(f"pool has no lock named {name!r}; it has "
                                  f"{sorted(self._names)}")
            index = self._names[name]
            local = fast = None
            if self._local is not None:
                local = self._local.mutex(index)
                if self.header.lock_mode_name == "manager":
                    fast = self._fast_path(index)
            lock = self._locks[name] = Lock(self.space, self.header.lock_mode_name, index, name,
                                            local, fast, waited=self._lock_waited)
        return lock

    def _lock_waited(self, seconds: float) -> None:
        self.stats.add(lock_waits=1, lock_wait_ns=max(0, int(seconds * 1e9)))

    def counters(self) -> dict[int, dict[str, int]]:
        """Every node's counters (`tract.stats.COUNTERS`), read fresh; nodes
        whose counters are all zero are left out."""
        if self.stats is not None:
            self.stats.publish()  # this process's counts so far
        table = read_stats(self.region, self.header.stats, self.header.max_nodes)
        return {node: dict(zip(COUNTERS, map(int, row))) for node, row in enumerate(table)
                if row.any()}

    def leave(self) -> None:
        """Tell the other nodes this node is gone for good (not only this process)."""
        self.nodes.leave(self.node)

    def _stop_threads(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def close(self) -> None:
        """Close this process's handle.  The node's last process (no other
        live one in the node-local member list, judged and acted on under
        its flock, so no process joins meanwhile) first hands back what the
        node holds that nothing references and leaves the node table
        (`_hand_back`): a clean close leaves a clean pool."""
        try:
            if self._local is not None and not self.region.closed:
                self._local.lock()
                if self._local.alone():
                    self._hand_back()
            self._stop_threads()
            if self.stats is not None and not self.region.closed:
                self.stats.publish()
        finally:
            self._locks.clear()
            self._fast_paths.clear()
            self.allocator.heap = None
            if self._local is not None:
                self.own.detach()
                self._local.close()
            self.region.close()

    def _hand_back(self) -> None:
        """The node's last process closes: free the blocks other nodes
        queued for its slabs, give back its empty slabs, then leave, so
        that every other node judges the rest (slabs and extents still
        referenced by the index or an object) as a gone owner's at once, to
        reclaim once unreferenced (R6).  What a
        lease of waiting for the ``alloc`` lock cannot give back stays,
        reclaimable; a process whose own lease lapsed writes nothing."""
        if not self.space.liveness.live(self.node):
            return
        try:
            self.allocator.drain(self.header.lease_timeout)
            self.allocator.trim(self.header.lease_timeout)
        except TractError:
            pass  # left to the allocator's reclaim, once this node has left
        self.leave()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_owner(path: str, allowed: bool) -> None:
    if allowed or os.environ.get("TRACT_ALLOW_OTHER_OWNER") == "1" or is_dax_path(path):
        return
    try:
        owner = os.stat(path).st_uid
    except FileNotFoundError:
        return  # open_region names the missing file
    if owner != os.geteuid():
        raise PermissionError(f"pool {path!r} is owned by uid {owner}, not this process's "
                              f"({os.geteuid()}); pass allow_other_owner=True (or set "
                              f"TRACT_ALLOW_OTHER_OWNER=1) to trust it")


class NodeLocal:
    """A node's file in /dev/shm: per lock a slot (tier-1 mutex, cohort
    words), the pids of the node's processes that have the pool open, and
    the node's slab heap.  Made and joined under an flock, which the opener
    holds until `unlock` (after it joined the node table and checked the
    heap's incarnation)."""

    @staticmethod
    def path_of(header: Header, node: int) -> str:
        return os.path.join(_LOCAL_DIR, f"tract-{header.uuid.hex}-node{node}.local")

    @staticmethod
    def shape(header: Header) -> tuple[int, int, int]:
        """(members offset, heap offset, file size): one slot per lock, one
        for the manager, one for the free rings' turn (`RingTurn`) and one
        for the node's lease (`tract.lease.OwnLease`), the member pids, the
        slab heap."""
        members = _round_up((header.max_locks + 3) * SLOT_BYTES, 4096)
        heap = members + MEMBERS * 8
        return members, heap, heap + heap_bytes(header.nchunks, header.chunk_size,
                                                SLAB_MIN_BLOCK)

    def __init__(self, header: Header, node: int):
        self.path = self.path_of(header, node)
        self.max_locks = header.max_locks
        self.members, self.heap_offset, size = self.shape(header)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            fresh = os.fstat(self._fd).st_size == 0
            if fresh:
                os.ftruncate(self._fd, size)
            self.region = open_region(self.path, coherence="hardware", size=size)
            if fresh:
                for index in range(header.max_locks + 2):
                    LocalMutex(self.region, index * SLOT_BYTES).initialize()
                LocalMutex(self.region, self.heap_offset).initialize()
            self.heap = NodeHeap(self.region, LocalMutex(self.region, self.heap_offset),
                                 self.heap_offset, header.nchunks, header.chunk_size,
                                 SLAB_MIN_BLOCK, header.heap)
            self.first = not self._enter()
        except BaseException:
            os.close(self._fd)
            raise

    def _enter(self) -> bool:
        """Add this process to the members (dropping dead ones); whether
        another live process of the node was there."""
        region, pid, others, free = self.region, os.getpid(), False, None
        for index in range(MEMBERS):
            slot = self.members + index * 8
            member = region.load_u64(slot)
            if member and not pid_alive(member):
                region.store_u64(slot, member := 0)
            if member:
                others = True
            elif free is None:
                free = slot
        if free is None:
            raise ConfigError(f"{self.path}: {MEMBERS} processes of this node already have the "
                              f"pool open")
        region.store_u64(free, pid)
        self._slot = free
        return others

    def lock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def alone(self) -> bool:
        """Whether no other live process of the node is a member (another
        handle of this process counts); call it under `lock`."""
        for index in range(MEMBERS):
            slot = self.members + index * 8
            member = self.region.load_u64(slot)
            if slot != self._slot and member and pid_alive(member):
                return False
        return True

    def member_pids(self) -> tuple[int, ...]:
        """The pids in the member list, live or not, in slot order."""
        slots = self.region.view(self.members, MEMBERS * 8).view(np.uint64)
        return tuple(slots[slots != 0].tolist())

    def mutex(self, index: int) -> LocalMutex:
        return LocalMutex(self.region, index * SLOT_BYTES)

    def lease_words(self) -> np.ndarray:
        """The node's `tract.lease.OwnLease` words (the slot after the rings')."""
        return self.region.view((self.max_locks + 2) * SLOT_BYTES, 8 * LEASE_WORDS).view(np.uint64)

    def rings(self) -> RingTurn:
        """The node's turn at its free rings (the slot after the manager's)."""
        return RingTurn(self.mutex(self.max_locks + 1))

    def fast_path(self, index: int, pool: Pool) -> ManagerFastPath:
        """The native manager-mode fast path of lock ``index`` for ``pool``'s node."""
        layout = pool.layout
        return ManagerFastPath(pool.region, self.region, self.mutex(index), index * SLOT_BYTES,
                               layout.request_line(index, pool.node), layout.manager_line,
                               layout.grant_line(index, 0), pool.node, layout.max_nodes,
                               COHORT_PASSES)

    def close(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if self.region.load_u64(self._slot) == os.getpid():
                self.region.store_u64(self._slot, 0)
        finally:
            os.close(self._fd)
        self.region.close()


def pool_info(path: str, watch: float = 0.5) -> dict:
    """What `tract pool info` shows: layout, nodes (is each heartbeat moving
    over ``watch`` seconds), occupancy and lock holders.  Writes nothing."""
    from tract._kernels.bitmap import count_free
    from tract.lease import ABSENT
    from tract.lock import TIER2, read_manager

    pool = Pool.observe(path)
    try:
        header = pool.header
        before = [pool.nodes.read(node) for node in range(header.max_nodes)]
        pool.clock.sleep(min(watch, header.lease_timeout))
        nodes = []
        for node, (beat, epoch, state) in enumerate(before):
            now_beat, now_epoch, now_state = pool.nodes.read(node)
            if now_state == ABSENT:
                continue
            moving = now_beat != beat or now_epoch != epoch
            nodes.append(dict(node=node, state=("alive" if now_state == ALIVE else "left"),
                              epoch=now_epoch, heartbeat=("beating" if moving else
                                                          f"still for >= {watch} s")))
        free = count_free(pool.allocator._bitmap(), header.nchunks)
        pool.space.fresh(pool.layout.manager_line)
        manager, manager_epoch = read_manager(pool.space)
        locks = []
        for index, name in header.lock_names:
            holder, epoch = TIER2[header.lock_mode_name](pool.space, index, name).holder()
            locks.append(dict(name=name, holder=holder, epoch=epoch))
        flush = (platform.FLUSH_CHOICES[header.flush]
                 if header.flush < len(platform.FLUSH_CHOICES) else "other")
        return dict(size=header.size, layout_version=header.version, uuid=str(header.uuid),
                    coherence=header.coherence_name, flush=flush, lock_mode=header.lock_mode_name,
                    lease_timeout=header.lease_timeout, chunk_size=header.chunk_size,
                    areas=header.areas(), max_objects=header.max_objects,
                    objects=len(pool.objects.list()), index_capacity=header.index_capacity,
                    chunks=dict(total=header.nchunks, free=free, taken=header.nchunks - free),
                    nodes=nodes, manager=dict(node=manager, epoch=manager_epoch), locks=locks)
    finally:
        pool.close()
