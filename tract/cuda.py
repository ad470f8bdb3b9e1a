"""GPU <-> pool DMA for `tract.transfer.TransferEngine` (CUDA tensors).

The whole mapping is registered with ``cudaHostRegister`` once per
process, in chunks of `REGISTER_CHUNK` (well under the driver's limit on one
registration), so every pool range is pinned host memory: a copy is one DMA
on a dedicated stream (ordered after the caller's current stream), with no
bounce buffer.  torch's CUDA runtime bindings return error
codes instead of raising; each is checked here and raised as `CudaError`
with the call's name and the error's.

Cache rules (DESIGN.md): DMA into host memory may land in the last-level
cache of the host that owns the device, so a store writes its ranges back
(the payload instruction) and fences before it returns (R3); a load drops
its ranges first and fences (R4), so the DMA engine, which snoops this
host's caches, cannot read a stale line.  Checksums are computed by the CPU
over the pool ranges, overlapping the DMA (``checksum=False`` skips them):
on a store, each block as soon as its copy has landed, while its lines are
still cached, and written back right after (`Region.digest_blocks`); on a
load, while the DMA reads the ranges.
"""

from __future__ import annotations

import threading

import numpy as np

from tract.errors import CudaError

__all__ = ["REGISTER_CHUNK", "CudaDma", "CudaTransfer", "HostRegistrations", "spans"]

REGISTER_CHUNK = 1 << 30
_HOST_REGISTER_PORTABLE = 1
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def _code(code) -> int:
    return int(getattr(code, "value", code))


def _check(code, call: str, runtime=None) -> None:
    value = _code(code)
    if value != 0:
        try:
            name = runtime.cudaGetErrorString(code)
        except Exception:  # noqa: BLE001 - the code alone still names it
            name = "unknown"
        raise CudaError(f"{call} failed: CUDA error {value} ({name})")


def spans(offset: int, length: int, chunk: int = REGISTER_CHUNK):
    """The ``(offset, length)`` parts of a pool range, cut where a
    registration chunk ends: one DMA may not span two registrations (CUDA
    answers it with an invalid-argument error)."""
    while length > 0:
        take = min(length, chunk - offset % chunk)
        yield offset, take
        offset += take
        length -= take


