"""The native fast path of manager-mode locks (`tract._native._lockfast`)
against its reference, the Python steps of `tract.lock.ManagedLock`, on the
same memory states; and cohorting (local hand-offs of a grant) natively."""

import itertools
import multiprocessing
import os
import signal
import threading
import time

import pytest

import twins

from tract._native import _lockfast
from tract.errors import CorruptionError
from tract.lock import (COHORT_PASSES, GRANTED, HELD, NONE, PASSES, REVOKING, SLOT_BYTES,
                        WAITERS, Cohort, grant_check)
from tract.pool import Pool
from tract.region import open_region

NODE = 1
MAX_NODES = 4


@pytest.fixture
def pool(pool_path):
    Pool.create(pool_path, 1 << 20, lock_mode="manager", max_nodes=MAX_NODES, lease_timeout=0.5,
                chunk_size=1 << 16)
    with Pool.open(pool_path, NODE) as handle:
        yield handle


@pytest.fixture
def quiet(pool_path):
    """A pool handle with no heartbeat thread (the heartbeat sweeps hand-offs
    that stand still, which would race the cohort steps under test)."""
    Pool.create(pool_path, 1 << 20, lock_mode="manager", max_nodes=MAX_NODES, lease_timeout=0.5,
                chunk_size=1 << 16)
    with Pool(open_region(pool_path), NODE, heartbeat=False) as handle:
        yield handle


def _states():
    """Manager line x grant line x request line, including torn, foreign,
    stale-manager and out-of-range values."""
    managers = [(0, 7), (3, 7), (NODE + 1, 7), (MAX_NODES + 1, 7), (MAX_NODES + 5, 7)]
    holders = [0, NODE + 1, 3, MAX_NODES + 9]
    states = [NONE, GRANTED, REVOKING, 9]
    for (manager, manager_epoch), holder, state, grant_epoch, torn, stale, request in \
            itertools.product(managers, holders, states, [5, 6], [False, True], [False, True],
                              [(0, 0, 0), (4, 3, 2)]):  # done and wait behind req
        fields = [holder, state, 2, grant_epoch, manager_epoch - stale]
        check = grant_check(fields) ^ torn
        yield (manager, manager_epoch), fields + [check], request


def _write(pool, lock, state):
    (manager, manager_epoch), grant, request = state
    region, layout = pool.region, pool.layout
    region.store_u64(layout.manager_line, manager)
    region.store_u64(layout.manager_line + 8, manager_epoch)
    if 0 < manager <= MAX_NODES:
        for index, value in enumerate(grant):
            region.store_u64(layout.grant_line(lock, manager - 1) + 8 * index, value)
    for index, value in enumerate(request):
        region.store_u64(layout.request_line(lock, NODE) + 8 * index, value)


def _lock_area(pool):
    return pool.region.read(pool.layout.offset, pool.layout.nbytes)


def test_grant_check_twin():
    for fields in ([0] * 5, [1, 2, 3, 4, 5], [2**64 - 1] * 5, [NODE + 1, GRANTED, 9, 2**63, 1]):
        assert _lockfast.grant_check(fields) == grant_check(fields)


def _held_to(name, pool, lock, state, reference, fast):
    """Each step from ``state``, held to the reference by result, bytes and
    cache-control batches (tests/twins.py)."""
    area = [(pool.layout.offset, pool.layout.nbytes)]
    _write(pool, lock, state)
    want, got = twins.both(pool.region, area, reference, fast)
    twins.check(name, want, got, context=state)


def test_announce_and_first_attempt_match_the_reference(pool):
    lock = pool.lock("alloc")
    index, reference, fast = pool._names["alloc"], lock.global_lock, lock.fast
    compared = 0

    def announce_and_attempt():
        seq = reference.announce()
        try:
            granted, _, _ = reference.attempt(seq, first=True)
        except CorruptionError:
            granted = False  # the reference raises; the fast path must leave it to it
        return (_lockfast.ACQUIRED if granted else _lockfast.ANNOUNCED, seq,
                reference.epoch if granted else None)

    def attempt():
        outcome = fast.attempt()
        return outcome, fast.seq, fast.epoch if outcome == _lockfast.ACQUIRED else None

    for state in _states():
        _held_to("tract._native._lockfast.ManagerFastPath.attempt", pool, index, state,
                 announce_and_attempt, attempt)
        compared += 1
    assert compared == 5 * 4 * 4 * 2 * 2 * 2 * 2


