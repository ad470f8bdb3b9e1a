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
model name), ``timeout`` (seconds a pool lock may be waited for, and a queued
transfer may wait to start; default 30), ``async_loads`` and ``async_saves``
(loads, stores on the worker's transfer thread, not inside the step;
defaults: loads on GPUs only, stores everywhere), ``async`` (sets both),
``events_sweep`` (seconds between two looks for announced blocks gone from
the rack; default 1), ``events_medium`` (the medium tract's KV events name;
default ``CXL``; ``CPU`` under Dynamo 1.6.1, whose KV router drops media it
does not know: docs/dynamo.md), ``load_threads`` (threads a load of 4 MiB
or more is copied by; default 2 where this process may use 2 cores).

What the adapter does (the work is `tract.connector.Connector`'s; this
module only translates):

- **Keys** are vLLM's own ``request.block_hashes``, mapped into tract's
  namespace by `Connector.digest_keys` (nothing is hashed again from the
  tokens).  The namespace fingerprints model, KV dtype, block size, layers,
  KV heads, head size, the cache layout, the tensor-parallel rank and size,
  and the platform (the CPU backend's bytes differ between instruction
  sets): only identical configurations share a block.
- **The prompt's last block**: a producer also stores the partial last
  block of a prompt (2 or more tokens past its last whole block) once the
  prompt is computed, under a digest of its tokens chained after the whole
  blocks' (`_tail_digest`).  A consumer that finds every block of a prompt
  then loads ``prompt - 1`` tokens and computes only the last one, as after
  a P/D transfer, not the whole partial block; vLLM's own prefix cache and
  file connectors hit whole blocks only.  Tails are not KV events (vLLM
  names whole blocks only).
- **Scheduler side** (`get_num_new_matched_tokens`): the pool's leading
  hits after vLLM's own prefix hit, never the prompt's last token (vLLM
  computes at least one); `update_state_after_alloc` queues the loads;
  `build_connector_meta` hands the worker those loads and the stores of
  every block that the step completes (producer and both roles).
- **Asynchronous** (``async_loads``, ``async_saves``):
  `get_num_new_matched_tokens` says the load is asynchronous, so vLLM parks
  the request
  (``WAITING_FOR_REMOTE_KVS``) and steps on; the worker queues the load on
  its transfer thread (`tract.integrations.transfers`) and reports it in
  ``finished_recving`` when it ended, its failed blocks as load errors in
  the same step.  Stores are queued after the step that completed their
  blocks; a finished request with queued stores keeps its blocks
  (`request_finished` returns True) until the worker reports it in
  ``finished_sending``, once they ended.  A transfer not started within
  ``timeout`` fails (a load error; a block not stored), and a running one is
  bounded by the pool's timeouts, so nothing waits for ever.  A preempted
  request's queued stores are cancelled in `handle_preemptions`, and a
  running one is waited for, before the step may reuse its blocks; a
  finished request's queued loads are cancelled.  tract is a cache
  (`requires_kv_delivery` is False): a cancelled store is a later miss, so
  vLLM lets a preempted producer request finish.
- **Synchronous** (``"async": false``, and loads on the CPU backend by
  default): loads run in `start_load_kv`,
  before the forward pass (on the CPU backend the copy is the CPU's own
  work, and with one range per block it runs at memory speed); stores run
  in `wait_for_save`, after the step wrote every layer.
- **Blocks**: a block moves as opaque bytes, one
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
- **Hybrid KV cache manager**: the connector is `SupportsHMA`
  (`request_finished_all_groups`), so vLLM keeps that manager on.  A model
  of one full-attention group is served as above.  A hybrid model (groups
  of full attention and of sliding windows, as Gemma 2 and 3, gpt-oss), or
  one whose every layer has a sliding window, is served group by group
  (`kv_groups`, `KVGroup`): each group's blocks are its own layers' bytes
  (vLLM's groups alias one buffer), stored under a namespace of the group's
  own (its kind, window and layers); vLLM's null block (a block out of a
  window) is neither loaded into nor stored.  A hit must hold for every
  group: each full-attention group's leading run, cut back a block at a
  time until every sliding group's window at its end is in the pool.  A
  sliding group's stores run inside their step (vLLM frees a block that
  left the window while its request runs).  With several groups, loads are
  asynchronous and a failed one fails its request (``failed_recving``: vLLM
  recomputes it), as vLLM takes no block load errors there.  Other groups
  (Mamba, chunked local attention, MLA beside others, pipeline parallelism
  with several groups): tract stands aside, with a warning.
