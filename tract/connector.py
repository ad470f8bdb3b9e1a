"""The engine-agnostic connector: a rack-wide prefix cache and P/D handoff
over one pool, for one engine worker process (the vLLM and SGLang adapters
only translate to it).

Prefix cache
    `lookup` (tokens or block hashes) says how many leading tokens the pool
    holds; `load` pins the leading hits, copies them into the engine's
    blocks and unpins; `store` reserves the absent blocks, copies them and
    publishes them.  A block that is evicted, being written, written by a
    writer that died, or whose checksum fails is a miss: the counts returned
    are of leading good blocks, so the engine recomputes from the first bad
    one.

P/D handoff
    The prefill side `offer`s a request: its blocks are stored and pinned by
    the prefill node, and a *handoff record* (`tract.handoff`: the keys, a
    deadline, a random nonce, a check word) is written to memory the prefill
    process allocates; `offer` returns a *ticket* (the record's offset and
    nonce, a short string) for the engine to pass to the decode side with
    the request (vLLM: ``kv_transfer_params``).  The decode side `take`s
    it: reads and checks the record, pins the blocks (its own pins), loads
    them, marks the record taken and unpins.  No lock and no shared
    directory is involved: one writer per line (the producer writes the
    record, decoders only its *taken* line).  The prefill side's `release`
    (called by the cache operations every `RELEASE_EVERY` seconds, and by
    the engine when it likes) drops the pins of taken or expired offers; a
    record's memory is freed a lease after its deadline, since a decoder
    marks it taken only before the deadline.  A decode worker that never
    comes costs pins for one TTL; a prefill worker that dies costs nothing
    more: pins of a dead node do not count (R6), and its records go with its
    memory.

Cluster tier
    With a ``tier`` (`tract.tier`: Mooncake Store below the rack), a rack
    miss falls to the cluster before the engine recomputes.  `lookup`
    counts the rack's leading hits, then the tier's longest further run;
    `load` fills the rack's hits from the pool and the next run from the
    tier, and *promotes* what the tier gave: stores it into the pool, so
    every node of the rack hits it next time.  Stores reach the tier by
    ``tier_policy``:

    - ``write_through`` (the default): `store` puts the blocks into the
      pool and into the tier.  The tier gets a copy of every stored block,
      so a rack that loses its pool, or evicts under pressure, loses
      nothing the cluster had, and no eviction (which runs inside some
      engine's store) waits on the network.
    - ``write_back``: `store` puts them into the pool only; when this
      process evicts for room, the evicted blocks of this layout are
      *demoted*: read fresh from the pool, checked against their
      checksums, and put into the tier before their memory is freed
      (`tract.index`'s demoters).  The network sees only what the rack
      lets go, but that eviction waits on the tier (at most its timeout),
      and a rack that loses its pool loses what it had not yet evicted.

    The tier's failures are misses (it never raises for them and bounds
    every call), and its checksums travel with its blocks.  Blocks on a
    CUDA device go to and from the tier through host copies.

Rules relied on: those of `tract.index` (pins, R3/R4 ordering of payloads
and entries), `tract.transfer` (payloads in memory before publish;
checksums) and `tract.handoff` (the records, their checks and their
lifetime); the connector itself touches no pool line.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import os
import tempfile
import threading
import time
import typing
import uuid
from collections.abc import Sequence

import numpy as np

from tract._kernels import bitmap
from tract.errors import LeaseLost, LockTimeout, PoolFull
from tract.handoff import NO_OFFER, HandoffRecords, format_ticket
from tract.hashing import BlockHasher
from tract.index import Hits
from tract.stats import COUNTERS
from tract import _failpoints as faults
from tract.tier import POLICIES, Tier, open_tier
from tract.transfer import KVLayout, TransferEngine

__all__ = ["NO_OFFER", "RELEASE_EVERY", "Connector", "Offer", "Stored", "Taken", "warm_up"]

log = logging.getLogger(__name__)

RELEASE_EVERY = 0.01  # seconds between the cache calls' checks of this process's offers


@dataclasses.dataclass
class Offer:
    """A request's blocks, pinned by the prefill node for the decode side."""

    request_id: str
    ticket: str
    hits: Hits
    deadline: float
    record: int  # pool offset of the handoff record
    nonce: int


