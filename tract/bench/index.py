"""`tract bench index`: the prefix index's metadata cost per block.

A table filled to 70% (4 KiB payloads from the node heap), then batches of
64 chained keys: lookup + pin + validate + unpin of present keys, lookup
alone, reserve + publish of new keys (with their payload allocation,
without the payload copy), and the eviction that keeps the load at 70%
(sampled LRU, per entry evicted), each per block against the store +
flush + fence round trip measured in the same run (ratio = round trip /
value, so 1/3 means three round trips).  The lock manager runs in another
process, as `tract manager` would.

Each step also gets its *floor*: the memory traffic it makes in the index's
own areas (entries and pin words), replayed alone, in one kernel call, from
its cache-control trace (`replay`).  Every line the step wrote back with
the metadata flush is stored to and written back again; every line it
dropped with the payload instruction is dropped and, after the fence that
followed, read; its fences are fenced.  No computation, no lock, no payload
allocation: a lower bound on any step with the same protocol traffic, which
R3, R4 and R6 set (an entry written WRITING then READY, a home's reach
raised before an entry lies past it, a pin in memory before its entry is
validated, a probe window read fresh).  ``index[STEP,floor]`` is that floor
against the round trip, and ``index[STEP] vs floor`` the step against it.
"""

from __future__ import annotations

import multiprocessing
import time

import numpy as np

from tract._kernels.cachectl import fence, lines, words
from tract._kernels.config import kernel
from tract._native._region import INSTRUCTIONS, TRACE_FENCE
from tract.bench import Result
from tract.bench.lock import MAX_NODES, manage_locks, bench_pool
from tract.hashing import BlockHasher
from tract.pool import Pool
from tract.region import scratch_region

BATCH = 64
LOAD = 0.7
PAYLOAD = 4096