def test_still_granted_and_release_match_the_reference(pool):
    lock = pool.lock("alloc")
    index, reference, fast = pool._names["alloc"], lock.global_lock, lock.fast

    def still_granted():
        try:
            return reference.still_granted()
        except CorruptionError:
            return False

    for state in _states():
        for epoch in (5, 6):
            reference.epoch = fast.epoch = epoch
            _held_to("tract._native._lockfast.ManagerFastPath.still_granted", pool, index,
                     state, still_granted, fast.still_granted)
        _held_to("tract._native._lockfast.ManagerFastPath.repair", pool, index, state,
                 reference.release, fast.repair)
        assert fast.slot_words() == (0, 0, 0)


# --------------------------------------------- cohorting: acquire, release, sweep

class _Tier1:
    """The lock's tier-1 mutex in a given state for one step: ``free``,
    ``busy`` (another thread holds it throughout) or ``dead`` (its last
    holder, a thread, ended holding it)."""

    def __init__(self, mutex, state):
        self.mutex, self.state = mutex, state
        self.taken, self.done = threading.Event(), threading.Event()
        self.thread = None

    def _hold(self):
        if self.mutex.acquire():  # a dead holder left it: this one repairs nothing
            self.mutex.consistent()
        self.taken.set()
        self.done.wait(30)
        self.mutex.release()

    def __enter__(self):
        if self.state == "busy":
            self.thread = threading.Thread(target=self._hold)
            self.thread.start()
            self.taken.wait(30)
        elif self.state == "dead":  # a thread that ends holding it (no fork: 7 ms here)
            holder = threading.Thread(target=self.mutex.acquire)
            holder.start()
            holder.join(30)
            # the kernel marks a robust mutex's owner dead as the thread exits, before
            # the thread leaves /proc (Python's join returns a little earlier)
            deadline = time.monotonic() + 30
            while os.path.exists(f"/proc/self/task/{holder.native_id}"):
                assert time.monotonic() < deadline, "the holder thread did not exit"
                time.sleep(0.0002)
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.thread is not None:
            self.thread.join(30)


def _cohort_twin(pool, index, words, tier1, step, after):
    """``step`` (of a `Cohort` or of the fast path) from the slot ``words``
    (held, waiters, passes) with tier 1 in state ``tier1``; ``after`` puts
    tier 1 back (the step may leave it held).  Result: the step's, its slot
    words and the epoch and seq it leaves."""
    local, slot = pool._local.region, index * SLOT_BYTES

    def run():
        for word, value in zip((HELD, WAITERS, PASSES), words):
            local.store_u64(slot + word, value)
        with _Tier1(pool._local.mutex(index), tier1):
            try:
                result = step()
            except TimeoutError as error:
                result = (TimeoutError, str(error).split(" still held")[0])
            words_after = tuple(local.load_u64(slot + w) for w in (HELD, WAITERS, PASSES))
            after(result)
        return result, words_after
    return run


def _cohorts(pool):
    lock = pool.lock("alloc")
    index = pool._names["alloc"]
    local = pool._local
    reference = Cohort(pool.space, index, "alloc", local.region, index * SLOT_BYTES,
                       local.mutex(index), COHORT_PASSES)
    return index, reference, lock.fast, local.mutex(index)


def _some_states():
    """Every fifth pool state (256: the cohort steps read the grant line
    only where `attempt` and `still_granted`, compared on all, do)."""
    return itertools.islice(_states(), 0, None, 5)