class Stored(typing.NamedTuple):
    """What `Connector.store_each` did: ``published`` blocks copied and
    published now (``written[i]``: block ``i`` is one of them);
    ``kept[i]``: block ``i`` is in the pool after the call (published now,
    present already, or being written by another writer), false for a
    block not stored (counted in ``stats["not_stored"]``)."""

    published: int
    kept: np.ndarray
    written: np.ndarray


@dataclasses.dataclass(frozen=True)
class Taken:
    """What the decode side got of an offer: ``blocks`` leading blocks
    loaded (the rest are misses to recompute), of ``offered``."""

    blocks: int
    offered: int


class Connector:
    """One engine worker's view of the pool's KV cache."""

    def __init__(self, pool, layout: KVLayout, *, checksum: bool = True,
                 handoff_ttl: float = 30.0, salt: str | bytes | None = None,
                 timeout: float | None = 30.0, tier: Tier | str | None = None,
                 tier_policy: str = "write_through", load_threads: int | None = None):
        if tier_policy not in POLICIES:
            raise ValueError(f"tier_policy must be one of {POLICIES}, got {tier_policy!r}")
        if tier is not None and not isinstance(tier, (Tier, str)):
            raise ValueError(f"tier must be a tract.tier.Tier or its URL, got "
                             f"{type(tier).__name__}")
        self.pool, self.layout, self.index = pool, layout, pool.index
        self.transfer = TransferEngine(pool, layout, checksum=checksum,
                                       load_threads=load_threads)
        self.handoff = HandoffRecords(pool)
        self.hasher = BlockHasher(pool.header.hash_key, layout.block_size,
                                  namespace=layout.namespace(), salt=salt)
        if not (isinstance(handoff_ttl, (int, float)) and 0 < handoff_ttl < float("inf")):
            raise ValueError(f"handoff_ttl must be a positive number of seconds, got "
                             f"{handoff_ttl!r}")
        self.ttl, self.timeout, self.salt = handoff_ttl, timeout, salt
        self._digest_hasher: BlockHasher | None = None  # made by `digest_keys`
        self.offers: dict[str, Offer] = {}
        self._retired: list[tuple[float, int]] = []  # (free at, record offset) heap
        self._released = float("-inf")
        self._epoch = pool.epoch  # the incarnation its offers belong to
        #: this process's counts (the pool keeps its node's: `Pool.counters`)
        self.stats = dict.fromkeys([*COUNTERS, "expired"], 0)
        # a tier named by URL is this connector's own, its digests seeded
        # as the pool's checksums are (racks that share a tier share a key)
        self._own_tier = isinstance(tier, str)
        self.tier = open_tier(tier, seed=self.transfer.seed) if self._own_tier else tier
        self.tier_policy = tier_policy
        if self.tier is not None and tier_policy == "write_back":
            self.index.demoters.append(self._demote)

    def not_stored(self, blocks: int) -> None:
        """Count ``blocks`` that an engine asked to store and that were not
        (a queued save cancelled or timed out: `stats["not_stored"]`)."""
        self._count(not_stored=blocks)

    def _renew(self) -> None:
        """Before each operation: rejoin as a new incarnation when this
        node's lease lapsed (`tract.pool.Pool.renew`): the lapsed one's
        offers and pins went with it."""
        self.pool.renew()
        if self.pool.epoch != self._epoch:  # rejoined, here or by another caller
            self._epoch = self.pool.epoch
            self.stats["rejoins"] += 1
            # its records are in memory the lapsed incarnation held: another
            # node may hold it now, so they are not freed from here (R6)
            self.offers.clear()
            self._retired.clear()

    def _count_if_lapsed(self) -> None:
        """Count a call that lost a lock as ``fenced`` when the loss was
        this node's own lapsed lease (a stall), not a manager's take-over."""
        if not self.pool.lease_held():
            self._count(fenced=1)

    def _count(self, **deltas: int) -> None:
        for name, delta in deltas.items():
            self.stats[name] += delta
        self.pool.stats.add(**deltas)

    # ------------------------------------------------------------ keys

    def keys(self, tokens_or_hashes) -> np.ndarray:
        """Block keys: of a token array (int32/int64, whole blocks only),
        or block hashes given as an (n, 2) uint64 array."""
        array = np.asarray(tokens_or_hashes)
        if array.ndim == 2 and array.dtype == np.uint64:
            return np.ascontiguousarray(array)
        return self.hasher(array)

    def digest_keys(self, digests: Sequence[bytes], chained: bool = True) -> np.ndarray:
        """Block keys of an engine's own chained block digests (vLLM's
        ``request.block_hashes``, SGLang's page hashes, LMCache's keys),
        mapped into this connector's namespace: hashed under the pool's
        key, the layout's namespace and the salt, so two layouts or tenants
        never share a key.  ``chained``: the digests are hashed as one
        chain (a prefix of digests keys a prefix of blocks); else each on
        its own, for engines that ask of one digest at a time (each digest
        names its whole prefix already).  All digests have one length, a
        multiple of 4 bytes."""
        if not len(digests):
            return np.empty((0, 2), dtype=np.uint64)
        size = len(digests[0])
        if size % 4 or size == 0 or any(len(digest) != size for digest in digests):
            raise ValueError(f"engine block digests must all have one length, a multiple of 4 "
                             f"bytes; got lengths {sorted({len(d) for d in digests})}")
        if self._digest_hasher is None or self._digest_hasher.block_size != size // 4:
            self._digest_hasher = BlockHasher(self.pool.header.hash_key, size // 4,
                                              namespace=self.layout.namespace() + ":digests",
                                              salt=self.salt)
        words = np.frombuffer(b"".join(digests), dtype="<u4").astype(np.int64)
        if chained:
            return self._digest_hasher(words)
        width = size // 4
        return np.vstack([self._digest_hasher(words[row * width:(row + 1) * width])
                          for row in range(len(digests))])

    # ----------------------------------------------------- prefix cache

    def lookup(self, tokens_or_hashes) -> int:
        """How many leading tokens the pool holds, ready."""
        self._renew()
        self._release_now_and_then()
        keys = self.keys(tokens_or_hashes)
        blocks = self.index.lookup(keys)
        if self.tier is not None and blocks < keys.shape[0]:
            blocks += self._tier_call(lambda: _leading(self.tier.exists(keys[blocks:])))
        self._count(lookups=1)
        return blocks * self.layout.block_size

    def load(self, tokens_or_hashes, blocks: Sequence) -> int:
        """Copy the leading hits of the keys into ``blocks`` (one engine
        block each, or its segments); returns how many leading blocks are
        good (checksums verified)."""
        self._renew()
        keys = self.keys(tokens_or_hashes)[:len(blocks)]
        hits = self._pin(keys)
        try:
            if len(hits) < len(blocks):  # what no hit fills is checked all the same
                self.transfer.check(blocks[len(hits):])
            loaded = self._load_hits(hits, blocks)
        finally:
            self.index.unpin(hits)
        if self.tier is not None and loaded < keys.shape[0]:
            loaded += self._load_from_tier(keys[loaded:], blocks[loaded:keys.shape[0]])
        self._count(miss_blocks=keys.shape[0] - loaded)
        return loaded

    # ----------------------------------------------------- cluster tier

    def _tier_call(self, call):
        """``call()``, with the tier's own counts of failures and corrupt
        blocks added to the pool's."""
        before = self.tier.stats["failures"], self.tier.stats["corrupt"]
        try:
            return call()
        finally:
            self._count(tier_failures=self.tier.stats["failures"] - before[0],
                        tier_corrupt=self.tier.stats["corrupt"] - before[1])

    def _load_from_tier(self, keys: np.ndarray, blocks: Sequence) -> int:
        """The leading run of ``keys`` the tier holds, loaded into
        ``blocks`` and promoted into the pool; returns its length.  Blocks
        on a device are got into host memory, then copied to it."""
        views = self.transfer.host_views(blocks)
        device = None
        if views is None:
            device = [self.transfer.device_segments(block) for block in blocks]
            views = [[np.empty(int(flat.numel()), np.uint8) for flat in segments]
                     for segments in device]
        run = self._tier_call(lambda: _leading(self.tier.get_into(keys, views)))
        if device is not None and run:
            import torch

            for segments, host in zip(device[:run], views[:run]):
                for flat, part in zip(segments, host):
                    flat.copy_(torch.from_numpy(part))
        promoted = self._store(keys[:run], blocks[:run], np.zeros(run, np.bool_),
                               np.zeros(run, np.bool_)) if run else 0
        self._count(tier_hit_blocks=run, tier_miss_blocks=len(blocks) - run,
                    tier_read_bytes=run * self.layout.block_bytes, tier_promotions=promoted)
        return run

    def _demote(self, entries: np.ndarray) -> np.ndarray:
        """Write-back: of evicted ``entries`` (`Index.demoters`), those of
        this layout's size, read fresh into host memory, checked against
        their checksums, put into the tier; returns which were taken (a
        block that fails its checksum is this layout's, or no layout's,
        and is taken too: dropped)."""
        size = self.layout.block_bytes
        mine = entries[:, 5] == np.uint64(size)
        rows = np.flatnonzero(mine)
        if rows.size:
            host = [np.empty(size, np.uint8) for _ in rows]
            good = self.transfer.load(entries[rows, 4].astype(np.int64), host,
                                      entries[rows, 6] >> np.uint64(32))
            keys = np.ascontiguousarray(entries[rows[good], :2])
            kept = [block for block, ok in zip(host, good) if ok]
            taken = int(self._tier_call(lambda: self.tier.put_from(keys, kept)).sum()) \
                if kept else 0
            self._count(tier_demotions=taken, tier_stored_blocks=taken,
                        tier_written_bytes=taken * size, checksum_failures=int((~good).sum()))
        return mine

    def _store_to_tier(self, keys: np.ndarray, blocks: Sequence) -> None:
        """Write-through: ``blocks`` to the tier too (from a device, through
        host copies)."""
        views = self.transfer.host_views(blocks)
        if views is None:
            views = [[flat.cpu().numpy() for flat in self.transfer.device_segments(block)]
                     for block in blocks]
        taken = int(self._tier_call(lambda: self.tier.put_from(keys, views)).sum())
        self._count(tier_stored_blocks=taken,
                    tier_written_bytes=taken * self.layout.block_bytes)

    def _pin(self, keys: np.ndarray) -> Hits:
        """`Index.pin`; no hits when this node's lease lapsed (`LeaseLost`:
        the engine recomputes, and the next operation rejoins)."""
        try:
            return self.index.pin(keys)
        except LeaseLost:
            self._count(fenced=1)
            return Hits(np.empty(0, np.int64), np.empty((0, 8), np.uint64), self.pool.epoch)

    def _load_hits(self, hits: Hits, blocks: Sequence) -> int:
        count = len(hits)
        if not count:
            return 0
        short = np.flatnonzero(hits.lengths != self.layout.block_bytes)
        if short.size:  # another layout under this namespace: a miss, never a wrong copy
            count = int(short[0])
        faults.point("load.pinned")  # pinned, not yet copied
        good = self.transfer.load(hits.offsets[:count], blocks[:count], hits.checksums[:count])
        try:
            # this node's pins may have been ignored mid-copy (R6: a lapsed
            # node's claims are reclaimable): what was read is not trusted
            self.pool.self_fence("a load's bytes (pinned) into the engine")
        except LeaseLost:
            self._count(fenced=1)
            return 0
        bad = np.flatnonzero(~good)
        loaded = int(bad[0]) if bad.size else count
        self._count(checksum_failures=int(bad.size), hit_blocks=loaded,
                    read_bytes=loaded * self.layout.block_bytes)
        return loaded

    def store(self, tokens_or_hashes, blocks: Sequence) -> int:
        """Store the blocks of the keys that the pool lacks; returns how
        many were published (blocks present already are not copied).

        A full pool is not an error: the index evicts to make room, and
        when it cannot make room for every block, the leading blocks that
        fit are stored and the others counted in ``stats["not_stored"]``
        (a cache that lacks them is still correct: the engine recomputes).
        A lock lost to a manager's take-over (or not had in ``timeout``)
        stores nothing and counts the blocks the same way.  Raises only for
        misuse: fewer keys than blocks, or blocks that do not fit the
        layout (`ValueError`).  `store_each` says which blocks the pool
        holds."""
        return self.store_each(tokens_or_hashes, blocks).published

    def store_each(self, tokens_or_hashes, blocks: Sequence) -> Stored:
        """`store`, reporting block by block: `Stored.kept` is true for
        each block the pool holds or another writer is writing (published
        now or present already), false for each one not stored."""
        self._renew()
        self._release_now_and_then()
        keys = self.keys(tokens_or_hashes)
        if keys.shape[0] < len(blocks):
            raise ValueError(f"store: {len(blocks)} blocks but keys for {keys.shape[0]} "
                             f"(tokens name whole blocks of {self.layout.block_size}); pass a "
                             f"key for every block")
        keys = keys[:len(blocks)]
        kept = np.zeros(keys.shape[0], dtype=np.bool_)
        written = np.zeros(keys.shape[0], dtype=np.bool_)
        if keys.shape[0]:
            self.transfer.check(blocks)
            self._store(keys, blocks, kept, written)
            if self.tier is not None and self.tier_policy == "write_through":
                # all of them, those the rack held already too: they may have
                # been stored while the tier was down (a key the tier holds
                # costs it no transfer)
                self._store_to_tier(keys, blocks)
        self._count(not_stored=int(kept.size - kept.sum()))
        return Stored(int(written.sum()), kept, written)

    def _store(self, keys: np.ndarray, blocks: Sequence, kept: np.ndarray,
               written: np.ndarray) -> int:
        """`store_each`'s work: sets ``kept`` of the blocks the pool holds
        after it and ``written`` of those it published; returns how many
        it published."""
        reserved, fitted = None, keys.shape[0]
        while reserved is None:
            try:
                reserved = self.index.reserve(keys[:fitted], self.layout.block_bytes,
                                              tokens=self.layout.block_size,
                                              timeout=self.timeout)
            except PoolFull:  # no room for them all: the leading half, and so on
                fitted //= 2
                if not fitted:
                    return 0
            except (LeaseLost, LockTimeout):  # a lock lost or not had: nothing was written
                self._count_if_lapsed()
                return 0
        kept[:fitted] = ~reserved.taken  # present, or being written by another writer
        taken = np.flatnonzero(reserved.taken)
        if not taken.size:
            return 0
        try:
            # the blocks lie in slabs this node owns: another node may have
            # reclaimed them if this node's lease lapsed since the reserve
            self.pool.self_fence("payloads into reserved blocks")
            sums = self.transfer.store(reserved.offsets[taken], [blocks[i] for i in taken])
        except LeaseLost:  # WRITING entries of a lapsed incarnation: others reclaim them (R6)
            self._count(fenced=1)
            return 0
        except BaseException:
            self.index.abort(reserved, timeout=self.timeout)
            raise
        faults.point("store.copied")  # copied, not yet published
        checksums = np.zeros(len(reserved), dtype=np.uint64)
        checksums[taken] = sums
        try:
            done = np.asarray(self.index.publish(reserved, checksums, timeout=self.timeout),
                              dtype=np.bool_)
        except (LeaseLost, LockTimeout):  # not published: withdrawn when the lock allows
            self._count_if_lapsed()
            try:
                self.index.abort(reserved, timeout=self.timeout)
            except (LeaseLost, LockTimeout):
                pass  # WRITING entries of this node: reusable once its lease lapses
            return 0
        kept[taken] = written[taken] = done[taken]
        published = int(done.sum())
        self._count(stored_blocks=published, written_bytes=published * self.layout.block_bytes)
        return published

    def remove(self, tokens_or_hashes) -> np.ndarray:
        """Delete the blocks of the keys (an engine's explicit remove);
        returns which were removed.  A block some live node pins stays."""
        self._renew()
        return self.index.remove(self.keys(tokens_or_hashes), timeout=self.timeout)

    # ---------------------------------------------------------- handoff

    def offer(self, request_id: str, tokens_or_hashes, blocks: Sequence,
              ttl: float | None = None) -> str:
        """Prefill side: store a request's blocks and pin them for the
        decode side for ``ttl`` seconds.  Returns the ticket to pass to the
        decode side's `take` (the offer's leading blocks:
        ``len(offers[request_id].hits)``): `NO_OFFER`, counted in
        ``stats["not_offered"]``, when a full pool has no room left even for
        the handoff record (the decode side then recomputes)."""
        if request_id in self.offers:
            raise ValueError(f"request {request_id!r} is already offered")
        if ttl is not None and not (isinstance(ttl, (int, float)) and 0 < ttl < float("inf")):
            raise ValueError(f"offer ttl must be a positive number of seconds, got {ttl!r}")
        keys = self.keys(tokens_or_hashes)[:len(blocks)]
        self.store(keys, blocks)
        hits = self._pin(keys)
        faults.point("handoff.pinned")
        deadline = self.pool.clock.wall() + (self.ttl if ttl is None else ttl)
        try:
            record, nonce = self.handoff.write(hits.keys, deadline, self.timeout)
        except (PoolFull, LeaseLost, LockTimeout):  # no record: the decode side recomputes
            self.index.unpin(hits)
            self._count(not_offered=1)
            return NO_OFFER
        except BaseException:
            self.index.unpin(hits)
            raise
        ticket = format_ticket(record, nonce)
        self.offers[request_id] = Offer(request_id, ticket, hits, deadline, record, nonce)
        self._count(offers=1)
        return ticket

    def take(self, ticket: str, blocks: Sequence) -> Taken:
        """Decode side: load an offer's blocks into ``blocks`` and mark the
        offer taken.  An offer that is gone (expired, cancelled, its
        producer dead, its record reused) loads nothing: the engine
        recomputes."""
        self._renew()
        record = self.handoff.read(ticket)  # raises `ValueError` for a string naming no record
        if record is None:  # `NO_OFFER`, or an offer that is gone
            self._count(handoff_misses=1, miss_blocks=len(blocks))
            return Taken(0, 0)
        keys = record.keys
        hits = self._pin(keys[:len(blocks)])
        try:
            loaded = self._load_hits(hits, blocks)
            self.handoff.mark_taken(record)
        finally:
            self.index.unpin(hits)
        self._count(takes=1, miss_blocks=min(len(blocks), keys.shape[0]) - loaded)
        return Taken(loaded, keys.shape[0])

    def _retire(self, offer: Offer) -> None:
        """Drop an offer's pins; its record is freed a lease after its
        deadline (`HandoffRecords.free_at`)."""
        self.index.unpin(offer.hits)
        faults.point("handoff.released")
        heapq.heappush(self._retired, (self.handoff.free_at(offer.deadline), offer.record))

    def _free_retired(self, now: float) -> None:
        while self._retired and self._retired[0][0] <= now:
            try:
                self.pool.free(self._retired[0][1], self.timeout)
            except LeaseLost:  # a lapsed incarnation's records: dropped at its rejoin
                return
            heapq.heappop(self._retired)

    def _release_now_and_then(self) -> None:
        """`release`, from the cache calls, at most every `RELEASE_EVERY`
        seconds (it reads each offer's taken line)."""
        now = self.pool.clock.now()
        if (self.offers or self._retired) and now - self._released >= RELEASE_EVERY:
            self._released = now
            self.release()

    def release(self) -> int:
        """Prefill side: drop the pins of offers that were taken or
        expired, and free the records whose time has come; returns how
        many offers ended."""
        self._renew()
        now, done = self.pool.clock.wall(), []
        marks = self.handoff.taken([(offer.record, offer.nonce)
                                    for offer in self.offers.values()]) if self.offers else []
        for (request_id, offer), taken in zip(self.offers.items(), marks):
            if taken:
                done.append(request_id)
            elif offer.deadline < now:
                self.stats["expired"] += 1
                done.append(request_id)
        for request_id in done:
            self._retire(self.offers.pop(request_id))
        self._free_retired(now)
        return len(done)

    def cancel(self, request_id: str) -> None:
        """Prefill side: withdraw an offer (the request was aborted): its
        record no longer reads as an offer, and its pins go."""
        self._renew()  # a lapsed incarnation's records may be another's memory now
        offer = self.offers.pop(request_id, None)
        if offer is None:
            return
        self.handoff.withdraw(offer.record)
        self._retire(offer)

    def close(self) -> None:
        """Withdraw every offer, free the records whose time has come (the
        others go with this process's memory) and release the transfer
        engine."""
        for request_id in list(self.offers):
            self.cancel(request_id)
        self._free_retired(self.pool.clock.wall())
        self.transfer.close()
        if self._demote in self.index.demoters:
            self.index.demoters.remove(self._demote)
        if self._own_tier:
            self.tier.close()


