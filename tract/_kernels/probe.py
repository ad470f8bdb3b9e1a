"""Linear-probing kernels of the prefix index (`tract.index`).

An entry is one 64-byte line, eight little-endian uint64 words:

    0  key low             1  key high
    2  version
    3  state | (writer node + 1) << 8 | reach << 24 | tokens << 40
    4  payload offset      5  payload length
    6  writer epoch (low 32 bits) | payload checksum << 32
    7  check word of words 0..6

An EMPTY entry is all zeros (never used), or a whole entry of state EMPTY
that keeps the slot's version (versions never repeat).

*Reach* belongs to the slot, not to its entry: every entry whose key's home
is this slot lies at most ``reach`` slots past it.  A lookup stops there (or
at an empty slot), so tombstones never make chains long; a reserve proves a
key absent there.  Writers keep it under the index lock: raised before an
entry is placed farther, carried over when a slot's entry is replaced,
lowered by eviction.  `UNKNOWN` (a torn home line, or a reach too long to
store) means: probe until an empty slot.

The kernels read entries gathered from the pool (never the pool itself) and
decide; `tract.index` moves the lines.
Each key probes a *window*: the lines from its home slot on, ``(n, W, 8)``.
Twins: ``tests/naive.py`` (``entry_check``, ``reach``, ``probe_lookup``,
``collect``, ``probe_reserve``, ``grow_windows``, ``next_widths``,
``reaches``, ``raise_reaches``, ``outside``).
"""

import numpy as np

from tract._kernels.config import kernel
from tract.lines import CHECK_ADD, CHECK_PRIME

__all__ = ["BUSY", "CONTINUE", "EMPTY", "EVICTING", "EXISTS", "FREE", "HIT", "MISS", "READY",
           "REACH_BITS", "TOKENS_MAX", "TOMBSTONE", "UNKNOWN", "WRITING", "collect", "empty",
           "entry_check", "finished", "grow_windows", "next_widths", "outside", "place",
           "probe_lookup", "probe_reserve", "raise_reaches", "reach", "reaches",
           "reserved_entries", "seal", "validate", "whole", "window_reaches", "with_reaches"]

EMPTY, WRITING, READY, EVICTING, TOMBSTONE = 0, 1, 2, 3, 4
# lookup outcomes
HIT, MISS, BUSY, CONTINUE = 0, 1, 2, 3
# reserve outcomes (and CONTINUE)
FREE, EXISTS = 4, 5

U64 = np.uint64
ENTRY_TAG = 0x5452_4143_5449_4458  # seeds an entry's check word (`tract.lines`)
UNKNOWN = 0xFFFF  # reach not known: probe until an empty slot
TOKENS_MAX = (1 << 24) - 1
REACH_BITS = U64(UNKNOWN) << U64(24)  # word 3's reach field


@kernel(inline="always")
def _check(entry):
    check = U64(ENTRY_TAG)
    for i in range(7):
        check = (check ^ entry[i]) * U64(CHECK_PRIME) + U64(CHECK_ADD)
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


@kernel(inline="always")
def _reach(entry):
    for i in range(8):
        if entry[i] != 0:
            if entry[7] != _check(entry):
                return UNKNOWN
            return np.int64((entry[3] >> U64(24)) & U64(0xFFFF))
    return 0


@kernel
def reach(entries, out):
    """Each row's slot reach (`UNKNOWN` for a torn line)."""
    for row in range(entries.shape[0]):
        out[row] = _reach(entries[row])


@kernel
def empty(entries, out):
    """Whether each row of ``entries`` (n, 8) is an EMPTY entry."""
    for row in range(entries.shape[0]):
        out[row] = _empty(entries[row])


