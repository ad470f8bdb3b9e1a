"""The prefix index's fast path (`tract._kernels.indexfast`, one kernel call
per batch step) against its Python steps on the same pool state: random
tables with every state, torn lines, dead and live writers, wrapping
windows, full tables and full pin words.  The Python steps are the protocol
the simulator and the mutation harness check; these tests make the kernels
answer exactly as they do."""

import random

import naive
import twins
import numpy as np
import pytest

from tract._kernels import probe
from tract.errors import CorruptionError
from tract.index import Hits, Index, _IndexFull
from tract.lines import LINE
from tract.pool import Pool


def _random_table(rng, index, keys, nodes, full=False):
    """Random entries in every slot: empty, the batch's keys or others in
    every state, writers of live and dead epochs, payloads in the heap or
    (rarely) outside it, torn lines.  ``full``: other keys' READY entries
    only."""
    low, _ = index.heap
    table = np.zeros((index.capacity, 8), dtype=np.uint64)
    empty_share = 0.0 if full else rng.choice([0.0, 0.05, 0.3])
    for slot in range(index.capacity):
        if rng.random() < empty_share:
            continue
        entry = table[slot]
        ours = rng.random() < 0.5 and not full
        entry[:2] = keys[rng.randrange(len(keys))] if ours else \
            (rng.getrandbits(64), rng.getrandbits(64))
        entry[2] = rng.randrange(1, 9)
        state = probe.READY if full else rng.choice(
            [probe.WRITING, probe.READY, probe.READY, probe.EVICTING, probe.TOMBSTONE,
             probe.EMPTY, 9])
        entry[3] = state | (rng.randrange(nodes + 1) + 1) << 8 | rng.randrange(50) << 32
        entry[4] = low + rng.randrange(64) * 4096 if rng.random() < 0.97 else 8
        entry[5] = 4096
        entry[6] = rng.randrange(1, 3) | rng.getrandbits(32) << 32
        entry[7] = naive.entry_check(entry)
        if rng.random() < 0.05 and not full:
            entry[rng.randrange(7)] ^= np.uint64(1 << rng.randrange(64))  # torn
    offsets = index._entries(np.arange(index.capacity))
    index.region.scatter_lines(offsets, table.view(np.uint8))
    index.region.flush_lines(offsets)
    index.region.fence()


def _keys(rng, count, mask):
    """Keys homed in a small table: some share a home, some repeat."""
    keys = [(rng.randrange(mask + 1) + (rng.getrandbits(20) << 20), rng.randrange(3))
            for _ in range(count)]
    if count > 2 and rng.random() < 0.3:
        keys[-1] = keys[0]
    return np.array(keys, dtype=np.uint64)


@pytest.fixture
def indexes(pool_path):
    """(fast, reference) views of one pool's index, node 0."""
    Pool.create(pool_path, 16 << 20, chunk_size=1 << 16, max_nodes=4, index_capacity=64,
                lease_timeout=5.0)
    with Pool.open(pool_path, 0, manager=True) as pool:
        fast, reference = pool.index, Index(pool, fast=False)
        assert fast._fast and not reference._fast
        yield pool, fast, reference


def _pin_counts(index):
    words = index._pin_words(np.arange(index.capacity))
    lines = index._read(np.unique(words & ~(LINE - 1)))
    return (lines.reshape(-1) & np.uint64(0xFFFFFFFF))[:index.capacity].copy()


def _areas(index):
    """The index's table and every node's pin words."""
    return [(index.base, index.capacity * LINE),
            (index.node_base, index.max_nodes * index.node_bytes)]


def _others(index):
    """The lines other hosts write: all but this node's pin words, which
    only this host writes (R2), so its cache never holds them stale."""
    own = index._own_pins()
    return lambda line: not own <= line < own + index.node_bytes


def _held_to(name, reference, fast, step, context, settle=False):
    """``step(index)`` of each from the same bytes, held to the reference
    by result, bytes, cache-control batches and memory (tests/twins.py);
    ``settle`` for a step whose caller fences its write-backs."""
    want, got = twins.both(reference.region, _areas(reference), lambda: step(reference),
                           lambda: step(fast), stale=_others(reference), settle=settle)
    twins.check(name, want, got, context=context)
    return got.result


