"""Two-tier cross-host lock (TraCT), with a manager-less mode and leases.

Tier 1 is node-local: a robust process-shared mutex per lock in a small
node-local file, so at most one process per node competes across hosts; a
holder that dies is reported (EOWNERDEAD) to the next process, which drops
the dead holder's tier-2 claim before going on.

Tier 2 arbitrates between nodes over pool memory, in one of three modes:

``manager`` (TraCT)
    Each node has a request line per lock (``req_seq``, ``done_seq``,
    ``wait_seq``, ``ack``); the manager has a grant line per lock (holder,
    state, request seq, lock epoch, manager epoch, check word: a line is
    written field by field and may be evicted between two stores, so readers
    retry a line whose check word does not match).  A node announces a request by
    bumping ``req_seq``, flushes and fences, then reads the grant line of the
    current manager.  Grants are *sticky*: a holder that released keeps the
    grant until another node asks, so an uncontended re-acquire touches only
    its own request line and the grant line.  The manager takes a lock back
    from a holder h that is idle or back in on its sticky grant (never from
    one that has yet to use a fresh grant: that would livelock): it first
    marks the grant REVOKING, fences, and only then reads h's request line:
    h is outside when ``req_seq == done_seq``, or when h waits for a fresh
    grant (``wait_seq == req_seq`` and the grant was made for an older
    request).  Both sides write, flush, fence, then read the other's
    line, so at least one sees the other (Dekker).  Grants rotate round-robin
    among waiting nodes.  Each candidate manager node writes only its own
    grant lines; the manager line names the current manager and its epoch and
    is written only by a node holding the internal election lock (bakery).
    A standby takes over when the manager's heartbeat is stale; nodes follow
    the manager line, so a stale manager's writes reach nobody.  When a
    manager process exits, another process of its node takes over: it
    rewrites the node's grant lines, then names the new epoch in the
    manager line; a holder that checks in between sees the two epochs
    differ and reads again (a take-over under way, not a lost grant).  A new
    manager trusts nothing its predecessor wrote: it grants nothing until
    every node is outside (``req_seq == done_seq``) or has written the new
    manager epoch into ``ack`` while waiting — a node inside never polls.

``bakery``
    Lamport's bakery over per-node lines (choosing, number): no manager, no
    single point of failure.  Waiters skip nodes whose lease lapsed.

``atomic``
    Compare-and-swap on a lock word; only for pools declared
    ``coherence="hardware"``.

Releasing fences first, so the flushes a holder issued complete before any
other node can see the lock free: code under a lock flushes what it wrote
and leaves the fence to the release (R3).  Every grant carries an epoch, a
fencing token: code working under a lock calls ``check()`` before it
publishes, which raises `LeaseLost` if another
node has since been granted the lock (R6).

A node's new incarnation drops what its last one left in every lock
(`LockSpace.forget_node`: requests done, tickets zero); fsck's check of the
lock area is `LockSpace.check`.

Rules relied on (DESIGN.md): R2 — every line has one writer at a time
(request and bakery lines: their node; grant lines: their manager node;
manager and epoch lines: the holder of the lock that guards them);
R3 — every store others read is flushed and fenced before anything that
depends on it; R4 — every line another host writes is invalidated and
fenced before it is read, also in every polling iteration; R5 — holder
nodes, states and epochs read from the pool are range-checked; R6 — leases
(`tract.lease`).
"""

from __future__ import annotations

import dataclasses
import functools
import typing

import numpy as np

from tract.errors import ConfigError, CorruptionError, LeaseLost, LockTimeout
from tract.lease import Backoff, Clock, Liveness, NodeTable
from tract.lines import LINE, MASK64, check_word
from tract import _failpoints as faults

__all__ = ["COHORT_PASSES", "Cohort", "LOCK_MODES", "Lock", "LockLayout", "LockManager",
           "LockSpace"]

LOCK_MODES = ("manager", "bakery", "atomic")
COHORT_PASSES = 64  # local hand-offs of a grant before the node gives it back
GRANT_TAG = 0x5152_4143_5447_524E  # seeds a grant line's check word

# grant states
NONE, GRANTED, REVOKING = 0, 1, 2
GRANT_STATES = (NONE, GRANTED, REVOKING)


@dataclasses.dataclass(frozen=True)
class LockLayout:
    """Where each lock's lines are, from ``offset`` in the pool.

    One manager line, then per lock (plus one internal election lock): an
    epoch line, an atomic word line, ``max_nodes`` grant lines (one per
    potential manager), ``max_nodes`` request lines and ``max_nodes`` bakery
    lines.
    """

    offset: int
    max_nodes: int
    max_locks: int

    @property
    def election(self) -> int:
        """Index of the internal lock that guards the manager line."""
        return self.max_locks

    @functools.cached_property
    def per_lock(self) -> int:
        return (2 + 3 * self.max_nodes) * LINE

    @property
    def nbytes(self) -> int:
        return LINE + (self.max_locks + 1) * self.per_lock

    @property
    def manager_line(self) -> int:
        return self.offset

    def _base(self, lock: int) -> int:
        return self.offset + LINE + lock * self.per_lock

    def epoch_line(self, lock: int) -> int:
        return self._base(lock)

    def word_line(self, lock: int) -> int:
        return self._base(lock) + LINE

    def grant_line(self, lock: int, manager: int) -> int:
        return self._base(lock) + (2 + manager) * LINE

    def request_line(self, lock: int, node: int) -> int:
        return self._base(lock) + (2 + self.max_nodes + node) * LINE

    def bakery_line(self, lock: int, node: int) -> int:
        return self._base(lock) + (2 + 2 * self.max_nodes + node) * LINE


