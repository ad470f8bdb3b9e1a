"""Tiers below the rack: a cluster-wide store that a rack's miss falls to
before the engine recomputes.

A CXL pool spans one rack.  A block evicted from it, or computed in another
rack, can still be fetched over the network, which costs less than
recomputing it.  tract does not build that network store: it sits above
one.  `Tier` is what tract needs of it, batched over block keys (the
connector's (n, 2) uint64 keys, which already carry the layout's namespace
and the tenant's salt, so tenants share nothing in a tier either).  The
first tier is Mooncake Store (`MooncakeTier`), which vLLM, SGLang, LMCache
and Dynamo all speak; `open_tier` makes one from a URL.

**A block in a tier** is one object: a 64-byte header, then its bytes.
The header's words:

    0  magic "TRACTBLK"      1  layout version
    2  length in bytes       3  key low        4  key high
    5  digest                6  pieces         7  check word of words 0..6

The digest is XXH3-64 (``seed``) of each piece of the block, as the engine
hands them (one buffer per layer, say), then XXH64 of those (`xxh64_rows`),
computed while the block is copied.  A get takes a block only when its
header is whole, names the key asked for and the target's length and piece
count, and its bytes hash to its digest; anything else is a miss (and the
object is removed, so that a later put can heal it).  A target of a miss
holds unspecified bytes: the engine recomputes it.

**Failure is a miss.**  Every store call runs on one worker thread and is
awaited at most ``timeout`` seconds.  A store that is down, slow or
restarting turns into misses and one logged warning, never an error to the
engine and never a hang; calls are not tried again for ``retry`` seconds,
and a store that could not be set up is set up again, on the worker, from
then on.  Objects move through a private *staging* mapping registered with
the store once: a call that outlives its timeout can only write there, and
no call uses the staging until it returns.

No pool memory is touched here, so none of DESIGN.md's rules R1-R6 applies:
the staging is this process's own (coherent) memory.  The connector moves
blocks between a tier and the rack's pool through the engine's buffers, by
the pool's own steps.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence

import numpy as np

from tract._native._region import xxh64_rows
from tract.errors import ConfigError

__all__ = ["HEADER_BYTES", "POLICIES", "MooncakeTier", "Tier", "TierStats", "open_tier"]

log = logging.getLogger(__name__)

HEADER_BYTES = 64
#: how a connector's stores reach its tier (`tract.connector`); the first is the default
POLICIES = ("write_through", "write_back")
MAGIC = int.from_bytes(b"TRACTBLK", "little")
VERSION = 1
_CHECK_SEED = 0x7472_6163_742D_7469  # the header's check word: XXH64 of words 0..6
_ALIGN = 64
# Mooncake's codes that say the store was not reached (TRANSFER_FAIL,
# RPC_FAIL): the tier is down, not the key missing (OBJECT_NOT_FOUND, -704)
_UNREACHED = (-800, -900)


def _keys(keys) -> np.ndarray:
    array = np.ascontiguousarray(keys, dtype=np.uint64)
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"keys must be an (n, 2) uint64 array of block keys, got shape "
                         f"{array.shape}")
    return array


def _batch(keys, blocks, writable: bool = False):
    """(keys, each block's pieces, each block's piece sizes) of a batch,
    checked: a key for every block, and pieces a get can write."""
    keys, blocks = _keys(keys), [_pieces(block) for block in blocks]
    if len(blocks) != keys.shape[0]:
        raise ValueError(f"{keys.shape[0]} keys for {len(blocks)} blocks")
    if writable and any(piece.readonly for block in blocks for piece in block):
        raise ValueError("a get's targets must be writable buffers")
    return keys, blocks, [[piece.nbytes for piece in block] for block in blocks]


def _pieces(block) -> list[memoryview]:
    """A block as its pieces: one buffer, or a sequence of buffers, each
    C-contiguous bytes."""
    parts = block if isinstance(block, (list, tuple)) else [block]
    if not parts:
        raise ValueError("a block needs at least one piece")
    views = []
    for part in parts:
        view = memoryview(part)
        if not view.c_contiguous:
            raise ValueError(f"a block's pieces must be C-contiguous buffers, got "
                             f"{type(part).__name__} of shape {view.shape}")
        views.append(view.cast("B"))
    return views


class TierStats:
    """A tier's counts in this process: blocks ``hits`` and ``misses`` of
    gets, ``stored`` by puts, ``bytes_in`` (put) and ``bytes_out`` (got),
    ``corrupt`` objects found (each also a miss), and ``failures``: calls
    that failed, timed out or were skipped while the tier was down."""

    NAMES = ("hits", "misses", "stored", "bytes_in", "bytes_out", "corrupt", "failures")

    def __init__(self):
        self.counts = dict.fromkeys(self.NAMES, 0)

    def add(self, **deltas: int) -> None:
        for name, delta in deltas.items():
            self.counts[name] += delta

    def __getitem__(self, name: str) -> int:
        return self.counts[name]


class Tier:
    """A block store below the rack.  Every method is batched over block
    keys ((n, 2) uint64) and never raises for the store's own failures:
    those are misses (see the module docstring).

    A *block* is a buffer, or a sequence of buffers (its pieces), of
    C-contiguous bytes; a get fills the pieces of each target in order.
    """

    def __init__(self):
        self.stats = TierStats()

    def exists(self, keys) -> np.ndarray:
        """Whether each key's block is in the tier (bool array)."""
        raise NotImplementedError

    def get_into(self, keys, blocks: Sequence) -> np.ndarray:
        """Fill each of ``blocks`` with its key's block; True where it was
        there, whole and of that size (bool array)."""
        raise NotImplementedError

    def put_from(self, keys, blocks: Sequence) -> np.ndarray:
        """Store each of ``blocks`` under its key; True where the tier took
        it (a key it holds already counts as taken)."""
        raise NotImplementedError

    def remove(self, keys) -> int:
        """Drop each key's block; how many were there."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _staged_bytes(pieces: list[int]) -> int:
    """What one object takes in the staging: its header and pieces, to a line."""
    return -(-(HEADER_BYTES + sum(pieces)) // _ALIGN) * _ALIGN


class _Staging:
    """The objects of one batch laid out in the staging mapping: each a
    header, then its pieces, each object starting on a line."""

    def __init__(self, sizes: list[list[int]]):
        self.starts, self.lengths, self.piece_offsets = [], [], []
        at = 0
        for pieces in sizes:
            self.starts.append(at)
            self.lengths.append(HEADER_BYTES + sum(pieces))
            offset = at + HEADER_BYTES
            for size in pieces:
                self.piece_offsets.append(offset)
                offset += size
            at += _staged_bytes(pieces)

    @staticmethod
    def batches(capacity: int, sizes: list[list[int]]) -> list[range]:
        """Consecutive runs of blocks whose objects fit ``capacity``
        together; a block that fits no run is refused before any is made."""
        runs, first, used = [], 0, 0
        for i, pieces in enumerate(sizes):
            length = _staged_bytes(pieces)
            if length > capacity:
                raise ValueError(f"a block of {sum(pieces)} bytes (with its {HEADER_BYTES}-byte "
                                 f"header) does not fit the tier's {capacity}-byte staging; "
                                 f"raise staging_bytes")
            if used + length > capacity and i > first:
                runs.append(range(first, i))
                first, used = i, 0
            used += length
        if first < len(sizes):
            runs.append(range(first, len(sizes)))
        return runs


def _header(key: np.ndarray, length: int, digest: int, pieces: int) -> np.ndarray:
    words = np.array([MAGIC, VERSION, length, key[0], key[1], digest, pieces, 0], np.uint64)
    words[7] = xxh64_rows(words[None, :7].copy(), _CHECK_SEED)[0]
    return words


def _block_digests(sums: np.ndarray, counts: list[int], seed: int) -> list[int]:
    """Each block's digest from its pieces' (``counts`` pieces per block, in order)."""
    digests, at = [], 0
    for count in counts:
        digests.append(int(xxh64_rows(sums[None, at:at + count].copy(), seed)[0]))
        at += count
    return digests


class MooncakeTier(Tier):
    """Mooncake Store as a tier: batched zero-copy calls
    (`batch_put_from`, `batch_get_into`, `batch_is_exist`) from a staging
    mapping registered once.

    Parameters
    ----------
    master : str
        The master's RPC address, ``host:port``.
    metadata : str
        The metadata server (``http://host:port/metadata``).
    protocol : {"tcp", "rdma"}
        Mooncake's transport ("rdma" needs ``device``).
    device : str
        RDMA device names, for ``protocol="rdma"``.
    hostname : str
        This client's address as the store's other clients reach it.
    segment_bytes : int
        Memory this client gives the store (0: none; segment holders such as
        ``mooncake_client`` hold the blocks).
    staging_bytes : int
        The staging mapping: a batch larger than it goes in several calls.
    timeout : float
        The longest any store call is awaited, in seconds.
    retry : float
        Seconds after a failure before the store is called again.
    seed : int
        Digest seed: racks that share a tier share it (the pools' hash key).
    prefix : str
        The objects' key prefix (``prefix/<32 hex digits>``).
    """

    def __init__(self, master: str, metadata: str, *, protocol: str = "tcp", device: str = "",
                 hostname: str = "127.0.0.1", segment_bytes: int = 0,
                 staging_bytes: int = 64 << 20, timeout: float = 5.0, retry: float = 5.0,
                 seed: int = 0, prefix: str = "tract"):
        super().__init__()
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if protocol == "rdma" and not device:
            raise ConfigError("mooncake protocol 'rdma' needs its device names (device=...)")
        for what, value in (("segment_bytes", segment_bytes), ("staging_bytes", staging_bytes)):
            if not isinstance(value, int) or value < 0 or (what == "staging_bytes"
                                                           and value < 2 * HEADER_BYTES):
                raise ConfigError(f"{what} must be a whole number of bytes"
                                  f"{' of at least 128' if what == 'staging_bytes' else ''},"
                                  f" got {value!r}")
        for what, value in (("timeout", timeout), ("retry", retry)):
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ConfigError(f"{what} must be a positive number of seconds, got {value!r}")
        if not prefix or "/" in prefix:
            raise ConfigError(f"prefix must be a non-empty name without '/', got {prefix!r}")
        try:
            importlib.import_module("mooncake.store")
        except ImportError as error:
            raise ConfigError(f"the mooncake tier needs mooncake-transfer-engine-non-cuda "
                              f"(pip install 'tract[peers]'; Debian libibverbs1): {error}") \
                from None
        from tract.region import scratch_region

        self.master, self.metadata, self.protocol, self.device = master, metadata, protocol, \
            device
        self.hostname, self.segment_bytes = hostname, segment_bytes
        self.timeout, self.retry, self.seed, self.prefix = float(timeout), float(retry), \
            int(seed), prefix
        self.url = f"mooncake://{master}"
        self._staging = scratch_region(staging_bytes, name="tier-staging", coherence="hardware")
        self._staging.fill(0, staging_bytes, 0)  # its pages made now, not in a timed call
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tract-tier")
        self._lock = threading.Lock()  # one batch at a time uses the staging
        self._store = None
        self._busy: concurrent.futures.Future | None = None  # the last call sent
        self._quiet_until = 0.0  # no call before this (monotonic) after a failure
        self._down_reason: str | None = None
        self._closed = False
        # the first setup is awaited (bounded), and reported here: a callback
        # may run after `result` has returned to this thread
        self._busy = self._worker.submit(self._setup)
        try:
            self._busy.result(self.timeout)
        except concurrent.futures.TimeoutError:
            self._busy.add_done_callback(self._after_setup)  # reported when it ends
        except Exception as error:  # noqa: BLE001 - a miss until set up again
            self._down(f"setup failed: {type(error).__name__}: {error}")

    # ------------------------------------------------------ the worker

    def _setup(self):
        """On the worker: a connected store with the staging registered."""
        from mooncake.store import MooncakeDistributedStore

        # Mooncake's setup retries an absent master for a minute and more,
        # which would hold the worker: a master that refuses is a miss now
        host, _, port = self.master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), min(1.0, self.timeout)).close()
        except (OSError, ValueError) as error:
            raise ConnectionError(f"master {self.master} does not answer: {error}") from None
        store = MooncakeDistributedStore()
        code = store.setup(self.hostname, self.metadata, self.segment_bytes,
                           max(self.segment_bytes, 16 << 20), self.protocol, self.device,
                           self.master)
        if code:
            raise ConnectionError(f"setup returned {code}")
        code = store.register_buffer(self._staging.base, self._staging.size)
        if code:
            store.close()
            raise ConnectionError(f"register_buffer of the staging returned {code}")
        self._store = store
        return True

    def _call(self, what: str, function, *args):
        """``function(*args)`` on the worker, awaited at most ``timeout``;
        None (a miss) when the tier is down, the call is still running from
        before, it timed out or raised.  The caller holds ``_lock``."""
        if self._closed:
            return None
        if self._busy is not None and not self._busy.done():
            self.stats.add(failures=1)
            return None
        if time.monotonic() < self._quiet_until:
            self.stats.add(failures=1)
            return None
        if self._store is None:  # set up again, in the background
            self._connect()
            self.stats.add(failures=1)
            return None
        self._busy = self._worker.submit(function, *args)
        try:
            result = self._busy.result(self.timeout)
        except concurrent.futures.TimeoutError:
            self._down(f"{what} took over {self.timeout:g} s")
            return None
        except Exception as error:  # noqa: BLE001 - the store's failure is a miss
            self._down(f"{what} failed: {type(error).__name__}: {error}")
            return None
        self._up()
        return result

    def _connect(self) -> None:
        self._busy = self._worker.submit(self._setup)
        self._busy.add_done_callback(self._after_setup)

    def _after_setup(self, future) -> None:
        error = future.exception()
        if error is None:
            self._up()
        else:
            self._down(f"setup failed: {type(error).__name__}: {error}")

    def _down(self, reason: str) -> None:
        self.stats.add(failures=1)
        self._quiet_until = time.monotonic() + self.retry
        if self._down_reason is None:
            log.warning("tier %s is not answering (%s): its blocks are misses; trying again "
                        "every %g s", self.url, reason, self.retry)
        self._down_reason = reason

    def _up(self) -> None:
        if self._down_reason is not None:
            log.warning("tier %s answers again", self.url)
        self._down_reason = None

    @property
    def down(self) -> str | None:
        """Why the tier is not answering, or None."""
        return self._down_reason

    def _names(self, keys: np.ndarray) -> list[str]:
        return [f"{self.prefix}/{int(k0):016x}{int(k1):016x}" for k0, k1 in keys.tolist()]

    def _failed(self, what: str, codes, n: int) -> bool:
        """Whether a batch's results say the store itself failed (not a
        key missing): no results, a wrong count, or a code of `_UNREACHED`."""
        if codes is None:
            return True
        if len(codes) != n:
            self._down(f"{what} of {n} keys came back with {len(codes)} results")
            return True
        unreached = sorted({code for code in codes if code in _UNREACHED})
        if unreached:
            self._down(f"{what} returned {unreached}")
            return True
        return False

    # ------------------------------------------------------ the tier

    def exists(self, keys) -> np.ndarray:
        keys = _keys(keys)
        found = np.zeros(keys.shape[0], np.bool_)
        if keys.shape[0]:
            with self._lock:
                codes = self._call("batch_is_exist", lambda store, names: store.batch_is_exist(
                    names), self._store, self._names(keys))
            if not self._failed("batch_is_exist", codes, keys.shape[0]):
                found[:] = np.asarray(codes) == 1
        return found

    def put_from(self, keys, blocks: Sequence) -> np.ndarray:
        keys, blocks, sizes = _batch(keys, blocks)
        taken = np.zeros(keys.shape[0], np.bool_)
        with self._lock:
            for run in _Staging.batches(self._staging.size, sizes):
                layout = _Staging([sizes[i] for i in run])
                pieces = [piece for i in run for piece in blocks[i]]
                sums = np.empty(len(pieces), np.uint64)
                self._staging.copy_in_blocks(np.array(layout.piece_offsets, np.int64), pieces,
                                             sums, self.seed)
                digests = _block_digests(sums, [len(blocks[i]) for i in run], self.seed)
                for j, i in enumerate(run):
                    header = _header(keys[i], layout.lengths[j] - HEADER_BYTES, digests[j],
                                     len(blocks[i]))
                    self._staging.view(layout.starts[j], HEADER_BYTES)[:] = header.view(np.uint8)
                codes = self._call(
                    "batch_put_from", lambda store, *args: store.batch_put_from(*args),
                    self._store, self._names(keys[run.start:run.stop]),
                    [self._staging.base + start for start in layout.starts], layout.lengths)
                if self._failed("batch_put_from", codes, len(run)):
                    continue
                ok = np.asarray(codes) == 0
                taken[run.start:run.stop] = ok
                self.stats.add(stored=int(ok.sum()),
                               bytes_in=sum(length - HEADER_BYTES
                                            for length, good in zip(layout.lengths, ok) if good))
        return taken

    def get_into(self, keys, blocks: Sequence) -> np.ndarray:
        keys, blocks, sizes = _batch(keys, blocks, writable=True)
        got = np.zeros(keys.shape[0], np.bool_)
        corrupt = []
        with self._lock:
            for run in _Staging.batches(self._staging.size, sizes):
                layout = _Staging([sizes[i] for i in run])
                results = self._call(
                    "batch_get_into", lambda store, *args: store.batch_get_into(*args),
                    self._store, self._names(keys[run.start:run.stop]),
                    [self._staging.base + start for start in layout.starts], layout.lengths)
                if self._failed("batch_get_into", results, len(run)):
                    continue
                whole = []
                for j, i in enumerate(run):
                    if results[j] < HEADER_BYTES:
                        continue  # not there, or larger than its target: a miss
                    header = self._staging.view(layout.starts[j], HEADER_BYTES).view(np.uint64)
                    stored = _header(keys[i], int(header[2]), int(header[5]), int(header[6]))
                    if not np.array_equal(header, stored) \
                            or results[j] != HEADER_BYTES + int(header[2]):
                        corrupt.append(i)  # torn, misfiled, or not its own length
                    elif int(header[2]) == layout.lengths[j] - HEADER_BYTES \
                            and int(header[6]) == len(blocks[i]):
                        whole.append((j, i, int(header[5])))
                    # else: a whole block of another shape (another layout): a miss
                if not whole:
                    continue
                offsets, targets, counts = [], [], []
                piece_at = np.cumsum([0] + [len(blocks[i]) for i in run])
                for j, i, _ in whole:
                    offsets += layout.piece_offsets[piece_at[j]:piece_at[j + 1]]
                    targets += blocks[i]
                    counts.append(len(blocks[i]))
                sums = np.empty(len(targets), np.uint64)
                self._staging.copy_out_blocks(np.array(offsets, np.int64), targets, sums,
                                              self.seed)
                for (j, i, digest), computed in zip(whole, _block_digests(sums, counts,
                                                                          self.seed)):
                    if computed == digest:
                        got[i] = True
                    else:
                        corrupt.append(i)
            if corrupt:
                self._call("batch_remove", lambda store, names: store.batch_remove(names, True),
                           self._store, self._names(keys[sorted(corrupt)]))
        hits = int(got.sum())
        self.stats.add(hits=hits, misses=keys.shape[0] - hits, corrupt=len(corrupt),
                       bytes_out=sum(sum(sizes[i]) for i in np.flatnonzero(got)))
        return got

    def remove(self, keys) -> int:
        keys = _keys(keys)
        if not keys.shape[0]:
            return 0
        with self._lock:
            codes = self._call("batch_remove", lambda store, names: store.batch_remove(
                names, True), self._store, self._names(keys))
        if self._failed("batch_remove", codes, keys.shape[0]):
            return 0
        return int((np.asarray(codes) == 0).sum())

    def close(self) -> None:
        """Disconnect.  The staging stays mapped while a call that timed out
        may still write to it (it is unmapped when that call returns)."""
        if self._closed:
            return
        with self._lock:
            busy = self._busy
            if self._store is not None and (busy is None or busy.done()):
                store = self._store
                self._call("close", lambda: store.close())
            self._closed = True
            self._store = None
            self._worker.shutdown(wait=False)
            staging = self._staging
            if busy is None or busy.done():
                staging.close()
            else:
                busy.add_done_callback(lambda _: staging.close())


def open_tier(url: str, **options) -> Tier:
    """A tier from its URL, ``options`` overriding the URL's query.

    ``mooncake://MASTER_HOST:PORT?metadata=URL&protocol=tcp&...``: the
    query's keys are `MooncakeTier`'s parameters (``metadata`` defaults to
    ``http://MASTER_HOST:8080/metadata``, the master's own HTTP metadata
    server).  An unknown scheme or key is refused by name.
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "mooncake":
        raise ConfigError(f"unknown tier {url!r}: the tiers are mooncake://HOST:PORT")
    if not parsed.hostname or not parsed.port:
        raise ConfigError(f"tier {url!r} names no master HOST:PORT")
    known = {"metadata": str, "protocol": str, "device": str, "hostname": str,
             "segment_bytes": int, "staging_bytes": int, "timeout": float, "retry": float,
             "seed": int, "prefix": str}
    query = {}
    for key, values in urllib.parse.parse_qs(parsed.query, keep_blank_values=True).items():
        if key not in known:
            raise ConfigError(f"tier {url!r}: unknown option {key!r}; known: "
                              f"{', '.join(sorted(known))}")
        try:
            query[key] = known[key](values[-1])
        except ValueError:
            raise ConfigError(f"tier {url!r}: option {key}={values[-1]!r} is not "
                              f"{'a number' if known[key] is not str else 'valid'}") from None
    for key in options:
        if key not in known:
            raise ConfigError(f"unknown tier option {key!r}; known: {', '.join(sorted(known))}")
    query.update(options)
    query.setdefault("metadata", f"http://{parsed.hostname}:8080/metadata")
    return MooncakeTier(f"{parsed.hostname}:{parsed.port}", **query)
