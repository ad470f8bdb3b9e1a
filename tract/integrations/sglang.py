"""SGLang's HiCache L3 storage backend over a tract pool: every SGLang
instance of the rack shares one prefix cache of KV pages.

Loaded by SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tract",
        "module_path": "tract.integrations.sglang",
        "class_name": "TractHiCacheStorage", "interface_v1": 1,
        "pool": "/dev/dax0.0", "node": 3}'

Extra-config keys of tract's (the rest are SGLang's): ``pool`` (pool file
or DAX device, required), ``node`` (this host's node id, required),
``manager`` (run a lock-manager thread here, active or standby; default
false), ``checksum`` (verify every page loaded; default true), ``salt``
(a tenant's salt), ``model_id`` (the name two instances must share to
share pages; default SGLang's model name), ``timeout`` (seconds a pool
lock may be waited for; default 30).

What the backend does (the work is `tract.connector.Connector`'s):

- **Pages** are whole host-pool pages, moved as opaque bytes into one pool
  block.  The zero-copy path (``interface_v1``: `batch_get_v1`,
  `batch_set_v1`) copies straight between the host pool's memory (its
  ``get_page_buffer_meta`` regions, range-checked against the pool's
  buffer) and the pool; the flat path (`get`, `set`, `batch_get`,
  `batch_set`) copies SGLang's flat page tensors.  Both give the same
  bytes (a ``layer_first`` MHA page is ordered as its flat page is: every
  layer's K, then every layer's V), so the two interfaces share pages.
- **Layouts** ``layer_first``, ``page_first`` and ``page_first_direct``,
  for MHA and MLA host pools.  A page's bytes depend on the layout, so the
  namespace fingerprints it, with the model, dtype, page size, layers,
  heads and head size (MLA: the latent width), and the tensor-parallel
  rank and size (MHA: each rank its head shard; MLA: one copy that every
  rank reads, written by SGLang's writer rank), the pipeline stage and
  the context-parallel ranks.
- **Keys** are SGLang's own page hashes (hex SHA-256 chained over the
  prefix), mapped into the namespace by `Connector.digest_keys` one by
  one: each names its whole prefix already.
- **Hits**: `batch_exists` counts the leading pages the pool holds; a
  page that fails its checksum, or was evicted between SGLang's query
  and its get, ends the run of ``True`` `batch_get_v1` returns, and
  SGLang recomputes from there.
- **Failures** never raise into SGLang's storage threads (it would count
  them as misses anyway): they are logged, and the calls report misses
  or failed backups.
- **Stats**: `get_stats` gives SGLang's ``StorageMetrics`` (pages and
  GB/s per call since the last call); the pool keeps every node's
  counters too (``tract stat``).
- `clear` leaves the pool alone: it is the rack's, not one engine's
  (``tract pool`` manages it).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import numpy as np
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from tract.errors import ConfigError
from tract.integrations.common import close_pool, open_connector, options
from tract.transfer import KVLayout

__all__ = ["LAYOUTS", "TractHiCacheStorage", "page_layout"]

log = logging.getLogger(__name__)

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
#: extra-config keys that are SGLang's, not tract's
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "allocator",
                "model_id"}


def page_layout(storage_config, host, model: str | None = None) -> KVLayout:
    """The tract layout (and so the namespace) of one page of ``host``
    (an SGLang host KV pool) under ``storage_config``."""
    if host.layout not in LAYOUTS:
        raise ConfigError(f"TractHiCacheStorage supports the host layouts {list(LAYOUTS)}; "
                          f"this SGLang runs {host.layout!r} (--hicache-mem-layout)")
    if getattr(storage_config, "should_split_heads", False):
        raise ConfigError("TractHiCacheStorage does not split heads across ranks "
                          "(tp_lcm_size): run the same tensor-parallel size everywhere")
    dtype = str(host.dtype).removeprefix("torch.")
    config = storage_config
    variant = (f"pp{config.pp_rank}/{config.pp_size}:cp{config.attn_cp_rank}/"
               f"{config.attn_cp_size}:dcp{getattr(config, 'dcp_rank', 0)}/"
               f"{getattr(config, 'dcp_size', 1)}")
    name = model or config.model_name or "sglang-model"
    if hasattr(host, "kv_cache_dim"):  # MLA: one latent per token, the same on every rank
        return KVLayout(model=name, dtype=dtype, num_layers=host.layer_num, num_kv_heads=1,
                        head_size=int(host.kv_cache_dim), block_size=host.page_size,
                        engine_layout=f"sglang:mla:{host.layout}", kv_parts=1, variant=variant)
    if getattr(host, "v_head_dim", host.head_dim) != host.head_dim:
        raise ConfigError(f"TractHiCacheStorage needs K and V of one head size; this model has "
                          f"{host.head_dim} and {host.v_head_dim}")
    return KVLayout(model=name, dtype=dtype, num_layers=host.layer_num,
                    num_kv_heads=host.head_num, head_size=host.head_dim,
                    block_size=host.page_size, engine_layout=f"sglang:mha:{host.layout}",
                    tp_rank=config.tp_rank, tp_size=config.tp_size, variant=variant)


def _view(pointer: int, size: int) -> np.ndarray:
    """A writable byte array over ``size`` bytes of host memory at ``pointer``."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(pointer))


class TractHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage backend over a tract pool (see the module
    docstring).  SGLang's storage threads call it concurrently: one lock
    orders the calls."""

    def __init__(self, storage_config, kwargs=None):
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.options = options({k: v for k, v in extra.items() if k not in _SGLANG_KEYS},
                               "TractHiCacheStorage's --hicache-storage-backend-extra-config")
        self.model = extra.get("model_id")
        self.metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.connector = None
        self.mem_pool_host = None
        self._lock = threading.Lock()
        self._calls = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                       "backup_bandwidth": []}
        # the host pool comes next, by register_mem_pool_host (SGLang's dynamic
        # loader passes ``kwargs`` as an empty dict)

    # ------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host) -> None:
        layout = page_layout(self.storage_config, mem_pool_host, self.model)
        with self._lock:
            if self.connector is not None:
                if layout != self.connector.layout:
                    raise ConfigError(f"TractHiCacheStorage was registered a second host pool "
                                      f"of another layout ({layout} after "
                                      f"{self.connector.layout})")
                self.mem_pool_host = mem_pool_host
                return
            super().register_mem_pool_host(mem_pool_host)
            self.connector = open_connector(self.options, layout)
        self.layout = layout
        self.pool = self.connector.pool
        self._mha_layer_first = layout.kv_parts == 2 and mem_pool_host.layout == "layer_first"
        buffer = mem_pool_host.kv_buffer
        buffers = buffer if isinstance(buffer, (list, tuple)) else [buffer]
        self._ranges = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
                              for b in buffers)

    def _ready(self):
        if self.connector is None:
            raise ConfigError("TractHiCacheStorage has no host pool yet "
                              "(SGLang calls register_mem_pool_host first)")
        return self.connector

    # ------------------------------------------------------------- keys

    def _keys(self, keys) -> np.ndarray:
        try:
            digests = [bytes.fromhex(key) for key in keys]
        except (TypeError, ValueError):
            raise ValueError(f"SGLang page keys are hex digests; got {list(keys)[:3]!r}") \
                from None
        return self._ready().digest_keys(digests, chained=False)

    def _pages(self, keys, host_indices) -> list[list[np.ndarray]]:
        """Each page of ``host_indices`` as its host-memory regions, in
        the page's byte order, each checked to lie in the host pool."""
        host, count = self.mem_pool_host, len(keys)
        if host_indices.numel() != count * host.page_size:
            raise ValueError(f"{count} page keys but {host_indices.numel()} host indices "
                             f"(page size {host.page_size})")
        pointers, sizes = host.get_page_buffer_meta(host_indices)
        per = len(pointers) // count if count else 0
        if per * count != len(pointers) or len(sizes) != len(pointers):
            raise ValueError(f"the host pool gave {len(pointers)} regions for {count} pages")
        pages = []
        for page in range(count):
            regions = list(zip(pointers[page * per:(page + 1) * per],
                               sizes[page * per:(page + 1) * per]))
            if self._mha_layer_first:  # (K, V) per layer -> every K, then every V: the flat order
                regions = regions[0::2] + regions[1::2]
            for pointer, size in regions:
                if not any(low <= pointer and pointer + size <= high for low, high in self._ranges):
                    raise ValueError(f"host region [{pointer:#x}, +{size}) of page {page} is "
                                     f"outside the host pool's memory")
            pages.append([_view(pointer, size) for pointer, size in regions])
        return pages

    # ------------------------------------------------- zero-copy (v1)

    def batch_exists(self, keys, extra_info=None) -> int:
        if not keys:
            return 0
        try:
            with self._lock:
                return self._ready().lookup(self._keys(keys)) // self.layout.block_size
        except Exception:
            log.exception("tract: batch_exists failed; reporting no hits")
            return 0

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._move(keys, lambda: self._pages(keys, host_indices), load=True)

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._move(keys, lambda: self._pages(keys, host_indices), load=False)

    def _move(self, keys, blocks, load: bool) -> list[bool]:
        """Load (or store) the pages ``blocks()`` gives for ``keys``; which
        pages are good: the leading loaded ones, or all stored (present
        already or published) or none."""
        if not keys:
            return []
        start = time.perf_counter()
        try:
            with self._lock:
                connector, tract_keys = self._ready(), self._keys(keys)
                if load:
                    done = connector.load(tract_keys, blocks())
                    ok = [row < done for row in range(len(keys))]
                else:  # the pages a full pool could not take are not backed up
                    ok = connector.store_each(tract_keys, blocks()).kept.tolist()
                    done = sum(ok)
        except Exception:
            log.exception("tract: %s of %d pages failed", "load" if load else "store", len(keys))
            return [False] * len(keys)
        if self.metrics and done:
            seconds = max(time.perf_counter() - start, 1e-9)
            kind = "prefetch" if load else "backup"
            self._calls[f"{kind}_pgs"].append(done)
            self._calls[f"{kind}_bandwidth"].append(done * self.layout.block_bytes / seconds / 1e9)
        return ok

    # --------------------------------------------------------- flat pages

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        if target_locations is None or len(target_locations) != len(keys) or \
                any(target is None for target in target_locations):
            raise ValueError("TractHiCacheStorage.batch_get copies into the flat page tensors "
                             "SGLang passes (one per key)")
        good = self._move(keys, lambda: list(target_locations), load=True)
        return [target if ok else None for target, ok in zip(target_locations, good)]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("TractHiCacheStorage.batch_set stores the flat page tensors "
                             "SGLang passes (one per key)")
        return all(self._move(keys, lambda: [value.contiguous() for value in values],
                              load=False))

    # ------------------------------------------------------------- rest

    def get_stats(self):
        """SGLang's StorageMetrics of the calls since the last call (None
        unless SGLang asked for storage metrics)."""
        if not self.metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._lock:
            for name, values in self._calls.items():
                getattr(metrics, name).extend(values)
                values.clear()
        return metrics

    def clear(self) -> None:
        log.warning("tract: SGLang asked to clear its storage; the pool is the rack's and "
                    "stays (tract pool commands manage it)")

    def close(self) -> None:
        with self._lock:
            connector, self.connector = self.connector, None
        if connector is not None:
            try:
                connector.close()
            finally:
                close_pool(self.options.pool, self.options.node)
