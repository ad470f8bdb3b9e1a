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

mooncake_store = pytest.importorskip(
    "mooncake.store", reason="the mooncake tier needs mooncake-transfer-engine-non-cuda "
    "(Debian libibverbs1)")

from tract.bench.peers import free_port, master_command, start_server  # noqa: E402

SEGMENT = 64 << 20
MARGIN = 5  # timing bounds: five times what the code promises


class Store:
    """A Mooncake Store of one master and one segment holder on 127.0.0.1."""

    def __init__(self):
        self.master, self.metadata, self.holder = free_port(), free_port(), free_port()
        self.stack = contextlib.ExitStack()

    def start_master(self):
        self.master_process = self.stack.enter_context(start_server(
            master_command(self.master, self.metadata), [self.master, self.metadata],
            "mooncake_master"))

    def start(self):
        self.start_master()
        self.stack.enter_context(start_server(
            ["mooncake_client", "--host=127.0.0.1", f"--port={self.holder}",
             f"--master_server_address=127.0.0.1:{self.master}",
             f"--metadata_server=http://127.0.0.1:{self.metadata}/metadata",
             f"--global_segment_size={SEGMENT}", "--protocol=tcp"],
            [self.holder], "mooncake_client"))
        return self

    def url(self, **query) -> str:
        extra = "".join(f"&{key}={value}" for key, value in query.items())
        return f"mooncake://127.0.0.1:{self.master}?metadata=http://127.0.0.1:" \
               f"{self.metadata}/metadata{extra}"

    def stop(self):
        self.stack.close()


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
        with pytest.raises(ValueError, match="does not fit the tier's 65536-byte staging"):
            tier.put_from(_keys(rng, 1), [np.zeros(70_000, np.uint8)])
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
        assert not tier.exists(keys).any() and tier.down is not None
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
