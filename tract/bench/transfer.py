"""`tract bench transfer`: moving KV blocks, against the copies and the
peers a user would pick instead, all in the same run.

Per block size (256 KiB, 2 MiB, 16 MiB; and, without ``--quick``, one
request shaped like a 6000-token Llama-3-8B prompt: 750 blocks of 1 MiB),
each sample moving at least 64 MiB (more blocks at the small sizes):

- put GB/s (`Connector.store` of absent blocks: reserve, copy, checksum,
  publish) against the non-temporal copy into the pool;
- get GB/s (`Connector.load`: pin, fresh copy, checksum check, unpin)
  against memcpy from memory, against ``memcpy_dropping`` (the same memcpy
  after the ranges are dropped and fenced, timed: the least any read that
  R4 holds costs, since a reader cannot know which lines its CPU still
  caches), and, for reference, the same memcpy between private buffers
  still in this CPU's caches;
- both again with checksums off, and the get on one thread (a load of
  `tract.transfer.SPLIT_LOAD_BYTES` or more is copied by `LOAD_THREADS`
  threads by default);
- handoff GB/s, prefill process -> decode process: from the moment the
  prefill side starts `offer` to the moment the decode side's `take` has
  the bytes (the notification between them, a pipe, included), against
  the two-copy bounds: ``two_copy_best`` (the non-temporal copy in, then
  memcpy out from memory: the fastest pair of copies this machine offers a
  CPU handoff), ``two_copy_dropping`` (the same, the out side's drop timed:
  the fastest pair R4 allows) and ``two_copy_memcpy`` (memcpy from memory
  twice); and
  against the same handoff over the peers: raw TCP loopback between two
  processes, Redis (SET/GET), and Mooncake Store (TCP, and its
  shared-memory path) when they can be started here; the report says
  which could not, and why;
- ``two_copy_best`` against each peer too: a CPU handoff makes two copies,
  so this is the ceiling of any handoff's ratio to that peer on this
  machine (a target above it is out of reach here).

Every measurement runs once a round, in turn with all the others (A B A
B ...: tract, its baselines, the peers), and each figure's ratio is the
median of the rounds' paired ratios, with their lowest and highest, so a
noisy neighbour hurts both sides of a pair alike.  The bytes start where a
rack puts them: not in this CPU's caches.  The memcpy baseline copies from
pool ranges dropped from the cache first (a pool read always comes from
memory: another host wrote it), and the ranges the put and the
non-temporal copy write are dropped first too (on a rack, the hosts that
read them last are others).

Servers are started on 127.0.0.1 by this module and stopped after.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import statistics
import time

import numpy as np

from tract.bench import Result, paired
from tract.bench.lock import MAX_NODES, manage_locks
from tract.bench.peers import PEERS, Peer, Unavailable
from tract.connector import Connector
from tract.pool import Pool
from tract.transfer import KVLayout

__all__ = ["SAMPLE_BYTES", "BenchPool", "decode_worker", "layout_of", "random_blocks", "run",
           "shapes"]

KIB, MIB = 1 << 10, 1 << 20
SAMPLE_BYTES = 64 * MIB


def shapes(quick: bool) -> list[tuple[int, int]]:
    """``(block bytes, blocks per sample)``: each sample moves at least
    `SAMPLE_BYTES`, so one takes long enough that scheduling noise does not
    decide it."""
    sizes = [(256 * KIB, 16), (2 * MIB, 8), (16 * MIB, 2)]
    if not quick:
        sizes.append((1 * MIB, 750))  # a 6000-token Llama-3-8B prompt: 128 KiB a token
    return [(size, max(count, -(-SAMPLE_BYTES // size))) for size, count in sizes]


def _label(size: int) -> str:
    return f"{size // MIB}MiB" if size >= MIB else f"{size // KIB}KiB"


def layout_of(size: int) -> KVLayout:
    """A layout whose blocks are ``size`` bytes, in 64 pieces."""
    return KVLayout(model="bench", dtype="uint8", num_layers=32, num_kv_heads=1,
                    head_size=size // 64, block_size=1)


class BenchPool:
    """A pool for the bench; its lock manager runs in another process, as
    `tract manager` would (one in this process would compete for the GIL)."""

    def __init__(self, bytes_needed: int):
        self.path = os.path.join("/dev/shm", f"tract-bench-transfer-{os.getpid()}")
        chunk = 2 * MIB
        size = max(64 * MIB, (bytes_needed * 3 // chunk + 8) * chunk)
        Pool.create(self.path, size, chunk_size=chunk, max_nodes=MAX_NODES, lease_timeout=5.0,
                    index_capacity=4096)
        context = multiprocessing.get_context("fork")
        self.stop = context.Event()
        self.manager = context.Process(target=manage_locks, args=(self.path, self.stop))
        self.manager.start()
        self.pool = Pool.open(self.path, 0, populate=True)
        # every heap page written once, as in a pool that has been serving a
        # while (a first write to a /dev/shm page faults; a DAX device never does)
        header = self.pool.header
        self.pool.region.fill(header.heap, header.heap_end - header.heap, 0)

    def close(self):
        self.pool.close()
        self.stop.set()
        self.manager.join(30)
        Pool.destroy(self.path)


def random_blocks(size: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _drop(pool, offsets: np.ndarray, size: int) -> None:
    """The ranges out of this CPU's caches (untimed)."""
    for offset in offsets.tolist():
        pool.region.invalidate(offset, size, payload=True)
    pool.region.fence()