class LockSpace:
    """Everything one node needs to take locks in one pool: the region, the
    layout, its node id, the node table, a clock and its view of leases."""

    def __init__(self, region, layout: LockLayout, nodes: NodeTable, node: int,
                 lease_timeout: float, clock: Clock | None = None,
                 liveness: Liveness | None = None):
        if not 0 <= node < layout.max_nodes:
            raise ConfigError(f"node {node} is outside 0..{layout.max_nodes - 1}")
        self.region = region
        self.layout = layout
        self.nodes = nodes
        self.node = node
        self.clock = clock or Clock()
        self.lease_timeout = lease_timeout
        # one view of the leases per process (`tract.pool.Pool` shares it with its
        # lock manager): a node the manager judged stale is stale to every step
        self.liveness = liveness or Liveness(nodes, self.clock, lease_timeout)
        self._last_beat = self.clock.now()
        self.own = None  # this node's `tract.lease.OwnLease`: beats go through it
        self.fencing = None  # the pool's self-fence (`tract.pool.Pool.self_fence`), if on

    def backoff(self) -> Backoff:
        return Backoff(self.clock)

    def keep_alive(self) -> None:
        """Beat when a quarter lease has passed (waiters call this, so a node
        stuck waiting keeps its place even without a heartbeat thread).  A
        waiter whose own lease lapsed (fencing on) gets `LeaseLost`: no node
        gives a stale one its turn (R6), and it would write nothing under
        it anyway."""
        now = self.clock.now()
        if now - self._last_beat >= self.lease_timeout / 4:
            if self.own is not None:
                self.own.beat(self.nodes, self.node)  # a late beat is not a beat
            else:
                self.nodes.beat(self.node)
            self._last_beat = now
        if self.fencing is not None:
            self.fencing("a wait for a lock")

    def self_fence(self, what: str) -> None:
        """Raise `LeaseLost` when this node's own lease lapsed (R6): ``what``
        depends on a claim and is not written."""
        if self.fencing is not None:
            self.fencing(what)

    def fresh(self, *lines: int) -> None:
        """Invalidate lines another host writes, then one fence (R4)."""
        for line in lines:
            self.region.invalidate(line, LINE)
        self.region.fence()

    def publish(self, line: int) -> None:
        """Flush a line this host wrote, then fence (R3)."""
        self.region.flush(line, LINE)
        self.region.fence()

    def release(self, line: int, fields: dict[int, int]) -> None:
        """Leave a lock by writing ``fields`` (offset in ``line`` -> value):
        a fence first, so every flush the holder issued completes before any
        other node can see the lock free (R3), then write and publish."""
        self.region.fence()
        for field, value in fields.items():
            self.region.store_u64(line + field, value)
        self.publish(line)

    def holder_field(self, value: int, where: str, offset: int) -> int | None:
        """Decode a stored ``node + 1`` (0 = nobody), range-checked (R5)."""
        if value == 0:
            return None
        if value > self.layout.max_nodes:
            raise CorruptionError(f"{where} at offset {offset} names node {value - 1}; the "
                                  f"pool has {self.layout.max_nodes} nodes")
        return value - 1

    def timeout(self, name: str, holder: int | None, epoch: int, waited: float) -> LockTimeout:
        who = "nobody (no live grant)" if holder is None else f"node {holder}"
        return LockTimeout(f"lock {name!r} not acquired after {waited:.3f} s: held by {who}, "
                           f"epoch {epoch}")

    def forget_node(self, node: int) -> None:
        """Drop the claims a past incarnation of ``node`` left in every lock
        (the internal election lock included), as its new incarnation
        joins: each request line and bakery ticket is read fresh (R4: the
        last incarnation may have run on another host, and a line written in
        part is written back whole), the request made done and not waiting
        at its last request seq, the ticket zeroed, and each line published
        (R3) before the next.  Only ``node`` writes these lines (R2)."""
        layout, region = self.layout, self.region
        for lock in range(layout.max_locks + 1):
            request, ticket = layout.request_line(lock, node), layout.bakery_line(lock, node)
            self.fresh(request, ticket)  # the last incarnation may have run on another host
            seq = region.load_u64(request)
            region.store_u64(request + 8, seq)  # done
            region.store_u64(request + 16, seq)  # not waiting
            self.publish(request)
            region.store_u64(ticket, 0)
            region.store_u64(ticket + 8, 0)
            self.publish(ticket)

    def check(self) -> list[tuple[int, str]]:
        """(offset, problem) of every line of the lock area that is not
        whole or names what the pool does not have, for fsck: the whole
        area is read fresh (R4, one fence), then (R5) the manager line must
        name a node of the pool, and every grant line ever written must be
        whole by its check word and name a holder of the pool and a grant
        state."""
        layout, region = self.layout, self.region
        region.invalidate(layout.offset, layout.nbytes)
        region.fence()
        found = []
        manager = region.load_u64(layout.manager_line)
        if manager > layout.max_nodes:
            found.append((layout.manager_line, f"manager line names node {manager - 1}"))
        for lock in range(layout.max_locks + 1):
            for owner in range(layout.max_nodes):
                grant = layout.grant_line(lock, owner)
                *fields, check = region.load_u64s(grant, 6)
                if not any(fields) and not check:
                    continue  # never written
                if check != grant_check(fields):
                    found.append((grant, f"grant line of lock {lock} by manager {owner} is "
                                  f"torn (check word)"))
                elif fields[1] not in GRANT_STATES or fields[0] > layout.max_nodes:
                    found.append((grant, f"grant line of lock {lock} by manager {owner} has "
                                  f"holder {fields[0] - 1}, state {fields[1]}"))
        return found


