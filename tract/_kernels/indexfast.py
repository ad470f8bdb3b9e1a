"""The prefix index's batch steps in one kernel call each (`tract.index`'s
fast path on a real mapping).

Each kernel is the Python step it names, line for line: the same windows,
the same decisions (`tract._kernels.probe`), the same cache control in the
same order (`tract._kernels.cachectl`: invalidate the batch, one fence, then
read).  The Python steps stay the protocol that runs on the simulator and
under the mutation harness; ``tests/test_index_fast.py`` checks each kernel
against its step on the same pool state.

``address`` is the mapping's base address; ``base`` the index's offset,
``pins`` this node's pin words' offset.  Every offset used is ``base +
(slot & mask) * 64`` or ``pins + (slot & mask) * 8``, which the caller has
checked lie inside the mapping.
"""

import numpy as np

from tract._kernels.cachectl import add_u32, fence, halves, lines, words
from tract._kernels.config import kernel
from tract._kernels.probe import (CONTINUE, HIT, MISS, collect, finished, next_widths,
                                  probe_reserve, raise_reaches, reserved_entries, seal, validate,
                                  with_reaches)

__all__ = ["finish_entries", "lookup", "pin", "reserve_entries", "reserve_slots", "stamp",
           "unpin", "write"]

U64 = np.uint64
ENTRY = 64
PIN_MAX = 0xFFFFFFFF


@kernel(inline="always")
def _read(address, base, mask, insn, slots, out):
    """Invalidate the entries of ``slots``, fence, copy them to ``out`` (R4)."""
    for i in range(slots.size):
        lines(insn, address + base + (slots[i] & mask) * ENTRY, ENTRY)
    fence()
    for i in range(slots.size):
        entry = words(address + base + (slots[i] & mask) * ENTRY, 8)
        for j in range(8):
            out[i, j] = entry[j]


@kernel
def lookup(address, base, mask, capacity, insn, keys, leading, codes, slots, entries):
    """`Index._probe`: (codes, slots, entries) of each key's lookup, windows
    of 2, 8, 32... lines a round; returns how many lead with HIT."""
    count = keys.shape[0]
    codes[:] = CONTINUE
    slots[:] = -1
    entries[:] = 0
    start = np.empty(count, np.int64)
    for k in range(count):
        start[k] = np.int64(keys[k, 0] & U64(mask))
    reaches = np.empty(count, np.int64)
    pending = np.arange(count)
    left, scanned, width = count, 0, 2
    while left:
        if scanned >= capacity:
            for i in range(left):
                codes[pending[i]] = MISS
            break
        width = min(width, capacity - scanned)
        window = np.empty(left * width, np.int64)
        for i in range(left):
            for w in range(width):
                window[i * width + w] = start[pending[i]] + scanned + w
        lines_read = np.empty((left * width, 8), np.uint64)
        _read(address, base, mask, insn, window, lines_read)
        left = collect(keys, pending, left, lines_read.reshape((left, width, 8)), scanned,
                       start, mask, leading, reaches, codes, slots, entries)
        scanned += width
        width *= 4
    for k in range(count):
        if codes[k] != HIT:
            return k
    return count


@kernel(inline="always")
def _unpin(word, flush_insn):
    add_u32(word, -1)
    lines(flush_insn, word, 8)


@kernel
def unpin(address, pins, mask, flush_insn, slots):
    """`Index._unpin_words`: one off this node's pin word of each of
    ``slots``, written back (no fence: an unpin seen late only delays an
    eviction).  Returns the first row whose word was not pinned, or -1."""
    first = -1
    for i in range(slots.size):  # the adds first: a locked add waits for earlier write-backs
        if add_u32(address + pins + (slots[i] & mask) * 8, -1) == 0 and first < 0:
            first = i
    for i in range(slots.size):
        lines(flush_insn, address + pins + (slots[i] & mask) * 8, 8)
    return first


@kernel
def stamp(address, pins, mask, flush_insn, slots, now):
    """`Index._stamp_words`: this node's access stamp of each of ``slots``
    set to ``now`` (the high half of its pin word) and written back (the
    caller fences)."""
    for i in range(slots.size):
        halves(address + pins + (slots[i] & mask) * 8, 2)[1] = now
    for i in range(slots.size):
        lines(flush_insn, address + pins + (slots[i] & mask) * 8, 8)


@kernel
def pin(address, base, mask, capacity, pins, read_insn, flush_insn, keys, stamp, slots,
        entries):
    """`Index.pin` up to the payload check: look up, add one to this
    node's pin word of each leading hit and stamp it, flush, fence, read
    the entries again and keep the hits that still validate (pins of the
    rest taken back).  Returns how many, or ``-1 - i`` when the pin word of
    hit ``i`` is full (the pins before it taken back)."""
    codes = np.empty(keys.shape[0], np.int64)
    count = lookup(address, base, mask, capacity, read_insn, keys, True, codes, slots, entries)
    if count == 0:
        return 0
    for i in range(count):
        word = address + pins + (slots[i] & mask) * 8
        if add_u32(word, 1) == PIN_MAX:
            for j in range(i):
                _unpin(address + pins + (slots[j] & mask) * 8, flush_insn)
            return -1 - i
        halves(word, 2)[1] = stamp
    for i in range(count):
        lines(flush_insn, address + pins + (slots[i] & mask) * 8, 8)
    # the pins are in memory before the entries are dropped and read again
    fence()
    fresh = np.empty((count, 8), np.uint64)
    _read(address, base, mask, read_insn, slots[:count], fresh)
    ok = np.empty(count, np.bool_)
    validate(entries[:count], fresh, ok)
    valid = count
    for i in range(count):
        if not ok[i]:
            valid = i
            break
    for i in range(valid, count):
        _unpin(address + pins + (slots[i] & mask) * 8, flush_insn)
    return valid


