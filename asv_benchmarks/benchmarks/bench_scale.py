"""asv: what one operation costs a node in cache control as the rack grows
(`tract bench scale`): exact counts on the simulator, tracked per rack
size; every path but bakery acquisition and eviction is constant."""

from tract.testing.bench_scale import measure


class PerOperation:
    """Node 1's cache-control operations, fences and lines per operation."""

    params = [[2, 16, 64], ["store", "load", "evict", "take", "lock"],
              ["cache-control ops", "fences", "lines"]]
    param_names = ["nodes", "operation", "metric"]

    def setup_cache(self):
        return {nodes: measure(nodes) for nodes in self.params[0]}

    def track_count(self, counts, nodes, operation, metric):
        return counts[nodes][operation][metric]

    track_count.unit = "per block (store, load, evict) or per operation"


class BakeryLock:
    """The bakery lock reads every node's ticket: linear by design."""

    params = [[2, 16, 64]]
    param_names = ["nodes"]

    def track_cache_control_ops(self, nodes):
        return measure(nodes, "bakery")["lock"]["cache-control ops"]

    track_cache_control_ops.unit = "cache-control ops per acquire + release"
