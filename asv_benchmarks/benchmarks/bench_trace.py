"""asv: the cache-control trace (`tract bench trace`, which compares the
shipped build with one that has no hook): the primitives with the trace off,
the production state, and on, as the twin tests run them."""

import numpy

from tract.region import scratch_region


class TraceHook:
    """A store + flush + fence round trip and a batch of 64 unaligned 4 KiB
    streaming copies, with the trace off and on."""

    params = (["off", "on"],)
    param_names = ["trace"]

    def setup(self, trace):
        self.region = scratch_region(8 << 20, name="asv-trace", populate=True)
        self.offsets = numpy.arange(64, dtype=numpy.int64) * 8192 + 4096 + 24
        self.sources = [numpy.full(4096, i, dtype=numpy.uint8) for i in range(64)]
        if trace == "on":
            self.region.trace_start(1 << 20)

    def teardown(self, trace):
        if trace == "on":
            try:
                self.region.trace_stop()
            except OverflowError:  # past its capacity it only counts: the cost measured
                pass
        self.region.close()

    def time_round_trips(self, trace):
        self.region.time_round_trip(0, 1000)

    def time_copy_in_blocks(self, trace):
        self.region.copy_in_blocks(self.offsets, self.sources)
