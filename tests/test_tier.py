"""Tiers below the rack (`tract.tier`): Mooncake Store, started here on
127.0.0.1 (its master and a segment holder), stopped after."""

import contextlib
import json
import logging
import time

import numpy as np
import pytest

from tract.errors import ConfigError
from tract.tier import HEADER_BYTES, MooncakeTier, open_tier

pytestmark = pytest.mark.multiprocess  # the store's master and segment holder

mooncake_store = pytest.importorskip(  # ImportError: its libibverbs.so.1 is missing
    "mooncake.store", reason="the mooncake tier needs mooncake-transfer-engine-non-cuda "
    "(Debian libibverbs1)", exc_type=ImportError)

from tract.bench.peers import MooncakeCluster as Store, free_port  # noqa: E402

MARGIN = 5  # timing bounds: five times what the code promises


@pytest.fixture(scope="module")
def store():
    started = Store().start()
    yield started
    started.stop()


def _blocks(rng, count, pieces=3, piece=4096):
    return [[rng.integers(0, 256, piece, dtype=np.uint8) for _ in range(pieces)]
            for _ in range(count)]


def _keys(rng, count):
    return rng.integers(0, 2**63, (count, 2), dtype=np.uint64)


def test_a_block_stored_from_one_rack_is_loaded_byte_exact_by_another(store):
    rng = np.random.default_rng(1)
    keys, blocks = _keys(rng, 5), _blocks(rng, 5)
    with open_tier(store.url(seed=7)) as rack_a, open_tier(store.url(seed=7)) as rack_b:
        assert rack_a.put_from(keys, blocks).all()
        assert rack_a.put_from(keys[:2], blocks[:2]).all()  # held already: taken
        assert rack_b.exists(keys).all()
        missing = _keys(rng, 2)
        assert not rack_b.exists(missing).any()
        targets = [[np.zeros(4096, np.uint8) for _ in range(3)] for _ in range(7)]
        got = rack_b.get_into(np.concatenate([keys[:3], missing, keys[3:]]), targets)
        assert got.tolist() == [True] * 3 + [False] * 2 + [True] * 2
        for target, block in zip(targets[:3] + targets[5:], blocks):
            for piece, original in zip(target, block):
                assert np.array_equal(piece, original)
        assert rack_b.stats["hits"] == 5 and rack_b.stats["misses"] == 2
        assert rack_b.stats["bytes_out"] == 5 * 3 * 4096
        assert rack_a.stats["stored"] == 7 and rack_b.stats["failures"] == 0, rack_b.down
        assert rack_b.remove(keys) == 5 and not rack_b.exists(keys).any()


def test_batches_larger_than_the_staging_go_in_several_calls(store):
    rng = np.random.default_rng(2)
    keys, blocks = _keys(rng, 9), _blocks(rng, 9, pieces=1, piece=20_000)
    with open_tier(store.url(staging_bytes=64 << 10)) as tier:
        assert tier.put_from(keys, blocks).all()
        targets = [np.zeros(20_000, np.uint8) for _ in range(9)]
        assert tier.get_into(keys, targets).all()
        assert all(np.array_equal(t, b[0]) for t, b in zip(targets, blocks))
        refused = _keys(rng, 2)  # a block that fits, then one that does not: neither is put
        with pytest.raises(ValueError, match="does not fit the tier's 65536-byte staging"):
            tier.put_from(refused, [np.zeros(20_000, np.uint8), np.zeros(70_000, np.uint8)])
        assert not tier.exists(refused).any()
        tier.remove(keys)