def test_lookup_and_pin_match_the_python_steps(indexes):
    _, fast, reference = indexes
    fast.stamp = reference.stamp = lambda: 0x1234  # the pin stamp: the same for both
    rng = random.Random(5)
    for trial in range(150):
        keys = _keys(rng, rng.randint(1, 12), fast.mask)
        _random_table(rng, fast, keys.tolist(), 3)
        for leading in (False, True):
            _held_to("tract._kernels.indexfast.lookup", reference, fast,
                     lambda index: index._probe(keys, leading), (trial, leading))
        assert fast.lookup(keys) == reference.lookup(keys)
        hits = _held_to("tract._kernels.indexfast.pin", reference, fast,
                        lambda index: _pinned(index, keys), trial)
        if not isinstance(hits[0], type):  # not a CorruptionError (a payload outside the heap)
            fast.unpin(Hits(*hits))
            assert not _pin_counts(fast).any()


def _pinned(index, keys):
    hits = index.pin(keys)
    return hits.slots, hits.entries


def test_a_full_pin_word_takes_back_every_pin(indexes):
    pool, fast, reference = indexes
    fast.stamp = reference.stamp = lambda: 0x1234  # the pin stamp: the same for both
    rng = np.random.default_rng(6)
    for _ in range(10):
        keys = rng.integers(0, 2**63, size=(6, 2), dtype=np.uint64)
        assert all(fast.publish(fast.reserve(keys, 256)))
        slots = fast._probe(keys, leading=True)[1]
        full = int(slots[rng.integers(6)])
        word = int(fast._pin_words(np.array([full]))[0])
        pool.region.store_u32(word, 0xFFFFFFFF)
        # the declared difference: the reference pinned every hit at once, so it
        # takes back (and writes back) the pins after the full word too; the
        # kernel stops at it, taking back only those before it
        words = fast._pin_words(slots)
        before = words[:int(np.flatnonzero(slots == full)[0])]
        flush = twins.INSTRUCTIONS[pool.region.cache_control.flush]
        taken_back = (0, tuple(sorted((flush, int(w) & ~(LINE - 1)) for w in before)))

        def stops_at_the_full_word(found, got):
            return found[:-1] + ([taken_back] if before.size else []), got

        want, got = twins.both(pool.region, _areas(fast), lambda: _pinned(reference, keys),
                               lambda: _pinned(fast, keys), stale=_others(fast))
        twins.check("tract._kernels.indexfast.pin", want, got, adjust=stops_at_the_full_word,
                    context=word)
        error, message = got.result
        assert error is CorruptionError and f"pin word at offset {word} " in message \
            and "full" in message
        counts = _pin_counts(fast)
        assert counts[full] == 0xFFFFFFFF and counts.sum() == 0xFFFFFFFF
        pool.region.store_u32(word, 0)
        while fast.evict(6, window=64):
            pass


def test_reserve_slots_match_the_python_steps(indexes):
    pool, fast, reference = indexes
    rng = random.Random(7)
    outcomes = {"full": 0, "decided": 0}
    # the nodes' live epochs, judged once for both (a re-judgement after a
    # quarter lease, due in one of the two runs only, is not the step's)
    reference._live = fast._live = (float("inf"), reference._live_epochs())
    for trial in range(200):
        keys = _keys(rng, rng.randint(1, 20), fast.mask)
        _random_table(rng, fast, keys.tolist(), 3, full=rng.random() < 0.15)
        with pool.lock("index")(10):
            result = _held_to("tract._kernels.indexfast.reserve_slots", reference, fast,
                              lambda index: index._reserve_slots(keys), trial)
        outcomes["full" if result[0] is _IndexFull else "decided"] += 1
    assert outcomes["full"] and outcomes["decided"] > 100, outcomes


