"""`tract bench transfer`: moving KV blocks, against the copies and the
peers a user would pick instead, all in the same run.

Per block size (256 KiB, 2 MiB, 16 MiB; and, without ``--quick``, one
request shaped like a 6000-token Llama-3-8B prompt: 750 blocks of 1 MiB):

- put GB/s (`Connector.store` of absent blocks: reserve, copy, checksum,
  publish) against the non-temporal copy into the pool;
- get GB/s (`Connector.load`: pin, fresh copy, checksum check, unpin)
  against numpy memcpy from memory (and, for reference, the same memcpy
  between private buffers still in this CPU's caches);
- both again with checksums off;
- handoff GB/s, prefill process -> decode process: from the moment the
  prefill side starts `offer` to the moment the decode side's `take` has
  the bytes (the notification between them, a pipe, included), against
  the two-copy memcpy bound (``memcpy`` time x 2, in the same rounds) and
  against the same handoff over the peers: raw TCP loopback between two
  processes, Redis (SET/GET), and Mooncake Store (TCP, and its
  shared-memory path) when they can be started here; the report says
  which could not, and why.

The bytes start where a rack puts them: not in this CPU's caches.  The
memcpy baseline copies from pool ranges dropped from the cache first (a
pool read always comes from memory: another host wrote it; a copy from
cache-resident buffers would measure the cache, not a transfer), and the
ranges the put and the non-temporal copy write are dropped first too (on a
rack, the hosts that read them last are others).  The baselines and
tract's calls are measured in turn, round by round, so a noisy neighbour
hurts them alike.

Servers are started on 127.0.0.1 by this module and stopped after.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import time

import numpy as np

from tract.bench import Result, median_time
from tract.bench.lock import MAX_NODES, manage_locks
from tract.bench.peers import PEERS, Unavailable
from tract.connector import Connector
from tract.pool import Pool
from tract.transfer import KVLayout

KIB, MIB = 1 << 10, 1 << 20


def _label(size: int) -> str:
    return f"{size // MIB}MiB" if size >= MIB else f"{size // KIB}KiB"


def layout_of(size: int) -> KVLayout:
    """A layout whose blocks are ``size`` bytes, in 64 pieces."""
    return KVLayout(model="bench", dtype="uint8", num_layers=32, num_kv_heads=1,
                    head_size=size // 64, block_size=1)


class _Pool:
    """A pool for the bench; its lock manager runs in another process, as
    `tract manager` would (one in this process would compete for the GIL)."""

    def __init__(self, bytes_needed: int):
        self.path = os.path.join("/dev/shm", f"tract-bench-transfer-{os.getpid()}")
        chunk = 2 * MIB
        size = max(64 * MIB, (bytes_needed * 2 // chunk + 8) * chunk)
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


def _blocks(size: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _drop(pool, offsets: np.ndarray, size: int) -> None:
    """The ranges out of this CPU's caches (untimed)."""
    for offset in offsets.tolist():
        pool.region.invalidate(offset, size, payload=True)
    pool.region.fence()


class _Copies:
    """The baselines, on ``count`` pool ranges of ``size`` bytes: memcpy
    from memory (the ranges dropped from the cache first), the
    non-temporal copy into them (dropped first too), and memcpy between
    private buffers still in the cache (for reference)."""

    def __init__(self, size: int, count: int, pool):
        self.pool, self.size = pool, size
        self.src = _blocks(size, count, 1)
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

    def memcpy(self) -> float:
        return self._timed(lambda: [np.copyto(b, a) for a, b in zip(self.in_pool, self.dst)])

    def nontemporal(self) -> float:
        return self._timed(lambda: self.pool.region.copy_in_blocks(self.offsets, self.src))

    def cached(self) -> float:
        start = time.perf_counter()
        for a, b in zip(self.src, self.dst):
            np.copyto(b, a)
        return time.perf_counter() - start

    def close(self) -> None:
        self.in_pool.clear()
        for offset in self.offsets.tolist():
            self.pool.free(offset)


