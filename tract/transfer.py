"""Moving KV blocks between engine memory and the pool.

A block is stored as the engine's own bytes, one contiguous pool range, so
a load is one copy.  An engine whose layout splits a block (per layer, or
per layer and K/V) hands its *segments* in order; they are gathered into
the range on store and scattered back on load.

Rules relied on (DESIGN.md): R3 — a store is in memory before it returns
(non-temporal stores, their partial end lines written back, one store
fence), so the index entry published after it never names bytes still in a
cache; R4 — a load drops every range it reads first, then fences once; R5 —
every range is checked against the mapping before a byte moves (the native
region refuses one outside), and a block whose checksum does not match is
reported as a miss, never returned as data.

Checksums.  Each block's checksum is XXH64 (seed: the pool's key) over the
digests of its *pieces*: the block cut into ``layout.pieces`` equal parts
(one per layer and K/V), each hashed by the copy that moves it, from the
same loads (XXH3-64 above 240 bytes, XXH64 below: `_native._region.digest`).
So the checksum does not depend on how an engine splits its blocks, costs
no second pass over the data, and any flipped byte changes it.  It is on by
default: on real non-coherent hardware a torn or stale block must be a
miss, not wrong tokens; ``checksum=False`` skips it for trusted setups
(`tract bench transfer` shows the cost).

CUDA tensors go by DMA, without a bounce buffer: the whole mapping is
registered with ``cudaHostRegister`` in chunks, copies run on a dedicated
stream, and every CUDA return code is checked and raised by name
(`CudaError`).  On a machine without CUDA this path is never entered.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tract._native._region import Region, flat_segments, xxh64_rows
from tract.errors import ConfigError, CudaError

__all__ = ["DTYPE_BYTES", "LOAD_THREADS", "SPLIT_LOAD_BYTES", "CudaError", "KVLayout",
           "TransferEngine"]

#: threads a large load's copy is spread over by default: on a 2-core machine
#: one thread's fresh loads reached about 0.6 of memcpy, two about 0.8 to 1.0
#: (`tract bench transfer`: get against get,1-thread)
LOAD_THREADS = min(2, len(os.sched_getaffinity(0)))
#: a load of fewer bytes is copied by its caller alone (a thread's hand-off
#: costs more than it saves)
SPLIT_LOAD_BYTES = 4 << 20

#: bytes per element of each KV dtype an engine may use
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "int8": 1, "uint8": 1}


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What one engine's KV block is: only identical layouts share blocks
    (their fingerprint is part of the namespace)."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int  # tokens per block
    engine_layout: str = "block_contiguous"  # the engine's name for its cache layout
    tp_rank: int = 0
    tp_size: int = 1
    kv_parts: int = 2  # K and V (1 for a joint latent cache)
    variant: str = ""  # anything else that changes the bytes (e.g. a CPU ISA build)

    def __post_init__(self):
        if not self.model:
            raise ConfigError("KVLayout.model must name the model")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"KVLayout.dtype {self.dtype!r} is not one of "
                              f"{sorted(DTYPE_BYTES)}")
        for field in ("num_layers", "num_kv_heads", "head_size", "block_size", "tp_size",
                      "kv_parts"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVLayout.{field} must be a positive int, got {value!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"KVLayout.tp_rank {self.tp_rank} is not in 0..{self.tp_size - 1}")

    @property
    def pieces(self) -> int:
        """Equal parts a block is hashed in: one per layer and K/V."""
        return self.num_layers * self.kv_parts

    @property
    def piece_bytes(self) -> int:
        return self.num_kv_heads * self.head_size * self.block_size * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.pieces * self.piece_bytes

    def fingerprint(self) -> str:
        """16 hex digits naming every field."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def namespace(self) -> str:
        """The block-hash namespace of this layout (`tract.hashing.BlockHasher`)."""
        return f"kv:{self.model}:{self.fingerprint()}"


def _dtype_name(block) -> str | None:
    """The element type of a typed array or tensor (``float16``...); None
    for raw bytes (uint8), which any layout takes."""
    dtype = getattr(block, "dtype", None)
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return None if name == "uint8" else name


