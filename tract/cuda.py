"""GPU <-> pool DMA for `tract.transfer.TransferEngine` (CUDA tensors).

The whole mapping is registered with ``cudaHostRegister`` once, in chunks
of `REGISTER_CHUNK` (well under the driver's limit on one registration), so
every pool range is pinned host memory: a copy is one DMA on a dedicated
stream, with no bounce buffer.  torch's CUDA runtime bindings return error
codes instead of raising; each is checked here and raised as `CudaError`
with the call's name and the error's.

Cache rules (DESIGN.md): DMA into host memory may land in the last-level
cache of the host that owns the device, so a store writes its ranges back
(the payload instruction) and fences before it returns (R3); a load drops
its ranges first and fences (R4), so the DMA engine, which snoops this
host's caches, cannot read a stale line.  Checksums are computed by the CPU
over the pool ranges (a second pass; ``checksum=False`` skips it).
"""

from __future__ import annotations

import numpy as np

from tract._native._region import digest
from tract.errors import CudaError

__all__ = ["REGISTER_CHUNK", "CudaDma", "CudaTransfer"]

REGISTER_CHUNK = 1 << 30
_HOST_REGISTER_PORTABLE = 1


def _check(code, call: str) -> None:
    value = int(getattr(code, "value", code))
    if value != 0:
        import torch

        try:
            name = torch.cuda.cudart().cudaGetErrorString(code)
        except Exception:  # noqa: BLE001 - the code alone still names it
            name = "unknown"
        raise CudaError(f"{call} failed: CUDA error {value} ({name})")


class CudaDma:
    """The device half: the mapping registered with CUDA (pinned host
    memory) and the copies between device tensors and pool ranges, on a
    dedicated stream.  ``plans`` are ``(pool offset, flat uint8 segments)``,
    already checked; both calls return once the copies are done."""

    def __init__(self, region):
        import torch

        if not torch.cuda.is_available():
            raise CudaError("CUDA tensors given, but torch sees no CUDA device")
        self.region, self.torch = region, torch
        self.runtime = torch.cuda.cudart()
        self.stream = torch.cuda.Stream()
        self.registered: list[int] = []
        base = region.base
        try:
            for start in range(0, region.size, REGISTER_CHUNK):
                size = min(REGISTER_CHUNK, region.size - start)
                _check(self.runtime.cudaHostRegister(base + start, size,
                                                     _HOST_REGISTER_PORTABLE),
                       f"cudaHostRegister(offset {start}, {size} bytes)")
                self.registered.append(base + start)
        except BaseException:
            self.close()
            raise
        self.host = torch.from_numpy(region.view())  # the mapping, pinned

    def close(self) -> None:
        self.host = None
        for address in reversed(self.registered):
            _check(self.runtime.cudaHostUnregister(address), "cudaHostUnregister")
        self.registered.clear()

    def to_pool(self, plans) -> None:
        with self.torch.cuda.stream(self.stream):
            for offset, flat in plans:
                for segment in flat:
                    self.host[offset:offset + segment.numel()].copy_(segment, non_blocking=True)
                    offset += segment.numel()
        self.stream.synchronize()

    def from_pool(self, plans) -> None:
        with self.torch.cuda.stream(self.stream):
            for offset, flat in plans:
                for segment in flat:
                    segment.copy_(self.host[offset:offset + segment.numel()], non_blocking=True)
                    offset += segment.numel()
        self.stream.synchronize()


class CudaTransfer:
    """The CUDA half of one `TransferEngine`: the cache rules around the
    copies of ``dma`` (a `CudaDma` by default; the simulated suite gives a
    copier that stores through the host's cache, as DMA into a host's last
    level cache does)."""

    def __init__(self, engine, dma=None):
        import torch

        self.engine, self.region = engine, engine.region
        self.torch = torch
        self.dma = dma if dma is not None else CudaDma(self.region)

    def close(self) -> None:
        self.dma.close()

    def _flat(self, block):
        torch = self.torch
        segments = block if isinstance(block, (list, tuple)) else [block]
        for segment in segments:
            if not segment.is_contiguous():
                raise ValueError("block tensors must be contiguous")
        return [segment.reshape(-1).view(torch.uint8) for segment in segments]

    def _ranges(self, offsets, blocks):
        layout = self.engine.layout
        plans = []
        for row, (offset, block) in enumerate(zip(np.asarray(offsets).tolist(), blocks)):
            flat = self._flat(block)
            total = sum(segment.numel() for segment in flat)
            if total != layout.block_bytes:
                raise ValueError(f"block {row} has {total} bytes; layout {layout.model!r} "
                                 f"blocks have {layout.block_bytes}")
            if not 0 <= offset <= self.region.size - total:
                raise ValueError(f"block {row}: range [{offset}, {offset + total}) is outside "
                                 f"the {self.region.size}-byte mapping")
            plans.append((offset, flat))
        return plans

    def _sums(self, offsets) -> np.ndarray:
        engine, layout = self.engine, self.engine.layout
        digests = np.array([digest(self.region.view(int(offset), layout.piece_bytes), engine.seed)
                            for offset in engine.piece_offsets(offsets)], dtype=np.uint64)
        return engine.block_sums(digests)

    def store(self, offsets, blocks) -> np.ndarray:
        plans = self._ranges(offsets, blocks)
        self.dma.to_pool(plans)
        for offset, flat in plans:  # the DMA may have left them in this host's cache (R3)
            self.region.flush(offset, sum(s.numel() for s in flat), payload=True)
        self.region.fence()
        if not self.engine.checksum:
            return np.zeros(len(plans), dtype=np.uint64)
        return self._sums(offsets)

    def load(self, offsets, blocks, checksums=None) -> np.ndarray:
        plans = self._ranges(offsets, blocks)
        for offset, flat in plans:  # the DMA reads through this host's cache (R4)
            self.region.invalidate(offset, sum(s.numel() for s in flat), payload=True)
        self.region.fence()
        self.dma.from_pool(plans)
        if not (self.engine.checksum and checksums is not None):
            return np.ones(len(plans), dtype=np.bool_)
        return self._sums(offsets) == (np.asarray(checksums, dtype=np.uint64)
                                       & np.uint64(0xFFFFFFFF))
