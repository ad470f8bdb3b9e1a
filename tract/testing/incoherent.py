"""A simulator of non-coherent shared memory, for proving tract's protocols
on machines whose memory is coherent (DESIGN.md §5).

Model.  `SimPool` holds the pool's memory and N simulated hosts.  Each
`SimHost` offers the interface of a native `tract.Region` (views, typed loads
and stores, flush, invalidate, write-back, fences, copies), so protocol code
runs on it unchanged.  A host sees the pool through a private copy, its
"cache", with per 64-byte line:

- a snapshot of what it last fetched, and the memory version it fetched;
- a dirty mark (any store; bytes written through a view are found by
  comparing the line with its snapshot);
- which bytes it stored through the interface since the fetch, and whether
  it read the line while it was stale.

Cache semantics, as on x86 with clflushopt/clwb (and aarch64 dc + dsb):

- ``flush`` writes the host's dirty lines back, then drops them (the next
  read refetches); ``invalidate`` drops them, writing back a dirty line first
  (as clflush does); ``writeback`` writes back and keeps the line;
- all three are weakly ordered: each only queues its lines, and the queue
  completes at the next fence of the same thread (a fence orders its own
  core's flushes, not another's), or earlier at random (chaos);
- a queued write-back carries the line as it was when queued: a store
  after the flush and before its fence stays in the cache, dirty (on
  hardware the flush may complete at once, and the store lands in a line
  fetched again), so a store moved past its write-back is never published
  by it;
- at every synchronisation call, with probability ``chaos``, random lines of
  random hosts are spontaneously written back (eviction) or refetched
  (prefetch), and random queued operations complete early, in any order;
- a line a host never drops stays stale for ever: with ``chaos=0`` nothing
  but the protocol's own flushes moves data, so progress that relies on
  luck shows up as a livelock.

Detection.  A write-back that overwrites bytes another host wrote back after
this host fetched the line is a `LostUpdate` (R2 broken), unless this host
stored every byte of the line since the fetch and never read it stale: a
line written whole replaces memory on the hardware too, whatever was cached
before (a read-modify-write of a stale line is still caught); a read of a line
that another host has written back since this host fetched it is a
`StaleRead` (R4 broken).  Both are recorded with offsets, hosts and a short
trace; ``raise_on_lost_update`` / ``raise_on_stale_read`` raise at once.

Trace.  `SimHost.trace_start` / `trace_stop` record the host's cache
control in the format of the native `Region.trace_stop` (DESIGN.md §5):
``(instruction, line offset)`` per line a flush, invalidate or write-back
touches, with the instructions a given `CacheControl` would issue (the
process default), and ``(TRACE_*FENCE, -1)`` per fence; copies record what
the native copies issue (write-backs of the lines not streamed whole, the
store fence).  So a Python step traced here and on a real mapping can be
compared batch by batch.

Scheduling.  `SimPool.run` runs one function per host in threads, but only
one at a time: a seeded scheduler passes the baton between them at every
simulated memory operation, so a seed fixes the interleaving, the chaos and
therefore the whole run, bit for bit.  A failing run raises
`SimulationFailure` carrying its seed.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import random
import threading

import numpy

from tract import platform
from tract._native import _region
from tract.errors import BoundsError, ConfigError, TractError
from tract.lines import LINE
from tract.platform import CacheControl

__all__ = [
    "CRASHED",
    "LINE",
    "LostUpdate",
    "SimClock",
    "SimHost",
    "SimMutex",
    "SimNodeLocal",
    "SimPool",
    "SimulationFailure",
    "StaleRead",
]

_FENCES = {"fence": _region.TRACE_FENCE, "store_fence": _region.TRACE_STORE_FENCE,
           "load_fence": _region.TRACE_LOAD_FENCE}
_WHOLE = b"\x01" * LINE  # a line's store record when every byte of it was stored
_SIM_CONTROL = CacheControl("none", "simulated", "simulated", "simulated", "simulated",
                            "simulated", "simulated", "simulated", "simulator")


class SimulationFailure(TractError):
    """A simulated run failed; the message names the seed that replays it."""

    def __init__(self, message: str, seed: int):
        super().__init__(f"{message} [replay with seed={seed}]")
        self.seed = seed


class _Abort(BaseException):
    """Unwinds a simulated host when the run is being torn down."""


class _Crashed(BaseException):
    """Unwinds a thread of a host that crashed (`SimPool.crash`)."""


CRASHED = "crashed"  # what `SimPool.run` reports for a thread of a crashed host


@dataclasses.dataclass
class LostUpdate:
    """A write-back clobbered bytes another host had written back (R2)."""

    line_offset: int
    offsets: list[int]
    host: int
    overwritten_host: int
    trace: list[str]


@dataclasses.dataclass
class StaleRead:
    """A host read a line another host had written back since it fetched it (R4)."""

    line_offset: int
    host: int
    writer: int
    trace: list[str]


class _LostUpdateError(TractError):
    pass


class _StaleReadError(TractError):
    pass


class SimPool:
    """Backing memory plus ``hosts`` simulated hosts; see the module docstring.

    Parameters
    ----------
    size : int
        Bytes of pool memory (zeroed).
    hosts : int
        Number of simulated hosts; ``pool.hosts[i]`` is host ``i``'s region.
    seed : int
        Seeds the scheduler and the chaos; the same seed replays the run.
    chaos : float
        Probability, at each synchronisation call, of spontaneous cache
        events (write-backs, refetches, early completion of queued flushes).
    switch : float
        Probability of switching to another host at each memory operation.
    max_steps : int
        Operations after which a run counts as a livelock.
    """

    def __init__(self, size: int, hosts: int = 2, *, seed: int = 0, chaos: float = 0.2,
                 chaos_events: int = 3, switch: float = 0.3, max_steps: int = 200_000,
                 raise_on_lost_update: bool = False, raise_on_stale_read: bool = False):
        if size <= 0 or size % LINE:
            raise ValueError(f"simulated pool size {size} must be a positive multiple of {LINE}")
        if hosts < 1:
            raise ValueError(f"a simulated pool needs at least one host, got {hosts}")
        self.size = size
        self.seed = seed
        self.chaos = chaos
        self.chaos_events = chaos_events
        self.switch = switch
        self.max_steps = max_steps
        self.raise_on_lost_update = raise_on_lost_update
        self.raise_on_stale_read = raise_on_stale_read
        self.rng = random.Random(seed)
        #: the key to format this pool with (`format_pool(hash_key=...)`):
        #: made from the seed, so that a seed replays the run whole (a random
        #: key would change every block key and the evictor's tie-breaks)
        self.hash_key = random.Random(f"hash_key:{seed}").randbytes(16)
        self.memory = numpy.zeros(size, dtype=numpy.uint8)
        lines = size // LINE
        self.version = numpy.zeros(lines, dtype=numpy.int64)
        self.last_writer = numpy.full(lines, -1, dtype=numpy.int64)
        self.lost_updates: list[LostUpdate] = []
        self.stale_reads: list[StaleRead] = []
        self.trace: collections.deque[str] = collections.deque(maxlen=24)
        self.steps = 0
        self._hot: list[int] = []  # lines touched, in first-touch order
        self._touched: set[int] = set()
        self._watched: dict[int, set[int]] = {}  # host -> lines it touched since `watch`
        self.hosts = [SimHost(self, index) for index in range(hosts)]
        self.clock = SimClock(self)
        self.slept = 0.0
        # scheduler state: exactly one simulated thread runs, the one named
        # `_running`; each other waits on its own turnstile (a lock held
        # locked), which the thread handing it the turn releases
        self._turns: dict[int, threading.Lock] = {}
        self._running: int | None = None
        self._alive: list[int] = []
        self._aborting = False
        self._thread = threading.local()
        self._wake: dict[int, float] = {}
        self._crash_at: dict[int, int] = {}
        self.crashed: set[int] = set()

    # ------------------------------------------------------------ copies

    def clone(self) -> SimPool:
        """This pool as it is now, copied whole between runs: memory, each
        host's cache, marks and queued flushes, the step count and the
        scheduler's random state.  A run on the copy is the run this pool
        would make (a test formats once and copies for each crash point)."""
        if self._running is not None or self._alive:
            raise RuntimeError("a simulated pool is copied only between runs")
        return copy.deepcopy(self)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_turns"], state["_thread"]  # the scheduler's, made anew for the copy
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._turns = {}
        self._thread = threading.local()

    # ------------------------------------------------------------ running

    def run(self, *functions) -> list:
        """Run each function as one simulated thread, interleaved by the
        seeded scheduler: a plain callable ``functions[i]`` runs on host i;
        a pair ``(host_index, callable)`` runs on that host, so several
        threads can share one host (and its cache, coherently).  Returns
        their results; raises `SimulationFailure` (naming the seed) if any
        raised or the run exceeded ``max_steps``."""
        placed = [item if isinstance(item, tuple) else (index, item)
                  for index, item in enumerate(functions)]
        for host, _ in placed:
            if not 0 <= host < len(self.hosts):
                raise ValueError(f"host {host} does not exist; the pool has {len(self.hosts)}")
        results: list = [None] * len(placed)
        errors: list[tuple[int, BaseException]] = []

        def body(index: int) -> None:
            self._thread.index = index
            self._thread.host = placed[index][0]
            self._turns[index].acquire()  # its first turn
            host, function = placed[index]
            try:
                results[index] = function(self.hosts[host])
            except _Abort:
                pass
            except _Crashed:
                results[index] = CRASHED
            except BaseException as error:  # reported with the seed below
                errors.append((index, error))
                self._aborting = True
            finally:
                self._alive.remove(index)
                self._running = self._pick() if self._alive else None
                if self._running is not None:
                    self._turns[self._running].release()

        self._alive = list(range(len(placed)))
        self._aborting = False
        self._turns = {index: threading.Lock() for index in self._alive}
        for turnstile in self._turns.values():
            turnstile.acquire()
        threads = [threading.Thread(target=body, args=(i,), daemon=True)
                   for i in range(len(placed))]
        for thread in threads:
            thread.start()
        self._wake = {}
        self._running = self._pick()
        self._turns[self._running].release()
        for thread in threads:
            thread.join()
        if errors:
            index, error = errors[0]
            raise SimulationFailure(f"thread {index} on host {placed[index][0]} failed: "
                                    f"{type(error).__name__}: {error}", self.seed) from error
        return results

    def _step(self, host: int, what: str, line: int, force: bool = False) -> None:
        """One simulated operation: maybe switch threads (always, with
        ``force``, when another can run), count, trace."""
        self.steps += 1
        self.trace.append(f"h{host} {what} @{line * LINE}")
        if self._crash_at or self.crashed:
            self._maybe_crash(host)
        if line >= 0 and line not in self._touched:
            self._touched.add(line)
            self._hot.append(line)
        if line >= 0 and host in self._watched:
            self._watched[host].add(line * LINE)
        if self._aborting:
            raise _Abort()
        if self.steps > self.max_steps:
            self._aborting = True
            raise SimulationFailure(f"no progress after {self.max_steps} operations "
                                    f"(livelock); last: {list(self.trace)[-6:]}", self.seed)
        me = getattr(self._thread, "index", None)
        if me is None or self._running is None or (len(self._alive) < 2 and not force):
            return
        if force:
            target = self._pick()
        elif self.rng.random() < self.switch:
            target = self._pick()
        else:
            return
        if target == me:
            return
        self._running = target
        self._turns[target].release()
        self._turns[me].acquire()  # until a thread hands the turn back
        if self._aborting:
            raise _Abort()

    @contextlib.contextmanager
    def watch(self, host: int):
        """The pool offsets of the lines host ``host`` reads, writes, flushes
        or drops inside the block: a set, filled as it runs."""
        if host in self._watched:
            raise RuntimeError(f"host {host}'s lines are already watched")
        self._watched[host] = lines = set()
        try:
            yield lines
        finally:
            del self._watched[host]

    def crash(self, host: int, after: int) -> None:
        """Make host ``host`` die after ``after`` more of its memory
        operations: its cache (dirty lines included) and its queued flushes
        are lost, and each of its threads stops (`run` reports CRASHED for
        it) at its next operation."""
        if not 0 <= host < len(self.hosts):
            raise ValueError(f"host {host} does not exist; the pool has {len(self.hosts)}")
        self._crash_at[host] = after

    def _maybe_crash(self, host: int) -> None:
        mine = getattr(self._thread, "host", None)
        if mine in self.crashed:
            raise _Crashed()
        left = self._crash_at.get(host)
        if left is None or host != mine:
            return
        if left > 0:
            self._crash_at[host] = left - 1
            return
        del self._crash_at[host]
        self.crashed.add(host)
        dead = self.hosts[host]
        dead._queues.clear()
        dead._queued.clear()
        dead._cache[:] = self.memory
        dead._snapshot[:] = self.memory
        dead._fetched[:] = self.version
        dead._marked[:] = False
        dead._stored[:] = False
        dead._read_stale[:] = False
        self.trace.append(f"h{host} crashed")
        raise _Crashed()

    def _pick(self) -> int:
        """A thread to run next: any thread not asleep; when all are asleep,
        virtual time jumps to the earliest wake-up."""
        now = self.clock.now()
        ready = [index for index in self._alive if self._wake.get(index, 0.0) <= now]
        if not ready:
            wake = min(self._wake[index] for index in self._alive)
            self.slept += wake - now
            ready = [index for index in self._alive if self._wake[index] <= wake]
        return self.rng.choice(ready)

    def _sleep(self, seconds: float) -> None:
        """Block the calling simulated thread for ``seconds`` of virtual time."""
        me = getattr(self._thread, "index", None)
        if me is None or self._running is None:
            self.slept += max(seconds, 0.0)
            return
        self._wake[me] = self.clock.now() + max(seconds, SimClock.TICK)
        self._step(-1, "sleep", -1, force=True)
        self._wake.pop(me, None)

    def _chaos(self) -> None:
        """Spontaneous cache events at a synchronisation call."""
        if self.chaos <= 0 or self.rng.random() >= self.chaos or not self._hot:
            return
        for _ in range(self.chaos_events):
            host = self.hosts[self.rng.randrange(len(self.hosts))]
            event = self.rng.random()
            queues = [queue for queue in host._queues.values() if queue]
            if event < 0.4 and queues:
                queue = self.rng.choice(queues)
                line = self.rng.choice(list(queue))
                host._complete(line, queue.pop(line))
            else:
                line = self.rng.choice(self._hot)
                if event < 0.7:
                    host._write_back(line)   # eviction (no-op when clean)
                else:
                    host._refetch(line)      # prefetch (writes back a dirty line first)


class SimClock:
    """Virtual time for lease logic under the simulator: a microsecond per
    simulated operation plus every sleep, so the same seed gives the same
    expiries.  Has the methods of `tract.lease.Clock`."""

    TICK = 1e-6

    def __init__(self, pool: SimPool):
        self.pool = pool

    def now(self) -> float:
        return self.pool.steps * self.TICK + self.pool.slept

    def wall(self) -> float:
        """Virtual wall time: a fixed date plus `now`."""
        return 1.7e9 + self.now()

    def sleep(self, seconds: float) -> None:
        self.pool._sleep(seconds)


class SimNodeLocal:
    """A node's local memory under the simulator (the node-local file of
    `tract.pool.NodeLocal`): one host's, so coherent, with the typed loads
    and stores and the host-atomic adds of a native Region; every access is
    a scheduling point of ``host``."""

    def __init__(self, pool: SimPool, host: int, size: int):
        self.pool, self.host = pool, host
        self.words = numpy.zeros(size // 8, dtype=numpy.uint64)
        self.path = f"<simulated node-local memory, host {host}>"

    def _at(self, offset: int, count: int = 1) -> int:
        if offset % 8 or not 0 <= offset <= 8 * (len(self.words) - count):
            raise BoundsError(f"node-local words [{offset}, {offset + 8 * count}) are not "
                              f"8-byte aligned inside {8 * len(self.words)} bytes")
        self.pool._step(self.host, "local", -1)
        return offset // 8

    def load_u64(self, offset: int) -> int:
        return int(self.words[self._at(offset)])

    def load_u64s(self, offset: int, count: int) -> tuple[int, ...]:
        at = self._at(offset, count)
        return tuple(int(word) for word in self.words[at:at + count])

    def store_u64(self, offset: int, value: int) -> None:
        self.words[self._at(offset)] = value

    def local_add_u64s(self, offset: int, deltas) -> None:
        at = self._at(offset, len(deltas))
        self.words[at:at + len(deltas)] += numpy.asarray(deltas, dtype=numpy.uint64)


class SimMutex:
    """A robust node-local mutex under the simulator, with the interface of
    `tract._native._localmutex.LocalMutex`: a simulated thread that ends
    while holding it (a process of the node that died) leaves it to the next
    taker, who is told so (True) and calls `consistent`."""

    def __init__(self, pool: SimPool):
        self.pool = pool
        self.holder: int | None = None
        self.dead = False  # taken over from a holder that died: not consistent yet

    def try_acquire(self) -> bool | None:
        pool = self.pool
        me = pool._thread.index
        pool._step(pool._thread.host, "mutex", -1)
        if self.holder is not None and self.holder in pool._alive:
            return None
        died = self.holder is not None or self.dead
        self.holder, self.dead = me, died
        return died

    def acquire(self, timeout: float | None = None) -> bool:
        start = self.pool.clock.now()
        while (died := self.try_acquire()) is None:
            if timeout is not None and self.pool.clock.now() - start > timeout:
                raise TimeoutError(f"simulated local mutex still held after {timeout} s")
            self.pool.clock.sleep(SimClock.TICK * 16)
        return died

    def consistent(self) -> None:
        self.dead = False

    def release(self) -> None:
        if self.holder != self.pool._thread.index:
            raise RuntimeError("simulated local mutex released by a thread that does not hold it")
        if self.dead:
            raise RuntimeError("simulated local mutex released after its holder died without "
                               "`consistent` (a real one would be unusable)")
        self.holder = None


class SimHost:
    """One simulated host's view of a `SimPool`, with a native Region's interface."""

    def __init__(self, pool: SimPool, index: int):
        self.pool = pool
        self.index = index
        self.path = f"<simulated pool, host {index}>"
        self.kind = "simulated"
        self.cache_control = _SIM_CONTROL
        self.nontemporal = "simulated"
        self.closed = False
        self._cache = pool.memory.copy()
        self._snapshot = pool.memory.copy()
        self._fetched = pool.version.copy()
        self._marked = numpy.zeros(len(pool.version), dtype=bool)
        self._stored = numpy.zeros(len(pool.memory), dtype=bool)  # since each line's fetch
        self._read_stale = numpy.zeros(len(pool.version), dtype=bool)
        # Per simulated thread (a core): line -> "flush" | "invalidate" |
        # "writeback".  A fence completes only its own thread's queue.
        self._queues: dict[int | None, dict[int, str]] = {}
        # line -> its bytes when last queued, and whether they were dirty then, kept once a
        # store follows (None until then: the line as it is)
        self._queued: dict[int, tuple[numpy.ndarray, bool] | None] = {}
        self._trace: list[tuple[int, int]] | None = None
        self._trace_capacity = 0
        self._trace_insns: dict[str, int] = {}
        self._trace_nontemporal = "none"
        self.trace_control: CacheControl | None = None

    # ---------------------------------------------------------- interface

    @property
    def size(self) -> int:
        return self.pool.size

    @property
    def base(self) -> int:
        return (self.index + 1) << 40  # distinct per host, as real mappings are

    def address(self, offset: int) -> int:
        self._check(offset, 0)
        return self.base + offset

    def offset_of(self, address: int) -> int:
        if not self.base <= address <= self.base + self.size:
            raise BoundsError(f"address {address:#x} is outside region {self.path!r} mapped "
                              f"at {self.base:#x} with size {self.size}")
        return address - self.base

    def view(self, offset: int = 0, length: int | None = None) -> numpy.ndarray:
        """The host's private copy: reads may be stale, writes dirty its lines."""
        length = self.size - offset if length is None else length
        self._check(offset, length)
        return self._cache[offset:offset + length]

    def close(self) -> None:
        self.closed = True

    def load_u8(self, offset: int) -> int:
        return self._load(offset, 1)

    def load_u16(self, offset: int) -> int:
        return self._load(offset, 2)

    def load_u32(self, offset: int) -> int:
        return self._load(offset, 4)

    def load_u64(self, offset: int) -> int:
        return self._load(offset, 8)

    def load_u64s(self, offset: int, count: int) -> tuple[int, ...]:
        if count < 0:
            raise ValueError(f"count {count} is negative")
        self._check(offset, count * 8, 8)
        self._read_lines(offset, count * 8, "load_u64s")
        return tuple(int(word) for word in
                     self._cache[offset:offset + count * 8].view("<u8"))

    def store_u8(self, offset: int, value: int) -> None:
        self._store(offset, 1, value)

    def store_u16(self, offset: int, value: int) -> None:
        self._store(offset, 2, value)

    def store_u32(self, offset: int, value: int) -> None:
        self._store(offset, 4, value)

    def store_u64(self, offset: int, value: int) -> None:
        self._store(offset, 8, value)

    def read(self, offset: int, length: int) -> bytes:
        self._check(offset, length)
        self._read_lines(offset, length, "read")
        return self._cache[offset:offset + length].tobytes()

    def copy_out(self, offset: int, dst) -> None:
        target = memoryview(dst).cast("B")
        if target.readonly:
            raise BufferError("copy_out target must be a writable C-contiguous buffer")
        self._check(offset, target.nbytes)
        self._read_lines(offset, target.nbytes, "copy_out")
        target[:] = self._cache[offset:offset + target.nbytes].tobytes()

    def copy_in(self, offset: int, src, nontemporal: bool = True) -> None:
        source = numpy.frombuffer(memoryview(src).cast("B"), dtype=numpy.uint8)
        self._check(offset, source.nbytes)
        self._write_lines(offset, source.nbytes, "copy_in")
        self._stored[offset:offset + source.nbytes] = True
        self._cache[offset:offset + source.nbytes] = source
        if nontemporal:
            # Streaming stores and the closing sfence: in memory on return.
            self._stream(offset, source.nbytes)
            self._traced(_region.TRACE_STORE_FENCE, -1)

    def _stream(self, offset: int, length: int, pieces: int = 0) -> None:
        """Streamed into memory: every line written back now; traced as
        the native streaming copy (of whole ``pieces`` when checksummed)."""
        for line in self._lines(offset, length):
            self._write_back(line)
        if self._trace is None:
            return
        kind = self._trace_nontemporal
        for at in range(offset, offset + length, pieces or length):
            size = pieces or length
            if kind == "none" or (pieces and size > 240 and at % LINE):
                lines = self._lines(at, size)  # plain stores, all written back
            elif pieces and size > 240:  # fused with XXH3: the last stripe's tail
                last = (size - 1) // LINE * LINE if kind == "sse2" else size // LINE * LINE
                lines = self._lines(at + last, size - last)
            else:
                head = min(-at % LINE, size)
                body = (size - head) // LINE * LINE
                lines = (self._lines(at, size) if not body else
                         [*self._lines(at, head), *self._lines(at + head + body,
                                                               size - head - body)])
            for line in lines:
                self._traced(self._trace_insns["writeback"], line * LINE)

    def copy_in_blocks(self, offsets, sources, sums=None, seed: int = 0, piece: int = 0) -> None:
        """`Region.copy_in_blocks`: non-temporal copies (one store fence),
        digests of pieces."""
        for offset, source in self._blocks(offsets, sources, sums, piece):
            size = memoryview(source).nbytes
            self.copy_in(offset, source, nontemporal=False)
            self._stream(offset, size, (piece or size) if sums is not None else 0)
        self._traced(_region.TRACE_STORE_FENCE, -1)
        self._digests(sources, sums, seed, piece)

    def copy_out_blocks(self, offsets, targets, sums=None, seed: int = 0, piece: int = 0) -> None:
        """`Region.copy_out_blocks`: every range dropped, one fence, copies."""
        blocks = self._blocks(offsets, targets, sums, piece)
        for offset, target in blocks:
            self.invalidate(offset, memoryview(target).nbytes, payload=True)
        self.fence()
        for offset, target in blocks:
            self.copy_out(offset, target)
        self._digests(targets, sums, seed, piece)

    def digest_blocks(self, offsets, length: int, sums, seed: int = 0, piece: int = 0) -> None:
        """`Region.digest_blocks`: each piece read through this host's
        cache and hashed; no cache control."""
        from tract._native._region import digest

        size = piece or length
        if length <= 0 or piece < 0 or length % size:
            raise ValueError(f"a {length}-byte range is not a whole number of {piece}-byte "
                             f"pieces")
        offsets = [int(offset) for offset in offsets]
        if len(sums) != len(offsets) * (length // size):
            raise ValueError(f"sums must hold {len(offsets) * (length // size)} digests, got "
                             f"{len(sums)}")
        for offset in offsets:
            self._check(offset, length)
        sums[:] = [digest(self.read(at, size), seed)
                   for offset in offsets for at in range(offset, offset + length, size)]

    @staticmethod
    def _blocks(offsets, buffers, sums, piece):
        offsets = [int(offset) for offset in offsets]
        if len(buffers) != len(offsets):
            raise ValueError(f"{len(offsets)} offsets need as many buffers, got {len(buffers)}")
        for i, buffer in enumerate(buffers):
            size = memoryview(buffer).nbytes
            if not size or (piece and size % piece):
                raise ValueError(f"buffer {i} of {size} bytes is empty or not a whole number "
                                 f"of {piece}-byte pieces")
        return list(zip(offsets, buffers))

    @staticmethod
    def _digests(buffers, sums, seed, piece) -> None:
        if sums is None:
            return
        from tract._native._region import digest

        digests = []
        for buffer in buffers:
            data = memoryview(buffer).cast("B")
            size = piece or data.nbytes
            digests += [digest(data[at:at + size], seed) for at in range(0, data.nbytes, size)]
        if len(digests) != len(sums):
            raise ValueError(f"sums must hold {len(digests)} digests, got {len(sums)}")
        sums[:] = digests

    def fill(self, offset: int, length: int, byte: int = 0) -> None:
        if not 0 <= byte <= 0xFF:
            raise ValueError(f"fill byte {byte} is not in 0..255")
        self._check(offset, length)
        self._write_lines(offset, length, "fill")
        self._stored[offset:offset + length] = True
        self._cache[offset:offset + length] = byte

    def invalidate_lines(self, offsets, payload: bool = False) -> None:
        for offset in self._line_offsets(offsets):
            self.invalidate(offset, LINE, payload)

    def flush_lines(self, offsets, payload: bool = False) -> None:
        for offset in self._line_offsets(offsets):
            self.flush(offset, LINE, payload)

    def gather_lines(self, offsets, out) -> None:
        offsets = self._line_offsets(offsets)
        if out.shape != (len(offsets), LINE):
            raise ValueError(f"out must be ({len(offsets)}, {LINE}) bytes, got {out.shape}")
        for row, offset in enumerate(offsets):
            out[row] = numpy.frombuffer(self.read(offset, LINE), dtype=numpy.uint8)

    def scatter_lines(self, offsets, lines) -> None:
        offsets = self._line_offsets(offsets)
        if lines.shape != (len(offsets), LINE):
            raise ValueError(f"lines must be ({len(offsets)}, {LINE}) bytes, got {lines.shape}")
        for row, offset in enumerate(offsets):
            self.copy_in(offset, lines[row].tobytes(), nontemporal=False)

    def local_add_u32s(self, offsets, delta: int):
        """As the native one: atomic among this host's threads (one runs at a time)."""
        found = numpy.empty(len(offsets), dtype=numpy.uint32)
        for row, offset in enumerate(int(o) for o in offsets):
            found[row] = value = self.load_u32(offset)
            if 0 <= value + delta <= 0xFFFFFFFF:
                self.store_u32(offset, value + delta)
        return found

    def local_add_u64s(self, offset: int, deltas) -> None:
        """As the native one: atomic among this host's threads (one runs at a time)."""
        for i, delta in enumerate(int(d) for d in deltas):
            if delta:
                at = offset + 8 * i
                self.store_u64(at, (self.load_u64(at) + delta) & 0xFFFFFFFFFFFFFFFF)

    def store_u32s(self, offsets, value: int) -> None:
        for offset in offsets:
            self.store_u32(int(offset), value)

    def complete_early(self, offset: int, length: int) -> None:
        """Complete now this host's queued flushes and invalidations of the
        lines of a range, as the hardware may before any fence (chaos does
        it at random; a test can place it): an invalidated line is refetched
        at once, so it holds what memory held then (a prefetch)."""
        for queue in self._queues.values():
            for line in self._lines(offset, length):
                kind = queue.pop(line, None)
                if kind is not None:
                    self._complete(line, kind)

    def _line_offsets(self, offsets) -> list[int]:
        offsets = [int(offset) for offset in offsets]
        for row, offset in enumerate(offsets):
            if offset % LINE:
                raise BoundsError(f"offset {offset} (item {row}) is not aligned to a "
                                  f"{LINE}-byte line in region {self.path!r}")
        return offsets

    def compare_exchange_u64(self, offset: int, expected: int, desired: int) -> int:
        raise ConfigError(f"compare_exchange_u64 on {self.path!r}: simulated hosts share no "
                          f"coherence, so no atomics (atomic locks need coherence='hardware')")

    def flush(self, offset: int, length: int, payload: bool = False) -> None:
        self._enqueue(offset, length, "flush", "payload" if payload else "flush")

    def invalidate(self, offset: int, length: int, payload: bool = False) -> None:
        self._enqueue(offset, length, "invalidate", "payload" if payload else "invalidate")

    def writeback(self, offset: int, length: int) -> None:
        self._enqueue(offset, length, "writeback", "writeback")

    def fence(self) -> None:
        self._fence("fence")

    def store_fence(self) -> None:
        self._fence("store_fence")

    def load_fence(self) -> None:
        self._fence("load_fence")

    # --------------------------------------------------------------- trace

    @property
    def tracing(self) -> bool:
        """Whether this host's cache-control trace is on (`trace_start`)."""
        return self._trace is not None

    def trace_start(self, capacity: int = 1 << 16, memory=None) -> None:
        """Record this host's cache control as `Region.trace_start` does,
        naming the instructions `trace_control` (a `CacheControl`; None, the
        default: the process's, for a non-coherent pool) would issue.  No
        shadow ``memory``: a simulated host already runs against its pool's."""
        if memory is not None:
            raise ValueError(f"simulated host {self.index} runs against its pool's memory: "
                             f"it takes no shadow memory")
        if capacity <= 0:
            raise ValueError(f"trace capacity must be positive, got {capacity}")
        if self._trace is not None:
            raise RuntimeError("a cache-control trace is already on; trace_stop it first")
        control = self.trace_control or platform.cache_control(None, "none")
        self._trace_insns = {action: _region.INSTRUCTIONS[getattr(control, action)]
                             for action in ("flush", "invalidate", "writeback", "payload")}
        self._trace_nontemporal = control.nontemporal
        self._trace, self._trace_capacity = [], capacity

    def trace_stop(self) -> numpy.ndarray:
        """End the trace: an ``(n, 2)`` int64 array as `Region.trace_stop` returns."""
        if self._trace is None:
            raise RuntimeError("no cache-control trace is on")
        trace, self._trace = self._trace, None
        if len(trace) > self._trace_capacity:
            raise OverflowError(f"the cache-control trace held {self._trace_capacity} entries "
                                f"and {len(trace)} were made: start it with more")
        return numpy.array(trace, dtype=numpy.int64).reshape(-1, 2)

    def _traced(self, op: int, offset: int) -> None:
        if self._trace is not None and op != _region.INSTRUCTIONS["none"]:
            self._trace.append((op, offset))

    # ------------------------------------------------------------ internals

    def _check(self, offset: int, length: int, width: int = 1) -> None:
        if self.closed:
            raise ValueError(f"region {self.path!r} is closed")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise BoundsError(f"offset {offset} + length {length} is outside region "
                              f"{self.path!r} of size {self.size}")
        if offset % width:
            raise BoundsError(f"offset {offset} is not aligned to {width} bytes for a "
                              f"{width * 8}-bit access in region {self.path!r}")

    @staticmethod
    def _lines(offset: int, length: int) -> range:
        if length == 0:
            return range(0)
        return range(offset // LINE, (offset + length - 1) // LINE + 1)

    def _load(self, offset: int, width: int) -> int:
        self._check(offset, width, width)
        self._read_lines(offset, width, f"load_u{width * 8}")
        return int.from_bytes(self._cache[offset:offset + width].tobytes(), "little")

    def _store(self, offset: int, width: int, value: int) -> None:
        self._check(offset, width, width)
        if not 0 <= value < 1 << (width * 8):
            raise OverflowError(f"value {value!r} does not fit in u{width * 8} at offset {offset}")
        self._write_lines(offset, width, f"store_u{width * 8}")
        self._stored[offset:offset + width] = True
        self._cache[offset:offset + width] = numpy.frombuffer(
            value.to_bytes(width, "little"), dtype=numpy.uint8)

    def _read_lines(self, offset: int, length: int, what: str) -> None:
        pool = self.pool
        for line in self._lines(offset, length):
            pool._step(self.index, what, line)
            writer = int(pool.last_writer[line])
            if pool.version[line] > self._fetched[line] and writer != self.index:
                self._read_stale[line] = True
                record = StaleRead(line * LINE, self.index, writer, list(pool.trace))
                pool.stale_reads.append(record)
                if pool.raise_on_stale_read:
                    raise _StaleReadError(f"host {self.index} read line {line * LINE} that host "
                                          f"{writer} wrote back after it fetched it")

    def _write_lines(self, offset: int, length: int, what: str) -> None:
        for line in self._lines(offset, length):
            self.pool._step(self.index, what, line)
            if line in self._queued and self._queued[line] is None:
                # a store to a line whose flush is queued: that flush carries the line as it
                # was before this store (kept now, at the first such store only)
                self._queued[line] = (self._cache[line * LINE:(line + 1) * LINE].copy(),
                                      self._dirty(line))
            self._marked[line] = True

    def _enqueue(self, offset: int, length: int, kind: str, action: str) -> None:
        self._check(offset, length)
        for line in self._lines(offset, length):
            if self._trace is not None:
                self._traced(self._trace_insns[action], line * LINE)
            self.pool._step(self.index, kind, line)
            queue = self._queues.setdefault(getattr(self.pool._thread, "index", None), {})
            self._queued[line] = None  # carries the line as it is now (see `_write_lines`)
            queued = queue.get(line)
            # flush subsumes both; invalidate + writeback = flush
            if queued is None:
                queue[line] = kind
            elif queued != kind:
                queue[line] = "flush"
        self.pool._chaos()

    def _fence(self, what: str) -> None:
        self._traced(_FENCES[what], -1)
        self.pool._step(self.index, what, -1)
        queue = self._queues.pop(getattr(self.pool._thread, "index", None), {})
        for line, kind in queue.items():
            self._complete(line, kind)
        self.pool._chaos()

    def _complete(self, line: int, kind: str) -> None:
        queued = self._queued.pop(line, None)
        if kind == "writeback":
            self._write_back(line, queued)
        else:
            self._refetch(line, queued)  # writes back first when dirty

    def _dirty(self, line: int) -> bool:
        span = slice(line * LINE, (line + 1) * LINE)
        return bool(self._marked[line]) or \
            self._cache[span].tobytes() != self._snapshot[span].tobytes()

    def _write_back(self, line: int, queued: tuple[numpy.ndarray, bool] | None = None
                    ) -> None:
        """Write the line back: its bytes now (an eviction), or ``queued``,
        as they were when a flush queued it (and whether they were dirty);
        a line stored to since stays dirty in the cache with the later bytes."""
        span = slice(line * LINE, (line + 1) * LINE)
        if queued is not None and queued[0].tobytes() != self._cache[span].tobytes():
            if not queued[1]:
                return  # clean when queued: nothing to carry
            later = self._cache[span].copy()
            self._cache[span] = queued[0]
            self._write_back(line)
            self._cache[span] = later
            self._marked[line] = True
            return
        if not self._dirty(line):
            return
        pool = self.pool
        blind_whole = self._stored[span].tobytes() == _WHOLE and not self._read_stale[line]
        if pool.version[line] != self._fetched[line] and not blind_whole:
            memory, mine = pool.memory[span], self._cache[span]
            clobbered = numpy.flatnonzero((memory != self._snapshot[span]) & (mine != memory))
            if clobbered.size:
                record = LostUpdate(line * LINE, [line * LINE + int(i) for i in clobbered],
                                    self.index, int(pool.last_writer[line]), list(pool.trace))
                pool.lost_updates.append(record)
                if pool.raise_on_lost_update:
                    raise _LostUpdateError(
                        f"host {self.index} wrote back line {line * LINE} over bytes "
                        f"{record.offsets[:4]} written by host {record.overwritten_host}")
        pool.memory[span] = self._cache[span]
        pool.version[line] += 1
        pool.last_writer[line] = self.index
        self._snapshot[span] = self._cache[span]
        self._fetched[line] = pool.version[line]
        self._marked[line] = False
        self._forget(line)

    def _forget(self, line: int) -> None:
        """A fetch (or write-back) starts the line's store and stale-read record afresh."""
        self._stored[line * LINE:(line + 1) * LINE] = False
        self._read_stale[line] = False

    def _refetch(self, line: int, queued: tuple[numpy.ndarray, bool] | None = None) -> None:
        span = slice(line * LINE, (line + 1) * LINE)
        if queued is not None and queued[0].tobytes() != self._cache[span].tobytes():
            self._write_back(line, queued)  # stored to since it was dropped: kept
            return
        self._write_back(line)
        pool = self.pool
        self._cache[span] = pool.memory[span]
        self._snapshot[span] = pool.memory[span]
        self._fetched[line] = pool.version[line]
        self._forget(line)
