"""LMCache's storage plugin over a tract pool: one more tier under LMCache,
shared by every LMCache instance of the rack.

Enabled in LMCache's config (YAML, or ``LMCACHE_*`` environment)::

    chunk_size: 256
    max_local_cpu_size: 5            # LMCache's CPU buffer: the plugin's allocator
    storage_plugins: ["tract"]
    extra_config:
      storage_plugin.tract.module_path: tract.integrations.lmcache
      storage_plugin.tract.class_name: TractStoragePlugin
      tract.pool: /dev/dax0.0          # pool file or DAX device (required)
      tract.node: 3                    # this host's node id (required)
      tract.salt: tenant-a             # optional: only the same salt shares blocks
      tract.checksum: true             # optional: verify every chunk loaded
      tract.manager: false             # optional: run a lock-manager thread here
      tract.timeout: 30                # optional: seconds a pool lock may be waited for

(the plugin's name, ``tract`` above, is the user's; the ``tract.`` option
keys are not).  LMCache logs and then ignores a plugin whose constructor
raises, so a bad option shows only as an error line in its log.

What the plugin does (the work is `tract.connector.Connector`'s):

- **Chunks** are whole LMCache memory objects: one chunk of
  ``chunk_size`` tokens in the engine's format (``KV_2LTD``,
  ``[2, layers, tokens, hidden]``; ``KV_MLA_FMT`` for MLA models), moved
  as opaque bytes into one pool block.  The layout (model, dtype, the
  chunk's shape and format, the worker's rank and world size) is the
  namespace: only identical configurations share a chunk.  Objects of
  another shape (an unfull last chunk, with ``save_unfull_chunk``; a
  layer-wise chunk) are not stored: they are counted (``skipped``) and
  LMCache recomputes them.
- **Keys** are LMCache's own keys (``CacheEngineKey.to_string()``: model,
  world size, worker, the chained chunk hash, dtype, tags), digested and
  mapped into the namespace by `Connector.digest_keys`.  LMCache's default
  chunk hash (``pre_caching_hash_algorithm: builtin``) hashes token ids,
  which is the same in every process; a string-salted hash needs one
  ``PYTHONHASHSEED`` rack-wide.
- **Puts** are synchronous: the bytes are in the pool (flushed, published)
  when `batched_submit_put_task` returns, since LMCache drops its objects
  right after.  A chunk the pool has already is not copied again.
- **Gets** allocate from LMCache's CPU backend and copy in; a chunk that
  fails its checksum, or was evicted meanwhile, is a miss.
- **Pins** (``contains(pin=True)``, `pin`, `unpin`) are pool pins of this
  node: another node's eviction skips them, and a crashed worker's pins
  lapse with its lease.  `remove` deletes a chunk no live node pins
  (``force`` cannot override another reader's pin: it may be copying).
- **Stats**: `get_stats` (this process's counts); the pool keeps every
  node's too (``tract stat``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence

import numpy as np
import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from tract.errors import ConfigError
from tract.integrations.common import close_pool, open_connector, options
from tract.transfer import KVLayout

__all__ = ["TractStoragePlugin", "chunk_layout"]

log = logging.getLogger(__name__)


def chunk_layout(metadata, fmt: MemoryFormat) -> KVLayout:
    """The tract layout of one full LMCache chunk of ``metadata``'s engine
    (``[parts, layers, tokens, hidden]``: a piece per part and layer)."""
    shapes, dtypes = metadata.get_shapes(), metadata.get_dtypes()
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ConfigError(f"TractStoragePlugin stores single-group KV chunks; this engine has "
                          f"{len(shapes)} KV layer groups")
    parts, layers, tokens, hidden = (int(n) for n in shapes[0])
    return KVLayout(model=str(metadata.model_name), dtype=str(dtypes[0]).removeprefix("torch."),
                    num_layers=layers, num_kv_heads=1, head_size=hidden, block_size=tokens,
                    engine_layout=f"lmcache:{fmt.name}", tp_rank=int(metadata.worker_id),
                    tp_size=int(metadata.world_size), kv_parts=parts)


def _digest(key) -> bytes:
    return hashlib.blake2b(key.to_string().encode(), digest_size=16).digest()


class TractStoragePlugin(StoragePluginInterface):
    """LMCache storage plugin over a tract pool (see the module docstring)."""

    def __init__(self, dst_device: str = "cpu", config=None, metadata=None,
                 local_cpu_backend=None, loop=None):
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if config is None or metadata is None:
            raise ConfigError("TractStoragePlugin needs LMCache's config and metadata")
        if getattr(config, "use_layerwise", False):
            raise ConfigError("TractStoragePlugin stores whole chunks; LMCache's use_layerwise "
                              "mode moves layers one by one: turn it off")
        self.options = options(config.extra_config or {}, "LMCache extra_config", "tract.")
        self.fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        self.layout = chunk_layout(metadata, self.fmt)
        self.shape = torch.Size(metadata.get_shapes()[0])
        self.dtype = metadata.get_dtypes()[0]
        self.connector = open_connector(self.options, self.layout)
        self.pool = self.connector.pool
        self._pins: dict[bytes, list] = {}  # digest -> this plugin's Hits on it
        self._lock = threading.Lock()  # LMCache calls from its loop thread and the engine's
        self._closed = False
        self.skipped = 0  # objects of another shape or format, not stored

    # ------------------------------------------------------------- keys

    def _keys(self, keys: Sequence) -> tuple[list[bytes], np.ndarray]:
        digests = [_digest(key) for key in keys]
        return digests, self.connector.digest_keys(digests, chained=False)

    def _fits(self, obj) -> bool:
        return (obj.get_memory_format() == self.fmt and obj.get_shape() == self.shape
                and obj.get_dtype() == self.dtype)

    # ------------------------------------------------------------- puts

    def batched_submit_put_task(self, keys, objs, transfer_spec=None,
                                on_complete_callback=None):
        if len(keys) != len(objs):
            raise ValueError(f"{len(keys)} keys but {len(objs)} memory objects")
        fits = [i for i, obj in enumerate(objs) if self._fits(obj)]
        if len(fits) < len(objs):
            if not self.skipped:
                odd = next(obj for obj in objs if not self._fits(obj))
                log.warning("tract: not storing LMCache chunks of shape %s %s (%s); this "
                            "plugin stores full chunks %s %s (%s)",
                            tuple(odd.get_shape()), odd.get_dtype(), odd.get_memory_format(),
                            tuple(self.shape), self.dtype, self.fmt)
            self.skipped += len(objs) - len(fits)
        if fits:
            _, tract_keys = self._keys([keys[i] for i in fits])
            with self._lock:  # a chunk a full pool could not take is not stored, nor reported
                kept = self.connector.store_each(tract_keys, [objs[i].tensor for i in fits]).kept
            if on_complete_callback is not None:
                for i in np.asarray(fits)[kept].tolist():
                    on_complete_callback(keys[i])
        return None

    def exists_in_put_tasks(self, key) -> bool:
        return False  # puts finish before batched_submit_put_task returns

    # ----------------------------------------------------- contains, pins

    def contains(self, key, pin: bool = False) -> bool:
        return self._contains([key], pin) == 1

    def batched_contains(self, keys, pin: bool = False) -> int:
        return self._contains(keys, pin)

    async def batched_async_contains(self, lookup_id, keys, pin: bool = False) -> int:
        return self._contains(keys, pin)

    def _contains(self, keys, pin: bool) -> int:
        """How many of ``keys`` the pool holds, from the first on (pinned
        if ``pin``)."""
        digests, tract_keys = self._keys(keys)
        with self._lock:
            if not pin:
                return self.connector.lookup(tract_keys) // self.layout.block_size
            hits = self.pool.index.pin(tract_keys)
            for row, digest in enumerate(digests[:len(hits)]):
                self._pins.setdefault(digest, []).append(hits[row])
            return len(hits)

    def pin(self, key) -> bool:
        return self._contains([key], True) == 1

    def unpin(self, key) -> bool:
        digest = _digest(key)
        with self._lock:
            held = self._pins.get(digest)
            if not held:
                return False
            self.pool.index.unpin([held.pop()])
            if not held:
                del self._pins[digest]
            return True

    def remove(self, key, force: bool = True) -> bool:
        _, tract_keys = self._keys([key])
        with self._lock:
            return bool(self.connector.remove(tract_keys)[0])

    # ------------------------------------------------------------- gets

    def get_allocator_backend(self):
        return self.local_cpu_backend

    def get_blocking(self, key):
        return self._get([key], leading=False)[0]

    def batched_get_blocking(self, keys):
        return self._get(keys, leading=False)

    async def batched_get_non_blocking(self, lookup_id, keys, transfer_spec=None):
        return self._get(keys, leading=True)

    def _get(self, keys, leading: bool) -> list:
        """Memory objects for ``keys`` (each owned by the caller), None
        for a miss; with ``leading``, only those before the first miss."""
        if not keys:
            return []
        if self.local_cpu_backend is None:
            raise ConfigError("TractStoragePlugin can get chunks only where LMCache has a CPU "
                              "backend (max_local_cpu_size > 0, not the scheduler)")
        _, tract_keys = self._keys(keys)
        objs: list = [None] * len(keys)
        with self._lock:
            count = self.connector.lookup(tract_keys) // self.layout.block_size
            rows = list(range(count)) if leading else \
                [row for row in range(len(keys)) if row < count
                 or self.connector.lookup(tract_keys[row:row + 1])]
            for row in rows:
                objs[row] = self.local_cpu_backend.allocate(self.shape, self.dtype, self.fmt)
                if objs[row] is None:  # LMCache's CPU buffer is full: the rest are misses
                    rows = rows[:rows.index(row)]
                    break
            done = self._load(tract_keys, rows, objs)
        for row in rows:
            if row not in done:
                objs[row].ref_count_down()
                objs[row] = None
        if leading:
            first_miss = next((row for row, obj in enumerate(objs) if obj is None), len(objs))
            for obj in objs[first_miss:]:
                if obj is not None:
                    obj.ref_count_down()
            return objs[:first_miss]
        return objs

    def _load(self, tract_keys: np.ndarray, rows: list[int], objs: list) -> set[int]:
        """Load the chunks of ``rows`` into their objects: runs of
        consecutive rows in one call each; the rows loaded."""
        done, start = set(), 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and rows[end] == rows[end - 1] + 1:
                end += 1
            first = rows[start]
            loaded = self.connector.load(tract_keys[first:rows[end - 1] + 1],
                                         [objs[row].tensor for row in rows[start:end]])
            done.update(rows[start:start + loaded])
            for row in rows[start + loaded + 1:end]:  # past a miss: one by one
                if self.connector.load(tract_keys[row:row + 1], [objs[row].tensor]):
                    done.add(row)
            start = end
        return done

    # ------------------------------------------------------------- rest

    def get_stats(self) -> dict:
        """This process's counts (`Connector.stats`) and the chunks not stored."""
        return {**self.connector.stats, "skipped": self.skipped}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with self._lock:
                for held in self._pins.values():
                    self.pool.index.unpin(held)
                self._pins.clear()
                self.connector.close()
        finally:
            close_pool(self.options.pool, self.options.node)

    def __str__(self) -> str:
        return f"TractStoragePlugin({self.options.pool}, node {self.options.node})"
