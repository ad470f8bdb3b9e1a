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
    The prefill side `offer`s a request: its blocks are stored, then pinned
    by the prefill node and named in the object store
    (``handoff/<digest of the request id>``: the keys and a deadline).  The
    decode side `take`s it: pins, loads, unpins, and deletes the record.
    The prefill side's `release` (called by the cache operations every
    `RELEASE_EVERY` seconds, and by the engine when it likes) drops the pins
    of taken, expired or cancelled offers, so a decode worker that never comes costs pins for
    one TTL only, and one that dies costs nothing more: pins of a dead node
    do not count (R6).

Rules relied on: those of `tract.index` (pins, R3/R4 ordering of payloads
and entries) and `tract.transfer` (payloads in memory before publish;
checksums); records of the object store are whole or absent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from tract.hashing import BlockHasher
from tract.index import Hits
from tract.transfer import KVLayout, TransferEngine

__all__ = ["RELEASE_EVERY", "Connector", "Offer", "Taken"]

RELEASE_EVERY = 0.01  # seconds between the cache calls' checks of this process's offers
_RECORD = struct.Struct("<8sQdI")  # magic, producer node, deadline (wall s), key count
_MAGIC = b"tractHO1"


@dataclasses.dataclass
class Offer:
    """A request's blocks, pinned by the prefill node for the decode side."""

    request_id: str
    name: str
    hits: Hits
    deadline: float
    record: int  # pool offset of the handoff record


@dataclasses.dataclass(frozen=True)
class Taken:
    """What the decode side got of an offer: ``blocks`` leading blocks
    loaded (the rest are misses to recompute), of ``offered``."""

    blocks: int
    offered: int


def _handoff_name(request_id: str) -> str:
    digest = hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
    return f"handoff/{digest}"


