"""`tract bench trace`: what the cache-control trace hook costs while it is
off (DESIGN.md §5; issue "fast twins, checked").

The mapping's extension is built twice from this checkout's sources into a
scratch directory: as shipped, and with ``TRACT_CACHECTL_NO_TRACE`` (the
hook compiled out).  Each round runs one fresh process per build, in
alternating order (A B, B A, ...), and each measures

- the store + flush + fence round trip on one line, natively (the
  primitive every metadata step is made of);
- `Region.copy_in_blocks` of 64 blocks of 4 KiB at unaligned offsets (a
  streaming copy with partial-line write-backs per block, one store fence).

The figure is the median over rounds of the paired ratio (the build without
the hook's time / the shipped build's: 1.0 is no cost, higher is better),
with the range.  Needs Cython and a C compiler (a development checkout).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tract.bench import Result

SOURCES = Path(__file__).resolve().parent.parent / "_native"

_BUILD = """
import sys
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
sys.argv = ["setup.py", "-q", "build_ext", "--inplace"]
name, macros = {extension!r}, {macros!r}
source = "tract/_native/" + name.rpartition(".")[2] + ".pyx"
setup(ext_modules=cythonize([Extension(
    name, [source], include_dirs=["tract/_native", numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), *macros],
    extra_compile_args=["-O2"])], language_level=3, quiet=True, force=True))
"""


def build_extension(root: Path, extension: str, macros: tuple[tuple[str, str], ...] = ()
                    ) -> str | None:
    """Build one extension of ``tract._native`` in place under ``root`` (a
    copy of the package's sources at ``root/tract``).  Returns None, or the
    build's error output."""
    done = subprocess.run([sys.executable, "-c", _BUILD.format(extension=extension,
                                                               macros=list(macros))],
                          cwd=root, capture_output=True, text=True, timeout=600)
    return None if done.returncode == 0 else (done.stdout + done.stderr)[-2000:]


_WORKER = """
import importlib.machinery, importlib.util, sys, time
spec = importlib.util.spec_from_file_location(
    "tract._native._region", {library!r},
    loader=importlib.machinery.ExtensionFileLoader("tract._native._region", {library!r}))
module = importlib.util.module_from_spec(spec)
sys.modules["tract._native._region"] = module
spec.loader.exec_module(module)
import numpy
from tract.region import scratch_region
region = scratch_region(8 << 20, name="bench-trace", populate=True)
round_trip = min(region.time_round_trip(0, {iterations}) for _ in range(5))
offsets = numpy.arange(64, dtype=numpy.int64) * 8192 + 4096 + 24
sources = [numpy.full(4096, i, dtype=numpy.uint8) for i in range(64)]
region.copy_in_blocks(offsets, sources)
best = float("inf")
for _ in range({copies}):
    start = time.perf_counter()
    for _ in range(20):
        region.copy_in_blocks(offsets, sources)
    best = min(best, (time.perf_counter() - start) / 20)
region.close()
print(round_trip, best * 1e9)
"""


def _measure(library: Path, quick: bool) -> tuple[float, float]:
    done = subprocess.run(
        [sys.executable, "-c", _WORKER.format(library=str(library),
                                              iterations=20000 if quick else 100000,
                                              copies=5 if quick else 20)],
        capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"trace bench worker failed: {done.stderr[-800:]}")
    round_trip, copies = done.stdout.split()
    return float(round_trip), float(copies)


def run(quick: bool = False) -> list[Result]:
    if not (SOURCES / "_region.pyx").exists():
        raise RuntimeError(f"tract bench trace builds the mapping from its sources; "
                           f"{SOURCES / '_region.pyx'} is not there (a development checkout "
                           f"is needed)")
    with tempfile.TemporaryDirectory(prefix="tract-bench-trace-") as scratch:
        libraries = {}
        for name, macros in (("traced", ()), ("untraced", (("TRACT_CACHECTL_NO_TRACE", "1"),))):
            root = Path(scratch, name)
            shutil.copytree(SOURCES, root / "tract" / "_native",
                            ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__"))
            failed = build_extension(root, "tract._native._region", macros)
            if failed:
                raise RuntimeError(f"building the {name} mapping failed:\n{failed}")
            libraries[name] = next((root / "tract" / "_native").glob("_region*.so"))
        ratios: dict[str, list[float]] = {"round_trip": [], "copy_in_blocks": []}
        for round_ in range(5 if quick else 11):
            order = ["traced", "untraced"] if round_ % 2 == 0 else ["untraced", "traced"]
            times = {name: _measure(libraries[name], quick) for name in order}
            for index, figure in enumerate(ratios):
                ratios[figure].append(times["untraced"][index] / times["traced"][index])
    results = []
    for figure, values in ratios.items():
        results.append(Result(f"{figure}[hook off / no hook, median]", statistics.median(values),
                              "ratio (no-hook time / hook-off time)", True))
        results.append(Result(f"{figure}[range]", min(values), "lowest paired ratio", True))
        results.append(Result(f"{figure}[range high]", max(values), "highest paired ratio",
                              True))
    return results


if __name__ == "__main__":  # pragma: no cover - a manual entry
    for result in run(quick="--quick" in sys.argv):
        print(result.as_dict())
    os._exit(0)
