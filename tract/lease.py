"""Leases: node heartbeats, how other nodes judge them, and bounded waiting.

Rules relied on (DESIGN.md): R2 — each node's line in the node table is
written only by that node; R3 — a heartbeat is stored, flushed and fenced;
R4 — an observer invalidates a node's line before reading it; R5 — a node
state read from the pool is range-checked; R6 — every claim is a lease: a
node whose heartbeat has not changed for ``lease_timeout`` seconds of the
*observer's* clock is stale, and loses whatever it held.  No clock is shared
between hosts: only the observer's own clock measures how long a heartbeat
has stood still.  The other half of R6 is self-fencing (`OwnLease`): a
process whose own node's last good beat is more than half a lease old, on
its own clock, writes nothing that depends on a claim, and a beat that
comes that late is no beat.

Node line (64 bytes): heartbeat u64, epoch u64, state u64, pid u64.
The epoch counts the node's incarnations: it is bumped when a node joins
after having been dead or gone, so claims stamped with an older epoch are
known to be orphaned.
"""

from __future__ import annotations

import functools
import os
import time

import numpy as np

from tract.errors import CorruptionError, LeaseLost
from tract.lines import LINE

#: the highest epoch a node may join past (joining once a microsecond, a node
#: would reach it in some 290,000 years)
EPOCH_MAX = 1 << 63

__all__ = ["ABSENT", "ALIVE", "HELD", "LAPSED", "LATE", "LEFT", "REJOINED", "Backoff", "Clock",
           "Liveness", "NodeTable", "OwnLease"]

ABSENT, ALIVE, LEFT = 0, 1, 2
_STATES = {ABSENT: "absent", ALIVE: "alive", LEFT: "left"}


