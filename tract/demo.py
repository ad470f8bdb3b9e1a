"""`tract demo`: one process writes KV-sized blocks into an emulated pool in
/dev/shm, another maps the same pool at its own address and reads them back.

This is the foundation's demo; it shows the mapping and the flush discipline
that every later layer is built on.  Protocol (DESIGN.md R3, R4, R5):

- the writer streams each block in (non-temporal copy: in memory on return),
  writes the block checksums, flushes them and fences, and only then writes
  the ready flag, flushes it and fences;
- the reader polls the flag, invalidating its line on every iteration, then
  invalidates the checksums and the payload before it reads them, and checks
  every value it read from the pool before using it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import uuid
import zlib

import numpy

from tract import platform
from tract.errors import CorruptionError
from tract.region import create_region, open_region

MAGIC = 0x5452_4143_5444_454D  # "TRACTDEM"
FLAG_OFFSET = 0        # line 0: magic, then ready flag (written last)
META_OFFSET = 64       # line 1: block count and size
SUMS_OFFSET = 128      # checksums, one u64 per block
HEADER_BYTES = 1 << 20
MIB = 1 << 20


def _writer(path: str, blocks: int, block_bytes: int, seed: int, results) -> None:
    region = open_region(path, populate=True)
    rng = numpy.random.default_rng(seed)
    payload = rng.integers(0, 256, (blocks, block_bytes), dtype=numpy.uint8)
    payload[:, :8] = numpy.arange(blocks, dtype="<u8").view(numpy.uint8).reshape(blocks, 8)
    sums = numpy.array([zlib.crc32(row) for row in payload], dtype=numpy.uint64)
    start = time.perf_counter()
    for block in range(blocks):
        region.copy_in(HEADER_BYTES + block * block_bytes, payload[block], nontemporal=True)
    elapsed = time.perf_counter() - start
    region.store_u64(META_OFFSET, blocks)
    region.store_u64(META_OFFSET + 8, block_bytes)
    region.copy_in(SUMS_OFFSET, sums, nontemporal=False)
    region.flush(META_OFFSET, SUMS_OFFSET - META_OFFSET + sums.nbytes)
    region.fence()
    region.store_u64(FLAG_OFFSET + 8, 1)
    region.flush(FLAG_OFFSET, 64)
    region.fence()
    results.put({"role": "writer", "pid": os.getpid(), "base": region.base,
                 "seconds": elapsed})
    region.close()


def _reader(path: str, results, timeout: float) -> None:
    region = open_region(path, populate=True)
    deadline = time.monotonic() + timeout
    while True:
        region.invalidate(FLAG_OFFSET, 64)
        region.fence()
        if region.load_u64(FLAG_OFFSET + 8) == 1:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"no ready flag in {path!r} after {timeout} s")
        time.sleep(0.001)
    region.invalidate(META_OFFSET, 64)
    region.fence()
    blocks, block_bytes = region.load_u64(META_OFFSET), region.load_u64(META_OFFSET + 8)
    if blocks * 8 > HEADER_BYTES - SUMS_OFFSET or HEADER_BYTES + blocks * block_bytes > region.size:
        raise CorruptionError(f"demo header at offset {META_OFFSET} of {path!r} claims "
                              f"{blocks} blocks of {block_bytes} bytes; pool has {region.size}")
    sums = numpy.empty(blocks, dtype=numpy.uint64)
    region.invalidate(SUMS_OFFSET, sums.nbytes)
    region.fence()
    region.copy_out(SUMS_OFFSET, sums)
    received = numpy.ones((blocks, block_bytes), dtype=numpy.uint8)  # touched: no page faults timed
    start = time.perf_counter()
    for index in range(blocks):
        offset = HEADER_BYTES + index * block_bytes
        region.invalidate(offset, block_bytes, payload=True)
        region.fence()
        region.copy_out(offset, received[index])
    elapsed = time.perf_counter() - start
    bad = [index for index in range(blocks)
           if zlib.crc32(received[index]) != sums[index]
           or int.from_bytes(received[index, :8], "little") != index]
    results.put({"role": "reader", "pid": os.getpid(), "base": region.base,
                 "seconds": elapsed, "bad_blocks": bad, "blocks": int(blocks)})
    region.close()


def run(quick: bool = False, directory: str = "/dev/shm") -> dict:
    """Run the demo and return its figures."""
    blocks, block_bytes = (64, 2 * MIB) if quick else (256, 2 * MIB)
    path = os.path.join(directory, f"tract-demo-{uuid.uuid4().hex[:8]}")
    total = blocks * block_bytes
    region = create_region(path, HEADER_BYTES + total)
    try:
        region.fill(0, HEADER_BYTES, 0)
        region.store_u64(FLAG_OFFSET, MAGIC)
        region.flush(0, HEADER_BYTES)
        region.fence()
        creator_base = region.base
        region.close()
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        reader = context.Process(target=_reader, args=(path, results, 60.0))
        writer = context.Process(target=_writer, args=(path, blocks, block_bytes, 7, results))
        reader.start()
        writer.start()
        report = {}
        for _ in range(2):
            item = results.get(timeout=120)
            report[item.pop("role")] = item
        writer.join()
        reader.join()
        if writer.exitcode or reader.exitcode:
            raise RuntimeError(f"demo worker failed: writer exit {writer.exitcode}, "
                               f"reader exit {reader.exitcode}")
    finally:
        os.unlink(path)
    return {
        "pool": path,
        "bytes": total,
        "blocks": blocks,
        "block_bytes": block_bytes,
        "cache_control": platform.default_cache_control().as_dict(),
        "creator_base": creator_base,
        "writer": report["writer"],
        "reader": report["reader"],
        "write_gbps": total / report["writer"]["seconds"] / 1e9,
        "read_gbps": total / report["reader"]["seconds"] / 1e9,
        "distinct_bases": len({creator_base, report["writer"]["base"], report["reader"]["base"]}),
        "verified": not report["reader"]["bad_blocks"] and report["reader"]["blocks"] == blocks,
    }


def main(quick: bool = False, as_json: bool = False) -> int:
    report = run(quick=quick)
    if as_json:
        print(json.dumps(report, indent=2))
        return 0 if report["verified"] else 1
    control = report["cache_control"]
    print(f"tract demo: a pool of {report['bytes'] // MIB} MiB in {report['pool']} "
          f"(coherence={control['coherence']}, flush={control['flush']}, "
          f"non-temporal={control['nontemporal']})")
    print(f"  writer pid {report['writer']['pid']} mapped it at {report['writer']['base']:#x} and "
          f"streamed {report['blocks']} blocks of {report['block_bytes'] // MIB} MiB: "
          f"{report['write_gbps']:.1f} GB/s, then published a ready flag (write, flush, fence)")
    print(f"  reader pid {report['reader']['pid']} mapped it at {report['reader']['base']:#x}, "
          f"polled the flag (invalidate, fence, read) and read every block: "
          f"{report['read_gbps']:.1f} GB/s")
    status = "all checksums match" if report["verified"] else \
        f"MISMATCH in blocks {report['reader']['bad_blocks']}"
    print(f"  {report['distinct_bases']} processes, {report['distinct_bases']} base addresses, "
          f"same bytes at the same offsets: {status}")
    return 0 if report["verified"] else 1
