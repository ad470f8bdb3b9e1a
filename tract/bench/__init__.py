"""`tract bench NAME`: the one entry point for every benchmark of the project.

Each benchmark is a function ``run(quick: bool) -> list[Result]`` registered
under a name.  Every figure that claims speed carries a baseline measured in
the same run, and its ``ratio`` is oriented so that higher is better for
tract: ``value / baseline_value`` for rates, ``baseline_value / value`` for
costs.  The unit says which.  Where tract and its baseline were measured in
turn, round by round (`paired`), the ratio is the median of the rounds'
ratios, with their lowest and highest (``ratio_min``, ``ratio_max``): on a
noisy machine a round's neighbour hurts both sides of its pair alike.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import platform as _platform
import statistics
import time
from typing import Callable

__all__ = ["BENCHMARKS", "Result", "machine", "median_time", "paired", "run"]

# name -> module that defines run(quick) (under tract.bench; the simulator's, under tract.testing)
BENCHMARKS = {
    "alloc": "tract.bench.alloc",
    "churn": "tract.bench.churn",
    "hash": "tract.bench.hash",
    "index": "tract.bench.index",
    "incoherent": "tract.testing.bench_incoherent",  # the simulator's own
    "lock": "tract.bench.lock",
    "region": "tract.bench.region",
    "scale": "tract.testing.bench_scale",  # counts on the simulator
    "tier": "tract.bench.tier",
    "trace": "tract.bench.trace",
    "transfer": "tract.bench.transfer",
}


@dataclasses.dataclass
class Result:
    """One measured figure, with its same-run baseline when it claims speed."""

    name: str
    value: float
    unit: str
    higher_is_better: bool
    baseline: str | None = None
    baseline_value: float | None = None
    #: (median, lowest, highest) of the paired rounds' ratios, when paired
    ratios: tuple[float, float, float] | None = None

    @property
    def ratio(self) -> float | None:
        if self.ratios is not None:
            return self.ratios[0]
        if self.baseline_value is None or not self.value or not self.baseline_value:
            return None
        if self.higher_is_better:
            return self.value / self.baseline_value
        return self.baseline_value / self.value

    def as_dict(self) -> dict:
        direction = "higher is better" if self.higher_is_better else "lower is better"
        unit = f"{self.unit}, {direction}"
        if self.baseline_value is not None:
            unit += "; ratio = " + ("value/baseline" if self.higher_is_better else "baseline/value")
        return {
            "name": self.name,
            "value": self.value,
            "unit": unit,
            "baseline": self.baseline,
            "baseline_value": self.baseline_value,
            "ratio": self.ratio,
            "ratio_min": self.ratios[1] if self.ratios else None,
            "ratio_max": self.ratios[2] if self.ratios else None,
        }


def median_time(functions: dict[str, Callable[[], object]], repeats: int,
                prepare: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds per call of each function, the calls interleaved so that
    a noisy neighbour hurts every candidate alike.  ``prepare`` runs, untimed,
    before every call, to give each the same starting state."""
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for name, function in functions.items():
        function()  # warm up: page faults, caches, lazy compilation
    for _ in range(repeats):
        for name, function in functions.items():
            if prepare is not None:
                prepare()
            start = time.perf_counter()
            function()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def paired(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """The median, lowest and highest of ``theirs[i] / ours[i]``: seconds
    of the same work measured in turn, round by round, so each ratio says
    how many times faster tract was in that round."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired needs as many rounds on each side, got {len(ours)} and "
                         f"{len(theirs)}")
    ratios = sorted(b / a for a, b in zip(ours, theirs))
    return statistics.median(ratios), ratios[0], ratios[-1]


def machine() -> dict:
    """What the figures were measured on."""
    import numpy
    import psutil

    from tract import __version__, platform

    return {
        "cpu_model": platform.cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "python": _platform.python_version(),
        "numpy": numpy.__version__,
        "tract": __version__,
        "cache_control": platform.default_cache_control().as_dict(),
    }


def run(name: str, quick: bool = False, **options) -> dict:
    """Run one benchmark and return its JSON-ready report (``options``:
    the benchmark's own, e.g. ``device`` for transfer)."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    module = importlib.import_module(BENCHMARKS[name])
    results = module.run(quick=quick, **options)
    return {"bench": name, "machine": machine(), "results": [r.as_dict() for r in results]}
