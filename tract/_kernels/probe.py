"""Linear-probing kernels of the prefix index (`tract.index`).

An entry is one 64-byte line, eight little-endian uint64 words:

    0  key low             1  key high
    2  version
    3  state | (writer node + 1) << 8 | tokens << 32
    4  payload offset      5  payload length
    6  writer epoch (low 32 bits) | payload checksum << 32
    7  check word of words 0..6

An EMPTY entry is all zeros (never used), or a whole entry of state EMPTY
that keeps the slot's version (a trimmed tombstone: versions never repeat).
The kernels read entries gathered from the pool (never the pool itself) and
decide; `tract.index` moves the lines.
Each key probes a *window*: the lines from its home slot on, ``(n, W, 8)``.
Twins: ``tests/naive.py`` (``entry_check``, ``probe_lookup``,
``probe_reserve``).
"""

import numpy as np

from tract._kernels.config import kernel

__all__ = ["BUSY", "CONTINUE", "EMPTY", "EVICTING", "EXISTS", "FREE", "HIT", "MISS", "READY",
           "TOMBSTONE", "WRITING", "collect", "empty", "entry_check", "grow_windows", "place",
           "probe_lookup", "probe_reserve",
           "seal", "validate", "whole"]

EMPTY, WRITING, READY, EVICTING, TOMBSTONE = 0, 1, 2, 3, 4
# lookup outcomes
HIT, MISS, BUSY, CONTINUE = 0, 1, 2, 3
# reserve outcomes (and CONTINUE)
FREE, EXISTS = 4, 5

U64 = np.uint64


@kernel(inline="always")
def _check(entry):
    check = U64(0x5452414354494458)
    for i in range(7):
        check = (check ^ entry[i]) * U64(0x100000001B3) + U64(0x9E3779B97F4A7C15)
    return check


@kernel
def entry_check(entry):
    """The check word of an entry's words 0..6."""
    return _check(entry)


@kernel
def seal(entries):
    """Write the check word of every row of ``entries`` (n, 8)."""
    for row in range(entries.shape[0]):
        entries[row, 7] = _check(entries[row])


@kernel
def whole(entries, ok):
    """Whether each row of ``entries`` (n, 8) carries its check word."""
    for row in range(entries.shape[0]):
        ok[row] = entries[row, 7] == _check(entries[row])


@kernel(inline="always")
def _empty(entry):
    for i in range(8):
        if entry[i] != 0:
            return entry[3] & U64(0xFF) == EMPTY and entry[7] == _check(entry)
    return True


@kernel
def empty(entries, out):
    """Whether each row of ``entries`` (n, 8) is an EMPTY entry."""
    for row in range(entries.shape[0]):
        out[row] = _empty(entries[row])


@kernel
def probe_lookup(keys, lines, codes, positions):
    """For each key, scan its window: HIT at the first whole READY entry of
    the key, BUSY at one being written or evicted, MISS at an empty entry,
    else CONTINUE (the window ran out).  ``positions``: where in the window."""
    for k in range(keys.shape[0]):
        codes[k] = CONTINUE
        positions[k] = -1
        for w in range(lines.shape[1]):
            entry = lines[k, w]
            if _empty(entry):
                codes[k], positions[k] = MISS, w
                break
            if entry[7] != _check(entry) or entry[0] != keys[k, 0] or entry[1] != keys[k, 1]:
                continue  # another key, or a torn line (a writer is at it): probe on
            state = entry[3] & U64(0xFF)
            if state == READY:
                codes[k], positions[k] = HIT, w
                break
            if state == WRITING or state == EVICTING:
                codes[k], positions[k] = BUSY, w
                break
            # a tombstone that kept its key: probe on


@kernel
def collect(keys, pending, count, lines, scanned, start, mask, leading, codes, slots,
            entries):
    """One round of lookups: ``pending[:count]`` (key rows, in order) probed
    ``lines`` (count, W, 8), the slots from ``start + scanned`` on.  Records
    each decided key's code, slot and entry; returns how many stay pending,
    compacted to the front of ``pending`` (``leading``: none after the first
    key decided otherwise than HIT)."""
    found = np.empty(count, np.int64)
    where = np.empty(count, np.int64)
    probe_lookup(keys[pending[:count]], lines, found, where)
    kept = 0
    stop = keys.shape[0]
    for i in range(count):
        k = pending[i]
        if found[i] == CONTINUE:
            if k < stop:
                pending[kept] = k
                kept += 1
            continue
        codes[k] = found[i]
        if found[i] != MISS:
            slots[k] = (start[k] + scanned + where[i]) & mask
            entries[k] = lines[i, where[i]]
        if leading and found[i] != HIT and k < stop:
            stop = k
    while kept and pending[kept - 1] >= stop:
        kept -= 1
    return kept


