"""What the engine adapters share (`tract.integrations.common`): options
read from an engine's config, and one pool handle per (pool, node)."""

from __future__ import annotations

import pytest

from tract.errors import ConfigError
from tract.integrations import common
from tract.pool import Pool
from tract.transfer import KVLayout


def test_options_read_prefixed_keys_and_refuse_bad_ones():
    opts = common.options({"tract.pool": "/dev/dax0.0", "tract.node": "3", "tract.salt": 7,
                           "tract.checksum": "false", "tract.timeout": "2.5", "other": 1},
                          "LMCache extra_config", "tract.")
    assert opts == common.Options(pool="/dev/dax0.0", node=3, manager=False, checksum=False,
                                  salt="7", timeout=2.5)
    assert common.options({"pool": "p", "node": 0, "model_id": "m"}, "vLLM").node == 0
    for config, match in [({"tract.node": 1}, "needs 'tract.pool'"),
                          ({"tract.pool": "p"}, "needs 'tract.node'"),
                          ({"tract.pool": "p", "tract.node": -1}, "non-negative int"),
                          ({"tract.pool": "p", "tract.node": True}, "non-negative int"),
                          ({"tract.pool": "p", "tract.node": 1, "tract.nod": 2},
                           r"unknown tract option\(s\) \['tract.nod'\]"),
                          ({"tract.pool": "p", "tract.node": 1, "tract.timeout": "soon"},
                           "timeout must be a number"),
                          ({"tract.pool": "p", "tract.node": 1, "tract.timeout": 0},
                           "timeout must be positive"),
                          ({"tract.pool": "p", "tract.node": 1, "tract.manager": "yes"},
                           "manager must be true or false")]:
        with pytest.raises(ConfigError, match=match):
            common.options(config, "LMCache extra_config", "tract.")


def test_adapters_of_one_process_share_one_pool_handle(pool_path):
    Pool.create(pool_path, 16 << 20, max_nodes=2)
    first = common.open_pool(pool_path, 1, manager=True)
    second = common.open_pool(pool_path, 1, manager=False)
    assert first is second
    common.close_pool(pool_path, 1)
    assert (pool_path, 1) in common._pools  # the second user still holds it
    common.close_pool(pool_path, 1)
    assert (pool_path, 1) not in common._pools
    common.close_pool(pool_path, 1)  # once too often: nothing to do


def test_a_connector_that_cannot_be_made_closes_its_pool_handle(pool_path, monkeypatch):
    Pool.create(pool_path, 16 << 20, max_nodes=2)
    opts = common.Options(pool=pool_path, node=1)
    layout = KVLayout(model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=8,
                      block_size=16)
    connector = common.open_connector(opts, layout)
    assert connector.layout == layout
    connector.close()
    common.close_pool(pool_path, 1)

    def broken(*args, **kwargs):
        raise RuntimeError("no connector")
    monkeypatch.setattr("tract.connector.Connector", broken)
    with pytest.raises(RuntimeError, match="no connector"):
        common.open_connector(opts, layout)
    assert (pool_path, 1) not in common._pools
