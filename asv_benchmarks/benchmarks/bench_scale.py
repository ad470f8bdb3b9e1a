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


class Crowd:
    """Processes storing and loading at once (`tract bench scale` runs 1 x 1
    to 8 x 1 and 2 x 4): the aggregate bytes per second as a share of the
    same processes' plain copies (0.5 is the target)."""

    params = [["2x1"], ["evicting", "recycling"]]
    param_names = ["nodes_x_processes", "pool"]
    timeout = 300

    def track_share_of_copy(self, shape, pool):
        import statistics

        from tract.bench.crowd import measure

        nodes, per_node = (int(n) for n in shape.split("x"))
        found = measure(nodes, per_node, pool, 1, 0.5, pool_mib=64)
        return statistics.median(found["tract"]) / statistics.median(found["copy"])

    track_share_of_copy.unit = "tract GB/s per plain-copy GB/s"
