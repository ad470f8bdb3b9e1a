"""Probe kernels (`tract._kernels.probe`) against their twins in
tests/naive.py on edges drawn on purpose: an entry exactly at its home's
reach and one past it, a reserve whose free slot lies past the table's end
or is the last of a whole-table window, reaches lowered and raised across
the wrap, payloads that end exactly at the heap's end; and the lookup round
and the reserve's window steps (`collect`, `grow_windows`, `next_widths`)
on random windows homed near the table's end.  Random tables of every
state are tests/test_index.py's."""

import random

import numpy as np
import pytest

import naive
from tract._kernels import probe

LIVE = np.array([1, 1, 1], dtype=np.uint64)  # each node's epoch: a writer of epoch 1 is live
MASK = 15


def _entry(key, state=probe.READY, reach=0, epoch=1):
    """A whole entry of ``key``, written by node 0 in ``epoch``, in a slot of
    ``reach``."""
    entry = np.zeros(8, dtype=np.uint64)
    entry[0], entry[1], entry[2] = key[0], key[1], 1
    entry[3] = state | 1 << 8 | reach << 24
    entry[6] = epoch
    entry[7] = naive.entry_check(entry)
    return entry


def _key(home, n):
    """The ``n``-th key homed at slot ``home`` of a table of ``MASK + 1``."""
    return home + (n << 20), n


def _full_table():
    """Every slot holds another key's READY entry (home slot 0's keys)."""
    return np.array([_entry(_key(0, 1000 + slot)) for slot in range(MASK + 1)])


@pytest.mark.parametrize("scanned", [0, 2])
@pytest.mark.parametrize("reach", [0, 1, 3, naive.UNKNOWN])
def test_a_lookup_ends_exactly_past_the_homes_reach(reach, scanned):
    """The key at each position of a window of other keys: a hit up to its
    home's reach (anywhere for an UNKNOWN reach), a miss just past it."""
    key = _key(5, 1)
    keys = np.array([key], dtype=np.uint64)
    for at in range(6):
        lines = np.array([[_entry(key if w == at else _key(5, 100 + w)) for w in range(6)]])
        codes, where = np.empty(1, np.int64), np.empty(1, np.int64)
        probe.probe_lookup(keys, lines, np.array([reach]), scanned, codes, where)
        want = naive.probe_lookup(keys, lines, [reach], scanned)
        assert [(codes[0], where[0])] == want
        hit = reach == naive.UNKNOWN or scanned + at <= reach
        assert want == [(probe.HIT, at) if hit else (probe.MISS, max(0, reach - scanned + 1))]


def _reserve(keys, table, widths):
    """The reserve kernel's (code, position) of each key, its window the
    table from its home on, wrapping; held to the twin's."""
    keys = np.array(keys, dtype=np.uint64)
    start = (keys[:, 0] & np.uint64(MASK)).astype(np.int64)
    lines = table[(start[:, None] + np.arange(MASK + 1)) & MASK]
    widths = np.array(widths, dtype=np.int64)
    codes, where = np.full(len(keys), probe.CONTINUE, np.int64), np.empty(len(keys), np.int64)
    probe.probe_reserve(keys, lines, start, MASK, widths, LIVE, np.ones(len(keys), np.bool_),
                        codes, where)
    got = list(zip(codes.tolist(), where.tolist()))
    assert got == naive.probe_reserve(keys, lines, start, MASK, widths, LIVE)
    return got


def test_a_reserve_takes_free_slots_past_the_tables_end():
    """Two keys homed at the last slot, the free slots at 1 and 3: the first
    takes slot 1, the second sees it taken and goes on to slot 3."""
    table = _full_table()
    table[1] = table[3] = 0
    first, second = _key(MASK, 1), _key(MASK, 2)
    assert _reserve([first, second], table, [8, 8]) == [(probe.FREE, 2), (probe.FREE, 4)]
    assert _reserve([first, second, first], table, [8, 3, 8]) == \
        [(probe.FREE, 2), (probe.CONTINUE, -1), (probe.EXISTS, 2)]


def test_a_reserve_takes_the_last_slot_of_a_whole_table_window():
    """A full table but for a tombstone just before the home: found only by
    a window of the whole table (the home's reach is UNKNOWN)."""
    table = _full_table()
    home = 5
    table[home] = _entry(_key(0, 999), reach=naive.UNKNOWN)
    table[home - 1] = _entry((0, 0), probe.TOMBSTONE)
    key = _key(home, 1)
    assert _reserve([key], table, [MASK + 1]) == [(probe.FREE, MASK)]
    assert _reserve([key], table, [MASK]) == [(probe.CONTINUE, -1)]


