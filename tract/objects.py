"""The object store: a directory of named roots in the pool.

A fixed table of 128-byte records (two lines), placed by a keyed hash of the
name with linear probing; a deleted record becomes a tombstone so probe
chains stay whole.  A record holds its version (bumped by every change),
state, offset, size, kind, name and the writer node, and ends with a check
word over all of them, stored last.

- Writes (`put`, `delete`) happen under the pool's ``objects`` lock: the
  holder reads the chain fresh (R4), checks the lock's epoch (fencing, R6),
  writes the record, check word last, and flushes both lines; the lock's
  release fences them before the next writer can start (R3).
- Reads (`get`, `list`) take no lock: invalidate the record's lines, fence,
  read, and accept the record only when its check word matches.  A record
  caught mid-write (a flush may land line by line, and an eviction may write
  back part of a line) fails its check; the reader retries, and after a
  lease timeout reports it, since only a writer that died leaves one torn
  (`tract pool fsck --repair` clears it).  So a reader sees a whole record
  or none.

Rules relied on (DESIGN.md): R2 — records are written only by the
``objects`` lock holder; R3, R4 as above; R5 — state, name length, name
bytes, offset and size are range-checked; R6 — the lock's fencing epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from tract.errors import CorruptionError, PoolFull
from tract.lines import LINE, MASK64, check_word

__all__ = ["NAME_MAX", "ObjectRecord", "ObjectStore", "RECORD_BYTES"]

RECORD_BYTES = 128
NAME_MAX = 64
NAME = re.compile(r"[A-Za-z0-9_.:/@+-]{1,64}")
EMPTY, LIVE, TOMBSTONE = 0, 1, 2
RECORD_TAG = 0x4F42_4A45_4354_5243  # seeds a record's check word


@dataclasses.dataclass(frozen=True)
class ObjectRecord:
    name: str
    offset: int
    size: int
    kind: int
    version: int
    writer: int


def record_check(words) -> int:
    """Check word over a record's first seven words and its eight name words."""
    return check_word(RECORD_TAG, words)


def validate_name(name: str) -> bytes:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"object name {name!r} must be 1..{NAME_MAX} characters of "
                         f"A-Z a-z 0-9 _ . : / @ + -")
    return name.encode("ascii")


