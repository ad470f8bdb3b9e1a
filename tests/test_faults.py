"""Kill points and the kill -9 campaign (`tract.testing.faults`): real
worker processes on several node ids, killed by SIGKILL at named points of
every protocol; no violation may survive."""

import json
import os
import subprocess
import sys

import pytest

from tract.testing import faults


def _die_at(point, after, env=None):
    code = ("from tract.testing import faults\n"
            f"faults.arm({point!r}, {after})\n"
            f"for i in range(5):\n    print(i, flush=True)\n    faults.point({point!r})\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=60)


def test_an_armed_point_kills_its_process_at_the_chosen_time():
    done = _die_at("evict.marked", 3)
    assert done.returncode == -9 and done.stdout.split() == ["0", "1", "2"]
    other = subprocess.run([sys.executable, "-c", "from tract.testing import faults\n"
                            "faults.arm('evict.marked'); faults.point('alloc.locked')"],
                           timeout=60)
    assert other.returncode == 0  # another point: nothing happens


def test_bad_arming_is_refused_by_name():
    with pytest.raises(ValueError, match="is not a kill point"):
        faults.arm("store.somewhere")
    with pytest.raises(ValueError, match="at least 1"):
        faults.arm("store.copied", 0)
    done = subprocess.run([sys.executable, "-c", "import tract.testing.faults"],
                          env=dict(os.environ, TRACT_KILL_POINT="nowhere"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "'nowhere' is not a kill point" in done.stderr


def _campaigns(points, seeds):
    """Campaigns of ``points`` kill points, one per seed, run at once (each
    on its own pool); their reports."""
    running = [subprocess.Popen([sys.executable, "-m", "tract.testing.faults", "--points",
                                 str(points), "--seed", str(seed), "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for seed in seeds]
    reports = []
    for process in running:
        stdout, _ = process.communicate(timeout=1800)
        report = json.loads(stdout)
        assert process.returncode == (1 if report["violations"] else 0)
        reports.append(report)
    return reports


def _campaign(points, seed):
    return _campaigns(points, [seed])[0]


@pytest.mark.multiprocess
def test_a_short_campaign_survives_every_kill():
    report = _campaign(60, seed=0)
    assert report["violations"] == [] and report["points"] == 60
    assert report["recovered_s_max"] <= report["recovery_bound_s"]
    assert sum(report["kills_by_point"].values()) == 60
    assert sum(1 for count in report["kills_by_point"].values() if count) >= 6


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_thousand_kill_points_leave_no_violation():
    # two seeded campaigns of 500 at once, on their own pools: 1000 kills in all
    reports = _campaigns(500, seeds=[1, 2])
    for report in reports:
        print(f"\nkill -9 campaign: {json.dumps(report)}")
        assert report["violations"] == [] and report["points"] == 500
        assert all(report["kills_by_point"].values())  # every point reached and killed at


@pytest.mark.multiprocess
def test_a_short_soak_keeps_every_invariant():
    done = subprocess.run([sys.executable, "-m", "tract.testing.faults", "--minutes", "0.25",
                           "--seed", "3", "--json"], capture_output=True, text=True,
                          timeout=600)
    report = json.loads(done.stdout)
    print(f"\nsoak: {json.dumps(report)}")
    assert report["violations"] == [] and done.returncode == 0
    assert report["operations"] > 1000

