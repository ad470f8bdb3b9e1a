"""Per-node pool counters: each node's counts reach every other host under
the non-coherent simulator, a node's processes add without losing counts,
and the counts the connector keeps agree with what it did.

Tests marked ``sim`` are the suite the mutation harness runs against every
mutant of tract.stats (TRACT_SIM_SEEDS sets the seeds).
"""

import multiprocessing

import numpy as np
import pytest

from tract.connector import Connector
from tract.pool import Pool, format_pool
from tract.stats import COUNTERS, format_table, metric_name
from tract.testing.incoherent import SimPool, SimulationFailure
from tract.transfer import KVLayout
from tract.testing.seeds import count

SEEDS = count()


def run_counts(seed, rounds=5, chaos=0.3):
    """Nodes 0 and 1 count; host 2 reads every node's counters as they go
    (never more than was added, never going back) and, once both are done,
    reads exactly what they added."""
    pool = SimPool(128 * 1024, hosts=3, seed=seed, chaos=chaos, max_steps=200_000)
    format_pool(pool.hosts[0], max_nodes=3, locks=("alloc", "objects"), max_locks=2,
                chunk_size=8192, max_objects=8, index_capacity=64, lock_mode="bakery",
                hash_key=pool.hash_key)
    for host in pool.hosts:
        host.invalidate(0, pool.size)
        host.fence()
    handles = [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
               for node, host in enumerate(pool.hosts)]
    added = {0: 0, 1: 0}
    done = []

    def counter(node):
        def body(host):
            for step in range(1, rounds + 1):
                added[node] += step  # first: a reader may see the add before it returns
                handles[node].stats.add(hit_blocks=step, written_bytes=7 * step)
                handles[node].stats.publish()
                pool.clock.sleep(1e-6)
            done.append(node)
        return body

    def reader(host):
        seen = {0: 0, 1: 0}
        while True:
            finished = len(done) == 2  # before the read: it must then see every count
            counters = handles[2].counters()
            for node in (0, 1):
                got = counters.get(node, {"hit_blocks": 0, "written_bytes": 0})
                if not seen[node] <= got["hit_blocks"] <= added[node]:
                    raise AssertionError(f"node {node}: read {got['hit_blocks']} after "
                                         f"{seen[node]}, {added[node]} added")
                seen[node] = got["hit_blocks"]
                if finished and (got["hit_blocks"], got["written_bytes"]) != \
                        (added[node], 7 * added[node]):
                    raise AssertionError(f"node {node}: read {got}, added {added[node]}")
            if finished:
                return
            pool.clock.sleep(1e-6)

    pool.run(counter(0), counter(1), reader)
    if pool.lost_updates:
        raise SimulationFailure(f"lost update at {pool.lost_updates[0].line_offset}", seed)


@pytest.mark.sim
@pytest.mark.parametrize("seed", range(SEEDS))
def test_counts_reach_other_hosts(seed):
    run_counts(seed)


def _add_many(path, node, times):
    with Pool.open(path, node) as pool:
        for _ in range(times):
            pool.stats.add(pins=1, lock_wait_ns=3)
            pool.stats.publish()


def test_a_nodes_processes_add_without_losing_counts(tmp_path):
    path = str(tmp_path / "pool")
    Pool.create(path, 32 << 20, max_nodes=4)
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_add_many, args=(path, 1, 2000)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    with Pool.observe(path) as pool:
        counters = pool.counters()
    assert set(counters) == {1}
    assert counters[1]["pins"] == 6000 and counters[1]["lock_wait_ns"] == 18000
    Pool.destroy(path)


def test_bad_counts_are_refused(tmp_path):
    path = str(tmp_path / "pool")
    Pool.create(path, 32 << 20, max_nodes=4)
    with Pool.open(path, 2) as pool:
        with pytest.raises(ValueError, match="no pool counter named 'hits'"):
            pool.stats.add(hits=1)
        with pytest.raises(ValueError, match="only grow"):
            pool.stats.add(pins=-1)
        assert pool.counters() == {}
    Pool.destroy(path)


def test_the_connector_counts_what_it_did(tmp_path):
    path = str(tmp_path / "pool")
    Pool.create(path, 64 << 20, max_nodes=4)
    layout = KVLayout(model="m", dtype="uint8", num_layers=2, num_kv_heads=1, head_size=64,
                      block_size=4)
    with Pool.open(path, 1, manager=True) as pool:
        connector = Connector(pool, layout)
        tokens = np.arange(40, dtype=np.int32)
        blocks = [np.full(layout.block_bytes, i, np.uint8) for i in range(10)]
        assert connector.store(tokens[:24], blocks[:6]) == 6
        assert connector.lookup(tokens) == 24
        outs = [np.empty(layout.block_bytes, np.uint8) for _ in range(10)]
        assert connector.load(tokens, outs) == 6
        assert pool.index.evict(2, window=pool.index.capacity) == 2
        counters = pool.counters()[1]
    assert counters["stored_blocks"] == 6 and counters["written_bytes"] == 6 * layout.block_bytes
    assert counters["lookups"] == 1 and counters["hit_blocks"] == 6
    assert counters["miss_blocks"] == 4 and counters["read_bytes"] == 6 * layout.block_bytes
    assert counters["pins"] == 6 and counters["evictions"] == 2
    assert counters["lock_waits"] >= 2  # reserve and publish took the index lock
    assert {name: connector.stats[name] for name in ("stored_blocks", "hit_blocks")} == \
        {"stored_blocks": 6, "hit_blocks": 6}
    Pool.destroy(path)


def test_names_and_table():
    assert metric_name("lock_wait_ns") == "tract_lock_wait_seconds"
    assert metric_name("hit_blocks") == "tract_hit_blocks"
    table = format_table({0: dict.fromkeys(COUNTERS, 0) | {"lock_wait_ns": 1_500_000_000},
                          5: dict.fromkeys(COUNTERS, 12345)})
    assert "node 5" in table and "12,345" in table and "1.500s" in table
    assert format_table({}) == "no node has counted anything yet"