def _evict_all(pool) -> None:
    while pool.index.evict(64, window=pool.index.capacity):
        pass


class _Copies:
    """The baselines, on ``count`` pool ranges of ``size`` bytes: memcpy
    from memory (the ranges dropped from the cache first), the same with the
    drop timed (``memcpy_dropping``: the least a read fresh from memory
    costs, R4), the non-temporal copy into them (dropped first too), and
    memcpy between private buffers still in the cache (for reference)."""

    def __init__(self, size: int, count: int, pool):
        self.pool, self.size = pool, size
        self.src = random_blocks(size, count, 1)
        self.dst = [np.empty(size, np.uint8) for _ in range(count)]
        self.offsets = np.array([pool.alloc(size) for _ in range(count)], dtype=np.int64)
        pool.region.copy_in_blocks(self.offsets, self.src)
        self.in_pool = [np.frombuffer(pool.region.view(offset, size), np.uint8)
                        for offset in self.offsets.tolist()]

    def _timed(self, function) -> float:
        _drop(self.pool, self.offsets, self.size)
        start = time.perf_counter()
        function()
        return time.perf_counter() - start

    def step(self, round_: int) -> dict[str, float]:
        def memcpy():
            for a, b in zip(self.in_pool, self.dst):
                np.copyto(b, a)

        def dropping():
            _drop(self.pool, self.offsets, self.size)
            memcpy()
        times = {"nt_copy": self._timed(lambda: self.pool.region.copy_in_blocks(self.offsets,
                                                                              self.src)),
                 "memcpy": self._timed(memcpy), "memcpy_dropping": self._timed(dropping)}
        start = time.perf_counter()
        for a, b in zip(self.src, self.dst):
            np.copyto(b, a)
        times["memcpy_cached"] = time.perf_counter() - start
        times["two_copy_best"] = times["nt_copy"] + times["memcpy"]
        times["two_copy_dropping"] = times["nt_copy"] + times["memcpy_dropping"]
        times["two_copy_memcpy"] = 2 * times["memcpy"]
        return times

    def close(self) -> None:
        self.in_pool.clear()
        for offset in self.offsets.tolist():
            self.pool.free(offset)