@kernel
def probe_lookup(keys, lines, reaches, scanned, codes, positions):
    """For each key, scan its window (the slots ``scanned`` on past its
    home): HIT at the first whole READY entry of the key, BUSY at one being
    written or evicted, MISS at an empty entry or past the home's reach
    (``reaches[k]``), else CONTINUE (the window ran out).  ``positions``:
    where in the window."""
    for k in range(keys.shape[0]):
        codes[k] = CONTINUE
        positions[k] = -1
        for w in range(lines.shape[1]):
            entry = lines[k, w]
            if _empty(entry) or (reaches[k] != UNKNOWN and scanned + w > reaches[k]):
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
def collect(keys, pending, count, lines, scanned, start, mask, leading, reaches, codes, slots,
            entries):
    """One round of lookups: ``pending[:count]`` (key rows, in order) probed
    ``lines`` (count, W, 8), the slots from ``start + scanned`` on; the
    first round (``scanned`` 0) sets each key's home reach in ``reaches``.
    Records each decided key's code, slot and entry; returns how many stay
    pending, compacted to the front of ``pending`` (``leading``: none after
    the first key decided otherwise than HIT)."""
    found = np.empty(count, np.int64)
    where = np.empty(count, np.int64)
    if scanned == 0:
        for i in range(count):
            reaches[pending[i]] = _reach(lines[i, 0])
    probe_lookup(keys[pending[:count]], lines, reaches[pending[:count]], scanned, found, where)
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
def outside(entries, low, high):
    """The first row whose payload (offset, word 4; length, word 5) does
    not lie inside the heap ``[low, high)``, or -1 (R5: a pinned entry's
    range is checked before its payload is read)."""
    for k in range(entries.shape[0]):
        offset, length = np.int64(entries[k, 4]), np.int64(entries[k, 5])
        if offset < low or length <= 0 or length > high - offset:
            return k
    return -1


@kernel
def grow_windows(pending, widths, targets, start, mask, base, offsets, rows, positions):
    """The lines each pending key has not read yet, up to its ``targets``
    width: their entry offsets (``base`` + slot * 64), key rows and window
    positions; returns how many (and sets the keys' widths to their
    targets)."""
    n = 0
    for k in pending:
        for w in range(widths[k], targets[k]):
            offsets[n] = base + ((start[k] + w) & mask) * 64
            rows[n] = k
            positions[n] = w
            n += 1
        widths[k] = max(widths[k], targets[k])
    return n


@kernel
def next_widths(lines, widths, pending, count, capacity, targets):
    """The next window of each of the first ``count`` ``pending`` keys of a
    reserve: up to its home's reach (its home line, ``lines[k, 0]``, was
    read first), which decides once a reusable slot lies within it; past
    that (or with the reach UNKNOWN) twice as wide; at most
    ``capacity``.  Returns the widest."""
    widest = 0
    for i in range(count):
        k = pending[i]
        home_reach = _reach(lines[k, 0])
        want = widths[k] * 2
        if home_reach != UNKNOWN and home_reach + 1 > widths[k]:
            want = home_reach + 1
        targets[k] = min(want, capacity)
        widest = max(widest, targets[k])
    return widest


@kernel
def window_reaches(entries, tails, extras, run, mask, slots, out):
    """`reaches` of each window of ``run`` consecutive slots of
    ``entries`` (slots ``slots``), followed by its share of ``tails``, the
    lines after the windows that their reaches cover (``extras[w]`` for
    window ``w``, in order)."""
    width = run
    for w in range(extras.size):
        width = max(width, run + extras[w])
    lines = np.empty((width, 8), U64)
    at = 0
    for w in range(extras.size):
        first, extra = w * run, extras[w]
        lines[:run] = entries[first:first + run]
        lines[run:run + extra] = tails[at:at + extra]
        reaches(lines[:run + extra], run, mask, slots[first], out[first:first + run])
        at += extra


@kernel
def place(lines, read, rows, positions, count):
    """Put ``read[i]`` at ``lines[rows[i], positions[i]]`` for i < count."""
    for i in range(count):
        lines[rows[i], positions[i]] = read[i]


