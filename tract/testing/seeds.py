"""The simulated tests' seeds: how many each test runs, and which runs first.

``TRACT_SIM_SEEDS`` sets the count (`count`).  A test walks its seeds with
`seeds`, which puts ``TRACT_SIM_FIRST_SEED`` first when it is one of them and
keeps the seed being run in `current`; when a test fails, this module, as a
pytest plugin (``-p tract.testing.seeds``, which the harness passes), appends
that test's id and seed to the file ``TRACT_SIM_SEED_REPORT`` names.  The
mutation harness records both for each mutant it kills and runs them first
next time, so a mutant still killed costs one seed, not the seeds before it.
Every seed still runs when the first passes: the order saves time and
changes no verdict.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

__all__ = ["COUNT_ENV", "FIRST_ENV", "REPORT_ENV", "count", "current", "report", "seeds"]

COUNT_ENV = "TRACT_SIM_SEEDS"
FIRST_ENV = "TRACT_SIM_FIRST_SEED"
REPORT_ENV = "TRACT_SIM_SEED_REPORT"

#: the seed the running test is at (None outside a walk, or after one ends)
current: int | None = None


def count(default: int = 200) -> int:
    """Seeds per simulated test: ``TRACT_SIM_SEEDS``, else ``default``."""
    return int(os.environ.get(COUNT_ENV, default))


def seeds(n: int) -> Iterator[int]:
    """Seeds 0 … n-1, ``TRACT_SIM_FIRST_SEED`` first when it is among them.
    A walk that a failure ends leaves `current` at the failing seed."""
    global current
    first = os.environ.get(FIRST_ENV, "")
    order: list[int] | range = range(n)
    if first.isdigit() and int(first) < n:
        order = [int(first), *(seed for seed in range(n) if seed != int(first))]
    for seed in order:
        current = seed
        yield seed
    current = None


def report(test: str) -> None:
    """Append ``test`` (its whole pytest id) and the seed it failed at (None
    when it walks no seeds) to ``TRACT_SIM_SEED_REPORT``, when that is set."""
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"test": test, "seed": current}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """The plugin's hook: a failing test's seed goes to the report."""
    global current
    current = None
    outcome = yield
    if outcome.excinfo is not None:
        report(item.nodeid)
