"""Plain-Python twins of tract's kernels: the specification each fast path is
tested against (STYLE habit 5)."""


def _bit(words, index):
    return (int(words[index // 64]) >> (index % 64)) & 1


def count_free(words, nbits):
    return sum(1 for index in range(nbits) if not _bit(words, index))


def first_free_run(words, nbits, count, start=0):
    for begin, end in ((start, nbits), (0, min(start + count - 1, nbits))):
        run = 0
        for index in range(begin, end):
            run = 0 if _bit(words, index) else run + 1
            if run == count:
                return index - count + 1
    return -1


# ------------------------------------------------------------ block hashes

_M64 = 2**64 - 1


def _rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & _M64


def siphash(data, k0, k1, c=1, d=3, wide=True):
    """SipHash-c-d of ``data`` (bytes), 128-bit (low, high) or 64-bit."""
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D,
         k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]
    if wide:
        v[1] ^= 0xEE

    def rounds(n):
        for _ in range(n):
            v[0] = (v[0] + v[1]) & _M64
            v[1] = _rotl(v[1], 13) ^ v[0]
            v[0] = _rotl(v[0], 32)
            v[2] = (v[2] + v[3]) & _M64
            v[3] = _rotl(v[3], 16) ^ v[2]
            v[0] = (v[0] + v[3]) & _M64
            v[3] = _rotl(v[3], 21) ^ v[0]
            v[2] = (v[2] + v[1]) & _M64
            v[1] = _rotl(v[1], 17) ^ v[2]
            v[2] = _rotl(v[2], 32)

    whole = len(data) // 8 * 8
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, whole, 8)]
    words.append(int.from_bytes(data[whole:], "little") | (len(data) & 0xFF) << 56)
    for m in words:
        v[3] ^= m
        rounds(c)
        v[0] ^= m
    v[2] ^= 0xEE if wide else 0xFF
    rounds(d)
    low = v[0] ^ v[1] ^ v[2] ^ v[3]
    if not wide:
        return low
    v[1] ^= 0xDD
    rounds(d)
    return low, v[0] ^ v[1] ^ v[2] ^ v[3]