@contextlib.contextmanager
def _put_get(size: int, count: int, pool, checksum: bool, load_threads: int | None = None):
    """A round: put ``count`` absent blocks, then get them back (on
    ``load_threads`` threads: the connector's default when None)."""
    connector = Connector(pool, layout_of(size), checksum=checksum, load_threads=load_threads)
    blocks = random_blocks(size, count, 2)
    outs = [np.empty(size, np.uint8) for _ in range(count)]
    suffix = ("" if checksum else "_plain") + ("" if load_threads is None else
                                               f"_{load_threads}_thread")

    def step(round_: int) -> dict[str, float]:
        keys = np.random.default_rng([round_, checksum]).integers(
            0, 2**63, size=(count, 2), dtype=np.uint64)
        start = time.perf_counter()
        stored = connector.store(keys, blocks)
        middle = time.perf_counter()
        loaded = connector.load(keys, outs)
        end = time.perf_counter()
        assert stored == loaded == count, (stored, loaded)
        hits = pool.index.pin(keys)  # as if read last by another host
        _drop(pool, hits.offsets, size)
        pool.index.unpin(hits)
        _evict_all(pool)
        return {"put" + suffix: middle - start, "get" + suffix: end - middle}

    try:
        yield step
    finally:
        connector.close()


# ---------------------------------------------------------------- handoff

def decode_worker(path: str, size: int, count: int, pipe, checksum: bool) -> None:
    """The decode side of the handoff (node 1): takes each ticket it is
    sent, answers the seconds since its ``started`` and the blocks taken."""
    with Pool.open(path, 1, populate=True) as pool:
        connector = Connector(pool, layout_of(size), checksum=checksum)
        outs = [np.empty(size, np.uint8) for _ in range(count)]
        while (message := pipe.recv()) is not None:
            ticket, started = message
            taken = connector.take(ticket, outs)
            done = time.monotonic()
            pipe.send((done - started, taken.blocks))


@contextlib.contextmanager
def _tract_handoff(path: str, size: int, count: int, pool, checksum: bool = True):
    """A round: offer ``count`` blocks here (node 0), take them in a decode
    process (node 1)."""
    connector = Connector(pool, layout_of(size), checksum=checksum)
    blocks = random_blocks(size, count, 3)
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    decoder = context.Process(target=decode_worker, args=(path, size, count, theirs, checksum))
    decoder.start()

    def step(round_: int) -> dict[str, float]:
        keys = np.random.default_rng([7, round_]).integers(0, 2**63, size=(count, 2),
                                                            dtype=np.uint64)
        started = time.monotonic()
        ticket = connector.offer(f"bench-{round_}", keys, blocks)
        ours.send((ticket, started))
        elapsed, loaded = ours.recv()
        assert loaded == count, loaded
        # read by the decode side, which here shares this CPU's caches: dropped, as
        # on a rack, where it runs on another host
        _drop(pool, connector.offers[f"bench-{round_}"].hits.offsets, size)
        connector.release()
        _evict_all(pool)
        return {"handoff": elapsed}

    try:
        yield step
    finally:
        with contextlib.suppress(OSError):
            ours.send(None)
        decoder.join(30)
        connector.close()


def _tcp_receive(port: int, size: int, count: int, pipe) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        outs = [bytearray(size) for _ in range(count)]
        while (message := pipe.recv()) is not None:
            for out in outs:
                view, got = memoryview(out), 0
                while got < size:
                    got += conn.recv_into(view[got:])
            pipe.send(time.monotonic() - message)


@contextlib.contextmanager
def _tcp_handoff(size: int, count: int):
    """A round: ``count`` blocks sent over TCP loopback to a receiving
    process, timed from the first send to the last byte received."""
    blocks = random_blocks(size, count, 4)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        context = multiprocessing.get_context("fork")
        ours, theirs = context.Pipe()
        receiver = context.Process(target=_tcp_receive, args=(port, size, count, theirs))
        receiver.start()
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def step(round_: int) -> dict[str, float]:
            ours.send(time.monotonic())
            for block in blocks:
                conn.sendall(block)
            return {"tcp_loopback": ours.recv()}

        try:
            with conn:
                yield step
        finally:
            with contextlib.suppress(OSError):
                ours.send(None)
            receiver.join(30)


