# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Private: the native critical sections of the allocator's global path.

The protocol is `tract.alloc`'s; its Python steps are the reference, and they
are what runs under the simulator and the mutation harness.  This module does
the same steps, each critical section in one call, for a caller that holds
the pool's ``alloc`` lock through its manager-mode fast path, so an alloc or
free of whole chunks costs its cache-line round trips rather than ~40 Python
calls:

``alloc``       `Allocator._find`'s common case, the lock's fencing check
                (R6), then `Allocator._publish`;
``free``        `Allocator._extent`'s common case, the fencing check, then
                `Allocator._release`;
``fresh_kind``  the kind of a chunk's owner record, for `Allocator.free`.

The grant line is invalidated with the first lines a section reads and read
after the same fence (FACTS: one fence per batch of misses).  A section
never decides a hard case and writes nothing before it knows it has none:
no free run (reclaim, `PoolFull`), a cursor out of range, a head record that
is not a whole, in-range extent or slab of the kind expected (R5), or a grant
no longer this node's all return -1, and the caller goes on with the
reference, which reclaims or raises with the full message.  The bitmap scan
is the Numba kernel `tract._kernels.bitmap.first_free_run`, called through
its C address.  tests/test_alloc_fast.py runs both on the same memory states
and requires the same results and the same bytes.