@kernel
def validate(first, lines, ok):
    """After the pin: is each entry still the whole READY one read first
    (same key, version and payload)?"""
    for k in range(first.shape[0]):
        entry = lines[k]
        ok[k] = (entry[7] == _check(entry) and entry[0] == first[k, 0]
                 and entry[1] == first[k, 1] and entry[2] == first[k, 2]
                 and entry[4] == first[k, 4] and entry[3] & U64(0xFF) == READY)


@kernel
def grow_windows(pending, widths, grown, start, mask, base, offsets, rows, positions):
    """The lines each pending key has not read yet, up to ``grown``: their
    entry offsets (``base`` + slot * 64), key rows and window positions;
    returns how many (and sets the keys' widths to ``grown``)."""
    n = 0
    for k in pending:
        for w in range(widths[k], grown):
            offsets[n] = base + ((start[k] + w) & mask) * 64
            rows[n] = k
            positions[n] = w
            n += 1
        widths[k] = max(widths[k], grown)
    return n


@kernel
def place(lines, read, rows, positions, count):
    """Put ``read[i]`` at ``lines[rows[i], positions[i]]`` for i < count."""
    for i in range(count):
        lines[rows[i], positions[i]] = read[i]


@kernel
def probe_reserve(keys, lines, start, mask, widths, live_epochs, codes, positions):
    """Under the index lock: for each key in turn, EXISTS where its entry
    is (READY, EVICTING, or WRITING by a live writer), else FREE at the
    first reusable slot of its window (empty, tombstone, or WRITING by a
    writer whose node epoch is not ``live_epochs[node]``) once the window
    shows the key is absent (an empty entry ends the chain), else CONTINUE.
    A torn line is reusable too: under the lock, only a crashed writer
    leaves one.  Slots taken by earlier keys of the batch count as theirs.
    Key ``k``'s window is the slots ``(start[k] + w) & mask`` for ``w`` below
    ``widths[k]``; a key that reaches its width continues, unless its window
    covers the whole table (``mask + 1`` slots): then a reusable slot is
    taken anyway."""
    for k in range(keys.shape[0]):
        codes[k] = CONTINUE
        positions[k] = -1
        reusable = -1
        for w in range(widths[k]):
            entry = lines[k, w]
            if _empty(entry):
                free = True
            else:
                whole = entry[7] == _check(entry)
                state = entry[3] & U64(0xFF)
                writer = np.int64((entry[3] >> U64(8)) & U64(0xFFFF)) - 1
                dead_writer = (state == WRITING and whole
                               and not (0 <= writer < live_epochs.size
                                        and live_epochs[writer] == entry[6] & U64(0xFFFFFFFF)))
                if whole and entry[0] == keys[k, 0] and entry[1] == keys[k, 1] \
                        and state != TOMBSTONE and not dead_writer:
                    codes[k], positions[k] = EXISTS, w
                    break
                free = not whole or state == TOMBSTONE or dead_writer
                if not free:
                    continue
            # an empty or reusable slot: is it taken by an earlier key of the batch?
            slot = (start[k] + w) & mask
            claimed = -1
            for j in range(k):
                if codes[j] == FREE and (start[j] + positions[j]) & mask == slot:
                    claimed = j
                    break
            if claimed >= 0:
                if keys[claimed, 0] == keys[k, 0] and keys[claimed, 1] == keys[k, 1]:
                    codes[k], positions[k] = EXISTS, w
                    break
                continue
            if _empty(entry):
                codes[k], positions[k] = FREE, (reusable if reusable >= 0 else w)
                break
            if reusable < 0:
                reusable = w
        if codes[k] == CONTINUE and widths[k] > mask and reusable >= 0:
            codes[k], positions[k] = FREE, reusable
