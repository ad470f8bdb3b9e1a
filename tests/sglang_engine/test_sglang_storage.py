"""tract's SGLang HiCache storage backend against the real package
(sglang 0.5.23, `make test-sglang`): built by SGLang's dynamic backend
loader, registered SGLang's own host KV pools (MHA and MLA, every
supported layout), keyed by SGLang's own page hashes, and driven end to
end by SGLang's own HiCacheController (backup and prefetch threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed "
                    "here (make test-sglang builds its environment)")

import sgl_engine as engine  # noqa: E402
import torch  # noqa: E402

from tract.errors import ConfigError  # noqa: E402
from tract.fsck import fsck  # noqa: E402
from tract.integrations.sglang import TractHiCacheStorage  # noqa: E402
from tract.pool import Pool  # noqa: E402

HERE = Path(__file__).parent
KINDS = [(kind, layout) for kind in ("mha", "mla") for layout in engine.LAYOUTS]


@pytest.fixture
def pool_path(pool_path):
    """The conftest's fresh /dev/shm path (removed after the test), with a pool."""
    Pool.create(pool_path, 64 << 20, max_nodes=4, lease_timeout=2.0)
    return pool_path


def test_the_dynamic_loader_builds_the_backend(pool_path):
    made = engine.backend(pool_path, 1, "mha", "page_first")
    try:
        assert type(made) is TractHiCacheStorage
        assert made.layout.engine_layout == "sglang:mha:page_first"
        assert made.layout.block_bytes == made.mem_pool_host.get_size_per_token() * engine.PAGE
    finally:
        made.close()


@pytest.mark.parametrize("kind,layout", KINDS)
def test_zero_copy_and_flat_pages_round_trip_byte_exact(pool_path, kind, layout):
    host = engine.host_pool(kind, layout)
    made = engine.backend(pool_path, 1, kind, layout, host)
    try:
        _, keys = engine.page_keys(seed=1, pages=6)
        source = engine.fill(host, keys[:5])
        assert made.batch_set_v1(keys[:5], source) == [True] * 5
        assert made.batch_exists(keys) == 5 and made.exists(keys[0]) and not made.exists(keys[5])
        slots = host.alloc(6 * engine.PAGE)
        assert made.batch_get_v1(keys, slots) == [True] * 5 + [False]
        assert engine.exact(host, keys[:5], slots) == [True] * 5
        # the flat interface reads the same bytes the zero-copy one wrote, and back
        flats = [host.get_dummy_flat_data_page() for _ in range(5)]
        got = made.batch_get(keys[:5], flats)
        assert all(torch.equal(page, engine.page_bytes(host, key))
                   for page, key in zip(got, keys[:5]))
        assert made.get(keys[5], host.get_dummy_flat_data_page()) is None
        assert made.set(keys[5], engine.page_bytes(host, keys[5]))
        again = host.alloc(engine.PAGE)
        assert made.batch_get_v1(keys[5:], again) == [True]
        assert engine.exact(host, keys[5:], again) == [True]
        assert made.get_stats() is None  # SGLang asked for no storage metrics
    finally:
        made.close()
    assert fsck(pool_path, watch=False)["ok"]


def test_layouts_and_tensor_parallel_ranks_never_share_pages(pool_path):
    _, keys = engine.page_keys(seed=2, pages=3)
    first = engine.host_pool("mha", "page_first")
    writer = engine.backend(pool_path, 1, "mha", "page_first", first)
    others = [engine.backend(pool_path, 1, "mha", "layer_first"),
              engine.backend(pool_path, 1, "mha", "page_first", tp_rank=1, tp_size=2),
              engine.backend(pool_path, 1, "mha", "page_first", model_id="another/model")]
    try:
        assert writer.batch_set_v1(keys, engine.fill(first, keys)) == [True] * 3
        assert writer.batch_exists(keys) == 3
        assert [other.batch_exists(keys) for other in others] == [0, 0, 0]
    finally:
        for made in [writer, *others]:
            made.close()


def test_mla_pages_are_one_copy_every_rank_reads(pool_path):
    _, keys = engine.page_keys(seed=3, pages=3)
    host = engine.host_pool("mla", "page_first")
    rank0 = engine.backend(pool_path, 1, "mla", "page_first", host, tp_rank=0, tp_size=2)
    rank1_host = engine.host_pool("mla", "page_first")
    rank1 = engine.backend(pool_path, 1, "mla", "page_first", rank1_host, tp_rank=1, tp_size=2)
    try:
        assert rank0.batch_set_v1(keys, engine.fill(host, keys)) == [True] * 3
        slots = rank1_host.alloc(3 * engine.PAGE)
        assert rank1.batch_get_v1(keys, slots) == [True] * 3
        assert engine.exact(rank1_host, keys, slots) == [True] * 3
    finally:
        rank0.close()
        rank1.close()


def test_a_corrupted_page_ends_the_leading_hits(pool_path):
    host = engine.host_pool("mha", "page_first_direct")
    made = engine.backend(pool_path, 1, "mha", "page_first_direct", host)
    try:
        _, keys = engine.page_keys(seed=4, pages=4)
        assert made.batch_set_v1(keys, engine.fill(host, keys)) == [True] * 4
        hits = made.pool.index.pin(made._keys(keys[1:2]))
        offset = int(hits.offsets[0]) + 10
        made.pool.index.unpin(hits)
        region = made.pool.region
        region.copy_in(offset, bytes([region.read(offset, 1)[0] ^ 0x40]))  # flushed
        slots = host.alloc(4 * engine.PAGE)
        assert made.batch_get_v1(keys, slots) == [True, False, False, False]
        assert engine.exact(host, keys[:1], slots) == [True]
        assert made.connector.stats["checksum_failures"] == 1
    finally:
        made.close()


