"""The native critical sections of the global path (`tract._native._allocfast`)
against their reference, the Python steps of `tract.alloc.Allocator`, on the
same memory states: same result (or the reference's error where the native
section hands the case back), same bytes."""

import contextlib
import ctypes
import itertools
import random

import numpy as np
import pytest

import naive
import twins
from tract._kernels import bitmap
from tract.alloc import FREE, HEAD, OWNER_BYTES, SLAB, TAIL
from tract.errors import CorruptionError, LeaseLost, PoolFull
from tract.pool import Pool

MAX_NODES = 4


@pytest.fixture
def pool(pool_path):
    # 80 chunks: a bitmap with a partial word; records of two chunks a line
    Pool.create(pool_path, 96 << 16, chunk_size=1 << 16, max_nodes=MAX_NODES,
                lease_timeout=0.5, lock_mode="manager")
    with Pool.open(pool_path, 1, manager=True) as handle:
        yield handle


def _area(pool):
    layout = pool.alloc_layout
    return layout.cursor_line, layout.rings - layout.cursor_line


def _snapshot(pool):
    offset, length = _area(pool)
    return bytes(pool.region.read(offset, length))


def _restore(pool, state):
    offset, _ = _area(pool)
    pool.region.copy_in(offset, state, nontemporal=False)


def _record(node, kind, pid, epoch, run):
    return np.array([(node + 1 if kind != FREE else 0) | kind << 16 | pid << 32, epoch, run, 0],
                    dtype=np.uint64).tobytes()


