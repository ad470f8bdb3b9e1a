"""`tract bench scale`: what one operation costs a node in cache control, as
the rack grows.

A rack-scale cache must not make each operation dearer as nodes join: a
step that reads every node's line (a heartbeat, a pin counter, a request
line) costs one line per node, and at 64 nodes that is the whole budget of
a block.  These are counts, not timings, so they are exact: each operation
runs on the simulator (the Python protocol steps, which the fast twins
match line for line), and node 1's own trace (`SimHost.trace_start`) and
the lines it touched (`SimPool.watch`) are counted.

For each rack size (2, 4, 8, 16, 32 and 64 nodes; ``--quick``: 2, 8, 64) a
pool is formatted for that many nodes and every node joins (nodes 2 and up
on a third simulated host), node 0 running the lock manager; then node 1,
warmed up, does

- ``store``: `Connector.store` of 8 absent blocks, per block;
- ``load``: `Connector.load` of them, per block;
- ``evict``: `Index.remove` of them (mark, check every node's pins,
  free), per block;
- ``take``: `Connector.take` of 8 blocks node 0 offered, per take;
- ``lock``: an uncontended acquire + release of a manager-mode lock;
- ``lock_bakery``: the same in bakery mode (a second pool), which reads
  every node's ticket by design: its slope, per node, is reported.

Each figure is held to the same count at 2 nodes (ratio 1.0: constant).

Then the pool's size (`tract.bench.pool_size`): a store that evicts, per
block, against a plain copy, at each size, and another node's stores after
the node that filled the pool closed or was killed.  Then a crowd of
processes (`tract.bench.crowd`: 1 x 1 up to 8 processes, on one node or
several) storing and loading at once, on a pool that evicts and on one
that does not, against the same processes' plain copies.
"""

from __future__ import annotations

import numpy as np

from tract._native._region import TRACE_FENCE
from tract.bench import Result
from tract.connector import Connector
from tract.pool import Pool, format_pool
from tract.testing.incoherent import SimPool
from tract.transfer import KVLayout

__all__ = ["NODE_COUNTS", "counted", "measure", "run"]

NODE_COUNTS = (2, 4, 8, 16, 32, 64)
LEASE = 30.0  # virtual seconds: every node stays live while node 1 is measured
POLL = LEASE / 3000  # how long a waiting simulated thread sleeps
BLOCKS = 8
LAYOUT = KVLayout(model="scale", dtype="uint8", num_layers=2, num_kv_heads=1, head_size=64,
                  block_size=2)
METRICS = ("cache-control ops", "fences", "lines")


def _pool(nodes: int, mode: str) -> SimPool:
    pool = SimPool(3 << 20, hosts=3, seed=0, chaos=0.0, max_steps=20_000_000)
    format_pool(pool.hosts[0], max_nodes=nodes, locks=("alloc", "objects", "index"),
                max_locks=3, chunk_size=8192, max_objects=8, index_capacity=64,
                lock_mode=mode, lease_timeout=LEASE, hash_key=pool.hash_key)
    for host in pool.hosts:  # the formatted pool is in memory; every host starts fresh
        host.invalidate(0, pool.size)
        host.fence()
    return pool


def counted(pool: SimPool, host: int, action) -> dict[str, int]:
    """Node ``host``'s cache control and lines while ``action()`` runs."""
    region = pool.hosts[host]
    region.trace_start(1 << 20)
    try:
        with pool.watch(host) as lines:
            action()
    finally:
        trace = region.trace_stop()
    fences = int((trace[:, 0] >= TRACE_FENCE).sum()) if len(trace) else 0
    return {"cache-control ops": len(trace) - fences, "fences": fences, "lines": len(lines)}


def _keys(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**63, size=(BLOCKS, 2), dtype=np.uint64)


def _blocks(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in range(BLOCKS)]