class Clock:
    """Monotonic time and sleep.  The simulator supplies a virtual one with
    the same two methods, so lease logic runs unchanged under it."""

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def wall() -> float:
        """Seconds since the Unix epoch: comparable across hosts (access stamps)."""
        return time.time()

    @staticmethod
    def sleep(seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
        else:
            os.sched_yield()


class Backoff:
    """Spin briefly, then yield, then sleep with bounded exponential backoff,
    so a waiter never burns a core for long (these machines have 2)."""

    def __init__(self, clock: Clock, spins: int = 64, yields: int = 64,
                 first_sleep: float = 2e-6, max_sleep: float = 1e-3):
        self.clock = clock
        self.spins, self.yields = spins, yields
        self.first_sleep, self.max_sleep = first_sleep, max_sleep
        self.reset()

    def reset(self) -> None:
        self.rounds = 0
        self._sleep = self.first_sleep

    def wait(self) -> None:
        self.rounds += 1
        if self.rounds <= self.spins:
            return
        if self.rounds <= self.spins + self.yields:
            self.clock.sleep(0)
            return
        self.clock.sleep(self._sleep)
        self._sleep = min(self._sleep * 2, self.max_sleep)


class NodeTable:
    """The per-node lines of a pool, at ``offset`` in ``region``."""

    def __init__(self, region, offset: int, max_nodes: int):
        self.region = region
        self.offset = offset
        self.max_nodes = max_nodes

    def line(self, node: int) -> int:
        if not 0 <= node < self.max_nodes:
            raise ValueError(f"node {node} is outside 0..{self.max_nodes - 1}")
        return self.offset + node * LINE

    def read(self, node: int) -> tuple[int, int, int]:
        """(heartbeat, epoch, state) of ``node``, fresh from memory (R4)."""
        line = self.line(node)
        self.region.invalidate(line, LINE)
        self.region.fence()
        return self.decode(node)

    def decode(self, node: int) -> tuple[int, int, int]:
        """(heartbeat, epoch, state) as this host currently sees them."""
        line = self.line(node)
        state = self.region.load_u64(line + 16)
        if state not in _STATES:
            raise CorruptionError(f"node table entry {node} at offset {line + 16} has state "
                                  f"{state}; expected one of {sorted(_STATES)}")
        return self.region.load_u64(line), self.region.load_u64(line + 8), state

    def standing(self) -> bytes:
        """Every node's epoch and state, fresh (one batch: R4), as bytes to
        compare with an earlier look: a change means a node joined, left or
        rejoined."""
        size = self.max_nodes * LINE
        self.region.invalidate(self.offset, size)
        self.region.fence()
        table = np.frombuffer(self.region.read(self.offset, size), dtype=np.uint64)
        return table.reshape(self.max_nodes, LINE // 8)[:, 1:3].tobytes()

    def join(self, node: int, stale: bool) -> int:
        """Mark ``node`` alive; bump its epoch when its last incarnation is
        dead or gone (``stale``) or it never joined.  Returns the epoch."""
        heartbeat, epoch, state = self.read(node)
        line = self.line(node)
        if state != ALIVE or stale:
            if epoch >= EPOCH_MAX:  # no incarnation count comes near: the line is corrupt (R5)
                raise CorruptionError(f"node table entry {node} at offset {line + 8} has epoch "
                                      f"{epoch}, beyond any real count of incarnations "
                                      f"(< {EPOCH_MAX})")
            epoch += 1
        self.region.store_u64(line, (heartbeat + 1) & 0xFFFF_FFFF_FFFF_FFFF)
        self.region.store_u64(line + 8, epoch)
        self.region.store_u64(line + 16, ALIVE)
        self.region.store_u64(line + 24, os.getpid())
        self.region.flush(line, LINE)
        self.region.fence()
        return epoch

    def beat(self, node: int) -> None:
        """Bump this node's heartbeat (its own line: no other host writes it)."""
        line = self.line(node)
        heartbeat = self.region.load_u64(line)
        self.region.store_u64(line, (heartbeat + 1) & 0xFFFF_FFFF_FFFF_FFFF)
        self.region.flush(line, LINE)
        self.region.fence()

    def leave(self, node: int) -> None:
        line = self.line(node)
        self.region.store_u64(line + 16, LEFT)
        self.region.flush(line, LINE)
        self.region.fence()


class Liveness:
    """One observer's view of every node's lease.

    A node is *live* when it is ALIVE and its heartbeat changed within
    ``lease_timeout`` of this observer's clock; a node seen for the first
    time gets a full lease from that moment.
    """

    def __init__(self, nodes: NodeTable, clock: Clock, lease_timeout: float):
        self.nodes = nodes
        self.clock = clock
        self.lease_timeout = lease_timeout
        self._seen: dict[int, tuple[int, int, float]] = {}  # node -> (beat, epoch, since)

    def live(self, node: int) -> bool:
        return self._judge(node, *self.nodes.read(node))

    def live_nodes(self) -> list[int]:
        """The nodes `live` now, the table read fresh in one batch (R4)."""
        nodes = self.nodes
        nodes.region.invalidate(nodes.offset, nodes.max_nodes * LINE)
        nodes.region.fence()
        return [node for node in range(nodes.max_nodes) if self._judge(node, *nodes.decode(node))]

    def _judge(self, node: int, heartbeat: int, epoch: int, state: int) -> bool:
        if state != ALIVE:
            self._seen.pop(node, None)
            return False
        now = self.clock.now()
        seen = self._seen.get(node)
        if seen is None or seen[0] != heartbeat or seen[1] != epoch:
            self._seen[node] = (heartbeat, epoch, now)
            return True
        return now - seen[2] < self.lease_timeout

    def stale_for(self, node: int) -> float:
        """Seconds this observer has seen ``node``'s heartbeat stand still."""
        seen = self._seen.get(node)
        return 0.0 if seen is None else self.clock.now() - seen[2]


#: what `OwnLease.state` finds (`tract._native._lockfast.lease_state` returns the same codes)
HELD, LATE, LAPSED, REJOINED = 0, 1, 2, 3
_VERDICTS = {LATE: "its last beat is older than half its lease",
             LAPSED: "a beat came late (the process or its heartbeat stood still)",
             REJOINED: "another process of the node rejoined it under a new epoch"}
#: the words of an `OwnLease` (u64 indexes): the node's last good beat (ns of
#: this host's monotonic clock, read *before* the beat was written), the
#: node's current epoch, and 1 once a beat came late (until the node rejoins)
BEATEN, CURRENT, LATE_BEAT = 0, 1, 2
LEASE_WORDS = 3


class OwnLease:
    """Self-fencing (R6): this process's judgement of its own node's lease.

    Another node judges this one stale when its heartbeat stood still for
    ``lease_timeout`` of *that* node's clock, counted from when it first
    saw the last value, so never before the beat's own moment plus the
    lease.  A process that finds its node's last good beat no older than
    half the lease, on its own clock, knows that no node has judged it
    stale yet, and has the other half for the write it checks for.

    The words (`LEASE_WORDS` u64, at ``words``: a numpy view) are the node's:
    in its node-local file, shared by every process of the node (one host:
    one monotonic clock, coherent memory), or private to a process that is
    its node's only one.  A beat that comes more than half a lease after
    the last good one is not a beat ("a beat that is late is not a beat"):
    it is not written, and the node stays lapsed until one of its processes
    rejoins under a new epoch (`tract.pool.Pool.renew`).  Racing beats of
    two processes may set ``BEATEN`` back to the earlier of two fresh
    moments: only ever older, so only ever safer.

    `state` is the Python reference step of the native
    `tract._native._lockfast.lease_state` (tests/test_twins.py holds them
    to the same verdicts); the simulator runs this one on its virtual
    clock.
    """

    def __init__(self, clock: Clock, lease_timeout: float, words):
        self.clock = clock
        self.words = words
        self.limit_ns = int(lease_timeout * 1e9) // 2
        self._bind()

    def _bind(self) -> None:
        #: ``now(epoch)``: `state` now, by the native twin on the host's
        #: monotonic clock (what the hot paths call), else by the reference
        self.now = self.state
        if type(self.clock) is Clock:
            from tract._native._lockfast import lease_state

            self.now = functools.partial(lease_state, self.words.ctypes.data, -1, self.limit_ns)

    def detach(self) -> None:
        """Keep a private copy of the words (their node-local file is closing)."""
        self.words = self.words.copy()
        self._bind()

    def now_ns(self) -> int:
        if type(self.clock) is Clock:
            return time.monotonic_ns()
        return int(self.clock.now() * 1e9)

    def joined(self, epoch: int) -> None:
        """The node (re)joined as ``epoch``: a fresh lease from now."""
        words = self.words
        words[BEATEN] = self.now_ns()
        words[CURRENT] = epoch
        words[LATE_BEAT] = 0

    def state(self, epoch: int, now_ns: int | None = None) -> int:
        """`HELD`, or why the lease of this process's incarnation ``epoch``
        is not held now (`LATE`, `LAPSED`, `REJOINED`)."""
        words = self.words
        now = self.now_ns() if now_ns is None else now_ns
        if int(words[CURRENT]) != epoch:
            return REJOINED
        if words[LATE_BEAT]:
            return LAPSED
        if now - int(words[BEATEN]) > self.limit_ns:
            return LATE
        return HELD

    def check(self, node: int, epoch: int, what: str) -> None:
        """Raise `LeaseLost` unless the lease is held: ``what`` is not written."""
        state = self.now(epoch)
        if state != HELD:
            raise LeaseLost(f"node {node} (epoch {epoch}) does not write {what}: "
                            f"{_VERDICTS[state]} ({self.age():.3f} s since its last good beat; "
                            f"lease {2 * self.limit_ns / 1e9:g} s); its next operation rejoins "
                            f"under a new epoch")

    def age(self) -> float:
        """Seconds since the node's last good beat."""
        return (self.now_ns() - int(self.words[BEATEN])) / 1e9

    def beat(self, nodes: NodeTable, node: int) -> bool:
        """The heartbeat step: beat ``node`` unless the beat is late (then
        mark the node lapsed and write nothing); whether it beat."""
        words = self.words
        now = self.now_ns()
        if words[LATE_BEAT]:
            return False
        if now - int(words[BEATEN]) > self.limit_ns:
            words[LATE_BEAT] = 1
            return False
        nodes.beat(node)
        if now > int(words[BEATEN]):
            words[BEATEN] = now
        return True