# ------------------------------------------------------------------- bakery

class BakeryLock:
    """Lamport's bakery across nodes; the lock epoch lives in the epoch line,
    written only by the holder."""

    def __init__(self, space: LockSpace, lock: int, name: str):
        self.space, self.lock, self.name = space, lock, name
        self.epoch = 0

    def _ticket(self, node: int) -> tuple[int, int]:
        return self.space.region.load_u64s(self.space.layout.bakery_line(self.lock, node), 2)

    def acquire(self, timeout: float | None = None) -> int:
        space, region, me = self.space, self.space.region, self.space.node
        layout = space.layout
        mine = layout.bakery_line(self.lock, me)
        others = {n: layout.bakery_line(self.lock, n) for n in range(layout.max_nodes) if n != me}
        start = space.clock.now()
        region.store_u64(mine, 1)  # choosing
        space.publish(mine)
        space.fresh(*others.values())
        number = 1 + max((self._ticket(n)[1] for n in others), default=0)
        region.store_u64(mine + 8, number)
        space.publish(mine)
        region.store_u64(mine, 0)
        space.publish(mine)
        space.fresh(*others.values())  # every ticket read after our doorway, one fence
        for other, line in others.items():
            backoff = space.backoff()
            while True:
                choosing, theirs = self._ticket(other)
                if not choosing and (theirs == 0 or (theirs, other) > (number, me)):
                    break
                if not space.liveness.live(other):
                    break  # a stale node loses its place in line (R6)
                if timeout is not None and space.clock.now() - start > timeout:
                    self._withdraw()
                    holder, epoch = self.holder()
                    raise space.timeout(self.name, holder, epoch, space.clock.now() - start)
                try:
                    space.keep_alive()
                except LeaseLost:
                    self._withdraw()
                    raise
                backoff.wait()
                space.fresh(line)
        epoch_line = layout.epoch_line(self.lock)
        space.fresh(epoch_line)
        self.epoch = (region.load_u64(epoch_line) + 1) & MASK64
        region.store_u64(epoch_line, self.epoch)
        region.store_u64(epoch_line + 8, me + 1)
        space.publish(epoch_line)
        return self.epoch

    def _withdraw(self) -> None:
        self.space.release(self.space.layout.bakery_line(self.lock, self.space.node),
                           {0: 0, 8: 0})

    release = _withdraw
    repair = _withdraw

    def holder(self) -> tuple[int | None, int]:
        line = self.space.layout.epoch_line(self.lock)
        self.space.fresh(line)
        holder = self.space.holder_field(self.space.region.load_u64(line + 8),
                                         f"epoch line of lock {self.name!r}", line + 8)
        return holder, self.space.region.load_u64(line)

    def check(self) -> None:
        holder, epoch = self.holder()
        if holder != self.space.node or epoch != self.epoch:
            raise LeaseLost(f"lock {self.name!r}: node {self.space.node}'s grant (epoch "
                            f"{self.epoch}) was taken over by node {holder} (epoch {epoch})")


# ------------------------------------------------------------------ manager

class Grant(typing.NamedTuple):
    holder: int | None
    state: int
    seq: int
    epoch: int
    manager_epoch: int


def read_manager(space: LockSpace) -> tuple[int | None, int]:
    """(manager node, manager epoch) as this host sees the manager line now."""
    line = space.layout.manager_line
    holder_field, epoch = space.region.load_u64s(line, 2)
    return space.holder_field(holder_field, "manager line", line), epoch


def grant_check(fields) -> int:
    """The check word over a grant line's five fields, stored last
    (`tract.lines`)."""
    return check_word(GRANT_TAG, fields)


def _read_grant(space: LockSpace, line: int) -> Grant | None:
    """The grant line at ``line``, or None while it is torn (its writer is
    mid-update)."""
    *fields, check = space.region.load_u64s(line, 6)
    if check != grant_check(fields):
        return None
    holder_field, state, seq, epoch, manager_epoch = fields
    if state not in GRANT_STATES:
        raise CorruptionError(f"grant line at offset {line} has state {state}")
    return Grant(space.holder_field(holder_field, "grant line", line), state, seq, epoch,
                 manager_epoch)