def _bytes_of(block) -> memoryview:
    """A flat byte view of a C-contiguous CPU array or tensor (no copy)."""
    module = type(block).__module__
    if module.startswith("torch"):
        if block.device.type != "cpu":
            raise ValueError(f"a {block.device.type} tensor goes through the CUDA path")
        if not block.is_contiguous():
            raise ValueError("block tensors must be contiguous")
        import torch

        return memoryview(block.reshape(-1).view(torch.uint8).numpy())
    view = memoryview(block)
    if not view.c_contiguous:
        raise ValueError("block arrays must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class TransferEngine:
    """Copies whole blocks between engine memory and pool ranges."""

    def __init__(self, pool, layout: KVLayout, checksum: bool = True,
                 load_threads: int | None = None):
        if load_threads is None:
            load_threads = LOAD_THREADS
        if not isinstance(load_threads, int) or isinstance(load_threads, bool) \
                or load_threads < 1:
            raise ValueError(f"load_threads must be a positive int, got {load_threads!r}")
        self.pool, self.region, self.layout = pool, pool.region, layout
        self.checksum, self.load_threads = checksum, load_threads
        self._helpers: ThreadPoolExecutor | None = None  # made by the first split load
        self._accepted = {np.dtype(np.uint8)}
        self._format = b"B"  # the layout's element as a buffer names it (`flat_segments`)
        if layout.dtype in np.sctypeDict:
            self._accepted.add(np.dtype(layout.dtype))
            self._format = memoryview(np.empty(0, layout.dtype)).format.encode()
        self.seed = int.from_bytes(pool.header.hash_key[8:16], "little")
        self._cuda = None

    # ---------------------------------------------------------- segments

    def _segments(self, offsets, blocks: Sequence) -> tuple[np.ndarray, list]:
        """Every block (one buffer, or its segments in order) as flat byte
        views with the pool offset of each, checked against the layout."""
        if len(blocks) != len(offsets):
            raise ValueError(f"{len(offsets)} offsets but {len(blocks)} blocks")
        piece, want = self.layout.piece_bytes, self.layout.block_bytes
        fast = flat_segments(np.ascontiguousarray(offsets, dtype=np.int64), blocks, want, piece,
                             self._format)
        if fast is not None:  # buffers that fit (thousands per load): walked natively
            return fast
        return self._walk(offsets, blocks)

    def _walk(self, offsets, blocks: Sequence) -> tuple[np.ndarray, list]:
        """`_segments`, a block and a segment at a time: any block an engine
        hands (tensors, memoryviews...), each refusal explained."""
        piece, want = self.layout.piece_bytes, self.layout.block_bytes
        dtype = self.layout.dtype
        accepted = self._accepted  # numpy types taken without a name check
        views, where = [], []
        for row, (offset, block) in enumerate(zip(np.asarray(offsets).tolist(), blocks)):
            segments = block if isinstance(block, (list, tuple)) else [block]
            total = 0
            for segment in segments:
                if type(segment) is np.ndarray and segment.dtype in accepted \
                        and segment.flags.c_contiguous:
                    view, size = segment, segment.nbytes  # taken as is: no view to make
                else:
                    typed = _dtype_name(segment)
                    if typed is not None and typed != dtype:
                        raise ValueError(f"block {row}: a {typed} buffer, but layout "
                                         f"{self.layout.model!r} holds {dtype} (raw uint8 "
                                         f"bytes are taken as they are)")
                    view = _bytes_of(segment)
                    size = view.nbytes
                if size % piece:
                    raise ValueError(f"block {row}: a segment of {size} bytes is not a "
                                     f"whole number of {piece}-byte pieces (layer, K/V)")
                views.append(view)
                where.append(offset + total)
                total += size
            if total != want:
                raise ValueError(f"block {row} has {total} bytes; layout {self.layout.model!r} "
                                 f"blocks have {want}")
        return np.array(where, dtype=np.int64), views

    def host_views(self, blocks: Sequence) -> list[list] | None:
        """Each block's flat byte views in host memory, in order, checked
        against the layout; None for blocks on a CUDA device."""
        if len(blocks) and self._on_cuda(blocks[0]):
            return None
        size = self.layout.block_bytes
        where, views = self._segments(np.arange(len(blocks), dtype=np.int64) * size, blocks)
        grouped: list[list] = [[] for _ in blocks]
        for offset, view in zip((where // size).tolist(), views):
            grouped[offset].append(view)
        return grouped

    def device_segments(self, block) -> list:
        """A block on a device (one tensor, or its segments in order) as
        flat uint8 views of its segments, checked contiguous and against
        the layout's size."""
        import torch  # a device block is a tensor: torch is loaded

        segments = block if isinstance(block, (list, tuple)) else [block]
        flat = []
        for segment in segments:
            if not segment.is_contiguous():
                raise ValueError("block tensors must be contiguous")
            flat.append(segment.reshape(-1).view(torch.uint8))
        total = sum(int(view.numel()) for view in flat)
        if total != self.layout.block_bytes:
            raise ValueError(f"a block of {total} bytes; layout {self.layout.model!r} blocks "
                             f"have {self.layout.block_bytes}")
        return flat

    def check(self, blocks: Sequence) -> None:
        """Refuse ``blocks`` that do not fit the layout (size, segments,
        element type), as a copy would: for blocks nothing is copied into."""
        if len(blocks) and not self._on_cuda(blocks[0]):
            self._segments(np.zeros(len(blocks), np.int64), blocks)

    def piece_offsets(self, offsets) -> np.ndarray:
        """The pool offset of every piece of the blocks at ``offsets``."""
        offsets = np.asarray(offsets, dtype=np.int64)
        piece = self.layout.piece_bytes
        return (offsets[:, None] + piece * np.arange(self.layout.pieces)).ravel()

    def block_sums(self, digests: np.ndarray) -> np.ndarray:
        """Each block's checksum (u32) from its pieces' digests."""
        return xxh64_rows(digests.reshape(-1, self.layout.pieces), self.seed) & \
            np.uint64(0xFFFFFFFF)

    # ------------------------------------------------------------- moves

    def store(self, offsets, blocks: Sequence) -> np.ndarray:
        """Copy ``blocks`` to the pool ranges at ``offsets``: in memory on
        return (R3).  Returns each block's checksum (zeros without)."""
        if len(blocks) and self._on_cuda(blocks[0]):
            return self._cuda_engine().store(offsets, blocks)
        where, views = self._segments(offsets, blocks)
        digests = np.zeros(len(blocks) * self.layout.pieces, np.uint64) if self.checksum \
            else None
        self.region.copy_in_blocks(where, views, digests, self.seed, self.layout.piece_bytes)
        return self.block_sums(digests) if self.checksum else np.zeros(len(blocks), np.uint64)

    def load(self, offsets, blocks: Sequence, checksums=None) -> np.ndarray:
        """Fill ``blocks`` from the pool ranges at ``offsets``, read fresh
        (R4).  Returns which blocks are good: all, or with ``checksums``
        (and checksums on), those whose bytes match (a mismatch is a miss:
        the engine recomputes that block)."""
        if len(blocks) and self._on_cuda(blocks[0]):
            return self._cuda_engine().load(offsets, blocks, checksums)
        where, views = self._segments(offsets, blocks)
        verify = self.checksum and checksums is not None
        digests = np.zeros(len(blocks) * self.layout.pieces, np.uint64) if verify else None
        self._copy_out(where, views, digests, len(blocks) * self.layout.block_bytes)
        if not verify:
            return np.ones(len(blocks), dtype=np.bool_)
        return self.block_sums(digests) == (np.asarray(checksums, dtype=np.uint64)
                                       & np.uint64(0xFFFFFFFF))

    def _copy_out(self, where: np.ndarray, views: list, digests, total: int) -> None:
        """`Region.copy_out_blocks` over the segments, spread over
        ``load_threads`` threads when the load is `SPLIT_LOAD_BYTES` or
        more: each thread's share, a run of whole segments (so of whole
        pieces: its digests are its own slice), is one call, which drops its
        ranges, fences and copies them (R4 holds for each).  Not on a
        simulated region, nor while a cache-control trace is on (the native
        trace records every thread)."""
        piece = self.layout.piece_bytes
        threads = self.load_threads if total >= SPLIT_LOAD_BYTES else 1
        if threads == 1 or type(self.region) is not Region or self.region.tracing \
                or len(views) < threads:
            self.region.copy_out_blocks(where, views, digests, self.seed, piece)
            return
        if self._helpers is None:
            self._helpers = ThreadPoolExecutor(self.load_threads - 1,
                                               thread_name_prefix="tract-load")
        ends = np.cumsum([view.nbytes for view in views])
        cuts = [0, *np.searchsorted(ends, [total * k // threads for k in range(1, threads)],
                                    side="right").tolist(), len(views)]
        shares = []
        for first, last in zip(cuts, cuts[1:]):
            if first == last:
                continue
            low = int(ends[first - 1]) // piece if first else 0
            high = int(ends[last - 1]) // piece
            shares.append((where[first:last], views[first:last],
                           None if digests is None else digests[low:high], self.seed, piece))
        pending = [self._helpers.submit(self.region.copy_out_blocks, *share)
                   for share in shares[1:]]
        try:
            self.region.copy_out_blocks(*shares[0])
        finally:
            for future in pending:
                future.result()

    # -------------------------------------------------------------- CUDA

    @staticmethod
    def _on_cuda(block) -> bool:
        block = block[0] if isinstance(block, (list, tuple)) else block
        return type(block).__module__.startswith("torch") and block.device.type == "cuda"

    def _cuda_engine(self):
        if self._cuda is None:
            from tract.cuda import CudaTransfer

            self._cuda = CudaTransfer(self)
        return self._cuda

    def close(self) -> None:
        """Unregister the mapping from CUDA (when it was registered); end
        the load threads (when a load started them)."""
        if self._cuda is not None:
            self._cuda.close()
            self._cuda = None
        if self._helpers is not None:
            self._helpers.shutdown()
            self._helpers = None