- **KV events** (when vLLM's ``kv_events_config`` turns them on):
  `take_events` yields a `BlockStored` (medium ``CXL``, chained to the block
  before it) for each block a store put in the rack, once every worker
  reported the store ended (`build_connector_worker_meta`,
  `update_connector_output`), so a KV-aware router sees what the rack
  holds; and a `BlockRemoved` for announced blocks later found gone
  (evicted by any process of any node: `_sweep`).
- **Metrics**: vLLM counts tract's hits as ``host`` in
  ``vllm:prompt_tokens_cached_by_source``; `get_kv_connector_stats` reports the connector's counts per
  step (`TractConnectorStats`: hits, misses, stored and not stored
  blocks, bytes, checksum failures, and each load's and store's time);
  `build_prom_metrics` puts them on vLLM's ``/metrics`` as ``vllm:tract_*``
  (`TractPromMetrics`); the pool keeps every node's counters too
  (`tract stat`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import metrics as _metrics
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tract.errors import ConfigError
from tract.integrations.common import Options, close_pool, flag, open_connector, options
from tract.integrations.transfers import CANCELLED, DONE, TransferThread
from tract.transfer import KVLayout

# tract.connector and tract.pool (Numba, LLVM) are imported when a connector
# is made, not with this module: vLLM imports it in every process, and its
# CPU worker's start-up scan of sys.modules (register_triton_kernel_overrides)
# fails on llvmlite's library wrapper when llvmlite is already loaded.

__all__ = ["KVGroup", "TractConnector", "TractConnectorMetadata", "TractConnectorStats",
           "TractPromMetrics", "TractWorkerMetadata", "kv_groups", "kv_layout"]

log = logging.getLogger(__name__)

#: the connector counts reported per step (`Connector.stats` keys)
STAT_NAMES = ("lookups", "hit_blocks", "miss_blocks", "stored_blocks", "not_stored",
              "read_bytes", "written_bytes", "checksum_failures", "tier_hit_blocks",
              "tier_promotions", "tier_failures", "fenced", "rejoins")
#: the transfer jobs' times reported per step (seconds: an asynchronous job's from its
#: submission, queueing included, to its end; a synchronous one's inside the step)
LATENCY_NAMES = ("load_seconds", "save_seconds")
#: vLLM's base classes across versions: SupportsHMA (0.32 and later) and the
#: transfer results with failed receives (0.33)
SupportsHMA = getattr(_base, "SupportsHMA", object)
TransferResults = getattr(_base, "KVConnectorTransferResults", None)
WorkerMetadata = getattr(_base, "KVConnectorWorkerMetadata", object)
#: whether this vLLM takes a failed load per request (``failed_recving``): a model of
#: several KV cache groups is served only then
FAILS_REQUESTS = "failed_recving" in getattr(TransferResults, "__dataclass_fields__", {})
#: the adapter's own keys of ``kv_connector_extra_config`` (beside `Options`)
ADAPTER_KEYS = ("model_id", "async", "async_loads", "async_saves", "events_sweep",
                "events_medium")
#: BlockRemoved: the blocks this instance announced, checked this many a sweep (round
#: robin), and at most this many tracked (the oldest beyond are reported removed)
SWEEP_KEYS = 4096
TRACKED_MAX = 1 << 17
#: the medium named in tract's KV events by default (vLLM's own are GPU, CPU and
#: STORAGE; ``events_medium`` names another, for a router that knows only those)
MEDIUM = "CXL"


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
    tract keys, row for row; ``asynchronous``: on the worker's transfer
    thread, not inside the step."""

    request_id: str
    block_ids: list[int]
    keys: np.ndarray  # (n, 2) uint64
    asynchronous: bool = False
    seq: int = -1  # a store's number, to report which of its blocks are in the pool
    group: int = 0  # vLLM's index of the KV cache group the blocks are of


@dataclasses.dataclass
class TractConnectorMetadata(KVConnectorMetadata):
    """What one step's worker does: loads before the forward pass (or
    queued), stores after it (or queued); ``preempted``: requests whose
    blocks vLLM freed this step, whose queued stores must not run."""

    loads: list[BlockJob] = dataclasses.field(default_factory=list)
    stores: list[BlockJob] = dataclasses.field(default_factory=list)
    preempted: set[str] = dataclasses.field(default_factory=set)


def _merged(had: tuple[int, frozenset[int]] | None, report: tuple[int, frozenset[int]]
            ) -> tuple[int, frozenset[int]]:
    """Two workers' reports of one store: how many reported, and the blocks
    every one of them has in the pool."""
    if had is None:
        return report
    return had[0] + report[0], had[1] & report[1]


@dataclasses.dataclass
class TractWorkerMetadata(WorkerMetadata):
    """Worker to scheduler, per step, when KV events are on: for each
    store (by ``seq``) that ended, how many workers report it and which of
    its blocks every one of them has in the pool (a tensor-parallel block is
    in the rack when each rank's part is)."""

    stored: dict[int, tuple[int, frozenset[int]]] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: TractWorkerMetadata) -> TractWorkerMetadata:
        for seq, report in other.stored.items():
            self.stored[seq] = _merged(self.stored.pop(seq, None), report)
        return self


@dataclasses.dataclass
class TractConnectorStats(KVConnectorStats):
    """The connector's counts over an interval (sums), and its jobs'
    durations (lists of seconds)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {**dict.fromkeys(STAT_NAMES, 0), **{name: [] for name in LATENCY_NAMES}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, list):
                self.data[name] = list(self.data.get(name, ())) + value
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced = {}
        for name, value in self.data.items():
            if isinstance(value, list):
                reduced[name.replace("seconds", "count")] = len(value)
                reduced[name.replace("seconds", "mean_ms")] = \
                    round(1e3 * sum(value) / len(value), 3) if value else 0.0
            else:
                reduced[name] = value
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: what each count means, for ``/metrics``
STAT_HELP = {
    "lookups": "prefix lookups in the rack's pool",
    "hit_blocks": "blocks loaded from the pool",
    "miss_blocks": "blocks asked for and not loaded (absent, evicted, corrupt or timed out)",
    "stored_blocks": "blocks stored into the pool",
    "not_stored": "blocks the pool had no room for, or whose save failed or was cancelled",
    "read_bytes": "bytes loaded from the pool",
    "written_bytes": "bytes stored into the pool",
    "checksum_failures": "blocks whose checksum failed on load (each one a miss)",
    "tier_hit_blocks": "rack misses loaded from the cluster tier",
    "tier_promotions": "cluster-tier hits stored into the rack's pool",
    "tier_failures": "cluster-tier calls that failed, timed out or were skipped (misses)",
    "fenced": "calls that wrote or trusted nothing: this worker's node had lapsed (a stall)",
    "rejoins": "times this worker's node rejoined the pool after its lease lapsed",
}
#: histogram buckets of a load's or save's time, in seconds
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


#: a model of one KV cache group is served as one namespace when every layer of
#: it keeps every block of its tokens
SERVED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
#: the groups of a hybrid model (or of a model whose every layer has a sliding
#: window) tract serves, each in a namespace of its own: full attention, and
#: sliding windows (whose blocks out of the window vLLM replaces by its null block)
GROUP_SPECS = {"FullAttentionSpec": "full_attention", "SlidingWindowSpec": "sliding_window"}
#: vLLM's null block: stands for a sliding-window block out of the window; never
#: loaded into nor stored
NULL_BLOCK = 0


@dataclasses.dataclass
class KVGroup:
    """One KV cache group that tract serves: vLLM's index of it, its layers
    (none: every registered layer, for a model of one full-attention group),
    its sliding window in tokens (0: full attention) and the tract layout
    (namespace) its blocks are stored under."""

    index: int
    layer_names: tuple[str, ...] = ()
    window: int = 0
    retained: int = 0  # the window's extra retained tokens (vLLM's extra_retained_tokens)
    num_kv_heads: int = 0
    head_size: int = 0
    layout: KVLayout | None = None

    @property
    def kind(self) -> str:
        return "sliding_window" if self.window else "full_attention"

    def skipped(self, tokens: int) -> int:
        """Leading tokens out of the window after ``tokens`` (vLLM's
        ``get_num_skipped_tokens``): their blocks are null."""
        return max(0, tokens - self.window + 1 - self.retained) if self.window else 0

    def of(self, base: KVLayout) -> KVLayout:
        """This group's layout: the model's, with the group's layers, heads
        and kind (two groups of one spec differ by their layers)."""
        kind = f"{self.kind}:{self.window}+{self.retained}" if self.window else self.kind
        return dataclasses.replace(
            base, num_layers=len(self.layer_names), num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            variant=f"{base.variant};group={kind};layers={','.join(self.layer_names)}")


def _spec_kinds(spec) -> list[str]:
    specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one per layer
    return sorted({type(each).__name__ for each in (specs.values() if specs else [spec])})


def kv_groups(kv_cache_config, block_size: int, stages: int = 1
              ) -> tuple[list[KVGroup] | None, str | None]:
    """The KV cache groups tract serves, and what of the KV cache it cannot
    serve (then it stands aside), from vLLM's ``kv_cache_config``: the
    scheduler and every worker compute the same.  Groups None: one group
    of full attention (or a vLLM that does not say), under the model
    config's layout (`kv_layout`), as before groups were served."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None:
        return None, None
    if not groups:
        return None, "no KV cache group"
    if len(groups) == 1 and not set(_spec_kinds(groups[0].kv_cache_spec)) - set(SERVED_SPECS):
        return None, None
    served = []
    for index, group in enumerate(groups):
        spec, kinds = group.kv_cache_spec, _spec_kinds(group.kv_cache_spec)
        if kinds[0] not in GROUP_SPECS or len(kinds) != 1 or \
                hasattr(spec, "kv_cache_specs"):
            return None, f"a group of {', '.join(kinds)} layers"
        if spec.block_size != block_size or \
                getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
            return None, f"a group of {spec.block_size}-token blocks or unequal K and V heads"
        served.append(KVGroup(index, tuple(group.layer_names),
                              int(getattr(spec, "sliding_window", 0) or 0),
                              int(getattr(spec, "extra_retained_tokens", 0) or 0),
                              spec.num_kv_heads, spec.head_size))
    hashed = getattr(kv_cache_config, "hash_block_size", None)
    if hashed not in (None, block_size):
        return None, f"block hashes of {hashed} tokens in {block_size}-token blocks"
    if len(served) > 1 and stages > 1:
        return None, f"{len(served)} groups under pipeline parallelism"
    if len(served) > 1 and not FAILS_REQUESTS:
        return None, f"{len(served)} groups, and this vLLM takes no failed load per request"
    return served, None


def _tail_digest(tokens, size: int) -> bytes:
    """The digest, ``size`` bytes like vLLM's block hashes, that a prompt's
    partial last block of ``tokens`` is stored under (chained after its
    whole blocks' by `Connector.digest_keys`); tagged, so never a whole
    block's."""
    body = b"tract:partial-block:" + np.asarray(tokens, dtype="<i8").tobytes()
    return hashlib.blake2b(body, digest_size=size).digest()


def _stored_events(hashes, parent, tokens, kept: list[int], block_size: int, medium: str,
                   **fields) -> list:
    """`BlockStored` events (``medium``) for the ``kept`` blocks (indices
    into ``hashes``; a partial last block past them is no event) of one
    store: one event per run of consecutive blocks, each chained to the
    block before it; ``fields``: the group's, for a model served by group."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    kept = [at for at in kept if at < len(hashes)]
    events, first = [], 0
    for at in range(1, len(kept) + 1):
        if at < len(kept) and kept[at] == kept[at - 1] + 1:
            continue
        run = kept[first:at]
        start, end = run[0], run[-1] + 1
        before = hashes[start - 1] if start else parent
        events.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[start:end]],
            parent_block_hash=None if before is None else maybe_convert_block_hash(before),
            token_ids=tokens[start * block_size:end * block_size], block_size=block_size,
            lora_id=None, medium=medium, lora_name=None, **fields))
        first = at
    return events


class TractPromMetrics(getattr(_metrics, "KVConnectorPromMetrics", object)):
    """tract's connector on vLLM's ``/metrics``: a counter
    ``vllm:tract_<count>`` per `STAT_NAMES` entry and a histogram
    ``vllm:tract_<load|save>_seconds`` of the jobs' times (an asynchronous
    one's queueing included), one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {name: self._per_engine(self._counter_cls(
            name=f"vllm:tract_{name}", documentation=f"tract: {text}",
            labelnames=labelnames)) for name, text in STAT_HELP.items()}
        self.histograms = {name: self._per_engine(self._histogram_cls(
            name=f"vllm:tract_{name}",
            documentation=f"tract: seconds a {name.split('_')[0]} took (an asynchronous "
                          f"one's queueing included)",
            buckets=LATENCY_BUCKETS, labelnames=labelnames)) for name in LATENCY_NAMES}

    def _per_engine(self, metric):
        return {engine: metric.labels(*values)
                for engine, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, counter in self.counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter[engine_idx].inc(value)
        for name, histogram in self.histograms.items():
            for seconds in transfer_stats_data.get(name, ()):
                histogram[engine_idx].observe(seconds)


# --------------------------------------------------------------- connector

class TractConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector v1 over a tract pool (see the module docstring)."""

    # vLLM's ``vllm:prompt_tokens_cached_by_source``: the rack's pool is host memory
    if hasattr(_base, "CacheHitSource"):
        _cache_hit_source = _base.CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config or {}
        where = "TractConnector's kv_connector_extra_config"
        known = {field.name for field in dataclasses.fields(Options)} | set(ADAPTER_KEYS)
        unknown = sorted(set(extra) - known)
        if unknown:  # a typo is refused, not a silent default
            raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
        self.options = options({k: v for k, v in extra.items() if k not in ADAPTER_KEYS}, where)
        # loads and stores on the worker's transfer thread, or inside the step: ``async``
        # sets both; by default stores are queued, and loads are on GPUs only (on the CPU
        # backend a load's copy is the CPU's own work, and parking the request costs more
        # engine steps than the copy: see docs/vllm.md)
        both = None if extra.get("async") is None else flag(extra["async"], "async", where)
        on_cpu, _ = _platform()
        self.async_loads = flag(extra.get("async_loads", not on_cpu if both is None else both),
                                "async_loads", where)
        self.async_saves = flag(extra.get("async_saves", True if both is None else both),
                                "async_saves", where)
        try:
            self._sweep_every = float(extra.get("events_sweep", 1.0))
        except (TypeError, ValueError):
            self._sweep_every = -1.0
        if not self._sweep_every >= 0:
            raise ConfigError(f"{where}: events_sweep must be a number of seconds, 0 or more; "
                              f"got {extra['events_sweep']!r}")
        self.medium = extra.get("events_medium", MEDIUM)
        if not (isinstance(self.medium, str) and self.medium.strip()):
            raise ConfigError(f"{where}: events_medium must be a medium's name (CXL, CPU, "
                              f"...); got {self.medium!r}")
        self._produces, self._consumes = transfer.is_kv_producer, transfer.is_kv_consumer
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        groups, unserved = kv_groups(kv_cache_config, self.block_size,
                                     parallel.pipeline_parallel_size)
        if unserved:  # tract's keys name whole blocks of the groups it serves: it stands aside
            log.warning("tract: this model's KV cache has %s; tract serves groups of full "
                        "attention or sliding windows (in blocks of the cache's size), so "
                        "it neither loads nor stores here", unserved)
            self._produces = self._consumes = False
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        base = kv_layout(vllm_config, tp_rank)
        #: the groups served, each in its own namespace (one, under the model's layout,
        #: for a model of one full-attention group)
        self.groups = [dataclasses.replace(group, layout=group.of(base)) for group in groups] \
            if groups else [KVGroup(0, layout=base)]
        #: several groups: a failed load fails its request (``failed_recving``), never
        #: blocks (vLLM raises on block load errors there), so loads are asynchronous
        self.hybrid = len(self.groups) > 1
        self.by_group = bool(groups)  # in namespaces of the groups' own (their KV events too)
        if self.hybrid and not self.async_loads:
            if extra.get("async_loads", extra.get("async")) is not None:
                log.warning("tract: a model of %d KV cache groups loads asynchronously (vLLM "
                            "takes a failed load of several groups per request only)",
                            len(self.groups))
            self.async_loads = True
        self.connectors: dict[int, Any] = {}
        try:
            for group in self.groups:
                self.connectors[group.index] = open_connector(self.options, group.layout)
        except BaseException:
            for connector in self.connectors.values():
                connector.close()
                close_pool(self.options.pool, self.options.node)
            raise
        self.connector = self.connectors[self.groups[0].index]
        self.layout = self.groups[0].layout
        self.layouts = [group.layout for group in self.groups]
        self.pool = self.connector.pool
        self._closed = False
        # scheduler side
        self._requests: dict[str, Any] = {}  # request id -> vLLM Request, until finished
        self._local_hit: dict[str, int] = {}  # tokens vLLM had when it asked us
        self._external: dict[str, int] = {}  # tokens we load
        self._stored: dict[str, int] = {}  # leading blocks queued for storing
        self._tails: set[str] = set()  # requests whose partial last block is queued
        self._load_failed: set[str] = set()  # requests a load of failed, until finished
        self._loads: list[BlockJob] = []
        events = getattr(vllm_config, "kv_events_config", None)
        #: KV events (`take_events`): only when vLLM publishes them
        self._events_on = bool(events is not None and events.enable_kv_cache_events)
        self._next_sweep = 0.0
        #: announced blocks, oldest first: tract key (16 bytes) -> (vLLM block hash, group)
        self._in_rack: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._workers = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self._seq = 0
        #: store seq -> (group, each row's block past the first, hashes, parent, tokens, keys)
        self._announcing: dict[int, tuple] = {}
        self._reports: dict[int, tuple[int, frozenset[int]]] = {}  # partial, across steps
        self._events: list = []
        # worker side
        self._layers: dict[int, list] = {}  # group -> its layers' views
        self._split = False  # layers laid out (K/V, block, ...), not (block, ...)
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()  # requests a load of failed (several groups)
        self._full_warned = False  # a full pool is said once at WARNING, then at DEBUG
        self._reported = dict.fromkeys(STAT_NAMES, 0)
        self._transfers: TransferThread | None = None  # made at the first queued job
        self._jobs: dict[tuple[str, str], int] = {}  # (kind, request id) -> jobs not ended
        self._saves_queued: set[str] = set()  # requests with stores queued here, until reported
        self._owed: set[str] = set()  # finished requests whose stores are still queued
        self._latencies: dict[str, list[float]] = {name: [] for name in LATENCY_NAMES}
        self.preemptions = 0  # requests vLLM preempted, as this worker heard
        self._kept: dict[int, frozenset[int]] = {}  # ended stores' blocks in the pool, unsent

    # ------------------------------------------------------------- keys

    def _digests(self, request) -> tuple[list[bytes], int]:
        """The digests of a request's blocks, and the tokens they hold: its
        whole blocks (vLLM's ``block_hashes``), then, while it has not
        decoded, its prompt's partial last block when that holds 2 tokens
        or more (a consumer computes the last one itself)."""
        digests = list(request.block_hashes)
        whole = len(digests) * self.block_size
        prompt = request.num_prompt_tokens
        if request.num_tokens != prompt or prompt - whole < 2 or \
                (digests and (len(digests[0]) > 64 or len(digests[0]) % 4)):
            return digests, whole
        size = len(digests[0]) if digests else 32
        digests.append(_tail_digest(request.all_token_ids[whole:prompt], size))
        return digests, prompt

    def _keys(self, request, blocks: int) -> dict[int, np.ndarray]:
        """Each group's keys of the request's first ``blocks`` blocks
        (`_digests`): one chain of digests, in each group's namespace."""
        digests = self._digests(request)[0][:blocks]
        return {group.index: self.connectors[group.index].digest_keys(digests)
                for group in self.groups}

    # --------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """The pool's leading hits past vLLM's own: every full-attention
        group's leading run, cut back, a block at a time, to an end whose
        sliding windows the pool holds whole in every sliding group."""
        if not self._consumes or request.request_id in self._load_failed:
            return 0, False
        size = self.block_size
        first = num_computed_tokens // size
        digests, held = self._digests(request)
        end = min(held, request.num_tokens - 1)  # vLLM computes the last token
        blocks = -(-end // size)
        if blocks <= first:
            return 0, False
        keys = {group.index: self.connectors[group.index].digest_keys(digests[:blocks])[first:]
                for group in self.groups}
        for group in self.groups:
            if not group.window:
                hits = self.connectors[group.index].lookup(keys[group.index]) // size
                end = min(end, (first + hits) * size)
        windows = [(group, self.connectors[group.index].index.present(keys[group.index]))
                   for group in self.groups if group.window]
        while end > num_computed_tokens and not all(
                present[max(0, group.skipped(end) // size - first):-(-end // size) - first].all()
                for group, present in windows):
            end = (-(-end // size) - 1) * size  # the block boundary before
        tokens = max(0, end - num_computed_tokens)
        self._local_hit[request.request_id] = num_computed_tokens
        return tokens, self.async_loads and tokens > 0

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """Every group tract serves: a hit counts only where each one's
        blocks (a sliding group's window) are in the pool."""
        return tuple(group.index for group in self.groups)

    def _jobs_of(self, request_id: str, block_ids, keys: dict[int, np.ndarray], start: int,
                 asynchronous: bool, store: bool) -> list[tuple[BlockJob, list[int]]]:
        """One job per group over its blocks from ``start`` that are not the
        null block (a sliding window's blocks out of the window), with each
        row's block index past ``start``; a sliding group's stores are never
        asynchronous (`build_connector_meta`)."""
        jobs = []
        for group in self.groups:
            ids = list(block_ids[group.index][start:start + len(keys[group.index])])
            rows = [at for at, block in enumerate(ids) if block != NULL_BLOCK]
            if rows:
                job = BlockJob(request_id, [ids[at] for at in rows],
                               keys[group.index][rows],
                               asynchronous and not (store and group.window),
                               group=group.index)
                jobs.append((job, rows))
        return jobs

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        request_id = request.request_id
        self._requests[request_id] = request
        if num_external_tokens <= 0:
            return
        local = self._local_hit.get(request_id, 0)
        first = local // self.block_size
        end = -(-(local + num_external_tokens) // self.block_size)
        keys = {group: keys[first:] for group, keys in self._keys(request, end).items()}
        self._loads += [job for job, _ in self._jobs_of(
            request_id, blocks.get_block_ids(), keys, first, self.async_loads, store=False)]
        self._external[request_id] = self._external.get(request_id, 0) + num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """The step's loads, and the stores of the blocks it completes.  A
        sliding group's stores run inside the step, whatever
        ``async_saves`` says: vLLM frees a block that left the window while
        its request runs, and the next step may overwrite it."""
        meta = TractConnectorMetadata(
            loads=self._loads,
            preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        self._loads = []
        if not self._produces:
            return meta
        size = self.block_size
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(request_id)
            if request is None:
                continue
            computed = request.num_computed_tokens + scheduled
            done = min(computed // size, len(request.block_hashes))
            start = self._stored.get(request_id, 0)
            # the prompt's partial last block, once the prompt is computed
            tail = request_id not in self._tails and computed >= request.num_prompt_tokens \
                and len(self._digests(request)[0]) > done
            if done <= start and not tail:
                continue
            end = done + 1 if tail else done
            keys = {group: keys[start:] for group, keys in self._keys(request, end).items()}
            block_ids = self._kv_cache_manager.get_block_ids(request_id)
            for job, rows in self._jobs_of(request_id, block_ids, keys, start,
                                           self.async_saves, store=True):
                meta.stores.append(job)
                if self._events_on:
                    self._announcing[self._seq] = (
                        job.group, rows, request.block_hashes[start:done],
                        request.block_hashes[start - 1] if start else None,
                        list(request.all_token_ids[start * size:done * size]), job.keys)
                job.seq = self._seq
                self._seq += 1
            self._stored[request_id] = done
            if tail:
                self._tails.add(request_id)
        return meta

    def update_connector_output(self, connector_output) -> None:
        """The workers' reports: requests whose load failed (vLLM asks them
        again from token 0: the pool is not offered twice, so they are
        recomputed, not loaded and failed for ever); ended stores: once every
        worker reported a store, its blocks in the pool become `BlockStored`
        events."""
        self._load_failed |= set(getattr(connector_output, "failed_recving", None) or ())
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, TractWorkerMetadata):
            return
        for seq, report_of_seq in report.stored.items():
            count, kept = _merged(self._reports.pop(seq, None), report_of_seq)
            if count < self._workers:
                self._reports[seq] = (count, kept)
                continue
            announced = self._announcing.pop(seq, None)
            if announced is not None and kept:
                group, rows, hashes, parent, tokens, keys = announced
                kept = sorted(row for row in kept if rows[row] < len(hashes))  # whole blocks
                self._events += _stored_events(hashes, parent, tokens,
                                               [rows[row] for row in kept], self.block_size,
                                               self.medium,
                                               **self._group_fields(group))
                for row in kept:
                    key = keys[row].tobytes()
                    self._in_rack[key] = (hashes[rows[row]], group)
                    self._in_rack.move_to_end(key)

    def _group_fields(self, index: int) -> dict[str, Any]:
        """A KV event's group fields, for a model tract serves by group."""
        if not self.by_group:
            return {}
        group = next(group for group in self.groups if group.index == index)
        return {"group_idx": index, "kv_cache_spec_kind": group.kind,
                "kv_cache_spec_sliding_window": group.window or None}

    def take_events(self):
        """`BlockStored` events (medium ``CXL``) of the blocks this
        connector stored into the rack, as the workers confirmed them, and
        `BlockRemoved` events of those found gone (`_sweep`)."""
        if self._events_on:
            self._sweep()
        events, self._events = self._events, []
        return events

    def _sweep(self) -> None:
        """At most every ``events_sweep`` seconds: a `BlockRemoved` of the
        announced blocks no longer in the rack (evicted by any process of
        any node), `SWEEP_KEYS` of them looked up at a time, round robin.
        Beyond `TRACKED_MAX` announced blocks the oldest are reported
        removed and forgotten, so a router's view of the rack never holds
        more than the rack (a later miss, never a wrong route)."""
        now = time.monotonic()
        if now < self._next_sweep or not self._in_rack:
            return
        self._next_sweep = now + self._sweep_every
        gone = [self._in_rack.popitem(last=False)[1]
                for _ in range(len(self._in_rack) - TRACKED_MAX)]
        looked = list(zip(range(SWEEP_KEYS), self._in_rack.items()))
        keys = np.frombuffer(b"".join(key for _, (key, _) in looked), np.uint64).reshape(-1, 2)
        for (_, (key, block)), here in zip(looked, self.connector.index.present(keys)):
            if here:
                self._in_rack.move_to_end(key)
            else:
                del self._in_rack[key]
                gone.append(block)
        if gone:
            from vllm.distributed.kv_events import BlockRemoved
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            for group in self.groups:
                hashes = [block_hash for block_hash, index in gone if index == group.index]
                if hashes:
                    fields = {"group_idx": group.index} if self.by_group else {}
                    self._events.append(BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(h) for h in hashes],
                        medium=self.medium, **fields))

    def request_finished(self, request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Delays the free of a request with queued stores: the worker
        reports it in ``finished_sending`` once they ended (stored, failed
        or timed out).  A request still loading is never delayed here: vLLM
        holds its blocks until the worker reports the load ended."""
        request_id = request.request_id
        self._requests.pop(request_id, None)
        self._local_hit.pop(request_id, None)
        self._load_failed.discard(request_id)
        stored = self._stored.pop(request_id, 0)  # whole blocks queued for storing
        tail = request_id in self._tails
        self._tails.discard(request_id)
        params = {"tract_external_tokens": self._external.pop(request_id, 0),
                  "tract_stored_blocks": stored}
        return self.async_saves and (stored > 0 or tail), params

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """`SupportsHMA`: as `request_finished` (a sliding group's stores
        ended inside their steps; the full-attention groups' blocks are what
        a delayed free keeps)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    # ------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Each group's views of its own layers (a model served by group:
        vLLM's groups alias one buffer, layer by layer, so a block of a
        group is in that group's layers only)."""
        for group in self.groups:
            named = kv_caches
            if group.layer_names:
                missing = [name for name in group.layer_names if name not in kv_caches]
                if missing:
                    raise ConfigError(f"vLLM registered no KV cache for layers {missing} of "
                                      f"KV cache group {group.index}")
                named = {name: kv_caches[name] for name in group.layer_names}
            self._layers[group.index] = self._views(named, group.layout)

    def _views(self, kv_caches: dict[str, torch.Tensor], layout: KVLayout) -> list:
        layers = list(kv_caches.values())
        if len(layers) != layout.num_layers:
            raise ConfigError(f"vLLM registered {len(layers)} KV cache layers; the model "
                              f"config says {layout.num_layers}")
        per_layer = layout.block_bytes // layout.num_layers
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
                    f"{layout} needs")
            views.append(tensor if tensor.device.type != "cpu" else
                         tensor.view(torch.uint8).numpy())
        return views

    def _segments(self, job: BlockJob) -> list[list]:
        """Each block's bytes, layer by layer of its group (K then V where
        they are split)."""
        layers = self._layers[job.group]
        if self._split:
            return [[layer[part, block] for layer in layers for part in (0, 1)]
                    for block in job.block_ids]
        return [[layer[block] for layer in layers] for block in job.block_ids]

    def _load(self, job: BlockJob) -> int:
        return self.connectors[job.group].load(job.keys, self._segments(job))

    def _loaded(self, job: BlockJob, loaded: int) -> None:
        if loaded < len(job.block_ids):
            log.warning("tract: request %s: %d of %d blocks failed to load (evicted, "
                        "corrupt, unpublished or timed out); reported to vLLM as load errors",
                        job.request_id, len(job.block_ids) - loaded, len(job.block_ids))
            if self.hybrid:  # the request is recomputed (vLLM takes no block errors here)
                self._failed.add(job.request_id)
            else:
                self._load_errors.update(job.block_ids[loaded:])

    def _save(self, job: BlockJob) -> np.ndarray:
        """Store the job's blocks; which are in the pool after it."""
        kept = self.connectors[job.group].store_each(job.keys, self._segments(job)).kept
        self._saved(job, int(kept.sum()))
        return kept

    def _ended_store(self, job: BlockJob, kept: np.ndarray | None) -> None:
        if self._events_on:
            self._kept[job.seq] = frozenset(np.flatnonzero(kept).tolist()) \
                if kept is not None else frozenset()

    def _saved(self, job: BlockJob, kept: int) -> None:
        if kept < len(job.block_ids):  # a full pool: the engine serves on, the pool lacks them
            log.log(logging.WARNING if not self._full_warned else logging.DEBUG,
                    "tract: request %s: %d of %d blocks not stored (the pool is full, a lock "
                    "was lost, or the save timed out); counted in the connector's not_stored",
                    job.request_id, len(job.block_ids) - kept, len(job.block_ids))
            self._full_warned = True

    def _queue(self, kind: str, job: BlockJob, run) -> None:
        if self._transfers is None:
            self._transfers = TransferThread(f"tract-transfers-{self.options.node}")
        self._transfers.submit(kind, job.request_id, lambda: run(job), self.options.timeout,
                               info=job)
        key = (kind, job.request_id)
        self._jobs[key] = self._jobs.get(key, 0) + 1
        if kind == "save":
            self._saves_queued.add(job.request_id)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Before this step's forward may overwrite a preempted request's
        freed blocks: its queued stores are cancelled (its blocks are not
        stored: a later miss, never a wrong block), and a store of it that
        is running is waited for."""
        preempted = getattr(kv_connector_metadata, "preempted", None)
        self.preemptions += len(preempted or ())
        if preempted and self._transfers is not None:
            self._transfers.cancel(preempted, kinds=("save",))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for job in getattr(meta, "loads", ()):
            if job.asynchronous:
                self._queue("load", job, self._load)
            else:
                began = time.monotonic()
                loaded = self._load(job)
                self._latencies["load_seconds"].append(time.monotonic() - began)
                self._loaded(job, loaded)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finished in `start_load_kv`, or run on the transfer thread."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        """Blocks are stored whole, every layer at once, in `wait_for_save`."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for job in getattr(meta, "stores", ()):
            if job.asynchronous:
                self._queue("save", job, self._save)
            else:
                began = time.monotonic()
                saved = self._save(job)
                self._latencies["save_seconds"].append(time.monotonic() - began)
                self._ended_store(job, saved)

    def _transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose delayed free may end: finished, every store of
        theirs ended; requests whose loads all ended)."""
        recving: set[str] = set()
        if self._transfers is None:
            return set(), recving
        # a finished request's queued loads are not needed: cancelled (vLLM holds the
        # blocks of a request that finished loading until its loads are reported)
        self._transfers.cancel(finished_req_ids, kinds=("load",), wait=False)
        for ended in self._transfers.finished():
            job, key = ended.info, (ended.kind, ended.request_id)
            self._jobs[key] -= 1
            if not self._jobs[key]:
                del self._jobs[key]
            self._latencies[f"{ended.kind}_seconds"].append(ended.seconds)
            count = ended.result if ended.state == DONE else 0
            if ended.kind == "load":
                if ended.state != CANCELLED:  # a cancelled load's request is gone
                    self._loaded(job, count)
                if key not in self._jobs:
                    recving.add(ended.request_id)
            else:
                self._ended_store(job, ended.result)
                if ended.state != DONE:
                    self.connectors[job.group].not_stored(len(job.block_ids))
                    if ended.state != CANCELLED:
                        self._saved(job, 0)
        self._owed |= set(finished_req_ids) & self._saves_queued
        sending = {request_id for request_id in self._owed
                   if ("save", request_id) not in self._jobs}
        self._owed -= sending
        self._saves_queued -= sending
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]):
        sending, recving = self._transfer_results(finished_req_ids)
        if not FAILS_REQUESTS:
            return TransferResults(finished_sending=sending, finished_recving=recving)
        failed, self._failed = self._failed & recving, self._failed - recving
        return TransferResults(finished_sending=sending, finished_recving=recving,
                               failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """vLLM versions that ask `get_finished` (not `get_transfer_results`)."""
        sending, recving = self._transfer_results(finished_req_ids)
        return sending or None, recving or None

    def build_connector_worker_meta(self):
        """The stores that ended since the last step, for KV events."""
        if not self._kept:
            return None
        kept, self._kept = self._kept, {}
        return TractWorkerMetadata({seq: (1, blocks) for seq, blocks in kept.items()})

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        now = {name: sum(connector.stats[name] for connector in self.connectors.values())
               for name in STAT_NAMES}
        delta = {name: now[name] - self._reported[name] for name in STAT_NAMES}
        self._reported = now
        latencies, self._latencies = self._latencies, {name: [] for name in LATENCY_NAMES}
        if not any(delta.values()) and not any(latencies.values()):
            return None
        return TractConnectorStats(data={**delta, **latencies})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return TractConnectorStats(data=dict(data)) if data is not None else \
            TractConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """vLLM's ``/metrics``: ``vllm:tract_*`` counters and histograms
        (`TractPromMetrics`); None where vLLM has no connector metrics."""
        if not hasattr(_metrics, "KVConnectorPromMetrics"):
            return None
        return TractPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: tract is a cache.  A producer's store that a preemption
        cancels is a later miss (the consumer computes those tokens), never
        a lost hand-off, so vLLM need not recompute a preempted request to
        deliver it."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        on_cpu, _ = _platform()
        return None if on_cpu else "BLHNC"  # the CPU backend takes LBHNC only

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._transfers is not None and not self._transfers.close(self.options.timeout):
            log.warning("tract: transfers still queued at shutdown were cancelled")
            if self._transfers.busy():  # a copy still runs: the pool stays mapped for it
                log.warning("tract: a transfer still runs at shutdown; the pool handle is "
                            "left open for it")
                return
        for connector in self.connectors.values():
            try:
                connector.close()
            finally:
                close_pool(self.options.pool, self.options.node)