@kernel
def reserve_slots(address, base, mask, capacity, insn, keys, live, codes, slots, targets, homes):
    """`Index._reserve_slots`, under the index lock: each key's window
    grows 2 lines, then up to its home's reach, then twice as wide
    (`next_widths`), each round reading only the lines not read yet.
    Returns 0, or how many keys found no free slot in the whole table."""
    count = keys.shape[0]
    start = np.empty(count, np.int64)
    for k in range(count):
        start[k] = np.int64(keys[k, 0] & U64(mask))
    widths = np.zeros(count, np.int64)
    wants = np.full(count, min(2, capacity), np.int64)
    where = np.empty(count, np.int64)
    codes[:] = CONTINUE
    grown = np.ones(count, np.bool_)  # whose windows grew since the last probe
    table = np.empty((count, min(capacity, 32), 8), np.uint64)
    pending = np.arange(count)
    left, widest = count, min(2, capacity)
    while True:
        if widest > table.shape[1]:
            wider = np.empty((count, widest, 8), np.uint64)
            for k in range(count):  # only the lines read: one long window widens them all
                wider[k, :widths[k]] = table[k, :widths[k]]
            table = wider
        new = 0
        for i in range(left):
            new += wants[pending[i]] - widths[pending[i]]
        window = np.empty(new, np.int64)
        n = 0
        for i in range(left):
            k = pending[i]
            for w in range(widths[k], wants[k]):
                window[n] = start[k] + w
                n += 1
        fresh = np.empty((new, 8), np.uint64)
        _read(address, base, mask, insn, window, fresh)
        n = 0
        grown[:] = False
        for i in range(left):
            k = pending[i]
            for w in range(widths[k], wants[k]):
                table[k, w] = fresh[n]
                n += 1
            grown[k] = wants[k] > widths[k]
            widths[k] = max(widths[k], wants[k])
        probe_reserve(keys, table, start, mask, widths, live, grown, codes, where)
        left = 0
        for k in range(count):
            if codes[k] == CONTINUE:
                pending[left] = k
                left += 1
        if not left:
            break
        full = True
        for i in range(left):
            if widths[pending[i]] < capacity:
                full = False
        if full:
            return left
        widest = next_widths(table, widths, pending, left, capacity, wants)
    for k in range(count):
        slots[k] = (start[k] + where[k]) & mask
        targets[k] = table[k, where[k]]
        homes[k] = table[k, 0]
    return 0


@kernel(inline="always")
def _write(address, base, mask, insn, slots, entries):
    """`Index._write`: seal ``entries``, store each at its slot and write it
    back (the caller fences: R3)."""
    seal(entries)
    for i in range(slots.size):
        line = words(address + base + (slots[i] & mask) * ENTRY, 8)
        for j in range(8):
            line[j] = entries[i, j]
    for i in range(slots.size):
        lines(insn, address + base + (slots[i] & mask) * ENTRY, ENTRY)


@kernel
def reserve_entries(address, base, mask, insn, keys, codes, slots, targets, homes, payloads,
                    sizes, tokens, word3, epoch, rows, written):
    """`Index._reserve_entries`, under the index lock once its grant is
    checked: the WRITING entries of the keys whose code is FREE built
    (``rows``: which key; ``written``: their lines, sealed), the homes whose
    reach falls short raised, written back and fenced first, then the
    entries written back (the caller fences).  Returns how many."""
    count = keys.shape[0]
    reaches = np.empty(count, np.int64)
    taken = reserved_entries(keys, codes, targets, payloads, sizes, tokens, word3, epoch, rows,
                             written, reaches)
    mine = np.empty((taken, 2), np.uint64)
    at = np.empty(taken, np.int64)
    home_lines = np.empty((taken, 8), np.uint64)
    for i in range(taken):
        mine[i] = keys[rows[i]]
        at[i] = slots[rows[i]]
        home_lines[i] = homes[rows[i]]
    raised_slots = np.empty(taken, np.int64)
    raised = np.empty((taken, 8), np.uint64)
    n = raise_reaches(mine, at, home_lines, mask, reaches[:taken], raised_slots, raised)
    if n:
        _write(address, base, mask, insn, raised_slots[:n], raised[:n])
        fence()
    with_reaches(written[:taken], reaches[:taken])
    _write(address, base, mask, insn, at, written[:taken])
    return taken


@kernel
def write(address, base, mask, insn, slots, entries):
    """`Index._write`: ``entries`` sealed, stored at ``slots`` and written
    back (the caller fences: R3)."""
    _write(address, base, mask, insn, slots, entries)


@kernel
def finish_entries(address, base, mask, insn, slots, expected, state, checksums, ours, done):
    """`Index._finished`, under the index lock: the entries of ``slots``
    read fresh (R4); those still as reserved are ``ours``, moved on into
    ``done`` (`probe.finished`).  Returns how many."""
    entries = np.empty((slots.size, 8), np.uint64)
    _read(address, base, mask, insn, slots, entries)
    return finished(entries, expected, state, checksums, ours, done)
