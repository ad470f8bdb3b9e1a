"""P/D handoff records: what a prefill process leaves in the pool for the
decode side to find a request's blocks by (DESIGN.md §3, P/D handoff).

A record is written once, by the process that offers, into memory it
allocates: a head line (magic, a random nonce, the producer's node and
epoch, a deadline, the key count, and a check word over all of them and
the keys), a *taken* line that decoders write, then the keys, 16 bytes
each.  A *ticket* names a record: ``tract:<offset hex>.<nonce hex>``, a
short string the engine passes to the decode side with the request.

- Write (`HandoffRecords.write`): the whole record, taken line zeroed,
  copied in and in memory when the call returns, before the ticket exists
  (R3).
- Read (`HandoffRecords.read`): the ticket's offset is checked to be a line
  inside the heap; the head line is dropped, fenced and read, and checked
  (magic, nonce, node, a count that fits the heap, a deadline ahead); only
  then are the keys dropped, fenced and read, and the whole record held to
  its check word.  A stale copy, a withdrawn record or memory reused by
  another record is no record: the caller's miss, never another request's
  keys.
- Mark taken (`HandoffRecords.mark_taken`): a decoder writes the nonce,
  masked, into the taken line, flushes and fences it, only while the
  producer (node, epoch) is live and the deadline is ahead.  The producer
  frees a record's memory no sooner than a lease past its deadline
  (`HandoffRecords.free_at`), and a dead node's memory is reclaimed only
  once its lease lapsed, so a mark never lands in reused memory.
- Taken marks (`HandoffRecords.taken`): the producer drops every taken line
  it asks about, fences once, and reads them.
- Withdraw (`HandoffRecords.withdraw`): the producer clears the magic,
  flushes and fences: a decoder that reads the record afterwards finds no
  offer.

On a real mapping each step above is one native call
(`tract._native._handofffast`), held to the Python step it replaces by
result, bytes and cache-control trace (DESIGN.md §5, tests/test_twins.py's
registry); the simulator runs the Python steps.

Rules relied on (DESIGN.md): R2 — the producer writes the head line and
the keys, a decoder only the taken line; R3 — the record is in memory
before its ticket is returned, the taken mark and the withdrawal are
flushed and fenced; R4 — a decoder reads the record fresh, the producer
the taken lines; R5 — a ticket's offset is checked against the heap, the
record's count against its range, and the whole record against its check
word; R6 — a decoder marks a record only while its producer is live in
the record's epoch and before the deadline, and the memory is freed a
lease after the deadline.
"""

from __future__ import annotations

import os
import re
import struct
import typing
from collections.abc import Sequence

import numpy as np

from tract._native._handofffast import HandoffFastPath
from tract._native._region import Region, xxh64
from tract.lines import LINE

__all__ = ["NO_OFFER", "HandoffRecords", "Record", "format_ticket", "parse_ticket"]

_HEAD = struct.Struct("<8sQQQdQQ")  # magic, nonce, producer node, its epoch, deadline, count, check
_CHECKED = 48  # head bytes under the check word (all but the check itself)
_TAKEN_AT, _KEYS_AT = LINE, 2 * LINE
_MAGIC = b"tractHO2"
_TAKEN = 0x7A6B_656E_7461_6B65  # the taken word: nonce ^ this
_TICKET = re.compile(r"tract:([0-9a-f]{1,16})\.([0-9a-f]{16})")
#: the ticket of an offer a full pool had no room for: it names no record
NO_OFFER = "tract:0.0000000000000000"


class Record(typing.NamedTuple):
    """A live handoff record, as `HandoffRecords.read` found it."""

    offset: int
    nonce: int
    node: int  # the producer's
    epoch: int
    deadline: float
    keys: np.ndarray  # (n, 2) uint64


def format_ticket(offset: int, nonce: int) -> str:
    """The ticket naming the record at ``offset`` with ``nonce``."""
    return f"tract:{offset:x}.{nonce:016x}"


def parse_ticket(ticket: str) -> tuple[int, int]:
    """(record offset, nonce) of a ticket `format_ticket` made."""
    match = _TICKET.fullmatch(ticket) if isinstance(ticket, str) else None
    if match is None:
        raise ValueError(f"{ticket!r} is not a handoff ticket (tract:<offset hex>.<nonce hex>, "
                         f"as Connector.offer returns)")
    return int(match[1], 16), int(match[2], 16)