def test_a_block_altered_in_the_tier_is_a_miss_and_is_removed(store):
    rng = np.random.default_rng(3)
    keys, blocks = _keys(rng, 3), _blocks(rng, 3, pieces=2)
    with open_tier(store.url()) as tier:
        assert tier.put_from(keys, blocks).all()
        raw = mooncake_store.MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", f"http://127.0.0.1:{store.metadata}/metadata", 0,
                         16 << 20, "tcp", "", f"127.0.0.1:{store.master}") == 0
        try:
            name = f"tract/{int(keys[1, 0]):016x}{int(keys[1, 1]):016x}"
            stored = bytearray(raw.get(name))
            assert len(stored) == HEADER_BYTES + 2 * 4096
            stored[HEADER_BYTES + 100] ^= 1  # one bit of its bytes
            assert raw.remove(name, True) == 0 and raw.put(name, bytes(stored)) == 0
        finally:
            raw.close()
        targets = [[np.zeros(4096, np.uint8) for _ in range(2)] for _ in range(3)]
        assert tier.get_into(keys, targets).tolist() == [True, False, True]
        assert tier.stats["corrupt"] == 1
        assert tier.exists(keys).tolist() == [True, False, True]  # removed: a put heals it
        # a target of another shape is a miss, not a corrupt block: it stays
        assert not tier.get_into(keys[:1], [np.zeros(8192, np.uint8)]).any()
        assert not tier.get_into(keys[:1], [np.zeros(4096, np.uint8)]).any()
        assert tier.stats["corrupt"] == 1 and tier.exists(keys[:1]).all()
        # another seed (racks that do not share a hash key) finds every block wrong
        with open_tier(store.url(seed=99)) as stranger:
            assert not stranger.get_into(keys[2:], targets[2:]).any()
        tier.remove(keys)


def test_a_dead_master_turns_into_misses_within_the_timeout_and_it_serves_again(caplog):
    store = Store().start()
    try:
        rng = np.random.default_rng(4)
        keys, blocks = _keys(rng, 4), _blocks(rng, 4, pieces=1)
        tier = open_tier(store.url(timeout=1.0, retry=0.5))
        try:
            assert tier.put_from(keys, blocks).all()
            store.master_process.kill()
            store.master_process.wait()
            targets = [np.zeros(4096, np.uint8) for _ in range(4)]
            with caplog.at_level(logging.WARNING, logger="tract.tier"):
                for call in (lambda: tier.get_into(keys, targets), lambda: tier.exists(keys),
                             lambda: tier.put_from(keys, blocks), lambda: tier.remove(keys)):
                    start = time.monotonic()
                    result = call()
                    assert time.monotonic() - start < 1.0 * MARGIN
                    assert not np.any(result)
            assert tier.down is not None and tier.stats["failures"] >= 4
            assert sum("is not answering" in r.getMessage() for r in caplog.records) == 1
            store.start_master()  # a new master, on the same ports: its store is empty
            deadline = time.monotonic() + 30 * MARGIN
            while not tier.put_from(keys, blocks).all():
                assert time.monotonic() < deadline, f"the tier never served again: {tier.down}"
                time.sleep(0.2)
            assert tier.down is None
            assert tier.get_into(keys, targets).all()
            assert all(np.array_equal(t, b[0]) for t, b in zip(targets, blocks))
        finally:
            tier.close()
    finally:
        store.stop()


def test_a_tier_that_cannot_be_reached_at_start_is_set_up_in_the_background():
    store = Store()
    tier = open_tier(store.url(timeout=1.0, retry=0.3))
    try:
        keys = _keys(np.random.default_rng(5), 1)
        assert not tier.exists(keys).any()  # a miss, at once
        deadline = time.monotonic() + 1.0 * MARGIN
        while tier.down is None:  # its setup failed (on the worker: it may still be trying)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        store.start()
        deadline = time.monotonic() + 30 * MARGIN
        while not tier.put_from(keys, [np.ones(64, np.uint8)]).all():
            assert time.monotonic() < deadline, f"never set up: {tier.down}"
            time.sleep(0.2)
        assert tier.exists(keys).all()
    finally:
        tier.close()
        store.stop()


def test_tier_urls_and_options_are_checked_by_name():
    with pytest.raises(ConfigError, match="unknown tier 'redis://x:1'"):
        open_tier("redis://x:1")
    with pytest.raises(ConfigError, match="names no master"):
        open_tier("mooncake://localhost")
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        open_tier("mooncake://127.0.0.1:1?colour=red")
    with pytest.raises(ConfigError, match="timeout='soon' is not a number"):
        open_tier("mooncake://127.0.0.1:1?timeout=soon")
    with pytest.raises(ConfigError, match="unknown tier option 'colour'"):
        open_tier("mooncake://127.0.0.1:1", colour="red")
    with pytest.raises(ConfigError, match="'rdma' needs its device"):
        MooncakeTier("127.0.0.1:1", "http://127.0.0.1:2/metadata", protocol="rdma")
    with pytest.raises(ConfigError, match="timeout must be a positive"):
        MooncakeTier("127.0.0.1:1", "http://127.0.0.1:2/metadata", timeout=0)