def test_reserve_entries_match_the_python_steps(indexes):
    """After `_reserve_slots` (the same codes, slots and lines for both):
    the entries written, the homes raised first, their fence, and the
    entries returned."""
    pool, fast, reference = indexes
    rng = random.Random(9)
    reference._live = fast._live = (float("inf"), reference._live_epochs())
    written = raised = 0
    for trial in range(200):
        keys = _keys(rng, rng.randint(1, 20), fast.mask)
        _random_table(rng, fast, keys.tolist(), 3)
        count = keys.shape[0]
        payloads = np.array([rng.getrandbits(40) for _ in range(count)], dtype=np.uint64)
        sizes = np.array([rng.randint(1, 1 << 20) for _ in range(count)], dtype=np.int64)
        tokens = np.array([rng.randint(0, probe.TOKENS_MAX) for _ in range(count)],
                          dtype=np.int64)
        with pool.lock("index")(10):
            try:
                decided = reference._reserve_slots(keys)
            except _IndexFull:
                continue
            before = _table(fast)
            rows, _ = _held_to("tract._kernels.indexfast.reserve_entries", reference, fast,
                               lambda index: index._reserve_entries(keys, *decided, payloads,
                                                                    sizes, tokens), trial)
        assert rows.tolist() == np.flatnonzero(decided[0] == probe.FREE).tolist()
        written += rows.size
        after = _table(fast)
        raised += int(sum((before[slot] != after[slot]).any()
                          for slot in range(fast.capacity)
                          if slot not in set(decided[1][rows].tolist())))
    assert written > 300 and raised > 10, (written, raised)


def test_finish_and_write_match_the_python_steps(indexes):
    """A publish's or abort's read under the lock (`Index._finished`: the
    entries still as reserved, moved on) and the write of what it moved
    on (`Index._write`), from entries as reserved, reach-raised (still
    ours), torn or rewritten meanwhile (not ours)."""
    pool, fast, reference = indexes
    rng = random.Random(13)
    moved = kept = 0
    for trial in range(200):
        keys = _keys(rng, 8, fast.mask)
        _random_table(rng, fast, keys.tolist(), 3)
        count = rng.randint(1, 12)
        slots = np.array(rng.sample(range(fast.capacity), count), dtype=np.int64)
        expected = _table(fast)[slots]
        for row in range(count):
            change = rng.random()
            if change < 0.3:  # rewritten meanwhile (or torn): not ours
                expected[row, rng.randrange(8)] ^= np.uint64(1 << rng.randrange(64))
            elif change < 0.5:  # its reach raised by another key's reserve: still ours
                expected[row, 3] ^= np.uint64(rng.randrange(1, 64) << 8 * 3)
        state = rng.choice([probe.READY, probe.TOMBSTONE])
        sums = np.array([rng.getrandbits(32) for _ in range(count)], dtype=np.uint64)

        def finish(index):
            ours = np.empty(count, dtype=np.bool_)
            done = np.empty((count, 8), dtype=np.uint64)
            taken = index._finished(slots, expected, state, sums, ours, done)
            return taken, ours, done[:taken]

        with pool.lock("index")(10):
            taken, ours, done = _held_to("tract._kernels.indexfast.finish_entries", reference,
                                         fast, finish, trial)
            _held_to("tract._kernels.indexfast.write", reference, fast,
                     lambda index: index._write(slots[ours], done.copy()), trial)
        assert (_table(fast)[slots[ours], :7] == done[:, :7]).all()  # sealed as written
        moved, kept = moved + taken, kept + count - taken
    assert moved > 300 and kept > 200, (moved, kept)


def test_stamp_and_unpin_match_the_python_steps(indexes):
    """A publish's access stamps and an unpin, from random pin words: some
    slots repeat, and an unpin of a word at 0 is refused by slot."""
    pool, fast, reference = indexes
    rng = random.Random(14)
    pins = fast._own_pins()
    refused = 0
    for trial in range(200):
        words = np.array([rng.choice([0, 1, 2, 7]) | rng.getrandbits(32) << 32
                          for _ in range(fast.capacity)], dtype=np.uint64)
        pool.region.copy_in(pins, words.tobytes(), nontemporal=False)
        slots = np.array([rng.randrange(fast.capacity) for _ in range(rng.randint(1, 12))],
                         dtype=np.int64)
        now = rng.getrandbits(32)
        _held_to("tract._kernels.indexfast.stamp", reference, fast,
                 lambda index: index._stamp_words(slots, now), trial, settle=True)
        result = _held_to("tract._kernels.indexfast.unpin", reference, fast,
                          lambda index: index.unpin(Hits(slots, np.zeros((slots.size, 8),
                                                                         np.uint64))), trial)
        counts, first = (words & np.uint64(0xFFFFFFFF)).tolist(), None
        for slot in slots.tolist():
            if counts[slot] == 0 and first is None:
                first = slot
            counts[slot] = max(0, counts[slot] - 1)
        assert result == (None if first is None else
                          (ValueError, f"unpin of index slot {first} that node 0 had not "
                                       f"pinned")), (trial, result)
        assert _pin_counts(fast).tolist() == counts
        refused += first is not None
    assert 20 < refused < 190, refused