@pytest.mark.parametrize("reach, decided", [(3, (probe.FREE, 3)), (4, (probe.EXISTS, 4))])
def test_a_reserve_decides_at_the_homes_reach_across_the_wrap(reach, decided):
    """Home 14, a dead writer's slot 1 (3 past it) and the key's own entry
    at slot 2 (4 past): a reach of 3 proves the key absent at slot 1, a reach
    of 4 finds it."""
    table = _full_table()
    home = MASK - 1
    key = _key(home, 1)
    table[home] = _entry(_key(0, 999), reach=reach)
    table[1] = _entry(_key(home, 2), probe.WRITING, epoch=7)
    table[2] = _entry(key)
    assert _reserve([key], table, [MASK + 1]) == [decided]


def _wrapped(table, first, count):
    return table[(first + np.arange(count)) & MASK]


@pytest.mark.parametrize("change", ["none", "evicted", "evicting", "torn", "short"])
def test_reaches_are_lowered_across_the_tables_end(change):
    """Homes 14, 15 and 0 with entries past the table's end (slots 0, 1, 2):
    each home's reach, the farthest live entry homed there, as eviction
    computes it from consecutive lines and from windows with their tails."""
    table = np.zeros((MASK + 1, 8), dtype=np.uint64)
    table[14] = _entry(_key(14, 1), reach=4)
    table[15] = _entry(_key(15, 1), reach=2)
    table[0] = _entry(_key(14, 2), reach=3)
    table[1] = _entry(_key(15, 2))
    table[2] = _entry(_key(0, 2))
    if change == "evicted":
        table[0] = _entry((0, 0), probe.TOMBSTONE, reach=3)
    elif change == "evicting":
        table[0] = _entry(_key(14, 2), probe.EVICTING, reach=3)
    elif change == "torn":
        table[1, 4] ^= np.uint64(1)
    lines = _wrapped(table, 13, 5 if change == "short" else 8)  # short: the reach of 14 ends past
    found = np.empty(4, np.int64)
    probe.reaches(lines, 4, MASK, 13, found)
    want = naive.reaches(lines, 4, MASK, 13)
    assert found.tolist() == want
    assert want == {"none": [0, 2, 2, 2], "evicted": [0, 0, 2, 2], "evicting": [0, 2, 2, 2],
                    "torn": [0, 4, 2, 3], "short": [0, 4, 2, 3]}[change]
    entries = _wrapped(table, 12, 4)  # eviction's window of slots 12..15, and its tails
    extra = 3 if change == "short" else 4
    tails = _wrapped(table, 0, extra)
    probe.window_reaches(entries, tails, np.array([extra]), 4, MASK, np.arange(12, 16), found)
    assert found.tolist() == naive.reaches(_wrapped(table, 12, 4 + extra), 4, MASK, 12)


def _raised(keys, slots, homes):
    """(reaches, {home slot: raised reach}) of the raise kernel, held to the
    twin's; every reach carried in from the slots is 0."""
    keys, slots = np.array(keys, dtype=np.uint64), np.array(slots, dtype=np.int64)
    reaches = np.zeros(len(keys), dtype=np.int64)
    want = naive.raise_reaches(keys, slots, homes, MASK, reaches.tolist())
    raised_slots, raised_lines = np.empty(len(keys), np.int64), np.empty((len(keys), 8), np.uint64)
    n = probe.raise_reaches(keys, slots, homes, MASK, reaches, raised_slots, raised_lines)
    got = {int(slot): (int(line[3]) >> 24) & 0xFFFF
           for slot, line in zip(raised_slots[:n], raised_lines[:n])}
    assert (reaches.tolist(), got) == want
    return want


@pytest.mark.parametrize("known, raised", [(2, {}), (1, {MASK: 2}), (0, {MASK: 2}),
                                           (naive.UNKNOWN, {})])
def test_reaches_are_raised_across_the_tables_end(known, raised):
    """Two keys homed at the last slot placed at slots 0 and 1: their home
    is raised only when its known reach falls short of 2.  A home among the
    slots takes the distance in its row instead: a key homed at the last
    slot placed at 1, one homed at 14 placed at the last slot."""
    home = _entry(_key(0, 999), reach=known)
    assert _raised([_key(MASK, 1), _key(MASK, 2)], [0, 1], np.array([home, home])) == \
        ([0, 0], raised)
    homes = np.array([home, _entry(_key(0, 998), reach=known)])
    assert _raised([_key(MASK, 1), _key(MASK - 1, 1)], [1, MASK], homes) == \
        ([0, 2], {} if known in (1, 2, naive.UNKNOWN) else {MASK - 1: 1})


HEAP = (4096, 8192)
INSIDE = [(4096, 4096), (8191, 1), (4096, 1)]  # the first two end at the heap's end
OUTSIDE = [(8191, 2), (8192, 1), (4096, 4097), (4095, 1), (4096, 0), (2**64 - 64, 128),
           (4096, 2**64 - 1), (1 << 63, 64)]


