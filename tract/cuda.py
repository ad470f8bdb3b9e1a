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
over the pool ranges (`Region.digest_blocks`), on `DIGEST_THREADS` threads
that only read, overlapping the DMA (``checksum=False`` skips them): on a
store, each block as soon as its copy has landed (the calling thread writes
it back meanwhile); on a load, while the DMA reads the ranges.
"""

from __future__ import annotations

import concurrent.futures
import os
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


#: device memory for gathering a block's segments before its DMA (and
#: scattering them after): a ring of block-sized slots, at least one
STAGING_BYTES = 64 << 20


class CudaDma:
    """The device half: the mapping registered with CUDA (pinned host
    memory, see `HostRegistrations`) and the copies between device tensors
    and pool ranges, on a dedicated stream that first waits for the
    caller's current stream (the kernels that wrote the blocks, or still
    use the targets).  ``plans`` are ``(pool offset, flat uint8 segments)``,
    already checked; both calls return once the copies are done.

    A block of one segment moves by one DMA.  A block of several (an
    engine's per-layer K and V: 64 pieces of 32 KiB for Llama-3-8B) is
    gathered on the device into a slot of a staging ring by one kernel and
    moved by one DMA (a load: one DMA, then one kernel scatters it), as a
    DMA per piece costs more to issue than to run; everything runs in order
    on the one stream, so a slot is reused only after its last copy."""

    def __init__(self, region):
        import torch

        if not torch.cuda.is_available():
            raise CudaError("CUDA tensors given, but torch sees no CUDA device")
        self.region, self.torch = region, torch
        self.runtime = torch.cuda.cudart()
        self.stream = torch.cuda.Stream()
        self.base = region.base
        self.staging = None
        REGISTRATIONS.acquire(self.runtime, self.base, region.size)
        self.host = torch.from_numpy(region.view())  # the mapping, pinned

    def close(self) -> None:
        if self.host is None:
            return
        self.host = self.staging = None
        REGISTRATIONS.release(self.runtime, self.base)

    def _slots(self, plans):
        """A staging slot for each plan of several segments (None for the
        others), the ring allocated on first use, on this stream."""
        sizes = [sum(s.numel() for s in flat) for _, flat in plans if len(flat) > 1]
        if not sizes:
            return [None] * len(plans)
        slot = max(sizes)
        count = max(1, min(len(sizes), STAGING_BYTES // slot))
        if self.staging is None or self.staging.shape != (count, slot):
            self.staging = self.torch.empty((count, slot), dtype=self.torch.uint8,
                                            device=plans[0][1][0].device)
        slots, used = [], 0
        for _, flat in plans:
            if len(flat) > 1:
                size = sum(s.numel() for s in flat)
                slots.append(self.staging[used % count, :size])
                used += 1
            else:
                slots.append(None)
        return slots

    def _dma(self, offset: int, device, to_pool: bool) -> None:
        """One contiguous device buffer to or from the range at ``offset``
        (a DMA per registration chunk it spans)."""
        for start, length in spans(offset, device.numel()):
            at = start - offset
            if to_pool:
                self.host[start:start + length].copy_(device[at:at + length], non_blocking=True)
            else:
                device[at:at + length].copy_(self.host[start:start + length], non_blocking=True)

    def to_pool(self, plans, landed=None) -> None:
        """Copy each plan's segments to its range; ``landed(i)`` is called
        (in order) once plan ``i``'s bytes are in host memory, while the
        copies after it still run."""
        torch = self.torch
        events = []
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for (offset, flat), slot in zip(plans, self._slots(plans)):
                if slot is None:
                    self._dma(offset, flat[0], True)
                else:
                    torch.cat(flat, out=slot)
                    self._dma(offset, slot, True)
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
            for (offset, flat), slot in zip(plans, self._slots(plans)):
                if slot is None:
                    self._dma(offset, flat[0], False)
                    continue
                self._dma(offset, slot, False)
                torch._foreach_copy_(flat, list(slot.split([s.numel() for s in flat])))
        if meanwhile is not None:
            meanwhile()
        self.stream.synchronize()


#: threads that hash DMA'd blocks for their checksums (the copies are at
#: the link's speed; one core hashes a few GB/s): up to 8, half the cores
DIGEST_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


class CudaTransfer:
    """The CUDA half of one `TransferEngine`: the cache rules around the
    copies of ``dma`` (a `CudaDma` by default; the simulated suite gives a
    copier that stores through the host's cache, as DMA into a host's last
    level cache does).  Every flush, drop and fence is issued by the
    calling thread; the ``threads`` hashing for the checksums only read
    (0: the calling thread hashes too)."""

    def __init__(self, engine, dma=None, threads: int = DIGEST_THREADS):
        import torch

        self.engine, self.region, self.threads = engine, engine.region, threads
        self.torch = torch
        self.dma = dma if dma is not None else CudaDma(self.region)
        self.hashers = (concurrent.futures.ThreadPoolExecutor(threads, "tract-digest")
                        if threads > 0 else None)

    def close(self) -> None:
        self.dma.close()
        if self.hashers is not None:
            self.hashers.shutdown()

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

    def _digests(self, offsets: list[int], sums: np.ndarray, tasks: list) -> None:
        """Hash the pieces of the blocks at ``offsets`` into ``sums`` (their
        rows, in order): on a hashing thread when there are some (the task
        joins ``tasks``), else here."""
        engine, layout = self.engine, self.engine.layout

        def digest():
            self.region.digest_blocks(np.array(offsets, dtype=np.int64), layout.block_bytes,
                                      sums, engine.seed, layout.piece_bytes)
        if self.hashers is None:
            digest()
        else:
            tasks.append(self.hashers.submit(digest))

    def store(self, offsets, blocks) -> np.ndarray:
        engine, layout, region = self.engine, self.engine.layout, self.region
        plans = self._ranges(offsets, blocks)
        pieces = layout.pieces
        sums = np.zeros(len(plans) * pieces, dtype=np.uint64) if engine.checksum else None
        tasks: list = []
        # blocks hashed a group a task, each group once its last block landed: a
        # task a block costs more to hand over than to hash at 1 MiB and below
        group, landed_blocks = -(-len(plans) // max(1, self.threads)), []

        def landed(index):  # the DMA may have left its lines in this host's cache (R3)
            offset = plans[index][0]
            region.flush(offset, layout.block_bytes, payload=True)
            if sums is not None:
                landed_blocks.append(offset)
                if len(landed_blocks) == group or index == len(plans) - 1:
                    first = index + 1 - len(landed_blocks)
                    self._digests(landed_blocks[:], sums[first * pieces:(index + 1) * pieces],
                                  tasks)
                    landed_blocks.clear()

        try:
            self.dma.to_pool(plans, landed)
            region.fence()
        finally:
            for task in tasks:
                task.result()
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
        sums = np.zeros(len(plans) * layout.pieces, dtype=np.uint64)
        tasks: list = []

        def hash_all():  # the ranges, fresh (dropped above), hashed while the DMA reads them
            groups = max(1, min(len(plans), self.threads))
            for group in np.array_split(np.arange(len(plans)), groups):
                if len(group):
                    self._digests([plans[i][0] for i in group.tolist()],
                                  sums[group[0] * layout.pieces:(group[-1] + 1) * layout.pieces],
                                  tasks)

        try:
            self.dma.from_pool(plans, hash_all)
        finally:
            for task in tasks:
                task.result()
        return engine.block_sums(sums) == (np.asarray(checksums, dtype=np.uint64)
                                           & np.uint64(0xFFFFFFFF))
