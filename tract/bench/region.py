"""`tract bench region`: the native mapping and its cache-control primitives.

Measured, each against a baseline from the same run:

Every copy starts with the pool range out of this host's cache, as a block
freshly allocated or written by another host is (R4 invalidates it).

- copy-in GB/s, plain and non-temporal, against numpy ``copyto`` into the
  same mapping, and the non-temporal copy against what a correct writer to a
  non-coherent pool must otherwise do: ``copyto`` then write the range back
  (R3);
- copy-out GB/s against numpy ``copyto`` out of the same mapping;
- nanoseconds per flushed line, dirty and clean, per instruction;
- the store + flush + fence round trip on one line, per instruction: the unit
  later benchmarks quote metadata costs in.
"""

from __future__ import annotations

import numpy

from tract import platform
from tract.bench import Result, median_time
from tract.region import scratch_region

KIB, MIB = 1 << 10, 1 << 20


def run(quick: bool = False) -> list[Result]:
    sizes = [256 * KIB, 2 * MIB, 16 * MIB] + ([] if quick else [256 * MIB])
    results: list[Result] = []
    for size in sizes:
        results += _copies(size, repeats=5 if quick else 25)
    for instruction in platform.FLUSH_CHOICES:
        if platform.cpu_features()[instruction]:
            results += _flushes(instruction, quick)
    return results


def _label(size: int) -> str:
    return f"{size // MIB}MiB" if size >= MIB else f"{size // KIB}KiB"


def _copies(size: int, repeats: int) -> list[Result]:
    offset = 64  # one line in: the head and tail lines are whole lines
    # The fastest write-back this CPU has, so the copyto + write-back
    # baseline is the best a plain copy can do.
    features = platform.cpu_features()
    flush = "clflushopt" if features["clflushopt"] else None
    region = scratch_region(offset + size + 64, name="bench-region", populate=True, flush=flush)
    try:
        times = _time_copies(region, offset, size, repeats)
    finally:
        region.close()
    rate = {name: size / seconds / 1e9 for name, seconds in times.items()}
    label = _label(size)

    def gbps(name: str, baseline: str) -> Result:
        return Result(f"{name}[{label}]", rate[name], "GB/s", True,
                      f"{baseline}[{label}]", rate[baseline])

    return [
        gbps("copy_in", "numpy_copyto_in"),
        gbps("copy_in_nt", "numpy_copyto_in"),
        gbps("copy_in_nt", "numpy_copyto_in_writeback"),
        gbps("copy_out", "numpy_copyto_out"),
    ]


def _time_copies(region, offset: int, size: int, repeats: int) -> dict[str, float]:
    """Seconds per copy of each candidate; the view dies on return, so the
    region can be closed."""
    view = region.view(offset, size)
    source = numpy.random.default_rng(size).integers(0, 256, size, dtype=numpy.uint8)
    target = numpy.empty_like(source)
    return median_time({
        "numpy_copyto_in": lambda: numpy.copyto(view, source),
        "copy_in": lambda: region.copy_in(offset, source, nontemporal=False),
        "copy_in_nt": lambda: region.copy_in(offset, source, nontemporal=True),
        "numpy_copyto_in_writeback": lambda: (numpy.copyto(view, source),
                                              region.writeback(offset, size),
                                              region.fence()),
        "numpy_copyto_out": lambda: numpy.copyto(target, view),
        "copy_out": lambda: region.copy_out(offset, target),
    }, repeats, prepare=lambda: (region.invalidate(offset, size), region.fence()))


def _flushes(instruction: str, quick: bool) -> list[Result]:
    lines = 32768  # 2 MiB
    region = scratch_region(lines * 64, name="bench-region", flush=instruction, populate=True)
    try:
        repeats = 3 if quick else 9
        dirty = region.time_flush_lines(0, lines, True, repeats)
        clean = region.time_flush_lines(0, lines, False, repeats)
        round_trip = min(region.time_round_trip(0, 2000 if quick else 20000)
                         for _ in range(repeats))
    finally:
        region.close()
    return [
        Result(f"flush_dirty_line[{instruction}]", dirty, "ns per line", False),
        Result(f"flush_clean_line[{instruction}]", clean, "ns per line", False),
        Result(f"store_flush_fence[{instruction}]", round_trip, "ns per round trip", False),
    ]
