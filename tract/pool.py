"""A pool: header, node table, lock area (this issue's minimal layout; the
pool issue adds the allocator, object directory and index areas).

Layout (every area line-aligned, in this order, none overlapping):

    0        header      magic, layout version, uuid, size, limits, modes,
                         area offsets, hash key; written once at creation
    4096     node table  one line per node (`tract.lease`)
             lock names  32 bytes per lock, written once at creation
             lock area   `tract.lock.LockLayout`
             heap        the rest (unused until the allocator lands)

Rules relied on (DESIGN.md): R1 — areas are named by offset; R3 — the
header is written, flushed and fenced before anyone can open the pool;
R5 — every field read from the header is range-checked at open, and a
foreign magic, another layout version or areas that overlap or leave the
pool are refused with what was expected and what was found; R6 — every
process beats its node's heartbeat from a daemon thread.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
import uuid

from tract import platform
from tract._native._localmutex import LocalMutex
from tract._native._lockfast import SLOT_BYTES, ManagerFastPath
from tract.errors import ConfigError, CorruptionError
from tract.lease import LINE, Clock, NodeTable
from tract.lock import COHORT_PASSES, LOCK_MODES, Lock, LockLayout, LockManager, LockSpace
from tract.region import create_region, open_region

__all__ = ["DEFAULT_LOCKS", "Pool", "format_pool"]

MAGIC = int.from_bytes(b"TRACTPL\x01", "little")
LAYOUT_VERSION = 1
HEADER_BYTES = 4096
NAME_BYTES = 32
DEFAULT_LOCKS = ("alloc", "objects", "index")
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,30}$")
_LOCAL_DIR = "/dev/shm"  # node-local: tier-1 mutexes never live in the pool

# header field offsets
_F = dict(magic=0, version=8, uuid=16, size=32, max_nodes=40, max_locks=48, lock_mode=56,
          coherence=64, flush=72, lease_us=80, node_table=88, names=96, lock_area=104,
          lock_area_size=112, heap=120, hash_key=128, created_ns=144)


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _areas(max_nodes: int, max_locks: int) -> dict[str, int]:
    node_table = HEADER_BYTES
    names = node_table + max_nodes * LINE
    lock_area = _round_up(names + max_locks * NAME_BYTES, LINE)
    size = LockLayout(lock_area, max_nodes, max_locks).nbytes
    return dict(node_table=node_table, names=names, lock_area=lock_area, lock_area_size=size,
                heap=_round_up(lock_area + size, 4096))


def format_pool(region, *, max_nodes: int = 16, locks=DEFAULT_LOCKS, max_locks: int = 16,
                lock_mode: str = "manager", lease_timeout: float = 2.0) -> None:
    """Write a fresh pool header and zeroed metadata into ``region``."""
    if not 1 <= max_nodes <= 4096:
        raise ConfigError(f"max_nodes must be in 1..4096, got {max_nodes}")
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
    for name in locks:
        if not _NAME.match(name):
            raise ConfigError(f"lock name {name!r} must match {_NAME.pattern}")
    if len(set(locks)) != len(locks):
        raise ConfigError(f"lock names repeat: {list(locks)}")
    areas = _areas(max_nodes, max_locks)
    if areas["heap"] > region.size:
        raise ConfigError(f"a pool for {max_nodes} nodes and {max_locks} locks needs at least "
                          f"{areas['heap']} bytes, got {region.size}")
    region.fill(0, areas["heap"], 0)
    fields = dict(areas, magic=0, version=LAYOUT_VERSION, size=region.size, max_nodes=max_nodes,
                  max_locks=max_locks, lock_mode=LOCK_MODES.index(lock_mode),
                  coherence=platform.COHERENCE_MODES.index(control.coherence),
                  flush=_flush_code(control), lease_us=int(lease_timeout * 1e6),
                  created_ns=time.time_ns())
    for field, value in fields.items():
        region.store_u64(_F[field], value)
    region.copy_in(_F["uuid"], uuid.uuid4().bytes, nontemporal=False)
    region.copy_in(_F["hash_key"], os.urandom(16), nontemporal=False)
    for index, name in enumerate(locks):
        region.copy_in(areas["names"] + index * NAME_BYTES, name.encode(), nontemporal=False)
    region.flush(0, areas["heap"])
    region.fence()
    region.store_u64(_F["magic"], MAGIC)  # published last: a half-made pool is foreign
    region.flush(0, LINE)
    region.fence()


def _flush_code(control) -> int:
    return platform.FLUSH_CHOICES.index(control.chosen) if control.chosen in \
        platform.FLUSH_CHOICES else len(platform.FLUSH_CHOICES)


class Header:
    """The header's fields, read fresh and checked (R5)."""

    def __init__(self, region):
        region.invalidate(0, HEADER_BYTES)
        region.fence()
        read = {field: region.load_u64(offset) for field, offset in _F.items()
                if field not in ("uuid", "hash_key")}
        where = getattr(region, "path", "<pool>")
        if read["magic"] != MAGIC:
            raise CorruptionError(f"{where!r} is not a tract pool: magic {read['magic']:#x} at "
                                  f"offset 0, expected {MAGIC:#x}")
        if read["version"] != LAYOUT_VERSION:
            raise CorruptionError(f"{where!r} has pool layout version {read['version']}, this "
                                  f"tract reads version {LAYOUT_VERSION}")
        if read["size"] != region.size:
            raise CorruptionError(f"{where!r} header says {read['size']} bytes, the mapping has "
                                  f"{region.size}")
        for field, low, high, limit in (("max_nodes", 1, 4096, None), ("max_locks", 1, 1024, None),
                                        ("lock_mode", 0, len(LOCK_MODES) - 1, None),
                                        ("coherence", 0, len(platform.COHERENCE_MODES) - 1, None),
                                        ("lease_us", 1, 3600 * 10**6, None)):
            if not low <= read[field] <= high:
                raise CorruptionError(f"{where!r} header field {field} at offset {_F[field]} is "
                                      f"{read[field]}, expected {low}..{high}")
        expected = _areas(read["max_nodes"], read["max_locks"])
        for field, value in expected.items():
            if read[field] != value:
                raise CorruptionError(f"{where!r} header field {field} at offset {_F[field]} is "
                                      f"{read[field]}, expected {value} for {read['max_nodes']} "
                                      f"nodes and {read['max_locks']} locks")
        if expected["heap"] > region.size:
            raise CorruptionError(f"{where!r}: its areas end at {expected['heap']}, past the pool "
                                  f"size {region.size}")
        self.__dict__.update(read)
        self.uuid = uuid.UUID(bytes=region.read(_F["uuid"], 16))
        self.hash_key = region.read(_F["hash_key"], 16)
        self.lock_mode_name = LOCK_MODES[self.lock_mode]
        self.coherence_name = platform.COHERENCE_MODES[self.coherence]
        self.lease_timeout = self.lease_us / 1e6
        self.lock_names = []
        for index in range(self.max_locks):
            raw = region.read(self.names + index * NAME_BYTES, NAME_BYTES).rstrip(b"\0")
            if not raw:
                continue
            name = raw.decode("ascii", "replace")
            if not _NAME.match(name):
                raise CorruptionError(f"{where!r} lock name {index} at offset "
                                      f"{self.names + index * NAME_BYTES} is {raw!r}")
            self.lock_names.append((index, name))


