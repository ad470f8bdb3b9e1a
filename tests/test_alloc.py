"""The allocator: the global path under the non-coherent simulator (with
crashes), and natively: node heaps, remote frees, reclaim, a property-based
model check, several processes on several nodes, and kill -9.

Tests marked ``sim`` are the suite the mutation harness runs against every
mutant of tract.alloc (TRACT_SIM_SEEDS sets the seeds).
"""

import functools
import multiprocessing
import os
import random
import signal
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tract.alloc import OWNER_BYTES, FreeRing
from tract.errors import PoolFull
from tract.fsck import _Check, fsck
from simnodes import heartbeat
from tract.pool import Pool, format_pool
from tract.testing.incoherent import CRASHED, LINE, SimPool, SimulationFailure
from tract.testing.seeds import count, seeds

SEEDS = count()
SIM_LEASE = 0.004


# ----------------------------------------------------------- simulator runs

def _sim_pool(seed, nodes, chaos=0.2, size=128 * 1024, locks=("alloc", "objects")):
    """A formatted simulated pool that every host sees fresh: a copy of one
    formatted once per set of arguments (`SimPool.clone`)."""
    return _formatted(seed, nodes, chaos, size, locks).clone()


@functools.lru_cache(maxsize=4)
def _formatted(seed, nodes, chaos, size, locks):
    pool = SimPool(size, hosts=nodes, seed=seed, chaos=chaos, max_steps=400_000)
    format_pool(pool.hosts[0], max_nodes=nodes, locks=locks, max_locks=len(locks),
                chunk_size=8192, max_objects=16, index_capacity=64, lock_mode="bakery",
                lease_timeout=SIM_LEASE, hash_key=pool.hash_key)
    for host in pool.hosts:
        host.invalidate(0, pool.size)
        host.fence()
    return pool


def _memory_words(pool, offset, count):
    return np.frombuffer(pool.memory[offset:offset + count * 8].tobytes(), dtype=np.uint64)


