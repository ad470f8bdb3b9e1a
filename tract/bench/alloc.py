"""`tract bench alloc`: the allocator (`tract.alloc`).

Alloc + free of 4 KiB and 64 KiB objects (the node-heap path: a slab block,
no pool metadata touched) and of 2 MiB and 16 MiB objects (the global path:
the ``alloc`` lock, the bitmap scan, owner records), each against the store
+ flush + fence round trip measured in the same run (ratio = round trip /
value, so 1/3 means three round trips); and `alloc_many` of a batch of
``BATCH`` node-heap objects (what an index reserve takes), per object,
against as many `alloc` calls.  The lock manager runs in another process,
as `tract manager` would.
"""

from __future__ import annotations

import multiprocessing
import time

from tract.bench import Result
from tract.bench.lock import MAX_NODES, manage_locks, bench_pool
from tract.pool import Pool
from tract.region import scratch_region

SIZES = {"4KiB": 4 << 10, "64KiB": 64 << 10, "2MiB": 2 << 20, "16MiB": 16 << 20}
NODE_HEAP_MAX = 1 << 20  # half the default 2 MiB chunk: the largest slab object
BATCH = 16


def path_of(size: int) -> str:
    return "node-heap" if size <= NODE_HEAP_MAX else "global"


class Harness:
    """A 256 MiB pool with a manager process and this process as node 0."""

    def __init__(self):
        self.path = bench_pool()
        Pool.create(self.path, 256 << 20, max_nodes=MAX_NODES, lease_timeout=2.0)
        context = multiprocessing.get_context("fork")
        self.stop = context.Event()
        self.manager = context.Process(target=manage_locks, args=(self.path, self.stop))
        self.manager.start()
        self.pool = Pool.open(self.path, 0)
        self.pool.free(self.pool.alloc(4096, timeout=30))  # first grant, first slab

    def alloc_free(self, size: int) -> None:
        self.pool.free(self.pool.alloc(size))

    def batch_free(self, size: int, together: bool) -> None:
        """``BATCH`` objects by one `alloc_many` (``together``) or by as
        many `alloc` calls, then freed."""
        pool = self.pool
        offsets = pool.alloc_many(size, BATCH) if together else \
            [pool.alloc(size) for _ in range(BATCH)]
        for offset in offsets:
            pool.free(offset)

    def close(self) -> None:
        self.pool.close()
        self.stop.set()
        self.manager.join(30)
        Pool.destroy(self.path)


def _best_ns(function, rounds: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            function()
        best = min(best, (time.perf_counter() - start) / rounds)
    return best * 1e9


def run(quick: bool = False) -> list[Result]:
    round_trip = min(scratch_region(4096, name="bench-alloc").time_round_trip(0, 20000)
                     for _ in range(3))
    harness = Harness()
    results = []
    try:
        for label, size in SIZES.items():
            rounds = (2000 if quick else 20000) if size <= NODE_HEAP_MAX else \
                (200 if quick else 2000)
            value = _best_ns(lambda: harness.alloc_free(size), rounds)
            results.append(Result(f"alloc_free[{label},{path_of(size)}]", value, "ns", False,
                                  "store_flush_fence", round_trip))
        rounds = 200 if quick else 2000
        for label in ("4KiB", "64KiB"):
            size = SIZES[label]
            one_by_one = _best_ns(lambda: harness.batch_free(size, False), rounds) / BATCH
            value = _best_ns(lambda: harness.batch_free(size, True), rounds) / BATCH
            results.append(Result(f"alloc_many[{label}x{BATCH},node-heap]", value, "ns/object",
                                  False, "alloc_one_by_one", one_by_one))
    finally:
        harness.close()
    return results