class Pool:
    """One node's handle on a pool: `Pool.create`, then `Pool.open` per process."""

    def __init__(self, region, node: int, *, clock: Clock | None = None, manager: bool = False,
                 heartbeat: bool = True, local_locks: bool = True):
        self.region = region
        self.header = header = Header(region)
        if not 0 <= node < header.max_nodes:
            raise ConfigError(f"node {node} is beyond this pool's max_nodes "
                              f"({header.max_nodes}): expected 0..{header.max_nodes - 1}")
        self.node = node
        self.clock = clock or Clock()
        self.nodes = NodeTable(region, header.node_table, header.max_nodes)
        self.layout = LockLayout(header.lock_area, header.max_nodes, header.max_locks)
        self.space = self._space()
        self.epoch = self._join()
        self._names = {name: index for index, name in header.lock_names}
        self._locks: dict[str, Lock] = {}
        self._fast_paths: dict[int, ManagerFastPath] = {}
        self._local = _NodeLocal(header.uuid, node, header.max_locks) if local_locks else None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        if heartbeat:
            self._start(self._beat, "heartbeat")
        if manager:
            self._start(lambda: self.manager().run(self._stop), "lock-manager")

    # --------------------------------------------------------- lifecycle

    @classmethod
    def create(cls, path: str, size: int, *, flush: str | None = None, coherence: str = "none",
               mode: int = 0o600, **layout) -> None:
        """Create a pool file (see `format_pool` for ``layout`` options)."""
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
             coherence: str | None = None) -> Pool:
        """Map a pool as node ``node``; ``manager=True`` runs a lock manager
        (active or standby) in a daemon thread."""
        region = open_region(path, flush=flush, coherence=coherence or "none")
        try:
            declared = Header(region).coherence_name
            if coherence is None and declared != "none":
                region.close()
                region = open_region(path, flush=flush, coherence=declared)
            return cls(region, node, manager=manager)
        except BaseException:
            if not region.closed:
                region.close()
            raise

    @staticmethod
    def destroy(path: str) -> None:
        """Remove a pool file and the node-local lock files of every node."""
        try:
            region = open_region(path)
            try:
                pool_uuid = Header(region).uuid
            finally:
                region.close()
        except (OSError, CorruptionError, ConfigError):
            pool_uuid = None  # not a readable pool: remove the file alone
        if pool_uuid is not None:
            for name in os.listdir(_LOCAL_DIR):
                if name.startswith(f"tract-{pool_uuid.hex}-node") and name.endswith(".locks"):
                    os.unlink(os.path.join(_LOCAL_DIR, name))
        os.unlink(path)

    def _space(self) -> LockSpace:
        return LockSpace(self.region, self.layout, self.nodes, self.node,
                         self.header.lease_timeout, self.clock)

    def _join(self) -> int:
        heartbeat, epoch, state = self.nodes.read(self.node)
        pid = self.region.load_u64(self.nodes.line(self.node) + 24)
        stale = state == 1 and not _pid_alive(pid)
        joined = self.nodes.join(self.node, stale)
        if joined != epoch:  # a new incarnation: drop claims the last one left
            for lock in range(self.header.max_locks + 1):
                request = self.layout.request_line(lock, self.node)
                self.space.fresh(request)
                seq = self.region.load_u64(request)
                self.region.store_u64(request + 8, seq)  # done
                self.region.store_u64(request + 16, seq)  # not waiting
                self.space.publish(request)
                ticket = self.layout.bakery_line(lock, self.node)
                self.region.store_u64(ticket, 0)
                self.region.store_u64(ticket + 8, 0)
                self.space.publish(ticket)
        return joined

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
        """Beat every quarter lease; give back a cohort hand-off of this node
        that no local process took for a whole beat (its waiter timed out or
        died)."""
        nodes = NodeTable(self.region, self.header.node_table, self.header.max_nodes)
        cohorting = self._local is not None and self.header.lock_mode_name == "manager"
        seen: dict[int, tuple[int, int, int]] = {}
        while not self._stop.wait(self.header.lease_timeout / 4):
            nodes.beat(self.node)
            if cohorting:
                for index in self._names.values():
                    words = self._fast_path(index).slot_words()
                    if words[0] and seen.get(index) == words:
                        self._fast_path(index).sweep()
                    seen[index] = words

    def manager(self) -> LockManager:
        """A lock manager for this node (run it with ``.run(stop_event)``)."""
        local = self._local.mutex(self.header.max_locks) if self._local is not None else None
        return LockManager(self._space(), self.header.max_locks, local)

    def lock(self, name: str) -> Lock:
        """The named lock; use as ``with pool.lock(name):`` or
        ``with pool.lock(name)(timeout=2.0):``."""
        lock = self._locks.get(name)
        if lock is None:
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
                                            local, fast)
        return lock

    def leave(self) -> None:
        """Tell the other nodes this node is gone for good (not only this process)."""
        self.nodes.leave(self.node)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        self._locks.clear()
        self._fast_paths.clear()
        if self._local is not None:
            self._local.close()
        self.region.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pid_alive(pid: int) -> bool:
    if pid <= 0 or pid > 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _NodeLocal:
    """The node-local file of tier-1 mutexes, one per lock, made once per
    node under an flock so concurrent first openers agree."""

    def __init__(self, pool_uuid, node: int, max_locks: int):
        path = os.path.join(_LOCAL_DIR, f"tract-{pool_uuid.hex}-node{node}.locks")
        size = _round_up((max_locks + 1) * SLOT_BYTES, 4096)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            fresh = os.fstat(fd).st_size == 0
            if fresh:
                os.ftruncate(fd, size)
            self.region = open_region(path, coherence="hardware")
            if fresh:
                for index in range(max_locks + 1):  # one per lock, one for the manager
                    LocalMutex(self.region, index * SLOT_BYTES).initialize()
        finally:
            os.close(fd)  # releases the flock
        self.path = path

    def mutex(self, index: int) -> LocalMutex:
        return LocalMutex(self.region, index * SLOT_BYTES)

    def fast_path(self, index: int, pool: Pool) -> ManagerFastPath:
        """The native manager-mode fast path of lock ``index`` for ``pool``'s node."""
        layout = pool.layout
        return ManagerFastPath(pool.region, self.region, self.mutex(index), index * SLOT_BYTES,
                               layout.request_line(index, pool.node), layout.manager_line,
                               layout.grant_line(index, 0), pool.node, layout.max_nodes,
                               COHORT_PASSES)

    def close(self) -> None:
        self.region.close()
