"""`tract bench trace`: what the cache-control trace hook costs while it is
off (DESIGN.md §5; issue "fast twins, checked").

The mapping's extension is built twice from this checkout's sources into a
scratch directory: as shipped, and with ``TRACT_CACHECTL_NO_TRACE`` (the
hook compiled out).  One process loads both, maps one file through each,
and measures them in pairs, alternating which goes first (A B, B A, ...):

- the store + flush + fence round trip on one line, natively (the
  primitive every metadata step is made of);
- `Region.copy_in_blocks` of 64 blocks of 4 KiB at unaligned offsets (a
  streaming copy with partial-line write-backs per block, one store fence;
  the hook looks once per streamed group of lines, for the shadow memory);
- a 256 KiB block's 4096 lines dropped with the payload instruction and
  fenced, as a load does before it reads (the hook looks once per line, in
  the loop that issues the instruction).

The figure is the median of the paired ratios (the build without the
hook's time / the shipped build's: 1.0 is no cost, higher is better), with
the lowest and highest pair.  Needs Cython and a C compiler (a development checkout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tract.bench import Result

SOURCES = Path(__file__).resolve().parent.parent / "_native"

#: one extension built in place, as setuptools would build it (the
#: interpreter's compiler, flags and shared-object options, then
#: ``optimize``), without setuptools' start-up: Cython, then one compiler run
BUILD_SCRIPT = """
import shlex, subprocess, sys, sysconfig
import numpy
name, macros, optimize, cythonize = {extension!r}, {macros!r}, {optimize!r}, {cythonize!r}
stem = "tract/_native/" + name.rpartition(".")[2]
if cythonize:
    cython = subprocess.run([sys.executable, "-m", "cython", "-3", "--module-name", name,
                             "-I", ".", "-I", "tract/_native", stem + ".pyx", "-o", stem + ".c"])
    if cython.returncode:
        sys.exit(cython.returncode)
config = sysconfig.get_config_var
command = [*shlex.split(config("CC")), *shlex.split(config("CFLAGS")),
           *shlex.split(config("CCSHARED")), optimize,
           "-I", "tract/_native", "-I", numpy.get_include(),
           "-I", sysconfig.get_paths()["include"],
           "-DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION",
           *("-D%s=%s" % macro for macro in macros),
           stem + ".c", *shlex.split(config("LDSHARED"))[1:], *shlex.split(config("LDFLAGS")),
           "-o", stem + config("EXT_SUFFIX")]
sys.exit(subprocess.run(command).returncode)
"""


def build_extension(root: Path, extension: str, macros: tuple[tuple[str, str], ...] = (),
                    optimize: str = "-O2", cythonize: bool = True) -> str | None:
    """Build one extension of ``tract._native`` in place under ``root`` (a
    copy of the package's sources at ``root/tract``), with the compiler's
    ``optimize`` flag (the shipped build's by default); with ``cythonize``
    False, from the C file already beside its ``.pyx``.  Returns None, or
    the build's error output."""
    script = BUILD_SCRIPT.format(extension=extension, macros=list(macros), optimize=optimize,
                                 cythonize=cythonize)
    done = subprocess.run([sys.executable, "-c", script],
                          cwd=root, capture_output=True, text=True, timeout=600)
    return None if done.returncode == 0 else (done.stdout + done.stderr)[-2000:]


_WORKER = """
import importlib.machinery, importlib.util, os, statistics, sys, time
import numpy
from tract import platform

def load(path):
    loader = importlib.machinery.ExtensionFileLoader("tract._native._region", path)
    spec = importlib.util.spec_from_file_location("tract._native._region", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module

builds = {{name: load(path) for name, path in {libraries!r}.items()}}
control = platform.cache_control(None, "none")
path = "/dev/shm/tract-bench-trace-%d" % os.getpid()
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 8 << 20)
regions = {{name: module.map_fd(fd, 8 << 20, 0, path, "file", control, True)
           for name, module in builds.items()}}
os.close(fd)
os.unlink(path)
offsets = numpy.arange(64, dtype=numpy.int64) * 8192 + 4096 + 24
sources = [numpy.full(4096, i, dtype=numpy.uint8) for i in range(64)]

def copies(region):
    start = time.perf_counter()
    for _ in range(20):
        region.copy_in_blocks(offsets, sources)
    return time.perf_counter() - start

def drops(region):
    start = time.perf_counter()
    for _ in range(20):
        region.invalidate(1 << 20, 256 << 10, payload=True)
        region.fence()
    return time.perf_counter() - start

figures = {{"round_trip": lambda region: region.time_round_trip(0, {iterations}),
           "copy_in_blocks": copies, "invalidate_block": drops}}
ratios = {{figure: [] for figure in figures}}
for figure, measure in figures.items():
    for region in regions.values():
        measure(region)  # warm up
    for pair in range({pairs}):
        order = ["traced", "untraced"] if pair % 2 == 0 else ["untraced", "traced"]
        times = {{name: measure(regions[name]) for name in order}}
        ratios[figure].append(times["untraced"] / times["traced"])
for figure, values in ratios.items():
    print(figure, statistics.median(values), min(values), max(values))
"""


def _measure(libraries: dict[str, Path], quick: bool) -> dict[str, tuple[float, float, float]]:
    done = subprocess.run(
        [sys.executable, "-c", _WORKER.format(
            libraries={name: str(path) for name, path in libraries.items()},
            iterations=2000 if quick else 5000, pairs=40 if quick else 400)],
        capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"trace bench worker failed: {done.stderr[-800:]}")
    out = {}
    for line in done.stdout.splitlines():
        figure, *values = line.split()
        out[figure] = tuple(float(value) for value in values)
    return out


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
        paired = _measure(libraries, quick)
    results = []
    for figure, (median, low, high) in paired.items():
        results.append(Result(f"{figure}[no hook / hook off, median of pairs]", median,
                              "paired time ratio (1.0: no cost)", True))
        results.append(Result(f"{figure}[lowest pair]", low, "paired time ratio", True))
        results.append(Result(f"{figure}[highest pair]", high, "paired time ratio", True))
    return results


if __name__ == "__main__":  # pragma: no cover - a manual entry
    for result in run(quick="--quick" in sys.argv):
        print(result.as_dict())
    os._exit(0)
