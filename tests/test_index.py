"""The prefix index: its probe kernels against their twins, the protocol
under the non-coherent simulator (readers, writers and evictors on
different hosts), and natively: a model check, several processes on several
nodes, bad input.

Tests marked ``sim`` are the suite the mutation harness runs against every
mutant of tract.index (TRACT_SIM_SEEDS sets the seeds).
"""

import multiprocessing
import os
import random
import time
import zlib

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import naive
from simnodes import heartbeat
from tract._kernels import probe
from tract.errors import CorruptionError, LeaseLost, PoolFull
from tract.fsck import fsck
from tract.hashing import BlockHasher
from tract.pool import Pool, format_pool
from tract.testing.incoherent import CRASHED, LINE, SimPool, SimulationFailure
from tract.testing.seeds import count, seeds

SEEDS = count()
SIM_LEASE = 0.004


# ------------------------------------------------------- kernels vs twins

def _random_window(rng, keys, width, nodes, among=None):
    """Entries around ``keys``: empty, other keys, the key (or one of
    ``among``) in every state, torn lines, writers alive or dead."""
    lines = np.zeros((len(keys), width, 8), dtype=np.uint64)
    for k, key in enumerate(keys):
        for w in range(width):
            kind = rng.random()
            if kind < 0.2:
                continue  # empty
            entry = np.zeros(8, dtype=np.uint64)
            if among is not None:
                key = among[rng.randrange(len(among))]
            entry[:2] = key if rng.random() < 0.4 else (rng.getrandbits(64), rng.getrandbits(64))
            entry[2] = rng.randrange(1, 9)
            state = rng.choice([probe.EMPTY, probe.WRITING, probe.READY, probe.EVICTING,
                                probe.TOMBSTONE, 7])
            entry[3] = state | (rng.randrange(nodes + 1) + 1) << 8 | \
                rng.choice([0, 0, 1, 2, 5]) << 24 | rng.randrange(50) << 40
            entry[6] = rng.randrange(1, 4)
            entry[7] = naive.entry_check(entry)
            if rng.random() < 0.1:
                entry[rng.randrange(7)] ^= np.uint64(1 << rng.randrange(64))  # torn
            lines[k, w] = entry
    return lines