#: untimed seconds after a peer's round: its server's background work (freeing
#: what the round deleted) must not land on the next measurement
SETTLE = 0.5


@contextlib.contextmanager
def _peer(name: str, size: int, count: int):
    with Peer(name, size, count) as peer:
        def step(round_: int) -> dict[str, float]:
            seconds = peer.sample(round_)
            time.sleep(SETTLE)
            return {name: seconds}
        yield step


def _rounds(steps: dict[str, object], repeats: int, notes: list[str]) -> dict[str, list[float]]:
    """Each step once a round, in turn (the first round warms up, untimed);
    the seconds of every measurement, round by round.  A step that fails
    with `Unavailable` is dropped, its samples with it, and noted."""
    samples: dict[str, list[float]] = {}
    dropped: set[str] = set()
    for round_ in range(repeats + 1):
        for name, step in steps.items():
            if name in dropped:
                continue
            try:
                times = step(round_)
            except Unavailable as why:
                dropped.add(name)
                notes.append(f"{why.args[0]} (dropped after {max(round_ - 1, 0)} rounds)")
                continue
            if round_:
                for measured, seconds in times.items():
                    samples.setdefault(measured, []).append(seconds)
    for name in dropped:
        samples.pop(name, None)
    return samples


#: (tract's measurement, its figure's name, the baseline it is held to)
COMPARISONS = [("put", "put", "nt_copy"), ("get", "get", "memcpy"),
               ("get", "get", "memcpy_dropping"), ("get", "get", "memcpy_cached"),
               ("get_1_thread", "get,1-thread", "memcpy"),
               ("get_1_thread", "get,1-thread", "memcpy_dropping"),
               ("put_plain", "put,no-checksum", "nt_copy"),
               ("get_plain", "get,no-checksum", "memcpy"),
               ("get_plain", "get,no-checksum", "memcpy_dropping"),
               ("handoff", "handoff", "two_copy_best"),
               ("handoff", "handoff", "two_copy_dropping"),
               ("handoff", "handoff", "two_copy_memcpy"),
               ("handoff", "handoff", "tcp_loopback"),
               *[("handoff", "handoff", peer) for peer in PEERS],
               # the ceiling: no CPU handoff beats two copies, so no ratio of
               # tract's to a peer's can exceed this one (same rounds)
               *[("two_copy_best", "two_copy_best", peer) for peer in ("tcp_loopback", *PEERS)]]


def _cpu(size: int, count: int, repeats: int, harness: BenchPool, peers: bool,
         notes: list[str]) -> list[Result]:
    nbytes = size * count
    with contextlib.ExitStack() as stack:
        copies = _Copies(size, count, harness.pool)
        stack.callback(copies.close)
        steps = {"copies": copies.step,
                 "put_get": stack.enter_context(_put_get(size, count, harness.pool, True)),
                 "put_get_plain": stack.enter_context(_put_get(size, count, harness.pool,
                                                               False)),
                 "put_get_1_thread": stack.enter_context(_put_get(size, count, harness.pool,
                                                                  True, 1)),
                 "handoff": stack.enter_context(_tract_handoff(harness.path, size, count,
                                                               harness.pool)),
                 "tcp_loopback": stack.enter_context(_tcp_handoff(size, count))}
        for name in PEERS if peers else ():
            try:
                steps[name] = stack.enter_context(_peer(name, size, count))
            except Unavailable as why:
                if why.args[0] not in notes:
                    notes.append(why.args[0])
        samples = _rounds(steps, repeats, notes)
    label = f"{_label(size)}x{count}"
    return [Result(f"transfer[{figure},{label}]", _gbps(nbytes, statistics.median(samples[ours])),
                   "GB/s", True, baseline,
                   _gbps(nbytes, statistics.median(samples[baseline])),
                   paired(samples[ours], samples[baseline]))
            for ours, figure, baseline in COMPARISONS if baseline in samples]