def _put_get(size: int, count: int, repeats: int, pool) -> dict[str, float]:
    """put and get with and without checksums, and the baselines, measured
    round by round in turn (a noisy neighbour hurts them alike)."""
    connectors = {True: Connector(pool, layout_of(size), checksum=True),
                  False: Connector(pool, layout_of(size), checksum=False)}
    copies = _Copies(size, count, pool)
    blocks = _blocks(size, count, 2)
    outs = [np.empty(size, np.uint8) for _ in range(count)]
    samples: dict[str, list[float]] = {}
    for round_ in range(repeats + 1):
        times = {"nt": copies.nontemporal(), "memcpy": copies.memcpy(),
                 "memcpy_cached": copies.cached()}
        for checksum, connector in connectors.items():
            keys = np.random.default_rng([round_, checksum]).integers(
                0, 2**63, size=(count, 2), dtype=np.uint64)
            start = time.perf_counter()
            stored = connector.store(keys, blocks)
            middle = time.perf_counter()
            loaded = connector.load(keys, outs)
            end = time.perf_counter()
            assert stored == loaded == count, (stored, loaded)
            suffix = "" if checksum else "_plain"
            times["put" + suffix], times["get" + suffix] = middle - start, end - middle
            hits = pool.index.pin(keys)  # as if read last by another host
            _drop(pool, hits.offsets, size)
            pool.index.unpin(hits)
            while pool.index.evict(64, window=pool.index.capacity):
                pass
        if round_:  # the first is a warm-up
            for name, seconds in times.items():
                samples.setdefault(name, []).append(seconds)
    copies.close()
    return {name: _gbps(size * count, statistics.median(values))
            for name, values in samples.items()}


# ---------------------------------------------------------------- handoff

def _decode(path: str, size: int, count: int, pipe, checksum: bool) -> None:
    with Pool.open(path, 1, populate=True) as pool:
        connector = Connector(pool, layout_of(size), checksum=checksum)
        outs = [np.empty(size, np.uint8) for _ in range(count)]
        while (message := pipe.recv()) is not None:
            ticket, started = message
            taken = connector.take(ticket, outs)
            done = time.monotonic()
            pipe.send((done - started, taken.blocks))


def _tract_handoff(path: str, size: int, count: int, repeats: int, pool,
                   checksum: bool = True) -> tuple[float, float]:
    """GB/s of the handoff, and of its bound (two memcpys from memory, timed
    in the same rounds)."""
    connector = Connector(pool, layout_of(size), checksum=checksum)
    copies = _Copies(size, count, pool)
    blocks = _blocks(size, count, 3)
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    decoder = context.Process(target=_decode, args=(path, size, count, theirs, checksum))
    decoder.start()
    times, bounds = [], []
    try:
        for round_ in range(repeats + 1):
            keys = np.random.default_rng([7, round_]).integers(0, 2**63, size=(count, 2),
                                                                dtype=np.uint64)
            bound = 2 * copies.memcpy()
            started = time.monotonic()
            ticket = connector.offer(f"bench-{round_}", keys, blocks)
            ours.send((ticket, started))
            elapsed, loaded = ours.recv()
            assert loaded == count, loaded
            if round_:
                times.append(elapsed)
                bounds.append(bound)
            # read by the decode side, which here shares this CPU's caches: dropped, as
            # on a rack, where it runs on another host
            _drop(pool, connector.offers[f"bench-{round_}"].hits.offsets, size)
            connector.release()
            while pool.index.evict(64, window=pool.index.capacity):
                pass
    finally:
        ours.send(None)
        decoder.join(30)
        connector.close()
        copies.close()
    nbytes = size * count
    return _gbps(nbytes, statistics.median(times)), _gbps(nbytes, statistics.median(bounds))


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