def test_tier_check_says_whether_a_tier_answers(store, capsys):
    from tract.cli import main

    assert main(["tier", "check", store.url(), "--size", "65536"]) == 0
    out = capsys.readouterr().out
    assert "answers: put" in out and "got back byte-exact" in out
    dead = f"mooncake://127.0.0.1:{free_port()}?metadata=http://127.0.0.1:1/metadata"
    assert main(["tier", "check", dead, "--timeout", "1", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["answers"] and "does not answer" in report["problem"]
    assert main(["tier", "check", "mooncake://127.0.0.1:1?colour=red"]) == 2
    assert "unknown option 'colour'" in capsys.readouterr().err


# ------------------------------------------------------- the connector's policy

LAYOUT = None  # made on first use (tract.transfer imports torch lazily)


def _layout():
    global LAYOUT
    if LAYOUT is None:
        from tract.transfer import KVLayout

        LAYOUT = KVLayout(model="tiny-llama", dtype="float16", num_layers=2, num_kv_heads=2,
                          head_size=16, block_size=4)
    return LAYOUT


@contextlib.contextmanager
def _racks(key=b"k" * 16, count=2, capacity=256):
    """``count`` racks: pools made from one hash key, each opened by its
    node 0 (its own manager), removed after."""
    import os
    import uuid

    from tract.pool import Pool

    paths = [f"/dev/shm/tract-test-tier-{os.getpid()}-{uuid.uuid4().hex[:8]}"
             for _ in range(count)]
    pools = []
    try:
        for path in paths:
            Pool.create(path, 32 << 20, chunk_size=1 << 16, max_nodes=4, lease_timeout=1.0,
                        index_capacity=capacity, hash_key=key)
            pools.append(Pool.open(path, 0, manager=True))
        yield paths, pools
    finally:
        for pool in pools:
            pool.close()
        for path in paths:
            if os.path.exists(path):
                Pool.destroy(path)


def _tokens(seed, blocks):
    return np.random.default_rng(seed).integers(0, 32000, blocks * _layout().block_size,
                                                dtype=np.int32)


def _kv(seed, blocks):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, _layout().block_bytes, dtype=np.uint8) for _ in range(blocks)]


def _empty(count):
    return [np.zeros(_layout().block_bytes, np.uint8) for _ in range(count)]


def test_a_prefix_stored_in_one_rack_is_loaded_by_another_and_promoted(store):
    from tract.connector import Connector
    from tract.fsck import fsck

    tokens, kv = _tokens(10, 6), _kv(10, 6)
    with _racks() as (paths, (rack_a, rack_b)):
        prefill = Connector(rack_a, _layout(), tier=store.url())
        decode = Connector(rack_b, _layout(), tier=store.url())
        try:
            assert prefill.store(tokens[:4 * 4], kv[:4]) == 4  # written through
            assert prefill.stats["tier_stored_blocks"] == 4
            assert rack_b.index.lookup(decode.keys(tokens)) == 0
            assert decode.lookup(tokens) == 4 * 4  # none in its rack, 4 in the cluster
            out = _empty(6)
            assert decode.load(tokens, out) == 4
            assert all(np.array_equal(a, b) for a, b in zip(out[:4], kv[:4]))
            assert decode.stats["tier_hit_blocks"] == decode.stats["tier_promotions"] == 4
            assert decode.stats["tier_miss_blocks"] == 2 and decode.stats["miss_blocks"] == 2
            # promoted: rack B's own pool holds them now, for every node of the rack
            assert rack_b.index.lookup(decode.keys(tokens)) == 4
            counters = rack_b.counters()
            assert counters[0]["tier_hit_blocks"] == 4 and counters[0]["tier_promotions"] == 4
        finally:
            prefill.close()
            decode.close()
        for path in paths:
            assert fsck(path, watch=False)["ok"]


