"""The engine-agnostic connector: prefix reuse across processes and node
ids, misses for evicted or corrupt blocks, and P/D handoff with its TTL;
under the non-coherent simulator, handoffs between hosts (tests marked
``sim``: the mutation harness's suite for tract.connector)."""

import multiprocessing
import os
import time

import numpy as np
import pytest

from tract.connector import NO_OFFER, Connector, Taken
from tract.fsck import fsck
from tract.pool import Pool, format_pool
from tract.testing.incoherent import SimPool, SimulationFailure
from tract.transfer import KVLayout
from tract.testing.seeds import count, seeds

from simnodes import heartbeat

LAYOUT = KVLayout(model="tiny-llama", dtype="float16", num_layers=2, num_kv_heads=2,
                  head_size=16, block_size=4)


def _create(path):
    Pool.create(path, 32 << 20, chunk_size=1 << 16, max_nodes=4, lease_timeout=1.0,
                index_capacity=256)


def _tokens(seed, blocks):
    return np.random.default_rng(seed).integers(0, 32000, blocks * LAYOUT.block_size,
                                                dtype=np.int32)


def _kv(tokens):
    """Blocks whose bytes follow from their tokens (what a model would compute)."""
    out = []
    for block in tokens.reshape(-1, LAYOUT.block_size):
        rng = np.random.default_rng(int(block.astype(np.int64).sum()) * 7919 + int(block[0]))
        out.append(rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8))
    return out


def _empty(count):
    return [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(count)]


