"""`tract bench scale`: what one operation costs a node in cache control as
the rack grows, counted exactly on the simulator."""

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
    results = {r["name"]: r for r in run("scale", quick=True)["results"]}
    store = results["scale[store,cache-control ops,nodes=64]"]
    assert store["baseline"] == "nodes=2" and store["ratio"] == 1.0
    assert results["scale[lock_bakery,lines,slope]"]["value"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        measure(1)