class HostRegistrations:
    """Each mapping's registration with CUDA (``cudaHostRegister``, in
    chunks of `REGISTER_CHUNK`), shared by every `CudaDma` of it in this
    process: CUDA refuses to register the same memory twice (error 712), and
    two engines or connectors on one pool are common (a scheduler and a
    worker, a store and a load side).  The last release unregisters.  A
    chunk that something outside tract registered first is used as it is
    and left to its owner."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[int, list] = {}  # base -> [users, addresses tract registered]

    def acquire(self, runtime, base: int, size: int) -> None:
        with self._lock:
            held = self._held.get(base)
            if held is not None:
                held[0] += 1
                return
            ours: list[int] = []
            try:
                for start in range(0, size, REGISTER_CHUNK):
                    length = min(REGISTER_CHUNK, size - start)
                    code = runtime.cudaHostRegister(base + start, length,
                                                    _HOST_REGISTER_PORTABLE)
                    if _code(code) == _ALREADY_REGISTERED:
                        continue  # pinned by its owner: usable, not ours to unregister
                    _check(code, f"cudaHostRegister(offset {start}, {length} bytes)", runtime)
                    ours.append(base + start)
            except BaseException:
                self._unregister(runtime, ours)
                raise
            self._held[base] = [1, ours]

    def release(self, runtime, base: int) -> None:
        with self._lock:
            held = self._held.get(base)
            if held is None:
                return
            held[0] -= 1
            if held[0] == 0:
                del self._held[base]
                self._unregister(runtime, held[1])

    def users(self, base: int) -> int:
        with self._lock:
            held = self._held.get(base)
            return held[0] if held else 0

    @staticmethod
    def _unregister(runtime, addresses) -> None:
        for address in reversed(addresses):
            _check(runtime.cudaHostUnregister(address), "cudaHostUnregister", runtime)


REGISTRATIONS = HostRegistrations()


class CudaDma:
    """The device half: the mapping registered with CUDA (pinned host
    memory, see `HostRegistrations`) and the copies between device tensors
    and pool ranges, on a dedicated stream that first waits for the
    caller's current stream (the kernels that wrote the blocks, or still
    use the targets).  ``plans`` are ``(pool offset, flat uint8 segments)``,
    already checked; both calls return once the copies are done."""

    def __init__(self, region):
        import torch

        if not torch.cuda.is_available():
            raise CudaError("CUDA tensors given, but torch sees no CUDA device")
        self.region, self.torch = region, torch
        self.runtime = torch.cuda.cudart()
        self.stream = torch.cuda.Stream()
        self.base = region.base
        REGISTRATIONS.acquire(self.runtime, self.base, region.size)
        self.host = torch.from_numpy(region.view())  # the mapping, pinned

    def close(self) -> None:
        if self.host is None:
            return
        self.host = None
        REGISTRATIONS.release(self.runtime, self.base)

    def to_pool(self, plans, landed=None) -> None:
        """Copy each plan's segments to its range; ``landed(i)`` is called
        (in order) once plan ``i``'s bytes are in host memory, while the
        copies after it still run."""
        torch = self.torch
        events = []
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for offset, flat in plans:
                for segment in flat:
                    for start, length in spans(offset, segment.numel()):
                        at = start - offset
                        self.host[start:start + length].copy_(segment[at:at + length],
                                                              non_blocking=True)
                    offset += segment.numel()
                if landed is not None:
                    events.append(torch.cuda.Event())
                    events[-1].record(self.stream)
        for index, event in enumerate(events):
            event.synchronize()
            landed(index)
        self.stream.synchronize()

    def from_pool(self, plans, meanwhile=None) -> None:
        """Fill each plan's segments from its range; ``meanwhile()`` runs
        while the copies do (work that only reads the ranges)."""
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for offset, flat in plans:
                for segment in flat:
                    for start, length in spans(offset, segment.numel()):
                        at = start - offset
                        segment[at:at + length].copy_(self.host[start:start + length],
                                                      non_blocking=True)
                    offset += segment.numel()
        if meanwhile is not None:
            meanwhile()
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

    def _sums(self, count: int) -> np.ndarray:
        return np.zeros(count * self.engine.layout.pieces, dtype=np.uint64)

    def store(self, offsets, blocks) -> np.ndarray:
        engine, layout, region = self.engine, self.engine.layout, self.region
        plans = self._ranges(offsets, blocks)
        sums = self._sums(len(plans)) if engine.checksum else None

        def landed(index):  # the DMA may have left its lines in this host's cache (R3)
            offset = plans[index][0]
            if sums is None:
                region.flush(offset, layout.block_bytes, payload=True)
                return
            # hashed while still cached, then written back
            region.digest_blocks(np.array([offset], dtype=np.int64), layout.block_bytes,
                                 sums[index * layout.pieces:(index + 1) * layout.pieces],
                                 engine.seed, layout.piece_bytes, writeback=True)

        self.dma.to_pool(plans, landed)
        region.fence()
        if sums is None:
            return np.zeros(len(plans), dtype=np.uint64)
        return engine.block_sums(sums)

    def load(self, offsets, blocks, checksums=None) -> np.ndarray:
        engine, layout, region = self.engine, self.engine.layout, self.region
        plans = self._ranges(offsets, blocks)
        for offset, _ in plans:  # the DMA reads through this host's cache (R4)
            region.invalidate(offset, layout.block_bytes, payload=True)
        region.fence()
        if not (engine.checksum and checksums is not None):
            self.dma.from_pool(plans)
            return np.ones(len(plans), dtype=np.bool_)
        sums = self._sums(len(plans))
        # the CPU hashes the ranges (fresh: dropped above) while the DMA reads them
        self.dma.from_pool(plans, lambda: region.digest_blocks(
            np.array([offset for offset, _ in plans], dtype=np.int64), layout.block_bytes,
            sums, engine.seed, layout.piece_bytes))
        return engine.block_sums(sums) == (np.asarray(checksums, dtype=np.uint64)
                                           & np.uint64(0xFFFFFFFF))
