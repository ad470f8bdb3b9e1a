"""The handoff record's native steps (`tract._native._handofffast`) held to
the Python steps of `tract.handoff` by result, bytes and cache-control
trace (tests/twins.py), over records in every state a decoder may find."""

import struct

import numpy as np
import pytest

import twins
from tract import handoff
from tract._native._handofffast import HandoffFastPath
from tract.handoff import HandoffRecords
from tract.pool import Pool

NODES = 4


@pytest.fixture
def records(pool_path):
    Pool.create(pool_path, 64 << 16, chunk_size=1 << 16, max_nodes=NODES, lease_timeout=5.0)
    with Pool.open(pool_path, 1, manager=True) as pool:
        yield HandoffRecords(pool)


def _keys(count, seed):
    return np.random.default_rng(seed).integers(0, 2**64, (count, 2), dtype=np.uint64)


def _area(records, offset, count):
    return [(offset, handoff._KEYS_AT + 16 * count)]


def test_the_layout_compiled_in_is_the_python_one():
    from tract._native import _handofffast

    assert struct.pack("<Q", _handofffast.MAGIC_WORD) == handoff._MAGIC
    assert _handofffast.TAKEN_WORD == handoff._TAKEN
    assert _handofffast.KEYS_OFFSET == handoff._KEYS_AT


@pytest.mark.parametrize("count", [0, 1, 7, 300])
def test_write_copies_the_record_in_as_the_python_step_does(records, count):
    pool, keys = records.pool, _keys(count, count)
    offset = pool.index.alloc(handoff._KEYS_AT + 16 * count)
    pool.region.fill(offset, handoff._KEYS_AT + 16 * count, 0xA5)  # memory a record reused
    args = (offset, 0x1234_5678_9ABC_DEF1, pool.node, pool.epoch, 1.5e9 + count, keys)
    want, got = twins.both(pool.region, _area(records, offset, count),
                           lambda: records._write(*args), lambda: records.fast.write(*args))
    twins.check("tract._native._handofffast.HandoffFastPath.write", want, got, context=count)
    assert got.batches  # a store fence closed the copy


def _states(records, rng):
    """(label, offset, nonce, count, now) for a record at each state."""
    pool = records.pool
    now = pool.clock.wall()
    for count in (0, 3, 64):
        keys = _keys(count, count + 1)
        offset, nonce = records.write(keys, now + 60)
        size = handoff._KEYS_AT + 16 * count
        yield "live", offset, nonce, count, now
        yield "another nonce", offset, nonce ^ 2, count, now
        yield "expired", offset, nonce, count, now + 61
        if count:
            byte = offset + handoff._KEYS_AT + int(rng.integers(16 * count))
            pool.region.store_u8(byte, pool.region.read(byte, 1)[0] ^ 0x10)
            yield "a key flipped", offset, nonce, count, now
        head = pool.region.read(offset, 56)
        pool.region.copy_in(offset, head[:16] + struct.pack("<Q", NODES) + head[24:],
                            nontemporal=False)
        yield "a node out of range", offset, nonce, count, now
        pool.region.copy_in(offset, head[:40] + struct.pack("<Q", 1 << 40) + head[48:],
                            nontemporal=False)
        yield "a count past the heap", offset, nonce, count, now
        pool.region.copy_in(offset, head, nontemporal=False)
        records.withdraw(offset)
        yield "withdrawn", offset, nonce, count, now
        pool.region.fill(offset, size, 0x5A)
        yield "memory reused", offset, nonce, count, now


def test_read_finds_what_the_python_step_finds_in_every_state(records):
    rng, seen = np.random.default_rng(7), set()
    for label, offset, nonce, count, now in _states(records, rng):
        area = _area(records, offset, count)
        want, got = twins.both(records.pool.region, area,
                               lambda: records._read(offset, nonce, now),
                               lambda: records.fast.read(offset, nonce, now))
        twins.check("tract._native._handofffast.HandoffFastPath.read", want, got,
                    context=(label, count))
        seen.add((label, want.result is not None))
    assert ("live", True) in seen and ("a key flipped", False) in seen
    assert {found for label, found in seen if label != "live"} == {False}


@pytest.mark.parametrize("count, node, found", [(4, NODES - 1, True), (5, NODES - 1, False),
                                                (4, NODES, False)])
def test_read_checks_a_sealed_record_against_the_heap_and_the_nodes(records, monkeypatch, count,
                                                                    node, found):
    """R5 at its edges, for records whose check word is good: a count one
    key past the heap's end, or a node one past the last, is no record,
    decided before the keys are read (a count past the end reads no byte
    past it); a record that ends exactly at the heap's end is found.  The
    heap is cut short of the mapping, so a weakened bound reads mapped
    memory and returns the record rather than crashing."""
    pool, now = records.pool, records.pool.clock.wall()
    low = pool.index.heap[0]
    offset = pool.index.alloc(handoff._KEYS_AT + 16 * 8)
    cut = offset + handoff._KEYS_AT + 16 * 4  # four keys fit before the heap's end
    records._write(offset, 0x77, node, pool.epoch, now + 60, _keys(count, count))
    monkeypatch.setattr(pool.index, "heap", (low, cut))
    fast = HandoffFastPath(pool.region, low, cut, NODES)
    want, got = twins.both(pool.region, [(offset, cut + 64 - offset)],
                           lambda: records._read(offset, 0x77, now),
                           lambda: fast.read(offset, 0x77, now))
    twins.check("tract._native._handofffast.HandoffFastPath.read", want, got,
                context=(count, node))
    assert (got.result is not None) == found


def test_read_refuses_an_offset_that_is_no_line_inside_the_heap(records):
    low, high = records.pool.index.heap
    for offset in (low - 64, low + 8, high - handoff._KEYS_AT + 64, -64):
        with pytest.raises(ValueError, match="not a line inside the heap"):
            records.fast.read(offset, 1, 0.0)


def test_mark_taken_and_withdraw_write_as_the_python_steps_do(records):
    pool, now = records.pool, records.pool.clock.wall()
    written = [records.write(_keys(2, seed), now + 60) for seed in range(5)]
    for offset, nonce in written:
        area = _area(records, offset, 2)
        want, got = twins.both(pool.region, area, lambda: records._mark(offset, nonce),
                               lambda: records.fast.mark(offset, nonce))
        twins.check("tract._native._handofffast.HandoffFastPath.mark", want, got)
        want, got = twins.both(pool.region, area, lambda: records._withdraw(offset),
                               lambda: records.fast.withdraw(offset))
        twins.check("tract._native._handofffast.HandoffFastPath.withdraw", want, got)


def test_taken_reads_the_marks_as_the_python_step_does(records):
    pool, now = records.pool, records.pool.clock.wall()
    written = [records.write(_keys(1, seed), now + 60) for seed in range(6)]
    for offset, nonce in written[::2]:
        records.fast.mark(offset, nonce)
    low, high = pool.index.heap
    for asked in (written, written[1:4], [], [(o, n ^ 4) for o, n in written]):
        offsets = np.array([o for o, _ in asked], np.int64)
        nonces = np.array([n for _, n in asked], np.uint64)
        want, got = twins.both(pool.region, [(low, high - low)],
                               lambda: records._taken(asked),
                               lambda: records.fast.taken(offsets, nonces))
        twins.check("tract._native._handofffast.HandoffFastPath.taken", want, got,
                    context=len(asked))
    assert records.taken(written) == [True, False] * 3
