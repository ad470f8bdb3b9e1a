"""asv: the allocator (`tract bench alloc`): alloc + free on the node-heap
path (4 KiB, 64 KiB: a slab block) and the global path (2 MiB, 16 MiB: the
alloc lock, bitmap scan and owner records), next to the store + flush +
fence round trip they are judged against; and a batch by `alloc_many`
against as many `alloc` calls."""

from tract.bench import alloc as bench
from tract.region import scratch_region


class AllocFree:
    """One alloc and one free of an object of the given size."""

    params = list(bench.SIZES)
    param_names = ["size"]

    def setup(self, size):
        self.harness = bench.Harness()
        self.size = bench.SIZES[size]

    def teardown(self, size):
        self.harness.close()

    def time_alloc_free(self, size):
        self.harness.alloc_free(self.size)


class AllocMany:
    """``BATCH`` node-heap objects by one `alloc_many`, or one by one, then freed."""

    params = (["4KiB", "64KiB"], [True, False])
    param_names = ["size", "together"]

    def setup(self, size, together):
        self.harness = bench.Harness()
        self.size = bench.SIZES[size]

    def teardown(self, size, together):
        self.harness.close()

    def time_batch_free(self, size, together):
        self.harness.batch_free(self.size, together)


class RoundTrip:
    """The baseline: store + flush + fence on one line."""

    def setup(self):
        self.region = scratch_region(4096, name="asv-alloc")

    def teardown(self):
        self.region.close()

    def time_store_flush_fence(self):
        self.region.time_round_trip(0, 1)
