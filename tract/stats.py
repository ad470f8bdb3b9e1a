"""Per-node counters in the pool: what every node did, readable from any host.

Each node owns `STATS_BYTES` (four lines) of the pool's stats area, one u64
per counter in `COUNTERS` order.  Only that node's processes write them
(R2): each counts in its own memory and publishes every heartbeat, adding
atomically among the node's processes (one host's caches are coherent),
then flushing the lines and fencing (R3).  A reader drops the
whole area from its cache and fences before it reads (R4).  Counters are
plain counts that only grow; nothing read here is used as an offset, so R5
asks nothing more of them.

Names follow Prometheus conventions when exported (`tract stat
--prometheus-port`): ``tract_<name>_total``, and ``_seconds`` for times
(the pool keeps nanoseconds).
"""

from __future__ import annotations

import threading

import numpy as np

from tract.errors import ConfigError
from tract.lines import LINE

__all__ = ["COUNTERS", "STATS_BYTES", "NodeStats", "PoolCollector", "format_table",
           "metric_name", "read_stats", "serve_prometheus"]

#: counter name -> what it counts (pool order: never reorder, only append)
COUNTERS = {
    "lookups": "prefix lookups",
    "hit_blocks": "blocks loaded from the pool (prefix loads and handoff takes)",
    "miss_blocks": "blocks a load or take asked for and did not get",
    "stored_blocks": "blocks this node published",
    "evictions": "entries this node evicted",
    "written_bytes": "payload bytes this node copied into the pool",
    "read_bytes": "payload bytes this node copied out of the pool",
    "pins": "entries this node pinned",
    "checksum_failures": "blocks whose checksum did not match (served as misses)",
    "lock_waits": "global lock acquisitions that had to wait",
    "lock_wait_ns": "time spent waiting for global locks (ns)",
    "offers": "P/D handoffs offered",
    "takes": "P/D handoffs taken",
    "handoff_misses": "takes that found no live offer",
    "not_stored": "blocks a store had no room for (a full pool; the engine recomputes them)",
    "not_offered": "P/D handoffs a full pool had no room for (the decode side recomputes)",
    "tier_hit_blocks": "blocks loaded from the cluster tier (rack misses it held)",
    "tier_miss_blocks": "rack misses the cluster tier did not hold either (or held corrupt)",
    "tier_read_bytes": "bytes loaded from the cluster tier",
    "tier_written_bytes": "bytes stored to the cluster tier",
    "tier_stored_blocks": "blocks stored to the cluster tier",
    "tier_promotions": "cluster-tier hits stored into the rack's pool",
    "tier_failures": "cluster-tier calls that failed, timed out or were skipped (misses)",
    "tier_corrupt": "cluster-tier blocks found torn, misfiled or altered (misses)",
    "tier_demotions": "blocks the rack evicted and put into the cluster tier (write-back)",
    "fenced": "connector operations that wrote (or trusted) nothing: this node's own lease "
              "had lapsed (R6)",
    "rejoins": "times this node rejoined as a new incarnation after its lease lapsed",
}
STATS_BYTES = 4 * LINE
assert len(COUNTERS) * 8 <= STATS_BYTES
_INDEX = {name: i for i, name in enumerate(COUNTERS)}
_WORDS = STATS_BYTES // 8


class NodeStats:
    """This node's counters (``node``'s `STATS_BYTES` at ``base``).

    `add` only counts in this process (no pool access, so no flush or fence
    lands inside a protocol's steps); `publish` adds what was counted to the
    pool's lines and makes it visible.  A pool's heartbeat thread publishes
    every beat, and `Pool.counters` and `Pool.close` publish first."""

    def __init__(self, region, base: int, node: int):
        self.region, self.offset = region, base + node * STATS_BYTES
        self._pending = [0] * _WORDS  # Python ints: a count costs no numpy call
        self._mutex = threading.Lock()

    def add(self, **deltas: int) -> None:
        """Count (published by the next `publish`)."""
        for name, delta in deltas.items():
            if name not in _INDEX:
                raise ValueError(f"no pool counter named {name!r}; known: {list(COUNTERS)}")
            if delta < 0:
                raise ValueError(f"pool counters only grow: {name} += {delta}")
        with self._mutex:
            pending = self._pending
            for name, delta in deltas.items():
                pending[_INDEX[name]] += int(delta)

    def publish(self) -> None:
        """Add the counts so far to the pool: in memory on return (R3)."""
        with self._mutex:
            counts, self._pending = self._pending, [0] * _WORDS
        if not any(counts):
            return
        words = np.array([count & 0xFFFF_FFFF_FFFF_FFFF for count in counts], dtype=np.uint64)
        self.region.local_add_u64s(self.offset, words)
        self.region.flush(self.offset, STATS_BYTES)
        self.region.fence()


def read_stats(region, base: int, max_nodes: int) -> np.ndarray:
    """Every node's counters, read fresh: a (max_nodes, len(COUNTERS))
    uint64 array."""
    region.invalidate(base, max_nodes * STATS_BYTES)
    region.fence()
    raw = np.frombuffer(region.read(base, max_nodes * STATS_BYTES), dtype="<u8")
    return raw.reshape(max_nodes, _WORDS)[:, :len(COUNTERS)].astype(np.uint64)


def metric_name(counter: str) -> str:
    """The Prometheus name of a counter (the exposition adds ``_total``)."""
    if counter.endswith("_ns"):
        return f"tract_{counter[:-3]}_seconds"
    return f"tract_{counter}"


def format_table(counters: dict[int, dict[str, int]]) -> str:
    """The counters as a table: one column per node, one row per counter."""
    if not counters:
        return "no node has counted anything yet"
    nodes = sorted(counters)
    width = max(12, *(len(f"{v:,}") for row in counters.values() for v in row.values()))
    lines = [f"{'counter':<20}" + "".join(f"{f'node {n}':>{width + 2}}" for n in nodes)]
    for name in COUNTERS:
        cells = []
        for node in nodes:
            value = counters[node][name]
            cells.append(f"{value / 1e9:>{width + 1}.3f}s" if name.endswith("_ns")
                         else f"{value:>{width + 2},}")
        lines.append(f"{name.removesuffix('_ns'):<20}" + "".join(cells))
    return "\n".join(lines)


class PoolCollector:
    """A `prometheus_client` collector: the pool's counters, read fresh at
    every scrape, labelled by node."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        counters = self.pool.counters()
        for name, help_text in COUNTERS.items():
            family = CounterMetricFamily(metric_name(name), help_text, labels=["node"])
            for node, row in sorted(counters.items()):
                value = row[name] / 1e9 if name.endswith("_ns") else row[name]
                family.add_metric([str(node)], value)
            yield family


def serve_prometheus(pool, port: int, host: str = "127.0.0.1"):
    """Export the pool's counters on http://host:port/metrics; returns the
    server (``.shutdown()`` stops it)."""
    try:
        from prometheus_client import start_http_server
        from prometheus_client.core import CollectorRegistry
    except ImportError:
        raise ConfigError("--prometheus-port needs the prometheus_client package "
                          "(pip install prometheus_client)") from None
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