# ------------------------------------------------------------------ CUDA

def _cuda(size: int, count: int, repeats: int, pool, segments: int = 1) -> list[Result]:
    """put / get of CUDA blocks (DMA to and from the registered pool)
    against torch's copies of the same blocks between pinned host memory
    and the device, interleaved round by round (put, d2h, get, h2d).  A
    block of ``segments`` > 1 is that many separate device tensors (as an
    engine's per-layer KV caches give), each its own DMA."""
    import torch

    label = f"cuda,{_label(size)}x{count}" + (f",{segments}seg" if segments > 1 else "")
    connector = Connector(pool, layout_of(size))
    generator = torch.Generator(device="cuda").manual_seed(size + segments)

    def device_blocks(fill: bool):
        flat = (torch.randint(0, 256, (count, segments, size // segments), dtype=torch.uint8,
                              device="cuda", generator=generator) if fill else
                torch.empty((count, segments, size // segments), dtype=torch.uint8,
                            device="cuda"))
        return [list(block) if segments > 1 else block.reshape(-1) for block in flat]

    blocks, outs = device_blocks(True), device_blocks(False)
    pinned = torch.empty((count, size), dtype=torch.uint8, pin_memory=True)
    flat_blocks = [torch.cat(b) if segments > 1 else b for b in blocks]

    def copies(sources, targets):
        start = time.perf_counter()
        for a, b in zip(sources, targets):
            b.copy_(a, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    put, get, d2h, h2d = [], [], [], []
    for round_ in range(repeats + 1):
        keys = np.random.default_rng([9, segments, round_]).integers(
            0, 2**63, size=(count, 2), dtype=np.uint64)
        to_host = copies(flat_blocks, pinned)
        start = time.perf_counter()
        stored = connector.store(keys, blocks)
        put_time = time.perf_counter() - start
        to_device = copies(pinned, flat_blocks)
        start = time.perf_counter()
        loaded = connector.load(keys, outs)
        torch.cuda.synchronize()
        get_time = time.perf_counter() - start
        assert stored == loaded == count, (stored, loaded, count)
        assert all(torch.equal(torch.cat(a) if segments > 1 else a, f)
                   for a, f in zip(outs, flat_blocks))
        if round_:  # the first round warms up
            for samples, value in ((put, put_time), (get, get_time), (d2h, to_host),
                                   (h2d, to_device)):
                samples.append(value)
        _evict_all(pool)
    nbytes = size * count
    connector.close()
    return [Result(f"transfer[{kind},{label}]", _gbps(nbytes, statistics.median(ours)), "GB/s",
                   True, baseline, _gbps(nbytes, statistics.median(bound)), paired(ours, bound))
            for kind, ours, bound, baseline in (("put", put, d2h, "pinned_d2h_copy"),
                                                ("get", get, h2d, "pinned_h2d_copy"))]


# ------------------------------------------------------------------- run

def run(quick: bool = False, peers: bool = True, device: str = "cpu") -> list[Result]:
    repeats = 3 if quick else 9
    sizes = shapes(quick)
    harness = BenchPool(max(size * count for size, count in sizes))
    results: list[Result] = []
    notes: list[str] = []
    try:
        if device == "cuda":
            # and the per-layer case: a 2 MiB block as 64 tensors (32 layers x K, V)
            for size, count, segments in [(size, count, 1) for size, count in sizes] + \
                    [(2 * MIB, 32, 64)]:
                results += _cuda(size, count, repeats, harness.pool, segments)
            return results
        for size, count in sizes:
            results += _cpu(size, count, repeats, harness, peers, notes)
    finally:
        harness.close()
    for note in notes:
        results.append(Result(f"unavailable: {note}", 0.0, "note", True))
    return results