class ObjectStore:
    """One node's view of a pool's object directory (`pool.objects`)."""

    def __init__(self, pool, offset: int, capacity: int, heap_range: tuple[int, int]):
        self.pool = pool
        self.region = pool.region
        self.offset = offset
        self.capacity = capacity
        self.heap_range = heap_range
        self._key = pool.header.hash_key

    def record_offset(self, index: int) -> int:
        """Where record ``index`` lies in the pool."""
        return self.offset + index * RECORD_BYTES

    def _home(self, name: bytes) -> int:
        digest = hashlib.blake2b(name, key=self._key, digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.capacity

    def _decode(self, index: int, words) -> tuple[int, ObjectRecord | None]:
        """(state, record) of a slot's words as read; raises on a torn or
        out-of-range record (`_TornRecord` when only the check word fails)."""
        where = f"object record {index} at offset {self.record_offset(index)}"
        if not any(words):
            return EMPTY, None
        version, state, offset, size, kind, name_length, writer, check = words[:8]
        if check != record_check(words[:7] + words[8:]):
            raise _TornRecord(where)
        if state not in (LIVE, TOMBSTONE):
            raise CorruptionError(f"{where} has state {state}; expected {LIVE} or {TOMBSTONE}")
        if state == TOMBSTONE:
            return TOMBSTONE, None
        if not 1 <= name_length <= NAME_MAX:
            raise CorruptionError(f"{where} has a name of {name_length} bytes; expected "
                                  f"1..{NAME_MAX}")
        raw = b"".join(word.to_bytes(8, "little") for word in words[8:])[:name_length]
        name = raw.decode("ascii", "replace")
        if not NAME.fullmatch(name):
            raise CorruptionError(f"{where} has name {raw!r}")
        low, high = self.heap_range
        if not (low <= offset and size <= high - offset):
            raise CorruptionError(f"{where} ({name!r}) points at [{offset}, {offset}+{size}), "
                                  f"outside the heap [{low}, {high})")
        if writer == 0 or writer > self.pool.header.max_nodes:
            raise CorruptionError(f"{where} ({name!r}) names writer node {writer - 1}")
        return LIVE, ObjectRecord(name, offset, size, kind, version, writer - 1)

    def _read(self, index: int, fresh: bool = True):
        line = self.record_offset(index)
        if fresh:
            self.region.invalidate(line, RECORD_BYTES)
            self.region.fence()
        return list(self.region.load_u64s(line, 16))

    def _read_whole(self, index: int) -> tuple[int, ObjectRecord | None]:
        """A slot's state and record, retrying a torn one for a lease."""
        clock, backoff = self.pool.clock, self.pool.space.backoff()
        start = clock.now()
        while True:
            try:
                return self._decode(index, self._read(index))
            except _TornRecord as torn:
                if clock.now() - start > self.pool.header.lease_timeout:
                    raise CorruptionError(f"{torn} stays torn (its writer died mid-write); "
                                          f"tract pool fsck --repair clears it") from None
                backoff.wait()

    def _find(self, name: bytes) -> tuple[int | None, int | None, ObjectRecord | None]:
        """(slot holding ``name`` or None, first reusable slot or None, record)."""
        home, reusable = self._home(name), None
        text = name.decode()
        for step in range(self.capacity):
            index = (home + step) % self.capacity
            state, record = self._read_whole(index)
            if state == EMPTY:
                return None, index if reusable is None else reusable, None
            if state == TOMBSTONE:
                reusable = index if reusable is None else reusable
            elif record.name == text:
                return index, reusable, record
        return None, reusable, None

    # ------------------------------------------------------------------ API

    def get(self, name: str) -> ObjectRecord | None:
        """The record named ``name``, or None (no lock taken)."""
        return self._find(validate_name(name))[2]

    def _slots(self):
        """(slot, state, record, error) of every slot, read after one bulk
        invalidate and one fence; ``error`` is the exception a torn or
        corrupt slot raised (then state and record are None)."""
        self.region.invalidate(self.offset, self.capacity * RECORD_BYTES, payload=True)
        self.region.fence()
        for index in range(self.capacity):
            try:
                state, record = self._decode(index, self._read(index, fresh=False))
            except (_TornRecord, CorruptionError) as error:
                yield index, None, None, error
            else:
                yield index, state, record, None

    def list(self) -> list[ObjectRecord]:
        """Every live record (no lock taken)."""
        records = []
        for index, state, record, error in self._slots():
            if error is not None:
                state, record = self._read_whole(index)  # retries a torn one; raises
            if state == LIVE:
                records.append(record)
        return records

    def put(self, name: str, offset: int, size: int, kind: int = 0,
            timeout: float | None = None) -> ObjectRecord:
        """Name the range [offset, offset + size) (replacing any record of
        that name); returns the new record."""
        raw = validate_name(name)
        low, high = self.heap_range
        if not (isinstance(offset, int) and isinstance(size, int) and low <= offset
                and 0 < size <= high - offset):
            raise ValueError(f"object {name!r}: range [{offset}, +{size}) is not inside the "
                             f"heap [{low}, {high})")
        if not 0 <= kind <= 0xFFFF_FFFF:
            raise ValueError(f"object {name!r}: kind {kind} is outside 0..2**32-1")
        with self.pool.lock("objects")(timeout) as lock:
            index, reusable, old = self._find(raw)
            if index is None:
                if reusable is None:
                    raise PoolFull(f"object directory of {self.capacity} records is full; "
                                   f"cannot add {name!r}")
                index = reusable
                previous = self._read(index, fresh=False)[0]
            else:
                previous = old.version
            record = ObjectRecord(name, offset, size, kind, (previous + 1) & MASK64,
                                  self.pool.node)
            lock.check()
            self._write(index, LIVE, record, raw)
        return record

    def delete(self, name: str, timeout: float | None = None) -> ObjectRecord:
        """Remove the record named ``name`` and return it (its memory is the
        caller's to free).  KeyError if there is none."""
        raw = validate_name(name)
        with self.pool.lock("objects")(timeout) as lock:
            index, _, old = self._find(raw)
            if index is None:
                raise KeyError(f"no object named {name!r}")
            lock.check()
            tombstone = ObjectRecord(name, 0, 0, 0, (old.version + 1) & MASK64, self.pool.node)
            self._write(index, TOMBSTONE, tombstone, b"")
        return old

    def _write(self, index: int, state: int, record: ObjectRecord, raw: bytes) -> None:
        padded = raw.ljust(NAME_MAX, b"\0")
        name_words = [int.from_bytes(padded[i:i + 8], "little") for i in range(0, NAME_MAX, 8)]
        head = [record.version, state, record.offset, record.size, record.kind, len(raw),
                record.writer + 1]
        line = self.record_offset(index)
        for position, word in enumerate(head):
            self.region.store_u64(line + 8 * position, word)
        for position, word in enumerate(name_words):
            self.region.store_u64(line + LINE + 8 * position, word)
        self.region.store_u64(line + 56, record_check(head + name_words))
        # the caller holds the objects lock: its release fences this flush
        # before anyone else can take the lock (R3)
        self.region.flush(line, RECORD_BYTES)

    def clear(self, index: int) -> None:
        """Make slot ``index`` a tombstone whatever it held (fsck --repair,
        under the ``objects`` lock)."""
        words = self._read(index)
        version = words[0]
        self._write(index, TOMBSTONE, ObjectRecord("", 0, 0, 0, (version + 1) & MASK64,
                                                   self.pool.node), b"")

    def scan(self) -> list[tuple[int, str, ObjectRecord | None, str | None]]:
        """(slot, state name, record, problem) of every non-empty slot, for
        fsck; a torn or corrupt slot is reported, not raised."""
        found = []
        for index, state, record, error in self._slots():
            if error is not None:
                found.append((index, "bad", None, str(error)))
            elif state != EMPTY:
                found.append((index, "live" if state == LIVE else "tombstone", record, None))
        return found


class _TornRecord(Exception):
    """A record whose check word does not match (mid-write, or corrupt)."""