class ManagedLock:
    """The node side of manager mode (see the module docstring)."""

    def __init__(self, space: LockSpace, lock: int, name: str):
        self.space, self.lock, self.name = space, lock, name
        self.epoch = 0
        self._request = space.layout.request_line(lock, space.node)
        self._grant_lines = [space.layout.grant_line(lock, manager)
                             for manager in range(space.layout.max_nodes)]
        self._fresh_lines = [space.layout.manager_line]  # + the last manager's grant line

    def _current(self) -> tuple[int | None, int, Grant | None]:
        """Fresh manager line and that manager's grant line, one fence when
        the manager is the one seen last time."""
        space = self.space
        space.fresh(*self._fresh_lines)
        manager, manager_epoch = read_manager(space)
        if manager is None:
            return None, manager_epoch, None
        line = self._grant_lines[manager]
        if self._fresh_lines[1:] != [line]:
            self._fresh_lines = [space.layout.manager_line, line]
            space.fresh(line)
        return manager, manager_epoch, _read_grant(space, line)

    def announce(self) -> int:
        """Bump and publish this node's request seq (R3); returns it."""
        region, request = self.space.region, self._request
        seq = (region.load_u64(request) + 1) & MASK64
        region.store_u64(request, seq)
        self.space.publish(request)
        return seq

    def attempt(self, seq: int, first: bool) -> tuple[bool, Grant | None, int]:
        """Look once for this node's grant: (granted, grant line, manager
        epoch).  The first look after the announce also takes a sticky grant
        made for an earlier request; later ones only a grant for ``seq``."""
        _, manager_epoch, grant = self._current()
        if (grant is not None and grant.manager_epoch == manager_epoch
                and grant.holder == self.space.node and grant.state == GRANTED
                and (first or grant.seq == seq)):
            self.epoch = grant.epoch
            return True, grant, manager_epoch
        return False, grant, manager_epoch

    def acquire(self, timeout: float | None = None, seq: int | None = None) -> int:
        """Take tier 2.  ``seq``: a request already announced (by the native
        fast path), whose first look found no grant."""
        space = self.space
        start = space.clock.now()
        if seq is None:
            seq = self.announce()
        # sleeps of at most 50 us: a grant made while its node sleeps idles
        # (1 ms sleeps made a cross-node hand-off cost about 640 us)
        backoff = Backoff(space.clock, spins=16, yields=16, max_sleep=5e-5)
        first = True
        while True:
            granted, grant, manager_epoch = self.attempt(seq, first)
            if granted:
                return self.epoch
            self._say_waiting(self._request, seq, grant, manager_epoch, first)
            first = False
            if timeout is not None and space.clock.now() - start > timeout:
                self.release()
                holder = grant.holder if grant is not None else None
                raise space.timeout(self.name, holder, grant.epoch if grant else 0,
                                    space.clock.now() - start)
            try:
                space.keep_alive()
            except LeaseLost:  # withdrawn, as after a timeout
                self.release()
                raise
            backoff.wait()

    def _say_waiting(self, request: int, seq: int, grant: Grant | None, manager_epoch: int,
                     first: bool) -> None:
        """Tell the manager this request waits outside: ``wait_seq`` once, and
        the manager epoch it saw (``ack``, which a new manager waits for)."""
        region = self.space.region
        updates = {}
        if first:
            updates[16] = seq
        if (grant is not None and grant.manager_epoch == manager_epoch
                and region.load_u64(request + 24) != manager_epoch):
            updates[24] = manager_epoch
        for field, value in updates.items():
            region.store_u64(request + field, value)
        if updates:
            self.space.publish(request)

    def release(self) -> None:
        seq = self.space.region.load_u64(self._request)  # done and not waiting
        self.space.release(self._request, {8: seq, 16: seq})

    repair = release

    def still_granted(self) -> bool:
        """Whether this node's grant stands unrevoked under the current
        manager (what a releasing process needs to hand it on locally)."""
        _, manager_epoch, grant = self._current()
        return (grant is not None and grant.manager_epoch == manager_epoch
                and grant.holder == self.space.node and grant.state == GRANTED
                and grant.epoch == self.epoch)

    def holder(self) -> tuple[int | None, int]:
        _, _, grant = self._current()
        return (None, 0) if grant is None else (grant.holder, grant.epoch)

    def check(self) -> None:
        space = self.space
        start, backoff = space.clock.now(), space.backoff()
        _, manager_epoch, grant = self._current()
        # Torn (its writer is mid-update), or of another manager epoch than
        # the manager line: a take-over by another process of the manager's
        # node rewrites these same grant lines before the manager line.
        while ((grant is None or grant.manager_epoch != manager_epoch)
               and space.clock.now() - start < space.lease_timeout):
            backoff.wait()
            _, manager_epoch, grant = self._current()
        if grant is None or grant.manager_epoch != manager_epoch:
            held = False
        elif grant.holder is None:
            # A new manager took over and waits for every node to be outside:
            # it has granted nobody since its predecessor's grant to us.
            held = grant.state == REVOKING and grant.epoch == (self.epoch + 1) & MASK64
        else:
            held = (grant.holder == space.node and grant.epoch == self.epoch
                    and grant.state != NONE)
        if not held:
            raise LeaseLost(f"lock {self.name!r}: node {self.space.node}'s grant (epoch "
                            f"{self.epoch}) is gone: {grant}")


