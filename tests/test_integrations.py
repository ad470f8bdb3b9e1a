"""What the engine adapters share (`tract.integrations.common`): options
read from an engine's config, and one pool handle per (pool, node)."""

from __future__ import annotations

import pytest

from tract.errors import ConfigError
from tract.integrations import common
from tract.pool import Pool
from tract.transfer import KVLayout


def test_options_read_prefixed_keys_and_refuse_bad_ones():
    opts = common.options({"tract.pool": "/dev/dax0.0", "tract.node": "3", "tract.salt": 7,
                           "tract.checksum": "false", "tract.timeout": "2.5",
                           "tract.load_threads": "3", "other": 1},
                          "LMCache extra_config", "tract.")
    assert opts == common.Options(pool="/dev/dax0.0", node=3, manager=False, checksum=False,
                                  salt="7", timeout=2.5, load_threads=3)
    assert common.options({"pool": "p", "node": 0, "model_id": "m"}, "vLLM").node == 0
    for config, match in [({"tract.node": 1}, "needs 'tract.pool'"),
                          ({"tract.pool": "p"}, "needs 'tract.node'"),
                          ({"tract.pool": "p", "tract.node": -1}, "non-negative int"),
                          ({"tract.pool": "p", "tract.node": True}, "non-negative int"),
                          ({"tract.pool": "p", "tract.node": 1, "tract.nod": 2},
                           r"unknown tract option\(s\) \['tract.nod'\]"),
                          ({"tract.pool": "p", "tract.node": 1, "tract.timeout": "soon"},
                           "timeout must be a number"),
                          ({"tract.pool": "p", "tract.node": 1, "tract.timeout": 0},
                           "timeout must be positive"),
                          ({"tract.pool": "p", "tract.node": 1, "tract.manager": "yes"},
                           "manager must be true or false"),
                          ({"tract.pool": "p", "tract.node": 1, "tract.load_threads": 0},
                           "load_threads must be a positive int"),
                          ({"tract.pool": "p", "tract.node": 1, "tract.load_threads": "two"},
                           "load_threads must be a positive int")]:
        with pytest.raises(ConfigError, match=match):
            common.options(config, "LMCache extra_config", "tract.")


def test_adapters_of_one_process_share_one_pool_handle(pool_path):
    Pool.create(pool_path, 16 << 20, max_nodes=2)
    first = common.open_pool(pool_path, 1, manager=True)
    second = common.open_pool(pool_path, 1, manager=False)
    assert first is second
    common.close_pool(pool_path, 1)
    assert (pool_path, 1) in common._pools  # the second user still holds it
    common.close_pool(pool_path, 1)
    assert (pool_path, 1) not in common._pools
    common.close_pool(pool_path, 1)  # once too often: nothing to do


def test_a_connector_that_cannot_be_made_closes_its_pool_handle(pool_path, monkeypatch):
    Pool.create(pool_path, 16 << 20, max_nodes=2)
    opts = common.Options(pool=pool_path, node=1)
    layout = KVLayout(model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=8,
                      block_size=16)
    connector = common.open_connector(opts, layout)
    assert connector.layout == layout
    connector.close()
    common.close_pool(pool_path, 1)

    def broken(*args, **kwargs):
        raise RuntimeError("no connector")
    monkeypatch.setattr("tract.connector.Connector", broken)
    with pytest.raises(RuntimeError, match="no connector"):
        common.open_connector(opts, layout)
    assert (pool_path, 1) not in common._pools


# ------------------------------------------------- the transfer thread

def _ended(thread, count, timeout=30.0):
    """The next ``count`` jobs to end (waits on the thread; no sleep-polling
    of timing: each job ends when its gate opens)."""
    import time

    ended, deadline = [], time.monotonic() + timeout
    while len(ended) < count:
        ended += thread.finished()
        assert time.monotonic() < deadline, f"only {len(ended)} of {count} jobs ended"
        time.sleep(0.001)
    return ended


def test_the_transfer_thread_runs_jobs_in_order_and_reports_each_once():
    import threading

    from tract.integrations.transfers import DONE, FAILED, TransferThread

    thread, order = TransferThread(), []
    gate = threading.Event()

    def job(name, fail=False):
        def run():
            gate.wait(30)
            order.append(name)
            if fail:
                raise RuntimeError(f"{name} broke")
            return name
        return run

    jobs = [thread.submit("save", f"r{i}", job(f"j{i}", fail=i == 1), timeout=30) for i in range(3)]
    assert thread.busy()
    gate.set()
    ended = _ended(thread, 3)
    assert order == ["j0", "j1", "j2"] and ended == jobs
    assert [(j.state, j.result) for j in ended] == [(DONE, "j0"), (FAILED, None), (DONE, "j2")]
    assert "j1 broke" in str(ended[1].error)
    assert thread.finished() == [] and not thread.busy()
    assert thread.close(5)
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit("load", "r9", lambda: None, timeout=1)
    with pytest.raises(ValueError, match="timeout must be positive"):
        TransferThread().submit("load", "r", lambda: None, timeout=0)


def test_a_job_past_its_deadline_is_failed_unrun_and_a_cancelled_one_never_runs():
    import threading

    from tract.integrations.transfers import CANCELLED, DONE, FAILED, TransferThread

    now = [0.0]
    thread = TransferThread(clock=lambda: now[0])
    gate, running, ran = threading.Event(), threading.Event(), []

    def blocker():
        running.set()
        gate.wait(30)
        ran.append("blocker")

    first = thread.submit("save", "a", blocker, timeout=10)
    assert running.wait(30)
    late = thread.submit("load", "b", lambda: ran.append("late"), timeout=5)
    kept = thread.submit("load", "c", lambda: ran.append("kept"), timeout=50)
    dropped = thread.submit("save", "c", lambda: ran.append("dropped"), timeout=50)
    assert thread.cancel(["c"], kinds=("save",), wait=False) == 1
    now[0] = 20.0  # b's deadline passes while the blocker runs
    gate.set()
    ended = _ended(thread, 4)
    assert ran == ["blocker", "kept"]
    states = {id(job): job.state for job in ended}
    assert states == {id(first): DONE, id(late): FAILED, id(kept): DONE, id(dropped): CANCELLED}
    assert isinstance(late.error, TimeoutError) and "deadline" in str(late.error)
    assert thread.close(5)


def test_cancel_waits_for_a_running_job_of_the_request_and_close_cancels_what_is_left():
    import threading

    from tract.integrations.transfers import CANCELLED, TransferThread

    thread = TransferThread()
    gate, running = threading.Event(), threading.Event()

    def blocker():
        running.set()
        return gate.wait(30)

    thread.submit("save", "p", blocker, timeout=30)
    queued = thread.submit("save", "p", lambda: None, timeout=30)
    assert running.wait(30)
    waiter = threading.Thread(target=lambda: thread.cancel(["p"]))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "cancel returned while the request's job still ran"
    gate.set()
    waiter.join(30)
    assert not waiter.is_alive() and queued.state == CANCELLED
    stuck = threading.Event()
    thread.submit("save", "q", lambda: stuck.wait(30), timeout=30)
    left = thread.submit("load", "r", lambda: None, timeout=30)
    assert not thread.close(0.2)  # q still runs: r is cancelled, not run
    assert left.state == CANCELLED
    assert thread.busy(), "a job still running is reported (its pool must stay mapped)"
    stuck.set()