def _chain(tokens, block_size, parent, digest):
    hashes = []
    for block in range(len(tokens) // block_size):
        chunk = tokens[block * block_size:(block + 1) * block_size]
        message = b"".join(int(t).to_bytes(4, "little") for t in chunk)
        message += parent[0].to_bytes(8, "little") + parent[1].to_bytes(8, "little")
        parent = digest(message)
        hashes.append(parent)
    return hashes


def keyed_chain(tokens, block_size, k0, k1, parent):
    """[(low, high)] of each full block: SipHash-1-3-128(tokens || parent)."""
    return _chain(tokens, block_size, parent, lambda m: siphash(m, k0, k1))


def fast_chain(tokens, block_size, seed, parent):
    """[(low, high)] of each full block: XXH3-128(tokens || parent, seed),
    by the ``xxhash`` package."""
    import xxhash

    def digest(message):
        value = xxhash.xxh3_128_intdigest(message, seed)
        return value & _M64, value >> 64
    return _chain(tokens, block_size, parent, digest)


# ------------------------------------------------------------ index probes

EMPTY, WRITING, READY, EVICTING, TOMBSTONE = 0, 1, 2, 3, 4
HIT, MISS, BUSY, CONTINUE, FREE, EXISTS = 0, 1, 2, 3, 4, 5


def entry_check(entry):
    check = 0x5452414354494458
    for word in entry[:7]:
        check = ((check ^ int(word)) * 0x100000001B3 + 0x9E3779B97F4A7C15) & _M64
    return check


def _decode(entry):
    entry = [int(word) for word in entry]
    whole = entry[7] == entry_check(entry)
    return {"empty": not any(entry) or (whole and entry[3] & 0xFF == EMPTY), "whole": whole,
            "key": (entry[0], entry[1]), "state": entry[3] & 0xFF,
            "writer": ((entry[3] >> 8) & 0xFFFF) - 1, "epoch": entry[6] & 0xFFFFFFFF}


UNKNOWN = 0xFFFF


def reach(entry):
    """A slot's reach: word 3 bits 24..39 of a whole entry, 0 for a
    never-used slot, UNKNOWN for a torn line."""
    if not any(int(word) for word in entry):
        return 0
    e = _decode(entry)
    return (int(entry[3]) >> 24) & 0xFFFF if e["whole"] else UNKNOWN


def probe_lookup(keys, lines, reaches, scanned):
    """[(code, position)] per key: the first whole entry of the key decides;
    an empty slot or the home's reach ends the chain."""
    result = []
    for key, window, far in zip(keys, lines, reaches):
        key = (int(key[0]), int(key[1]))
        outcome = (CONTINUE, -1)
        for position, entry in enumerate(window):
            e = _decode(entry)
            if e["empty"] or (far != UNKNOWN and scanned + position > far):
                outcome = (MISS, position)
                break
            if e["whole"] and e["key"] == key and e["state"] in (READY, WRITING, EVICTING):
                outcome = (HIT if e["state"] == READY else BUSY, position)
                break
        result.append(outcome)
    return result


def probe_reserve(keys, lines, start, mask, widths, live_epochs):
    """[(code, position)] per key, keys in turn: a key seen before in the
    batch repeats its outcome; slots taken by earlier keys are held in a
    dict (slot -> key)."""
    taken, seen, result = {}, {}, []
    capacity = mask + 1
    for key, window, first, width in zip(keys, lines, start, widths):
        key = (int(key[0]), int(key[1]))
        if key in seen:
            code, position = seen[key]
            result.append((EXISTS if code == FREE else code, position))
            continue
        far = reach(window[0])
        outcome, reusable = (CONTINUE, -1), None
        window_slots = [(int(first) + w) & mask for w in range(int(width))]
        for position, (entry, slot) in enumerate(zip(window[:width], window_slots)):
            e = _decode(entry)
            dead = (e["state"] == WRITING and e["whole"]
                    and not (0 <= e["writer"] < len(live_epochs)
                             and int(live_epochs[e["writer"]]) == e["epoch"]))
            if not e["empty"] and e["whole"] and e["key"] == key \
                    and e["state"] != TOMBSTONE and not dead:
                outcome = (EXISTS, position)
                break
            usable = e["empty"] or not e["whole"] or e["state"] == TOMBSTONE or dead
            if usable and reusable is None and slot not in taken:
                reusable = position
            if reusable is not None and (e["empty"] or (far != UNKNOWN and position >= far)):
                outcome = (FREE, reusable)
                break
        if outcome[0] == CONTINUE and width >= capacity and reusable is not None:
            outcome = (FREE, reusable)
        if outcome[0] == FREE:
            taken[window_slots[outcome[1]]] = key
        seen[key] = outcome
        result.append(outcome)
    return result


def reaches(lines, count, mask, first):
    """Per slot of the first ``count``: the farthest whole live entry homed
    there within its recorded reach (the recorded reach when it is unknown,
    a torn line lies within it, or the lines end first)."""
    result = []
    for h in range(count):
        known = reach(lines[h])
        if known == UNKNOWN or h + known >= len(lines):
            result.append(known)
            continue
        farthest = 0
        for p in range(h, h + known + 1):
            e = _decode(lines[p])
            if e["empty"]:
                continue
            if not e["whole"]:
                farthest = known
                break
            if e["state"] in (WRITING, READY, EVICTING) and e["key"][0] % (mask + 1) == \
                    (first + h) % (mask + 1):
                farthest = p - h
        result.append(farthest)
    return result


def raise_reaches(keys, slots, homes, mask, reaches):
    """(reaches, {home slot: raised reach}): the reach each home needs
    after keys are placed at slots; a home among the slots takes it in
    ``reaches``, another is raised when its known reach falls short."""
    reaches, raised = list(reaches), {}
    where = {int(slot): row for row, slot in reversed(list(enumerate(slots)))}
    for key, slot, home_line in zip(keys, slots, homes):
        home = int(key[0]) % (mask + 1)
        distance = (int(slot) - home) % (mask + 1)
        if home in where:
            reaches[where[home]] = max(reaches[where[home]], distance)
        elif reach(home_line) != UNKNOWN and distance > reach(home_line):
            raised[home] = max(raised.get(home, 0), distance)
    return reaches, raised


def collect(keys, pending, lines, scanned, start, mask, leading, reaches):
    """One lookup round of the keys ``pending`` (rows, in order) over their
    ``lines``, the slots ``scanned`` on past each home: (the rows still
    pending, {row: (code, slot, entry)} of those decided, the home
    reaches, each recorded in the first round).  Slot and entry are None
    for a MISS; with ``leading``, no row after the first one decided
    otherwise than HIT stays pending."""
    reaches = list(reaches)
    if scanned == 0:
        for row, window in zip(pending, lines):
            reaches[row] = reach(window[0])
    found = probe_lookup([keys[row] for row in pending], lines,
                         [reaches[row] for row in pending], scanned)
    kept, decided, stop = [], {}, len(keys)
    for row, (code, position), window in zip(pending, found, lines):
        if code == CONTINUE:
            kept.append(row)
        elif code == MISS:
            decided[row] = (code, None, None)
        else:
            decided[row] = (code, (int(start[row]) + scanned + position) % (mask + 1),
                            [int(word) for word in window[position]])
        if leading and code not in (HIT, CONTINUE):
            stop = min(stop, row)
    return [row for row in kept if row < stop], decided, reaches


def grow_windows(pending, widths, targets, start, mask, base):
    """([(entry offset, key row, window position)] of the lines each pending
    key has not read yet, up to its target width; the widths after)."""
    widths, unread = list(widths), []
    for row in pending:
        for position in range(widths[row], targets[row]):
            slot = (int(start[row]) + position) % (mask + 1)
            unread.append((base + slot * 64, row, position))
        widths[row] = max(widths[row], targets[row])
    return unread, widths


def next_widths(lines, widths, pending, capacity):
    """({row: its next window's width}, the widest) of each pending key of a
    reserve: its home's reach + 1 when that lies past its window, else
    twice as wide; at most ``capacity``."""
    targets = {}
    for row in pending:
        known = reach(lines[row][0])
        want = known + 1 if known != UNKNOWN and known >= widths[row] else 2 * widths[row]
        targets[row] = min(want, capacity)
    return targets, max(targets.values(), default=0)


def outside(entries, low, high):
    """The first row whose payload [offset, offset + length) (words 4 and
    5, unsigned) is empty or not inside [low, high), or -1."""
    for row, entry in enumerate(entries):
        offset, length = int(entry[4]), int(entry[5])
        if length == 0 or offset < low or offset + length > high:
            return row
    return -1


_REACH_BITS = 0xFFFF << 24


def reserved_entries(keys, codes, targets, payloads, sizes, tokens, word3, epoch):
    """[(key row, words 0..6 of its WRITING entry, its slot's reach)] of
    the keys whose code is FREE."""
    out = []
    for k, code in enumerate(codes):
        if code != FREE:
            continue
        words = [int(keys[k][0]), int(keys[k][1]), (int(targets[k][2]) + 1) & _M64,
                 word3 | int(tokens[k]) << 40, int(payloads[k]), int(sizes[k]), epoch]
        out.append((k, words, reach(targets[k])))
    return out


def finished(entries, expected, state, checksums):
    """(ours, words 0..6 of each moved on): an entry is ours when whole and
    equal to the expected one but for the reach bits; it moves on to READY
    (checksum in word 6's high half) or to a tombstone (version and reach
    kept), its version + 1."""
    ours, done = [], []
    for entry, want, checksum in zip(entries, expected, checksums):
        e, x = [int(word) for word in entry], [int(word) for word in want]
        same = e[7] == entry_check(e) and all(e[i] == x[i] for i in (0, 1, 2, 4, 5, 6)) \
            and e[3] & ~_REACH_BITS == x[3] & ~_REACH_BITS
        ours.append(same)
        if not same:
            continue
        e[2] = (e[2] + 1) & _M64
        if state == READY:
            e[3] = (e[3] & ~0xFF) | READY
            e[6] = (e[6] & 0xFFFFFFFF) | (int(checksum) & 0xFFFFFFFF) << 32
        else:
            e[0] = e[1] = e[4] = e[5] = e[6] = 0
            e[3] = (e[3] & _REACH_BITS) | TOMBSTONE
        done.append(e[:7])
    return ours, done