class Harness:
    """A pool whose index holds ``LOAD * capacity`` entries; this process is node 0."""

    def __init__(self, capacity: int = 1 << 14):
        self.path = bench_pool()
        Pool.create(self.path, 256 << 20, max_nodes=MAX_NODES, lease_timeout=2.0,
                    index_capacity=capacity)
        context = multiprocessing.get_context("fork")
        self.stop = context.Event()
        self.manager = context.Process(target=manage_locks, args=(self.path, self.stop))
        self.manager.start()
        self.pool = Pool.open(self.path, 0)
        self.index = self.pool.index
        hasher = BlockHasher(self.pool.header.hash_key, 16)
        present = int(capacity * LOAD) // BATCH * BATCH
        tokens = np.random.default_rng(1).integers(0, 50_000, size=16 * 2 * present,
                                                   dtype=np.int32)
        keys = hasher(tokens)
        self.present, self.absent = keys[:present], keys[present:]
        for first in range(0, present, BATCH):
            self.publish(self.present[first:first + BATCH])
        self.fresh = 0

    def publish(self, keys) -> int:
        """Publish the absent ones of ``keys``; returns how many."""
        return sum(self.index.publish(self.index.reserve(keys, PAYLOAD, tokens=16, timeout=30)))

    def batch(self, keys, rng) -> np.ndarray:
        first = rng.integers(0, keys.shape[0] // BATCH) * BATCH
        return keys[first:first + BATCH]

    def pin_unpin(self, keys) -> None:
        self.index.unpin(self.index.pin(keys))

    def publish_fresh(self) -> np.ndarray:
        """The next batch of absent keys."""
        keys = self.absent[self.fresh:self.fresh + BATCH]
        self.fresh = (self.fresh + BATCH) % (self.absent.shape[0] - BATCH)
        return keys

    def close(self) -> None:
        self.pool.close()
        self.stop.set()
        self.manager.join(30)
        Pool.destroy(self.path)


def _per_block_ns(harness, function, batches: int, rng) -> float:
    best = float("inf")
    for _ in range(5):
        elapsed = 0.0
        for _ in range(batches):
            keys = harness.batch(harness.present, rng)
            start = time.perf_counter()
            function(keys)
            elapsed += time.perf_counter() - start
        best = min(best, elapsed / batches / BATCH)
    return best * 1e9


def _publish_ns(harness, batches: int) -> tuple[float, float]:
    """(reserve + publish per block, eviction per entry evicted): the best
    of 5 rounds each."""
    best, best_evict = float("inf"), float("inf")
    for _ in range(5):
        elapsed = evicting = 0.0
        evicted = 0
        for _ in range(batches):
            keys = harness.publish_fresh()
            start = time.perf_counter()
            published = harness.publish(keys)
            middle = time.perf_counter()
            _drop(harness, published)  # timed apart: the load stays at 70%
            elapsed += middle - start
            evicting += time.perf_counter() - middle
            evicted += published
        best = min(best, elapsed / batches / BATCH)
        best_evict = min(best_evict, evicting / max(evicted, 1))
    return best * 1e9, best_evict * 1e9


def _drop(harness, count: int) -> None:
    """Evict ``count`` entries (sampled LRU, as allocation pressure would),
    so the load and the tombstones stay at a steady state."""
    left = count
    while left > 0:
        left -= harness.index.evict(left, window=256, timeout=30)


@kernel
def replay(address, ops, offsets, flush_op, fresh_op, fence_op, reads):
    """A step's traffic from its trace (``ops``, ``offsets``): lines of op
    ``flush_op`` stored to and written back with it, lines of op ``fresh_op``
    dropped with it and read after the next fence, ops from ``fence_op`` on
    fenced.  ``reads``: room for the lines of one fenced batch.  Returns a
    sum of the words read (so that the reads are made)."""
    pending = 0
    total = np.uint64(0)
    for i in range(ops.size):
        op = ops[i]
        if op >= fence_op:
            fence()
            for j in range(pending):
                line = words(address + reads[j], 8)
                for w in range(8):
                    total += line[w]
            pending = 0
        elif op == flush_op:
            words(address + offsets[i], 1)[0] = np.uint64(i)
            lines(flush_op, address + offsets[i], 64)
        elif op == fresh_op:
            lines(fresh_op, address + offsets[i], 64)
            reads[pending] = offsets[i]
            pending += 1
    return total


def traced(harness, step, batches: int) -> np.ndarray:
    """The trace of ``batches`` calls of ``step`` (each given the next batch
    of present keys), keeping fences and the lines of the index's areas."""
    index, region = harness.index, harness.pool.region
    rng = np.random.default_rng(3)
    region.trace_start(1 << 20)
    try:
        for _ in range(batches):
            step(harness.batch(harness.present, rng))
    finally:
        trace = region.trace_stop()
    offsets = trace[:, 1]
    entries = (offsets >= index.base) & (offsets < index.base + index.capacity * 64)
    pins = (offsets >= index.node_base) \
        & (offsets < index.node_base + index.max_nodes * index.node_bytes)
    return trace[(trace[:, 0] >= TRACE_FENCE) | entries | pins]


def floor_ns(harness, trace: np.ndarray, blocks: int, repeats: int = 5) -> float:
    """Nanoseconds per block of ``trace``'s traffic replayed alone (best of
    ``repeats``), on a private mapping of the pool's size: a line the step
    wrote back costs a store and a write-back; a line it dropped, a drop and
    a read.  Where the CPU has one instruction for both, every line is
    priced as a drop and read, the cheaper: the floor stays a floor."""
    control = harness.pool.region.cache_control
    flush, fresh = INSTRUCTIONS[control.flush], INSTRUCTIONS[control.payload]
    if flush == fresh:
        flush = -1
    region = scratch_region(harness.pool.region.size, name="bench-index-floor")
    try:
        region.fill(0, region.size, 0)  # its pages made before the clock starts
        ops = np.ascontiguousarray(trace[:, 0])
        offsets = np.ascontiguousarray(trace[:, 1]) & ~np.int64(63)
        reads = np.empty(ops.size, np.int64)
        best = float("inf")
        for _ in range(repeats + 1):  # the first compiles and warms
            start = time.perf_counter()
            replay(region.base, ops, offsets, flush, fresh, TRACE_FENCE, reads)
            best = min(best, time.perf_counter() - start)
    finally:
        region.close()
    return best / blocks * 1e9


def _publish_floor_ns(harness, batches: int) -> float:
    """The floor of reserve + publish per block; the entries published are
    evicted again after, as in `_publish_ns`."""
    published = []

    def publish(_keys):
        published.append(harness.publish(harness.publish_fresh()))

    trace = traced(harness, publish, batches)
    _drop(harness, sum(published))
    return floor_ns(harness, trace, batches * BATCH)


def run(quick: bool = False) -> list[Result]:
    round_trip = min(scratch_region(4096, name="bench-index").time_round_trip(0, 20000)
                     for _ in range(3))
    harness = Harness(1 << 12 if quick else 1 << 14)
    rng = np.random.default_rng(2)
    batches = 10 if quick else 60
    floors = 4 if quick else 16  # batches traced for a floor
    try:
        pin = _per_block_ns(harness, harness.pin_unpin, batches, rng)
        # traced while the keys are present: the publishes below evict them
        pin_floor = floor_ns(harness, traced(harness, harness.pin_unpin, floors), floors * BATCH)
        lookup = _per_block_ns(harness, harness.index.lookup, batches, rng)
        publish, evict = _publish_ns(harness, batches // 2)
        publish_floor = _publish_floor_ns(harness, floors)
    finally:
        harness.close()
    baseline = "store_flush_fence"
    return [
        Result("index[lookup+pin+validate+unpin,hit]", pin, "ns/block", False, baseline,
               round_trip),
        Result("index[lookup,hit]", lookup, "ns/block", False, baseline, round_trip),
        Result("index[reserve+publish]", publish, "ns/block", False, baseline, round_trip),
        Result("index[evict]", evict, "ns/block", False, baseline, round_trip),
        Result("index[lookup+pin+validate+unpin,floor]", pin_floor, "ns/block", False, baseline,
               round_trip),
        Result("index[reserve+publish,floor]", publish_floor, "ns/block", False, baseline,
               round_trip),
        Result("index[lookup+pin+validate+unpin] vs floor", pin, "ns/block", False, "floor",
               pin_floor),
        Result("index[reserve+publish] vs floor", publish, "ns/block", False, "floor",
               publish_floor),
    ]