def test_cohort_acquire_matches_its_reference(quiet):
    pool = quiet
    index, reference, fast, mutex = _cohorts(pool)
    name = "tract._native._lockfast.ManagerFastPath.acquire"

    def put_back(result):
        if result[0] == _lockfast.OWNER_DIED:
            mutex.consistent()
        if result[0] != TimeoutError:
            mutex.release()

    def acquire(side):
        def step():
            outcome = side.acquire(0.002)
            return (outcome, side.epoch if outcome == _lockfast.ACQUIRED else None,
                    side.seq if outcome == _lockfast.ANNOUNCED else None)
        return step

    compared = 0
    for state in _some_states():
        for words, tier1 in [((0, 0, 3), "free"), ((6, 0, 3), "free"), ((0, 0, 0), "dead"),
                             ((9, 2, 1), "free")]:
            _write(pool, index, state)
            area = [(pool.layout.offset, pool.layout.nbytes)]
            want, got = twins.both(pool.region, area,
                                   _cohort_twin(pool, index, words, tier1, acquire(reference),
                                                put_back),
                                   _cohort_twin(pool, index, words, tier1, acquire(fast),
                                                put_back))
            twins.check(name, want, got, context=(state, words, tier1))
            compared += 1
    for words in [(0, 0, 0), (6, 0, 0)]:  # tier 1 stays busy: both time out, uncounted
        want, got = twins.both(pool.region, [(pool.layout.offset, pool.layout.nbytes)],
                               _cohort_twin(pool, index, words, "busy", acquire(reference),
                                            put_back),
                               _cohort_twin(pool, index, words, "busy", acquire(fast),
                                            put_back))
        twins.check(name, want, got, context=(words, "busy"))
        assert want.result[0][0] == TimeoutError and want.result[1] == words
    assert compared == 256 * 4


def test_cohort_release_matches_its_reference(quiet):
    pool = quiet
    index, reference, fast, mutex = _cohorts(pool)
    name = "tract._native._lockfast.ManagerFastPath.release"

    def release(side):
        def step():
            mutex.acquire()  # a holder releases
            return side.release()
        return step

    for state in _some_states():
        for waiters, passes, epoch in itertools.product(
                (0, 1), (0, 1, 8, COHORT_PASSES - 1, COHORT_PASSES), (5, 6)):
            reference.epoch = fast.epoch = epoch
            _write(pool, index, state)
            words = (0, waiters, passes)
            area = [(pool.layout.offset, pool.layout.nbytes)]
            want, got = twins.both(pool.region, area,
                                   _cohort_twin(pool, index, words, "free", release(reference),
                                                lambda result: None),
                                   _cohort_twin(pool, index, words, "free", release(fast),
                                                lambda result: None))
            twins.check(name, want, got, context=(state, words, epoch))
            assert mutex.try_acquire() is False  # each released tier 1
            mutex.release()


def test_cohort_sweep_matches_its_reference(quiet):
    pool = quiet
    index, reference, fast, mutex = _cohorts(pool)
    name = "tract._native._lockfast.ManagerFastPath.sweep"
    seen = set()
    for state in itertools.islice(_states(), 0, None, 20):
        for held, tier1, stale in itertools.product((0, 6), ("free", "busy", "dead"),
                                                    (True, False)):
            _write(pool, index, state)
            words = (held, 0, 3)
            area = [(pool.layout.offset, pool.layout.nbytes)]
            want, got = twins.both(
                pool.region, area,
                _cohort_twin(pool, index, words, tier1, lambda: reference.sweep(stale),
                             lambda result: None),
                _cohort_twin(pool, index, words, tier1, lambda: fast.sweep(stale),
                             lambda result: None))
            twins.check(name, want, got, context=(state, words, tier1, stale))
            swept, words_after = want.result
            seen.add((swept, tier1, stale, held))
            # a dead holder's hold is always given back; a standing hand-off only when stale
            assert swept == (tier1 == "dead" or (tier1 == "free" and stale and held > 0))
            assert words_after[0] == (0 if swept else held)
            assert mutex.try_acquire() is False  # free again, and consistent
            mutex.release()
    assert {swept for swept, *_ in seen} == {True, False}


def test_uncontended_acquire_takes_the_sticky_grant_natively(pool_path):
    Pool.create(pool_path, 1 << 20, lock_mode="manager", max_nodes=MAX_NODES, lease_timeout=0.5,
                chunk_size=1 << 16)
    with Pool.open(pool_path, NODE, manager=True) as pool:
        lock = pool.lock("alloc")
        with lock(timeout=10):  # the first grant goes through the manager
            first = lock.epoch
        request = pool.layout.request_line(pool._names["alloc"], NODE)
        for _ in range(3):
            before = pool.region.load_u64(request)
            assert lock.fast.acquire() == _lockfast.ACQUIRED  # sticky: no wait
            assert lock.epoch == first and lock.fast.seq == before + 1
            lock.check()
            lock.release()
            assert pool.region.load_u64s(request, 3) == (before + 1,) * 3


def _blocked_acquire(lock, results):
    results.append(lock.acquire(timeout=10))
    lock.release()