def test_chains_across_the_tables_end_match_the_python_steps(indexes):
    """Chains homed at the last two slots that run past the table's end
    (slots 62, 63, 0, 1, 2): a lookup finds the keys beyond the wrap and
    misses at the first empty slot after it or past the home's reach; a
    reserve takes the first free slots after the wrap; fast and Python
    steps alike, at the slots drawn."""
    pool, fast, reference = indexes
    mask, (low, _) = fast.mask, fast.heap
    fast.stamp = reference.stamp = lambda: 0x1234  # the pin stamp: the same for both

    def key(home, n):
        return home + (n << 20), n

    chain = {mask - 1: key(mask - 1, 1), mask: key(mask, 1), 0: key(mask - 1, 2),
             1: key(mask, 2), 2: key(mask, 3)}
    reach = {mask - 1: 2, mask: 3}  # each home's farthest entry, past the wrap
    table = np.zeros((fast.capacity, 8), dtype=np.uint64)
    for n, (slot, present) in enumerate(chain.items()):
        table[slot, :7] = [*present, 1, probe.READY | 1 << 8 | reach.get(slot, 0) << 24,
                           low + n * 4096, 4096, 1]
        table[slot, 7] = naive.entry_check(table[slot])
    offsets = fast._entries(np.arange(fast.capacity))
    pool.region.scatter_lines(offsets, table.view(np.uint8))
    pool.region.flush_lines(offsets)
    pool.region.fence()
    keys = np.array([*chain.values(), key(mask, 9), key(mask - 1, 9)], dtype=np.uint64)
    for leading in (False, True):
        _held_to("tract._kernels.indexfast.lookup", reference, fast,
                 lambda index: index._probe(keys, leading), leading)
    codes, slots, _ = fast._probe(keys, leading=False)
    assert codes.tolist() == [probe.HIT] * 5 + [probe.MISS] * 2
    assert slots[:5].tolist() == list(chain)
    hits = _held_to("tract._kernels.indexfast.pin", reference, fast,
                    lambda index: _pinned(index, keys), "pin")
    assert hits[0].tolist() == list(chain)
    fast.unpin(Hits(*hits))
    reference._live = fast._live = (float("inf"), reference._live_epochs())
    keys = np.array([key(mask, 9), key(mask, 10), key(mask - 1, 1)], dtype=np.uint64)
    with pool.lock("index")(10):
        codes, slots, _, _ = _held_to("tract._kernels.indexfast.reserve_slots", reference,
                                      fast, lambda index: index._reserve_slots(keys), "reserve")
    assert (codes.tolist(), slots.tolist()) == \
        ([probe.FREE, probe.FREE, probe.EXISTS], [3, 4, mask - 1])


def _found(index, keys):
    keys = np.array(sorted(keys), dtype=np.uint64).reshape(-1, 2)
    codes, _, _ = index._probe(keys, leading=False)
    return {tuple(map(int, key)) for key in keys[codes == probe.HIT]}


def _table(index):
    return index._read(index._entries(np.arange(index.capacity))).copy()


def _farthest(table, mask):
    """Per slot: how far past it the live entries homed there lie."""
    farthest = [0] * (mask + 1)
    for slot, entry in enumerate(table):
        state = int(entry[3]) & 0xFF
        if probe.WRITING <= state <= probe.EVICTING:
            home = int(entry[0]) & mask
            farthest[home] = max(farthest[home], (slot - home) & mask)
    return farthest


