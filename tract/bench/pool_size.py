"""`tract bench scale`, pool sizes: what a store costs as the pool grows,
and how another node stores once the node that filled the pool is gone.

Real pools in /dev/shm, one at a time (at most 8 GiB held), 256 KiB blocks
stored through the public `Connector`.  For each size (``--quick``: 256 MiB
and 1 GiB; else up to 8 GiB, as memory allows) node 0 fills the pool, then:

- ``store_evict``: node 0 stores 8 new blocks, each store evicting, round
  by round with a plain copy of the same 8 blocks (numpy into a buffer of
  this process): per block, the median and the 99th percentile, and the
  paired ratio copy / store (so 0.1 is "10 times a plain copy");
- ``vs_smallest``: each size's median store against the smallest size's
  (1.0: flat);
- ``after_close`` / ``after_kill``: node 0 closes (or its process is
  killed), node 1 opens and stores: its first store's seconds, against
  the pool's lease (after a kill it waits for node 0's lease to lapse, and
  for the lock manager node 0 ran to be taken over), then for a window
  the share of its stores that cost at most 3 times node 0's median; the
  seconds of its join and close, each size's against the smallest's, and
  its close against the control: unmapping as many touched pages of a
  mapping of its own, with no pool held (``close_vs_unmap``: the kernel's
  share of a close, which grows with the pages a process touched).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import time
import uuid

import numpy as np

from tract.bench import Result

__all__ = ["BLOCKS", "after_gone", "fill", "layout", "run", "store_evict", "tokens"]

MIB = 1 << 20
BLOCKS = 8  # per store
LEASE = 2.0


def layout():
    from tract.transfer import KVLayout

    # 16 tokens x 32 layers x 2 (K, V) x 8 heads x 16 x 2 bytes = 256 KiB a block
    return KVLayout(model="tract-bench-size", dtype="float16", num_layers=32, num_kv_heads=8,
                    head_size=16, block_size=16)


def tokens(serial: int) -> np.ndarray:
    """The tokens of prompt ``serial``: `BLOCKS` blocks of 16."""
    return np.random.default_rng(serial).integers(0, 50_000, BLOCKS * 16)


def fill(kv, pool, start: int) -> int:
    """Store until a store evicts; returns the next serial."""
    blocks = [np.full(kv.layout.block_bytes, 7, np.uint8) for _ in range(BLOCKS)]
    serial = start
    while True:
        before = pool.counters().get(pool.node, {}).get("evictions", 0)
        kv.store(tokens(serial), blocks)
        serial += 1
        if pool.counters()[pool.node].get("evictions", 0) > before:
            return serial


def _filler(path: str, ready, leave) -> None:
    """Node 0 in its own process: fill the pool, say so, then close (or wait
    to be killed)."""
    from tract.connector import Connector
    from tract.pool import Pool

    with Pool.open(path, 0, manager=True) as pool:
        fill(Connector(pool, layout(), timeout=30.0), pool, 0)
        ready.set()
        leave.wait(600)


def store_evict(path: str, rounds: int) -> tuple[list[float], list[float]]:
    """Node 0 fills the pool, then stores ``rounds`` times 8 new blocks,
    each round beside a plain copy of them: (store, copy) seconds per block."""
    from tract.connector import Connector
    from tract.pool import Pool

    shape = layout()
    blocks = [np.full(shape.block_bytes, 7, np.uint8) for _ in range(BLOCKS)]
    copies = [np.empty(shape.block_bytes, np.uint8) for _ in range(BLOCKS)]
    stores, plain = [], []
    with Pool.open(path, 0, manager=True) as pool:
        kv = Connector(pool, shape, timeout=30.0)
        serial = fill(kv, pool, 0)
        for _ in range(rounds):
            start = time.perf_counter()
            kv.store(tokens(serial), blocks)
            stores.append((time.perf_counter() - start) / BLOCKS)
            serial += 1
            start = time.perf_counter()
            for block, copy in zip(blocks, copies):
                np.copyto(copy, block)
            plain.append((time.perf_counter() - start) / BLOCKS)
    return stores, plain


def after_gone(path: str, how: str, window: float) -> dict:
    """Node 0 fills the pool in a child process and closes (or is killed);
    node 1 joins, stores for ``window`` seconds and closes: the seconds of
    its join, its first store and its close, and each later store's
    seconds per block (``each``)."""
    from tract.connector import Connector, warm_up
    from tract.pool import Pool

    context = multiprocessing.get_context("spawn")
    ready, leave = context.Event(), context.Event()
    child = context.Process(target=_filler, args=(path, ready, leave), daemon=True)
    child.start()
    try:
        if not ready.wait(600):
            raise RuntimeError("the filling node did not fill the pool in 600 s")
        if how == "close":
            leave.set()
            child.join(60)
        else:
            os.kill(child.pid, signal.SIGKILL)
            child.join(60)
        shape = layout()
        blocks = [np.full(shape.block_bytes, 9, np.uint8) for _ in range(BLOCKS)]
        each = []
        warm_up()  # as the engine adapters do before they open their pool
        start = time.perf_counter()
        pool = Pool.open(path, 1, manager=True)
        joined = time.perf_counter() - start
        try:
            kv = Connector(pool, shape, timeout=30.0)
            serial, start = 1 << 30, time.perf_counter()
            kv.store(tokens(serial), blocks)
            first = time.perf_counter() - start
            end = time.perf_counter() + window
            while time.perf_counter() < end:
                serial += 1
                start = time.perf_counter()
                kv.store(tokens(serial), blocks)
                each.append((time.perf_counter() - start) / BLOCKS)
        finally:
            resident = _resident(path)
            start = time.perf_counter()
            pool.close()
            closed = time.perf_counter() - start
        return {"join": joined, "first_store": first, "close": closed, "each": each,
                "resident": resident}
    finally:
        if child.is_alive():
            child.kill()
        child.join()


def _resident(path: str) -> int:
    """Bytes of this process's mappings of ``path`` in memory (the pages it
    touched), from /proc/self/smaps; 0 where there is none."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                fields = line.split()
                if fields and "-" in fields[0] and not fields[0].endswith(":"):
                    inside = fields[-1] == path  # a mapping's first line
                elif inside and fields[0] == "Rss:":
                    total += int(fields[1]) * 1024
    except OSError:
        return 0
    return total