@kernel
def probe_reserve(keys, lines, start, mask, widths, live_epochs, grown, codes, positions):
    """Under the index lock: for each key in turn, EXISTS where its entry
    is (READY, EVICTING, or WRITING by a live writer), else FREE at the
    first reusable slot of its window (empty, tombstone, or WRITING by a
    writer whose node epoch is not ``live_epochs[node]``) once the window
    shows the key is absent (past the home's reach, or at an empty entry),
    else CONTINUE.  A torn line is reusable too: under the lock, only a
    crashed writer leaves one.  A key met earlier in the batch gets that
    key's outcome, and slots taken by earlier keys are theirs.
    Key ``k``'s window is the slots ``(start[k] + w) & mask`` for ``w`` below
    ``widths[k]``, its home first; a key that reaches its width continues,
    unless its window covers the whole table (``mask + 1`` slots): then a
    reusable slot is taken anyway.

    Called again as windows grow: ``grown[k]`` says key ``k``'s window
    grew since the last call (all keys, on the first).  A key whose window
    did not grow keeps its outcome unless an earlier key newly claimed a
    slot of its window: its outcome depends on nothing else, so the result
    is the same as deciding every key again.  (Claims only accumulate: a
    longer window never changes a decided outcome, and a key leaves its
    slot only when an earlier key claims that slot.)"""
    count = keys.shape[0]
    moved = np.empty(count, np.int64)  # slots newly claimed in this call
    n_moved = 0
    for k in range(count):
        old_code, old_position = codes[k], positions[k]
        twin = -1
        for j in range(k):
            if keys[j, 0] == keys[k, 0] and keys[j, 1] == keys[k, 1]:
                twin = j
                break
        if twin >= 0:  # claims nothing
            codes[k] = EXISTS if codes[twin] == FREE else codes[twin]
            positions[k] = positions[twin]
            continue
        if not grown[k]:
            affected = False
            for m in range(n_moved):
                if (moved[m] - start[k]) & mask < widths[k]:
                    affected = True
                    break
            if not affected:
                continue
        codes[k] = CONTINUE
        positions[k] = -1
        home_reach = _reach(lines[k, 0])
        reusable = -1
        for w in range(widths[k]):
            entry = lines[k, w]
            nonzero = False
            for i in range(8):
                if entry[i] != 0:
                    nonzero = True
                    break
            whole = nonzero and entry[7] == _check(entry)
            state = entry[3] & U64(0xFF)
            empty = not nonzero or (whole and state == EMPTY)
            free = False
            if not empty:
                writer = np.int64((entry[3] >> U64(8)) & U64(0xFFFF)) - 1
                dead_writer = (state == WRITING and whole
                               and not (0 <= writer < live_epochs.size
                                        and live_epochs[writer] == entry[6] & U64(0xFFFFFFFF)))
                if whole and entry[0] == keys[k, 0] and entry[1] == keys[k, 1] \
                        and state != TOMBSTONE and not dead_writer:
                    codes[k], positions[k] = EXISTS, w
                    break
                free = not whole or state == TOMBSTONE or dead_writer
            if (empty or free) and reusable < 0:
                # is it taken by an earlier key of the batch?
                slot = (start[k] + w) & mask
                claimed = False
                for j in range(k):
                    if codes[j] == FREE and (start[j] + positions[j]) & mask == slot:
                        claimed = True
                        break
                if not claimed:
                    reusable = w
            if reusable >= 0 and (empty or (home_reach != UNKNOWN and w >= home_reach)):
                codes[k], positions[k] = FREE, reusable
                break
        if codes[k] == CONTINUE and widths[k] > mask and reusable >= 0:
            codes[k], positions[k] = FREE, reusable
        if codes[k] == FREE and (old_code != FREE or positions[k] != old_position):
            moved[n_moved] = (start[k] + positions[k]) & mask
            n_moved += 1


@kernel
def reaches(lines, count, mask, first, out):
    """Eviction's update of reach: for each of the first ``count`` of
    ``lines`` (consecutive slots from ``first``), the farthest any whole
    live (WRITING, READY or EVICTING) entry homed there lies within its
    recorded reach; the recorded reach where that is UNKNOWN, where a torn
    line lies within it, or where the lines end before it does."""
    n = lines.shape[0]
    for h in range(count):
        known = _reach(lines[h])
        out[h] = known
        if known == UNKNOWN or h + known >= n:
            continue
        farthest = 0
        for p in range(h, h + known + 1):
            entry = lines[p]
            if _empty(entry):
                continue
            state = entry[3] & U64(0xFF)
            if entry[7] != _check(entry):
                farthest = known
                break
            if (state == WRITING or state == READY or state == EVICTING) \
                    and np.int64(entry[0] & U64(mask)) == (first + h) & mask:
                farthest = p - h
        out[h] = farthest


