"""tract's LMCache storage plugin against the real package (lmcache 0.5.6,
`make test-lmcache`): loaded by LMCache's own plugin loader and driven
through LMCache's own StorageManager, keys from LMCache's own token
database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="lmcache is not installed here "
                    "(make test-lmcache builds its environment)")

import torch  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402

import lmc_engine as engine  # noqa: E402
from tract.errors import ConfigError  # noqa: E402
from tract.integrations.lmcache import TractStoragePlugin  # noqa: E402
from tract.fsck import fsck  # noqa: E402
from tract.pool import Pool  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture
def pool_path(pool_path):
    """The conftest's fresh /dev/shm path (removed after the test), with a pool."""
    Pool.create(pool_path, 64 << 20, max_nodes=4, lease_timeout=2.0)
    return pool_path


@pytest.fixture
def sm(pool_path):
    manager = engine.manager(pool_path, 1)
    yield manager
    manager.close()


def _plugin(sm) -> TractStoragePlugin:
    assert engine.PLUGIN in sm.storage_backends, "LMCache did not load the plugin (see its log)"
    plugin = sm.storage_backends[engine.PLUGIN]
    assert type(plugin) is TractStoragePlugin
    return plugin


def test_lmcache_loads_the_plugin_with_its_allocator(sm):
    plugin = _plugin(sm)
    assert plugin.get_allocator_backend() is sm.storage_backends["LocalCPUBackend"]
    assert plugin.layout.block_bytes == sm.metadata.get_shapes()[0].numel() * 2  # bfloat16
    assert plugin.layout.namespace().startswith(f"kv:{engine.MODEL}:")


def test_put_contains_get_through_the_storage_manager(sm):
    plugin = _plugin(sm)
    chunk_keys = engine.keys(sm, seed=1, chunks=5)
    engine.put(sm, chunk_keys[:4])
    assert plugin.get_stats()["stored_blocks"] == 4
    assert sm.contains(chunk_keys[0]) == engine.PLUGIN
    assert sm.contains(chunk_keys[4]) is None
    hits, _ = sm.batched_contains(chunk_keys, search_range=[engine.PLUGIN])
    assert hits == 4
    assert engine.exact(sm, chunk_keys[:4], sm.batched_get(chunk_keys[:4],
                                                             location=engine.PLUGIN)) == [True] * 4
    got = plugin.batched_get_blocking([chunk_keys[0], chunk_keys[4], chunk_keys[2]])
    assert got[1] is None and engine.exact(sm, [chunk_keys[0], chunk_keys[2]],
                                           [got[0], got[2]]) == [True, True]
    engine.put(sm, chunk_keys[:4])  # present already: nothing copied again
    assert plugin.get_stats()["stored_blocks"] == 4
    assert sm.memcheck()


def test_pins_hold_a_chunk_against_remove(sm):
    plugin = _plugin(sm)
    chunk_keys = engine.keys(sm, seed=2, chunks=3)
    engine.put(sm, chunk_keys)
    hits, _ = sm.batched_contains(chunk_keys[:2], search_range=[engine.PLUGIN], pin=True)
    assert hits == 2
    assert plugin.remove(chunk_keys[0], force=False) is False
    assert sm.remove(chunk_keys[0], [engine.PLUGIN]) == 0  # pinned: a reader may be copying
    sm.batched_unpin(chunk_keys[:2], [engine.PLUGIN])
    assert plugin.unpin(chunk_keys[0]) is False  # nothing left to unpin
    assert sm.remove(chunk_keys[0], [engine.PLUGIN]) == 1
    assert sm.batched_remove(chunk_keys[1:], [engine.PLUGIN]) == 2
    assert sm.contains(chunk_keys[1]) is None
    assert plugin.pin(chunk_keys[0]) is False


