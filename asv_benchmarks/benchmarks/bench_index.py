"""asv: the prefix index (`tract bench index`): per batch of 64 chained
keys at 70% load, lookup + pin + validate + unpin, lookup alone,
reserve + publish, and the eviction that keeps the load at 70%, next to
the store + flush + fence round trip they are judged against."""

import numpy as np

from tract.bench import index as bench
from tract.region import scratch_region


class Batch:
    """One batch of 64 keys (divide by 64 for the cost per block)."""

    def setup(self):
        self.harness = bench.Harness(1 << 12)
        self.rng = np.random.default_rng(3)

    def teardown(self):
        self.harness.close()

    def time_pin_unpin(self):
        self.harness.pin_unpin(self.harness.batch(self.harness.present, self.rng))

    def time_lookup(self):
        self.harness.index.lookup(self.harness.batch(self.harness.present, self.rng))

    def time_reserve_publish(self):
        bench._drop(self.harness, self.harness.publish(self.harness.publish_fresh()))

    def track_evict(self):
        """Nanoseconds per entry evicted, over 8 batches published then
        evicted (only the eviction timed)."""
        _, evict = bench._publish_ns(self.harness, 8)
        return evict

    track_evict.unit = "ns"


class RoundTrip:
    """The baseline: store + flush + fence on one line."""

    def setup(self):
        self.region = scratch_region(4096, name="asv-index")

    def teardown(self):
        self.region.close()

    def time_store_flush_fence(self):
        self.region.time_round_trip(0, 1)
