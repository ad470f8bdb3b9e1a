"""The two-tier lock: mutual exclusion, leases, crash recovery, in every mode,
natively across processes and under the non-coherent simulator.

Tests marked ``sim`` are the suite the mutation harness runs against every
mutant of tract.lock and tract.lease (TRACT_SIM_SEEDS sets the seeds).
"""

import multiprocessing
import os
import signal
import time

import pytest

from tract.errors import ConfigError, CorruptionError, LeaseLost, LockTimeout
from simnodes import heartbeat
from tract.lock import SLOT_BYTES, Cohort, Lock, grant_check
from tract.pool import Pool, format_pool
from tract.testing.incoherent import (LINE, SimMutex, SimNodeLocal, SimPool,
                                     SimulationFailure)
from tract.testing.seeds import count, seeds

SEEDS = count()
SIM_LEASE = 0.004  # virtual seconds: 4000 simulated operations


# ----------------------------------------------------------- simulator runs

def _sim_pool(seed, nodes, mode, chaos=0.2, max_steps=120_000):
    pool = SimPool(64 * 1024, hosts=nodes, seed=seed, chaos=chaos, max_steps=max_steps)
    format_pool(pool.hosts[0], max_nodes=nodes, locks=("alloc", "objects"), max_locks=2,
                chunk_size=8192, max_objects=16, index_capacity=64,
                lock_mode=mode, lease_timeout=SIM_LEASE, hash_key=pool.hash_key)
    for host in pool.hosts:  # the formatted pool is in memory; every host starts fresh
        host.invalidate(0, pool.size)
        host.fence()
    return pool


def _counter(handle):
    return handle.header.heap


def run_counter(seed, mode, nodes=3, rounds=3, chaos=0.2, crash=None):
    """Each node adds ``rounds`` to a non-atomic counter in the pool under the
    lock; node 0 also runs the lock manager in manager mode; every node runs a
    heartbeat thread.  ``crash=(node, round)`` makes that node die holding
    the lock.  Checks that no two holders are ever inside at once, that the
    counter is exact, and that the survivors finish (within the lease)."""
    pool = _sim_pool(seed, nodes, mode, chaos)
    inside: list[int] = []
    finished = [False] * nodes
    handles = {}

    def worker(node):
        def body(host):
            handle = handles[node] = Pool(host, node, clock=pool.clock, heartbeat=False,
                                          local_locks=False)
            lock = handle.lock("alloc")
            counter = _counter(handle)
            for round_ in range(rounds):
                lock.acquire()
                inside.append(node)
                if len(inside) > 1:
                    raise AssertionError(f"nodes {inside} inside the lock at once")
                host.invalidate(counter, 8)
                host.fence()
                value = host.load_u64(counter)
                host.store_u64(counter, value + 1)
                lock.check()
                host.flush(counter, 8)  # the release fences it (R3)
                if crash == (node, round_):
                    host.fence()  # its update is in memory; then it dies inside
                    inside.remove(node)
                    finished[node] = True
                    return "crashed"  # dies holding the lock: no release, no more beats
                inside.remove(node)
                lock.release()
            finished[node] = True
        return body

    def manager(host):
        while 0 not in handles:
            pool.clock.sleep(SIM_LEASE / 8)
        granting = handles[0].manager()
        while not all(finished):  # a busy manager still lets others run
            pool.clock.sleep(SIM_LEASE / 256 if granting.step() else SIM_LEASE / 16)

    threads = [(node, worker(node)) for node in range(nodes)]
    threads += [(node, heartbeat(pool, handles, finished, node, SIM_LEASE / 8))
                for node in range(nodes)]
    if mode == "manager":
        threads.append((0, manager))
    pool.run(*threads)
    lost = [u for u in pool.lost_updates]
    expected = nodes * rounds - (0 if crash is None else rounds - 1 - crash[1])
    value = int.from_bytes(pool.memory[_counter(handles[0]):_counter(handles[0]) + 8].tobytes(),
                           "little")
    if lost:
        raise SimulationFailure(f"lost update at {lost[0].line_offset} by host {lost[0].host}",
                                seed)
    if value != expected:
        raise SimulationFailure(f"counter is {value}, expected {expected}", seed)
    return pool