def test_tenants_with_other_salts_share_no_cluster_block(store):
    from tract.connector import Connector

    tokens, kv = _tokens(11, 3), _kv(11, 3)
    with _racks() as (_, (rack_a, rack_b)):
        alice = Connector(rack_a, _layout(), tier=store.url(), salt="alice")
        mallory = Connector(rack_b, _layout(), tier=store.url(), salt="mallory")
        alice_b = Connector(rack_b, _layout(), tier=store.url(), salt="alice")
        try:
            assert alice.store(tokens, kv) == 3
            assert mallory.lookup(tokens) == 0 and mallory.load(tokens, _empty(3)) == 0
            assert alice_b.lookup(tokens) == 3 * 4
        finally:
            for connector in (alice, mallory, alice_b):
                connector.close()


def test_a_dead_tier_leaves_the_racks_serving_and_a_restarted_one_serves_again():
    from tract.connector import Connector
    from tract.fsck import fsck

    dead = Store()
    dead.start()
    tokens, kv = _tokens(12, 4), _kv(12, 4)
    try:
        with _racks() as (paths, (rack_a, rack_b)):
            url = dead.url(timeout=1.0, retry=0.5)
            prefill, decode = Connector(rack_a, _layout(), tier=url), \
                Connector(rack_b, _layout(), tier=url)
            try:
                assert prefill.store(tokens[:8], kv[:2]) == 2
                dead.master_process.kill()
                dead.master_process.wait()
                start = time.monotonic()
                assert prefill.store(tokens, kv) == 2  # the rack takes them all the same
                assert decode.load(tokens, _empty(4)) == 0  # a miss, not an error
                assert decode.lookup(tokens) == 0
                out = _empty(4)
                assert prefill.load(tokens, out) == 4  # the rack serves
                assert all(np.array_equal(a, b) for a, b in zip(out, kv))
                assert time.monotonic() - start < 4 * 1.0 * MARGIN
                assert prefill.stats["tier_failures"] + decode.stats["tier_failures"] >= 2
                dead.start_master()  # a new master on the same ports: an empty store
                more, more_kv = _tokens(13, 3), _kv(13, 3)
                deadline = time.monotonic() + 30 * MARGIN
                while True:  # written through again, until rack B gets them from the cluster
                    prefill.store(more, more_kv)
                    if decode.load(more, _empty(3)) == 3:
                        break
                    assert time.monotonic() < deadline, "the tier never served again"
                    time.sleep(0.2)
                assert rack_b.index.lookup(decode.keys(more)) == 3  # promoted
            finally:
                prefill.close()
                decode.close()
            for path in paths:
                assert fsck(path, watch=False)["ok"]
    finally:
        dead.stop()


def test_every_adapter_takes_the_tier_options_by_name():
    from tract.integrations.common import options

    opts = options({"tract.pool": "/dev/shm/p", "tract.node": 1,
                    "tract.tier": "mooncake://10.0.0.1:50051?metadata=http://10.0.0.1:80/m",
                    "tract.tier_policy": "write_through"}, "config", "tract.")
    assert opts.tier.startswith("mooncake://10.0.0.1:50051")
    assert opts.tier_policy == "write_through"
    assert options({"pool": "p", "node": 0}, "config").tier is None
    with pytest.raises(ConfigError, match="tract.tier_policy must be one of"):
        options({"tract.pool": "p", "tract.node": 0, "tract.tier_policy": "write_around"},
                "config", "tract.")
    with pytest.raises(ConfigError, match="tract.tier must be a tier URL"):
        options({"tract.pool": "p", "tract.node": 0, "tract.tier": "redis://x"}, "config",
                "tract.")


def test_bench_tier_reports_each_figure_against_its_baseline(store):
    from tract.bench import tier as bench

    results = {result.name: result for result in bench.measure("256KiB", 8, 1, store)}
    assert set(results) == {"tier[tier_hit,256KiB] vs recompute",
                            "tier[tier_hit,256KiB] vs rack_hit",
                            "tier[promotion,256KiB] vs tier_hit", "tier[rack_hit,256KiB]",
                            "tier[recompute,256KiB]"}
    hit = results["tier[tier_hit,256KiB] vs recompute"]
    assert hit.value > 0 and hit.baseline_value == results["tier[recompute,256KiB]"].value
    assert results["tier[tier_hit,256KiB] vs rack_hit"].baseline_value == \
        results["tier[rack_hit,256KiB]"].value


