"""Tenancy and trust: pool file modes and owners, tenant namespaces, and
the per-pool hash key (the fuzzing of every metadata area, R5, is
`tests/test_fuzz.py`)."""

import os
import stat

import numpy as np
import pytest

from tract.connector import Connector
from tract.pool import Pool
from tract.transfer import KVLayout

LAYOUT = KVLayout(model="m", dtype="uint8", num_layers=1, num_kv_heads=1, head_size=64,
                  block_size=16)


def _create(path, **options):
    Pool.create(path, 4 << 20, chunk_size=64 << 10, max_nodes=4, lock_mode="bakery", **options)


def test_pool_files_are_private_unless_a_group_mode_is_asked_for(pool_path, tmp_path):
    _create(pool_path)
    assert stat.S_IMODE(os.stat(pool_path).st_mode) == 0o600
    shared = pool_path + "-group"
    try:
        _create(shared, mode=0o660)
        assert stat.S_IMODE(os.stat(shared).st_mode) == 0o660
    finally:
        Pool.destroy(shared)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_pool_owned_by_another_user_is_refused_unless_allowed(pool_path, monkeypatch):
    _create(pool_path)
    os.chown(pool_path, 12345, -1)
    with pytest.raises(PermissionError, match="owned by uid 12345"):
        Pool.open(pool_path, 0)
    with Pool.open(pool_path, 0, allow_other_owner=True) as pool:
        assert pool.node == 0
    monkeypatch.setenv("TRACT_ALLOW_OTHER_OWNER", "1")
    with Pool.open(pool_path, 1):
        pass


def test_tenants_share_blocks_only_under_one_salt(pool_path):
    _create(pool_path)
    tokens = np.arange(64, dtype=np.int64)
    blocks = [np.full(LAYOUT.block_bytes, i, np.uint8) for i in range(4)]
    with Pool.open(pool_path, 0) as pool:
        tenant_a, tenant_b = (Connector(pool, LAYOUT, salt=s) for s in ("tenant-a", "tenant-b"))
        also_a = Connector(pool, LAYOUT, salt="tenant-a")
        assert tenant_a.store(tokens, blocks) == 4
        assert tenant_b.lookup(tokens) == 0 and Connector(pool, LAYOUT).lookup(tokens) == 0
        assert also_a.lookup(tokens) == 64
        digests = [bytes([i]) * 32 for i in range(4)]
        assert not (tenant_a.digest_keys(digests) == tenant_b.digest_keys(digests)).all(1).any()
        for connector in (tenant_a, tenant_b, also_a):
            connector.close()


def test_the_hash_key_is_per_pool_and_keys_follow_it(pool_path):
    other = pool_path + "-other"
    _create(pool_path)
    _create(other)
    try:
        tokens = np.arange(64, dtype=np.int64)
        with Pool.open(pool_path, 0) as first, Pool.open(other, 0) as second:
            assert first.header.hash_key != second.header.hash_key
            assert len(set(first.header.hash_key)) > 4  # random, not a constant
            keys = [Connector(pool, LAYOUT).keys(tokens) for pool in (first, second)]
            assert not (keys[0] == keys[1]).all(1).any()
    finally:
        Pool.destroy(other)


def test_pool_create_group_mode_from_the_command_line(pool_path):
    from tract.cli import main

    assert main(["pool", "create", pool_path, "--size", "4M", "--chunk-size", "64K",
                 "--max-nodes", "4", "--group"]) == 0
    assert stat.S_IMODE(os.stat(pool_path).st_mode) == 0o660
