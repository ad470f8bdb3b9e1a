"""Tier 1 of the two-tier lock: the robust process-shared local mutex."""

import multiprocessing
import os
import signal

import pytest

from tract._native._localmutex import SIZE, LocalMutex
from tract.region import create_region, open_region

COUNTER = 256


@pytest.fixture
def local(pool_path):
    region = create_region(pool_path, 4096, coherence="hardware")
    LocalMutex(region, 0).initialize()
    yield pool_path, region
    region.close()


def _count(path, rounds):
    region = open_region(path, coherence="hardware")
    mutex = LocalMutex(region, 0)
    for _ in range(rounds):
        mutex.acquire()
        value = region.load_u64(COUNTER)  # a non-atomic read-modify-write
        os.sched_yield()
        region.store_u64(COUNTER, value + 1)
        mutex.release()


@pytest.mark.multiprocess
def test_processes_take_turns(local):
    path, region = local
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_count, args=(path, 500)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert region.load_u64(COUNTER) == 2000


def _hold_and_die(path, ready):
    region = open_region(path, coherence="hardware")
    LocalMutex(region, 0).acquire()
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.multiprocess
def test_a_dead_holder_is_reported_once_and_the_mutex_recovers(local):
    path, region = local
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    holder = context.Process(target=_hold_and_die, args=(path, ready))
    holder.start()
    assert ready.wait(30)
    holder.join(30)
    assert holder.exitcode == -signal.SIGKILL
    mutex = LocalMutex(region, 0)
    assert mutex.acquire(timeout=5) is True  # EOWNERDEAD: repair, then declare consistent
    mutex.consistent()
    mutex.release()
    assert mutex.acquire(timeout=5) is False
    mutex.release()


def test_busy_and_timeout(local):
    _, region = local
    mutex = LocalMutex(region, 0)
    assert mutex.acquire() is False
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def contend():
        other = LocalMutex(region, 0)
        try:
            other.acquire(timeout=0.2)
        except TimeoutError as error:
            queue.put((other.try_acquire(), str(error)))

    child = context.Process(target=contend)
    child.start()
    busy, message = queue.get(timeout=30)
    child.join(30)
    mutex.release()
    assert busy is None and "still held after 0.2 s" in message


def test_placement_is_checked(local):
    _, region = local
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        LocalMutex(region, 4)
    with pytest.raises(IndexError):
        LocalMutex(region, region.size - SIZE + 8)
