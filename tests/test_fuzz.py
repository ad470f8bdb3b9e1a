"""Metadata fuzzing (`tract.testing.fuzz`): every metadata area corrupted
by hypothesis-drawn cases, each opened, used and fscked in a child process;
only clear errors or repairs may come out (R5)."""

import json
import subprocess
import sys

import pytest

from tract.testing import fuzz


def test_a_case_changes_only_its_area(tmp_path):
    path = str(tmp_path / "pool")
    fuzz.template(path)
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


def test_an_unclear_error_is_a_finding(tmp_path, monkeypatch):
    from tract.pool import Pool

    path = str(tmp_path / "pool")
    fuzz.template(path)

    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(Pool, "open", broken)
    findings = fuzz._exercise(path)
    assert any("IndexError" in finding for finding in findings)


def test_cases_are_drawn_by_hypothesis_reproducibly():
    assert fuzz.draw_cases(30, seed=5) == fuzz.draw_cases(30, seed=5)
    assert {case["area"] for case in fuzz.draw_cases(200, seed=0)} == set(fuzz.AREAS)


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
