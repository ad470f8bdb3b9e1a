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


class PoolSize:
    """A store that evicts, per block, on a full pool of each size, as a
    share of a plain copy of the block (`tract bench scale` runs it up to
    8 GiB): flat in the pool's size."""

    params = [[64, 256]]
    param_names = ["pool_mib"]
    timeout = 300

    def setup(self, pool_mib):
        import os
        import uuid

        from tract.pool import Pool

        self.path = f"/dev/shm/tract-asv-size-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        Pool.create(self.path, pool_mib << 20)

    def teardown(self, pool_mib):
        from tract.pool import Pool

        Pool.destroy(self.path)

    def track_store_per_copy(self, pool_mib):
        import statistics

        from tract.bench.pool_size import store_evict

        stores, plain = store_evict(self.path, 40)
        return statistics.median(stores) / statistics.median(plain)

    track_store_per_copy.unit = "plain copies per stored block"
