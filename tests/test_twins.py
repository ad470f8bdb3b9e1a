"""Twins that have no test file of their own (tests/twins.py): the batched
copies of the mapping against their one-block primitives, and the
allocator's look at a head record against the Python read."""

import random

import numpy as np
import pytest

import twins
from tract.alloc import OWNER_BYTES
from tract.pool import Pool
from tract.region import scratch_region


@pytest.fixture
def region():
    with scratch_region(1 << 20, name="twins") as region:
        yield region


def _copies(rng, piece):
    count = rng.randint(1, 4)
    sizes = [piece * rng.randint(1, 3) if piece else rng.randint(1, 9000) for _ in range(count)]
    offsets, at = [], 0
    for size in sizes:
        at += rng.randrange(0, 200)
        offsets.append(at)
        at += size
    return np.array(offsets, dtype=np.int64), sizes


def test_copy_in_blocks_is_a_batch_of_nontemporal_copies(region):
    """`copy_in_blocks` (no checksums): each block as `copy_in` streams it,
    with one store fence for the batch."""
    rng = random.Random(3)
    area = [(0, 1 << 16)]
    for trial in range(60):
        offsets, sizes = _copies(rng, 0)
        sources = [np.frombuffer(rng.randbytes(size), dtype=np.uint8) for size in sizes]

        def blocks():
            region.copy_in_blocks(offsets, sources)

        def one_by_one():
            for offset, source in zip(offsets, sources):
                region.copy_in(int(offset), source)

        region.fill(0, 1 << 16, 0x5A)
        want, got = twins.both(region, area, one_by_one, blocks)
        twins.check("tract._native._region.Region.copy_in_blocks", want, got,
                    adjust=_one_store_fence, context=trial)


def _one_store_fence(found, fast):
    """The declared difference: the blocks' store fences are one."""
    ops = tuple(sorted(op for _, batch in found for op in batch))
    return ([(found[-1][0], ops)] if found else found), fast


def test_copy_out_blocks_drops_every_block_then_fences_once(region):
    rng = random.Random(4)
    area = [(0, 1 << 16)]
    for trial in range(60):
        offsets, sizes = _copies(rng, 0)
        region.copy_in(0, rng.randbytes(1 << 16))

        def blocks():
            targets = [np.zeros(size, np.uint8) for size in sizes]
            region.copy_out_blocks(offsets, targets)
            return targets

        def one_by_one():
            targets = [np.zeros(size, np.uint8) for size in sizes]
            for offset, target in zip(offsets, targets):
                region.invalidate(int(offset), target.size, payload=True)
            region.fence()
            for offset, target in zip(offsets, targets):
                region.copy_out(int(offset), target)
            return targets

        want, got = twins.both(region, area, one_by_one, blocks)
        twins.check("tract._native._region.Region.copy_out_blocks", want, got, context=trial)


def test_digest_blocks_is_a_digest_per_piece(region):
    """`digest_blocks`: each piece hashed where it lies, in one call, with
    no cache control (its caller drops and fences, R4)."""
    from tract._native._region import digest

    rng = random.Random(5)
    area = [(0, 1 << 16)]
    region.copy_in(0, rng.randbytes(1 << 16))
    for trial in range(60):
        piece = rng.choice([0, 64, 241, 4096])
        length = piece * rng.randint(1, 3) if piece else rng.randint(1, 9000)
        offsets = np.array([rng.randrange(0, (1 << 16) - length) for _ in range(rng.randint(1, 4))],
                           dtype=np.int64)
        size = piece or length

        def blocks():
            sums = np.zeros(len(offsets) * (length // size), np.uint64)
            region.digest_blocks(offsets, length, sums, 9, piece)
            return sums.tolist()

        def one_by_one():
            return [digest(region.view(at, size), 9) for offset in offsets.tolist()
                    for at in range(offset, offset + length, size)]

        want, got = twins.both(region, area, one_by_one, blocks)
        twins.check("tract._native._region.Region.digest_blocks", want, got, context=trial)
        assert got.batches == []


def test_fresh_kind_reads_the_head_record_as_the_python_step_does(pool_path):
    Pool.create(pool_path, 96 << 16, chunk_size=1 << 16, max_nodes=4, lease_timeout=5.0,
                lock_mode="manager")
    with Pool.open(pool_path, 0, manager=True) as pool:
        allocator, layout = pool.allocator, pool.alloc_layout
        first = allocator.alloc_chunks(3)
        area = [(layout.owners, allocator.nchunks * OWNER_BYTES)]
        for chunk in [first, first + 1, 0, allocator.nchunks - 1, allocator.nchunks, -1]:
            def reference(chunk=chunk):
                return allocator.owner_fresh(chunk).kind \
                    if 0 <= chunk < allocator.nchunks else -1

            want, got = twins.both(pool.region, area, reference,
                                   lambda chunk=chunk: allocator.fast.fresh_kind(chunk))
            twins.check("tract._native._allocfast.ChunkFastPath.fresh_kind", want, got,
                        context=chunk)
        allocator.free_chunks(first)
