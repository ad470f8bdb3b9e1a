"""vLLM's KV connector (v1) over a tract pool: P/D handoff and a rack-wide
prefix cache for vLLM instances on any node of the rack.

Loaded by vLLM with::

    --kv-transfer-config '{"kv_connector": "TractConnector",
        "kv_connector_module_path": "tract.integrations.vllm",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pool": "/dev/dax0.0", "node": 3}}'

``kv_connector_extra_config`` keys: ``pool`` (pool file or DAX device,
required), ``node`` (this host's node id, required), ``manager`` (run a
lock-manager thread here, active or standby; default false), ``checksum``
(verify every block loaded; default true), ``salt`` (a tenant's salt:
instances share blocks only under the same salt), ``model_id`` (the name
that must match for two instances to share blocks; default the served
model name), ``timeout`` (seconds a pool lock may be waited for; default 30).

What the adapter does (the work is `tract.connector.Connector`'s; this
module only translates):

- **Keys** are vLLM's own ``request.block_hashes``, mapped into tract's
  namespace by `Connector.digest_keys` (nothing is hashed again from the
  tokens).  The namespace fingerprints model, KV dtype, block size, layers,
  KV heads, head size, the cache layout, the tensor-parallel rank and size,
  and the platform (the CPU backend's bytes differ between instruction
  sets): only identical configurations share a block.
- **Scheduler side** (`get_num_new_matched_tokens`): the pool's leading
  hits after vLLM's own prefix hit, never the prompt's last token (vLLM
  computes at least one); `update_state_after_alloc` queues the loads;
  `build_connector_meta` hands the worker those loads and the stores of
  every block that the step completes (producer and both roles).
- **Worker side**: loads run in `start_load_kv`, before the forward pass
  (sync: on the CPU backend the copy is the CPU's own work, and with one
  range per block it runs at memory speed); stores run in `wait_for_save`,
  after the step wrote every layer.  A block moves as opaque bytes, one
  pool range, gathered from and scattered to each layer's tensor (the CPU
  backend's only layout, ``LBHNC``, keeps a block's bytes per layer; on
  other platforms the connector asks for ``BLHNC``, all layers of a block
  in one range).
- **Failures**: a block the scheduler counted that fails to load (evicted
  meanwhile, a checksum mismatch, a writer that died) is reported by
  `get_block_ids_with_load_errors`, so vLLM's ``kv_load_failure_policy``
  applies (``recompute``: the engine recomputes from that block; ``fail``,
  vLLM's default: the request ends with an error).  Blocks a dead
  producer had reserved but not published are never counted: the pool
  reports them as misses.  A full pool never fails a step: the blocks it
  has no room for are not stored (logged once at WARNING, then at DEBUG,
  and counted: ``not_stored``), and the engine serves on.
- **Lifecycle**: no pin outlives a call (loads pin, copy and unpin), so an
  aborted, preempted or finished request holds nothing; `request_finished`
  forgets its state and reports what tract did for it in
  ``kv_transfer_params`` (``tract_external_tokens``,
  ``tract_stored_blocks``); `shutdown` closes the connector and the pool.
- **Metrics**: `get_kv_connector_stats` reports the connector's counts per
  step (`TractConnectorStats`: hits, misses, stored and not stored
  blocks, bytes, checksum failures); the pool keeps every node's counters too
  (`tract stat`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tract.errors import ConfigError
from tract.integrations.common import close_pool, open_connector, options
from tract.transfer import KVLayout

# tract.connector and tract.pool (Numba, LLVM) are imported when a connector
# is made, not with this module: vLLM imports it in every process, and its
# CPU worker's start-up scan of sys.modules (register_triton_kernel_overrides)
# fails on llvmlite's library wrapper when llvmlite is already loaded.

__all__ = ["TractConnector", "TractConnectorMetadata", "TractConnectorStats", "kv_layout"]

log = logging.getLogger(__name__)

#: the connector counts reported per step (`Connector.stats` keys)
STAT_NAMES = ("lookups", "hit_blocks", "miss_blocks", "stored_blocks", "not_stored",
              "read_bytes", "written_bytes", "checksum_failures")


# ------------------------------------------------------------------ layout

def _platform() -> tuple[bool, str]:
    """(whether vLLM runs on its CPU backend, the platform's byte variant)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return True, f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    return False, f"{current_platform.device_name}:{current_platform.get_device_name()}"


def kv_layout(vllm_config, tp_rank: int = 0) -> KVLayout:
    """The tract layout (and so the namespace) of a vLLM configuration's
    KV blocks for tensor-parallel rank ``tp_rank``: the scheduler and
    every worker compute the same one from the same configuration."""
    model, parallel, cache = (vllm_config.model_config, vllm_config.parallel_config,
                              vllm_config.cache_config)
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    dtype = cache.cache_dtype
    if dtype == "auto":
        dtype = str(model.dtype).removeprefix("torch.")
    on_cpu, variant = _platform()
    name = extra.get("model_id") or model.served_model_name or model.model
    if isinstance(name, (list, tuple)):
        name = name[0]
    return KVLayout(model=str(name), dtype=dtype, num_layers=model.get_num_layers(parallel),
                    num_kv_heads=model.get_num_kv_heads(parallel),
                    head_size=model.get_head_size(), block_size=cache.block_size,
                    engine_layout="vllm:LBHNC" if on_cpu else "vllm:BLHNC",
                    tp_rank=tp_rank, tp_size=parallel.tensor_parallel_size, variant=variant)


# ------------------------------------------------------- metadata, stats

@dataclasses.dataclass
class BlockJob:
    """Blocks of one request to load or store: vLLM block ids and their
    tract keys, row for row."""

    request_id: str
    block_ids: list[int]
    keys: np.ndarray  # (n, 2) uint64


@dataclasses.dataclass
class TractConnectorMetadata(KVConnectorMetadata):
    """What one step's worker does: loads before the forward pass, stores
    after it."""

    loads: list[BlockJob] = dataclasses.field(default_factory=list)
    stores: list[BlockJob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TractConnectorStats(KVConnectorStats):
    """The connector's counts over an interval (sums)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = dict.fromkeys(STAT_NAMES, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# --------------------------------------------------------------- connector

class TractConnector(KVConnectorBase_V1):
    """vLLM KV connector v1 over a tract pool (see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config or {}
        self.options = options({k: v for k, v in extra.items() if k != "model_id"},
                               "TractConnector's kv_connector_extra_config")
        self._produces, self._consumes = transfer.is_kv_producer, transfer.is_kv_consumer
        self.block_size = vllm_config.cache_config.block_size
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self.layout = kv_layout(vllm_config, tp_rank)
        self.connector = open_connector(self.options, self.layout)
        self.pool = self.connector.pool
        self._closed = False
        # scheduler side
        self._requests: dict[str, Any] = {}  # request id -> vLLM Request, until finished
        self._local_hit: dict[str, int] = {}  # tokens vLLM had when it asked us
        self._external: dict[str, int] = {}  # tokens we load
        self._stored: dict[str, int] = {}  # leading blocks queued for storing
        self._loads: list[BlockJob] = []
        # worker side
        self._layers: list[torch.Tensor] = []
        self._split = False  # layers laid out (K/V, block, ...), not (block, ...)
        self._load_errors: set[int] = set()
        self._full_warned = False  # a full pool is said once at WARNING, then at DEBUG
        self._reported = dict.fromkeys(STAT_NAMES, 0)

    # ------------------------------------------------------------- keys

    def _keys(self, request, blocks: int) -> np.ndarray:
        """Keys of the request's first ``blocks`` blocks."""
        return self.connector.digest_keys(request.block_hashes[:blocks])

    # --------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self._consumes:
            return 0, False
        first = num_computed_tokens // self.block_size
        usable = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        if usable <= first:
            return 0, False
        hits = self.connector.lookup(self._keys(request, usable)[first:]) // self.block_size
        self._local_hit[request.request_id] = num_computed_tokens
        return hits * self.block_size, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        request_id = request.request_id
        self._requests[request_id] = request
        if num_external_tokens <= 0:
            return
        first = self._local_hit.get(request_id, 0) // self.block_size
        count = num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0][first:first + count]
        keys = self._keys(request, first + count)[first:]
        self._loads.append(BlockJob(request_id, list(block_ids), keys))
        self._external[request_id] = self._external.get(request_id, 0) + num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = TractConnectorMetadata(loads=self._loads)
        self._loads = []
        if not self._produces:
            return meta
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(request_id)
            if request is None:
                continue
            done = min((request.num_computed_tokens + scheduled) // self.block_size,
                       len(request.block_hashes))
            start = self._stored.get(request_id, 0)
            if done <= start:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(request_id)[0][start:done]
            meta.stores.append(BlockJob(request_id, list(block_ids),
                                        self._keys(request, done)[start:]))
            self._stored[request_id] = done
        return meta

    def request_finished(self, request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._requests.pop(request_id, None)
        self._local_hit.pop(request_id, None)
        params = {"tract_external_tokens": self._external.pop(request_id, 0),
                  "tract_stored_blocks": self._stored.pop(request_id, 0)}
        return False, params

    # ------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = list(kv_caches.values())
        if len(layers) != self.layout.num_layers:
            raise ConfigError(f"vLLM registered {len(layers)} KV cache layers; the model "
                              f"config says {self.layout.num_layers}")
        per_layer = self.layout.block_bytes // self.layout.num_layers
        first = layers[0]
        # (blocks, ...) with a block's layer bytes contiguous, or (K/V, blocks, ...)
        self._split = first[0].numel() * first.element_size() != per_layer and \
            first.dim() >= 2 and first.shape[0] == 2
        views = []
        for name, tensor in kv_caches.items():
            block = tensor[0, 0] if self._split else tensor[0]
            parts = 2 if self._split else 1
            if block.numel() * block.element_size() * parts != per_layer or \
                    not block.is_contiguous() or tensor.dtype != first.dtype:
                raise ConfigError(
                    f"KV cache layer {name!r} of shape {tuple(tensor.shape)} ({tensor.dtype}) "
                    f"does not hold {per_layer}-byte contiguous blocks, as layout "
                    f"{self.layout} needs")
            views.append(tensor if tensor.device.type != "cpu" else
                         tensor.view(torch.uint8).numpy())
        self._layers = views

    def _segments(self, block_ids: list[int]) -> list[list]:
        """Each block's bytes, layer by layer (K then V where they are split)."""
        if self._split:
            return [[layer[part, block] for layer in self._layers for part in (0, 1)]
                    for block in block_ids]
        return [[layer[block] for layer in self._layers] for block in block_ids]

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for job in getattr(meta, "loads", ()):
            loaded = self.connector.load(job.keys, self._segments(job.block_ids))
            if loaded < len(job.block_ids):
                log.warning("tract: request %s: %d of %d blocks failed to load (evicted, "
                            "corrupt or unpublished); reported to vLLM as load errors",
                            job.request_id, len(job.block_ids) - loaded, len(job.block_ids))
                self._load_errors.update(job.block_ids[loaded:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finished in `start_load_kv`."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        """Blocks are stored whole, every layer at once, in `wait_for_save`."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for job in getattr(meta, "stores", ()):
            kept = self.connector.store_each(job.keys, self._segments(job.block_ids)).kept
            if not kept.all():  # a full pool: the engine serves on, the pool lacks them
                log.log(logging.WARNING if not self._full_warned else logging.DEBUG,
                        "tract: request %s: %d of %d blocks not stored (the pool is full, "
                        "or a lock was lost); counted in the connector's not_stored",
                        job.request_id, int(kept.size - kept.sum()), kept.size)
                self._full_warned = True

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        now = {name: self.connector.stats[name] for name in STAT_NAMES}
        delta = {name: now[name] - self._reported[name] for name in STAT_NAMES}
        self._reported = now
        return TractConnectorStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return TractConnectorStats(data=dict(data)) if data is not None else \
            TractConnectorStats()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        on_cpu, _ = _platform()
        return None if on_cpu else "BLHNC"  # the CPU backend takes LBHNC only

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.connector.close()
        finally:
            close_pool(self.options.pool, self.options.node)