def _check_crash_consistent(pool, handle):
    """In memory: every taken chunk has a whole owner record (R3 order:
    records before bits on alloc, bits before records on free)."""
    layout, nchunks = handle.alloc_layout, handle.header.nchunks
    words = _memory_words(pool, layout.bitmap, layout.bitmap_bytes // 8)
    for chunk in range(nchunks):
        if (int(words[chunk // 64]) >> (chunk % 64)) & 1:
            owner = _memory_words(pool, layout.owner(chunk), 3)
            kind = (int(owner[0]) >> 16) & 0xFF
            if kind == 0:
                raise SimulationFailure(f"chunk {chunk} is taken with no owner record", pool.seed)


def run_alloc(seed, nodes=3, rounds=4, chaos=0.2, crash=None):
    """Each node takes runs of 1..3 chunks and frees them, half of them
    through another node (frees come from any node); no chunk is ever held
    by two nodes; at the end the bitmap and every owner record are clear.
    ``crash=(node, after)``: that host dies after that many operations; the
    survivors reclaim what it held once its lease lapsed."""
    pool = _sim_pool(seed, nodes, chaos)
    rng = random.Random(seed)
    held: dict[int, int] = {}  # chunk -> node, while allocated
    handoff: list[tuple[int, int]] = []  # (chunk, its node): another node frees it
    handles, finished = {}, [False] * nodes

    def worker(node):
        def body(host):
            handle = handles[node] = Pool(host, node, clock=pool.clock, heartbeat=False,
                                          local_locks=False)
            allocator = handle.allocator
            mine = []
            for _ in range(rounds):
                count = rng.randint(1, 3)
                try:
                    first = allocator.alloc_chunks(count, timeout=50 * SIM_LEASE)
                except PoolFull:  # the others hold it all: give one back, go on
                    if mine:
                        _free(allocator, mine.pop(0))
                    continue
                for chunk in range(first, first + count):
                    if chunk in held and held[chunk] not in pool.crashed:  # reclaimed: fine
                        raise AssertionError(f"chunk {chunk} given to node {node} while node "
                                             f"{held[chunk]} holds it")
                    held[chunk] = node
                mine.append(first)
                if handoff and rng.random() < 0.7:
                    _free_handed(allocator, *handoff.pop())
                if rng.random() < 0.5:
                    first = mine.pop(0)
                    handoff.append((first, allocator.owner_fresh(first)))
                elif len(mine) > 1:
                    _free(allocator, mine.pop(0))
            for first in mine:
                _free(allocator, first)
            while handoff:  # the last node to finish frees what is left
                _free_handed(allocator, *handoff.pop())
            finished[node] = True
            return node
        return body

    def _free(allocator, first, owner=None):
        count = allocator.owner_fresh(first).run
        for chunk in range(first, first + count):
            if owner is None or held.get(chunk) == owner.node:
                held.pop(chunk, None)
        allocator.free_chunks(first, timeout=50 * SIM_LEASE, owner=owner)

    def _free_handed(allocator, first, owner):
        if owner.node in pool.crashed:  # a dead node's chunks are reclaimed, not freed
            return
        try:  # the owner may die while this free waits for the lock, its extent reclaimed
            _free(allocator, first, owner)  # and given to another node: then not freed
        except ValueError:
            if owner.node not in pool.crashed:
                raise  # only a node that died meanwhile loses its chunks to a reclaim


    if crash is not None:
        pool.crash(*crash)
    threads = [(node, worker(node)) for node in range(nodes)]
    threads += [(node, heartbeat(pool, handles, finished, node, SIM_LEASE / 8))
                for node in range(nodes)]
    results = pool.run(*threads)
    if pool.lost_updates:
        raise SimulationFailure(f"lost update at {pool.lost_updates[0].line_offset}", seed)
    survivor = handles[0]
    _check_crash_consistent(pool, survivor)
    if CRASHED not in results:
        if handoff:
            raise SimulationFailure(f"chunks {handoff} handed off but never freed", seed)
        layout = survivor.alloc_layout
        if _memory_words(pool, layout.bitmap, layout.bitmap_bytes // 8).any():
            raise SimulationFailure("bits left set after every chunk was freed", seed)
        owners = _memory_words(pool, layout.owners, survivor.header.nchunks * OWNER_BYTES // 8)
        if owners.any():
            raise SimulationFailure("owner records left after every chunk was freed", seed)
        return pool
    dead = crash[0]
    held_by_dead = {chunk for chunk, node in held.items() if node == dead}
    reports = []

    def repair(host):  # fsck --repair, unchanged, on the simulator, after the lease
        survivor.space.liveness.live(dead)
        pool.clock.sleep(2 * SIM_LEASE)
        reports.append(_Check(survivor, repair=True, watch=False).run())
        reports.append(_Check(survivor, repair=False, watch=False).run())

    pool.run((0, repair))
    repaired, after = reports
    if not repaired["ok"] or after["problems"]:
        raise SimulationFailure(f"fsck after the crash: {repaired['problems'][:2]} then "
                                f"{after['problems'][:2]}", seed)
    bits = _memory_words(pool, survivor.alloc_layout.bitmap, 1)
    still = {c for c in held_by_dead if (int(bits[c // 64]) >> (c % 64)) & 1}
    if still:
        raise SimulationFailure(f"the dead node's chunks {sorted(still)} were not reclaimed",
                                seed)
    return pool


@pytest.mark.sim
def test_alloc_and_free_from_any_node_under_every_seed():
    for seed in seeds(SEEDS):
        run_alloc(seed)


@pytest.mark.sim
def test_a_node_that_crashes_mid_alloc_leaves_a_consistent_reclaimable_pool():
    for seed in seeds(SEEDS):
        rng = random.Random(seed)
        run_alloc(seed, crash=(rng.randint(1, 2), rng.randint(20, 2000)))


def run_ring(seed, count=40, chaos=0.3):
    """A sender pushes offsets through its free ring while the receiver
    drains it when `FreeRing.pending` names it: every offset arrives once,
    in order."""
    pool = _sim_pool(seed, 2, chaos)
    received, sent = [], list(range(4096, 4096 + 8 * count, 8))
    handles = [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
               for node, host in enumerate(pool.hosts)]

    def sender(host):
        ring = FreeRing(host, handles[0].alloc_layout, 0, 1)
        for offset in sent:
            while not ring.push(offset, 1):
                pool.clock.sleep(1e-5)

    def receiver(host):  # as `Allocator.drain`: only a ring `pending` names is drained
        ring = FreeRing(host, handles[1].alloc_layout, 0, 1)
        while len(received) < count:
            if FreeRing.pending(host, handles[1].alloc_layout, 1) == [0]:
                received.extend(ring.drain(1))
            pool.clock.sleep(1e-5)

    pool.run(sender, receiver)
    if received != sent:
        raise SimulationFailure(f"ring delivered {received[:6]}..., sent {sent[:6]}...", seed)


@pytest.mark.sim
def test_free_ring_delivers_every_offset_once_under_every_seed():
    for seed in seeds(SEEDS):
        run_ring(seed)
        if seed < 20:  # no chaos: nothing rescues a line left stale or unflushed
            run_ring(seed, chaos=0.0)


def run_ring_idle_receiver(seed):
    """The receiver drains once and then only waits: the sender must see
    the space it freed (its tail reached memory without another drain), at
    its first look after the drain returned, though it read the tail of the
    full ring before (R4: that line is dropped and fenced before it is read
    again, not one look late)."""
    from tract.alloc import RING_SLOTS
    pool = _sim_pool(seed, 2, chaos=0.0)
    handles = [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
               for node, host in enumerate(pool.hosts)]
    drained, sent = [], []

    def sender(host):
        ring = FreeRing(host, handles[0].alloc_layout, 0, 1)
        for offset in range(4096, 4096 + 8 * RING_SLOTS, 8):
            assert ring.push(offset, 1)
        assert not ring.push(1 << 20, 1)  # full: its tail is in this host's cache now
        # the hardware may complete a drop early and prefetch the line back (as it was)
        host.complete_early(ring.tail_line, LINE)
        sent.append(True)
        while not drained:
            pool.clock.sleep(1e-5)
        if not ring.push(1 << 20, 1):
            raise AssertionError("the drained ring did not show its free space to the sender")

    def receiver(host):
        ring = FreeRing(host, handles[1].alloc_layout, 0, 1)
        while not sent:
            pool.clock.sleep(1e-5)
        drained.extend(ring.drain(1))
        pool.clock.sleep(1.0)  # idle: no more drains

    pool.run(sender, receiver)
    assert len(drained) == RING_SLOTS


@pytest.mark.sim
def test_a_drained_ring_shows_its_space_without_another_drain():
    for seed in seeds(max(1, SEEDS // 20)):
        run_ring_idle_receiver(seed)


def _crash_run(after, seed, phase="all"):
    """Node 1 allocates and frees runs of chunks, dying after ``after``
    operations (counted from the start, or from the first free when
    ``phase`` is "free"); returns whether it died."""
    pool = _sim_pool(seed, 2, chaos=1.0)
    if phase == "all":
        pool.crash(1, after)

    def body(host):
        handle = Pool(host, 1, clock=pool.clock, heartbeat=False, local_locks=False)
        first = handle.allocator.alloc_chunks(3)
        second = handle.allocator.alloc_chunks(2)
        if phase == "free":
            pool.crash(1, after)
        handle.allocator.free_chunks(first)
        handle.allocator.free_chunks(second)

    results = pool.run((1, body))
    _check_crash_consistent(pool, Pool(pool.hosts[0], 0, clock=pool.clock, heartbeat=False,
                                       local_locks=False))
    return results[0] == CRASHED


@pytest.mark.sim
def test_a_crash_at_any_point_leaves_every_taken_chunk_owned():
    """Every crash point of an alloc/free sequence, with queued flushes
    completing early at random (chaos 1.0): a taken chunk always has its
    owner record, so fsck can attribute it."""
    for seed in seeds(max(1, SEEDS // 100)):
        after = 0
        while _crash_run(after, seed):
            after += 1
        assert after > 50
    for seed in seeds(max(1, SEEDS // 25)):  # the free path alone, more seeds
        after = 0
        while _crash_run(after, seed, "free"):
            after += 1


@pytest.mark.sim
def test_reclaim_reads_owner_records_fresh():
    """A node whose cache still holds a dead node's owner record for a chunk
    that a live node has since taken must not reclaim it."""
    pool = _sim_pool(0, 3, chaos=0.0)
    handles = [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
               for node, host in enumerate(pool.hosts)]
    taken = []

    def steps(host):
        chunk = handles[2].allocator.alloc_chunks(1)
        handles[2].leave()  # node 2 is gone for good; its chunk is reclaimable
        handles[0].allocator.owner_fresh(chunk)  # node 0 caches node 2's record
        handles[1].allocator.reclaim()
        taken.append(handles[1].allocator.alloc_chunks(handles[1].header.nchunks))
        handles[0].allocator.reclaim()  # must see node 1's fresh record

    pool.run((0, steps))
    bits = _memory_words(pool, handles[0].alloc_layout.bitmap, 1)
    assert taken == [0] and int(bits[0]) == (1 << handles[0].header.nchunks) - 1


@pytest.mark.sim
def test_an_eviction_reads_its_payloads_owner_records_fresh():
    """Node 0's cache still holds the owner records of free chunks that
    node 1 has since taken for the payloads of two entries; node 0 evicts
    the entries and must free both payloads (`payload_owners` reads the
    records fresh, R4), else they would stay taken with nothing naming
    them."""
    pool = _sim_pool(0, 2, chaos=0.0, locks=("alloc", "objects", "index"))
    handles = [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
               for node, host in enumerate(pool.hosts)]
    allocator, nchunks = handles[0].allocator, handles[0].header.nchunks
    evicted = []

    def steps(host):
        for chunk in range(nchunks):
            allocator.owner_fresh(chunk)  # node 0 caches every record: all free
        keys = np.array([[1, 0], [2, 0]], dtype=np.uint64)
        writer = handles[1].index
        assert all(writer.publish(writer.reserve(keys, 8192)))
        evicted.append(handles[0].index.evict(2, window=64))

    pool.run((0, steps))
    bits = _memory_words(pool, handles[0].alloc_layout.bitmap, 1)
    assert evicted == [2] and int(bits[0]) == 0


@pytest.mark.sim
def test_the_chunk_check_reads_fresh_and_its_repairs_are_published():
    """`Allocator.check` on node 1 sees the cursor and an owner record that
    node 0 changed after node 1 cached them (R4); the repairs node 1 makes
    are in memory for node 0 without a lock's release (R3)."""
    from tract.alloc import SLAB

    pool = _sim_pool(0, 2, chaos=0.0)
    handles = [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
               for node, host in enumerate(pool.hosts)]
    layout, nchunks = handles[0].alloc_layout, handles[0].header.nchunks
    seen = {}

    def steps(host):
        checker, writer = handles[1], pool.hosts[0]
        seen["before"] = checker.allocator.check({}, set())  # node 1 caches every line
        checker.region.fence()  # and holds no invalidate still queued from that check
        writer.store_u64(layout.cursor_line, nchunks + 3)
        writer.store_u64(layout.owner(2), 1 | SLAB << 16)  # node 0's slab, on a free chunk
        writer.flush(layout.cursor_line, LINE)
        writer.flush(layout.owner(2), OWNER_BYTES)
        writer.fence()
        seen["after"] = checker.allocator.check({}, set())
        seen["repairs"], seen["memory"] = [], []
        for finding in seen["after"][1]:  # node 0 reads each repair before the next is made
            seen["repairs"].append(finding.repair())
            writer.invalidate(finding.offset, 8)
            writer.fence()
            seen["memory"].append(writer.load_u64(finding.offset))

    pool.run((0, steps))
    counts, found = seen["before"]
    assert found == [] and counts["free"] == counts["total"] == nchunks
    counts, found = seen["after"]
    assert [(finding.area, finding.offset, finding.text) for finding in found] == [
        ("allocator", layout.cursor_line,
         f"cursor {nchunks + 3} is past the last chunk ({nchunks - 1})"),
        ("allocator", layout.owner(2),
         "chunk 2 is free in the bitmap but its owner record says slab of node 0")]
    assert seen["repairs"] == [f"set offset {layout.cursor_line} to 0",
                               "cleared the owner record of chunk 2"]
    assert seen["memory"] == [0, 0]
    assert pool.stale_reads == [] and pool.lost_updates == []


# ------------------------------------------------------------- native runs

def _create(path, size=8 << 20, chunk=1 << 16, **options):
    Pool.create(path, size, chunk_size=chunk, max_nodes=4,
                lease_timeout=options.pop("lease_timeout", 0.5), **options)


def test_sizes_alignment_and_classes(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        chunk, heap = pool.header.chunk_size, pool.header.heap
        taken = []
        for size in (1, 4096, 4097, 8192, 20000, chunk // 2, chunk // 2 + 1, chunk, 3 * chunk):
            offset = pool.alloc(size)
            assert heap <= offset and offset + size <= pool.header.heap_end
            block = 4096
            while block < size and block < chunk:
                block *= 2
            assert offset % min(block, chunk) == 0
            taken.append((offset, size))
        taken.sort()
        for (a, size_a), (b, _) in zip(taken, taken[1:]):
            assert a + size_a <= b, "allocations overlap"
        for offset, _ in taken:
            pool.free(offset)
        pool.allocator.trim()
        report = fsck(pool_path, watch=False)
        assert report["ok"] and report["chunks"]["free"] == pool.header.nchunks


def test_alloc_many_gives_what_as_many_allocs_would(pool_path):
    """A batch of slab blocks (across slabs, and past the last free one, when
    a slab is added) or of chunk runs: distinct, aligned, in the heap, all
    given back by `free`; a batch that cannot be had whole gives back what
    it took."""
    _create(pool_path, size=4 << 20)
    with Pool.open(pool_path, 0, manager=True) as pool:
        chunk = pool.header.chunk_size
        per_slab = chunk // 8192
        assert pool.alloc_many(5000, 0) == []
        with pytest.raises(ValueError, match="must not be negative"):
            pool.alloc_many(5000, -1)
        with pytest.raises(ValueError, match="must be positive"):
            pool.alloc_many(0, 2)
        first = pool.alloc(5000)  # a slab with per_slab - 1 blocks left
        batches = [pool.alloc_many(5000, 3 * per_slab), pool.alloc_many(chunk + 1, 2)]
        spans = [(first, 8192)] + [(o, 8192) for o in batches[0]] + \
            [(o, 2 * chunk) for o in batches[1]]
        assert len(spans) == 1 + 3 * per_slab + 2
        spans.sort()
        for (a, size), (b, _) in zip(spans, spans[1:]):
            assert a + size <= b, "allocations overlap"
        assert all(o % 8192 == 0 and pool.header.heap <= o < pool.header.heap_end
                   for o in batches[0])
        free_before = fsck(pool_path, watch=False)["chunks"]["free"]
        with pytest.raises(PoolFull):
            pool.alloc_many(chunk, pool.header.nchunks)
        assert fsck(pool_path, watch=False)["chunks"]["free"] == free_before
        for offset in [first] + batches[0] + batches[1]:
            pool.free(offset)
        pool.allocator.trim()
        report = fsck(pool_path, watch=False)
        assert report["ok"] and report["chunks"]["free"] == pool.header.nchunks


def test_bad_frees_are_refused_and_lose_nothing(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        small, big = pool.alloc(100), pool.alloc(200_000)
        with pytest.raises(ValueError, match="outside the heap"):
            pool.free(64)
        with pytest.raises(ValueError, match="inside a 4096-byte block"):
            pool.free(small + 8)
        with pytest.raises(ValueError, match="not the start of an allocation"):
            pool.free(big + pool.header.chunk_size)
        pool.free(small)
        with pytest.raises(ValueError, match="already free"):
            pool.free(small)
        pool.free(big)
        with pytest.raises(ValueError, match="not the start of an allocation"):
            pool.free(big)
        assert fsck(pool_path, watch=False)["ok"]


def test_a_free_naming_its_owner_spares_a_reallocated_extent(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        allocator = pool.allocator
        first = allocator.alloc_chunks(2)
        current = allocator.owner_fresh(first)
        # what a freer holds when the extent it was handed went to a reclaim and
        # then to another allocation: a record of another epoch, or another process
        for stale in (current._replace(epoch=current.epoch + 1),
                      current._replace(pid=current.pid + 1)):
            with pytest.raises(ValueError, match="no longer holds the allocation"):
                allocator.free_chunks(first, owner=stale)
            assert allocator.owner_fresh(first) == current  # untouched
        assert allocator.free_chunks(first, owner=current) == 2
        with pytest.raises(ValueError, match="does not start an extent"):
            allocator.free_chunks(first, owner=current)
        assert fsck(pool_path, watch=False)["ok"]


def test_a_remote_free_queued_for_a_dead_incarnation_is_dropped(pool_path):
    """What a sender queued for a node's last incarnation never reaches the
    next one: those slabs went with it, and their chunks may be slabs of
    the new incarnation again, whose blocks the stale free would free."""
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        ring = FreeRing(pool.region, pool.alloc_layout, 1, 0)
        old, new = pool.epoch - 1, pool.epoch
        assert ring.push(pool.header.heap + 4096, old)
        assert ring.push(pool.header.heap + 8192, new)
        # the tag is the epoch's low 16 bits: 65536 incarnations apart look alike
        assert ring.push(pool.header.heap + 12288, new + (1 << 16))
        assert ring.drain(new) == [pool.header.heap + 8192, pool.header.heap + 12288]
        assert ring.drain(new) == []
        with pytest.raises(ValueError, match="does not fit a free-ring entry"):
            ring.push(1 << 48, new)


def test_pool_full_is_clear_and_harmless(pool_path):
    _create(pool_path, size=2 << 20)
    with Pool.open(pool_path, 0, manager=True) as pool:
        total = pool.header.nchunks
        first = pool.alloc(total * pool.header.chunk_size)
        with pytest.raises(PoolFull, match=r"no run of 1 free chunks .* 0 of \d+ chunks free"):
            pool.alloc(10)
        with pytest.raises(PoolFull, match="requested; the pool has"):
            pool.allocator.alloc_chunks(total + 1)
        pool.free(first)
        assert pool.alloc(10) > 0
        assert fsck(pool_path, watch=False)["ok"]


def test_a_block_freed_by_another_node_returns_to_its_heap(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as first, Pool.open(pool_path, 1) as second:
        offsets = [first.alloc(4096) for _ in range(5)]
        for offset in offsets:
            second.free(offset)  # a block of node 0's slab: queued in ring 1 -> 0
        assert first.allocator.drain() == 5
        (chunk, size, used), = first.allocator.heap.slabs()
        assert size == 4096 and used == []
        with pytest.raises(ValueError, match="already free"):
            first.free(offsets[0])


def test_chunks_of_a_node_that_left_are_reclaimed_when_space_runs_out(pool_path):
    _create(pool_path, size=2 << 20)
    with Pool.open(pool_path, 0, manager=True) as pool:
        total, chunk = pool.header.nchunks, pool.header.chunk_size
        with Pool.open(pool_path, 1) as gone:
            kept = gone.alloc(chunk)
            gone.objects.put("kept", kept, chunk)  # referenced: it outlives its owner
            gone.alloc((total - 1) * chunk)
            with pytest.raises(PoolFull):
                pool.alloc(4096)  # node 1 is alive: its chunks stay
            gone.leave()
        assert pool.alloc((total - 1) * chunk) > 0  # reclaimed on the slow path
        with pytest.raises(PoolFull):
            pool.alloc(4096)  # all but the referenced chunk
        assert pool.objects.get("kept").offset == kept
        report = fsck(pool_path, watch=False)
        assert report["ok"] and report["chunks"]["referenced"] == 1


class AllocMachine(RuleBasedStateMachine):
    """Random alloc/free from two nodes against a model: nothing overlaps,
    everything stays in the heap, and at the end fsck is clean."""

    path = None

    def __init__(self):
        super().__init__()
        self.pools = [Pool.open(self.path, 0, manager=True), Pool.open(self.path, 1)]
        self.live: dict[int, tuple[int, int]] = {}  # offset -> (size, node)

    @rule(node=st.integers(0, 1), size=st.one_of(st.integers(1, 70_000),
                                                 st.integers(60_000, 300_000)))
    def alloc(self, node, size):
        try:
            offset = self.pools[node].alloc(size)
        except PoolFull:
            return
        self.live[offset] = (size, node)

    @precondition(lambda self: self.live)
    @rule(node=st.integers(0, 1), pick=st.integers(0, 10**6))
    def free(self, node, pick):
        offset = sorted(self.live)[pick % len(self.live)]
        del self.live[offset]
        self.pools[node].free(offset)

    @invariant()
    def nothing_overlaps(self):
        header = self.pools[0].header
        ranges = sorted((offset, size) for offset, (size, _) in self.live.items())
        for (a, size), (b, _) in zip(ranges, ranges[1:]):
            assert a + size <= b
        for offset, size in ranges:
            assert header.heap <= offset and offset + size <= header.heap_end

    def teardown(self):
        for offset in list(self.live):
            self.pools[0].free(offset)
        for pool in self.pools:
            pool.allocator.drain()
            pool.allocator.trim()
        report = fsck(self.path, watch=False)
        for pool in self.pools:
            pool.close()
        assert report["ok"], report["problems"]
        assert report["chunks"]["free"] == report["chunks"]["total"]


def test_random_alloc_and_free_match_the_model(pool_path):
    _create(pool_path, size=4 << 20)
    AllocMachine.path = pool_path
    machine = AllocMachine.TestCase()
    machine.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)
    machine.runTest()


def _churn(path, node, seed, rounds, results):
    rng = random.Random(seed)
    with Pool.open(path, node) as pool:
        mine = []
        for step in range(rounds):
            if mine and (rng.random() < 0.45 or len(mine) > 12):
                offset, size, stamp = mine.pop(rng.randrange(len(mine)))
                if pool.region.read(offset, 8) != stamp or pool.region.read(
                        offset + size - 8, 8) != stamp:
                    raise AssertionError(f"allocation at {offset} was overwritten")
                pool.free(offset)
            else:
                size = rng.choice([16, 4096, 9000, 40_000, 70_000, 200_000])
                offset = pool.alloc(size, timeout=30)
                stamp = f"{os.getpid():06d}{step:02d}"[-8:].encode()
                pool.region.copy_in(offset, stamp, nontemporal=False)
                pool.region.copy_in(offset + max(size, 16) - 8, stamp, nontemporal=False)
                mine.append((offset, max(size, 16), stamp))
        for offset, _, _ in mine:
            pool.free(offset)
        time.sleep(0.3)  # let the other nodes' heartbeats drain the rings
        pool.allocator.drain()
        pool.allocator.trim()
    results.put(node)


@pytest.mark.multiprocess
def test_processes_on_several_nodes_never_share_memory(pool_path):
    _create(pool_path, size=32 << 20)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_churn, args=(pool_path, node, seed, 150, results))
               for seed, node in enumerate([0, 0, 1, 1])]
    with Pool.open(pool_path, 2, manager=True):  # the lock manager outlives the workers
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
            assert worker.exitcode == 0
    report = fsck(pool_path, watch=False)
    assert report["ok"], report["problems"]
    assert report["chunks"]["free"] == report["chunks"]["total"]


def _allocate_forever(path, node, ready):
    """Allocate and free without end (at most 40 live allocations), so a
    kill lands in the middle of one."""
    with Pool.open(path, node) as pool:
        rng = random.Random(node)
        live, count = [], 0
        while True:
            live.append(pool.alloc(rng.choice([4096, 30_000, 100_000]), timeout=30))
            if len(live) > 40:
                pool.free(live.pop(rng.randrange(len(live))), timeout=30)
            count += 1
            if count == 20:
                ready.set()


@pytest.mark.multiprocess
def test_killed_allocators_are_reclaimed_by_fsck(pool_path):
    """kill -9 one process mid-alloc, then both processes of another node:
    the survivor keeps allocating, and fsck --repair returns everything."""
    _create(pool_path, size=64 << 20, lease_timeout=0.5)
    context = multiprocessing.get_context("spawn")
    with Pool.open(pool_path, 0, manager=True) as survivor:
        ready = [context.Event() for _ in range(3)]
        victims = [context.Process(target=_allocate_forever, args=(pool_path, node, event),
                                   daemon=True)
                   for node, event in zip([2, 1, 1], ready)]
        for victim in victims:
            victim.start()
        try:
            for event in ready:
                assert event.wait(60)
            os.kill(victims[0].pid, signal.SIGKILL)  # one process, its node stays alive
            kept = [survivor.alloc(50_000, timeout=10) for _ in range(10)]
            for victim in victims[1:]:  # a whole node
                os.kill(victim.pid, signal.SIGKILL)
            kept += [survivor.alloc(50_000, timeout=10) for _ in range(10)]
        finally:  # killed however the test went: none allocates on
            for victim in victims:
                if victim.is_alive():
                    victim.kill()
                victim.join(30)
        survivor.objects.put("kept", kept[0], 50_000)
        report = fsck(pool_path, repair=True, node=3)
        assert report["ok"], report["problems"]
        assert report["repaired"], "nothing was reclaimed"
        for offset in kept:
            survivor.free(offset)
        survivor.objects.delete("kept")
        survivor.allocator.trim()
        after = fsck(pool_path, watch=False)
        assert after["ok"], after["problems"]
        assert after["chunks"]["free"] == after["chunks"]["total"]


def test_owner_records_are_range_checked(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        first = pool.allocator.alloc_chunks(2)
        line = pool.alloc_layout.owner(first)
        pool.region.store_u64(line + 16, 10**6)  # a run that does not fit
        pool.region.flush(line, 64)
        pool.region.fence()
        with pytest.raises(Exception, match="does not fit"):
            pool.allocator.free_chunks(first)
        report = fsck(pool_path, watch=False)
        assert not report["ok"]
        assert any("does not fit" in p["problem"] for p in report["problems"])


def test_a_bad_remote_free_is_set_aside_not_raised(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as first, Pool.open(pool_path, 1) as second:
        offset = first.alloc(4096)
        second.free(offset)
        second.free(offset)  # a double free, queued before anyone can tell
        assert first.allocator.drain() == 1
        assert first.allocator.rejected and "already free" in first.allocator.rejected[0]


def _owners_of(pool, offsets):
    """The pool's owner record of each offset's chunk (read fresh), or of
    the slab/extent head it lies in."""
    allocator = pool.allocator
    return [allocator.owner_fresh(allocator.chunk_of(offset)) for offset in offsets]


def test_a_node_whose_slabs_were_reclaimed_never_allocates_from_them(pool_path):
    """Node 2's heap lists slabs the pool gave to node 1 while node 2 was
    judged gone (its lease lapsed, a process of it stalled): a process
    joining node 2's incarnation forgets them before it carves a block."""
    _create(pool_path)
    with Pool.open(pool_path, 1, manager=True) as other, Pool.open(pool_path, 2) as stalled:
        blocks = [stalled.alloc(4096) for _ in range(40)]
        slabs = sorted({stalled.allocator.chunk_of(offset) for offset in blocks})
        stalled.allocator.heap.free(blocks[0])  # a free block in a slab the pool will reclaim
        with other.lock("alloc"):  # what the reclaim of a lapsed node does to its slabs
            for chunk in slabs:
                other.allocator._release(chunk, 1)
        taken = [other.allocator.alloc_chunks(1) for _ in slabs]  # node 1's now
        with Pool.open(pool_path, 2) as rejoined:  # the same incarnation: the heap is kept
            assert rejoined.epoch == stalled.epoch
            assert rejoined.allocator.heap.slabs() == []
            fresh = [rejoined.alloc(4096) for _ in range(40)]
            assert not {rejoined.allocator.chunk_of(offset) for offset in fresh} & set(taken)
            for owner in _owners_of(rejoined, fresh):
                assert (owner.kind, owner.node, owner.epoch) == (1, 2, rejoined.epoch)


def test_a_node_that_left_reopens_on_a_fresh_heap_clear_of_other_owners(pool_path):
    _create(pool_path, size=4 << 20)
    with Pool.open(pool_path, 1, manager=True) as other:
        with Pool.open(pool_path, 2) as node2:
            kept = [node2.alloc(4096) for _ in range(100)]
            node2.objects.put("kept", kept[0], 4096)  # one block stays referenced
            before = node2.epoch
        # node 2 closed cleanly (it left): node 1 takes all the room it needs
        extents = []
        with pytest.raises(PoolFull):
            while True:
                extents.append(other.alloc(other.header.chunk_size))
        with Pool.open(pool_path, 2) as node2:
            assert node2.epoch == before + 1
            for offset in extents[:4]:
                other.free(offset)
            fresh = [node2.alloc(4096) for _ in range(30)]
            owners = _owners_of(node2, fresh)
            assert all((o.kind, o.node, o.epoch) == (1, 2, node2.epoch) for o in owners)
            assert fsck(pool_path, watch=False)["problems"] == []
        other.objects.delete("kept")


def _store_and_die(path, node, ready):
    with Pool.open(path, node) as pool:
        pool.objects.put("from-the-dead", pool.alloc(4096), 4096)
        [pool.alloc(size) for size in (4096, 8192, 4096, 100_000)]  # referenced by nothing
        ready.set()
        time.sleep(600)


@pytest.mark.multiprocess
@pytest.mark.parametrize("node", [2, 1], ids=["a-whole-node", "one-process-of-a-live-node"])
def test_after_a_kill_fsck_reports_reclaimable_and_the_allocator_takes_it_back(pool_path, node):
    """A killed process's memory is reclaimable, not a problem: its
    extents, and its node's slabs (a whole node) or its blocks in its
    live node's slabs (one process).  Under pressure the allocator takes
    every byte back by itself (dead blocks of a live node's slab after two
    looks a lease apart), with no repair."""
    _create(pool_path, size=4 << 20, lease_timeout=0.3)
    context = multiprocessing.get_context("fork")
    with Pool.open(pool_path, 1, manager=True) as survivor:
        ready = context.Event()
        victim = context.Process(target=_store_and_die, args=(pool_path, node, ready))
        victim.start()
        assert ready.wait(60)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(30)
        survivor.objects.delete("from-the-dead")
        survivor.space.liveness.live(2)  # the survivor starts watching node 2's heartbeat
        report = fsck(pool_path)  # watches the heartbeats for a lease first
        assert report["ok"] and report["problems"] == [], report["problems"]
        areas = {entry["area"] for entry in report["reclaimable"]}
        assert areas == ({"allocator"} if node == 2 else {"allocator", "node heap"}), \
            report["reclaimable"]
        # under pressure, with no repair, every byte comes back
        extents = []
        for _ in range(3):  # a dead process's blocks go at the second look
            with pytest.raises(PoolFull):
                while True:
                    extents.append(survivor.alloc(survivor.header.chunk_size))
            survivor.clock.sleep(2 * survivor.header.lease_timeout)
        assert len(extents) == survivor.header.nchunks  # the dead's slabs and extents too
        for offset in extents:
            survivor.free(offset)
        survivor.allocator.trim()
        after = fsck(pool_path)
        assert after["ok"] and after["reclaimable"] == [], after
        assert after["chunks"]["free"] == after["chunks"]["total"]


def _alloc_and_exit(pool_path, sender):
    with Pool.open(pool_path, 0) as pool:
        sender.send(pool.alloc(4096))
        os._exit(0)  # dies holding the block, as a killed process does


def _a_dead_process_block(pool_path) -> tuple[int, int]:
    """(offset, pid) of a block a process of node 0 took and died holding."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_alloc_and_exit, args=(pool_path, sender))
    child.start()
    assert receiver.poll(60)
    offset = receiver.recv()
    child.join(60)
    return offset, child.pid


def test_a_dropped_reference_to_a_block_reclaimed_meanwhile_frees_nothing(pool_path):
    """An eviction frees a payload after its tombstone is in memory.  A
    block a killed process of this node held may be reclaimed in between
    (`reclaim_dead_blocks`) and even be given out again: `free_of` then
    frees nothing, neither a double free nor the new holder's block."""
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        allocator = pool.allocator
        kept = pool.alloc(4096)  # the slab stays this node's
        offset, pid = _a_dead_process_block(pool_path)
        owner, = allocator.payload_owners([offset])  # read while the reference stood
        assert owner.pid == pid
        # the reclaim gives the dead process's block back, and it is given out again
        assert allocator.heap.release_blocks([(offset, pid)]) == 1
        assert allocator.free_of(offset, owner) is False  # free already
        assert pool.alloc(4096) == offset
        assert allocator.free_of(offset, owner) is False  # another holder's now
        assert allocator.heap.holder(offset) == os.getpid()
        pool.free(offset)
        with pytest.raises(ValueError, match="already free"):
            pool.free(offset)  # a plain free of a free block still fails loudly
        assert allocator.free_of(kept, *allocator.payload_owners([kept])) is True
        assert allocator.heap.holder(kept) == 0



class _CountedHeap:
    """A node heap whose walks (`slabs`) are counted."""

    def __init__(self, heap):
        self.heap, self.walks = heap, 0

    def slabs(self):
        self.walks += 1
        return self.heap.slabs()

    def __getattr__(self, name):
        return getattr(self.heap, name)


def test_the_heap_is_walked_for_dead_blocks_only_after_a_process_or_a_node_changed(pool_path):
    """`reclaim_dead_blocks` reads every block of the node's heap, and a
    full pool asks it at each allocation: it walks only when something
    that can leave a block to a dead process and to no reference changed
    since a walk that left nothing to wait for (a process of the node
    came, went or died; a node's lease changed).  A process that dies
    holding a block it never published is such a change: the next look
    sees the block, the one a lease later gives it back."""
    _create(pool_path, lease_timeout=1.5)  # a stall of a lease would change the live nodes
    with Pool.open(pool_path, 0, manager=True) as pool:
        allocator = pool.allocator
        heap = allocator.heap = _CountedHeap(allocator.heap)
        lease = pool.header.lease_timeout
        pool.alloc(4096)
        pool.clock.sleep(lease / 3)
        assert allocator.reclaim_dead_blocks() == 0 and heap.walks == 1  # nothing dead
        pool.clock.sleep(lease / 3)
        assert allocator.reclaim_dead_blocks() == 0 and heap.walks == 1  # nothing changed
        offset, pid = _a_dead_process_block(pool_path)
        pool.clock.sleep(lease / 3)
        assert allocator.reclaim_dead_blocks() == 0 and heap.walks == 2  # seen once
        assert heap.holder(offset) == pid
        pool.clock.sleep(lease * 1.1)
        assert allocator.reclaim_dead_blocks() == 1 and heap.walks == 3  # a lease later
        assert heap.holder(offset) == 0
        pool.clock.sleep(lease / 3)
        assert allocator.reclaim_dead_blocks() == 0 and heap.walks == 3


def _free_each(path, offsets, done):
    """A process of node 0 that frees blocks of node 1's slabs (pushes)."""
    with Pool.open(path, 0) as pool:
        for offset in offsets:
            pool.free(offset, timeout=30)
    done.put([])


def _drain_until(path, stop, done):
    """A process of node 1 that drains its rings in a loop until ``stop``."""
    with Pool.open(path, 1) as pool:
        while not stop.is_set():
            pool.allocator.drain()
        done.put(list(pool.allocator.rejected))


@pytest.mark.multiprocess
def test_a_nodes_processes_share_its_free_rings_one_at_a_time(pool_path):
    """Two processes of node 0 free blocks of node 1's slabs while three
    processes of node 1 (and their heartbeats) drain: every block comes back
    exactly once (R2: one writer at a time for each end of a ring).  A block
    drained twice is refused as already free; a push lost leaves it used."""
    _create(pool_path, size=32 << 20, lease_timeout=2.0)
    context = multiprocessing.get_context("spawn")
    with Pool.open(pool_path, 2, manager=True), Pool.open(pool_path, 1) as owner:
        offsets = [owner.alloc(64) for _ in range(1500)]
        stop, done = context.Event(), context.Queue()
        workers = [context.Process(target=_free_each, args=(pool_path, offsets[i::2], done))
                   for i in range(2)]
        workers += [context.Process(target=_drain_until, args=(pool_path, stop, done))
                    for _ in range(2)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 120
        while any(used for _, _, used in owner.allocator.heap.slabs()):
            owner.allocator.drain()
            assert time.monotonic() < deadline, "blocks freed by node 0 never came back"
        stop.set()
        rejected = [text for _ in workers for text in done.get(timeout=60)]
        for worker in workers:
            worker.join(30)
            assert worker.exitcode == 0
        assert rejected + owner.allocator.rejected == []