class HandoffRecords:
    """One process's view of the handoff records in a pool: the records it
    writes as a producer and those it reads and marks as a decoder.  On a
    real mapping each step is one native call (`_native._handofffast`), held
    to the Python step beside it by tests/test_twins.py; on the simulator
    the Python steps run."""

    def __init__(self, pool):
        self.pool = pool
        low, high = pool.index.heap
        self.fast = HandoffFastPath(pool.region, low, high, pool.header.max_nodes) \
            if isinstance(pool.region, Region) else None

    def write(self, keys: np.ndarray, deadline: float,
              timeout: float | None = None) -> tuple[int, int]:
        """Write a record of ``keys`` ((n, 2) uint64) for this node,
        live until ``deadline`` (wall time), into memory allocated for it;
        returns its (offset, nonce), in memory on return (R3).  Raises what
        `Index.alloc` raises (`PoolFull`, `LeaseLost`, `LockTimeout`) when
        there is no memory for it."""
        pool = self.pool
        nonce = int.from_bytes(os.urandom(8), "little") | 1
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1, 2)
        offset = pool.index.alloc(_KEYS_AT + 16 * len(keys), timeout)
        try:
            pool.self_fence("a handoff record")  # into a block of a slab this node owns
            if self.fast is not None:
                self.fast.write(offset, nonce, pool.node, pool.epoch, deadline, keys)
            else:
                self._write(offset, nonce, pool.node, pool.epoch, deadline, keys)
        except BaseException:
            pool.free(offset)
            raise
        return offset, nonce

    def _write(self, offset: int, nonce: int, node: int, epoch: int, deadline: float,
               keys: np.ndarray) -> None:
        """The whole record, taken line zeroed, copied in: in memory on
        return (R3)."""
        chosen = keys.tobytes()
        head = _HEAD.pack(_MAGIC, nonce, node, epoch, deadline, len(keys), 0)
        check = xxh64(head[:_CHECKED] + chosen, nonce)
        body = head[:_CHECKED] + struct.pack("<Q", check) + bytes(_KEYS_AT - _HEAD.size) + chosen
        self.pool.region.copy_in(offset, body)

    def read(self, ticket: str) -> Record | None:
        """The live record a ticket names, read fresh (R4) and checked
        (R5); None when there is none (`NO_OFFER`, expired, withdrawn, or
        the memory reused).  Raises `ValueError` for a string that is no
        ticket, or one whose offset is not a line inside the heap."""
        offset, nonce = parse_ticket(ticket)
        if ticket == NO_OFFER:
            return None
        low, high = self.pool.index.heap
        if offset % LINE or not low <= offset <= high - _KEYS_AT:
            raise ValueError(f"handoff ticket {ticket!r} names offset {offset}, which is not a "
                             f"line inside the heap [{low}, {high})")
        now = self.pool.clock.wall()
        found = self.fast.read(offset, nonce, now) if self.fast is not None else \
            self._read(offset, nonce, now)
        return None if found is None else Record(offset, nonce, *found)

    def _read(self, offset: int, nonce: int, now: float):
        """(node, epoch, deadline, keys) of the live record at ``offset``:
        its head line dropped, fenced, read and checked, then its keys
        dropped, fenced and read, and the whole held to its check word; None
        when there is none."""
        high = self.pool.index.heap[1]
        region = self.pool.region
        region.invalidate(offset, LINE, payload=True)
        region.fence()
        head = region.read(offset, _HEAD.size)
        magic, found, node, epoch, deadline, count, check = _HEAD.unpack(head)
        if magic != _MAGIC or found != nonce or node >= self.pool.header.max_nodes or \
                count > (high - offset - _KEYS_AT) // 16 or deadline < now:
            return None
        region.invalidate(offset + _KEYS_AT, count * 16, payload=True)
        region.fence()
        chosen = region.read(offset + _KEYS_AT, count * 16)
        if xxh64(head[:_CHECKED] + chosen, nonce) != check:
            return None
        return node, epoch, deadline, np.frombuffer(chosen, np.uint64).reshape(count, 2)

    def mark_taken(self, record: Record) -> None:
        """Write the record's taken line while its producer (node, epoch)
        is live and the deadline is ahead: the producer frees a record no
        sooner than a lease past its deadline (`free_at`), and a dead
        node's memory only once its lease lapsed (R6), so the mark never
        lands in reused memory."""
        pool = self.pool
        if pool.nodes.read(record.node)[1] != record.epoch or \
                not pool.space.liveness.live(record.node) or pool.clock.wall() >= record.deadline:
            return
        if self.fast is not None:
            self.fast.mark(record.offset, record.nonce)
        else:
            self._mark(record.offset, record.nonce)

    def _mark(self, offset: int, nonce: int) -> None:
        """The taken word written, flushed and fenced: in memory when the
        decoder's take returns (R3)."""
        region = self.pool.region
        region.store_u64(offset + _TAKEN_AT, nonce ^ _TAKEN)
        region.flush(offset + _TAKEN_AT, LINE)
        region.fence()

    def taken(self, records: Sequence[tuple[int, int]]) -> list[bool]:
        """Whether the taken line of each record, given as (offset, nonce),
        holds its mark, read fresh (R4): one drop of all the lines, one
        fence."""
        if self.fast is not None:
            return self.fast.taken(np.array([offset for offset, _ in records], np.int64),
                                   np.array([nonce for _, nonce in records], np.uint64))
        return self._taken(records)

    def _taken(self, records: Sequence[tuple[int, int]]) -> list[bool]:
        region = self.pool.region
        lines = np.array([offset + _TAKEN_AT for offset, _ in records], dtype=np.int64)
        region.invalidate_lines(lines, payload=True)
        region.fence()
        return [region.load_u64(offset + _TAKEN_AT) == nonce ^ _TAKEN
                for offset, nonce in records]

    def withdraw(self, offset: int) -> None:
        """Make the record at ``offset`` read as no record, in memory on
        return (R3); its memory is still freed no sooner than `free_at`."""
        if self.fast is not None:
            self.fast.withdraw(offset)
        else:
            self._withdraw(offset)

    def _withdraw(self, offset: int) -> None:
        region = self.pool.region
        region.store_u64(offset, 0)  # the magic: a decoder finds no offer
        region.flush(offset, LINE)
        region.fence()

    def free_at(self, deadline: float) -> float:
        """When the memory of a record live until ``deadline`` may be
        freed: a lease after it, since a decoder marks a record only before
        its deadline, and only while the producer's lease holds."""
        return deadline + self.pool.header.lease_timeout
