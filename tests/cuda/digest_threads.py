"""Where the CUDA path's checksums can go (a diagnostic, not a test; it
needs no GPU): `Region.digest_blocks` over 256 x 1 MiB blocks of a pool
mapping, dropped from the cache first, on 1..16 threads, a group of blocks
a task or a block a task; then one thread on cached lines, a numpy copy
and the write-back per block, for scale.  Usage: python
tests/cuda/digest_threads.py (tests/cuda/check.sh runs it)."""
import concurrent.futures, os, time, statistics
import numpy as np
from tract.pool import Pool

MIB = 1 << 20
path = f"/dev/shm/tract-digest-threads-{os.getpid()}"
Pool.create(path, 1 << 30, chunk_size=2 * MIB, max_nodes=2, lease_timeout=10.0)
try:
    with Pool.open(path, 0, manager=True, populate=True) as pool:
        region = pool.region
        view = region.view()
        offs = np.array([pool.alloc(MIB) for _ in range(256)], dtype=np.int64)
        for o in offs.tolist():
            view[o:o + MIB] = np.random.default_rng(o).integers(0, 256, MIB, dtype=np.uint8)
        piece = 256 * 1024
        def digest(group):
            sums = np.zeros(len(group) * (MIB // piece), np.uint64)
            region.digest_blocks(group, MIB, sums, 7, piece)
        def flush_all():
            for o in offs.tolist():
                region.flush(o, MIB, payload=True)
            region.fence()
        print("cpus", os.cpu_count(), flush=True)
        for threads in (1, 2, 4, 8, 16):
            with concurrent.futures.ThreadPoolExecutor(threads) as ex:
                for mode in ("groups", "per-block"):
                    times = []
                    for _ in range(6):
                        flush_all()
                        t = time.perf_counter()
                        if mode == "groups":
                            list(ex.map(digest, np.array_split(offs, threads)))
                        else:
                            list(ex.map(digest, [offs[i:i + 1] for i in range(256)]))
                        times.append(time.perf_counter() - t)
                    m = statistics.median(times[1:])
                    print(f"threads {threads:2d} {mode:9s} {256 * MIB / m / 1e9:6.1f} GB/s", flush=True)
        # cached (not flushed) single thread
        t = time.perf_counter(); digest(offs); m = time.perf_counter() - t
        print(f"1 thread, lines cached: {256 * MIB / m / 1e9:6.1f} GB/s")
        a = np.empty(256 * MIB, np.uint8); b = np.ones(256 * MIB, np.uint8)
        t = time.perf_counter(); np.copyto(a, b); m = time.perf_counter() - t
        print(f"numpy copy 256 MiB: {256 * MIB / m / 1e9:6.1f} GB/s")
        t = time.perf_counter(); flush_all(); m = time.perf_counter() - t
        print(f"flush 256 x 1 MiB: {m * 1e3:.1f} ms; per block {m / 256 * 1e6:.1f} us")
        del view
        for o in offs.tolist():
            pool.free(o)
finally:
    Pool.destroy(path)