def test_write_back_demotes_what_the_rack_evicts_and_a_later_load_hits(store):
    from tract.connector import Connector
    from tract.fsck import fsck

    with _racks(capacity=32) as (paths, (rack_a, rack_b)):
        writer = Connector(rack_a, _layout(), tier=store.url(), tier_policy="write_back")
        reader = Connector(rack_b, _layout(), tier=store.url())
        try:
            batches = [(writer.keys(_tokens(20 + i, 8)), _kv(20 + i, 8)) for i in range(8)]
            for keys, kv in batches:
                writer.store(keys, kv)
            keys = np.concatenate([keys for keys, _ in batches])
            kv = [block for _, blocks in batches for block in blocks]
            gone = np.flatnonzero(~np.asarray(rack_a.index.present(keys)))
            assert gone.size and writer.stats["tier_demotions"] == gone.size
            assert writer.tier.exists(keys[gone]).all()  # every evicted block demoted
            assert writer.stats["tier_stored_blocks"] == gone.size  # and nothing else
            for i in gone[:4].tolist():  # a later load hits: here, and in another rack
                out = _empty(1)
                assert reader.load(keys[i:i + 1], out) == 1 and np.array_equal(out[0], kv[i])
        finally:
            writer.close()
            reader.close()
        assert not rack_a.index.demoters  # closed: no demotions from a closed connector
        for path in paths:
            assert fsck(path, watch=False)["ok"]


def test_a_demotion_that_fails_leaves_every_free_correct():
    from tract.connector import Connector
    from tract.fsck import fsck

    dead = Store().start()
    try:
        with _racks(capacity=32) as (paths, (rack, _)):
            writer = Connector(rack, _layout(), tier=dead.url(timeout=1.0, retry=60),
                               tier_policy="write_back")
            try:
                dead.master_process.kill()
                dead.master_process.wait()
                for i in range(8):
                    writer.store(_tokens(40 + i, 8), _kv(40 + i, 8))
                assert rack.counters()[0]["evictions"] > 0
                assert writer.stats["tier_demotions"] == 0 and writer.stats["tier_failures"] > 0
                # the rack serves on: every block it kept loads byte-exact
                keys = writer.keys(_tokens(47, 8))
                out = _empty(8)
                assert writer.load(keys, out) == 8
                assert all(np.array_equal(a, b) for a, b in zip(out, _kv(47, 8)))
            finally:
                writer.close()
            for path in paths:  # no chunk leaked, none freed twice
                report = fsck(path, watch=False)
                assert report["ok"], report["problems"]
    finally:
        dead.stop()


def test_blocks_on_a_device_go_through_host_copies(store, monkeypatch):
    """As for CUDA tensors (no device here: CPU tensors, the host views
    refused as for a device's)."""
    import torch

    from tract.connector import Connector
    from tract.transfer import TransferEngine

    monkeypatch.setattr(TransferEngine, "host_views", lambda self, blocks: None)
    tokens, kv = _tokens(50, 3), _kv(50, 3)
    half = _layout().block_bytes // 2
    with _racks() as (_, (rack_a, rack_b)):
        writer = Connector(rack_a, _layout(), tier=store.url())
        reader = Connector(rack_b, _layout(), tier=store.url())
        try:
            blocks = [[torch.from_numpy(block[:half].copy()), torch.from_numpy(block[half:].copy())]
                      for block in kv]
            assert writer.store(tokens, blocks) == 3
            assert writer.stats["tier_stored_blocks"] == 3
            out = [[torch.zeros(half, dtype=torch.uint8) for _ in range(2)] for _ in range(3)]
            assert reader.load(tokens, out) == 3 and reader.stats["tier_hit_blocks"] == 3
            for segments, block in zip(out, kv):
                assert np.array_equal(torch.cat(segments).numpy(), block)
        finally:
            writer.close()
            reader.close()