class Connector:
    """One engine worker's view of the pool's KV cache."""

    def __init__(self, pool, layout: KVLayout, *, checksum: bool = True,
                 handoff_ttl: float = 30.0, salt: str | bytes | None = None,
                 timeout: float | None = 30.0):
        self.pool, self.layout, self.index = pool, layout, pool.index
        self.transfer = TransferEngine(pool, layout, checksum=checksum)
        self.hasher = BlockHasher(pool.header.hash_key, layout.block_size,
                                  namespace=layout.namespace(), salt=salt)
        self.ttl, self.timeout = handoff_ttl, timeout
        self.offers: dict[str, Offer] = {}
        self._released = float("-inf")
        self.stats = dict.fromkeys(["lookups", "hit_blocks", "loaded_blocks", "stored_blocks",
                                    "checksum_failures", "offers", "taken", "expired"], 0)

    # ------------------------------------------------------------ keys

    def keys(self, tokens_or_hashes) -> np.ndarray:
        """Block keys: of a token array (int32/int64, whole blocks only),
        or block hashes given as an (n, 2) uint64 array."""
        array = np.asarray(tokens_or_hashes)
        if array.ndim == 2 and array.dtype == np.uint64:
            return np.ascontiguousarray(array)
        return self.hasher(array)

    # ----------------------------------------------------- prefix cache

    def lookup(self, tokens_or_hashes) -> int:
        """How many leading tokens the pool holds, ready."""
        self._release_now_and_then()
        keys = self.keys(tokens_or_hashes)
        self.stats["lookups"] += 1
        blocks = self.index.lookup(keys)
        self.stats["hit_blocks"] += blocks
        return blocks * self.layout.block_size

    def load(self, tokens_or_hashes, blocks: Sequence) -> int:
        """Copy the leading hits of the keys into ``blocks`` (one engine
        block each, or its segments); returns how many leading blocks are
        good (checksums verified)."""
        keys = self.keys(tokens_or_hashes)[:len(blocks)]
        hits = self.index.pin(keys)
        try:
            return self._load_hits(hits, blocks)
        finally:
            self.index.unpin(hits)

    def _load_hits(self, hits: Hits, blocks: Sequence) -> int:
        count = len(hits)
        if not count:
            return 0
        short = np.flatnonzero(hits.lengths != self.layout.block_bytes)
        if short.size:  # another layout under this namespace: a miss, never a wrong copy
            count = int(short[0])
        checksums = hits.entries[:count, 6] >> np.uint64(32)
        good = self.transfer.load(hits.offsets[:count], blocks[:count], checksums)
        bad = np.flatnonzero(~good)
        self.stats["checksum_failures"] += int(bad.size)
        loaded = int(bad[0]) if bad.size else count
        self.stats["loaded_blocks"] += loaded
        return loaded

    def store(self, tokens_or_hashes, blocks: Sequence) -> int:
        """Store the blocks of the keys that the pool lacks; returns how
        many were published (blocks present already are not copied)."""
        self._release_now_and_then()
        keys = self.keys(tokens_or_hashes)[:len(blocks)]
        if not keys.shape[0]:
            return 0
        reserved = self.index.reserve(keys, self.layout.block_bytes,
                                      tokens=self.layout.block_size, timeout=self.timeout)
        taken = np.flatnonzero(reserved.taken)
        if not taken.size:
            return 0
        try:
            sums = self.transfer.store(reserved.offsets[taken], [blocks[i] for i in taken])
        except BaseException:
            self.index.abort(reserved, timeout=self.timeout)
            raise
        checksums = np.zeros(len(reserved), dtype=np.uint64)
        checksums[taken] = sums
        published = int(sum(self.index.publish(reserved, checksums, timeout=self.timeout)))
        self.stats["stored_blocks"] += published
        return published

    # ---------------------------------------------------------- handoff

    def offer(self, request_id: str, tokens_or_hashes, blocks: Sequence,
              ttl: float | None = None) -> int:
        """Prefill side: store a request's blocks, pin them for the decode
        side for ``ttl`` seconds, and name them in the object store.
        Returns how many leading blocks are offered."""
        if request_id in self.offers:
            raise ValueError(f"request {request_id!r} is already offered")
        keys = self.keys(tokens_or_hashes)[:len(blocks)]
        self.store(keys, blocks)
        name = _handoff_name(request_id)
        hits = self.index.pin(keys)
        deadline = self.pool.clock.wall() + (self.ttl if ttl is None else ttl)
        body = _RECORD.pack(_MAGIC, self.pool.node, deadline, len(hits)) + \
            np.ascontiguousarray(hits.entries[:, :2]).tobytes()
        try:
            record = self.pool.alloc(len(body), self.timeout)
            try:
                self.pool.region.copy_in(record, body)
                self.pool.objects.put(name, record, len(body), timeout=self.timeout)
            except BaseException:
                self.pool.free(record)
                raise
        except BaseException:
            self.index.unpin(hits)
            raise
        self.offers[request_id] = Offer(request_id, name, hits, deadline, record)
        self.stats["offers"] += 1
        return len(hits)

    def take(self, request_id: str, blocks: Sequence) -> Taken:
        """Decode side: load an offered request's blocks into ``blocks``,
        then end the offer.  No offer (never made, expired, its producer
        gone) loads nothing: the engine recomputes."""
        name = _handoff_name(request_id)
        record = self.pool.objects.get(name)
        if record is None:
            return Taken(0, 0)
        self.pool.region.invalidate(record.offset, record.size, payload=True)
        self.pool.region.fence()  # the record, fresh (R4)
        data = self.pool.region.read(record.offset, record.size)
        if len(data) < _RECORD.size or data[:8] != _MAGIC:
            return Taken(0, 0)
        _, _, deadline, count = _RECORD.unpack_from(data)
        if _RECORD.size + count * 16 != len(data) or deadline < self.pool.clock.wall():
            return Taken(0, 0)
        keys = np.frombuffer(data, dtype=np.uint64, offset=_RECORD.size).reshape(count, 2)
        loaded = self.load(keys, blocks)
        self._end(name)
        self.stats["taken"] += 1
        return Taken(loaded, count)

    def _end(self, name: str) -> None:
        """Delete a handoff record and free it; whoever deletes it (the
        taker, or the offerer at its deadline) frees it, once."""
        try:
            record = self.pool.objects.delete(name, timeout=self.timeout)
        except KeyError:
            return  # the other side ended it
        self.pool.free(record.offset, self.timeout)

    def _release_now_and_then(self) -> None:
        """`release`, from the cache calls, at most every `RELEASE_EVERY`
        seconds (it reads each offer's record)."""
        now = self.pool.clock.now()
        if self.offers and now - self._released >= RELEASE_EVERY:
            self._released = now
            self.release()

    def release(self) -> int:
        """Prefill side: drop the pins of offers that were taken, expired
        or whose record is gone; returns how many."""
        if not self.offers:
            return 0
        now, done = self.pool.clock.wall(), []
        for request_id, offer in self.offers.items():
            record = self.pool.objects.get(offer.name)
            if record is None or record.offset != offer.record:
                done.append(request_id)  # taken: the consumer deleted the record
            elif offer.deadline < now:
                self._end(offer.name)
                self.stats["expired"] += 1
                done.append(request_id)
        for request_id in done:
            self.index.unpin(self.offers.pop(request_id).hits)
        return len(done)

    def cancel(self, request_id: str) -> None:
        """Prefill side: withdraw an offer (the request was aborted)."""
        offer = self.offers.pop(request_id, None)
        if offer is None:
            return
        self._end(offer.name)
        self.index.unpin(offer.hits)

    def close(self) -> None:
        """Withdraw every offer and release the transfer engine."""
        for request_id in list(self.offers):
            self.cancel(request_id)
        self.transfer.close()