def test_a_local_waiter_gets_the_grant_without_pool_writes(pool_path):
    Pool.create(pool_path, 1 << 20, lock_mode="manager", max_nodes=MAX_NODES, lease_timeout=0.5,
                chunk_size=1 << 16)
    with Pool.open(pool_path, NODE, manager=True) as pool, Pool.open(pool_path, NODE) as other:
        lock, waiting = pool.lock("alloc"), other.lock("alloc")
        epoch = lock.acquire(timeout=10)
        request = pool.layout.request_line(pool._names["alloc"], NODE)
        results = []
        thread = threading.Thread(target=_blocked_acquire, args=(waiting, results))
        thread.start()
        while lock.fast.slot_words()[1] == 0:  # the waiter is counted
            time.sleep(0.001)
        line = pool.region.read(request, 64)
        lock.release()
        thread.join(10)
        assert results == [epoch]  # the same grant, handed over
        # the waiter gave it back on release (no one else waited): seqs moved once
        assert pool.region.read(request, 64) != line
        assert lock.fast.slot_words() == (0, 0, 0)


def test_hand_offs_stop_at_the_bound(pool):
    lock = pool.lock("alloc")
    fast = lock.fast
    # pretend this node holds a grant and one local process waits forever
    index = pool._names["alloc"]
    _write(pool, index, ((NODE + 1, 7), [NODE + 1, GRANTED, 1, 5, 7,
                                           grant_check([NODE + 1, GRANTED, 1, 5, 7])],
                         (1, 0, 0)))
    waiters = pool._local.region
    slot = index * _lockfast.SLOT_BYTES + 72
    waiters.store_u64(slot, 1)
    handed = 0
    while True:
        assert fast.acquire() == _lockfast.ACQUIRED
        fast.release()
        if fast.slot_words()[0] == 0:
            break
        handed += 1
    assert handed == COHORT_PASSES
    waiters.store_u64(slot, 0)


def test_a_revoked_grant_is_given_back_not_handed_over(pool):
    lock, index = pool.lock("alloc"), pool._names["alloc"]
    fields = [NODE + 1, REVOKING, 1, 5, 7]
    _write(pool, index, ((NODE + 1, 7), fields + [grant_check(fields)], (1, 0, 0)))
    slot = index * _lockfast.SLOT_BYTES + 72
    pool._local.region.store_u64(slot, 1)  # a local waiter
    assert lock.fast.acquire() == _lockfast.ANNOUNCED  # REVOKING: not taken
    lock.fast.epoch = 5
    lock.fast.release()
    assert lock.fast.slot_words()[0] == 0  # given back
    pool._local.region.store_u64(slot, 0)


def test_sweep_gives_back_a_hand_off_nobody_took(pool):
    lock, index = pool.lock("alloc"), pool._names["alloc"]
    fields = [NODE + 1, GRANTED, 1, 5, 7]
    _write(pool, index, ((NODE + 1, 7), fields + [grant_check(fields)], (1, 0, 0)))
    slot = index * _lockfast.SLOT_BYTES + 72
    pool._local.region.store_u64(slot, 1)  # a waiter that then gave up
    assert lock.fast.acquire() == _lockfast.ACQUIRED
    lock.fast.release()
    pool._local.region.store_u64(slot, 0)
    assert lock.fast.slot_words()[0] == 6  # handed over, to nobody
    assert lock.fast.sweep(stale=False) is False  # not yet a whole beat
    assert lock.fast.slot_words()[0] == 6
    assert lock.fast.sweep() is True
    request = pool.layout.request_line(index, NODE)
    assert pool.region.load_u64s(request, 3) == (2, 2, 2)  # announced once, given back
    assert lock.fast.slot_words() == (0, 0, 0)
    assert lock.fast.sweep() is False


def _die_holding(path, ready):
    pool = Pool.open(path, NODE)
    pool.lock("alloc").acquire(timeout=10)
    ready.set()
    time.sleep(600)


@pytest.mark.multiprocess
def test_a_holder_killed_after_a_hand_off_is_repaired(pool_path):
    Pool.create(pool_path, 1 << 20, lock_mode="manager", max_nodes=MAX_NODES, lease_timeout=0.5,
                chunk_size=1 << 16)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    with Pool.open(pool_path, 0, manager=True) as manager_pool:
        victim = context.Process(target=_die_holding, args=(pool_path, ready))
        victim.start()
        assert ready.wait(60)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(30)
        with Pool.open(pool_path, NODE) as pool:
            lock = pool.lock("alloc")
            epoch = lock.acquire(timeout=10)  # EOWNERDEAD: repaired, then granted
            lock.check()
            lock.release()
            other = manager_pool.lock("alloc")
            assert other.acquire(timeout=10) > epoch  # node 1 gave it back
            other.release()


