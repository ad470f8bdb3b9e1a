"""asv: the native mapping and its cache-control primitives (`tract bench region`).

Sizes sit on both sides of a cache line (64 B), a page (4 KiB) and a chunk
(2 MiB).  Every copy starts with the pool range out of this host's cache, as
a freshly allocated block or one written by another host is.
"""

import numpy

from tract import platform
from tract.region import scratch_region

SIZES = [63, 64, 65, 4095, 4096, 4097, (2 << 20) - 1, 2 << 20, (2 << 20) + 1]
OFFSET = 64


def _region(size, flush=None):
    return scratch_region(size, name="asv", flush=flush, populate=True)


class CopyIn:
    """Copy into the pool: numpy copyto (baseline), tract's plain copy, and
    the non-temporal copy that leaves the bytes in memory (R3)."""

    params = (SIZES, ["numpy_copyto", "plain", "nontemporal"])
    param_names = ["size", "method"]

    def setup(self, size, method):
        self.region = _region(OFFSET + size + 64)
        self.view = self.region.view(OFFSET, size)
        self.source = numpy.random.default_rng(size).integers(0, 256, size, dtype=numpy.uint8)
        self.size = size

    def teardown(self, size, method):
        del self.view
        self.region.close()

    def time_copy_in(self, size, method):
        self.region.invalidate(OFFSET, size, payload=True)
        if method == "numpy_copyto":
            numpy.copyto(self.view, self.source)
        else:
            self.region.copy_in(OFFSET, self.source, nontemporal=method == "nontemporal")


class CopyOut:
    """Copy out of the pool after an invalidate (R4): numpy copyto (baseline)
    against tract's copy_out."""

    params = (SIZES, ["numpy_copyto", "copy_out"])
    param_names = ["size", "method"]

    def setup(self, size, method):
        self.region = _region(OFFSET + size + 64)
        self.view = self.region.view(OFFSET, size)
        self.target = numpy.ones(size, dtype=numpy.uint8)

    def teardown(self, size, method):
        del self.view
        self.region.close()

    def time_copy_out(self, size, method):
        self.region.invalidate(OFFSET, size, payload=True)
        if method == "numpy_copyto":
            numpy.copyto(self.target, self.view)
        else:
            self.region.copy_out(OFFSET, self.target)


def _instructions():
    return [name for name in platform.FLUSH_CHOICES if platform.cpu_features()[name]]


class FlushLines:
    """Nanoseconds per flushed line, dirty or clean, per instruction, for one
    line, a page and a chunk of lines."""

    params = (_instructions(), [1, 64, 32768], [True, False])
    param_names = ["instruction", "lines", "dirty"]

    def setup(self, instruction, lines, dirty):
        self.region = _region(lines * 64, flush=instruction)

    def teardown(self, instruction, lines, dirty):
        self.region.close()

    def track_ns_per_line(self, instruction, lines, dirty):
        return self.region.time_flush_lines(0, lines, dirty, 5)

    track_ns_per_line.unit = "ns"


class RoundTrip:
    """Store + flush + fence on one line: the unit metadata costs are quoted in."""

    params = _instructions()
    param_names = ["instruction"]

    def setup(self, instruction):
        self.region = _region(4096, flush=instruction)

    def teardown(self, instruction):
        self.region.close()

    def track_round_trip_ns(self, instruction):
        return min(self.region.time_round_trip(0, 5000) for _ in range(3))

    track_round_trip_ns.unit = "ns"