def test_probe_kernels_match_their_twins():
    rng = random.Random(3)
    for _ in range(300):
        count, width, nodes = rng.randint(1, 6), rng.randint(1, 6), 3
        keys = np.array([[rng.randrange(4), rng.randrange(2)] for _ in range(count)],
                        dtype=np.uint64)
        lines = _random_window(rng, keys, width, nodes)
        for row in lines.reshape(-1, 8):
            if row.any():
                assert int(probe.entry_check(row)) == naive.entry_check(row) or \
                    int(row[7]) != naive.entry_check(row)
        codes, where = np.empty(count, np.int64), np.empty(count, np.int64)
        reaches = np.array([rng.choice([0, 1, 3, naive.UNKNOWN]) for _ in range(count)])
        scanned = rng.choice([0, 2])
        probe.probe_lookup(keys, lines, reaches, scanned, codes, where)
        assert list(zip(codes.tolist(), where.tolist())) == \
            naive.probe_lookup(keys, lines, reaches.tolist(), scanned)
        # the reserve kernel sees one table: a slot holds the same entry in every window
        mask = rng.choice([7, 15])
        table = _random_window(rng, keys[:1], mask + 1, nodes, among=keys)[0]
        start = np.array([rng.randrange(mask + 1) for _ in range(count)], dtype=np.int64)
        widths = np.array([rng.randint(1, mask + 1) for _ in range(count)], dtype=np.int64)
        table_lines = table[(start[:, None] + np.arange(mask + 1)) & mask]
        live = np.array([rng.choice([1, 2, 2**64 - 1]) for _ in range(nodes)], dtype=np.uint64)
        codes[:] = naive.CONTINUE
        probe.probe_reserve(keys, table_lines, start, mask, widths, live,
                            np.ones(count, np.bool_), codes, where)
        assert list(zip(codes.tolist(), where.tolist())) == \
            naive.probe_reserve(keys, table_lines, start, mask, widths, live)
        # called again with some windows grown: as if every key were decided again
        grown = np.array([rng.random() < 0.5 for _ in range(count)])
        widths[grown] = np.minimum(widths[grown] + rng.randint(1, 3), mask + 1)
        probe.probe_reserve(keys, table_lines, start, mask, widths, live, grown, codes, where)
        assert list(zip(codes.tolist(), where.tolist())) == \
            naive.probe_reserve(keys, table_lines, start, mask, widths, live)
        low, high = rng.choice([(0, 1 << 20), (4096, 8192)])
        payloads = table.copy()
        payloads[:, 4:6] = [[rng.choice([0, 4096, 8000, 1 << 63, 2**64 - 64]),
                             rng.choice([0, 1, 192, 4096, 1 << 63, 2**64 - 1])]
                            for _ in range(mask + 1)]
        assert probe.outside(payloads, low, high) == naive.outside(payloads, low, high)
        found = np.empty(mask + 1, np.int64)
        probe.reach(table, found)
        assert found.tolist() == [naive.reach(entry) for entry in table]
        count = rng.randint(1, mask + 1)
        first = rng.randrange(mask + 1)
        probe.reaches(table, count, mask, first, found)
        assert found[:count].tolist() == naive.reaches(table, count, mask, first)
        run = rng.choice([2, 4])  # eviction's windows, each with lines after it
        extras = np.array([rng.randrange(mask + 2 - run) for _ in range((mask + 1) // run)])
        rotated = [table[(w * run + np.arange(run + extra)) & mask]
                   for w, extra in enumerate(extras)]
        tails = np.concatenate([lines[run:] for lines in rotated]).reshape(-1, 8)
        probe.window_reaches(table, tails, extras, run, mask, np.arange(mask + 1), found)
        assert found.tolist() == sum((naive.reaches(lines, run, mask, w * run)
                                      for w, lines in enumerate(rotated)), [])
        slots = np.array(rng.sample(range(mask + 1), count), dtype=np.int64)
        homes = table[(keys[:, 0].astype(np.int64) & mask)][np.arange(count) % len(keys)]
        batch = keys[np.arange(count) % len(keys)]
        reaches = np.array([rng.randrange(4) for _ in range(count)], dtype=np.int64)
        want = naive.raise_reaches(batch, slots, homes, mask, reaches.tolist())
        raised_slots, raised = np.empty(count, np.int64), np.empty((count, 8), np.uint64)
        n = probe.raise_reaches(batch, slots, homes, mask, reaches, raised_slots, raised)
        assert (reaches.tolist(), {int(slot): (int(line[3]) >> 24) & 0xFFFF
                                   for slot, line in zip(raised_slots[:n], raised[:n])}) == want
        for slot, line in zip(raised_slots[:n], raised[:n]):  # the home line, but for its reach
            assert (line ^ table[slot]).tolist() == [0, 0, 0, int(line[3] ^ table[slot][3])
                                                     & 0xFFFF << 24, 0, 0, 0, 0]



def _sealed(key, state, reach=0, writer=0, epoch=1):
    """A whole entry of ``key`` (two words) in ``state``, its slot's
    ``reach``, written by node ``writer`` in ``epoch``."""
    entry = np.zeros(8, dtype=np.uint64)
    entry[:2] = key
    entry[2] = 1
    entry[3] = state | (writer + 1) << 8 | reach << 24 | 16 << 40
    entry[4:7] = 4096, 64, epoch
    entry[7] = naive.entry_check(entry)
    return entry


def test_probe_kernels_stay_inside_their_arrays_at_the_edges():
    """R5 bounds of the kernels on values read from the pool, each at its
    edge, with the memory just past the array holding what a weakened
    bound would act on (Numba does not check indexes)."""
    # a reach that ends exactly where the lines do: the recorded reach, no line past them
    padded = np.zeros((5, 8), dtype=np.uint64)
    padded[2] = _sealed((5, 0), probe.TOMBSTONE, reach=2)
    padded[3] = _sealed((2, 0), probe.READY)  # homed at slot 2, one past it
    found = np.empty(4, np.int64)
    probe.reaches(padded[:4], 4, 7, 0, found)
    assert found.tolist() == naive.reaches(padded[:4], 4, 7, 0) == [0, 0, 2, 0]
    # a writer one past the last node: dead (its slot reusable), whatever lies past the epochs
    epochs = np.array([1, 1, 1, 9], dtype=np.uint64)
    window = _sealed((3, 4), probe.WRITING, writer=3, epoch=9).reshape(1, 1, 8)
    keys, start = np.array([[3, 4]], dtype=np.uint64), np.array([3], np.int64)
    codes, where = np.full(1, probe.CONTINUE, np.int64), np.empty(1, np.int64)
    probe.probe_reserve(keys, window, start, 7, np.ones(1, np.int64), epochs[:3],
                        np.ones(1, np.bool_), codes, where)
    assert list(zip(codes.tolist(), where.tolist())) == \
        naive.probe_reserve(keys, window, start, 7, [1], epochs[:3]) == [(probe.FREE, 0)]
    # a payload that ends at the heap's end, or one byte past it, or starts one byte before it
    low, high = 4096, 8192
    for offset, length, inside in [(low, high - low, True), (low, high - low + 1, False),
                                   (8000, 192, True), (8000, 193, False), (high - 1, 1, True),
                                   (high, 1, False), (low - 1, 1, False), (low, 0, False),
                                   (2**64 - 64, 128, False), (low, 2**64 - 1, False)]:
        payload = np.zeros((1, 8), dtype=np.uint64)
        payload[0, 4:6] = offset, length
        assert probe.outside(payload, low, high) == naive.outside(payload, low, high) == \
            (-1 if inside else 0), (offset, length)
    # a home's reach wider than the table: the window stops at the table's size
    for reach, want in [(5, 6), (naive.UNKNOWN - 1, 8), (naive.UNKNOWN, 4)]:
        lines = _sealed((1, 0), probe.READY, reach=reach).reshape(1, 1, 8)
        targets = np.empty(1, np.int64)
        assert probe.next_widths(lines, np.array([2]), np.array([0]), 1, 8, targets) == want
        assert targets.tolist() == [want]


# ----------------------------------------------------------- simulator runs

def _payload(key, length):
    """A payload that names its key and carries its checksum."""
    head = int(key[0]).to_bytes(8, "little") + int(key[1]).to_bytes(8, "little")
    body = (head * (length // 16 + 1))[:length - 16]
    return head + bytes(b ^ 0x5A for b in body)


def _write_payloads(region, reserved, streaming=True):
    """Each reservation's payload (naming its key) copied in, streaming or
    by plain stores and flushes left for `publish` to fence; their checksums."""
    sums = []
    for r in reserved:
        if r is None:
            sums.append(0)
            continue
        data = _payload(r.key, r.length)
        region.copy_in(r.offset, data, nontemporal=streaming)
        if not streaming:
            region.flush(r.offset, r.length, payload=True)
        sums.append(zlib.crc32(data))
    return sums


def _sim_pool(seed, nodes, chaos, capacity=16, lease=SIM_LEASE):
    pool = SimPool(192 * 1024, hosts=nodes, seed=seed, chaos=chaos, max_steps=1_500_000)
    format_pool(pool.hosts[0], max_nodes=nodes, locks=("alloc", "objects", "index"),
                max_locks=3, chunk_size=8192, max_objects=4, index_capacity=capacity,
                lock_mode="bakery", lease_timeout=lease, hash_key=pool.hash_key)
    for host in pool.hosts:
        host.invalidate(0, pool.size)
        host.fence()
    return pool


def run_index(seed, chaos=0.2, rounds=5):
    """Node 0 writes chains of blocks (payloads that name their key), node 1
    pins and reads them, node 2 evicts.  No hit is ever another key's
    payload, no payload is freed while pinned, and at the end every READY
    entry is visible to another host, unpinned and evictable."""
    pool = _sim_pool(seed, 3, chaos)
    rng = random.Random(seed)
    keys = np.array([[rng.getrandbits(64), rng.getrandbits(64)] for _ in range(12)],
                    dtype=np.uint64)
    chains = [keys[i:i + 3] for i in range(0, 12, 3)]
    handles, finished = {}, [False] * 3
    pinned: dict[int, int] = {}  # payload offset -> pins held by the reader
    counts = {"published": 0, "evicted": 0, "hits": 0}

    def open_handle(host, node):
        handle = Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
        handles[node] = handle
        return handle

    def writer(host):
        handle = open_handle(host, 0)
        for _ in range(rounds):
            chain = chains[rng.randrange(len(chains))]
            try:
                reserved = handle.index.reserve(chain, 256, tokens=16, timeout=100 * SIM_LEASE)
            except PoolFull:
                continue
            sums = _write_payloads(host, reserved, streaming=False)  # publish's lock fences
            counts["published"] += sum(handle.index.publish(reserved, sums,
                                                            timeout=100 * SIM_LEASE))
        finished[0] = True

    def reader(host):
        handle = open_handle(host, 1)
        for _ in range(rounds * 2):
            chain = chains[rng.randrange(len(chains))]
            hits = handle.index.pin(chain)
            for hit in hits:
                pinned[hit.offset] = pinned.get(hit.offset, 0) + 1
            for hit, key in zip(hits, chain):
                assert hit.key == (int(key[0]), int(key[1]))
                host.invalidate(hit.offset, hit.length, payload=True)
                host.fence()
                data = host.read(hit.offset, hit.length)
                if data != _payload(key, hit.length) or zlib.crc32(data) != hit.checksum:
                    raise SimulationFailure(f"slot {hit.slot}: payload at {hit.offset} is not "
                                            f"key {hit.key}'s", seed)
                counts["hits"] += 1
            for hit in hits:
                pinned[hit.offset] -= 1
            handle.index.unpin(hits)
            pool.clock.sleep(SIM_LEASE / 20)
        finished[1] = True

    def evictor(host):
        handle = open_handle(host, 2)
        real_free = handle.pool_free = handle.allocator.free

        def checked_free(offset, timeout=None):
            if pinned.get(offset):
                raise SimulationFailure(f"payload at {offset} freed while pinned", seed)
            real_free(offset, timeout)
        handle.allocator.free = checked_free
        while not (finished[0] and finished[1]):
            counts["evicted"] += handle.index.evict(2, window=16, timeout=100 * SIM_LEASE)
            pool.clock.sleep(SIM_LEASE / 10)
        # the end: everything READY is seen from here, and nothing is pinned
        ready = handle.index.stats()["ready"]
        if ready != counts["published"] - counts["evicted"]:
            raise SimulationFailure(f"{ready} READY entries seen; {counts['published']} "
                                    f"published, {counts['evicted']} evicted", seed)
        while ready:
            gone = handle.index.evict(16, window=16, timeout=100 * SIM_LEASE)
            if not gone:
                raise SimulationFailure(f"{ready} READY entries left that nobody pins can "
                                        f"not be evicted", seed)
            ready -= gone
        finished[2] = True

    pool.run((0, writer), (1, reader), (2, evictor),
             *[(node, heartbeat(pool, handles, finished, node, SIM_LEASE / 4))
               for node in range(3)])
    if pool.lost_updates:
        raise SimulationFailure(f"lost update at {pool.lost_updates[0].line_offset}", seed)
    return counts


def run_dekker(first):
    """A pin and an eviction of one block, interleaved where it hurts: the
    ``first`` side's drop of the lines it checks completes at once (as a
    prefetch may) and the other side runs whole right then.  Each side must
    fence its own write before it drops those lines, or the pinned block is
    evicted."""
    pool = _sim_pool(0, 3, chaos=0.0, lease=1.0)
    handles = [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
               for node, host in enumerate(pool.hosts)]
    writer, reader, evictor = (handle.index for handle in handles)
    key = np.array([[5, 7]], dtype=np.uint64)
    outcome = {}
    host = pool.hosts[1 if first == "reader" else 2]
    trigger = "local_add_u32s" if first == "reader" else "scatter_lines"
    armed = []

    def arming(*args):
        armed.append(True)
        return getattr(type(host), trigger)(host, *args)

    def invalidate_lines(offsets, payload=False):
        type(host).invalidate_lines(host, offsets, payload)
        if armed and armed.pop():
            for offset in offsets:
                host.complete_early(int(offset), LINE)
            if first == "reader":
                outcome["evicted"] = evictor.evict(1, window=evictor.capacity)
            else:
                outcome["hits"] = reader.pin(key)

    setattr(host, trigger, arming)
    host.invalidate_lines = invalidate_lines

    def steps(_):
        writer.publish(writer.reserve(key, 64))
        if first == "reader":
            outcome["hits"] = reader.pin(key)
        else:
            outcome["evicted"] = evictor.evict(1, window=evictor.capacity)
        if len(outcome["hits"]) and outcome["evicted"]:
            raise SimulationFailure(f"{first} first: a pinned block was evicted", 0)

    pool.run((0, steps))
    return outcome


@pytest.mark.sim
def test_a_new_incarnation_forgets_the_last_ones_pins_for_every_host():
    """Node 1's last incarnation left pins and stamps; its next zeroes them
    in memory (R3) for host 0, which had read them, before taking part."""
    pool = _sim_pool(0, 2, chaos=0.0)
    handles = [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
               for node, host in enumerate(pool.hosts)]
    index = handles[1].index
    pins, length = index.node_base + index.node_bytes, index.node_bytes
    seen = {}

    def steps(host):
        other, node = pool.hosts[0], pool.hosts[1]
        node.fill(pins, length, 0x11)  # the last incarnation's pins and stamps
        node.flush(pins, length)
        node.fence()
        other.invalidate(pins, length)
        other.fence()
        seen["before"] = other.read(pins, length)  # host 0 keeps them cached
        index.forget_node(1)
        other.invalidate(pins, length)
        other.fence()
        seen["after"] = other.read(pins, length)

    pool.run((0, steps))
    assert seen["before"] == b"\x11" * length and seen["after"] == bytes(length)
    assert pool.stale_reads == [] and pool.lost_updates == []


@pytest.mark.sim
@pytest.mark.parametrize("first", ["reader", "evictor"])
def test_pin_and_evict_each_fence_their_write_before_they_check(first):
    outcome = run_dekker(first)
    assert len(outcome["hits"]) + outcome["evicted"] == 1  # one of them won


def run_reach_crash(phase):
    """Keys 0..3 share home slot 3 and land in slots 3..6, each batch
    staler than the one before.  The writer dies right after the entry of
    key 2 reaches memory (``phase`` "raise": the reserve raised the home's
    reach, in another line, just before), or right after the home's
    lowered reach does (``phase`` "lower": eviction took key 3, the
    stalest, just before).  Either way no entry in memory lies past its
    home's reach: a raise is fenced before the entries it covers, a
    lowering after the tombstones it counts."""
    pool = _sim_pool(0, 2, chaos=0.0)
    keys = np.array([[3 + 16 * i, i] for i in range(4)], dtype=np.uint64)
    host = pool.hosts[0]
    index = Pool(host, 0, clock=pool.clock, heartbeat=False, local_locks=False).index
    stamps = iter([3, 2, 1])
    index.stamp = lambda: next(stamps)
    trigger = {"raise": 5, "lower": 3}[phase]
    armed = [phase == "raise"]
    flush_lines = host.flush_lines

    def flush_then_die(offsets):
        flush_lines(offsets)
        line = index.base + trigger * 64
        if armed[0] and line in np.asarray(offsets).tolist():
            host.complete_early(line, 64)  # this line lands, queued ones wait
            pool.crash(0, 0)

    host.flush_lines = flush_then_die

    def writer(host):
        for batch in (keys[:2], keys[2:3], keys[3:]):
            index.publish(index.reserve(batch, 64, timeout=100 * SIM_LEASE))
        armed[0] = True
        index.evict(1, window=16, timeout=100 * SIM_LEASE)

    assert pool.run((0, writer))[0] == CRASHED
    checker = Pool(pool.hosts[1], 1, clock=pool.clock, heartbeat=False, local_locks=False)
    return checker.index.short_reaches()


@pytest.mark.sim
@pytest.mark.parametrize("phase", ["raise", "lower"])
def test_reaches_cover_every_entry_when_a_writer_dies(phase):
    assert run_reach_crash(phase) == []


def run_pin_race(seed, rounds=12):
    """One reader pins and unpins a block while an evictor keeps trying to
    evict it, with every queued flush and prefetch at random (chaos 1.0):
    the evictor never takes it while it is pinned."""
    pool = _sim_pool(seed, 3, chaos=1.0)
    handles, finished = {}, [False] * 3
    key = np.array([[5, 7]], dtype=np.uint64)
    pinned = [0]

    def writer(host):
        handle = handles[0] = Pool(host, 0, clock=pool.clock, heartbeat=False, local_locks=False)
        for _ in range(rounds):
            handle.index.publish(handle.index.reserve(key, 64, timeout=100 * SIM_LEASE))
            pool.clock.sleep(SIM_LEASE / 8)
        finished[0] = True

    def reader(host):
        handle = handles[1] = Pool(host, 1, clock=pool.clock, heartbeat=False, local_locks=False)
        for _ in range(rounds * 2):
            hits = handle.index.pin(key)
            pinned[0] += len(hits)
            pool.clock.sleep(SIM_LEASE / 20)
            pinned[0] -= len(hits)
            handle.index.unpin(hits)
        finished[1] = True

    def evictor(host):
        handle = handles[2] = Pool(host, 2, clock=pool.clock, heartbeat=False, local_locks=False)
        real_free = handle.allocator.free

        def checked_free(offset, timeout=None):
            if pinned[0]:
                raise SimulationFailure(f"payload at {offset} freed while pinned", seed)
            real_free(offset, timeout)
        handle.allocator.free = checked_free
        while not (finished[0] and finished[1]):
            handle.index.evict(1, window=16, timeout=100 * SIM_LEASE)
        finished[2] = True

    pool.run((0, writer), (1, reader), (2, evictor),
             *[(node, heartbeat(pool, handles, finished, node, SIM_LEASE / 4))
               for node in range(3)])


@pytest.mark.sim
def test_a_pinned_block_is_never_evicted_under_every_seed():
    for seed in seeds(max(1, SEEDS // 4)):
        run_pin_race(seed)


def run_recency(seed):
    """Node 0 publishes A then B, then C and D; node 1 reads C.  An evictor
    on node 2 must see every node's stamps: it takes A, then B and D.  Slots
    are chosen so that a stamp it misses changes its choice."""
    pool = _sim_pool(seed, 3, chaos=0.0)
    handles = [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
               for node, host in enumerate(pool.hosts)]
    ticks = iter(range(1, 100))
    for handle in handles:
        handle.index.stamp = lambda: next(ticks)
    last = handles[0].index.capacity - 1
    key = {name: np.array([[slot, ord(name)]], dtype=np.uint64)
           for name, slot in (("A", last), ("B", 0), ("C", last - 1), ("D", 1))}
    writer, reader, evictor = (handle.index for handle in handles)

    def evict(count, expect_gone):
        assert evictor.evict(count, window=last + 1) == count
        gone = {name for name in key if evictor.lookup(key[name]) == 0}
        if gone != expect_gone:
            raise SimulationFailure(f"the evictor took {sorted(gone)}, not "
                                    f"{sorted(expect_gone)}: it missed an access stamp", seed)

    def steps(host):
        for name in "AB":
            writer.publish(writer.reserve(key[name], 64))
        evict(1, {"A", "C", "D"})
        for name in "CD":
            writer.publish(writer.reserve(key[name], 64))
        reader.unpin(reader.pin(key["C"]))
        evict(2, {"A", "B", "D"})

    pool.run((0, steps))


@pytest.mark.sim
def test_evictors_see_every_nodes_access_stamps():
    for seed in seeds(max(1, SEEDS // 50)):
        run_recency(seed)


@pytest.mark.sim
def test_readers_writers_and_evictors_under_every_seed():
    totals = {"published": 0, "evicted": 0, "hits": 0}
    for seed in seeds(SEEDS):
        for name, value in run_index(seed).items():
            totals[name] += value
    assert totals["hits"] > SEEDS and totals["evicted"] > SEEDS // 2, totals


# ------------------------------------------------------------- native runs

def _create(path, size=16 << 20, capacity=256, **options):
    Pool.create(path, size, chunk_size=1 << 16, max_nodes=4, index_capacity=capacity,
                lease_timeout=options.pop("lease_timeout", 0.5), **options)


def _publish(pool, keys, size=4096):
    reserved = pool.index.reserve(keys, size, tokens=16)
    return reserved, pool.index.publish(reserved, _write_payloads(pool.region, reserved))


def test_a_full_pool_makes_room_in_a_sparse_table(pool_path):
    """A pool whose heap fills long before its (large) table: each reserve
    that finds no memory evicts, widening its sample of slots until one
    holds an entry to evict, and never reports the pool full."""
    _create(pool_path, size=4 << 20, capacity=4096)
    with Pool.open(pool_path, 0, manager=True) as pool:
        rng = np.random.default_rng(5)
        stored = 0
        for _ in range(120):  # about 8 times what the heap holds
            keys = rng.integers(0, 2**63, size=(8, 2), dtype=np.uint64)
            _, published = _publish(pool, keys, size=32 << 10)
            stored += sum(published)
        assert stored == 120 * 8
        assert fsck(pool_path, watch=False)["ok"]


def test_the_payloads_the_reclaim_keeps_are_the_ones_scan_names(pool_path):
    """`Index.referenced` (arrays, for the allocator's reclaim) names
    exactly the payloads `scan` (fsck's, entry by entry) names: the live
    entries' (writing, ready, evicting), none of a tombstone, a torn entry
    or an entry whose payload lies outside the heap, before it or past its
    end (R5)."""
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        index = pool.index
        keys = np.random.default_rng(3).integers(0, 2**63, size=(12, 2), dtype=np.uint64)
        _publish(pool, keys[:8])
        index.reserve(keys[8:], 4096, tokens=16)  # writing
        index.remove(keys[:2])  # tombstones
        live = [slot for slot, state, _, _ in index.scan() if state == "ready"]
        outside, torn = np.array(live[:2]), live[2]
        entry = index._read(index._entries(outside)).copy()
        entry[0, 4] = np.uint64(64)  # a payload in the header
        entry[1, 4] = np.uint64(index.heap[1] + 4096)  # a payload past the heap's end
        index._write(outside, entry)  # sealed whole
        pool.region.store_u64(index.entry_offset(torn) + 8 * 4, 12345)  # check word broken
        pool.region.fence()
        scanned = sorted(payload for _, _, payload, _ in index.scan() if payload is not None)
        assert sorted(map(tuple, index.referenced().tolist())) == scanned
        assert len(scanned) == 6 + 4 - 3  # the live ones less the two outside and the torn
        assert index.referenced().dtype == np.int64


def _slab_owners(pool):
    """(node, epoch, adopted tag) -> chunks, of every slab chunk, fresh."""
    allocator, found = pool.allocator, {}
    for chunk in range(allocator.nchunks):
        owner = allocator.owner_fresh(chunk)
        if owner.kind == 1:  # a slab
            found.setdefault((owner.node, owner.epoch, owner.adopted), []).append(chunk)
    return found


@pytest.mark.parametrize("after", ["another node", "the same node restarted"])
def test_the_memory_of_a_node_that_left_flows_to_the_node_that_stores(pool_path, after):
    """Node 0 fills the pool with blocks (4 per slab) and closes: its slabs
    stay, every block referenced.  Then another node, or node 0 again as a
    new incarnation, stores as much again: each eviction of a gone
    incarnation's block adopts its slab, one record per chunk, so the block
    is the storing node's to allocate at once; every store succeeds, the
    whole index is read for references at the change of standing and by
    the heartbeat's sweep of adopted blocks (not at each allocation while
    the gone node's memory is referenced), and the pool ends
    with every slab the storing node's (adopted ones tagged with the gone
    owner), fsck clean."""
    from tract.alloc import adoption_tag, Owner
    _create(pool_path, size=4 << 20, capacity=1024)
    rng = np.random.default_rng(11)
    with Pool.open(pool_path, 0, manager=True) as first:
        gone = first.epoch
        while True:
            keys = rng.integers(0, 2**63, size=(8, 2), dtype=np.uint64)
            before = first.counters().get(0, {}).get("evictions", 0)
            _publish(first, keys, size=16 << 10)
            if first.counters()[0].get("evictions", 0) > before:
                break  # full
        full = _slab_owners(first)
    assert list(full) == [(0, gone, 0)]
    node = 1 if after == "another node" else 0
    with Pool.open(pool_path, node, manager=True) as pool:
        scans = []  # reads of every reference (the whole index): a referrer sees each
        pool.allocator.add_referrer(lambda: scans.append(1) or [])
        start = time.monotonic()
        for _ in range(2 * len(full[(0, gone, 0)])):
            keys = rng.integers(0, 2**63, size=(8, 2), dtype=np.uint64)
            _, published = _publish(pool, keys, size=16 << 10)
            assert all(published)
        # the walks at the change of standing, and the heartbeat's sweep of the
        # adopted blocks (every 4 leases): not one per store
        sweeps = (time.monotonic() - start) / (4 * pool.header.lease_timeout)
        assert len(scans) <= 2 + int(sweeps) + 1, (scans, sweeps)
        slabs = _slab_owners(pool)
        tag = adoption_tag(Owner(0, 1, 0, gone, 1))
        assert set(slabs) <= {(node, pool.epoch, 0), (node, pool.epoch, tag)}, slabs
        assert len(slabs.get((node, pool.epoch, tag), [])) > len(full[(0, gone, 0)]) // 2
        heap = {chunk for chunk, _, _ in pool.allocator.heap.slabs()}
        assert heap == {chunk for chunks in slabs.values() for chunk in chunks}
    assert fsck(pool_path, watch=False)["ok"]


def _fill_and_wait(path, ready):
    with Pool.open(path, 0, manager=True) as pool:
        rng = np.random.default_rng(12)
        while not pool.counters().get(0, {}).get("evictions"):
            _publish(pool, rng.integers(0, 2**63, size=(8, 2), dtype=np.uint64), size=16 << 10)
        ready.set()
        time.sleep(600)  # killed here


@pytest.mark.multiprocess
def test_the_memory_of_a_killed_node_flows_once_its_lease_lapses(pool_path):
    """Node 0 fills the pool and is killed (no leave: it stays ALIVE in the
    table until its lease lapses).  Node 1's first evictions queue their
    frees on node 0's ring, which nobody drains; when the ring is full the
    free waits until node 0 is judged gone, then adopts the slab: every
    store of node 1 publishes, and its slabs are adopted ones."""
    from tract.alloc import Owner, adoption_tag
    _create(pool_path, size=4 << 20, capacity=1024, lease_timeout=0.3)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=_fill_and_wait, args=(pool_path, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(60)
        with Pool.observe(pool_path) as peek:
            _, gone, _ = peek.nodes.read(0)
        os.kill(child.pid, 9)
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
    rng = np.random.default_rng(13)
    with Pool.open(pool_path, 1, manager=True) as pool:
        for _ in range(40):  # 320 blocks: more than the pool holds (about 250)
            _, published = _publish(pool, rng.integers(0, 2**63, size=(8, 2), dtype=np.uint64),
                                    size=16 << 10)
            assert all(published)
        tag = adoption_tag(Owner(0, 1, 0, gone, 1))
        assert _slab_owners(pool).get((1, pool.epoch, tag))
    assert fsck(pool_path, watch=False)["ok"]


def test_a_block_free_when_its_slab_was_adopted_comes_back_two_looks_later(pool_path):
    """Node 0 stores 4 blocks (one slab), removes one (free in its heap)
    and closes.  Node 1 removes a second: it adopts the slab, every block
    held (ADOPTED) but the one it freed.  The block that was free at the
    adoption is referenced by nothing: the adopted blocks' sweep gives it
    back at its second look a lease after the first, never the two still
    referenced."""
    from tract._native._nodeheap import ADOPTED
    _create(pool_path, size=4 << 20, capacity=256, lease_timeout=0.2)
    keys = np.arange(8, dtype=np.uint64).reshape(4, 2) + np.uint64(1)
    with Pool.open(pool_path, 0, manager=True) as first:
        reserved, _ = _publish(first, keys, size=16 << 10)
        offsets = [int(r.offset) for r in reserved]
        assert len({offset // (64 << 10) for offset in offsets}) == 1  # one slab
        assert first.index.remove(keys[:1]).all()
    with Pool.open(pool_path, 1, manager=True) as pool:
        assert pool.index.remove(keys[1:2]).all()
        heap = pool.allocator.heap
        assert [heap.holder(offset) for offset in offsets] == [ADOPTED, 0, ADOPTED, ADOPTED]
        pool.allocator.reclaim_dead_blocks(adopted=True)
        time.sleep(0.25)
        pool.allocator.reclaim_dead_blocks(adopted=True)
        assert [heap.holder(offset) for offset in offsets] == [0, 0, ADOPTED, ADOPTED]
        assert pool.index.lookup(keys[2:]) == 2
    assert fsck(pool_path, watch=False)["ok"]


def _read_hits(pool, hits, keys):
    for hit, key in zip(hits, keys):
        assert hit.key == (int(key[0]), int(key[1]))
        pool.region.invalidate(hit.offset, hit.length, payload=True)
        pool.region.fence()
        data = pool.region.read(hit.offset, hit.length)
        assert data == _payload(key, hit.length) and zlib.crc32(data) == hit.checksum


def test_publish_lookup_pin_and_unpin(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        hasher = BlockHasher(pool.header.hash_key, 16, namespace="test-model")
        tokens = np.arange(16 * 40, dtype=np.int32)
        keys = hasher(tokens)
        assert pool.index.lookup(keys) == 0
        reserved, published = _publish(pool, keys[:30])
        assert all(r is not None for r in reserved) and all(published)
        assert pool.index.lookup(keys) == 30
        assert pool.index.lookup(keys[5:]) == 25
        assert pool.index.present(keys).tolist() == [True] * 30 + [False] * 10
        assert pool.index.lookup(hasher(tokens + 1)) == 0
        hits = pool.index.pin(keys)
        assert len(hits) == 30 and [h.tokens for h in hits] == [16] * 30
        _read_hits(pool, hits, keys)
        assert (hits.keys == keys[:30]).all()  # the arrays say what each `Hit` says
        assert hits.checksums.dtype == np.uint64 and \
            hits.checksums.tolist() == [hit.checksum for hit in hits]
        assert hits.offsets.tolist() == [hit.offset for hit in hits]
        again = pool.index.pin(keys[:3])
        pool.index.unpin(hits)
        pool.index.unpin(again)
        with pytest.raises(ValueError, match="had not pinned"):
            pool.index.unpin(again)
        reserved, published = _publish(pool, np.vstack([keys[:2], keys[30:32], keys[30:31]]))
        assert [r is None for r in reserved] == [True, True, False, False, True]
        assert published == [False, False, True, True, False]
        assert pool.index.lookup(keys) == 32
        assert pool.index.stats()["ready"] == 32
        pool.index.remove(keys[3:5])
        assert pool.index.lookup(keys) == 3  # a chain stops at the first miss; present does not
        assert pool.index.present(keys).tolist() == \
            [True] * 3 + [False] * 2 + [True] * 27 + [False] * 8
        assert fsck(pool_path, watch=False)["ok"]


def test_abort_and_reclaimed_reservations_free_their_payloads(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        keys = BlockHasher(pool.header.hash_key, 4)(np.arange(40, dtype=np.int64))
        reserved = pool.index.reserve(keys, 100_000)
        assert pool.index.lookup(keys) == 0  # WRITING is not a hit
        pool.index.abort(reserved[:5])
        assert pool.index.stats()["tombstone"] == 5
        # a reservation reclaimed meanwhile (as if this node's lease had lapsed)
        with pool.lock("index")(5):
            pool.index.clear(reserved[5].slot)
        published = pool.index.publish(reserved[5:], [0] * 5)
        assert published == [False, True, True, True, True]
        assert pool.index.lookup(keys[6:]) == 4
        report = fsck(pool_path, watch=False)
        assert report["ok"], report["problems"]


def test_eviction_spares_pinned_entries_and_frees_payloads(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        keys = BlockHasher(pool.header.hash_key, 8)(np.arange(8 * 20, dtype=np.int32))
        _publish(pool, keys, size=70_000)  # whole chunks: frees are visible in the bitmap
        hits = pool.index.pin(keys[:8])
        assert pool.index.evict(100, window=256) == 12
        assert pool.index.lookup(keys) == 8
        _read_hits(pool, hits, keys)
        pool.index.unpin(hits)
        assert pool.index.evict(100, window=256) == 8
        assert pool.index.stats()["ready"] == 0
        report = fsck(pool_path, watch=False)
        assert report["ok"] and report["chunks"]["referenced"] == 0, report


def test_remove_takes_only_the_named_unpinned_entries(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        keys = BlockHasher(pool.header.hash_key, 8)(np.arange(8 * 10, dtype=np.int32))
        _publish(pool, keys, size=70_000)
        hits = pool.index.pin(keys[2:3])
        absent = BlockHasher(pool.header.hash_key, 8)(np.arange(8, dtype=np.int32) + 1)
        removed = pool.index.remove(np.vstack([keys[:4], absent]))
        assert removed.tolist() == [True, True, False, True, False]
        assert [pool.index.lookup(k[None]) for k in keys[:5]] == [0, 0, 1, 0, 1]
        _read_hits(pool, hits, keys[2:3])
        pool.index.unpin(hits)
        assert pool.index.remove(keys[2:3]).tolist() == [True]
        assert pool.index.stats()["ready"] == 6
        report = fsck(pool_path, watch=False)
        assert report["ok"] and report["chunks"]["referenced"] == 2 * 6, report  # two chunks each


def test_allocation_pressure_evicts_the_stalest(pool_path):
    _create(pool_path, size=4 << 20)
    with Pool.open(pool_path, 0, manager=True) as pool:
        stamps = iter(range(1, 10**6))
        pool.index.stamp = lambda: next(stamps)
        hasher = BlockHasher(pool.header.hash_key, 4)
        chunks = pool.header.nchunks
        first = hasher(np.arange(4 * 4, dtype=np.int32))
        _publish(pool, first, size=1 << 16)
        pool.index.unpin(pool.index.pin(first[:2]))  # the two first ones are fresh
        more = hasher(np.arange(4 * chunks, dtype=np.int32) + 10**6)
        for key in more:  # far more than fits: older entries make room
            _publish(pool, key[None], size=1 << 16)
        assert pool.index.lookup(more[-1:]) == 1
        assert pool.index.stats()["ready"] <= chunks
        pinned = pool.index.pin(more[-1:])
        while pool.index.evict(64, window=256):
            pass
        with pytest.raises(PoolFull):
            pool.index.reserve(hasher(np.arange(4 * 2 * chunks, dtype=np.int32) + 10**7),
                               1 << 16)
        pool.index.unpin(pinned)


def test_a_multi_chunk_block_evicts_one_run_in_a_fragmented_heap(pool_path):
    """A heap full of one-chunk payloads whose stalest entries lie every
    other chunk: a two-chunk payload evicts the two entries of one run
    (the stalest run), not a sample of stale entries scattered over the
    heap that frees no run, and a run held by a pinned entry is never
    chosen."""
    _create(pool_path, size=4 << 20)
    with Pool.open(pool_path, 0, manager=True) as pool:
        stamps = iter(range(1, 10**6))
        pool.index.stamp = lambda: next(stamps)
        hasher = BlockHasher(pool.header.hash_key, 4)
        chunk, nchunks = pool.header.chunk_size, pool.header.nchunks
        at = {}  # chunk -> the key whose payload it holds
        for key in hasher(np.arange(4 * nchunks, dtype=np.int32)):
            reserved, _ = _publish(pool, key[None], size=chunk)
            at[pool.allocator.chunk_of(reserved[0].offset)] = key[None]
        assert sorted(at) == list(range(nchunks)) and pool.allocator.taken_chunks().all()
        for first in range(1, nchunks, 2):  # odd chunks fresher, oldest first
            pool.index.unpin(pool.index.pin(at[first]))
        pinned = pool.index.pin(at[1])  # the stalest run holds a pin
        reserved, published = _publish(pool, hasher(np.arange(4, dtype=np.int32) + 10**6),
                                       size=2 * chunk)
        assert published == [True]
        first = pool.allocator.chunk_of(reserved[0].offset)
        gone = [c for c in range(nchunks) if pool.index.lookup(at[c]) == 0]
        assert first == 2 and gone == [2, 3], (first, gone)  # chunk 3 is the next stalest
        pool.index.unpin(pinned)
        report = fsck(pool_path, watch=False)
        assert report["ok"], report["problems"]


def test_a_full_index_evicts_then_says_so(pool_path):
    _create(pool_path, capacity=8)
    with Pool.open(pool_path, 0, manager=True) as pool:
        stamps = iter(range(1, 10**6))
        pool.index.stamp = lambda: next(stamps)
        keys = BlockHasher(pool.header.hash_key, 2)(np.arange(2 * 20, dtype=np.int32))
        for key in keys:
            _publish(pool, key[None], size=64)
        assert pool.index.stats()["ready"] == 8
        hits = pool.index.pin(keys[-8:])
        assert len(hits) == 8
        with pytest.raises(PoolFull, match="prefix index of 8 entries is full"):
            pool.index.reserve(keys[:1], 64)
        pool.index.unpin(hits)


def test_torn_and_corrupt_entries_are_never_hits(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        keys = BlockHasher(pool.header.hash_key, 4)(np.arange(12, dtype=np.int32))
        reserved, _ = _publish(pool, keys)
        offset = pool.index._entries(np.array([reserved[1].slot]))[0]
        pool.region.store_u64(int(offset) + 40, 12345)  # the length, check word not redone
        pool.region.flush(int(offset), 64)
        pool.region.fence()
        assert pool.index.lookup(keys) == 1
        assert pool.index.stats()["torn"] == 1
        entry = pool.index._read(pool.index._entries(np.array([reserved[2].slot]))).copy()
        entry[0, 4] = np.uint64(64)  # a payload offset inside the header, sealed
        with pool.lock("index")(5):
            pool.index._write(np.array([reserved[2].slot]), entry)
        with pytest.raises(CorruptionError, match="names payload .* outside the heap"):
            pool.index.pin(keys[2:])


def test_fsck_finds_and_raises_a_reach_that_falls_short(pool_path):
    """Keys sharing a home: the home's reach covers them; a reach lowered
    by hand is a problem fsck names and repairs; clearing a torn home
    measures its reach again."""
    _create(pool_path, capacity=64)
    with Pool.open(pool_path, 0, manager=True) as pool:
        index = pool.index
        keys = np.array([[5 + 64 * i, i] for i in range(4)], dtype=np.uint64)  # all homed at 5
        _publish(pool, keys)
        home = index._read(index._entries(np.array([5]))).copy()
        assert naive.reach(home[0]) == 3 and index.short_reaches() == []
        with pool.lock("index")(5):
            index._set_reach(home, np.array([1]))
            index._write(np.array([5]), home)
        assert index.short_reaches() == [(5, 1, 3)]
        assert index.lookup(keys) == 2  # past the reach: a miss, never a wrong hit
        report = fsck(pool_path, watch=False, repair=True, node=1)
        assert [p["problem"] for p in report["problems"]] == [
            "index slot 5 reaches 1 slots but an entry homed there lies 3 past it"]
        assert index.short_reaches() == [] and index.lookup(keys) == 4
        torn = index._read(index._entries(np.array([5]))).copy()
        torn[0, 7] ^= np.uint64(1)
        with pool.lock("index")(5):
            pool.region.scatter_lines(index._entries(np.array([5])), torn.view(np.uint8))
            index.clear(5)
        home = index._read(index._entries(np.array([5])))
        assert naive.reach(home[0]) == 3 and int(home[0, 3]) & 0xFF == probe.TOMBSTONE
        assert index.lookup(keys[1:]) == 3


def test_bad_input_is_refused(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        with pytest.raises(ValueError, match=r"\(n, 2\) uint64"):
            pool.index.lookup(np.zeros((3, 2), dtype=np.int64))
        with pytest.raises(ValueError, match=r"\(n, 2\) uint64"):
            pool.index.pin(np.zeros(4, dtype=np.uint64))
        with pytest.raises(ValueError, match="sizes must be positive"):
            pool.index.reserve(np.ones((2, 2), dtype=np.uint64), 0)


def test_a_new_incarnation_drops_its_pins(pool_path):
    _create(pool_path)
    keys = None
    with Pool.open(pool_path, 1, manager=True) as pool:
        keys = BlockHasher(pool.header.hash_key, 4)(np.arange(8, dtype=np.int32))
        _publish(pool, keys)
        pool.index.pin(keys)  # never unpinned: this incarnation ends with them
    with Pool.open(pool_path, 1, manager=True) as pool:
        assert pool.index.evict(8, window=256) == 2


class IndexModel(RuleBasedStateMachine):
    """Random publishes, pins, unpins, evictions and aborts, checked against
    a dict: key -> pins held.  A published key is found until it is evicted;
    a pinned key is never evicted."""

    def __init__(self):
        super().__init__()
        self.path = f"/dev/shm/tract-test-{os.getpid()}-model-{random.getrandbits(32):08x}"
        _create(self.path, size=8 << 20, capacity=64)
        self.pool = Pool.open(self.path, 0, manager=True)
        self.keys = BlockHasher(self.pool.header.hash_key, 2)(np.arange(2 * 24, dtype=np.int32))
        self.model: dict[int, int] = {}  # key index -> pins
        self.pins: list[tuple[int, object]] = []

    def teardown(self):
        self.pool.close()
        Pool.destroy(self.path)

    @rule(which=st.lists(st.integers(0, 23), min_size=1, max_size=6))
    def publish(self, which):
        reserved, published = _publish(self.pool, self.keys[which], size=1000)
        seen = set(self.model)
        for index, r, ok in zip(which, reserved, published):
            assert (r is None) == (index in seen) and ok == (r is not None)
            seen.add(index)
            if ok:
                self.model[index] = 0

    @rule(which=st.lists(st.integers(0, 23), min_size=1, max_size=6))
    def pin(self, which):
        hits = self.pool.index.pin(self.keys[which])
        expected = 0
        while expected < len(which) and which[expected] in self.model:
            expected += 1
        assert len(hits) == expected
        _read_hits(self.pool, hits, self.keys[which])
        for index, hit in zip(which, hits):
            self.model[index] += 1
            self.pins.append((index, hit))

    @rule(pick=st.integers(0, 1000))
    def unpin(self, pick):
        if self.pins:  # draws never depend on the pool (its hash key is random)
            index, hit = self.pins.pop(pick % len(self.pins))
            self.pool.index.unpin([hit])
            self.model[index] -= 1

    @rule(count=st.integers(1, 8))
    def evict(self, count):
        before = set(self.model)
        gone = self.pool.index.evict(count, window=64)
        still = {i for i in before if self.pool.index.lookup(self.keys[i][None]) == 1}
        assert len(before - still) == gone
        for index in before - still:
            assert self.model.pop(index) == 0, "a pinned entry was evicted"

    @rule(which=st.lists(st.integers(0, 23), min_size=1, max_size=6))
    def remove(self, which):
        removed = self.pool.index.remove(self.keys[which])
        expected = {index: self.model.get(index) == 0 for index in which}
        assert removed.tolist() == [expected[index] for index in which], (which, self.model)
        for index, gone in expected.items():
            if gone:
                del self.model[index]

    @invariant()
    def found(self):
        for index in self.model:
            assert self.pool.index.lookup(self.keys[index][None]) == 1


def test_random_operations_match_the_model():
    IndexModel.TestCase.settings = settings(max_examples=25, stateful_step_count=30,
                                            deadline=None)
    IndexModel.TestCase().runTest()


def _index_worker(path, node, seed, rounds, role, results, settled):
    """``rounds`` of the role's operation; a reader goes on until the
    writers and the evictor are done (``settled``), then does ``rounds``
    more, so it serves hits however the processes were scheduled."""
    rng = random.Random(seed)
    with Pool.open(path, node) as pool:
        keys = BlockHasher(pool.header.hash_key, 4)(np.arange(4 * 64, dtype=np.int32))
        served, done, after = 0, 0, 0
        while done < rounds or (role == "reader" and after < rounds):
            done += 1
            if role == "reader" and settled.is_set():
                after += 1
            chain = keys[rng.randrange(0, 48):][:rng.randint(1, 16)]
            if role == "writer":
                _publish(pool, chain, size=rng.choice([3000, 70_000]))
            elif role == "reader":
                hits = pool.index.pin(chain)
                _read_hits(pool, hits, chain)
                served += len(hits)
                pool.index.unpin(hits)
            else:
                pool.index.evict(rng.randint(1, 2), window=64)
        results.put((node, role, served))


@pytest.mark.multiprocess
def test_processes_on_several_nodes_read_only_their_keys(pool_path):
    _create(pool_path, size=12 << 20, capacity=128)
    context = multiprocessing.get_context("fork")
    with Pool.open(pool_path, 0, manager=True):
        results, settled = context.Queue(), context.Event()
        roles = [(1, "writer"), (2, "writer"), (2, "evictor"), (3, "reader"), (3, "reader"),
                 (1, "reader")]
        workers = [context.Process(target=_index_worker,
                                   args=(pool_path, node, seed, 60, role, results, settled),
                                   daemon=True)
                   for seed, (node, role) in enumerate(roles)]
        for worker in workers:
            worker.start()
        try:
            for count, worker in enumerate(workers, 1):
                worker.join(180)
                assert worker.exitcode == 0
                if count == 3:  # the writers and the evictor: the readers see a settled table
                    settled.set()
        finally:  # a failed worker leaves no reader waiting for ever
            for worker in workers:
                if worker.is_alive():
                    worker.kill()
                    worker.join()
        served = sum(results.get(timeout=5)[2] for _ in workers)
        assert served > 20
    report = fsck(pool_path, watch=False)
    assert report["ok"], report["problems"][:3]


def test_pins_held_counts_a_nodes_pins_until_they_are_taken_back(pool_path):
    Pool.create(pool_path, 16 << 20, max_nodes=2, index_capacity=256)
    with Pool.open(pool_path, 0, manager=True) as pool:
        keys = np.arange(1, 13, dtype=np.uint64).reshape(6, 2)
        pool.index.publish(pool.index.reserve(keys, 64))
        first, second = pool.index.pin(keys), pool.index.pin(keys[:2])
        assert (pool.index.pins_held(0), pool.index.pins_held(1)) == (8, 0)
        pool.index.unpin(first)
        assert pool.index.pins_held(0) == 2
        pool.index.unpin(second)
        assert pool.index.pins_held(0) == 0
        with pytest.raises(ValueError, match="beyond this pool's max_nodes"):
            pool.index.pins_held(2)


@pytest.mark.sim
def test_a_node_whose_lease_lapsed_pins_nothing():
    """Self-fencing (R6): a reader stalled past half its lease may have had
    its pins ignored by an evictor already; it pins nothing more (its pin
    words stay as they were) until it rejoins."""
    pool = _sim_pool(0, 2, chaos=0.0)
    handle = Pool(pool.hosts[0], 0, clock=pool.clock, heartbeat=False, local_locks=False,
                  fencing=True)
    index = handle.index
    keys = np.array([[5, 6], [7, 8]], dtype=np.uint64)
    reserved = index.reserve(keys, 256, tokens=4)
    index.publish(reserved)
    hits = index.pin(keys)
    assert len(hits) == 2
    index.unpin(hits)
    pool.clock.sleep(0.6 * SIM_LEASE)  # stalled
    words = pool.memory[index.node_base:index.node_base + index.node_bytes].copy()
    with pytest.raises(LeaseLost, match="does not write a pin"):
        index.pin(keys)
    assert np.array_equal(pool.memory[index.node_base:index.node_base + index.node_bytes], words)
    assert handle.renew() and len(index.pin(keys)) == 2