def _tcp_handoff(size: int, count: int, repeats: int) -> float:
    blocks = _blocks(size, count, 4)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        context = multiprocessing.get_context("fork")
        ours, theirs = context.Pipe()
        receiver = context.Process(target=_tcp_receive, args=(port, size, count, theirs))
        receiver.start()
        conn, _ = server.accept()
        times = []
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for round_ in range(repeats + 1):
                    started = time.monotonic()
                    ours.send(started)
                    for block in blocks:
                        conn.sendall(block)
                    elapsed = ours.recv()
                    if round_:
                        times.append(elapsed)
        finally:
            ours.send(None)
            receiver.join(30)
    return _gbps(size * count, statistics.median(times))


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
        while pool.index.evict(64, window=pool.index.capacity):
            pass
    nbytes = size * count
    connector.close()
    results = []
    for kind, ours, bound, baseline in (("put", put, d2h, "pinned_d2h_copy"),
                                        ("get", get, h2d, "pinned_h2d_copy")):
        ratios = sorted(b / o for o, b in zip(ours, bound))
        results.append(Result(f"transfer[{kind},{label}]", _gbps(nbytes, statistics.median(ours)),
                              "GB/s", True, baseline, _gbps(nbytes, statistics.median(bound))))
        results.append(Result(f"paired ratio[{kind},{label}] median {statistics.median(ratios):.3f}"
                              f" range {ratios[0]:.3f}-{ratios[-1]:.3f}", 0.0, "note", True))
    return results


# ------------------------------------------------------------------- run

def run(quick: bool = False, peers: bool = True, device: str = "cpu") -> list[Result]:
    shapes = [(256 * KIB, 16), (2 * MIB, 8), (16 * MIB, 2)]
    if not quick:
        shapes.append((1 * MIB, 750))  # a 6000-token Llama-3-8B prompt: 128 KiB a token
    repeats = 3 if quick else 9
    results: list[Result] = []
    notes: list[str] = []
    harness = _Pool(max(size * count for size, count in shapes))
    if device == "cuda":
        # and the per-layer case: a 2 MiB block as 64 tensors (32 layers x K, V)
        try:
            return [result for size, count, segments in
                    [(size, count, 1) for size, count in shapes] + [(2 * MIB, 8, 64)]
                    for result in _cuda(size, count, repeats, harness.pool, segments)]
        finally:
            harness.close()
    try:
        for size, count in shapes:
            label = f"{_label(size)}x{count}"
            rates = _put_get(size, count, repeats, harness.pool)
            # the bound: two copies, into the pool and out
            handoff, bound = _tract_handoff(harness.path, size, count, repeats, harness.pool)
            results += [
                Result(f"transfer[put,{label}]", rates["put"], "GB/s", True, "nt_copy",
                       rates["nt"]),
                Result(f"transfer[get,{label}]", rates["get"], "GB/s", True, "memcpy",
                       rates["memcpy"]),
                Result(f"transfer[get,{label}]", rates["get"], "GB/s", True,
                       "memcpy_cached", rates["memcpy_cached"]),
                Result(f"transfer[put,no-checksum,{label}]", rates["put_plain"], "GB/s", True,
                       "nt_copy", rates["nt"]),
                Result(f"transfer[get,no-checksum,{label}]", rates["get_plain"], "GB/s", True,
                       "memcpy", rates["memcpy"]),
                Result(f"transfer[handoff,{label}]", handoff, "GB/s", True,
                       "two_copy_memcpy", bound),
            ]
            baselines = {"tcp_loopback": _tcp_handoff, **(PEERS if peers else {})}
            for name, measure in baselines.items():
                try:
                    value = measure(size, count, repeats)
                except Unavailable as why:
                    if why.args[0] not in notes:
                        notes.append(why.args[0])
                    continue
                results.append(Result(f"transfer[handoff,{label}]", handoff, "GB/s", True,
                                      name, value))
    finally:
        harness.close()
    for note in notes:
        results.append(Result(f"unavailable: {note}", 0.0, "note", True))
    return results