def _unmap_seconds(nbytes: int) -> float:
    """The seconds a close of a mapping in /dev/shm of ``nbytes``, every
    page touched, takes: what the kernel charges a close for the pages a
    process used (4 KiB pages of tmpfs here; a device-DAX pool maps 2 MiB
    pages), measured with no pool held."""
    from tract.region import create_region

    path = f"/dev/shm/tract-bench-unmap-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:  # the file outlives the mapping, as a pool's does: the close frees no page
        region = create_region(path, max(nbytes, 4096))
        region.fill(0, max(nbytes, 4096), 1)
        start = time.perf_counter()
        region.close()
        return time.perf_counter() - start
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _sizes(quick: bool) -> list[int]:
    import psutil

    top = 1024 if quick else 8192
    room = psutil.disk_usage("/dev/shm").free // MIB // 2  # the pool, and what the rest needs
    return [size for size in (256, 1024, 4096, 8192) if size <= min(top, room)]


def run(quick: bool = False) -> list[Result]:
    from tract.pool import Pool

    rounds, window = (60, 3.0) if quick else (300, 30.0)
    results, medians, steps = [], {}, {}
    for size in _sizes(quick):
        path = f"/dev/shm/tract-bench-size-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        Pool.create(path, size * MIB, lease_timeout=LEASE)
        try:
            stores, plain = store_evict(path, rounds)
        finally:
            Pool.destroy(path)
        median = medians[size] = statistics.median(stores)
        p99 = float(np.percentile(stores, 99))
        ratios = sorted(copy / store for store, copy in zip(stores, plain))
        name = f"scale[store_evict,size={size}MiB]"
        results += [
            Result(f"{name}[p50]", median, "s per block", False, "plain copy",
                   statistics.median(plain),
                   (statistics.median(ratios), ratios[0], ratios[-1])),
            Result(f"{name}[p99]", p99, "s per block", False, "store p50", median)]
        if size != min(medians):
            smallest = min(medians)
            results.append(Result(f"scale[store_evict,vs_smallest,size={size}MiB]", median,
                                  "s per block", False, f"size={smallest}MiB",
                                  medians[smallest]))
        for how in ("close", "kill"):
            Pool.create(path, size * MIB, lease_timeout=LEASE)
            try:
                seen = after_gone(path, how, window)
            finally:
                Pool.destroy(path)
            # the control, with no pool held: unmapping as many touched pages
            unmap = _unmap_seconds(seen["resident"])
            each = seen["each"]
            steady = sum(cost <= 3 * median for cost in each) / max(1, len(each))
            results += [
                Result(f"scale[after_{how},first_store,size={size}MiB]",
                       seen["first_store"], "s", False, "lease", LEASE),
                Result(f"scale[after_{how},steady_share,size={size}MiB]", steady,
                       f"share of stores at most 3x node 0's p50 in {window:g} s", True),
                Result(f"scale[after_{how},close_vs_unmap,size={size}MiB]", seen["close"],
                       "s", False, f"unmapping {seen['resident'] / MIB:.0f} MiB of touched "
                       f"pages", unmap)]
            for step in ("join", "close"):
                joins = steps.setdefault((how, step), {})
                joins[size] = seen[step]
                smallest = min(joins)
                results.append(Result(
                    f"scale[after_{how},{step},size={size}MiB]", seen[step], "s", False,
                    f"size={smallest}MiB" if size != smallest else None,
                    joins[smallest] if size != smallest else None))
    return results
