"""Where the CUDA path's time goes: each stage of `CudaTransfer.store` and
`load` timed alone, interleaved round by round with torch's pinned copies
of the same bytes (the bound).  Run by tests/cuda/check.sh on a CUDA
machine; prints one line per stage: median ms per batch and its share of
the bound's time."""

import os
import statistics
import sys
import time

import numpy as np
import torch

from tract.bench.transfer import layout_of
from tract.connector import Connector
from tract.pool import Pool
from tract.transfer import TransferEngine

MIB = 1 << 20
ROUNDS = 7


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def timed(function):
    start = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def profile(pool, size: int, count: int) -> None:
    engine = TransferEngine(pool, layout_of(size))
    cuda = engine._cuda_engine()
    region, dma = pool.region, cuda.dma
    offsets = [pool.alloc(size) for _ in range(count)]
    blocks = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda") for _ in range(count)]
    outs = [torch.empty_like(b) for b in blocks]
    pinned = torch.empty((count, size), dtype=torch.uint8, pin_memory=True)
    plans = cuda._ranges(offsets, blocks)
    sums = cuda.store(offsets, blocks)
    print(f"--- {size // 1024} KiB x {count}: host mapping pinned per torch: "
          f"{dma.host.is_pinned()}", flush=True)

    def flush():
        for offset in offsets:
            region.flush(offset, size, payload=True)
        region.fence()

    def invalidate():
        for offset in offsets:
            region.invalidate(offset, size, payload=True)
        region.fence()

    def raw_d2h():  # one cudaMemcpyAsync a block, straight to the mapping (cupy's binding)
        from cupy.cuda import runtime

        stream = torch.cuda.current_stream().cuda_stream
        for offset, block in zip(offsets, blocks):
            runtime.memcpyAsync(region.base + offset, block.data_ptr(), size, 2, stream)

    stages = {
        "bound d2h (pinned copy_)": lambda: [p.copy_(b, non_blocking=True) for p, b in zip(pinned, blocks)],
        "dma.to_pool": lambda: dma.to_pool(plans),
        **({"raw cudaMemcpyAsync d2h": raw_d2h} if _has_cupy() else {}),
        "flush+fence": flush,
        "digest_blocks (1 thread)": lambda: region.digest_blocks(
            np.array(offsets, dtype=np.int64), size, np.zeros(count * engine.layout.pieces,
                                                               np.uint64),
            engine.seed, engine.layout.piece_bytes),
        "CudaTransfer.store": lambda: cuda.store(offsets, blocks),
        "bound h2d (pinned copy_)": lambda: [b.copy_(p, non_blocking=True) for p, b in zip(pinned, outs)],
        "invalidate+fence": invalidate,
        "dma.from_pool": lambda: dma.from_pool(plans),
        "CudaTransfer.load": lambda: cuda.load(offsets, outs, sums),
    }
    samples = {name: [] for name in stages}
    for round_ in range(ROUNDS + 1):
        for name, function in stages.items():
            elapsed = timed(function)
            if round_:
                samples[name].append(elapsed)
    bound = statistics.median(samples["bound d2h (pinned copy_)"])
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"  {name:<28} {median * 1e3:9.3f} ms  {size * count / median / 1e9:7.2f} GB/s  "
              f"{median / bound:6.2f} x bound", flush=True)
    for connector_checksum in (True, False):
        connector = Connector(pool, layout_of(size), checksum=connector_checksum)
        times = {"store": [], "load": []}
        for round_ in range(ROUNDS + 1):
            keys = np.random.default_rng([size, round_, connector_checksum]).integers(
                0, 2**63, size=(count, 2), dtype=np.uint64)
            store = timed(lambda: connector.store(keys, blocks))
            load = timed(lambda: connector.load(keys, outs))
            if round_:
                times["store"].append(store)
                times["load"].append(load)
            while pool.index.evict(64, window=pool.index.capacity):
                pass
        for kind, values in times.items():
            median = statistics.median(values)
            print(f"  connector.{kind} checksum={connector_checksum!s:<5} {median * 1e3:9.3f} ms  "
                  f"{size * count / median / 1e9:7.2f} GB/s", flush=True)
        connector.close()
    engine.close()
    for offset in offsets:
        pool.free(offset)


def main() -> None:
    path = f"/dev/shm/tract-cuda-profile-{os.getpid()}"
    Pool.create(path, 4 << 30, chunk_size=2 * MIB, max_nodes=4, lease_timeout=10.0,
                index_capacity=4096)
    try:
        with Pool.open(path, 0, manager=True, populate=True) as pool:
            for size, count in [(2 * MIB, 8), (1 * MIB, 256), (16 * MIB, 4)]:
                profile(pool, size, count)
    finally:
        Pool.destroy(path)


if __name__ == "__main__":
    sys.exit(main())
