"""The engine-agnostic connector: prefix reuse across processes and node
ids, misses for evicted or corrupt blocks, and P/D handoff with its TTL;
under the non-coherent simulator, handoffs between hosts (tests marked
``sim``: the mutation harness's suite for tract.connector)."""

import multiprocessing
import os
import time

import numpy as np
import pytest

from tract.connector import Connector
from tract.fsck import fsck
from tract.pool import Pool, format_pool
from tract.testing.incoherent import SimPool, SimulationFailure
from tract.transfer import KVLayout

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
    assert connector.stats["loaded_blocks"] == 12


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


def _prefill(path, tokens, request_id, ttl):
    with Pool.open(path, 1) as pool:
        connector = Connector(pool, LAYOUT)
        offered = connector.offer(request_id, tokens, _kv(tokens), ttl=ttl)
        assert offered == tokens.size // LAYOUT.block_size
        deadline = time.monotonic() + 20
        while connector.offers and time.monotonic() < deadline:
            connector.release()
            time.sleep(0.01)
        assert not connector.offers


def test_handoff_between_processes_and_nodes(pool, pool_path):
    tokens = _tokens(4, 8)
    context = multiprocessing.get_context("fork")
    producer = context.Process(target=_prefill, args=(pool_path, tokens, "req-1", 30.0))
    producer.start()
    consumer = Connector(pool, LAYOUT)
    deadline, taken = time.monotonic() + 20, None
    while time.monotonic() < deadline:
        out = _empty(8)
        taken = consumer.take("req-1", out)
        if taken.offered:
            break
        time.sleep(0.01)
    assert taken.blocks == taken.offered == 8
    assert all((a == b).all() for a, b in zip(out, _kv(tokens)))
    producer.join(30)
    assert producer.exitcode == 0
    assert not [r for r in pool.objects.list() if r.name.startswith("handoff/")]
    # the producer released its pins: every block can be evicted now
    evicted = 0
    while (count := pool.index.evict(16, window=256)):
        evicted += count
    assert evicted == 8


def test_an_offer_nobody_takes_expires(pool, pool_path):
    tokens = _tokens(5, 3)
    context = multiprocessing.get_context("fork")
    producer = context.Process(target=_prefill, args=(pool_path, tokens, "req-2", 0.2))
    producer.start()
    producer.join(30)
    assert producer.exitcode == 0
    consumer = Connector(pool, LAYOUT)
    assert consumer.take("req-2", _empty(3)).offered == 0  # expired: nothing to take
    assert consumer.lookup(tokens) == 3 * LAYOUT.block_size  # the blocks stay cached
    assert not [r for r in pool.objects.list() if r.name.startswith("handoff/")]


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
    evicted = 0
    while (count := pool.index.evict(16, window=256)):
        evicted += count
    assert evicted == 6


# ----------------------------------------------------------- simulator runs

SEEDS = int(os.environ.get("TRACT_SIM_SEEDS", "200"))
SIM_LEASE = 0.004
SIM_LAYOUT = KVLayout(model="tiny", dtype="uint8", num_layers=2, num_kv_heads=1, head_size=64,
                      block_size=2)


def run_handoffs(seed, rounds=3, chaos=0.5):
    """Host 0 (prefill) offers requests one after another, host 1 (decode)
    takes each: every take gets exactly that request's blocks, though each
    record's memory is reused by the next request's (a stale copy of it
    would name the previous request's blocks)."""
    pool = SimPool(256 * 1024, hosts=2, seed=seed, chaos=chaos, max_steps=2_000_000)
    format_pool(pool.hosts[0], max_nodes=2, locks=("alloc", "objects", "index"), max_locks=3,
                chunk_size=8192, max_objects=8, index_capacity=32, lock_mode="bakery",
                lease_timeout=SIM_LEASE)
    for host in pool.hosts:
        host.invalidate(0, pool.size)
        host.fence()
    rng = np.random.default_rng(seed)
    requests = [rng.integers(0, 2**63, size=(2, 2), dtype=np.uint64) for _ in range(rounds)]
    payloads = [[rng.integers(0, 256, SIM_LAYOUT.block_bytes, dtype=np.uint8) for _ in keys]
                for keys in requests]
    offered, taken = [False] * rounds, []

    def connector(host, node):
        handle = Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
        return Connector(handle, SIM_LAYOUT, handoff_ttl=1e6, timeout=100 * SIM_LEASE)

    def prefill(host):
        kv = connector(host, 0)
        for i, (keys, blocks) in enumerate(zip(requests, payloads)):
            while i and len(taken) < i:  # one request in flight: its record's memory is reused
                pool.clock.sleep(SIM_LEASE / 10)
            kv.offer(f"req-{i}", keys, blocks)
            offered[i] = True
        while kv.offers:
            kv.release()
            pool.clock.sleep(SIM_LEASE / 10)

    def decode(host):
        kv = connector(host, 1)
        for i in range(rounds):
            while not offered[i]:
                pool.clock.sleep(SIM_LEASE / 10)
            outs = [np.zeros(SIM_LAYOUT.block_bytes, np.uint8) for _ in payloads[i]]
            got = kv.take(f"req-{i}", outs)
            if got.offered != len(outs) or got.blocks != len(outs) or \
                    any((a != b).any() for a, b in zip(outs, payloads[i])):
                raise SimulationFailure(f"request {i}: took {got}, bytes "
                                        f"{'right' if got.blocks else 'missing'}", seed)
            taken.append(i)

    pool.run(prefill, decode)
    return len(taken)


@pytest.mark.sim
def test_handoffs_between_hosts_deliver_each_request_whole():
    assert sum(run_handoffs(seed) for seed in range(max(1, SEEDS // 4))) == \
        3 * max(1, SEEDS // 4)
