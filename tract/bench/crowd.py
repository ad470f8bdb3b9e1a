"""`tract bench scale`, processes: what a crowd of processes storing and
loading at once gets out of one pool, against the same processes copying
the same bytes in their own memory.

Shapes (nodes x processes per node): 1 x 1, 1 x 8, 2 x 4 and 8 x 1
(``--quick``: 1 x 1 and 2 x 2).  Each process opens the pool as its node
(the processes of a node share its node-local file, heap and lock tier 1)
and, over one pool of 256 MiB per shape, repeats for a phase:

- ``tract``: store 8 fresh 256 KiB blocks (a prompt of its own) through the
  public `Connector`, load them back; on the ``evicting`` pool the blocks
  stay, so the pool fills and each store evicts; on the ``recycling`` pool
  the process removes them after the load, so nothing is evicted;
- ``bare``: the same 8 blocks in and out of a mapping of its own in
  /dev/shm by the native copies tract's transfer makes
  (`Region.copy_in_blocks`: streamed, in memory on return, R3;
  `Region.copy_out_blocks`: the range dropped from the caches first, R4),
  without checksums, index or allocator: the least a correct store and
  load cost on memory no cache keeps coherent;
- ``copy`` (the control): copy the same 8 blocks into a buffer of its own
  and back, the same bytes each way, touching no pool.

The phases take turns, their order turned by one each round, every
process starting each phase together.  Reported per shape and pool: the
aggregate bytes per second of all processes (stored plus loaded; the
controls': in plus out), the paired ratios tract / copy and bare / copy
(median of the rounds with their range), and the global lock waits per
operation with their share of the processes' time (`tract.stats`
counters).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
import uuid

import numpy as np

from tract.bench import Result
from tract.bench.pool_size import BLOCKS, fill, layout, tokens

__all__ = ["measure", "run"]

SHAPES = ((1, 1), (1, 8), (2, 4), (8, 1))
QUICK_SHAPES = ((1, 1), (2, 2))
POOLS = ("evicting", "recycling")
POOL_MIB = 256
PHASES = ("tract", "bare", "copy")


def _worker(path, node, seed, kind, order, seconds, barrier, results) -> None:
    """One process of the crowd: warm up, then for each phase of ``order``
    wait at ``barrier`` and work for ``seconds``; puts (seed, [(phase,
    bytes, operations, lock waits, lock wait ns, seconds)])."""
    from tract.connector import Connector, warm_up
    from tract.pool import Pool
    from tract.region import scratch_region

    warm_up()
    shape = layout()
    blocks = [np.full(shape.block_bytes, seed & 0xFF, np.uint8) for _ in range(BLOCKS)]
    out = [np.empty(shape.block_bytes, np.uint8) for _ in range(BLOCKS)]
    mine = [np.empty(shape.block_bytes, np.uint8) for _ in range(BLOCKS)]
    serial = seed << 32
    bare = scratch_region(BLOCKS * shape.block_bytes, name="bench-crowd", populate=True)
    at = np.arange(BLOCKS, dtype=np.int64) * shape.block_bytes
    with bare, Pool.open(path, node, manager=True) as pool:
        kv = Connector(pool, shape, timeout=60.0)

        def tract_once() -> int:
            nonlocal serial
            serial += 1
            prompt = tokens(serial)
            stored = kv.store(prompt, blocks)
            loaded = kv.load(prompt, out)
            if kind == "recycling":
                kv.remove(prompt)
            return (stored + loaded) * shape.block_bytes

        def copy_once() -> int:
            for block, copy in zip(blocks, mine):
                np.copyto(copy, block)
            for copy, target in zip(mine, out):
                np.copyto(target, copy)
            return 2 * BLOCKS * shape.block_bytes

        def bare_once() -> int:
            bare.copy_in_blocks(at, blocks)
            bare.copy_out_blocks(at, out)
            return 2 * BLOCKS * shape.block_bytes

        steps = {"tract": tract_once, "bare": bare_once, "copy": copy_once}
        for _ in range(4):  # pages, kernels, the locks' first grants
            for once in steps.values():
                once()
        done = []
        for phase in order:
            once = steps[phase]
            barrier.wait(timeout=600)
            before = pool.counters().get(pool.node, {})
            moved = operations = 0
            start = time.perf_counter()
            end = start + seconds
            while time.perf_counter() < end:
                moved += once()
                operations += 1
            took = time.perf_counter() - start
            after = pool.counters().get(pool.node, {})
            # a node's counters count all its processes: the parent takes one per node
            waits = [after.get(name, 0) - before.get(name, 0)
                     for name in ("lock_waits", "lock_wait_ns")]
            done.append((phase, moved, operations, *waits, took))
        kv.close()
    results.put((seed, done))


def _fill(path: str) -> None:
    """Store until a store evicts (the evicting pool starts full)."""
    from tract.connector import Connector
    from tract.pool import Pool

    with Pool.open(path, 0, manager=True) as pool:
        kv = Connector(pool, layout(), timeout=60.0)
        fill(kv, pool, 1 << 40)
        kv.close()


def measure(nodes: int, per_node: int, kind: str, rounds: int, seconds: float,
            pool_mib: int = POOL_MIB) -> dict:
    """One shape on one fresh pool of ``pool_mib`` MiB: {phase: [aggregate
    bytes per second of each round]}, and ``lock_waits`` (waits per tract
    operation, share of the processes' tract time spent waiting)."""
    from tract.pool import Pool

    order = [PHASES[(round_ + step) % len(PHASES)] for round_ in range(rounds)
             for step in range(len(PHASES))]
    path = f"/dev/shm/tract-bench-crowd-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    Pool.create(path, pool_mib << 20, max_nodes=max(2, nodes), lease_timeout=2.0)
    context = multiprocessing.get_context("spawn")
    processes = []
    try:
        if kind == "evicting":
            _fill(path)
        count = nodes * per_node
        barrier, results = context.Barrier(count), context.Queue()
        processes = [context.Process(target=_worker, args=(
            path, index // per_node, index + 1, kind, order, seconds, barrier, results),
            daemon=True) for index in range(count)]
        for process in processes:
            process.start()
        reports = [results.get(timeout=600 + 2 * len(order) * seconds) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.exitcode is None:
                process.kill()
        Pool.destroy(path)
    rates = {phase: [] for phase in PHASES}
    operations = waits = wait_ns = busy = 0
    for step, phase in enumerate(order):
        rows = [done[step] for _, done in reports]
        # every process started the phase together: the aggregate is all bytes
        # over the longest process's time
        rates[phase].append(sum(row[1] for row in rows) / max(row[5] for row in rows))
        if phase == "tract":
            operations += sum(row[2] for row in rows)
            busy += sum(row[5] for row in rows)
            # each process read its node's counters: a node's waits once
            by_node = {}
            for (seed, _), row in zip(reports, rows):
                by_node[(seed - 1) // per_node] = row
            waits += sum(row[3] for row in by_node.values())
            wait_ns += sum(row[4] for row in by_node.values())
    rates["lock_waits"] = (waits / max(operations, 1), wait_ns / 1e9 / max(busy, 1e-9))
    return rates


def run(quick: bool = False) -> list[Result]:
    shapes, rounds, seconds = (QUICK_SHAPES, 2, 0.5) if quick else (SHAPES, 5, 2.0)
    results = []
    for kind in POOLS:
        for nodes, per_node in shapes:
            found = measure(nodes, per_node, kind, rounds, seconds)
            copy = found["copy"]
            name = f"scale[crowd,{kind},{nodes}x{per_node}]"
            per_op, share = found["lock_waits"]
            for phase in ("tract", "bare"):
                ratios = sorted(ours / theirs for ours, theirs in zip(found[phase], copy))
                results.append(Result(
                    f"{name}[{phase}]", statistics.median(found[phase]) / 1e9,
                    "GB/s, all processes", True, "plain copy", statistics.median(copy) / 1e9,
                    (statistics.median(ratios), ratios[0], ratios[-1])))
            results += [
                Result(f"{name}[lock_waits]", per_op, "global lock waits per store+load",
                       False),
                Result(f"{name}[lock_wait_share]", share,
                       "share of the processes' time in global lock waits", False)]
    return results