# ------------------------------------------------------- the node's own lease

def test_the_native_lease_verdict_is_its_reference_s():
    """`_lockfast.lease_state` against `tract.lease.OwnLease.state`, over
    fresh, late, lapsed and rejoined words, at the limit and either side."""
    import numpy as np

    from tract.lease import BEATEN, CURRENT, LATE_BEAT, LEASE_WORDS, Clock, OwnLease

    words = np.zeros(LEASE_WORDS, np.uint64)
    own = OwnLease(Clock(), 0.4, words)
    limit = own.limit_ns
    for beaten, current, late, epoch, age in itertools.product(
            [10**12, 5 * 10**12], [1, 7], [0, 1], [1, 7, 8],
            [0, 1, limit - 1, limit, limit + 1, 3 * limit]):
        words[BEATEN], words[CURRENT], words[LATE_BEAT] = beaten, current, late
        now = beaten + age
        assert _lockfast.lease_state(words.ctypes.data, now, limit, epoch) == \
            own.state(epoch, now), (beaten, current, late, epoch, age)


def test_a_native_beat_is_the_reference_beat(quiet):
    """`_lockfast.Heartbeat`'s step (`beat_once`) against `OwnLease.beat`
    with `NodeTable.beat`: the same verdict, the same heartbeat line and
    lease words, the same cache-control batches; a late beat writes
    nothing and lapses the node."""
    import numpy as np

    from tract.lease import BEATEN, LATE_BEAT, LEASE_WORDS, OwnLease

    region, line = quiet.region, quiet.nodes.line(NODE)
    words = np.zeros(LEASE_WORDS, np.uint64)
    own = OwnLease(quiet.clock, 0.4, words)
    for age, late in [(0, 0), (own.limit_ns // 2, 0), (own.limit_ns + 1, 0), (0, 1)]:
        start = words.copy()
        now = 10**13
        start[BEATEN], start[LATE_BEAT] = now - age, late
        own.now_ns = lambda: now  # the reference on the same moment as the native step

        def reference():
            words[:] = start
            return own.beat(quiet.nodes, NODE), words.copy()

        def fast():
            words[:] = start
            return _lockfast.beat_once(region, line, words.ctypes.data, now, own.limit_ns), \
                words.copy()
        found, got = twins.both(region, [(line, 64)], reference, fast)
        twins.check("tract._native._lockfast.Heartbeat.start", found, got,
                    context=(age, late))
        assert found.result[0] == (age <= own.limit_ns and not late)


def _stopped_holder(path, ready, outcome):
    with Pool.open(path, 0, manager=True) as pool:
        ready.set()
        time.sleep(0.5)  # SIGSTOPped here, past its lease, then SIGCONTed
        try:
            pool.self_fence("a test write")
            outcome.put("wrote")
        except Exception as error:
            outcome.put(type(error).__name__)
        outcome.put(pool.renew())


@pytest.mark.multiprocess
def test_a_process_stopped_past_its_lease_fences_itself_then_rejoins(pool_path):
    """SIGSTOP a process for three leases: its native heartbeat stopped too,
    its first beat after SIGCONT is late, so it writes nothing (`LeaseLost`)
    and rejoins as a new incarnation; meanwhile another node judged it
    stale."""
    Pool.create(pool_path, 1 << 20, lock_mode="manager", max_nodes=MAX_NODES, lease_timeout=0.2,
                chunk_size=1 << 16)
    context = multiprocessing.get_context("fork")
    ready, outcome = context.Event(), context.Queue()
    process = context.Process(target=_stopped_holder, args=(pool_path, ready, outcome))
    process.start()
    try:
        assert ready.wait(60)
        with Pool.open(pool_path, 2) as observer:
            assert observer.space.liveness.live(0)
            os.kill(process.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 3 * 0.2 * 5
            while observer.space.liveness.live(0):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            os.kill(process.pid, signal.SIGCONT)
        assert outcome.get(timeout=60) == "LeaseLost"
        assert outcome.get(timeout=60) is True
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.join(60)
    assert process.exitcode == 0