Rules relied on (DESIGN.md): R2 — every line written here is written only by
the ``alloc`` lock's holder; R3 — owner records are flushed and fenced before
the bits that publish them, bits before the records they retire; the final
flushes are fenced by the lock's release; R4 — cursor, bitmap, records and
the grant are invalidated and fenced before they are read, and a record line
shared with a neighbour before it is partly written (a line written whole
replaces memory whatever was cached); R5 — as above; R6 — the
grant is checked after the last read and before the first write.
"""

from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memset

from tract._native._lockfast cimport ManagerFastPath
from tract._native._region cimport Region, trace_state, tract_trace_bind

cdef extern from "_cachectl.h" nogil:
    void tract_lines(int insn, const char *addr, size_t length) noexcept
    void tract_fence() noexcept

tract_trace_bind(trace_state())  # one cache-control trace per process (_region.pxd)

ctypedef int64_t (*scan_fn)(const uint64_t *words, int64_t nwords, int64_t nbits,
                            int64_t count, int64_t start) noexcept nogil

cdef enum:
    LINE = 64
    OWNER_BYTES = 32
    KIND_SLAB = 1
    KIND_HEAD = 2
    KIND_TAIL = 3
    PAYLOAD_OWNERS = 16  # record ranges longer than this are invalidated with the payload insn


# the layout constants compiled in, for the rules test that holds them to
# the Python definitions (tract.lease.LINE, tract.alloc.OWNER_BYTES)
LINE_BYTES = LINE
OWNER_RECORD_BYTES = OWNER_BYTES


cdef class ChunkFastPath:
    """One pool's global-path metadata: the cursor line, the bitmap of
    ``nchunks`` bits and the owner records.  Offsets are checked here once;
    every call checks that the mapping was not closed since and that the
    lock's fast path is over the same mapping."""

    cdef Region pool
    cdef int64_t cursor_line, bitmap, bitmap_bytes, owners, nchunks, max_nodes
    cdef scan_fn scan

    def __cinit__(self, Region pool, int64_t cursor_line, int64_t bitmap, int64_t bitmap_bytes,
                  int64_t owners, int64_t nchunks, int64_t max_nodes, size_t scan_address):
        if nchunks < 1 or bitmap_bytes * 8 < nchunks or bitmap_bytes % LINE:
            raise ValueError(f"{nchunks} chunks do not fit a bitmap of {bitmap_bytes} bytes "
                             f"in whole lines")
        for name, offset in (("cursor line", cursor_line), ("bitmap", bitmap),
                             ("owner records", owners)):
            if offset % LINE:
                raise ValueError(f"{name} offset {offset} is not {LINE}-byte aligned")
        if scan_address == 0:
            raise ValueError("the bitmap scan's address is NULL")
        pool._check(cursor_line, LINE)
        pool._check(bitmap, bitmap_bytes)
        pool._check(owners, nchunks * OWNER_BYTES)
        self.pool = pool
        self.cursor_line, self.bitmap, self.bitmap_bytes = cursor_line, bitmap, bitmap_bytes
        self.owners, self.nchunks, self.max_nodes = owners, nchunks, max_nodes
        self.scan = <scan_fn>scan_address

    cdef char *_begin(self, ManagerFastPath granted) except NULL:
        """Checks, then the grant lines invalidated (the section fences)."""
        if self.pool._base == NULL:
            raise ValueError(f"allocator fast path over {self.pool.path!r}: the mapping is closed")
        if granted.pool is not self.pool:
            raise ValueError("the lock's fast path is over another mapping")
        granted._slot()
        granted.invalidate_grant()
        return self.pool._base

    cdef inline uint64_t *_record(self, char *base, int64_t chunk) noexcept nogil:
        return <uint64_t *>(base + self.owners + chunk * OWNER_BYTES)

    cdef inline void _bitmap_lines(self, char *base, int insn, int64_t first, int64_t end
                                   ) noexcept nogil:
        """``insn`` over the bitmap lines of bits [first, end)."""
        cdef int64_t low = first // 512 * LINE, high = (end - 1) // 512 * LINE + LINE
        tract_lines(insn, base + self.bitmap + low, high - low)

    cdef void _set_bits(self, char *base, int64_t first, int64_t count, bint value) noexcept nogil:
        """Set or clear bits [first, first + count) in the (fresh) bitmap and
        flush the lines written; the caller fences."""
        cdef uint64_t *words = <uint64_t *>(base + self.bitmap)
        cdef int64_t end = first + count, index, low, high
        cdef uint64_t mask
        for index in range(first // 64, (end - 1) // 64 + 1):
            low = max(first, index * 64) - index * 64
            high = min(end, index * 64 + 64) - index * 64
            mask = (<uint64_t>-1 if high - low == 64
                    else ((<uint64_t>1 << (high - low)) - 1)) << low
            words[index] = (words[index] | mask) if value else (words[index] & ~mask)
        self._bitmap_lines(base, self.pool._flush_insn, first, end)

    cdef void _fresh_partial_lines(self, char *base, int64_t first, int64_t count) noexcept nogil:
        """`Allocator._fresh_partial_lines`: before records [first, first +
        count) are written, fresh copies of the lines they share with
        neighbours (a line written whole needs none), fenced."""
        cdef int64_t start = self.owners + first * OWNER_BYTES
        cdef int64_t end = start + count * OWNER_BYTES
        cdef bint head = start % LINE != 0
        cdef bint tail = end % LINE != 0 and (not head or (end - 1) // LINE != start // LINE)
        if head:
            tract_lines(self.pool._invalidate_insn, base + start, 1)
        if tail:
            tract_lines(self.pool._invalidate_insn, base + end - 1, 1)
        if head or tail:
            tract_fence()

    def alloc(self, int64_t count, int kind, uint64_t owner, uint64_t epoch,
              ManagerFastPath granted not None):
        """Take a run of ``count`` chunks for ``owner`` (the record word
        without its kind) and ``epoch``: the first chunk, or -1 with nothing
        written (no free run from the cursor, a cursor out of range, the
        grant no longer this node's: the reference decides)."""
        cdef char *base = self._begin(granted)
        if not 1 <= count <= self.nchunks:
            return -1
        if kind != KIND_HEAD and not (kind == KIND_SLAB and count == 1):
            raise ValueError(f"alloc of kind {kind}: expected a slab chunk or an extent")
        cdef const uint64_t *words = <const uint64_t *>(base + self.bitmap)
        cdef uint64_t cursor
        cdef uint64_t *record
        cdef int64_t first, index
        tract_lines(self.pool._invalidate_insn, base + self.cursor_line, LINE)
        tract_lines(self.pool._payload_insn, base + self.bitmap, self.bitmap_bytes)
        tract_fence()
        cursor = (<const uint64_t *>(base + self.cursor_line))[0]
        if cursor >= <uint64_t>self.nchunks:
            return -1
        if count == 1 and not (words[cursor // 64] >> (cursor % 64)) & 1:
            first = <int64_t>cursor  # next fit: the cursor's chunk is free
        else:
            first = self.scan(words, self.bitmap_bytes // 8, self.nchunks, count, cursor)
        if first < 0 or not granted.granted_fenced():
            return -1
        self._fresh_partial_lines(base, first, count)
        record = self._record(base, first)
        record[0] = owner | <uint64_t>kind << 16
        record[1] = epoch
        record[2] = <uint64_t>count if kind == KIND_HEAD else 1
        record[3] = 0
        for index in range(1, count):
            record += OWNER_BYTES // 8
            record[0] = owner | <uint64_t>KIND_TAIL << 16
            record[1] = epoch
            record[2] = <uint64_t>first
            record[3] = 0
        tract_lines(self.pool._flush_insn, <char *>self._record(base, first), count * OWNER_BYTES)
        tract_fence()
        self._set_bits(base, first, count, True)
        (<uint64_t *>(base + self.cursor_line))[0] = <uint64_t>((first + count) % self.nchunks)
        tract_lines(self.pool._flush_insn, base + self.cursor_line, LINE)
        return first

    def free(self, int64_t first, int kind, ManagerFastPath granted not None):
        """Give back the allocation of ``kind`` (an extent, or a slab chunk)
        that starts at ``first``: its length in chunks, or -1 with nothing
        written (records not whole, in range and of that kind, the grant no
        longer this node's: the reference decides)."""
        cdef char *base = self._begin(granted)
        if not 0 <= first < self.nchunks:
            return -1
        cdef const uint64_t *record = self._record(base, first)
        cdef uint64_t node, run
        cdef int64_t index
        tract_lines(self.pool._invalidate_insn, <char *>record, OWNER_BYTES)
        self._bitmap_lines(base, self.pool._invalidate_insn, first, first + 1)
        tract_fence()
        if not granted.granted_fenced():
            return -1
        node, run = record[0] & 0xFFFF, record[2]
        if node == 0 or node > <uint64_t>self.max_nodes or (record[0] >> 16) & 0xFF != kind:
            return -1
        if kind == KIND_SLAB:
            run = 1
        elif kind != KIND_HEAD or not 1 <= run <= <uint64_t>(self.nchunks - first):
            return -1
        if run > 1:
            tract_lines(self.pool._payload_insn if run - 1 > PAYLOAD_OWNERS
                        else self.pool._invalidate_insn,
                        <char *>self._record(base, first + 1), (run - 1) * OWNER_BYTES)
            index = (first // 512 + 1) * 512  # the first bit on the next bitmap line
            if index < first + <int64_t>run:
                self._bitmap_lines(base, self.pool._invalidate_insn, index, first + run)
            tract_fence()
        for index in range(1, <int64_t>run):
            record += OWNER_BYTES // 8
            if (record[0] >> 16) & 0xFF != KIND_TAIL or record[2] != <uint64_t>first:
                return -1
        self._set_bits(base, first, run, False)
        tract_fence()
        memset(self._record(base, first), 0, run * OWNER_BYTES)
        tract_lines(self.pool._flush_insn, <char *>self._record(base, first), run * OWNER_BYTES)
        return <int64_t>run

    def fresh_kind(self, int64_t chunk):
        """The kind field of chunk ``chunk``'s owner record, fresh; a hint
        for the caller, who decides under the lock (-1 out of range)."""
        if self.pool._base == NULL:
            raise ValueError(f"allocator fast path over {self.pool.path!r}: the mapping is closed")
        if not 0 <= chunk < self.nchunks:
            return -1
        cdef char *record = <char *>self._record(self.pool._base, chunk)
        tract_lines(self.pool._invalidate_insn, record, OWNER_BYTES)
        tract_fence()
        return (<const uint64_t *>record)[0] >> 16 & 0xFF