_warmed = False
_warming = threading.Lock()


def warm_up() -> float:
    """Compile every kernel a connector's calls run (or load it from
    Numba's cache), once per process, on a scratch pool of its own; returns
    the seconds it took (0.0 once done).

    A kernel is compiled at its first call, and some first calls are made
    under a pool lock (an index reservation, an eviction).  A cold compile
    takes seconds, more on a loaded machine, and a holder that long stalls
    every node's stores behind it (and its lease may lapse meanwhile); a
    first load pays it inside a request.  The engine adapters call this
    before they open their pool, so no lock and no request ever waits on
    a compile.  No fail point fires in it (`tract._failpoints.suspended`).
    A scratch pool that cannot be made (no room in /dev/shm) is logged,
    and the kernels compile where first called, as before."""
    global _warmed
    from tract.pool import Pool

    with _warming:
        if _warmed:
            return 0.0
        began = time.monotonic()
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(directory, f"tract-warm-up-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            # a lease no compile outlasts: this pool is this process's alone, and a
            # kernel compiling holds the GIL, so its heartbeat may stand still for seconds
            Pool.create(path, 16 << 20, max_nodes=2, lock_mode="bakery", index_capacity=64,
                        lease_timeout=600)
        except OSError as error:
            log.warning("tract: no scratch pool to compile the kernels on (%s); each is "
                        "compiled at its first call", error)
        else:
            try:  # a fail point armed in this process aims at its engine's pool
                with faults.suspended(), Pool.open(path, 0) as pool:
                    _exercise(pool)
            finally:
                Pool.destroy(path)
        _warmed = True
        return time.monotonic() - began


def _exercise(pool) -> None:
    """Every call of a connector that reaches a kernel, on ``pool`` (its
    index small enough that removes and evictions lower reaches)."""
    layout = KVLayout(model="tract-warm-up", dtype="float16", num_layers=2, num_kv_heads=1,
                      head_size=8, block_size=4)
    connector = Connector(pool, layout, timeout=10.0)
    try:
        def blocks(count):
            return [np.full(layout.block_bytes, i, np.uint8) for i in range(count)]

        for dtype in (np.int64, np.int32):  # tokens are either (widened in `tract.hashing`)
            tokens = np.arange(3 * layout.block_size, dtype=dtype)
            connector.store(tokens[:layout.block_size], blocks(1))
            connector.load(tokens[:connector.lookup(tokens)], blocks(3))
        connector.take(connector.offer("warm-up", tokens, blocks(3)), blocks(3))
        connector.release()
        keys = connector.digest_keys([i.to_bytes(8, "little") for i in range(40)])
        connector.store_each(keys, blocks(40))
        connector.load(keys[:connector.lookup(keys)], blocks(40))
        connector.remove(keys[::2])
        pool.free(pool.alloc(1 << 20))
        pool.index.evict(8)
        # the allocator's bitmap scans, run when the cursor's chunk is taken (a full
        # pool's, as after a node leaves it), which this empty pool never reaches
        words = np.zeros(1, np.uint64)
        bitmap.first_free_run(words, 64, 2, 1)
        bitmap.count_free(words, 64)
    finally:
        connector.close()


def _leading(found: np.ndarray) -> int:
    """How many of ``found`` lead with True."""
    misses = np.flatnonzero(~np.asarray(found, dtype=np.bool_))
    return int(misses[0]) if misses.size else len(found)