def _state(pool, rng, density, cursor):
    """Random extents and slab chunks over about ``density`` of the heap."""
    allocator, layout = pool.allocator, pool.alloc_layout
    nchunks = allocator.nchunks
    bits = np.zeros(layout.bitmap_bytes // 8, dtype=np.uint64)
    records = bytearray(nchunks * OWNER_BYTES)
    chunk = 0
    while chunk < nchunks:
        run = min(rng.choice([1, 1, 2, 3, 8]), nchunks - chunk)
        if rng.random() < density:
            kind = SLAB if run == 1 and rng.random() < 0.3 else HEAD
            node = rng.randrange(MAX_NODES)
            for index in range(chunk, chunk + run):
                bits[index // 64] |= np.uint64(1 << index % 64)
                records[index * OWNER_BYTES:(index + 1) * OWNER_BYTES] = (
                    _record(node, kind, 7, 3, run) if index == chunk
                    else _record(node, TAIL, 7, 3, chunk))
        chunk += run
    state = cursor.to_bytes(8, "little") + bytes(56) + bits.tobytes() + bytes(records)
    return state + bytes(_area(pool)[1] - len(state))


@contextlib.contextmanager
def _held(pool):
    lock = pool.lock("alloc")
    lock.acquire(5)
    try:
        yield lock
    finally:
        lock.release()


def _run_both(pool, state, native, reference, name):
    """Each from ``state``, under the lock, traced (tests/twins.py): the
    native section's (result, bytes) when it handed the case back, else
    held to its reference (result, bytes, cache-control batches).  Returns
    ((native result, bytes), (reference result or error type, bytes))."""
    outcomes = []
    lock_lines = [(pool.layout.offset, pool.layout.nbytes)]  # stale too, not compared
    for step in (reference, native):
        _restore(pool, state)
        with _held(pool) as lock:  # its release fences the last flushes: settled
            outcomes.append(twins.run(pool.region, [_area(pool)], lambda: step(lock),
                                      also=lock_lines, settle=True,
                                      errors=(CorruptionError, LeaseLost, PoolFull, ValueError)))
    reference, fast = outcomes
    if fast.result != "handed back":
        layout = pool.alloc_layout
        lock_area = range(pool.layout.offset, pool.layout.offset + pool.layout.nbytes)
        bitmap = range(layout.bitmap, layout.bitmap + layout.bitmap_bytes)
        twins.check(name, reference, fast, adjust=twins.compose(
            twins.merge_into_first(lambda offset: offset in lock_area),
            (twins.drop_refetch if name.endswith(".alloc") else twins.hoist_reads)(
                lambda offset: offset in bitmap)))
    result = reference.result[0] if isinstance(reference.result, tuple) else reference.result
    return (fast.result, fast.after[0]), (result, reference.after[0])


def test_alloc_matches_the_reference_on_random_states(pool):
    allocator, rng = pool.allocator, random.Random(5)
    owner = (pool.node + 1) | allocator.pid << 32
    outcomes = {"taken": 0, "handed back": 0}
    for density, count, cursor_kind, kind in itertools.product(
            [0.0, 0.3, 0.7, 0.95, 1.0], [1, 2, 5, 17, 80], ["start", "random", "end"],
            [HEAD, SLAB]):
        if kind == SLAB and count != 1:
            continue
        cursor = {"start": 0, "random": rng.randrange(allocator.nchunks),
                  "end": allocator.nchunks - 1}[cursor_kind]
        state = _state(pool, rng, density, cursor)

        def native(lock):
            first = allocator.fast.alloc(count, kind, owner, pool.epoch, lock.fast)
            return "handed back" if first < 0 else first

        def reference(lock):
            first = allocator._find(count, lock)
            lock.check()
            allocator._publish(first, count, kind, owner)
            return first

        (fast, fast_bytes), (ref, ref_bytes) = _run_both(
            pool, state, native, reference, "tract._native._allocfast.ChunkFastPath.alloc")
        if fast == "handed back":
            assert fast_bytes == state, "a handed-back alloc wrote"
            # nothing free from the cursor: the reference reclaims or is full
            assert ref is PoolFull or isinstance(ref, int)
        else:
            assert (fast, fast_bytes) == (ref, ref_bytes)
        outcomes["handed back" if fast == "handed back" else "taken"] += 1
    assert outcomes["taken"] > 50 and outcomes["handed back"] > 5, outcomes


def test_free_matches_the_reference_on_random_and_broken_records(pool):
    allocator, rng = pool.allocator, random.Random(9)
    layout = pool.alloc_layout
    checked = {"freed": 0, "handed back": 0}
    for _ in range(40):
        state = bytearray(_state(pool, rng, 0.6, 0))
        owners = layout.owners - layout.cursor_line
        heads = [chunk for chunk in range(allocator.nchunks)
                 if (int.from_bytes(state[owners + chunk * OWNER_BYTES:][:8], "little") >> 16
                     & 0xFF) in (HEAD, SLAB)]
        if not heads:
            continue
        first = rng.choice(heads)
        record = owners + first * OWNER_BYTES
        damage = rng.choice(["none", "none", "kind", "node", "no node", "run", "tail",
                             "tail kind", "free"])
        word = int.from_bytes(state[record:record + 8], "little")
        if damage == "kind":
            word = word & ~(0xFF << 16) | 9 << 16
        elif damage == "node":
            word = word & ~0xFFFF | (MAX_NODES + 3)
        elif damage == "no node":  # the kind kept: only the node field tells
            word = word & ~0xFFFF
        elif damage == "free":
            word = 0
        state[record:record + 8] = word.to_bytes(8, "little")
        if damage == "run":
            state[record + 16:record + 24] = (allocator.nchunks + 1).to_bytes(8, "little")
        run = int.from_bytes(state[record + 16:record + 24], "little")
        if damage == "tail" and 1 < run <= allocator.nchunks - first:
            tail = record + rng.randrange(1, run) * OWNER_BYTES
            state[tail + 16:tail + 24] = (first + 1).to_bytes(8, "little")
        if damage == "tail kind" and 1 < run <= allocator.nchunks - first:
            tail = record + rng.randrange(1, run) * OWNER_BYTES  # names its head, wrong kind
            tail_word = int.from_bytes(state[tail:tail + 8], "little")
            state[tail:tail + 8] = (tail_word & ~(0xFF << 16) | HEAD << 16).to_bytes(8, "little")
        state = bytes(state)
        kind = (int.from_bytes(state[record:record + 8], "little") >> 16) & 0xFF
        for expected in (HEAD, SLAB):
            def native(lock, expected=expected):
                count = allocator.fast.free(first, expected, lock.fast)
                return "handed back" if count < 0 else count

            def reference(lock, expected=expected):
                count = allocator._extent(first, expected)
                lock.check()
                allocator._release(first, count)
                return count

            (fast, fast_bytes), (ref, ref_bytes) = _run_both(
                pool, state, native, reference, "tract._native._allocfast.ChunkFastPath.free")
            if fast == "handed back":
                assert fast_bytes == state, "a handed-back free wrote"
                assert ref in (ValueError, CorruptionError), (damage, kind, expected)
            else:
                assert (fast, fast_bytes) == (ref, ref_bytes)
            checked[fast if fast == "handed back" else "freed"] += 1
    assert checked["freed"] > 10 and checked["handed back"] > 10


def test_a_free_of_a_tail_chunk_is_handed_back(pool):
    """A free asked of a tail chunk as the kind its record holds: no extent
    starts there, so the native free writes nothing and hands it back, and
    the reference refuses it, even where the records after it read as the
    tails of a run starting there (its back pointer, 2, taken for a run)."""
    allocator, layout = pool.allocator, pool.alloc_layout
    state = bytearray(_state(pool, random.Random(4), 0.0, 0))
    owners = layout.owners - layout.cursor_line
    for chunk, record in ((12, _record(1, TAIL, 7, 3, 2)), (13, _record(1, TAIL, 7, 3, 12))):
        state[owners + chunk * OWNER_BYTES:owners + (chunk + 1) * OWNER_BYTES] = record
    state = bytes(state)

    def native(lock):
        count = allocator.fast.free(12, TAIL, lock.fast)
        return "handed back" if count < 0 else count

    def reference(lock):
        return allocator._extent(12, TAIL)

    (fast, fast_bytes), (ref, _) = _run_both(pool, state, native, reference,
                                             "tract._native._allocfast.ChunkFastPath.free")
    assert (fast, ref) == ("handed back", ValueError)
    assert fast_bytes == state


def test_a_lost_grant_writes_nothing_and_the_reference_raises(pool):
    allocator = pool.allocator
    owner = (pool.node + 1) | allocator.pid << 32
    state = _state(pool, random.Random(2), 0.3, 0)
    _restore(pool, state)
    first = allocator.alloc_chunks(3)
    allocated = _snapshot(pool)
    with _held(pool) as lock:
        lock.fast.epoch += 1  # as if the manager had granted the lock again since
        try:
            assert allocator.fast.alloc(2, HEAD, owner, pool.epoch, lock.fast) == -1
            assert allocator.fast.free(first, HEAD, lock.fast) == -1
            assert _snapshot(pool) == allocated
            with pytest.raises(LeaseLost):
                lock.check()
        finally:
            lock.fast.epoch -= 1


@pytest.mark.parametrize("past", [0, 4, 2**63])
def test_a_bad_cursor_is_handed_back_and_reported(pool, past):
    """A cursor at or past the chunk count, the first bad one included:
    the bit it names lies in the bitmap's padding, which reads as free."""
    allocator = pool.allocator
    cursor = allocator.nchunks + past
    state = bytearray(_state(pool, random.Random(3), 0.2, 0))
    state[:8] = cursor.to_bytes(8, "little")
    _restore(pool, bytes(state))
    with pytest.raises(CorruptionError, match=f"cursor at offset .* is {cursor};"):
        allocator.alloc_chunks(1)
    assert _snapshot(pool) == bytes(state)


@pytest.mark.parametrize("damage", ["a run one chunk too long", "a run of none",
                                    "a node one past the last"])
def test_free_hands_back_a_head_record_one_step_outside_its_range(pool, damage):
    """R5 at its edges: an extent one chunk longer than the heap has room
    for (a tail record naming it lies past the last chunk, in the owner
    records' padding, so only the bound tells), a run of 0, or a node one
    past the last.  The native free writes nothing and hands the case back;
    the reference raises `CorruptionError`."""
    allocator, layout = pool.allocator, pool.alloc_layout
    assert layout.capacity > allocator.nchunks  # the padding record exists
    first = allocator.nchunks - 3
    run = {"a run one chunk too long": 4, "a run of none": 0}.get(damage, 3)
    node = MAX_NODES if damage == "a node one past the last" else 1  # the field is node + 1
    state = bytearray(_state(pool, random.Random(1), 0.0, 0))
    owners = layout.owners - layout.cursor_line
    for chunk in range(first, first + max(run, 1)):
        record = _record(node, HEAD, 7, 3, run) if chunk == first else \
            _record(node, TAIL, 7, 3, first)
        state[owners + chunk * OWNER_BYTES:owners + (chunk + 1) * OWNER_BYTES] = record
    state = bytes(state)

    def native(lock):
        count = allocator.fast.free(first, HEAD, lock.fast)
        return "handed back" if count < 0 else count

    def reference(lock):
        count = allocator._extent(first, HEAD)
        lock.check()
        allocator._release(first, count)
        return count

    (fast, fast_bytes), (ref, _) = _run_both(pool, state, native, reference,
                                             "tract._native._allocfast.ChunkFastPath.free")
    assert (fast, ref) == ("handed back", CorruptionError)
    assert fast_bytes == state, "a handed-back free wrote"


def test_the_fast_path_is_used_and_frees_what_it_took(pool):
    allocator = pool.allocator
    assert allocator.fast is not None and pool.lock("alloc").fast is not None
    chunk = allocator.chunk_size
    offsets = [pool.alloc(size) for size in (chunk, 3 * chunk, 8 * chunk, chunk)]
    assert allocator.fast.fresh_kind(allocator.chunk_of(offsets[1])) == HEAD
    for offset in offsets:
        pool.free(offset)
    with pytest.raises(ValueError, match="not the start of an allocation"):
        pool.free(offsets[2])
    assert allocator.fast.fresh_kind(allocator.nchunks) == -1


def test_the_scan_called_through_its_address_matches_the_twin():
    scan = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(
        bitmap.first_free_run_address())
    rng = np.random.default_rng(4)
    for _ in range(200):
        nbits = int(rng.integers(1, 700))
        words = rng.integers(0, 2**64, size=-(-nbits // 64), dtype=np.uint64)
        words &= rng.integers(0, 2**64, size=words.size, dtype=np.uint64)  # sparser
        count, start = int(rng.integers(1, 9)), int(rng.integers(0, nbits))
        pointer = words.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))
        assert scan(pointer, words.size, nbits, count, start) == \
            naive.first_free_run(words, nbits, count, start)


@pytest.mark.parametrize("free, count, first", [
    ([511], 1, 511),  # one free chunk, the last bit of the first bitmap line
    (list(range(511, 520)), 9, 511),  # a run from that bit across the line
    ([511, *range(576, 580)], 2, 576),  # a full word right after a free bit
], ids=["a line's last bit", "a run from a line's last bit", "a full word after a free bit"])
def test_a_run_at_a_bitmap_lines_end_is_allocated_as_the_reference_allocates_it(
        pool_path, free, count, first):
    """Every chunk taken but ``free``: the native alloc (the bitmap kernel
    through its address) and the reference take the run the twin finds."""
    Pool.create(pool_path, 1100 << 13, chunk_size=1 << 13, max_nodes=MAX_NODES, lease_timeout=5.0,
                lock_mode="manager")
    with Pool.open(pool_path, 1, manager=True) as wide:
        allocator, layout = wide.allocator, wide.alloc_layout
        owner = (wide.node + 1) | allocator.pid << 32
        bits = np.full(layout.bitmap_bytes // 8, 2**64 - 1, dtype=np.uint64)
        records = bytearray(_record(0, HEAD, 7, 3, 1) * allocator.nchunks)
        for chunk in free:
            bits[chunk // 64] &= ~np.uint64(1 << chunk % 64)
            records[chunk * OWNER_BYTES:(chunk + 1) * OWNER_BYTES] = bytes(OWNER_BYTES)
        assert naive.first_free_run(bits, allocator.nchunks, count, 0) == first
        state = bytes(64) + bits.tobytes() + bytes(records)
        state += bytes(_area(wide)[1] - len(state))

        def native(lock):
            return allocator.fast.alloc(count, HEAD, owner, wide.epoch, lock.fast)

        def reference(lock):
            taken = allocator._find(count, lock)
            lock.check()
            allocator._publish(taken, count, HEAD, owner)
            return taken

        (fast, fast_bytes), (ref, ref_bytes) = _run_both(
            wide, state, native, reference, "tract._native._allocfast.ChunkFastPath.alloc")
        assert (fast, fast_bytes) == (ref, ref_bytes) and fast == first


def test_an_extent_across_bitmap_lines_is_freed_as_the_reference_frees_it(pool_path):
    """An extent whose bits span two bitmap lines (512 chunks a line): the
    second line's bits are dropped with the tail records, fenced, then read."""
    Pool.create(pool_path, 1100 << 13, chunk_size=1 << 13, max_nodes=MAX_NODES, lease_timeout=5.0,
                lock_mode="manager")
    with Pool.open(pool_path, 1, manager=True) as wide:
        allocator = wide.allocator
        assert allocator.nchunks > 512 + 8
        below = allocator.alloc_chunks(500)
        first = allocator.alloc_chunks(30)  # chunks 500..529: across bit 512
        assert first < 512 < first + 30
        state = _snapshot(wide)

        def native(lock):
            return allocator.fast.free(first, HEAD, lock.fast)

        def reference(lock):
            count = allocator._extent(first, HEAD)
            lock.check()
            allocator._release(first, count)
            return count

        (fast, _), (ref, _) = _run_both(wide, state, native, reference,
                                        "tract._native._allocfast.ChunkFastPath.free")
        assert fast == ref == 30
        allocator.free_chunks(below)
