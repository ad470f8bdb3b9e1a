"""LMCache 0.5.6's own storage manager with tract's plugin enabled, for the
real-package tier (`make test-lmcache`), and a child-process entry point
(``python lmc_engine.py put|get POOL NODE SEED``) so two LMCache instances on
two node ids share one pool.

Chunks are made by LMCache's ChunkedTokenDatabase from seeded token ids
(its keys: the chained chunk hashes), their bytes seeded from the key.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.token_database import ChunkedTokenDatabase

PLUGIN = "tract"
CHUNK, LAYERS, HEADS, HEAD = 16, 3, 2, 8
MODEL = "tiny/llama"


def config(pool: str, node: int, local_cpu: bool = False, options: dict | None = None,
           **settings) -> LMCacheEngineConfig:
    """LMCache's config with the plugin on: ``options`` are more tract
    options (``tract.*`` keys), ``settings`` LMCache's own."""
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=local_cpu, max_local_cpu_size=0.0625,
        storage_plugins=[PLUGIN],
        extra_config={f"storage_plugin.{PLUGIN}.module_path": "tract.integrations.lmcache",
                      f"storage_plugin.{PLUGIN}.class_name": "TractStoragePlugin",
                      "tract.pool": pool, "tract.node": node,
                      "tract.manager": True,  # each instance a lock manager, active or standby
                      **(options or {})},
        **settings)


def metadata(dtype=torch.bfloat16, worker: int = 0, world: int = 1) -> LMCacheMetadata:
    return LMCacheMetadata(model_name=MODEL, world_size=world, local_world_size=world,
                           worker_id=worker, local_worker_id=worker, kv_dtype=dtype,
                           kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD), chunk_size=CHUNK)


def manager(pool: str, node: int, local_cpu: bool = False, meta=None,
            options: dict | None = None, **settings) -> StorageManager:
    return StorageManager(config(pool, node, local_cpu, options, **settings),
                          meta or metadata(), event_manager=EventManager())


def keys(sm: StorageManager, seed: int, chunks: int, tokens: np.ndarray | None = None):
    """LMCache's own keys of ``chunks`` full chunks of seeded tokens."""
    if tokens is None:
        tokens = np.random.default_rng(seed).integers(0, 32000, chunks * CHUNK)
    database = ChunkedTokenDatabase(sm.config, sm.metadata)
    return [key for _, _, key in database.process_tokens(tokens=torch.tensor(tokens))]


def payload(sm: StorageManager, key) -> torch.Tensor:
    """The bytes a chunk of ``key`` holds: seeded from its chunk hash."""
    shape = sm.metadata.get_shapes()[0]
    rng = np.random.default_rng(key.chunk_hash & (2**63 - 1))
    return torch.from_numpy(rng.standard_normal(tuple(shape), dtype=np.float32)).to(
        sm.metadata.kv_dtype)


def put(sm: StorageManager, chunk_keys) -> None:
    shape, dtype = sm.metadata.get_shapes()[0], sm.metadata.kv_dtype
    objs = []
    for key in chunk_keys:
        obj = sm.allocate(shape, dtype, fmt=MemoryFormat.KV_2LTD)
        obj.tensor.copy_(payload(sm, key))
        objs.append(obj)
    sm.batched_put(chunk_keys, objs)


def exact(sm: StorageManager, chunk_keys, objs) -> list[bool]:
    out = []
    for key, obj in zip(chunk_keys, objs):
        out.append(obj is not None and torch.equal(obj.tensor, payload(sm, key)))
        if obj is not None:
            obj.ref_count_down()
    return out


def main(argv: list[str]) -> None:
    mode, pool, node, seed = argv[0], argv[1], int(argv[2]), int(argv[3])
    sm = manager(pool, node)
    try:
        assert PLUGIN in sm.storage_backends, "the tract plugin did not load (see the log)"
        chunk_keys = keys(sm, seed, 6)
        if mode == "put":
            put(sm, chunk_keys)
            report = {"stored": sm.storage_backends[PLUGIN].get_stats()["stored_blocks"]}
        else:
            hits, _ = sm.batched_contains(chunk_keys, search_range=[PLUGIN])
            objs = sm.batched_get(chunk_keys, location=PLUGIN)
            report = {"hits": hits, "exact": exact(sm, chunk_keys, objs),
                      "node": sm.storage_backends[PLUGIN].pool.node}
    finally:
        sm.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
