"""Metadata fuzzing (`tract.testing.fuzz`): every metadata area corrupted
by hypothesis-drawn cases, each opened, used and fscked in a child process;
only clear errors or repairs may come out (R5)."""

import json
import subprocess
import sys

import pytest

from tract.testing import fuzz


@pytest.fixture
def template(tmp_path):
    """A template pool, destroyed with its node-local files after the test."""
    from tract.pool import Pool

    path = str(tmp_path / "pool")
    fuzz.template(path)
    yield path
    Pool.destroy(path)


def test_a_case_changes_only_its_area(template):
    path = template
    where = fuzz.areas(path)
    before = open(path, "rb").read()
    for area in fuzz.AREAS:
        with open(path, "wb") as reset:
            reset.write(before)
        fuzz.corrupt(path, where, {"area": area, "at": 0.5, "kind": "huge word", "value": 3})
        after = open(path, "rb").read()
        changed = [i for i in range(len(before)) if before[i] != after[i]]
        start, end = where[area]
        assert changed and start <= changed[0] and changed[-1] < end, area


def test_an_unclear_error_is_a_finding(template, monkeypatch):
    from tract.pool import Pool

    path = template

    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(Pool, "open", broken)
    findings = fuzz._exercise(path)
    assert any("IndexError" in finding for finding in findings)


def test_cases_are_drawn_by_hypothesis_reproducibly():
    assert fuzz.draw_cases(30, seed=5) == fuzz.draw_cases(30, seed=5)
    drawn = fuzz.draw_cases(200, seed=0)
    assert {case["area"] for case in drawn} == set(fuzz.AREAS)
    assert {case["lock mode"] for case in drawn} == set(fuzz.LOCK_MODES)


#: (area, word, values): the words the native fast paths take a count, a
#: node or a chunk from, set one past their range and far past it
_NATIVE_BOUNDS = [
    ("handoff record", 5, [5, 1 << 60, 2**64 - 1]),  # the key count (4 keys written)
    ("handoff record", 2, [4, 2**64 - 1]),  # the producer node (4 nodes)
    ("allocator owners", 2, [0, 1 << 20, 2**64 - 1]),  # the first chunk's run
    ("allocator cursor", 0, [1 << 12, 2**64 - 1]),
    ("lock area", 0, [5, 2**64 - 1]),  # the manager line's node field (node + 1)
]


def test_corrupt_counts_and_nodes_reach_the_native_paths_with_clear_outcomes():
    """In a manager-mode pool, where the lock's, the allocator's and the
    handoff record's native steps run, each value they bound a loop or an
    offset by, corrupted: the take misses, and every other step succeeds
    or raises a clear error (R5) — no crash, hang or unchecked offset."""
    cases = [{"lock mode": "manager", "area": area, "word": word, "kind": "set word",
              "value": value} for area, word, values in _NATIVE_BOUNDS for value in values]
    report = fuzz.run_cases(cases)
    assert report["findings"] == [] and report["cases"] == len(cases)


@pytest.mark.multiprocess
def test_corrupted_metadata_gives_clear_errors_or_repairs():
    done = subprocess.run([sys.executable, "-m", "tract.testing.fuzz", "--cases", "400",
                           "--seed", "0", "--json"], capture_output=True, text=True,
                          timeout=1200)
    assert done.stdout, f"the campaign printed no report (exit {done.returncode}):\n" \
                        f"{done.stderr[-4000:]}"
    report = json.loads(done.stdout)
    print(f"\nmetadata fuzzing: {report['cases']} corruptions, {report['clear_errors']} "
          f"clear errors, by area {report['by_area']}")
    assert report["findings"] == [] and done.returncode == 0
    assert report["cases"] == 400 and all(report["by_area"].values())
    assert report["clear_errors"] > report["cases"] // 4  # the corruptions bite
