"""Per-node counters in the pool: what every node did, readable from any host.

Each node owns `STATS_BYTES` (two lines) of the pool's stats area, one u64
per counter in `COUNTERS` order.  Only that node's processes write them
(R2): they add atomically among themselves (one host's caches are
coherent), then flush the lines and fence, so a reader on another host sees
each update once the call that made it returns (R3).  A reader drops the
whole area from its cache and fences before it reads (R4).  Counters are
plain counts that only grow; nothing read here is used as an offset, so R5
asks nothing more of them.

Names follow Prometheus conventions when exported (`tract stat
--prometheus-port`): ``tract_<name>_total``, and ``_seconds`` for times
(the pool keeps nanoseconds).
"""

from __future__ import annotations

import numpy as np

from tract.lease import LINE

__all__ = ["COUNTERS", "STATS_BYTES", "NodeStats", "read_stats"]

#: counter name -> what it counts (pool order: never reorder, only append)
COUNTERS = {
    "lookups": "prefix lookups",
    "hit_blocks": "blocks loaded from the pool (prefix loads and handoff takes)",
    "miss_blocks": "blocks a load or take asked for and did not get",
    "stored_blocks": "blocks this node published",
    "evictions": "entries this node evicted",
    "bytes_in": "payload bytes this node copied into the pool",
    "bytes_out": "payload bytes this node copied out of the pool",
    "pins": "entries this node pinned",
    "checksum_failures": "blocks whose checksum did not match (served as misses)",
    "lock_waits": "global lock acquisitions that had to wait",
    "lock_wait_ns": "time spent waiting for global locks (ns)",
    "offers": "P/D handoffs offered",
    "takes": "P/D handoffs taken",
    "handoff_misses": "takes that found no live offer",
}
STATS_BYTES = 2 * LINE
assert len(COUNTERS) * 8 <= STATS_BYTES
_INDEX = {name: i for i, name in enumerate(COUNTERS)}
_WORDS = STATS_BYTES // 8


class NodeStats:
    """This node's counters (``node``'s `STATS_BYTES` at ``base``)."""

    def __init__(self, region, base: int, node: int):
        self.region, self.offset = region, base + node * STATS_BYTES

    def add(self, **deltas: int) -> None:
        """Add to the named counters; in memory for other hosts on return."""
        words = np.zeros(_WORDS, dtype=np.uint64)
        for name, delta in deltas.items():
            if name not in _INDEX:
                raise ValueError(f"no pool counter named {name!r}; known: {list(COUNTERS)}")
            if delta < 0:
                raise ValueError(f"pool counters only grow: {name} += {delta}")
            words[_INDEX[name]] = delta
        if not words.any():
            return
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