@pytest.fixture
def pool(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        yield pool


def test_store_lookup_load(pool):
    connector = Connector(pool, LAYOUT)
    tokens = _tokens(1, 6)
    assert connector.lookup(tokens) == 0
    assert connector.store(tokens[:4 * LAYOUT.block_size], _kv(tokens)[:4]) == 4
    assert connector.store(tokens, _kv(tokens)) == 2  # only the absent ones
    assert connector.lookup(tokens) == 6 * LAYOUT.block_size
    other = tokens.copy()
    other[9] += 1  # block 2 differs: blocks 2.. miss (chained hashes)
    assert connector.lookup(other) == 2 * LAYOUT.block_size
    out = _empty(6)
    assert connector.load(tokens, out) == 6
    assert all((a == b).all() for a, b in zip(out, _kv(tokens)))
    per_layer = [[b[:LAYOUT.block_bytes // 2], b[LAYOUT.block_bytes // 2:]] for b in _empty(6)]
    assert connector.load(connector.keys(tokens), per_layer) == 6
    assert all((np.concatenate(a) == b).all() for a, b in zip(per_layer, _kv(tokens)))
    assert connector.stats["hit_blocks"] == 12


def test_namespaces_and_salts_isolate(pool):
    tokens = _tokens(2, 3)
    Connector(pool, LAYOUT).store(tokens, _kv(tokens))
    other = KVLayout(**{**LAYOUT.__dict__, "tp_rank": 1, "tp_size": 2})
    assert Connector(pool, other).lookup(tokens) == 0
    assert Connector(pool, LAYOUT, salt="tenant-b").lookup(tokens) == 0
    assert Connector(pool, LAYOUT).lookup(tokens) == 3 * LAYOUT.block_size


def test_corrupt_and_evicted_blocks_are_misses(pool):
    connector = Connector(pool, LAYOUT)
    tokens = _tokens(3, 5)
    connector.store(tokens, _kv(tokens))
    hits = pool.index.pin(connector.keys(tokens))
    where = int(hits.offsets[2]) + 100
    pool.index.unpin(hits)
    pool.region.store_u8(where, pool.region.load_u8(where) ^ 0x10)
    pool.region.flush(where, 1)
    pool.region.fence()
    assert connector.load(tokens, _empty(5)) == 2
    assert connector.stats["checksum_failures"] == 1
    while pool.index.evict(16, window=256):
        pass
    assert connector.lookup(tokens) == 0 and connector.load(tokens, _empty(5)) == 0


def test_digest_keys_chained_or_each_on_its_own(pool):
    connector = Connector(pool, LAYOUT)
    digests = [bytes([i]) * 32 for i in range(5)]
    chained = connector.digest_keys(digests)
    own = connector.digest_keys(digests, chained=False)
    assert chained.shape == own.shape == (5, 2)
    assert (connector.digest_keys(digests[:3]) == chained[:3]).all()  # a prefix keys a prefix
    assert (chained[0] == own[0]).all() and not (chained[1:] == own[1:]).all(1).any()
    for row in range(5):  # unchained: a digest's key does not depend on what came before
        assert (connector.digest_keys(digests[row:row + 1]) == own[row]).all()
    assert len({tuple(key) for key in own.tolist()}) == 5
    assert connector.digest_keys([], chained=False).shape == (0, 2)
    with pytest.raises(ValueError, match="one length, a multiple of 4"):
        connector.digest_keys([b"abcd", b"abcdefgh"], chained=False)
    other = Connector(pool, KVLayout(**{**LAYOUT.__dict__, "tp_rank": 1, "tp_size": 2}))
    assert not (other.digest_keys(digests, chained=False) == own).all(1).any()


def _worker(path, node, seed, rounds, errors):
    """Store and load chains of a few shared prompts, under eviction
    pressure; every loaded block must be the one its tokens make."""
    try:
        with Pool.open(path, node) as pool:
            connector = Connector(pool, LAYOUT)
            rng = np.random.default_rng(seed)
            prompts = [_tokens(100 + i, 12) for i in range(6)]
            for _ in range(rounds):
                tokens = prompts[rng.integers(len(prompts))][:4 * int(rng.integers(1, 4))]
                out = _empty(tokens.size // LAYOUT.block_size)
                loaded = connector.load(tokens, out)
                want = _kv(tokens)
                if any((a != b).any() for a, b in zip(out[:loaded], want[:loaded])):
                    errors.put(f"node {node}: a loaded block is not its tokens' block")
                    return
                connector.store(tokens, want)
                if rng.random() < 0.2:
                    pool.index.evict(4, window=64)
    except Exception as error:  # noqa: BLE001 - reported to the test
        errors.put(f"node {node}: {type(error).__name__}: {error}")


def test_many_processes_on_many_nodes(pool, pool_path):
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    workers = [context.Process(target=_worker, args=(pool_path, node, 10 * node + i, 60, errors))
               for node in (1, 2) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert [worker.exitcode for worker in workers] == [0] * 4
    assert errors.empty(), errors.get()
    connector = Connector(pool, LAYOUT)
    assert sum(connector.lookup(_tokens(100 + i, 12)) for i in range(6)) > 0
    # blocks the workers freed into each other's heaps, undrained when they
    # exited, are theirs to reclaim: fsck --repair does, and finds no other problem
    report = fsck(pool_path, watch=False, repair=True, node=3)
    assert {problem["area"] for problem in report["problems"]} <= {"node heap"}, report
    assert fsck(pool_path, watch=False)["ok"]


def _prefill(path, tokens, request_id, ttl, pipe):
    with Pool.open(path, 1) as pool:
        connector = Connector(pool, LAYOUT)
        ticket = connector.offer(request_id, tokens, _kv(tokens), ttl=ttl)
        assert len(connector.offers[request_id].hits) == tokens.size // LAYOUT.block_size
        pipe.send(ticket)
        deadline = time.monotonic() + 20
        while connector.offers and time.monotonic() < deadline:
            connector.release()
            time.sleep(0.01)
        assert not connector.offers
        pipe.send(dict(connector.stats))
        pipe.recv()  # hold the records until the test is done with them


def _offered(pool_path, tokens, request_id, ttl):
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    producer = context.Process(target=_prefill, args=(pool_path, tokens, request_id, ttl, theirs))
    producer.start()
    assert ours.poll(30)
    return producer, ours, ours.recv()


def _evict_all(pool):
    evicted = 0
    while (count := pool.index.evict(16, window=256)):
        evicted += count
    return evicted


def test_handoff_between_processes_and_nodes(pool, pool_path):
    tokens = _tokens(4, 8)
    producer, pipe, ticket = _offered(pool_path, tokens, "req-1", 30.0)
    consumer = Connector(pool, LAYOUT)
    out = _empty(8)
    taken = consumer.take(ticket, out)
    assert taken.blocks == taken.offered == 8
    assert all((a == b).all() for a, b in zip(out, _kv(tokens)))
    assert pipe.poll(30)
    stats = pipe.recv()  # the producer saw the record taken and dropped its pins
    assert stats["offers"] == 1 and stats["expired"] == 0
    assert _evict_all(pool) == 8
    pipe.send(None)
    producer.join(30)
    assert producer.exitcode == 0


def test_an_offer_nobody_takes_expires(pool, pool_path):
    tokens = _tokens(5, 3)
    producer, pipe, ticket = _offered(pool_path, tokens, "req-2", 0.2)
    assert pipe.poll(30)
    assert pipe.recv()["expired"] == 1
    consumer = Connector(pool, LAYOUT)
    assert consumer.take(ticket, _empty(3)) == Taken(0, 0)  # expired: nothing to take
    assert consumer.lookup(tokens) == 3 * LAYOUT.block_size  # the blocks stay cached
    assert _evict_all(pool) == 3  # and unpinned
    pipe.send(None)
    producer.join(30)
    assert producer.exitcode == 0


def test_a_ticket_is_taken_only_as_offered(pool):
    producer, consumer = Connector(pool, LAYOUT), Connector(pool, LAYOUT)
    tokens = _tokens(6, 4)
    ticket = producer.offer("req-3", tokens, _kv(tokens))
    offset, nonce = ticket[len("tract:"):].split(".")
    for bad in ["req-3", "tract:12.34", ticket + "0", None]:
        with pytest.raises(ValueError, match="not a handoff ticket"):
            consumer.take(bad, _empty(4))
    low, high = pool.index.heap
    for offset_ in (low - 64, high, int(offset, 16) + 8):
        with pytest.raises(ValueError, match="not a line inside the heap"):
            consumer.take(f"tract:{offset_:x}.{nonce}", _empty(4))
    # another nonce, or a record whose keys changed, is no offer
    forged = (int(nonce, 16) ^ 2).to_bytes(8, "big").hex()
    assert consumer.take(f"tract:{offset}.{forged}", _empty(4)) == Taken(0, 0)
    record = producer.offers["req-3"].record
    key = pool.region.load_u64(record + 128)
    pool.region.store_u64(record + 128, key ^ 1)
    assert consumer.take(ticket, _empty(4)) == Taken(0, 0)
    pool.region.store_u64(record + 128, key)
    assert producer.release() == 0  # nothing taken so far
    # fewer blocks than offered: those are loaded, and the offer is taken
    out = _empty(2)
    assert consumer.take(ticket, out) == Taken(2, 4)
    assert all((a == b).all() for a, b in zip(out, _kv(tokens)))
    assert producer.release() == 1 and not producer.offers
    assert _evict_all(pool) == 4


def test_a_cancelled_offer_or_a_dead_producer_is_not_taken(pool, pool_path):
    producer, consumer = Connector(pool, LAYOUT), Connector(pool, LAYOUT)
    tokens = _tokens(7, 2)
    ticket = producer.offer("req-4", tokens, _kv(tokens))
    producer.cancel("req-4")
    assert consumer.take(ticket, _empty(2)) == Taken(0, 0)
    assert _evict_all(pool) == 2
    # a producer whose node is gone: its blocks load, but no mark is written
    tokens = _tokens(8, 2)
    other, pipe, ticket = _offered(pool_path, tokens, "req-5", 30.0)
    record = int(ticket[len("tract:"):].split(".")[0], 16)
    os.kill(other.pid, 9)
    other.join(30)
    heartbeat, epoch, _ = pool.nodes.read(1)
    consumer.pool.space.liveness._seen[1] = (heartbeat, epoch, -1e9)  # standing still for long
    out = _empty(2)
    assert consumer.take(ticket, out) == Taken(2, 2)
    assert pool.region.load_u64(record + 64) == 0


def test_records_are_freed_a_lease_after_their_deadline(pool):
    connector = Connector(pool, LAYOUT)
    tokens = _tokens(9, 2)
    connector.offer("req-6", tokens, _kv(tokens), ttl=0.05)
    record = connector.offers["req-6"].record
    time.sleep(0.06)
    assert connector.release() == 1 and connector._retired
    time.sleep(pool.header.lease_timeout)
    connector.release()
    assert not connector._retired
    assert pool.alloc(100) == record  # the record's memory is free again
    connector.close()


def test_cancel_and_close_release_every_pin(pool):
    connector = Connector(pool, LAYOUT)
    for i in range(3):
        tokens = _tokens(10 + i, 2)
        connector.offer(f"r{i}", tokens, _kv(tokens))
    with pytest.raises(ValueError, match="already offered"):
        connector.offer("r0", _tokens(10, 2), _kv(_tokens(10, 2)))
    connector.cancel("r0")
    connector.close()
    assert not connector.offers
    assert _evict_all(pool) == 6


# ----------------------------------------------------------- simulator runs

SEEDS = count()
SIM_LEASE = 0.004
TTL = 20 * SIM_LEASE  # ample for a take, even in a chaotic schedule
SIM_LAYOUT = KVLayout(model="tiny", dtype="uint8", num_layers=2, num_kv_heads=1, head_size=64,
                      block_size=2)


def run_handoffs(seed, rounds=3, chaos=0.5, cancel=False):
    """Host 0 (prefill) offers requests one after another, host 1 (decode)
    takes each: every take gets exactly that request's blocks, though each
    record's memory is reused by the next request's (a stale copy of it
    would name the previous request's blocks), and the producer sees each
    offer taken (none expires).  With ``cancel``, the producer withdraws
    every offer before the decode side takes it: no take loads anything."""
    pool = SimPool(256 * 1024, hosts=2, seed=seed, chaos=chaos, max_steps=2_000_000)
    format_pool(pool.hosts[0], max_nodes=2, locks=("alloc", "objects", "index"), max_locks=3,
                chunk_size=8192, max_objects=8, index_capacity=32, lock_mode="bakery",
                lease_timeout=SIM_LEASE, hash_key=pool.hash_key)
    for host in pool.hosts:
        host.invalidate(0, pool.size)
        host.fence()
    rng = np.random.default_rng(seed)
    requests = [rng.integers(0, 2**63, size=(2, 2), dtype=np.uint64) for _ in range(rounds)]
    payloads = [[rng.integers(0, 256, SIM_LAYOUT.block_bytes, dtype=np.uint8) for _ in keys]
                for keys in requests]
    tickets, taken = [None] * rounds, []
    handles, finished = {}, {0: False}

    def connector(host, node):
        handle = handles[node] = Pool(host, node, clock=pool.clock, heartbeat=False,
                                      local_locks=False)
        return Connector(handle, SIM_LAYOUT, handoff_ttl=TTL, timeout=100 * SIM_LEASE)

    def prefill(host):
        kv = connector(host, 0)
        for i, (keys, blocks) in enumerate(zip(requests, payloads)):
            while kv.offers or kv._retired:  # one request in flight: its record's memory
                kv.release()                 # is freed, and reused by the next one's
                pool.clock.sleep(SIM_LEASE / 10)
            ticket = kv.offer(f"req-{i}", keys, blocks)
            if cancel:
                kv.cancel(f"req-{i}")
            tickets[i] = ticket
            if not cancel:  # the mark is in memory once `take` returned: seen at once
                while len(taken) <= i:
                    pool.clock.sleep(SIM_LEASE / 10)
                if kv.release() != 1:
                    raise SimulationFailure(f"request {i}: taken, but its mark unseen", seed)
        finished[0] = True

    def decode(host):
        kv = connector(host, 1)
        for i in range(rounds):
            while tickets[i] is None:
                pool.clock.sleep(SIM_LEASE / 10)
            outs = [np.zeros(SIM_LAYOUT.block_bytes, np.uint8) for _ in payloads[i]]
            got = kv.take(tickets[i], outs)
            if cancel:
                if got.offered:
                    raise SimulationFailure(f"request {i}: took {got} of a withdrawn offer", seed)
            elif got.offered != len(outs) or got.blocks != len(outs) or \
                    any((a != b).any() for a, b in zip(outs, payloads[i])):
                raise SimulationFailure(f"request {i}: took {got}, bytes "
                                        f"{'right' if got.blocks else 'missing'}", seed)
            taken.append(i)

    # the producer's heartbeat: a decode side marks the offers of a live node only
    pool.run((0, prefill), (1, decode), (0, heartbeat(pool, handles, finished, 0, SIM_LEASE / 4)))
    return len(taken)


@pytest.mark.sim
def test_handoffs_between_hosts_deliver_each_request_whole():
    assert sum(run_handoffs(seed) for seed in seeds(max(1, SEEDS // 4))) == \
        3 * max(1, SEEDS // 4)


@pytest.mark.sim
def test_a_withdrawn_offer_is_taken_by_no_host():
    assert sum(run_handoffs(seed, cancel=True) for seed in seeds(max(1, SEEDS // 8))) == \
        3 * max(1, SEEDS // 8)


def test_misused_inputs_are_refused_by_name(pool):
    connector = Connector(pool, LAYOUT)
    tokens = _tokens(7, 3)
    blocks = _kv(tokens)
    typed = [block.view(np.float32) for block in blocks]  # the same bytes, another dtype
    with pytest.raises(ValueError, match="a float32 buffer, but layout 'tiny-llama' holds "
                                         "float16"):
        connector.store(tokens, typed)
    assert connector.lookup(tokens) == 0  # nothing was stored
    with pytest.raises(ValueError, match="3 blocks but keys for 2"):
        connector.store(tokens[:2 * LAYOUT.block_size], blocks)
    assert connector.store(tokens, blocks) == 3
    with pytest.raises(ValueError, match="a float32 buffer"):
        connector.load(tokens, [np.zeros(LAYOUT.block_bytes // 4, np.float32)] * 3)
    with pytest.raises(ValueError, match="has 512 bytes; layout 'tiny-llama' blocks have 1024"):
        connector.load(_tokens(8, 2), [np.zeros(512, np.uint8)] * 2)  # nothing hits
    for ttl in (0, -1, float("nan"), "10"):
        with pytest.raises(ValueError, match="offer ttl must be a positive number"):
            connector.offer(f"r{ttl}", tokens, blocks, ttl=ttl)
    with pytest.raises(ValueError, match="handoff_ttl must be a positive number"):
        Connector(pool, LAYOUT, handoff_ttl=0)
    assert connector.take(NO_OFFER, _empty(3)) == Taken(0, 0)  # what a full pool offers
    halves = [block.view(np.float16) for block in blocks]  # the layout's own dtype
    assert connector.store(_tokens(9, 3), halves) == 3


def test_store_each_says_which_blocks_the_pool_holds(pool_path):
    """A pool whose every entry is pinned stores nothing new and says so
    block by block (blocks present already are held, not written); once
    unpinned, the same store evicts and holds them all."""
    Pool.create(pool_path, 8 << 20, chunk_size=1 << 16, max_nodes=4, index_capacity=8)
    with Pool.open(pool_path, 0, manager=True) as pool:
        connector = Connector(pool, LAYOUT)
        tokens = _tokens(20, 8)
        published, kept, written = connector.store_each(tokens, _kv(tokens))
        assert published == 8 and kept.tolist() == written.tolist() == [True] * 8
        hits = pool.index.pin(connector.keys(tokens))  # nothing left to evict
        assert len(hits) == 8
        more = np.concatenate([tokens[:2 * LAYOUT.block_size], _tokens(21, 3)])
        published, kept, written = connector.store_each(more, _kv(more))
        assert published == 0 and kept.tolist() == [True, True, False, False, False]
        assert not written.any()
        assert connector.stats["not_stored"] == 3
        pool.index.unpin(hits)
        published, kept, written = connector.store_each(more, _kv(more))
        assert kept.all() and 3 <= published <= 5 and connector.stats["not_stored"] == 3
        assert written.sum() == published and written[2:].all()  # the first two were present
        out = _empty(5)
        assert connector.load(more, out) == 5
        assert all((a == b).all() for a, b in zip(out, _kv(more)))


# a layout whose blocks take two chunks (of 64 KiB) and one a slab serves
WIDE = KVLayout(model="wide", dtype="float16", num_layers=4, num_kv_heads=4, head_size=64,
                block_size=32)  # 4 * 4 * 64 * 32 * 2 * 2 bytes = 128 KiB: two chunks
NARROW = KVLayout(model="narrow", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64,
                  block_size=32)  # 32 KiB: a slab block


def _fill(path, node, seed, rounds, results, manager=False):
    """Store past the pool's size with one- and two-chunk blocks; check
    every block that reports stored, loaded back byte-exact; never raise.
    ``manager``: this worker runs a lock manager (active or standby)."""
    try:
        with Pool.open(path, node, manager=manager) as pool:
            rng = np.random.default_rng(seed)
            connectors = [Connector(pool, layout) for layout in (WIDE, NARROW)]
            stored = not_stored = offered = 0
            for round_ in range(rounds):
                connector = connectors[int(rng.integers(2))]
                layout = connector.layout
                tokens = rng.integers(0, 32000, 4 * layout.block_size, dtype=np.int32)
                blocks = [rng.integers(0, 256, layout.block_bytes, dtype=np.uint8)
                          for _ in range(4)]
                before = connector.stats["not_stored"]
                published, kept, written = connector.store_each(tokens, blocks)
                missed = connector.stats["not_stored"] - before
                assert missed == 4 - kept.sum() and published == written.sum() <= kept.sum()
                stored += published
                not_stored += missed
                out = [np.zeros(layout.block_bytes, np.uint8) for _ in range(4)]
                loaded = connector.load(tokens, out)
                for got, want in zip(out[:loaded], blocks):
                    assert (got == want).all(), "a loaded block is not the one stored"
                if round_ % 5 == 0:
                    ticket = connector.offer(f"{node}-{round_}", tokens, blocks, ttl=5.0)
                    offered += 1
                    taken = connector.take(ticket, out)
                    for got, want in zip(out[:taken.blocks], blocks):
                        assert (got == want).all(), "a taken block is not the one offered"
            for connector in connectors:
                connector.close()
        results.put((node, seed, stored, not_stored, offered, None))
    except Exception as error:  # noqa: BLE001 - reported to the test
        import traceback

        where = " <- ".join(f"{frame.name}:{frame.lineno}"
                            for frame in reversed(traceback.extract_tb(error.__traceback__)))
        results.put((node, seed, 0, 0, 0, f"{type(error).__name__}: {error} at {where}"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("managers", ["in-the-test", "in-the-workers"])
def test_a_full_fragmented_pool_never_fails_a_store_and_closes_clean(pool_path, managers):
    """Processes on several nodes store one- and two-chunk blocks past the
    pool's size, offer and take, and close: no store raises, every block
    that reports stored loads byte-exact, and fsck of the closed pool has
    nothing to repair, in each of 20 seeded repetitions.  The lock manager
    runs in this process, or in the workers themselves (a worker's close
    hands it to a standby while the others hold its grants)."""
    context = multiprocessing.get_context("fork")
    in_workers = managers == "in-the-workers"
    for repetition in range(20):
        # a lease far past any stall of a loaded 2-core machine: a lapsed lease is a
        # stall's matter (its memory may be reclaimed under it), not this test's
        Pool.create(pool_path, 4 << 20, chunk_size=1 << 16, max_nodes=4, lease_timeout=5.0,
                    index_capacity=256)
        try:
            manager = None if in_workers else Pool.open(pool_path, 0, manager=True)
            results = context.Queue()
            workers = [context.Process(target=_fill, args=(pool_path, node, 1000 * repetition
                                                           + 10 * node + i, 12, results,
                                                           in_workers))
                       for node in (1, 2) for i in range(2 if node == 1 else 1)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(120)
            reports = [results.get(timeout=10) for _ in workers]
            assert [worker.exitcode for worker in workers] == [0] * len(workers)
            assert [report[-1] for report in reports] == [None] * len(workers), reports
            assert sum(report[2] for report in reports) > 0
            report = fsck(pool_path, watch=False)
            assert report["ok"] and report["problems"] == [], (repetition, report["problems"])
            if manager is not None:
                manager.close()
        finally:
            Pool.destroy(pool_path)


# ------------------------------------------------------- self-fencing (R6)

def _fencing_connector():
    """A connector on node 0 of a one-host simulated pool, fencing on (it
    beats by hand: `Pool.beat`), and the simulator."""
    pool = SimPool(256 * 1024, hosts=1, seed=0, chaos=0.0)
    format_pool(pool.hosts[0], max_nodes=2, locks=("alloc", "objects", "index"), max_locks=3,
                chunk_size=8192, max_objects=8, index_capacity=32, lock_mode="bakery",
                lease_timeout=SIM_LEASE, hash_key=pool.hash_key)
    handle = Pool(pool.hosts[0], 0, clock=pool.clock, heartbeat=False, local_locks=False,
                  fencing=True)
    return pool, Connector(handle, SIM_LAYOUT, timeout=100 * SIM_LEASE)


def _stalls_after(pool, owner, name):
    """``owner.name`` stalls past half the lease once it has returned (a
    process paused there, as by SIGSTOP)."""
    step = getattr(owner, name)

    def stalled(*args, **kwargs):
        result = step(*args, **kwargs)
        pool.clock.sleep(0.6 * SIM_LEASE)
        return result
    setattr(owner, name, stalled)


def _blocks(seed, count):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**63, (count, 2), dtype=np.uint64), \
        [rng.integers(0, 256, SIM_LAYOUT.block_bytes, dtype=np.uint8) for _ in range(count)]


@pytest.mark.sim
def test_a_writer_stalled_after_its_reserve_copies_nothing():
    pool, kv = _fencing_connector()
    keys, blocks = _blocks(1, 2)
    reserved = []
    reserve = kv.index.reserve

    def remember(*args, **kwargs):
        reserved.append(reserve(*args, **kwargs))
        return reserved[-1]
    kv.index.reserve = remember
    _stalls_after(pool, kv.index, "reserve")
    assert kv.store(keys, blocks) == 0
    assert kv.stats["fenced"] == 1 and kv.stats["stored_blocks"] == 0
    for offset in reserved[0].offsets:  # its blocks may be another's already: untouched
        assert not pool.memory[offset:offset + SIM_LAYOUT.block_bytes].any()
    del kv.index.reserve  # the next store rejoins as a new incarnation, then stores
    epoch = kv.pool.epoch
    assert kv.store(keys, blocks) == 2
    assert kv.pool.epoch == epoch + 1 and kv.stats["rejoins"] == 1


@pytest.mark.sim
def test_a_reader_stalled_while_it_copies_serves_a_miss():
    pool, kv = _fencing_connector()
    keys, blocks = _blocks(2, 2)
    assert kv.store(keys, blocks) == 2
    out = [np.zeros(SIM_LAYOUT.block_bytes, np.uint8) for _ in blocks]
    _stalls_after(pool, kv.transfer, "load")  # its pins may have been ignored meanwhile
    assert kv.load(keys, out) == 0
    assert kv.stats["fenced"] == 1 and kv.stats["hit_blocks"] == 0
    del kv.transfer.load
    assert kv.load(keys, out) == 2 and kv.stats["rejoins"] == 1
    assert all(np.array_equal(got, block) for got, block in zip(out, blocks))


@pytest.mark.sim
def test_a_producer_stalled_before_its_record_offers_nothing():
    pool, kv = _fencing_connector()
    keys, blocks = _blocks(3, 2)
    record = []
    alloc = kv.index.alloc

    def remember(*args, **kwargs):
        record.append(alloc(*args, **kwargs))
        return record[-1]
    kv.index.alloc = remember
    _stalls_after(pool, kv.index, "alloc")
    assert kv.offer("req", keys, blocks) == NO_OFFER
    assert kv.stats["not_offered"] == 1 and not kv.offers
    assert not pool.memory[record[-1]:record[-1] + 64].any()  # no record written


_WARM_UP_CHECK = r"""
import numpy as np
from numba.core.dispatcher import Dispatcher

from tract import _failpoints as faults
from tract._kernels import bitmap, blockhash, cachectl, indexfast, probe
from tract.connector import Connector, warm_up
from tract.pool import Pool
from tract.transfer import KVLayout


def compiled():
    return {f"{module.__name__}.{name}": len(value.signatures)
            for module in (bitmap, blockhash, cachectl, indexfast, probe)
            for name, value in vars(module).items() if isinstance(value, Dispatcher)}


assert warm_up() > 0 and warm_up() == 0.0  # TRACT_KILL_POINT=store.copied: never fired
faults.arm(None)
before = compiled()
layout = KVLayout(model="m", dtype="bfloat16", num_layers=3, num_kv_heads=2, head_size=16,
                  block_size=8)
path = "{path}"
Pool.create(path, 8 << 20, chunk_size=1 << 16, max_nodes=4, index_capacity=256)
with Pool.open(path, 1, manager=True) as pool:
    connector = Connector(pool, layout)
    blocks = [np.full(layout.block_bytes, i, np.uint8) for i in range(6)]
    for tokens in (np.arange(48, dtype=np.int32), list(range(100, 148)),
                   np.arange(200, 248, dtype=np.int64)):
        connector.store(tokens, blocks)
        connector.load(tokens[:connector.lookup(tokens)], blocks)
        connector.take(connector.offer(str(tokens[0]), tokens, blocks), blocks)
    keys = connector.digest_keys([bytes([i]) * 16 for i in range(6)], chained=False)
    connector.store_each(keys, blocks)
    connector.remove(keys)
    for first in range(1000, 1200, 6):  # past a full pool: stores make room
        connector.store(list(range(first, first + 48)), blocks)
    pool.index.evict(8)
    connector.release()
    after = compiled()
    print({name: (before[name], after[name]) for name in after if after[name] != before[name]},
          flush=True)
    faults.arm("store.copied")  # the engine's own store still dies there
    connector.store(list(range(5000, 5048)), blocks)
"""


def test_warm_up_compiles_every_kernel_the_calls_reach(pool_path):
    """After `warm_up`, in a fresh process, a connector's calls (tokens of
    every dtype, digests, handoffs, removes, a full pool's evictions)
    compile no kernel: none is ever compiled under a pool lock.  A fail
    point armed in the process fires in none of the warm-up's steps, and
    still fires in the engine's own."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _WARM_UP_CHECK.replace("{path}", pool_path)],
                         capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         env=dict(os.environ, TRACT_KILL_POINT="store.copied"))
    assert out.stdout.strip() == "{}", f"compiled after warm_up: {out.stdout}{out.stderr}"
    assert out.returncode == -9, out.stderr[-3000:]  # the engine's store, armed, died