@kernel
def raise_reaches(keys, slots, homes, mask, reaches, raised_slots, raised_lines):
    """Reserve's update of reach, before entries for ``keys`` are written
    at ``slots`` (``homes``: each key's home line, ``reaches``: those of the
    entries to write, carried over from their slots).  A home among
    ``slots`` gets its key's distance in ``reaches``; any other home whose
    known reach falls short is copied to ``raised_lines`` with the reach
    raised (unsealed), its slot in ``raised_slots``.  Returns how many."""
    n = keys.shape[0]
    raised = 0
    for k in range(n):
        home = np.int64(keys[k, 0] & U64(mask))
        distance = (slots[k] - home) & mask
        mine = -1
        for j in range(n):
            if slots[j] == home:
                mine = j
                break
        if mine >= 0:
            reaches[mine] = max(reaches[mine], distance)
            continue
        known = _reach(homes[k])
        if known == UNKNOWN or distance <= known:
            continue
        row = -1
        for i in range(raised):
            if raised_slots[i] == home:
                row = i
        if row < 0:
            row = raised
            raised += 1
            raised_slots[row] = home
            raised_lines[row] = homes[k]
        if distance > np.int64((raised_lines[row, 3] >> U64(24)) & U64(0xFFFF)):
            raised_lines[row, 3] = (raised_lines[row, 3] & ~REACH_BITS) \
                | U64(min(distance, UNKNOWN)) << U64(24)
    return raised


@kernel
def reserved_entries(keys, codes, targets, payloads, sizes, tokens, word3, epoch, rows,
                     written, reaches):
    """The WRITING entries of the keys whose code is FREE, in key order:
    ``rows`` (which key), ``written`` (their lines: the taken slot's
    version + 1, ``word3`` | tokens, payload, size, ``epoch``; reach and
    check word left for `with_reaches`) and ``reaches`` (each taken slot's
    own, carried over).  Returns how many."""
    count = 0
    for k in range(keys.shape[0]):
        if codes[k] != FREE:
            continue
        rows[count] = k
        reaches[count] = _reach(targets[k])
        entry = written[count]
        entry[0], entry[1] = keys[k, 0], keys[k, 1]
        entry[2] = targets[k, 2] + U64(1)
        entry[3] = word3 | U64(tokens[k]) << U64(40)
        entry[4], entry[5], entry[6], entry[7] = payloads[k], U64(sizes[k]), epoch, U64(0)
        count += 1
    return count


@kernel
def with_reaches(entries, reaches):
    """Each row's reach bits set from ``reaches`` (`UNKNOWN` at most)."""
    for row in range(entries.shape[0]):
        value = U64(min(reaches[row], UNKNOWN))
        entries[row, 3] = (entries[row, 3] & ~REACH_BITS) | value << U64(24)


@kernel
def finished(entries, expected, state, checksums, ours, done):
    """Of the entries read back (``entries``) those still as reserved
    (``expected``: whole, same words but for the slot's reach, which other
    keys' reserves raise) are ``ours``; ``done`` gets them moved on, in
    order: version + 1, then READY with ``checksums`` (u32, word 6's high
    half), or a tombstone (version and reach kept).  Returns how many."""
    count = 0
    for k in range(entries.shape[0]):
        entry, want = entries[k], expected[k]
        same = entry[7] == _check(entry) and \
            (entry[3] & ~REACH_BITS) == (want[3] & ~REACH_BITS)
        for i in (0, 1, 2, 4, 5, 6):
            same = same and entry[i] == want[i]
        ours[k] = same
        if not same:
            continue
        out = done[count]
        out[:] = entry
        out[2] += U64(1)
        if state == READY:
            out[3] = (out[3] & ~U64(0xFF)) | U64(READY)
            out[6] = (out[6] & U64(0xFFFFFFFF)) | (checksums[k] & U64(0xFFFFFFFF)) << U64(32)
        else:
            out[0] = out[1] = out[4] = out[5] = out[6] = U64(0)
            out[3] = (out[3] & REACH_BITS) | U64(TOMBSTONE)
        count += 1
    return count
