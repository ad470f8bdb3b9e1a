"""`tract bench lock`: the two-tier lock (`tract.lock`), in every mode.

Measured, each against baselines from the same run:

- uncontended acquire + release, against the store + flush + fence round
  trip (the unit the issue's target is in: ratio = round trip / value, so a
  ratio of 1/8 means 8 round trips), a process-shared pthread mutex and an
  fcntl lock;
- contended throughput (acquire, bump a counter, release) with 2 and 4
  processes spread over 1, 2 and 4 node ids, against the same number of
  processes on one pthread mutex; and the handoff latency that implies.

Manager mode runs its lock manager in a separate process, as
`tract manager` would.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import tempfile
import time
import uuid

from tract._native._localmutex import LocalMutex
from tract.bench import Result
from tract.pool import Pool
from tract.region import create_region, open_region, scratch_region

MODES = ("manager", "bakery", "atomic")
MAX_NODES = 6
MANAGER_NODE = MAX_NODES - 1


def bench_pool() -> str:
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(directory, f"tract-bench-lock-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _create(mode: str) -> str:
    path = bench_pool()
    Pool.create(path, 1 << 20, lock_mode=mode, max_nodes=MAX_NODES, lease_timeout=2.0,
                chunk_size=1 << 16,
                coherence="hardware" if mode == "atomic" else "none")
    return path


def manage_locks(path: str, stop) -> None:
    with Pool.open(path, MANAGER_NODE) as pool:
        pool.manager().run(stop)


def _tract_worker(path: str, node: int, start, seconds: float, results) -> None:
    with Pool.open(path, node) as pool:
        lock, region, counter = pool.lock("alloc"), pool.region, pool.header.heap
        with lock(timeout=30):  # warm: the first grant
            pass
        start.wait()
        done, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            lock.acquire()
            region.store_u64(counter, region.load_u64(counter) + 1)
            lock.release()
            done += 1
        results.put(done)


def _pthread_worker(path: str, node: int, start, seconds: float, results) -> None:
    region = open_region(path, coherence="hardware")
    mutex = LocalMutex(region, 0)
    start.wait()
    done, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        mutex.acquire()
        region.store_u64(64, region.load_u64(64) + 1)
        mutex.release()
        done += 1
    results.put(done)
    region.close()


def _contended(worker, path: str, nodes: list[int], seconds: float) -> float:
    """Operations per second of ``len(nodes)`` processes on one lock."""
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    processes = [context.Process(target=worker, args=(path, node, start, seconds, results))
                 for node in nodes]
    for process in processes:
        process.start()
    time.sleep(0.5)  # every worker mapped the pool and took its first grant
    start.set()
    total = sum(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(60)
    return total / seconds


def _with_manager(mode: str, path: str, body):
    if mode != "manager":
        return body()
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    manager = context.Process(target=manage_locks, args=(path, stop))
    manager.start()
    try:
        return body()
    finally:
        stop.set()
        manager.join(30)


def _uncontended(mode: str, path: str, rounds: int) -> float:
    def body():
        with Pool.open(path, 0) as pool:
            lock = pool.lock("alloc")
            with lock(timeout=30):
                pass
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(rounds):
                    lock.acquire()
                    lock.release()
                best = min(best, (time.perf_counter() - start) / rounds)
            return best * 1e9
    return _with_manager(mode, path, body)


def _baselines(rounds: int) -> dict[str, float]:
    region = scratch_region(4096, name="bench-lock", coherence="hardware")
    mutex = LocalMutex(region, 0)
    mutex.initialize()
    round_trip = min(scratch_region(4096, name="bench-lock").time_round_trip(0, 20000)
                     for _ in range(3))
    timings = {}
    start = time.perf_counter()
    for _ in range(rounds):
        mutex.acquire()
        mutex.release()
    timings["pthread_mutex"] = (time.perf_counter() - start) / rounds * 1e9
    with tempfile.TemporaryFile() as handle:
        start = time.perf_counter()
        for _ in range(rounds):
            fcntl.lockf(handle, fcntl.LOCK_EX)
            fcntl.lockf(handle, fcntl.LOCK_UN)
        timings["fcntl_lock"] = (time.perf_counter() - start) / rounds * 1e9
    timings["store_flush_fence"] = round_trip
    region.close()
    return timings


def run(quick: bool = False) -> list[Result]:
    rounds = 2000 if quick else 20000
    seconds = 0.3 if quick else 1.5
    layouts = [(2, 1), (2, 2), (4, 2)] if quick else [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]
    baselines = _baselines(rounds)
    results: list[Result] = []
    pthread_path = bench_pool()
    shared = create_region(pthread_path, 4096, coherence="hardware")
    LocalMutex(shared, 0).initialize()
    shared.close()
    pthread_rate = {procs: _contended(_pthread_worker, pthread_path, [0] * procs, seconds)
                    for procs in sorted({procs for procs, _ in layouts})}
    os.unlink(pthread_path)
    for mode in MODES:
        path = _create(mode)
        try:
            value = _uncontended(mode, path, rounds)
            for baseline in ("store_flush_fence", "pthread_mutex", "fcntl_lock"):
                results.append(Result(f"uncontended_acquire_release[{mode}]", value, "ns", False,
                                      baseline, baselines[baseline]))
            for procs, nodes in layouts:
                placement = [index % nodes for index in range(procs)]
                rate = _with_manager(mode, path, lambda: _contended(
                    _tract_worker, path, placement, seconds))
                label = f"{mode},{procs}procs,{nodes}nodes"
                results.append(Result(f"contended_throughput[{label}]", rate, "acquisitions/s",
                                      True, f"pthread_mutex[{procs}procs]",
                                      pthread_rate[procs]))
                results.append(Result(f"handoff_latency[{label}]", 1e9 / rate, "ns", False,
                                      f"pthread_mutex[{procs}procs]", 1e9 / pthread_rate[procs]))
        finally:
            Pool.destroy(path)
    return results
