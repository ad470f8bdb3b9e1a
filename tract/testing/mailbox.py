"""A single-producer, single-consumer ring of mailboxes in the pool: the
smallest real message-passing protocol, and the yardstick the simulator and
the mutation harness are proven on.

Each slot has a payload and a flag.  The flag line is written by one host at
a time (R2): the sender sets it to ``seq + 1`` only after seeing it 0, the
receiver clears it only after seeing ``seq + 1``.  Rules relied on:

- R3: the sender writes the payload, flushes it and fences, and only then
  sets the flag, flushes it and fences;
- R4: both sides invalidate the flag before every poll, and the receiver
  invalidates the payload before reading it;
- R2: in the default layout the payload starts on a line and the flag has a
  line of its own; ``packed=True`` puts each flag straight after its payload,
  inside a line the neighbouring slot's payload shares — the broken layout
  the simulator must catch;
- R5: a flag value that is neither 0 nor a sequence number the ring can hold
  is a `CorruptionError`.
"""

from __future__ import annotations

import dataclasses

from tract.errors import CorruptionError
from tract.lines import LINE



@dataclasses.dataclass(frozen=True)
class Ring:
    """Offsets of a ring of ``slots`` mailboxes of ``payload_bytes`` each."""

    slots: int
    payload_bytes: int
    base: int = 0
    packed: bool = False

    @property
    def stride(self) -> int:
        if self.packed:
            return self.payload_bytes + 8
        return -(-self.payload_bytes // LINE) * LINE + LINE

    @property
    def nbytes(self) -> int:
        return -(-self.slots * self.stride // LINE) * LINE

    def payload(self, seq: int) -> int:
        return self.base + (seq % self.slots) * self.stride

    def flag(self, seq: int) -> int:
        return self.payload(seq) + self.stride - 8 if self.packed else \
            self.payload(seq) + self.stride - LINE


def _read_flag(region, ring: Ring, offset: int, seq: int) -> int:
    region.invalidate(offset, 8)
    region.fence()
    value = region.load_u64(offset)
    if value != 0 and not seq - ring.slots < value <= seq + 1:
        raise CorruptionError(f"mailbox flag at offset {offset} holds {value}; expected 0 or "
                              f"a sequence number in ({seq - ring.slots}, {seq + 1}]")
    return value


def send(region, ring: Ring, seq: int, payload) -> None:
    """Wait for slot ``seq`` to be free, then publish ``payload`` in it."""
    flag = ring.flag(seq)
    while _read_flag(region, ring, flag, seq) != 0:
        pass
    region.copy_in(ring.payload(seq), payload, nontemporal=False)
    region.flush(ring.payload(seq), ring.payload_bytes)
    region.fence()
    region.store_u64(flag, seq + 1)
    region.flush(flag, 8)
    region.fence()


def receive(region, ring: Ring, seq: int) -> bytes:
    """Wait for message ``seq``, copy it out and free its slot."""
    flag = ring.flag(seq)
    while _read_flag(region, ring, flag, seq) != seq + 1:
        pass
    region.invalidate(ring.payload(seq), ring.payload_bytes)
    region.fence()
    message = region.read(ring.payload(seq), ring.payload_bytes)
    region.store_u64(flag, 0)
    region.flush(flag, 8)
    region.fence()
    return message