def measure(nodes: int, mode: str = "manager") -> dict[str, dict[str, float]]:
    """Node 1's counts per operation (``store`` and ``load`` per block,
    ``take`` per take, ``lock`` per acquire + release) in a rack of
    ``nodes`` nodes whose locks run in ``mode``."""
    if not 2 <= nodes:
        raise ValueError(f"a rack to measure needs at least 2 nodes, got {nodes}")
    pool = _pool(nodes, mode)
    handles: dict[int, Pool] = {}
    state: dict[str, object] = {"joined": False, "offer": False, "ticket": None, "done": False}
    counts: dict[str, dict[str, float]] = {}

    def wait(condition) -> None:
        while not condition():
            pool.clock.sleep(POLL)

    def others(host) -> None:
        for node in range(2, nodes):
            Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
        state["joined"] = True

    def node0(host) -> None:
        handles[0] = Pool(host, 0, clock=pool.clock, heartbeat=False, local_locks=False)
        wait(lambda: state["offer"])
        producer = Connector(handles[0], LAYOUT, handoff_ttl=LEASE, timeout=LEASE)
        state["ticket"] = producer.offer("scale", _keys(3), _blocks(3))
        wait(lambda: state["done"])

    def manager(host) -> None:
        wait(lambda: 0 in handles)
        granting = handles[0].manager()
        while not state["done"]:
            pool.clock.sleep(POLL / 10 if granting.step() else POLL)

    def node1(host) -> None:
        wait(lambda: state["joined"] and 0 in handles)
        handle = Pool(host, 1, clock=pool.clock, heartbeat=False, local_locks=False)
        connector = Connector(handle, LAYOUT, handoff_ttl=LEASE, timeout=LEASE)
        outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(BLOCKS)]
        lock = handle.lock("alloc")
        # warm-up: the first allocations, the first judgement of the live nodes
        connector.store(_keys(1), _blocks(1))
        connector.load(_keys(1), outs)
        lock.acquire()
        lock.release()
        keys, blocks = _keys(2), _blocks(2)
        stored = counted(pool, 1, lambda: connector.store(keys, blocks))
        loaded = counted(pool, 1, lambda: connector.load(keys, outs))
        counts["store"] = {name: value / BLOCKS for name, value in stored.items()}
        counts["load"] = {name: value / BLOCKS for name, value in loaded.items()}
        removed = []
        evicted = counted(pool, 1, lambda: removed.append(handle.index.remove(keys)))
        if int(np.count_nonzero(removed[0])) != BLOCKS:
            raise AssertionError(f"{nodes} nodes: removed {removed[0]}, not {BLOCKS} blocks")
        counts["evict"] = {name: value / BLOCKS for name, value in evicted.items()}
        counts["lock"] = counted(pool, 1, lambda: (lock.acquire(), lock.release()))
        state["offer"] = True
        wait(lambda: state["ticket"] is not None)
        taken = []
        counts["take"] = counted(pool, 1, lambda: taken.append(
            connector.take(state["ticket"], outs)))
        if taken[0].blocks != BLOCKS:
            raise AssertionError(f"{nodes} nodes: took {taken[0]}, not {BLOCKS} blocks")
        state["done"] = True

    threads = [(2, others), (0, node0), (1, node1)]
    if mode == "manager":
        threads.append((0, manager))
    pool.run(*threads)
    return counts


def run(quick: bool = False, sizes: bool = True) -> list[Result]:
    """The counts per rack size on the simulator, then (``sizes``) on real
    pools: the pool's size (`tract.bench.pool_size`) and a crowd of
    processes (`tract.bench.crowd`)."""
    from tract.bench import crowd, pool_size

    return _counts(quick) + (pool_size.run(quick) + crowd.run(quick) if sizes else [])


def _counts(quick: bool) -> list[Result]:
    sizes = (2, 8, 64) if quick else NODE_COUNTS
    measured = {mode: {nodes: measure(nodes, mode) for nodes in sizes}
                for mode in ("manager", "bakery")}
    figures = [(operation, "manager", operation)
               for operation in ("store", "load", "evict", "take", "lock")]
    figures.append(("lock_bakery", "bakery", "lock"))
    results = []
    for name, mode, operation in figures:
        per = "block" if operation in ("store", "load", "evict") else operation
        for metric in METRICS:
            base = measured[mode][sizes[0]][operation][metric]
            for nodes in sizes:
                value = measured[mode][nodes][operation][metric]
                results.append(Result(f"scale[{name},{metric},nodes={nodes}]", float(value),
                                      f"{metric} per {per}", False,
                                      f"nodes={sizes[0]}" if nodes != sizes[0] else None,
                                      float(base) if nodes != sizes[0] and value else None))
            if name == "lock_bakery":
                top = measured[mode][sizes[-1]][operation][metric]
                results.append(Result(f"scale[{name},{metric},slope]",
                                      (top - base) / (sizes[-1] - sizes[0]),
                                      f"{metric} per lock per node", False))
    return results