@pytest.mark.parametrize("payload", [None, *OUTSIDE])
def test_a_payload_ending_at_the_heaps_end_is_inside(payload):
    """Rows whose payloads end exactly at the heap's end, and one (if any)
    that ends a byte past it, starts at it, or wraps: the first outside."""
    rows = INSIDE + ([] if payload is None else [payload]) + INSIDE
    entries = np.zeros((len(rows), 8), dtype=np.uint64)
    entries[:, 4:6] = rows
    want = naive.outside(entries, *HEAP)
    assert probe.outside(entries, *HEAP) == want == (-1 if payload is None else len(INSIDE))


def _random_table(rng, keys):
    """Random lines: never used, other keys' or the batch's in every state,
    some torn, reaches small or UNKNOWN."""
    table = np.zeros((MASK + 1, 8), dtype=np.uint64)
    for slot in range(MASK + 1):
        if rng.random() < 0.2:
            continue
        key = rng.choice(keys) if rng.random() < 0.4 else _key(rng.randrange(MASK + 1), 500)
        table[slot] = _entry(key, rng.choice([probe.EMPTY, probe.WRITING, probe.READY,
                                              probe.EVICTING, probe.TOMBSTONE]),
                             reach=rng.choice([0, 1, 2, 5, naive.UNKNOWN]))
        if rng.random() < 0.1:
            table[slot, rng.randrange(7)] ^= np.uint64(1 << rng.randrange(64))  # torn
    return table


def _batch(rng):
    """Keys homed near the table's end (some anywhere), a repeat now and then."""
    keys = np.array([_key(rng.choice([MASK, MASK - 1, MASK - 2, rng.randrange(MASK + 1)]),
                          rng.randrange(4)) for _ in range(rng.randint(1, 6))], dtype=np.uint64)
    return keys, (keys[:, 0] & np.uint64(MASK)).astype(np.int64)


def test_lookup_rounds_match_the_twin():
    """Rounds at each stage (``scanned``) for keys homed near the table's
    end: the keys left pending, each decided key's code, slot (wrapped) and
    entry, and the home reaches."""
    rng = random.Random(21)
    for _ in range(400):
        keys, start = _batch(rng)
        table = _random_table(rng, [tuple(map(int, key)) for key in keys])
        pending = sorted(rng.sample(range(len(keys)), rng.randint(1, len(keys))))
        scanned, width = rng.choice([0, 2, 8, 14]), rng.randint(1, 4)
        lines = np.array([_wrapped(table, start[row] + scanned, width) for row in pending])
        reaches = np.array([rng.choice([0, 3, 9, naive.UNKNOWN]) for _ in keys], np.int64)
        leading = rng.random() < 0.5
        want = naive.collect(keys, pending, lines, scanned, start, MASK, leading,
                             reaches.tolist())
        rows = np.array(pending, dtype=np.int64)
        codes = np.full(len(keys), probe.CONTINUE, np.int64)
        slots, entries = np.full(len(keys), -1, np.int64), np.zeros((len(keys), 8), np.uint64)
        kept = probe.collect(keys, rows, len(pending), lines, scanned, start, MASK, leading,
                             reaches, codes, slots, entries)
        decided = {row: (int(codes[row]), *((None, None) if codes[row] == probe.MISS else
                                            (int(slots[row]), entries[row].tolist())))
                   for row in pending if codes[row] != probe.CONTINUE}
        assert (rows[:kept].tolist(), decided, reaches.tolist()) == want


def test_reserve_windows_grow_as_the_twins_grow_them():
    """The lines a reserve reads next (their offsets wrap at the table's
    end) and the widths its windows grow to from their homes' reaches."""
    rng = random.Random(22)
    capacity, base = MASK + 1, 1 << 16
    for _ in range(400):
        keys, start = _batch(rng)
        count = len(keys)
        pending = np.array(sorted(rng.sample(range(count), rng.randint(1, count))), np.int64)
        widths = np.array([rng.randint(0, capacity) for _ in range(count)], np.int64)
        targets = np.minimum(widths + np.array([rng.randint(-1, 5) for _ in range(count)]),
                             capacity)
        unread, grown = naive.grow_windows(pending, widths.tolist(), targets, start, MASK, base)
        room = capacity * count
        offsets, rows, positions = (np.empty(room, np.int64) for _ in range(3))
        n = probe.grow_windows(pending, widths, targets, start, MASK, base, offsets, rows,
                               positions)
        assert (list(zip(offsets[:n].tolist(), rows[:n].tolist(), positions[:n].tolist())),
                widths.tolist()) == (unread, grown)
        homes = _random_table(rng, [tuple(map(int, key)) for key in keys])[start]
        lines = np.zeros((count, 2, 8), dtype=np.uint64)
        lines[:, 0] = homes
        widths = np.maximum(widths, 1)
        wants = np.zeros(count, np.int64)
        widest = probe.next_widths(lines, widths, pending, pending.size, capacity, wants)
        assert ({int(row): int(wants[row]) for row in pending}, widest) == \
            naive.next_widths(lines, widths.tolist(), pending.tolist(), capacity)