# ---------------------------------------------------------------- cohorting

#: a lock's slot in the node-local file: its tier-1 mutex's line, then the
#: cohort line's words (byte offsets; `tract._native._lockfast` has the same)
SLOT_BYTES = 128
HELD, WAITERS, PASSES = 64, 72, 80
PASSES_PER_CHECK = 8  # local hand-offs between two reads of the grant line
ACQUIRED, OWNER_DIED, ANNOUNCED = 0, 1, 2  # what `Cohort.acquire` and `attempt` report
_ONE, _MINUS_ONE = np.array([1], np.uint64), np.array([MASK64], np.uint64)


class Cohort:
    """Lock cohorting (DESIGN.md §3), step by step: the reference of the
    native fast path `tract._native._lockfast.ManagerFastPath`, with the same
    interface (so `Lock` runs either), which runs under the simulator.

    The node-local slot (``local`` at ``slot``: one host's memory, so
    coherent) holds the tier-1 ``mutex``, then ``held`` (grant epoch + 1
    while this node's tier-2 hold is being handed to the next local holder,
    else 0), ``waiters`` (processes of the node blocked on the mutex; changed
    atomically) and ``passes`` (local hand-offs since the node last gave the
    grant back).  ``held`` and ``passes`` change only under the mutex (R2).
    A releasing process that sees a waiter and has made fewer than ``bound``
    passes keeps tier 2 and hands it over through the mutex, touching no pool
    memory; every `PASSES_PER_CHECK` passes it first reads the grant line
    (R4) and gives the grant back instead when it is revoking, lost, torn or
    bad (the fencing token is what guards the data: R6).  The bound keeps the
    other nodes from starving.  A hand-off nobody takes, and the hold of a
    process that died holding tier 1, are given back by `sweep`, which the
    heartbeat runs.
    """

    def __init__(self, space: LockSpace, lock: int, name: str, local, slot: int, mutex,
                 bound: int = COHORT_PASSES):
        if bound < 0:
            raise ConfigError(f"lock {name!r}: the cohort bound {bound} is negative")
        local.load_u64s(slot, SLOT_BYTES // 8)  # the slot lies inside the mapping
        self.tier2 = ManagedLock(space, lock, name)
        self.local, self.slot, self.mutex, self.bound = local, slot, mutex, bound
        self.seq = 0

    @property
    def epoch(self) -> int:
        return self.tier2.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.tier2.epoch = value

    def _word(self, word: int) -> int:
        return self.local.load_u64(self.slot + word)

    def _set(self, word: int, value: int) -> None:
        self.local.store_u64(self.slot + word, value)

    def acquire(self, timeout: float | None = None) -> int:
        """Tier 1 (counted among the waiters while it blocks), then the hold
        handed over by the last local holder, or `attempt`.  TimeoutError
        when tier 1 stays busy ``timeout`` seconds."""
        died = self.mutex.try_acquire()
        if died is None:
            self.local.local_add_u64s(self.slot + WAITERS, _ONE)
            try:
                died = self.mutex.acquire(timeout)
            finally:
                self.local.local_add_u64s(self.slot + WAITERS, _MINUS_ONE)
        if died:
            return OWNER_DIED
        held = self._word(HELD)
        if held:
            self.epoch = held - 1
            self._set(HELD, 0)
            return ACQUIRED
        return self.attempt()

    def attempt(self) -> int:
        """Announce a request and look once for the grant (tier 1 held); a
        torn or bad line is left to `ManagedLock.acquire` (ANNOUNCED)."""
        self.seq = self.tier2.announce()
        try:
            granted, _, _ = self.tier2.attempt(self.seq, first=True)
        except CorruptionError:
            granted = False
        return ACQUIRED if granted else ANNOUNCED

    def still_granted(self) -> bool:
        """`ManagedLock.still_granted`, False for a torn or bad line too."""
        try:
            return self.tier2.still_granted()
        except CorruptionError:
            return False

    def release(self) -> None:
        """Hand tier 2 to a local waiter, or give it back; then tier 1."""
        passes = self._word(PASSES)
        keep = bool(self._word(WAITERS)) and passes < self.bound
        if keep and passes % PASSES_PER_CHECK == 0:
            keep = self.still_granted()
        if keep:
            self._set(PASSES, passes + 1)
            self._set(HELD, self.epoch + 1)
        else:
            self.repair()
        self.mutex.release()

    def repair(self) -> None:
        """Give tier 2 back and clear the slot (also after OWNER_DIED)."""
        self.tier2.release()
        self._set(HELD, 0)
        self._set(PASSES, 0)

    def sweep(self, stale: bool = True) -> bool:
        """Give back the tier-2 hold of a local process that died holding
        tier 1 (no other may take the lock again, and the pool would wait on
        this node for ever), or, when ``stale``, a hand-off no local process
        took.  True if it did."""
        died = self.mutex.try_acquire()
        if died is None:
            return False
        swept = died or (stale and self._word(HELD) != 0)
        if swept:
            self.repair()
        if died:
            self.mutex.consistent()
        self.mutex.release()
        return swept

    def slot_words(self) -> tuple[int, int, int]:
        """(held, waiters, passes) as this node sees them."""
        return self._word(HELD), self._word(WAITERS), self._word(PASSES)


@dataclasses.dataclass
class _Granting:
    """The manager's own copy of one of its grant lines."""

    holder: int | None
    state: int
    seq: int
    epoch: int


class LockManager:
    """Grants manager-mode locks.  Any node may run one; the one named in the
    manager line is active, the others stand by and take over when its lease
    lapses (under the internal election lock)."""

    def __init__(self, space: LockSpace, locks: int, local=None):
        """``local``: the node-local mutex that lets one process per node
        manage (the grant lines are the node's); None when this process is
        the node's only one."""
        self.space = space
        self.local = local
        self._local_held = local is None
        self.locks = locks
        self.manager_epoch = 0
        self.active = False
        self.deferred = False  # another process of this node manages
        self.failure: CorruptionError | None = None  # the last step that read a corrupt line
        self.writes = 0  # grant lines written: a step that wrote none changed nothing
        self._grants: list[_Granting] = []
        self._next = [0] * locks  # round-robin position per lock
        self._election = BakeryLock(space, space.layout.election, "<manager election>")

    # ------------------------------------------------------------ election

    def _take_over(self) -> bool:
        space = self.space
        self._election.acquire(timeout=space.lease_timeout)
        try:
            space.fresh(space.layout.manager_line)
            manager, epoch = read_manager(space)
            if manager is not None and manager != space.node and space.liveness.live(manager):
                return False
            previous = manager
            self.manager_epoch = (epoch + 1) & MASK64
            self._grants = []
            for lock in range(self.locks):
                # Trust nothing of the last manager's (it may have died mid-
                # write): REVOKING from nobody in particular, until every
                # node is outside or has seen this manager while waiting.
                last_epoch = 0
                if previous is not None:
                    line = space.layout.grant_line(lock, previous)
                    space.fresh(line)
                    last_epoch = space.region.load_u64(line + 24)
                grant = _Granting(None, REVOKING, 0, (last_epoch + 1) & MASK64)
                self._grants.append(grant)
                self._write(lock)
            line = space.layout.manager_line
            space.region.store_u64(line, space.node + 1)
            space.region.store_u64(line + 8, self.manager_epoch)
            space.publish(line)
            self.active = True
            return True
        finally:
            self._election.release()

    def _still_manager(self) -> bool:
        space = self.space
        space.fresh(space.layout.manager_line)
        manager, epoch = read_manager(space)
        return manager == space.node and epoch == self.manager_epoch

    # ------------------------------------------------------------- granting

    def _write(self, lock: int) -> None:
        grant, space = self._grants[lock], self.space
        space.self_fence(f"the grant line of lock {lock}")  # a lapsed manager grants nothing
        self.writes += 1
        line = space.layout.grant_line(lock, space.node)
        fields = [0 if grant.holder is None else grant.holder + 1, grant.state, grant.seq,
                  grant.epoch, self.manager_epoch]
        for index, value in enumerate(fields):
            space.region.store_u64(line + 8 * index, value)
        space.region.store_u64(line + 40, grant_check(fields))
        space.publish(line)

    def _requests(self, lock: int) -> list[tuple[int, int, int, int]]:
        """(req_seq, done_seq, wait_seq, ack) of every node, fresh, one fence."""
        space, region = self.space, self.space.region
        lines = [space.layout.request_line(lock, n) for n in range(space.layout.max_nodes)]
        space.fresh(*lines)
        return [region.load_u64s(line, 4) for line in lines]

    def _outside(self, grant: _Granting, node: int, request) -> bool:
        """Whether ``node`` is certainly not inside the lock."""
        req, done, wait, ack = request
        if req == done:
            return True
        if grant.holder is None:  # after a take-over: it waits if it saw us
            return ack == self.manager_epoch or not self.space.liveness.live(node)
        return wait == req and grant.seq != req  # it waits for a newer grant

    def _grant_next(self, lock: int, requests, after: int | None) -> None:
        grant, space = self._grants[lock], self.space
        count = space.layout.max_nodes
        start = self._next[lock] if after is None else after + 1
        for step in range(count):
            node = (start + step) % count
            req, done = requests[node][:2]
            if req != done and space.liveness.live(node):
                grant.holder, grant.state, grant.seq = node, GRANTED, req
                grant.epoch = (grant.epoch + 1) & MASK64
                self._next[lock] = (node + 1) % count
                faults.point("manager.grant")
                self._write(lock)
                return
        if grant.state != NONE:
            grant.holder, grant.state = None, NONE
            grant.epoch = (grant.epoch + 1) & MASK64
            self._write(lock)

    def _step_lock(self, lock: int) -> bool:
        """Advance one lock; True when some node is waiting for it."""
        grant = self._grants[lock]
        requests = self._requests(lock)
        holder = grant.holder
        waiting = [n for n, request in enumerate(requests)  # a stale node lost its place
                   if request[0] != request[1] and n != holder and self.space.liveness.live(n)]
        if grant.state == NONE:
            if waiting:
                self._grant_next(lock, requests, None)
            return bool(waiting)
        if holder is None:  # REVOKING after a take-over
            if all(self._outside(grant, n, r) for n, r in enumerate(requests)):
                self._grant_next(lock, requests, None)
            return True
        live = self.space.liveness.live(holder)
        if grant.state == GRANTED:
            req, done = requests[holder][:2]
            if live and not waiting:
                return False  # sticky: the holder keeps it
            if live and req != done and req == grant.seq:
                return True  # it has yet to use this grant, or uses it now
            if live:  # idle, or back in on the sticky grant: take it back
                grant.state = REVOKING
                self._write(lock)
                requests = self._requests(lock)  # re-read after the fence (Dekker)
        if not live or self._outside(grant, holder, requests[holder]):
            self._grant_next(lock, requests, holder)
        return True

    def step(self) -> bool:
        """One round: take over if needed, then advance every lock.  Returns
        True when something is waiting (the caller should not idle)."""
        space = self.space
        space.keep_alive()
        if self.active and not self._still_manager():
            self.active = False
        if not self.active:
            if not self._local_held:
                taken = self.local.try_acquire()
                if taken is None:
                    self.deferred = True
                    return False  # another process of this node manages
                if taken:  # that process died: its grants are re-taken below
                    self.local.consistent()
                self._local_held = True
            space.fresh(space.layout.manager_line)
            manager, _ = read_manager(space)
            if manager is None or manager == space.node or not space.liveness.live(manager):
                if not self._take_over():
                    return False
            else:
                return False
        return any([self._step_lock(lock) for lock in range(self.locks)])

    def run(self, stop) -> None:
        """Grant until ``stop.is_set()``; idle with bounded backoff.  A
        corrupt lock area (R5) stops no manager: the last such error is
        kept in ``failure``, and granting resumes once the lines read right
        again (``fsck --repair``)."""
        backoff = Backoff(self.space.clock, max_sleep=2e-4)
        try:
            while not stop.is_set():
                writes = self.writes
                try:
                    waiting = self.step()
                except CorruptionError as error:
                    self.failure, waiting = error, False
                    stop.wait(self.space.lease_timeout / 4)
                except LeaseLost:  # this node lapsed: a standby takes over; stand by
                    self.active, waiting = False, False
                if self.writes != writes:
                    backoff.reset()  # a grant moved: its next move follows soon
                elif waiting:
                    # a node waits on a holder: look again soon, but give the core
                    # to that holder first (a manager that spun here took a whole
                    # core of two from the nodes it serves)
                    backoff.reset()
                    self.space.clock.sleep(0)
                else:
                    backoff.wait()
        finally:
            if self.local is not None and self._local_held:
                self._local_held = self.active = False
                self.local.release()


# ------------------------------------------------------------------- atomic

class AtomicLock:
    """Compare-and-swap on a lock word ``epoch << 16 | (holder + 1)``; only on
    pools declared coherent, where no flush is needed."""

    def __init__(self, space: LockSpace, lock: int, name: str):
        self.space, self.lock, self.name = space, lock, name
        self.epoch = 0
        self._word = 0

    def _decode(self, word: int) -> tuple[int | None, int]:
        line = self.space.layout.word_line(self.lock)
        return self.space.holder_field(word & 0xFFFF, f"lock word {self.name!r}", line), word >> 16

    def acquire(self, timeout: float | None = None) -> int:
        space, me = self.space, self.space.node
        line = space.layout.word_line(self.lock)
        start = space.clock.now()
        backoff = space.backoff()
        while True:
            word = space.region.load_u64(line)
            holder, epoch = self._decode(word)
            if holder is None or (holder != me and not space.liveness.live(holder)):
                desired = (((epoch + 1) & 0xFFFF_FFFF_FFFF) << 16) | (me + 1)
                if space.region.compare_exchange_u64(line, word, desired) == word:
                    self._word, self.epoch = desired, desired >> 16
                    return self.epoch
                continue
            if timeout is not None and space.clock.now() - start > timeout:
                raise space.timeout(self.name, holder, epoch, space.clock.now() - start)
            space.keep_alive()
            backoff.wait()

    def release(self) -> None:
        line = self.space.layout.word_line(self.lock)
        self.space.region.compare_exchange_u64(line, self._word, self._word & ~0xFFFF)

    def repair(self) -> None:
        line = self.space.layout.word_line(self.lock)
        word = self.space.region.load_u64(line)
        if self._decode(word)[0] == self.space.node:
            self.space.region.compare_exchange_u64(line, word, word & ~0xFFFF)

    def holder(self) -> tuple[int | None, int]:
        return self._decode(self.space.region.load_u64(self.space.layout.word_line(self.lock)))

    def check(self) -> None:
        word = self.space.region.load_u64(self.space.layout.word_line(self.lock))
        if word != self._word:
            holder, epoch = self._decode(word)
            raise LeaseLost(f"lock {self.name!r}: node {self.space.node}'s grant (epoch "
                            f"{self.epoch}) was taken over by node {holder} (epoch {epoch})")


TIER2 = {"manager": ManagedLock, "bakery": BakeryLock, "atomic": AtomicLock}


# ----------------------------------------------------------------- two-tier

class Lock:
    """A named two-tier lock: ``with pool.lock("name"): ...``.

    Tier 1 (``local``, a `tract._native._localmutex.LocalMutex`, or None when
    this process is the node's only one, as under the simulator) then tier 2.
    ``fast``: for manager mode with a tier-1 mutex, tier 1 and tier 2 with
    cohorting (the grant handed to the node's next process): the native fast
    path (`tract._native._lockfast.ManagerFastPath`) or its reference,
    `Cohort`.  ``epoch`` is the fencing token of
    the current grant; call ``check()`` before publishing work done under the
    lock.
    """

    def __init__(self, space: LockSpace, mode: str, lock: int, name: str, local=None,
                 fast=None, waited=None):
        if mode not in TIER2:
            raise ConfigError(f"lock mode must be one of {LOCK_MODES}, got {mode!r}")
        if mode == "atomic" and space.region.cache_control.coherence != "hardware":
            raise ConfigError(f"lock mode 'atomic' needs a pool declared coherence='hardware'; "
                              f"lock {name!r} is in a pool with coherence="
                              f"{space.region.cache_control.coherence!r}")
        if fast is not None and (mode != "manager" or local is None):
            raise ConfigError(f"lock {name!r}: the native fast path is for manager mode "
                              f"with a tier-1 mutex (mode {mode!r})")
        self.name = name
        self.mode = mode
        self.global_lock = TIER2[mode](space, lock, name)
        self.local = local
        self.fast = fast
        self.waited = waited  # called with the seconds an acquire waited for the grant
        self._timeout: float | None = None

    @property
    def epoch(self) -> int:
        return self.global_lock.epoch if self.fast is None else self.fast.epoch

    def _local_timeout(self, timeout: float | None) -> LockTimeout:
        return LockTimeout(f"lock {self.name!r} not acquired after {timeout} s: another "
                           f"process of this node holds it")

    def acquire(self, timeout: float | None = None) -> int:
        """Take the lock; returns its epoch.  Raises `LockTimeout` after
        ``timeout`` seconds, naming the holder."""
        fast = self.fast
        if fast is None:
            epoch = self._acquire(timeout)
        else:  # the native fast path, inline: its uncontended acquire is a few round trips
            start = None if timeout is None else self.global_lock.space.clock.now()
            try:
                outcome = fast.acquire(timeout)
            except TimeoutError:
                raise self._local_timeout(timeout) from None
            if outcome == ACQUIRED:
                epoch = fast.epoch
            else:
                began = self.global_lock.space.clock.now()
                epoch = self._acquire_slow(outcome, timeout, start)
                if self.waited is not None:
                    self.waited(self.global_lock.space.clock.now() - began)
        if faults.ARMED is not None:  # the call skipped: the uncontended path is ~1 µs
            faults.point("lock.acquired")
        return epoch

    def _acquire(self, timeout: float | None) -> int:
        clock = self.global_lock.space.clock
        start = clock.now()
        if self.local is not None:
            try:
                if self.local.acquire(timeout):
                    # The previous holder on this node died: drop its claim.
                    self.global_lock.repair()
                    self.local.consistent()
            except TimeoutError:
                raise self._local_timeout(timeout) from None
        try:
            began = clock.now()
            left = None if timeout is None else max(0.0, timeout - (began - start))
            epoch = self.global_lock.acquire(left)
            if self.waited is not None:
                self.waited(clock.now() - began)
            return epoch
        except BaseException:
            if self.local is not None:
                self.local.release()
            raise

    def _acquire_slow(self, outcome: int, timeout: float | None, start: float | None) -> int:
        """After the fast path took tier 1 but found no grant, or a dead
        holder's state: the reference protocol, from the announced seq."""
        fast, clock = self.fast, self.global_lock.space.clock
        try:
            if outcome == OWNER_DIED:
                fast.repair()  # the dead holder's claim and hand-off
                self.local.consistent()
                if fast.attempt() == ACQUIRED:
                    return fast.epoch
            left = None if timeout is None else max(0.0, timeout - (clock.now() - start))
            fast.epoch = self.global_lock.acquire(left, seq=fast.seq)
            return fast.epoch
        except BaseException:
            fast.repair()
            self.local.release()
            raise

    def release(self) -> None:
        if faults.ARMED is not None:
            faults.point("lock.release")
        if self.fast is not None:
            self.fast.release()
            return
        try:
            self.global_lock.release()
        finally:
            if self.local is not None:
                self.local.release()

    def check(self) -> None:
        """Raise `LeaseLost` unless this node still holds the lock, and its
        own lease (a node may not know yet that its grant is revoked)."""
        self.global_lock.space.self_fence(f"under lock {self.name!r}")
        if self.fast is not None:
            if self.fast.still_granted():  # the common case, natively
                return
            self.global_lock.epoch = self.fast.epoch
        self.global_lock.check()

    def holder(self) -> tuple[int | None, int]:
        """(holder node or None, epoch) as the pool says now."""
        return self.global_lock.holder()

    def __call__(self, timeout: float | None) -> Lock:
        self._timeout = timeout
        return self

    def __enter__(self) -> Lock:
        timeout, self._timeout = self._timeout, None
        self.acquire(timeout)
        return self

    def __exit__(self, *exc) -> None:
        self.release()