def test_a_prefix_stored_on_one_node_is_found_from_another_process_and_node(pool_path):
    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = [sys.executable, str(HERE / "sgl_engine.py")]
    put = subprocess.run([*run, "put", pool_path, "1", "9", "mha", "layer_first"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert put.returncode == 0, put.stderr[-3000:]
    assert json.loads(put.stdout.splitlines()[-1]) == {"stored": [True] * 6}
    got = subprocess.run([*run, "get", pool_path, "2", "9", "mha", "layer_first"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout.splitlines()[-1]) == {
        "exists": 6, "loaded": [True] * 6, "exact": [True] * 6, "node": 2}
    assert fsck(pool_path, watch=False)["ok"]


def _drain(queue, until, timeout=60.0):
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            item = queue.get(timeout=0.2)
        except Exception:
            continue
        seen.append(item)
        if until(item):
            return item, seen
    raise TimeoutError(f"no matching item among {len(seen)} from SGLang's queue")


@pytest.mark.parametrize("kind,layout,interface_v1", [("mha", "page_first", 1),
                                                      ("mha", "layer_first", 0),
                                                      ("mla", "layer_first", 1)])
def test_sglangs_cache_controller_backs_up_and_prefetches_through_tract(pool_path, kind,
                                                                        layout, interface_v1):
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    publish(ServerArgs(model_path="dummy"), role="test")  # SGLang's own test context: tp = pp = 1
    device = engine.device_pool(kind)
    allocator = PagedTokenToKVPoolAllocator(device.size, engine.PAGE, engine.DTYPE, "cpu", device,
                                            need_sort=False)
    host = engine.host_pool(kind, layout, device)
    controller = HiCacheController(
        allocator, host, engine.PAGE, tp_group=None, load_cache_event=threading.Event(),
        io_backend="direct", storage_backend="dynamic", model_name=engine.MODEL,
        storage_backend_extra_config=engine.extra_config(pool_path, 1, interface_v1=interface_v1))
    try:
        assert type(controller.storage_backend) is TractHiCacheStorage
        tokens, keys = engine.page_keys(seed=5, pages=5)
        source = engine.fill(host, keys)
        controller.write_storage(source, tokens, hash_value=keys)
        backup, _ = _drain(controller.ack_backup_queue, lambda op: True)
        assert backup.completed_tokens == 5 * engine.PAGE
        controller.prefetch("req-1", tokens, last_hash=None)
        hit, _ = _drain(controller.prefetch_hit_queue, lambda op: True)
        assert hit.storage_hit_count == 5 * engine.PAGE
        hit.host_indices = controller.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
        controller.prefetch_buffer.put(hit)
        _, acks = _drain(controller.ack_prefetch_queue, lambda ack: bool(ack.completed_req))
        assert max(ack.completed_tokens or 0 for ack in acks) == 5 * engine.PAGE
        assert engine.exact(host, keys, hit.host_indices) == [True] * 5
    finally:
        controller.detach_storage_backend()


def test_storage_metrics_when_sglang_asks(pool_path):
    host = engine.host_pool("mha", "page_first")
    made = engine.backend(pool_path, 1, "mha", "page_first", host, metrics=True)
    try:
        _, keys = engine.page_keys(seed=6, pages=3)
        made.batch_set_v1(keys, engine.fill(host, keys))
        made.batch_get_v1(keys[:2], host.alloc(2 * engine.PAGE))
        metrics = made.get_stats()
        assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [2]
        assert len(metrics.backup_bandwidth) == 1 and metrics.backup_bandwidth[0] > 0
        assert made.get_stats().prefetch_pgs == []  # since the last call
    finally:
        made.close()


def test_bad_config_and_bad_calls_are_refused_by_name(pool_path):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = engine.storage_config(pool_path, 1, "mha", "page_first")
    config.extra_config.pop("pool")
    with pytest.raises(ConfigError, match="needs 'pool'"):
        StorageBackendFactory.create_backend("dynamic", config, None)
    config = engine.storage_config(pool_path, 1, "mha", "page_first")
    config.extra_config["node"] = "three"
    with pytest.raises(ConfigError, match="node must be a non-negative int"):
        StorageBackendFactory.create_backend("dynamic", config, None)
    host = engine.host_pool("mha", "page_first")
    made = engine.backend(pool_path, 1, "mha", "page_first", host)
    try:
        _, keys = engine.page_keys(seed=7, pages=2)
        assert made.batch_set_v1(keys, host.alloc(engine.PAGE)) == [False, False]  # logged
        assert made.batch_get_v1(["not hex", "zz"], host.alloc(2 * engine.PAGE)) == [False] * 2
        with pytest.raises(ValueError, match="flat page tensors"):
            made.batch_get(keys, None)
        with pytest.raises(ConfigError, match="another layout"):
            made.register_mem_pool_host(engine.host_pool("mha", "layer_first"))
    finally:
        made.close()
    unregistered = TractHiCacheStorage(engine.storage_config(pool_path, 1, "mha", "page_first"))
    assert unregistered.batch_exists(keys) == 0  # logged: no host pool yet