@pytest.mark.sim
@pytest.mark.parametrize("mode", ["bakery", "manager"])
def test_counter_is_exact_under_every_seed(mode):
    for seed in seeds(SEEDS):
        run_counter(seed, mode)


@pytest.mark.sim
@pytest.mark.parametrize("mode", ["bakery", "manager"])
def test_counter_is_exact_without_chaos(mode):
    for seed in seeds(max(1, SEEDS // 4)):
        run_counter(seed, mode, chaos=0.0)


@pytest.mark.sim
@pytest.mark.parametrize("mode", ["bakery", "manager"])
def test_survivors_proceed_when_a_holder_dies(mode):
    for seed in seeds(max(1, SEEDS // 4)):
        run_counter(seed, mode, crash=(1, 1))


def _two_nodes():
    """Nodes 0 and 1 of a bakery pool on hosts 0 and 1, without chaos."""
    pool = _sim_pool(0, 2, "bakery", chaos=0.0)
    return pool, [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
                  for node, host in enumerate(pool.hosts)]


@pytest.mark.sim
def test_the_lock_area_check_reads_the_lines_fresh():
    """`LockSpace.check` on node 1 finds the lines node 0 broke after node
    1 cached them whole (R4, R5)."""
    pool, handles = _two_nodes()
    layout, max_nodes = handles[0].layout, handles[0].header.max_nodes
    torn, bad = layout.grant_line(0, 0), layout.grant_line(1, 1)
    seen = {}

    def steps(host):
        checker, writer = handles[1].space, pool.hosts[0]
        seen["before"] = checker.check()  # node 1 caches the whole area
        checker.region.fence()  # and holds no invalidate still queued from that check
        writer.store_u64(layout.manager_line, max_nodes + 3)
        for field, value in enumerate([1, 1, 2, 3, 4, 12345]):  # check word wrong
            writer.store_u64(torn + 8 * field, value)
        fields = [2, 9, 1, 1, 1]  # whole, in a state that does not exist
        for field, value in enumerate(fields + [grant_check(fields)]):
            writer.store_u64(bad + 8 * field, value)
        for line in (layout.manager_line, torn, bad):
            writer.flush(line, LINE)
        writer.fence()
        seen["after"] = checker.check()

    pool.run((0, steps))
    assert seen["before"] == []
    assert seen["after"] == [
        (layout.manager_line, f"manager line names node {max_nodes + 2}"),
        (torn, "grant line of lock 0 by manager 0 is torn (check word)"),
        (bad, "grant line of lock 1 by manager 1 has holder 1, state 9")]
    assert pool.stale_reads == [] and pool.lost_updates == []


@pytest.mark.sim
def test_a_new_incarnation_forgets_the_last_ones_requests_for_every_host():
    """Node 1's last incarnation (on host 0) left a request and a bakery
    ticket in every lock; its next, on host 1, which had cached those lines
    (R4: it reads them fresh before it writes part of them), leaves each
    request done and not waiting and each ticket zero, in memory for host 0,
    which had cached them too (R3)."""
    pool, handles = _two_nodes()
    layout = handles[0].layout
    locks = range(layout.max_locks + 1)
    lines = [line for lock in locks
             for line in (layout.request_line(lock, 1), layout.bakery_line(lock, 1))]
    seen = {}

    def steps(host):
        other, node = pool.hosts[0], pool.hosts[1]
        for line in lines:  # host 1 reads them first, and keeps them cached
            node.invalidate(line, LINE)
        node.fence()
        for line in lines:
            node.load_u64s(line, 3)
        for line in lines:
            other.invalidate(line, LINE)
        other.fence()
        for lock in locks:
            other.store_u64(layout.request_line(lock, 1), 5 + lock)  # a request left open
            other.store_u64(layout.bakery_line(lock, 1), 1)
            other.store_u64(layout.bakery_line(lock, 1) + 8, 7)
            other.flush(layout.request_line(lock, 1), LINE)
            other.flush(layout.bakery_line(lock, 1), LINE)
        other.fence()
        handles[1].space.forget_node(1)
        for line in lines:
            other.invalidate(line, LINE)
        other.fence()
        seen["lines"] = [other.load_u64s(line, 3) for line in lines]

    pool.run((0, steps))
    assert seen["lines"] == [words for lock in locks
                             for words in ((5 + lock,) * 3, (0, 0, 0))]
    assert pool.stale_reads == [] and pool.lost_updates == []


def test_same_seed_same_lock_run():
    first, second = run_counter(3, "manager"), run_counter(3, "manager")
    assert first.steps == second.steps and list(first.trace) == list(second.trace)


def test_atomic_mode_is_refused_on_a_non_coherent_pool():
    pool = SimPool(64 * 1024, hosts=1)
    with pytest.raises(ConfigError, match="'atomic' needs coherence='hardware'"):
        format_pool(pool.hosts[0], lock_mode="atomic")


def test_corrupt_grant_line_is_refused():
    pool = _sim_pool(0, 2, "manager", chaos=0.0)
    handle = Pool(pool.hosts[0], 0, clock=pool.clock, heartbeat=False, local_locks=False)
    line = handle.layout.manager_line
    pool.memory[line:line + 8] = 0xFF
    with pytest.raises(CorruptionError, match="manager line at offset"):
        handle.lock("alloc").acquire(timeout=0.001)


# ------------------------------------------------------ cohorting, simulated

class _CountingCohort(Cohort):
    """A cohort that counts how its holds came: announced or handed over."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.announced = self.taken = 0

    def attempt(self):
        self.announced += 1
        return super().attempt()

    def acquire(self, timeout=None):
        outcome = super().acquire(timeout)
        self.taken += 1
        return outcome


def run_cohort(seed, bound=3, rounds=4, chaos=0.2, die=None):
    """Node 0 runs two processes (threads of one host sharing its node-local
    slot and tier-1 mutex: `Cohort`, the reference of the native fast path),
    node 1 one; each adds ``rounds`` to a non-atomic counter under the lock,
    node 0 also runs the manager.  ``die``: the round in which node 0's first
    process dies holding the lock (its node lives on).  Checks mutual
    exclusion, the exact count, that every process finishes (node 1 is not
    starved: the bound), and returns the cohorts."""
    pool = _sim_pool(seed, 2, "manager", chaos)
    inside: list[int] = []
    workers = [(0, 0), (0, 1), (1, 0)]
    finished = [False] * len(workers)
    handles, cohorts = {}, {}
    slot = SimNodeLocal(pool, 0, SLOT_BYTES), SimMutex(pool)

    def worker(which):
        node, process = workers[which]

        def body(host):
            if process == 0:  # the node joins once; its other process shares the handle
                handles[node] = Pool(host, node, clock=pool.clock, heartbeat=False,
                                     local_locks=False)
            while node not in handles:
                pool.clock.sleep(SIM_LEASE / 8)
            handle = handles[node]
            index = handle._names["alloc"]
            if node == 0:
                local, mutex = slot
                cohort = cohorts[which] = _CountingCohort(handle.space, index, "alloc", local, 0,
                                                          mutex, bound)
                lock = Lock(handle.space, "manager", index, "alloc", mutex, cohort)
            else:
                lock = handle.lock("alloc")
            counter = _counter(handle)
            for round_ in range(rounds):
                lock.acquire()
                inside.append(which)
                if len(inside) > 1:
                    raise AssertionError(f"processes {inside} inside the lock at once")
                host.invalidate(counter, 8)
                host.fence()
                host.store_u64(counter, host.load_u64(counter) + 1)
                lock.check()
                host.flush(counter, 8)
                if die == round_ and which == 0:
                    host.fence()
                    inside.remove(which)
                    finished[which] = True
                    return "died"  # holding tier 1 and tier 2: the next local taker repairs
                inside.remove(which)
                lock.release()
            finished[which] = True
        return body

    def beats(node):
        """The heartbeat; node 0's also sweeps, as `Pool._beat` does."""
        def body(host):
            while node not in handles:
                pool.clock.sleep(SIM_LEASE / 8)
            handle = handles[node]
            sweeper, seen = None, None
            if node == 0:
                local, mutex = slot
                sweeper = Cohort(handle.space, handle._names["alloc"], "alloc", local, 0, mutex,
                                 bound)
            while not all(finished):
                handle.nodes.beat(node)
                if sweeper is not None:
                    words = sweeper.slot_words()
                    sweeper.sweep(stale=bool(words[0]) and seen == words)
                    seen = words
                pool.clock.sleep(SIM_LEASE / 8)
        return body

    def manager(host):
        while 0 not in handles:
            pool.clock.sleep(SIM_LEASE / 8)
        granting = handles[0].manager()
        while not all(finished):
            pool.clock.sleep(SIM_LEASE / 256 if granting.step() else SIM_LEASE / 16)

    threads = [(node, worker(which)) for which, (node, _) in enumerate(workers)]
    threads += [(0, beats(0)), (1, beats(1)), (0, manager)]
    pool.run(*threads)
    counter = _counter(handles[0])
    value = int.from_bytes(pool.memory[counter:counter + 8].tobytes(), "little")
    expected = len(workers) * rounds - (0 if die is None else rounds - 1 - die)
    if pool.lost_updates:
        raise SimulationFailure(f"lost update at {pool.lost_updates[0].line_offset}", seed)
    if value != expected:
        raise SimulationFailure(f"counter is {value}, expected {expected}", seed)
    return cohorts


@pytest.mark.sim
def test_cohorting_hands_the_grant_over_locally_and_stays_exact():
    handed = 0
    for seed in seeds(max(1, SEEDS // 4)):
        cohorts = run_cohort(seed)
        handed += sum(cohort.taken - cohort.announced for cohort in cohorts.values())
    assert handed > 0  # the local hand-off happened, not only the announced path


@pytest.mark.sim
def test_cohorting_repairs_a_process_that_died_holding_the_lock():
    """The dying process's node-mate finishes first (or not): either it
    repairs, or node 0's heartbeat sweeps the hold back."""
    for seed in seeds(max(1, SEEDS // 4)):
        run_cohort(seed, die=1)


def test_the_cohort_bound_gives_the_grant_back():
    """With a bound of 0 no hold is ever handed over."""
    for seed in range(4):
        cohorts = run_cohort(seed, bound=0)
        assert all(cohort.taken == cohort.announced for cohort in cohorts.values())


# ------------------------------------------------------------- native runs

def _create(path, mode, **options):
    coherence = "hardware" if mode == "atomic" else "none"
    Pool.create(path, 1 << 20, lock_mode=mode, coherence=coherence, max_nodes=4, chunk_size=1 << 16,
                lease_timeout=options.pop("lease_timeout", 0.5), **options)


def _count(path, node, rounds, manager):
    with Pool.open(path, node, manager=manager) as pool:
        lock = pool.lock("alloc")
        counter = pool.header.heap
        region = pool.region
        for _ in range(rounds):
            with lock(timeout=30):
                region.invalidate(counter, 64)
                region.fence()
                stamp = region.load_u64(counter + 8)
                if stamp != 0:
                    raise AssertionError(f"owner stamp {stamp - 1} found by node {node}")
                region.store_u64(counter + 8, node + 1)
                region.flush(counter, 64)
                region.fence()
                value = region.load_u64(counter)
                region.store_u64(counter, value + 1)
                region.store_u64(counter + 8, 0)
                lock.check()
                region.flush(counter, 64)
                region.fence()


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["manager", "bakery", "atomic"])
def test_native_counter_across_processes_and_nodes(pool_path, mode):
    # No kills here, so a long lease: a heartbeat stalled on a loaded 2-core
    # host must not revoke a live holder's grant.  The manager role moves
    # between a node's processes as they finish (see
    # test_a_holder_keeps_its_grant_through_a_take_over_on_its_managers_node).
    _create(pool_path, mode, lease_timeout=2.5)
    context = multiprocessing.get_context("spawn")
    nodes = [0, 0, 1, 1]  # 4 processes on 2 node ids
    workers = [context.Process(target=_count, args=(pool_path, node, 200, mode == "manager"))
               for node in nodes]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    with Pool.open(pool_path, 2) as pool:
        pool.region.invalidate(pool.header.heap, 8)
        pool.region.fence()
        assert pool.region.load_u64(pool.header.heap) == 800


def _hold(path, node, manager, ready, tier):
    pool = Pool.open(path, node, manager=manager)
    pool.lock("alloc").acquire(timeout=30)
    ready.set()
    time.sleep(600)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["manager", "bakery"])
def test_killed_tier2_holder_is_overtaken_within_the_lease(pool_path, mode):
    _create(pool_path, mode, lease_timeout=0.5)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    holder = context.Process(target=_hold, args=(pool_path, 1, False, ready, 2))
    with Pool.open(pool_path, 0, manager=mode == "manager") as pool:
        holder.start()
        assert ready.wait(60)
        lock = pool.lock("alloc")
        with pytest.raises(LockTimeout, match=r"lock 'alloc' not acquired after .* held by node 1"):
            lock.acquire(timeout=0.1)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)
        start = time.monotonic()
        epoch = lock.acquire(timeout=10)
        waited = time.monotonic() - start
        assert waited < 0.5 * 4, waited  # the lease, plus scheduling slack
        assert lock.holder() == (0, epoch)
        lock.release()
        # the killed node rejoins with a new epoch and takes the lock again
        with Pool.open(pool_path, 1, manager=False) as again:
            assert again.epoch > 1
            with again.lock("alloc")(timeout=10):
                pass


@pytest.mark.multiprocess
def test_killed_tier1_holder_is_repaired_by_its_node(pool_path):
    _create(pool_path, "bakery", lease_timeout=30)  # far longer than the test: tier 1 repairs
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    holder = context.Process(target=_hold, args=(pool_path, 1, False, ready, 1))
    holder.start()
    assert ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(30)
    with Pool.open(pool_path, 1) as pool:  # same node: tier 1 reports the dead holder
        start = time.monotonic()
        with pool.lock("alloc")(timeout=5):
            pass
        assert time.monotonic() - start < 2


def _manage(path, node, ready):
    pool = Pool.open(path, node, manager=True)
    while True:
        pool.region.invalidate(pool.layout.manager_line, LINE)
        pool.region.fence()
        if pool.region.load_u64(pool.layout.manager_line) == node + 1:
            ready.set()
        time.sleep(0.01)


@pytest.mark.multiprocess
def test_killed_manager_is_replaced_by_a_standby(pool_path):
    _create(pool_path, "manager", lease_timeout=0.5)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    manager = context.Process(target=_manage, args=(pool_path, 3, ready))
    manager.start()
    assert ready.wait(60)
    with Pool.open(pool_path, 0, manager=True) as pool:  # a standby on node 0
        with pool.lock("alloc")(timeout=10):
            pass
        os.kill(manager.pid, signal.SIGKILL)
        manager.join(30)
        other = Pool.open(pool_path, 1)
        try:
            with other.lock("alloc")(timeout=10):  # forces a grant away from node 0
                pass
            with pool.lock("alloc")(timeout=10):
                pool.region.invalidate(pool.layout.manager_line, LINE)
                pool.region.fence()
                assert pool.region.load_u64(pool.layout.manager_line) == 1  # node 0 manages
        finally:
            other.close()


def test_lease_lost_is_reported_to_a_revoked_holder(pool_path):
    _create(pool_path, "bakery", lease_timeout=0.2)
    with Pool.open(pool_path, 0) as first:
        lock = first.lock("alloc")
        lock.acquire()
        first._stop_threads()  # its heartbeat stops, as a paused process's would
        with Pool.open(pool_path, 1) as second:
            with second.lock("alloc")(timeout=5):
                # its own lease tells it first (self-fencing, R6) ...
                with pytest.raises(LeaseLost, match="last beat is older than half its lease"):
                    lock.check()
                first.fencing = False  # ... and the grant, taken over, tells it too
                with pytest.raises(LeaseLost, match="taken over by node 1"):
                    lock.check()
        lock.release()


def test_unknown_lock_and_bad_node(pool_path):
    _create(pool_path, "bakery")
    with pytest.raises(ConfigError, match="beyond this pool's max_nodes"):
        Pool.open(pool_path, 4)
    with Pool.open(pool_path, 0) as pool:
        with pytest.raises(ConfigError, match="no lock named 'nope'"):
            pool.lock("nope")


@pytest.mark.sim
@pytest.mark.parametrize("mode", ["bakery", "manager"])
def test_each_call_is_visible_to_other_hosts_when_it_returns(mode, monkeypatch):
    """R3 as a contract: once join, beat, acquire, release and leave return,
    another host sees their effect, with no further step by the writer (and
    no chaos to write anything back by luck)."""
    pool = _sim_pool(0, 2, mode, chaos=0.0)
    first, second = (Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
                     for node, host in enumerate(pool.hosts))
    assert second.space.liveness.live(0)  # join
    before = second.nodes.read(0)[0]
    monkeypatch.setattr(os, "getpid", lambda: 4242)  # another process of the node joins
    first.nodes.join(0, stale=False)  # the same incarnation joins again: no other write
    assert second.nodes.read(0)[0] == before + 1
    # with its pid, by which a later join without a node-local file judges the incarnation
    assert pool.hosts[1].load_u64(second.nodes.line(0) + 24) == 4242
    monkeypatch.undo()
    beat = second.nodes.read(0)[0]
    first.nodes.beat(0)
    assert second.nodes.read(0)[0] == beat + 1
    lock, seen_by_second = first.lock("alloc"), second.lock("alloc")
    if mode == "bakery":
        epoch = lock.acquire()
        assert seen_by_second.holder() == (0, epoch)
        ticket = first.layout.bakery_line(0, 0)
        lock.release()
        second.space.fresh(ticket)
        assert pool.hosts[1].load_u64(ticket + 8) == 0
    else:
        done = []

        def holder(host):
            lock.acquire()
            lock.release()
            done.append(True)

        def manager(host):
            granting = second.manager()
            while not done:
                granting.step()
                pool.clock.sleep(1e-5)

        pool.run((0, holder), (1, manager))
        request = first.layout.request_line(0, 0)
        second.space.fresh(request)
        req, finished = pool.hosts[1].load_u64(request), pool.hosts[1].load_u64(request + 8)
        assert req == finished == 1
    first.leave()
    assert not second.space.liveness.live(0)


@pytest.mark.sim
def test_a_release_lands_only_after_the_holders_flushes():
    """R3 at release: the lock line may reach memory the moment it is
    flushed (hardware may complete a queued flush before any fence), so
    every flush the holder queued inside must complete before it: at the
    moment the freed lock line lands, the holder's data is in memory."""
    pool = _sim_pool(0, 2, "bakery", chaos=0.0)
    first = Pool(pool.hosts[0], 0, clock=pool.clock, heartbeat=False, local_locks=False)
    host, lock, counter = pool.hosts[0], first.lock("alloc"), _counter(first)
    lock.acquire()
    host.store_u64(counter, 12345)
    host.flush(counter, 8)  # queued: the release completes it (R3)
    queue, memory = host.flush, []

    def flush_landing_at_once(offset, length, payload=False):
        queue(offset, length, payload)
        host.complete_early(offset, length)
        memory.append(int.from_bytes(pool.memory[counter:counter + 8].tobytes(), "little"))
    host.flush = flush_landing_at_once
    lock.release()
    assert memory and set(memory) == {12345}, memory


@pytest.mark.sim
def test_the_batch_reads_of_the_node_table_see_each_change_at_their_first_look():
    """Node 0 holds node 1's table line in its cache; node 1 leaves, then
    rejoins.  `Liveness.live_nodes` drops node 1 at its first look after
    the leave is in memory, and `NodeTable.standing` differs at its first
    look after the rejoin (R4: one batch of drops, then one fence, then the
    reads: not one look late)."""
    pool, handles = _two_nodes()
    watcher, member = handles
    looks = {}

    def steps(host):
        looks["live before"] = watcher.space.liveness.live_nodes()
        before = watcher.nodes.standing()  # node 1's line is in node 0's cache
        member.leave()  # flushed and fenced: in memory
        looks["live after leave"] = watcher.space.liveness.live_nodes()
        left = watcher.nodes.standing()
        looks["standing changed at the leave"] = left != before
        member.nodes.join(1, True)
        looks["standing changed at the rejoin"] = watcher.nodes.standing() != left
        looks["live after rejoin"] = watcher.space.liveness.live_nodes()

    pool.run((0, steps))
    assert looks == {"live before": [0, 1], "live after leave": [0],
                     "standing changed at the leave": True,
                     "standing changed at the rejoin": True, "live after rejoin": [0, 1]}
    assert pool.stale_reads == [] and pool.lost_updates == []


@pytest.mark.sim
def test_a_node_that_stopped_before_an_open_is_gone_a_lease_after_it():
    """A node killed before another opens: the opener watches every
    heartbeat from its open, so it judges that node gone one lease later
    (R6: never sooner), however late its first question comes; and its
    lock manager shares that view, so the moment the manager may take the
    dead node's place, the frees and reclaims judge it gone too."""
    pool = _sim_pool(0, 2, "manager", chaos=0.0)
    Pool(pool.hosts[0], 0, clock=pool.clock, heartbeat=False, local_locks=False)  # then stops
    opener = Pool(pool.hosts[1], 1, clock=pool.clock, heartbeat=False, local_locks=False)
    assert opener.manager().space.liveness is opener.space.liveness
    lease = opener.header.lease_timeout
    pool.clock.sleep(0.9 * lease)
    assert opener.space.liveness.live(0)  # a lease is not over: not judged yet
    pool.clock.sleep(0.2 * lease)
    assert not opener.space.liveness.live(0)  # first asked now, watched since the open
    assert opener.space.liveness.live(1)


@pytest.mark.sim
def test_a_node_that_left_is_skipped_at_once():
    pool = _sim_pool(0, 2, "bakery", chaos=0.0)
    first, second = (Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
                     for node, host in enumerate(pool.hosts))
    first.lock("alloc").acquire()
    first.leave()  # gone for good, its ticket still out
    start = pool.clock.now()
    second.lock("alloc").acquire(timeout=SIM_LEASE)
    assert pool.clock.now() - start < SIM_LEASE / 10


@pytest.mark.sim
def test_a_holder_keeps_its_grant_through_a_manager_take_over():
    """A standby that takes over grants nobody until every node is outside,
    so a holder inside its predecessor's grant still holds the lock: check()
    passes; a holder of any older grant has lost it."""
    pool = _sim_pool(0, 3, "manager", chaos=0.0)
    first, holder_pool, standby_pool = (
        Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
        for node, host in enumerate(pool.hosts))
    old, new = first.manager(), standby_pool.manager()
    old.step()  # takes over: REVOKING from nobody until every node is outside
    old.step()  # they are: nobody holds it
    assert old.active
    lock = holder_pool.lock("alloc")
    lock.global_lock.announce()
    old.step()  # grants node 1
    epoch = lock.acquire(timeout=SIM_LEASE)
    new.step()
    assert not new.active  # node 0 is live
    pool.clock.sleep(2 * SIM_LEASE)  # node 0 falls silent; nodes 1 and 2 beat
    holder_pool.nodes.beat(1)
    standby_pool.nodes.beat(2)
    new.step()
    assert new.active and new.manager_epoch == old.manager_epoch + 1
    lock.check()
    assert lock.holder() == (None, epoch + 1)
    lock.global_lock.epoch = epoch - 1  # an older grant than the last one
    with pytest.raises(LeaseLost, match="is gone"):
        lock.check()
    lock.global_lock.epoch = epoch
    lock.release()
    waiter, granted = standby_pool.lock("alloc"), []

    def wait(host):
        granted.append(waiter.acquire(timeout=SIM_LEASE))

    def manage(host):
        while not granted:
            new.step()
            pool.clock.sleep(1e-5)

    pool.run((2, wait), (2, manage))
    assert granted[0] > epoch + 1  # node 1 left: the new manager granted node 2
    with pytest.raises(LeaseLost, match="is gone"):
        lock.check()


@pytest.mark.sim
@pytest.mark.parametrize("seed", range(4))
def test_a_holder_keeps_its_grant_through_a_take_over_on_its_managers_node(seed):
    """A manager process that exits hands the role to another process of its
    node, which rewrites the same grant lines before it names itself in the
    manager line.  A holder that checks in between sees a grant line one
    manager epoch ahead of the manager line: a take-over under way, not a
    lost grant (seen in CI as a LeaseLost of a live holder)."""
    pool = _sim_pool(seed, 2, "manager", chaos=0.2)
    first, holder_pool = (Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
                          for node, host in enumerate(pool.hosts))
    old = first.manager()
    old.step()
    old.step()
    lock = holder_pool.lock("alloc")
    lock.global_lock.announce()
    old.step()  # grants node 1
    epoch = lock.acquire(timeout=SIM_LEASE)
    new, done, checks = first.manager(), [], []  # the node's next manager process

    def take_over(host):
        new.step()
        done.append(True)

    def check(host):
        while not done:
            lock.check()
            checks.append(pool.clock.now())

    pool.run((0, take_over), (1, check))
    assert new.active and new.manager_epoch == old.manager_epoch + 1
    assert len(checks) > 1
    lock.check()
    assert lock.holder() == (None, epoch + 1)


# ------------------------------------------------------- self-fencing (R6)

def _fencing_node(pool, node):
    """Node ``node`` of a simulated pool, fencing on (it beats by hand)."""
    return Pool(pool.hosts[node], node, clock=pool.clock, heartbeat=False, local_locks=False,
                fencing=True)


@pytest.mark.sim
def test_a_holder_whose_lease_lapsed_is_fenced_before_its_grant_is_revoked():
    """A holder stalled past half its lease: the bakery has not let anyone
    in yet (nobody has judged it stale), but its own clock says that soon
    someone may: `check` refuses, its late beat is no beat, and it rejoins
    as a new incarnation before its next operation."""
    pool = _sim_pool(0, 2, "bakery", chaos=0.0)
    handle = _fencing_node(pool, 0)
    lock = handle.lock("alloc")
    lock.acquire()
    lock.check()
    pool.clock.sleep(0.6 * SIM_LEASE)
    with pytest.raises(LeaseLost, match="does not write under lock 'alloc'"):
        lock.check()
    lock.release()
    assert not handle.beat()  # late: not a beat, and the node stays lapsed
    with pytest.raises(LeaseLost, match="a beat came late"):
        lock.check()
    assert handle.renew() and handle.epoch == 2 and handle.nodes.read(0)[1] == 2
    lock.acquire()
    lock.check()
    lock.release()
    assert not handle.renew()


@pytest.mark.sim
def test_a_manager_whose_lease_lapsed_grants_nothing():
    """A manager stalled past half its lease writes no grant line (a
    standby may have taken over): here its take-over stops before any."""
    pool = _sim_pool(0, 2, "manager", chaos=0.0)
    handle = _fencing_node(pool, 0)
    manager = handle.manager()
    grant = handle.layout.grant_line(0, 0)
    kept_alive = manager.space.keep_alive

    def stalled():  # the step's beat and check pass, then the process stalls
        kept_alive()
        pool.clock.sleep(0.6 * SIM_LEASE)
    manager.space.keep_alive = stalled
    before = pool.memory[grant:grant + LINE].copy()
    with pytest.raises(LeaseLost, match="does not write the grant line of lock 0"):
        manager.step()
    assert (pool.memory[grant:grant + LINE] == before).all() and not manager.active
    manager.space.keep_alive = kept_alive
    with pytest.raises(LeaseLost, match="does not write a wait for a lock"):
        manager.step()  # lapsed: it does not even look for work
    assert handle.renew()
    manager.step()
    assert manager.active
