# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Private: the handoff record's steps, each one native call.

The protocol and the layout are `tract.handoff`'s; its Python steps are the
reference, and they are what runs under the simulator and the mutation
harness.  This module does the same steps on a real mapping, each in one
call, with the same cache-control operations in the same fenced batches
(tests/test_twins.py holds each to its reference by result, bytes and
trace):

``write``     the whole record (head, check word, taken line zeroed, keys)
              copied in by streaming stores, in memory on return;
``read``      the head line dropped, fenced, read and checked; only then
              the keys dropped, fenced, read, and the record held to its
              check word;
``mark``      the taken word written, its line flushed, fenced;
``taken``     every taken line asked about dropped, one fence, read;
``withdraw``  the magic cleared, its line flushed, fenced.

Rules relied on (DESIGN.md): R2 — the producer writes the head line and the
keys, a decoder only the taken line; R3 — the record is in memory before
`write` returns, the taken mark and the withdrawal are flushed and fenced;
R4 — `read` and `taken` drop what they read and fence first; R5 — every
offset is checked to be a line inside the heap, a record's count against the
heap's end, and the record against its check word.  R6 (the producer live in
the record's epoch before a mark) is the caller's check: it reads other
rooms' lines (`tract.handoff.HandoffRecords.mark_taken`).
"""

import numpy as np

from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from tract._native._region cimport Region, trace_state, tract_trace_bind

cdef extern from "_cachectl.h" nogil:
    void tract_lines(int insn, const char *addr, size_t length) noexcept
    void tract_fence() noexcept
    void tract_copy_in_nt(int kind, int insn, char *dst, const char *src, size_t n) noexcept
    uint64_t tract_xxh64(const char *p, size_t n, uint64_t seed) noexcept

tract_trace_bind(trace_state())  # one cache-control trace per process (_region.pxd)

cdef enum:
    LINE = 64
    CHECKED = 48  # head bytes under the check word (all but the check itself)
    TAKEN_AT = 64
    KEYS_AT = 128

cdef uint64_t MAGIC = 0x324F487463617274ULL  # b"tractHO2", little-endian
cdef uint64_t TAKEN = 0x7A6B656E74616B65ULL  # the taken word: nonce ^ this

# the layout constants compiled in, for the rules test that holds them to
# tract.handoff's
MAGIC_WORD = MAGIC
TAKEN_WORD = TAKEN
KEYS_OFFSET = KEYS_AT


cdef class HandoffFastPath:
    """The handoff records of one mapping, whose heap is [``low``,
    ``high``) and whose node ids are below ``max_nodes``."""

    cdef Region pool
    cdef int64_t low, high
    cdef uint64_t max_nodes

    def __cinit__(self, Region pool, int64_t low, int64_t high, uint64_t max_nodes):
        if low < 0 or high < low + KEYS_AT or low % LINE:
            raise ValueError(f"heap [{low}, {high}) holds no handoff record")
        pool._check(low, high - low)
        self.pool, self.low, self.high, self.max_nodes = pool, low, high, max_nodes

    cdef char *_base(self, int64_t offset) except NULL:
        """The mapping's base, once ``offset`` is known to be a record's
        line inside the heap (R5)."""
        if self.pool._base == NULL:
            raise ValueError(f"handoff fast path over {self.pool.path!r}: the mapping is closed")
        if offset % LINE or not self.low <= offset <= self.high - KEYS_AT:
            raise ValueError(f"handoff record offset {offset} is not a line inside the heap "
                             f"[{self.low}, {self.high})")
        return self.pool._base

    def write(self, int64_t offset, uint64_t nonce, uint64_t node, uint64_t epoch,
              double deadline, const uint64_t[:, ::1] keys):
        """The record of ``keys`` ((n, 2) uint64) at ``offset``, in memory
        on return (R3)."""
        cdef char *base = self._base(offset)
        cdef int64_t count = keys.shape[0], size = KEYS_AT + 16 * count
        if keys.shape[1] != 2:
            raise ValueError(f"keys must be (n, 2) uint64, got {keys.shape[1]} columns")
        if size > self.high - offset:
            raise ValueError(f"a record of {count} keys at {offset} ends past the heap's end "
                             f"{self.high}")
        cdef char *body = <char *>malloc(size)
        if body == NULL:
            raise MemoryError()
        cdef uint64_t *head = <uint64_t *>body
        try:
            memset(body, 0, KEYS_AT)
            head[0], head[1], head[2], head[3] = MAGIC, nonce, node, epoch
            memcpy(&head[4], &deadline, 8)
            head[5] = <uint64_t>count
            if count:
                memcpy(body + KEYS_AT, &keys[0, 0], 16 * count)
            # the check word covers the head's first 48 bytes, then the keys
            memcpy(body + KEYS_AT - CHECKED, body, CHECKED)
            head[6] = tract_xxh64(body + KEYS_AT - CHECKED, CHECKED + 16 * count, nonce)
            memset(body + KEYS_AT - CHECKED, 0, CHECKED)
            with nogil:
                tract_copy_in_nt(self.pool._nt_kind, self.pool._writeback_insn, base + offset,
                                 body, size)
        finally:
            free(body)

    def read(self, int64_t offset, uint64_t nonce, double now):
        """(node, epoch, deadline, keys) of the live record at ``offset``
        with ``nonce``, read fresh (R4) and checked (R5); None when there is
        none (expired, withdrawn, or the memory reused)."""
        cdef char *base = self._base(offset)
        cdef const uint64_t *head = <const uint64_t *>(base + offset)
        cdef double deadline
        cdef uint64_t count
        with nogil:
            tract_lines(self.pool._payload_insn, base + offset, LINE)
            tract_fence()
        cdef uint64_t found[7]
        memcpy(found, head, 56)
        memcpy(&deadline, &found[4], 8)
        count = found[5]
        if found[0] != MAGIC or found[1] != nonce or found[2] >= self.max_nodes or \
                count > <uint64_t>((self.high - offset - KEYS_AT) // 16) or deadline < now:
            return None
        with nogil:
            tract_lines(self.pool._payload_insn, base + offset + KEYS_AT, 16 * count)
            tract_fence()
        checked = np.empty(CHECKED + 16 * count, np.uint8)
        cdef unsigned char[::1] view = checked
        memcpy(&view[0], found, CHECKED)
        if count:
            memcpy(&view[CHECKED], base + offset + KEYS_AT, 16 * count)
        if tract_xxh64(<const char *>&view[0], CHECKED + 16 * count, nonce) != found[6]:
            return None
        keys = np.empty((count, 2), np.uint64)
        cdef uint64_t[:, ::1] out = keys
        if count:
            memcpy(&out[0, 0], &view[CHECKED], 16 * count)
        return found[2], found[3], deadline, keys

    def mark(self, int64_t offset, uint64_t nonce):
        """The record's taken word written, flushed and fenced (R3)."""
        cdef char *base = self._base(offset)
        with nogil:
            (<volatile uint64_t *>(base + offset + TAKEN_AT))[0] = nonce ^ TAKEN
            tract_lines(self.pool._flush_insn, base + offset + TAKEN_AT, LINE)
            tract_fence()

    def taken(self, const int64_t[::1] offsets, const uint64_t[::1] nonces):
        """Whether each record's taken line holds its mark, read fresh (R4):
        every line dropped, one fence."""
        cdef Py_ssize_t n = offsets.shape[0], i
        if nonces.shape[0] != n:
            raise ValueError(f"{n} record offsets but {nonces.shape[0]} nonces")
        cdef char *base = self.pool._base
        for i in range(n):
            base = self._base(offsets[i])
        with nogil:
            for i in range(n):
                tract_lines(self.pool._payload_insn, base + offsets[i] + TAKEN_AT, LINE)
            tract_fence()
        return [(<volatile uint64_t *>(base + offsets[i] + TAKEN_AT))[0] == nonces[i] ^ TAKEN
                for i in range(n)]

    def withdraw(self, int64_t offset):
        """The record's magic cleared, flushed and fenced (R3): a decoder
        that reads it afterwards finds no offer."""
        cdef char *base = self._base(offset)
        with nogil:
            (<volatile uint64_t *>(base + offset))[0] = 0
            tract_lines(self.pool._flush_insn, base + offset, LINE)
            tract_fence()