def test_publish_and_eviction_churn_keeps_chains_short(indexes):
    """A table at 70% load under publish / evict churn: every present key
    stays found, no entry lies past its home's reach, and a sweep of
    eviction lowers every reach to the farthest entry left."""
    _, fast, reference = indexes
    rng = np.random.default_rng(8)
    present: set[tuple[int, int]] = set()
    for round in range(300):
        index = (fast, reference)[round % 2]
        keys = rng.integers(0, 2**63, size=(4, 2), dtype=np.uint64)
        reserved = index.reserve(keys, 256)
        published = index.publish(reserved)
        present |= {tuple(map(int, key)) for key, ok in zip(keys, published) if ok}
        while len(present) > 0.7 * fast.capacity:
            index.evict(4, window=16)
            present = _found(index, present)
        table = _table(fast)
        reach = [naive.reach(entry) for entry in table]
        assert all(far <= known for far, known in zip(_farthest(table, fast.mask), reach))
    assert _found(fast, present) == present
    assert fast.stats()["ready"] == len(present)
    fast.evict(0, window=fast.capacity)
    table = _table(fast)
    assert [naive.reach(entry) for entry in table] == _farthest(table, fast.mask)


def test_entry_building_kernels_match_their_twins():
    """`reserved_entries`, `with_reaches` and `finished`: the entries a
    reserve writes and a publish or abort moves on, against the twins."""
    rng = random.Random(11)
    for _ in range(300):
        count = rng.randint(1, 8)
        keys = np.array([(rng.getrandbits(64), rng.getrandbits(64)) for _ in range(count)],
                        dtype=np.uint64)
        codes = np.array([rng.choice([probe.FREE, probe.EXISTS]) for _ in range(count)])
        targets = np.zeros((count, 8), dtype=np.uint64)
        for line in targets:  # never used, a whole old entry with a reach, or torn
            if rng.random() < 0.7:
                line[2], line[3] = rng.randrange(9), probe.TOMBSTONE | rng.randrange(40) << 24
                line[7] = naive.entry_check(line)
                if rng.random() < 0.2:
                    line[7] ^= np.uint64(1)
        payloads = np.array([rng.getrandbits(40) for _ in range(count)], dtype=np.uint64)
        sizes = np.array([rng.randrange(1, 1 << 30) for _ in range(count)], dtype=np.int64)
        tokens = np.array([rng.randrange(probe.TOKENS_MAX + 1) for _ in range(count)])
        word3, epoch = probe.WRITING | rng.randrange(1, 9) << 8, rng.getrandbits(32)
        rows, reaches = np.empty(count, np.int64), np.empty(count, np.int64)
        written = np.empty((count, 8), dtype=np.uint64)
        taken = probe.reserved_entries(keys, codes, targets, payloads, sizes, tokens,
                                       np.uint64(word3), np.uint64(epoch), rows, written,
                                       reaches)
        want = naive.reserved_entries(keys, codes, targets, payloads, sizes, tokens, word3,
                                      epoch)
        assert [(int(r), [int(w) for w in line[:7]], int(reach)) for r, line, reach
                in zip(rows[:taken], written[:taken], reaches[:taken])] == want
        # the reaches a reserve settles on, then sealed: what publish expects
        reaches = np.array([rng.choice([0, 5, naive.UNKNOWN, 70000]) for _ in range(taken)])
        written = written[:taken]
        probe.with_reaches(written, reaches)
        assert [(int(line[3]) >> 24) & 0xFFFF for line in written] == \
            [min(int(reach), naive.UNKNOWN) for reach in reaches]
        probe.seal(written)
        found = written.copy()  # read back: as reserved, a raised reach, changed, or torn
        for line in found:
            change = rng.randrange(4)
            if change == 1:
                line[3] = (line[3] & ~np.uint64(0xFFFF << 24)) | np.uint64(rng.randrange(99) << 24)
                line[7] = naive.entry_check(line)
            elif change == 2:
                line[rng.choice([0, 1, 2, 3, 4, 5, 6])] ^= np.uint64(1 << rng.randrange(40))
                line[7] = naive.entry_check(line)
            elif change == 3:
                line[7] ^= np.uint64(1)
        for state in (probe.READY, probe.TOMBSTONE):
            sums = np.array([rng.getrandbits(64) for _ in range(taken)], dtype=np.uint64)
            ours, done = np.empty(taken, np.bool_), np.empty((taken, 8), np.uint64)
            moved = probe.finished(found, written, state, sums, ours, done)
            assert (ours.tolist(), [[int(w) for w in line[:7]] for line in done[:moved]]) == \
                naive.finished(found, written, state, sums)
