"""`tract bench scale`: what one operation costs a node in cache control as
the rack grows, counted exactly on the simulator."""

import numpy as np
import pytest

from tract.bench import run
from tract.testing.bench_scale import measure


@pytest.fixture(scope="module")
def counts():
    return {(nodes, mode): measure(nodes, mode) for nodes in (2, 16) for mode in
            ("manager", "bakery")}


def test_store_load_take_and_the_manager_lock_cost_the_same_in_any_rack(counts):
    """A node's store, load and take, and its uncontended manager-mode
    acquire + release, touch no line per other node: the same counts at 2
    and 16 nodes."""
    small, large = counts[(2, "manager")], counts[(16, "manager")]
    for operation in ("store", "load", "take", "lock"):
        assert large[operation] == small[operation], operation
    assert small["lock"]["fences"] <= 4 and small["store"]["lines"] > 0


def test_bakery_and_eviction_read_a_line_per_node(counts):
    """The bakery reads every node's ticket, an eviction every node's pin
    of the slot: by design, one line per node more."""
    small, large = counts[(2, "bakery")], counts[(16, "bakery")]
    assert large["lock"]["lines"] - small["lock"]["lines"] == 14
    small, large = counts[(2, "manager")], counts[(16, "manager")]
    assert large["evict"]["lines"] - small["evict"]["lines"] >= 14


def test_the_bench_reports_each_count_against_two_nodes():
    results = {r["name"]: r for r in run("scale", quick=True, sizes=False)["results"]}
    store = results["scale[store,cache-control ops,nodes=64]"]
    assert store["baseline"] == "nodes=2" and store["ratio"] == 1.0
    assert results["scale[lock_bakery,lines,slope]"]["value"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        measure(1)


def _full_pool_counts(size: int) -> dict[str, dict[str, int]]:
    """On a simulated pool of ``size`` bytes filled with one-chunk payloads
    (until a store evicts), node 0's cache control and lines for a store of
    8 more (reserve and publish: each evicts), a lookup of them and an
    eviction of 8."""
    from tract.pool import Pool, format_pool
    from tract.testing.bench_scale import counted
    from tract.testing.incoherent import SimPool

    pool = SimPool(size, hosts=1, seed=0, chaos=0.0, max_steps=50_000_000)
    format_pool(pool.hosts[0], max_nodes=2, locks=("alloc", "objects", "index"), max_locks=3,
                chunk_size=8192, max_objects=8, index_capacity=size // 1024,
                lock_mode="bakery", lease_timeout=30.0, hash_key=pool.hash_key)
    handle = Pool(pool.hosts[0], 0, clock=pool.clock, heartbeat=False, local_locks=False)
    rng = np.random.default_rng(3)

    def store():
        keys = rng.integers(0, 2**63, size=(8, 2), dtype=np.uint64)
        handle.index.publish(handle.index.reserve(keys, 8192), np.zeros(8, np.uint64))
        return keys

    while not handle.counters().get(0, {}).get("evictions"):
        store()
    keys = []
    counts = {"store": counted(pool, 0, lambda: [keys.append(store()) for _ in range(4)])}
    counts["lookup"] = counted(pool, 0, lambda: [handle.index.lookup(k) for k in keys])
    counts["evict"] = counted(pool, 0, lambda: [handle.index.evict(8) for _ in range(4)])
    return counts


def test_a_full_pools_store_lookup_and_eviction_cost_the_same_at_four_times_the_size():
    """The records a step reads do not grow with the pool: 4 stores that
    evict, 4 lookups and 4 evictions touch as many lines, with as much
    cache control, on a pool four times larger (its index too), but for
    what the sampled victims' chains differ by (a fifth at most; a walk of
    the owner records or of the index would take 4 times as many).  The
    allocator's bitmap is read whole at a chunk allocation: one line per
    512 chunks, the same line here (128 and 512 chunks)."""
    small, large = _full_pool_counts(1 << 20), _full_pool_counts(4 << 20)
    for step, counts in small.items():
        for metric, count in counts.items():
            assert 0 < large[step][metric] <= 1.2 * count, (step, metric, small, large)
