"""Fail points and the kill -9 and stall campaigns (`tract.testing.faults`):
real worker processes on several node ids, killed by SIGKILL, or stopped
by SIGSTOP past their lease and resumed, at named points of every
protocol; no violation may survive."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

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
    with pytest.raises(ValueError, match="is not a fail point"):
        faults.arm("store.somewhere")
    with pytest.raises(ValueError, match="action must be one of"):
        faults.arm("store.copied", 1, "pause")
    with pytest.raises(ValueError, match="at least 1"):
        faults.arm("store.copied", 0)
    done = subprocess.run([sys.executable, "-c", "import tract.testing.faults"],
                          env=dict(os.environ, TRACT_KILL_POINT="nowhere"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "'nowhere' is not a kill point" in done.stderr


def test_an_armed_stop_point_stops_its_process_until_resumed():
    """``action="stop"``: SIGSTOP at the armed time, `on_stop` before and
    `on_resume` after; the point is disarmed first."""
    code = ("from tract import _failpoints as points\n"
            "points.on_stop = lambda name: print('stopping at', name, flush=True)\n"
            "points.on_resume = lambda name: print('resumed', flush=True)\n"
            "points.arm('evict.marked', 2, 'stop')\n"
            "for i in range(4):\n    print(i, flush=True)\n    points.point('evict.marked')\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    lines = [process.stdout.readline().strip() for _ in range(3)]
    assert lines == ["0", "1", "stopping at evict.marked"]
    deadline = time.monotonic() + 60
    while not faults._stopped(process.pid):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGCONT)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and rest.split() == ["resumed", "2", "3"]


def _campaigns(points, seeds, *options):
    """Campaigns of ``points`` kill (or stall) points, one per seed, run at
    once (each on its own pool); their reports."""
    running = [subprocess.Popen([sys.executable, "-m", "tract.testing.faults", "--points",
                                 str(points), "--seed", str(seed), "--json", *options],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for seed in seeds]
    reports = []
    for process in running:
        stdout, _ = process.communicate(timeout=1800)
        report = json.loads(stdout)
        assert process.returncode == (1 if report["violations"] else 0)
        reports.append(report)
    return reports


def _campaign(points, seed, *options):
    return _campaigns(points, [seed], *options)[0]


@pytest.mark.multiprocess
def test_a_short_campaign_survives_every_kill():
    report = _campaign(60, seed=0)
    assert report["violations"] == [] and report["points"] == 60
    assert report["history_events"] > 1000  # and its history checked (tract.testing.history)
    assert report["recovered_s_max"] <= report["recovery_bound_s"]
    assert sum(report["kills_by_point"].values()) == 60
    assert sum(1 for count in report["kills_by_point"].values() if count) >= 6


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_thousand_kill_points_leave_no_violation():
    # two seeded campaigns of 500 at once, on their own pools: 1000 kills in all
    reports = _campaigns(500, [1, 2], "--lease", "0.25")
    for report in reports:
        print(f"\nkill -9 campaign: {json.dumps(report)}")
        assert report["violations"] == [] and report["points"] == 500
        assert all(report["kills_by_point"].values())  # every point reached and killed at


@pytest.mark.multiprocess
def test_the_history_check_catches_stores_acknowledged_before_their_publish():
    """The seeded broken variant: workers acknowledge each store before it
    runs, so a store killed before its publish, or one the pool had no
    room for, is acknowledged and never loadable (no silent loss); and a
    version published after an eviction that began once it was
    "acknowledged" reads as stale (no stale get).  Nothing else is found."""
    report = _campaign(30, 0, "--ack-before-publish")
    rules = [v.split(":")[0] for v in report["violations"]]
    assert "no silent loss" in rules and set(rules) <= {"no silent loss", "no stale get"}, \
        report["violations"][:2]
    lost = report["violations"][rules.index("no silent loss")]
    assert "store end" in lost and "(the whole history: " in report["violations"][0]
    shutil.rmtree(report["violations"][0].rpartition("(the whole history: ")[2].rstrip(")"))


@pytest.mark.multiprocess
def test_a_short_stall_campaign_survives_every_stall():
    """Workers stopped at named points for up to 4 leases (0.4 s), then
    resumed: those that lapsed fence themselves and rejoin."""
    report = _campaign(40, 0, "--stall")
    assert report["violations"] == [] and report["points"] >= 40
    assert report["history_events"] > 1000
    assert report["recovered_s_max"] <= report["recovery_bound_s"]
    assert report["stalled_s_max"] > report["lease_timeout_s"]  # some stalls outlived the lease
    assert sum(1 for count in report["stalls_by_point"].values() if count) >= 5


@pytest.mark.multiprocess
@pytest.mark.slow
def test_five_hundred_stall_points_leave_no_violation():
    # two seeded campaigns of 250 at once, at a lease of 0.25 s: 500 stalls in all
    reports = _campaigns(250, [1, 2], "--stall", "--lease", "0.25")
    for report in reports:
        print(f"\nstall campaign: {json.dumps(report)}")
        assert report["violations"] == [] and report["points"] >= 250
        assert all(report["stalls_by_point"].values())  # every point reached and stopped at


@pytest.mark.multiprocess
def test_a_short_soak_keeps_every_invariant():
    done = subprocess.run([sys.executable, "-m", "tract.testing.faults", "--minutes", "0.25",
                           "--seed", "3", "--json"], capture_output=True, text=True,
                          timeout=600)
    report = json.loads(done.stdout)
    print(f"\nsoak: {json.dumps(report)}")
    assert report["violations"] == [] and done.returncode == 0
    assert report["operations"] > 1000 and report["history_events"] > report["operations"]

