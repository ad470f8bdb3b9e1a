"""`tract bench index`: the prefix index's metadata cost per block.

A table filled to 70% (4 KiB payloads from the node heap), then batches of
64 chained keys: lookup + pin + validate + unpin of present keys, lookup
alone, reserve + publish of new keys (with their payload allocation,
without the payload copy), and the eviction that keeps the load at 70%
(sampled LRU, per entry evicted), each per block against the store +
flush + fence round trip measured in the same run (ratio = round trip /
value, so 1/3 means three round trips).  The lock manager runs in another
process, as `tract manager` would.
"""

from __future__ import annotations

import multiprocessing
import time

import numpy as np

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


def run(quick: bool = False) -> list[Result]:
    round_trip = min(scratch_region(4096, name="bench-index").time_round_trip(0, 20000)
                     for _ in range(3))
    harness = Harness(1 << 12 if quick else 1 << 14)
    rng = np.random.default_rng(2)
    batches = 10 if quick else 60
    try:
        pin = _per_block_ns(harness, harness.pin_unpin, batches, rng)
        lookup = _per_block_ns(harness, harness.index.lookup, batches, rng)
        publish, evict = _publish_ns(harness, batches // 2)
    finally:
        harness.close()
    baseline = "store_flush_fence"
    return [
        Result("index[lookup+pin+validate+unpin,hit]", pin, "ns/block", False, baseline,
               round_trip),
        Result("index[lookup,hit]", lookup, "ns/block", False, baseline, round_trip),
        Result("index[reserve+publish]", publish, "ns/block", False, baseline, round_trip),
        Result("index[evict]", evict, "ns/block", False, baseline, round_trip),
    ]