def test_a_chunk_stored_by_one_instance_is_found_by_another_on_another_node(pool_path):
    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = [sys.executable, str(HERE / "lmc_engine.py")]
    put = subprocess.run([*run, "put", pool_path, "1", "7"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert put.returncode == 0, put.stderr[-3000:]
    assert json.loads(put.stdout.splitlines()[-1]) == {"stored": 6}
    got = subprocess.run([*run, "get", pool_path, "2", "7"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout.splitlines()[-1]) == {"hits": 6, "exact": [True] * 6, "node": 2}
    assert fsck(pool_path, watch=False)["ok"]


def test_a_corrupted_chunk_is_a_miss_never_wrong_bytes(sm):
    plugin = _plugin(sm)
    chunk_keys = engine.keys(sm, seed=3, chunks=3)
    engine.put(sm, chunk_keys)
    _, tract_keys = plugin._keys(chunk_keys[1:2])
    hits = plugin.pool.index.pin(tract_keys)
    offset = hits.offsets[0] + 100
    plugin.pool.index.unpin(hits)
    region = plugin.pool.region
    region.copy_in(int(offset), bytes([region.read(int(offset), 1)[0] ^ 1]))  # flushed
    got = plugin.batched_get_blocking(chunk_keys)
    assert got[1] is None
    assert engine.exact(sm, [chunk_keys[0], chunk_keys[2]], [got[0], got[2]]) == [True, True]
    assert plugin.get_stats()["checksum_failures"] >= 1


def test_other_shapes_and_dtypes_are_not_stored_nor_shared(pool_path, sm):
    plugin = _plugin(sm)
    chunk_keys = engine.keys(sm, seed=4, chunks=2)
    short = sm.allocate(torch.Size([2, engine.LAYERS, engine.CHUNK // 2, engine.HEADS * engine.HEAD]),
                        torch.bfloat16, fmt=MemoryFormat.KV_2LTD)
    sm.batched_put(chunk_keys[:1], [short])
    assert plugin.get_stats()["skipped"] == 1 and sm.contains(chunk_keys[0]) is None
    engine.put(sm, chunk_keys)
    other = engine.manager(pool_path, 2, meta=engine.metadata(dtype=torch.float16))
    try:
        assert _plugin(other).layout.namespace() != plugin.layout.namespace()
        assert other.contains(engine.keys(other, seed=4, chunks=2)[0]) is None
    finally:
        other.close()


def test_async_prefetch_loads_the_leading_hits(pool_path):
    import asyncio
    import threading

    from lmcache.v1.event_manager import EventManager, EventStatus, EventType
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    class LookupServer:  # what StorageManager tells the scheduler
        def __init__(self):
            self.done, self.responses = threading.Event(), []

        def send_response_to_scheduler(self, lookup_id, retrieved):
            self.responses.append((lookup_id, int(retrieved)))
            self.done.set()

    server, events = LookupServer(), EventManager()
    sm = StorageManager(engine.config(pool_path, 1, enable_async_loading=True),
                        engine.metadata(), event_manager=events, async_lookup_server=server)
    try:
        chunk_keys = engine.keys(sm, seed=5, chunks=4)
        engine.put(sm, chunk_keys[:3])
        ends = [engine.CHUNK * i for i in range(5)]
        asyncio.run_coroutine_threadsafe(sm.async_lookup_and_prefetch(
            "req-1", chunk_keys, ends, None, pin=False), sm.loop).result(timeout=30)
        assert server.done.wait(30) and server.responses == [("req-1", 3 * engine.CHUNK)]
        assert events.get_event_status(EventType.LOADING, "req-1") == EventStatus.DONE
        loaded = [obj for tier in events.pop_event(EventType.LOADING, "req-1").result()
                  for _, obj in tier]
        assert engine.exact(sm, chunk_keys[:3], loaded) == [True] * 3
    finally:
        sm.close()


def test_bad_options_are_refused_by_name(pool_path):
    meta = engine.metadata()
    for options, match in [({"tract.node": "x"}, "node must be a non-negative int"),
                           ({"tract.nodes": 1}, "unknown tract option"),
                           ({"tract.timeout": -1}, "timeout must be positive"),
                           ({"tract.checksum": "maybe"}, "checksum must be true or false")]:
        with pytest.raises(ConfigError, match=match):
            TractStoragePlugin(config=engine.config(pool_path, 1, options=options), metadata=meta)
    bare = engine.config(pool_path, 1)
    bare.extra_config = {"tract.node": 1}
    with pytest.raises(ConfigError, match="needs 'tract.pool'"):
        TractStoragePlugin(config=bare, metadata=meta)
    with pytest.raises(ConfigError, match="use_layerwise"):
        TractStoragePlugin(config=engine.config(pool_path, 1, use_layerwise=True), metadata=meta)


def test_closing_releases_pins_and_the_pool(pool_path):
    sm = engine.manager(pool_path, 1)
    chunk_keys = engine.keys(sm, seed=6, chunks=2)
    engine.put(sm, chunk_keys)
    assert sm.batched_contains(chunk_keys, search_range=[engine.PLUGIN], pin=True)[0] == 2
    sm.close()
    other = engine.manager(pool_path, 2)
    try:
        assert other.batched_remove(chunk_keys, [engine.PLUGIN]) == 2  # no pin survived close
    finally:
        other.close()
    assert fsck(pool_path, watch=False)["ok"]
