# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Private: one mapped pool and the cache-control primitives over it.

The public layer is ``tract.region``; this module may change freely.

Contract (DESIGN.md R1, R5): callers name memory by offset from the start of
the mapping, never by address; every offset and length is checked against the
mapping's size before any byte is touched, and a violation raises
``tract.errors.BoundsError`` naming the offset, the length and the size.
Typed loads and stores are naturally aligned, so each is one single-copy
atomic access on the host that makes it.

Which cache-maintenance instruction serves each action is decided by the
caller (``tract.platform.cache_control``) when it maps the pool and stored in
the Region; nothing here asks the CPU again on a hot path.
"""

from cpython.buffer cimport (PyBuffer_FillInfo, PyBuffer_Release, PyObject_GetBuffer,
                             PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_SIMPLE, PyBUF_WRITABLE)
from libc.errno cimport errno
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset, strcmp, strerror
from posix.mman cimport MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap, munmap
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from posix.types cimport off_t

import numpy

from tract.errors import BoundsError, ConfigError

cdef extern from "sys/mman.h" nogil:
    int MAP_POPULATE

cdef extern from "_cachectl.h" nogil:
    const char *TRACT_BUILD_PATH
    int TRACT_LINE
    unsigned long long TRACT_CHECK_PRIME, TRACT_CHECK_ADD
    int TRACT_HAS_CLFLUSH, TRACT_HAS_CLFLUSHOPT, TRACT_HAS_CLWB, TRACT_HAS_SSE2
    int TRACT_HAS_AVX2, TRACT_HAS_AVX512F, TRACT_HAS_DC
    int TRACT_INSN_NONE, TRACT_INSN_CLFLUSH, TRACT_INSN_CLFLUSHOPT, TRACT_INSN_CLWB
    int TRACT_INSN_DC_CIVAC, TRACT_INSN_DC_CVAC
    int TRACT_NT_NONE, TRACT_NT_SSE2, TRACT_NT_AVX2, TRACT_NT_AVX512
    int tract_cpu_features() noexcept
    void tract_lines(int insn, const char *addr, size_t length) noexcept
    void tract_fence() noexcept
    void tract_store_fence() noexcept
    void tract_load_fence() noexcept
    void tract_copy_in_nt(int kind, int insn, char *dst, const char *src, size_t n) noexcept
    void tract_stream_in(int kind, int insn, char *dst, const char *src, size_t n) noexcept
    void tract_stream_out(int kind, char *dst, const char *src, size_t n) noexcept
    void tract_private_fence() noexcept
    uint64_t tract_cas_u64(uint64_t *addr, uint64_t expected, uint64_t desired) noexcept
    uint32_t tract_add_u32_bounded(uint32_t *addr, int64_t delta) noexcept
    uint64_t tract_add_u64(uint64_t *addr, int64_t delta) noexcept
    uint64_t tract_xxh64(const char *p, size_t n, uint64_t seed) noexcept
    uint64_t tract_digest_copy(char *dst, const char *src, size_t n, uint64_t seed, int nt,
                               int kind, int insn) noexcept
    ctypedef struct tract_shadow_t:
        char *base
        size_t lines
        uint8_t *memory
        uint8_t *fetched
        uint8_t *queued
        uint8_t *kinds
        int64_t *queue
        size_t count
    ctypedef struct tract_trace_t:
        int64_t *entries
        tract_shadow_t shadow
    tract_trace_t *tract_trace
    void tract_trace_begin(int64_t *entries, size_t capacity) noexcept
    size_t tract_trace_end() noexcept
    int TRACT_TRACE_FENCE, TRACT_TRACE_STORE_FENCE, TRACT_TRACE_LOAD_FENCE, TRACT_TRACE_STREAM

LINE = TRACT_LINE
#: a `Region.copy_out_blocks` batch this big or bigger goes into the targets by
#: streaming stores: it would not stay in the caches, and a plain copy reads each
#: target line before overwriting it (measured: 1.29x memcpy's rate at 256 KiB)
cdef int64_t _STREAM_OUT = 2 << 20
STREAM_OUT_BYTES = _STREAM_OUT
CHECK_PRIME, CHECK_ADD = TRACT_CHECK_PRIME, TRACT_CHECK_ADD  # tract.lines has the same
BUILD_PATH = TRACT_BUILD_PATH.decode()

INSTRUCTIONS = {
    "none": TRACT_INSN_NONE,
    "clflush": TRACT_INSN_CLFLUSH,
    "clflushopt": TRACT_INSN_CLFLUSHOPT,
    "clwb": TRACT_INSN_CLWB,
    "dc civac": TRACT_INSN_DC_CIVAC,
    "dc cvac": TRACT_INSN_DC_CVAC,
}

#: trace ops of the fences (a line operation's op is its entry in `INSTRUCTIONS`)
TRACE_FENCE = TRACT_TRACE_FENCE
TRACE_STORE_FENCE = TRACT_TRACE_STORE_FENCE
TRACE_LOAD_FENCE = TRACT_TRACE_LOAD_FENCE
#: a line written by streaming stores: the shadow memory's, never in a trace's entries
TRACE_STREAM = TRACT_TRACE_STREAM

cdef tract_trace_t *trace_state() noexcept nogil:
    return tract_trace

_trace_buffer = None  # the entries of the trace that is on (kept alive while it is)

NONTEMPORAL = {
    "none": TRACT_NT_NONE,
    "sse2": TRACT_NT_SSE2,
    "avx2": TRACT_NT_AVX2,
    "avx512": TRACT_NT_AVX512,
}


def cpu_features():
    """The cache-control and vector features of this CPU and OS, by name."""
    cdef int f = tract_cpu_features()
    return {
        "clflush": bool(f & TRACT_HAS_CLFLUSH),
        "clflushopt": bool(f & TRACT_HAS_CLFLUSHOPT),
        "clwb": bool(f & TRACT_HAS_CLWB),
        "sse2": bool(f & TRACT_HAS_SSE2),
        "avx2": bool(f & TRACT_HAS_AVX2),
        "avx512f": bool(f & TRACT_HAS_AVX512F),
        "dc": bool(f & TRACT_HAS_DC),
    }


cdef inline uint64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <uint64_t>ts.tv_sec * 1000000000 + <uint64_t>ts.tv_nsec


cdef class Region:
    """A shared mapping of a pool, addressed by offset.

    Made by ``tract.region.create_region`` / ``open_region``; not directly.
    The mapping stays valid while any buffer view of it is alive: ``close``
    refuses to unmap under exported views.
    """

    # fields: _region.pxd (other native modules read _base, _size and the
    # instruction choices; they check _base != NULL on every call)

    def __cinit__(self):
        self._base = NULL
        self._size = 0
        self._exports = 0

    def __dealloc__(self):
        if self._base != NULL:
            munmap(self._base, self._size)
            self._base = NULL

    # ---------------------------------------------------------------- checks

    cdef int _check(self, int64_t offset, int64_t length) except -1:
        if self._base == NULL:
            raise ValueError(f"region {self.path!r} is closed")
        if offset < 0 or length < 0 or <uint64_t>offset > self._size \
                or <uint64_t>length > self._size - <uint64_t>offset:
            raise BoundsError(
                f"offset {offset} + length {length} is outside region {self.path!r} "
                f"of size {self._size}")
        return 0

    cdef int _check_aligned(self, int64_t offset, int width) except -1:
        self._check(offset, width)
        if offset & (width - 1):
            raise BoundsError(
                f"offset {offset} is not aligned to {width} bytes for a "
                f"{width * 8}-bit access in region {self.path!r}")
        return 0

    # ------------------------------------------------------------ properties

    @property
    def size(self):
        """Length of the mapping in bytes."""
        return self._size

    @property
    def base(self):
        """Address of offset 0 in this process (differs between processes)."""
        self._check(0, 0)
        return <uintptr_t>self._base

    @property
    def closed(self):
        return self._base == NULL

    @property
    def nontemporal(self):
        """Name of the streaming-store path ``copy_in`` uses."""
        for name, kind in NONTEMPORAL.items():
            if kind == self._nt_kind:
                return name

    def address(self, int64_t offset):
        """Address in this process of ``offset`` (``size`` is allowed: the end)."""
        self._check(offset, 0)
        return <uintptr_t>self._base + <uintptr_t>offset

    def offset_of(self, uintptr_t address):
        """Offset of an address inside this mapping."""
        self._check(0, 0)
        if address < <uintptr_t>self._base or address - <uintptr_t>self._base > self._size:
            raise BoundsError(
                f"address {address:#x} is outside region {self.path!r} mapped at "
                f"{<uintptr_t>self._base:#x} with size {self._size}")
        return address - <uintptr_t>self._base

    # -------------------------------------------------------- buffer exports

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        self._check(0, 0)
        PyBuffer_FillInfo(buffer, self, self._base, self._size, 0, flags)
        self._exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self._exports -= 1

    def view(self, int64_t offset=0, length=None):
        """Zero-copy numpy uint8 array over ``[offset, offset + length)``."""
        cdef int64_t n = (<int64_t>self._size - offset) if length is None else length
        self._check(offset, n)
        return numpy.frombuffer(self, dtype=numpy.uint8, count=n, offset=offset)

    def close(self):
        """Unmap.  Refused while views of the mapping are alive."""
        if self._base == NULL:
            return
        if self._exports:
            raise BufferError(
                f"cannot close region {self.path!r}: {self._exports} buffer view(s) "
                f"of it are still alive")
        munmap(self._base, self._size)
        self._base = NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._base == NULL else f"size={self._size}"
        return f"<Region {self.path!r} {self.kind} {state} {self.cache_control}>"

    # ----------------------------------------------- typed loads and stores

    def load_u8(self, int64_t offset):
        self._check(offset, 1)
        return (<volatile uint8_t *>(self._base + offset))[0]

    def load_u16(self, int64_t offset):
        self._check_aligned(offset, 2)
        return (<volatile uint16_t *>(self._base + offset))[0]

    def load_u32(self, int64_t offset):
        self._check_aligned(offset, 4)
        return (<volatile uint32_t *>(self._base + offset))[0]

    def load_u64(self, int64_t offset):
        self._check_aligned(offset, 8)
        return (<volatile uint64_t *>(self._base + offset))[0]

    def load_u64s(self, int64_t offset, int count):
        """``count`` consecutive u64 at an 8-aligned offset, as a tuple (one
        call for a line's fields; each load is single-copy atomic)."""
        if count < 0:
            raise ValueError(f"count {count} is negative")
        self._check_aligned(offset, 8)
        self._check(offset, count * 8)
        cdef volatile uint64_t *words = <volatile uint64_t *>(self._base + offset)
        return tuple([words[i] for i in range(count)])

    def store_u8(self, int64_t offset, value):
        self._check(offset, 1)
        (<volatile uint8_t *>(self._base + offset))[0] = _fit(value, 0xFF, "u8", offset)

    def store_u16(self, int64_t offset, value):
        self._check_aligned(offset, 2)
        (<volatile uint16_t *>(self._base + offset))[0] = _fit(value, 0xFFFF, "u16", offset)

    def store_u32(self, int64_t offset, value):
        self._check_aligned(offset, 4)
        (<volatile uint32_t *>(self._base + offset))[0] = _fit(value, 0xFFFFFFFF, "u32", offset)

    def store_u64(self, int64_t offset, value):
        self._check_aligned(offset, 8)
        (<volatile uint64_t *>(self._base + offset))[0] = _fit(value, 0xFFFFFFFFFFFFFFFF, "u64", offset)

    def compare_exchange_u64(self, int64_t offset, expected, desired):
        """Atomically store ``desired`` at ``offset`` if it holds ``expected``;
        returns the value found.  Only for pools declared
        ``coherence="hardware"``: non-coherent hosts share no atomics."""
        self._check_aligned(offset, 8)
        if self.cache_control.coherence != "hardware":
            raise ConfigError(f"compare_exchange_u64 on region {self.path!r}: atomics across "
                              f"hosts need coherence='hardware', this pool is "
                              f"{self.cache_control.coherence!r}")
        cdef uint64_t old = _fit(expected, 0xFFFFFFFFFFFFFFFF, "u64", offset)
        cdef uint64_t new = _fit(desired, 0xFFFFFFFFFFFFFFFF, "u64", offset)
        return tract_cas_u64(<uint64_t *>(self._base + offset), old, new)

    # -------------------------------------------------------- cache control

    def flush(self, int64_t offset, int64_t length, bint payload=False):
        """Write back and drop the lines of a range (R3, before publishing).

        ``payload=True`` uses the pool's payload instruction, for bulk data
        whose publication a later fence and metadata flush order.
        """
        self._check(offset, length)
        with nogil:
            tract_lines(self._payload_insn if payload else self._flush_insn,
                        self._base + offset, length)

    def invalidate(self, int64_t offset, int64_t length, bint payload=False):
        """Drop the lines of a range so the next read comes from memory (R4).

        ``payload=True`` as for `flush`; the caller fences before reading.
        """
        self._check(offset, length)
        with nogil:
            tract_lines(self._payload_insn if payload else self._invalidate_insn,
                        self._base + offset, length)

    def writeback(self, int64_t offset, int64_t length):
        """Write back the lines of a range; they may stay cached."""
        self._check(offset, length)
        with nogil:
            tract_lines(self._writeback_insn, self._base + offset, length)

    def fence(self):
        """Full fence: flushes, loads and stores before it complete first."""
        tract_fence()

    def store_fence(self):
        """Store fence: orders stores, streaming stores, clflushopt and clwb."""
        tract_store_fence()

    def load_fence(self):
        """Load fence: later loads wait for earlier loads and flushes."""
        tract_load_fence()

    # ------------------------------------------------------------- copying

    def copy_in(self, int64_t offset, src, bint nontemporal=True):
        """Copy a C-contiguous buffer into the mapping at ``offset``.

        With ``nontemporal`` the bytes are in memory when this returns
        (streaming stores, the partial end lines written back, one sfence):
        no flush of the range is needed before publishing.  Without it this
        is a plain copy and the caller flushes (R3).
        """
        cdef Py_buffer source
        _get_buffer(src, &source, PyBUF_SIMPLE, "copy_in source")
        try:
            self._check(offset, source.len)
            with nogil:
                if nontemporal:
                    tract_copy_in_nt(self._nt_kind, self._writeback_insn,
                                     self._base + offset, <const char *>source.buf, source.len)
                else:
                    memcpy(self._base + offset, source.buf, source.len)
        finally:
            PyBuffer_Release(&source)

    def copy_out(self, int64_t offset, dst):
        """Copy ``len(dst)`` bytes at ``offset`` into a writable C-contiguous buffer.

        The caller invalidates the range first when another host wrote it (R4).
        """
        cdef Py_buffer target
        _get_buffer(dst, &target, PyBUF_SIMPLE | PyBUF_WRITABLE, "copy_out target")
        try:
            self._check(offset, target.len)
            with nogil:
                memcpy(target.buf, self._base + offset, target.len)
        finally:
            PyBuffer_Release(&target)

    def copy_in_blocks(self, const int64_t[::1] offsets, sources, uint64_t[::1] sums=None,
                       uint64_t seed=0, int64_t piece=0):
        """`copy_in` (non-temporal: in memory on return) of each buffer of
        ``sources`` to its offset, in one call without the GIL.  With
        ``sums``: the `digest` (``seed``) of each ``piece`` bytes of the
        sources in order (of each whole source when ``piece`` is 0), hashed
        as it is copied."""
        cdef Py_ssize_t n = offsets.shape[0], i, got = 0
        cdef Py_buffer *views = self._views(offsets, sources, sums, piece, False, &got)
        cdef int64_t at, size, k = 0
        try:
            with nogil:
                for i in range(n):
                    if sums is None:  # one stream per buffer, one fence per batch
                        tract_stream_in(self._nt_kind, self._writeback_insn,
                                        self._base + offsets[i], <const char *>views[i].buf,
                                        views[i].len)
                        continue
                    size = piece if piece > 0 else views[i].len
                    at = 0
                    while at < views[i].len:
                        sums[k] = tract_digest_copy(
                            self._base + offsets[i] + at, <const char *>views[i].buf + at,
                            size, seed, 1, self._nt_kind, self._writeback_insn)
                        k += 1
                        at += size
                tract_store_fence()  # every streaming store and write-back in memory (R3)
        finally:
            for i in range(got):
                PyBuffer_Release(&views[i])
            free(views)

    def copy_out_blocks(self, const int64_t[::1] offsets, targets, uint64_t[::1] sums=None,
                        uint64_t seed=0, int64_t piece=0):
        """Fill each buffer of ``targets`` from its offset, fresh: every
        range is dropped first (the payload instruction), then one fence
        (R4).  With ``sums``: the `digest` (``seed``) of each ``piece``
        bytes copied, in order (of each whole target when ``piece`` is 0).
        A batch of `STREAM_OUT_BYTES` or more goes into the targets by
        streaming stores (the line-aligned parts), fenced before the call
        returns."""
        cdef Py_ssize_t n = offsets.shape[0], i, got = 0
        cdef Py_buffer *views = self._views(offsets, targets, sums, piece, True, &got)
        cdef int64_t at, size, k = 0, total = 0
        cdef bint stream
        try:
            with nogil:
                for i in range(n):
                    tract_lines(self._payload_insn, self._base + offsets[i], views[i].len)
                    total += views[i].len
                tract_fence()
                stream = total >= _STREAM_OUT and self._nt_kind != TRACT_NT_NONE
                for i in range(n):
                    size = piece if piece > 0 else views[i].len
                    if sums is None:
                        if stream:
                            tract_stream_out(self._nt_kind, <char *>views[i].buf,
                                             self._base + offsets[i], views[i].len)
                        else:
                            memcpy(views[i].buf, self._base + offsets[i], views[i].len)
                        continue
                    at = 0
                    while at < views[i].len:
                        sums[k] = tract_digest_copy(<char *>views[i].buf + at,
                                                    self._base + offsets[i] + at, size, seed,
                                                    stream, self._nt_kind, TRACT_INSN_NONE)
                        k += 1
                        at += size
                if stream:
                    tract_private_fence()
        finally:
            for i in range(got):
                PyBuffer_Release(&views[i])
            free(views)

    def digest_blocks(self, const int64_t[::1] offsets, int64_t length, uint64_t[::1] sums,
                      uint64_t seed=0, int64_t piece=0):
        """The `digest` (``seed``) of each ``piece`` bytes (of each whole
        range when ``piece`` is 0) of the ``length``-byte ranges at
        ``offsets``, in order, into ``sums``, in one call without the GIL:
        bytes another agent (a DMA engine) moved, which no copy of this
        mapping hashed.  It reads the ranges as they are and issues no
        cache control: where another host wrote them, the caller dropped
        them and fenced first (R4)."""
        cdef Py_ssize_t n = offsets.shape[0], i
        cdef int64_t at, size = piece if piece > 0 else length, k = 0
        if length <= 0:
            raise ValueError(f"length must be positive, got {length}")
        if piece < 0 or length % size:
            raise ValueError(f"a {length}-byte range is not a whole number of "
                             f"{piece}-byte pieces")
        if sums.shape[0] != n * (length // size):
            raise ValueError(f"sums must hold {n * (length // size)} digests, got "
                             f"{sums.shape[0]}")
        for i in range(n):
            self._check(offsets[i], length)
        with nogil:
            for i in range(n):
                at = 0
                while at < length:
                    sums[k] = tract_digest_copy(NULL, self._base + offsets[i] + at, size, seed,
                                                0, self._nt_kind, TRACT_INSN_NONE)
                    k += 1
                    at += size

    cdef Py_buffer *_views(self, const int64_t[::1] offsets, buffers, uint64_t[::1] sums,
                           int64_t piece, bint writable, Py_ssize_t *got) except NULL:
        """The buffers, acquired, each checked against its range and, with
        ``piece``, cut into whole pieces; ``sums`` must hold a digest for
        each piece (or buffer).  The caller releases ``got[0]`` of them."""
        cdef Py_ssize_t n = offsets.shape[0], i
        cdef int64_t digests = 0
        what = "target" if writable else "source"
        if len(buffers) != n:
            raise ValueError(f"{n} offsets need as many {what}s, got {len(buffers)}")
        if piece < 0:
            raise ValueError(f"piece must be 0 or positive, got {piece}")
        cdef Py_buffer *views = <Py_buffer *>malloc(max(n, 1) * sizeof(Py_buffer))
        if views == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                _get_buffer(buffers[i], &views[i],
                            PyBUF_SIMPLE | (PyBUF_WRITABLE if writable else 0), f"{what} {i}")
                got[0] += 1
                self._check(offsets[i], views[i].len)
                if views[i].len == 0:
                    raise ValueError(f"{what} {i} is empty")
                if piece and views[i].len % piece:
                    raise ValueError(f"{what} {i} of {views[i].len} bytes is not a whole "
                                     f"number of {piece}-byte pieces")
                digests += views[i].len // piece if piece else 1
            if sums is not None and sums.shape[0] != digests:
                raise ValueError(f"sums must hold {digests} digests, got {sums.shape[0]}")
        except BaseException:
            for i in range(got[0]):
                PyBuffer_Release(&views[i])
            free(views)
            got[0] = 0
            raise
        return views

    def read(self, int64_t offset, int64_t length):
        """A copy of ``length`` bytes at ``offset`` as ``bytes``."""
        self._check(offset, length)
        return (self._base + offset)[:length]

    def fill(self, int64_t offset, int64_t length, int byte=0):
        """Set ``length`` bytes at ``offset`` to ``byte`` (plain stores)."""
        self._check(offset, length)
        if not 0 <= byte <= 0xFF:
            raise ValueError(f"fill byte {byte} is not in 0..255")
        with nogil:
            memset(self._base + offset, byte, length)

    # ---------------------------------------------------- batches of lines

    cdef int _check_lines(self, const int64_t[::1] offsets, int width) except -1:
        """Every offset in range, and aligned to a line (``width`` 64) or to
        ``width`` bytes."""
        cdef Py_ssize_t i
        for i in range(offsets.shape[0]):
            if width == TRACT_LINE and offsets[i] % TRACT_LINE:
                raise BoundsError(f"offset {offsets[i]} (item {i}) is not aligned to a "
                                  f"{LINE}-byte line in region {self.path!r}")
            if width < TRACT_LINE:
                self._check_aligned(offsets[i], width)
            else:
                self._check(offsets[i], width)
        return 0

    def invalidate_lines(self, const int64_t[::1] offsets, bint payload=False):
        """`invalidate` the line at each offset (a line-aligned int64 array);
        the caller fences once for the batch (R4)."""
        self._check_lines(offsets, TRACT_LINE)
        cdef int insn = self._payload_insn if payload else self._invalidate_insn
        cdef Py_ssize_t i
        with nogil:
            for i in range(offsets.shape[0]):
                tract_lines(insn, self._base + offsets[i], TRACT_LINE)

    def flush_lines(self, const int64_t[::1] offsets, bint payload=False):
        """`flush` the line at each offset (line-aligned); the caller fences (R3)."""
        self._check_lines(offsets, TRACT_LINE)
        cdef int insn = self._payload_insn if payload else self._flush_insn
        cdef Py_ssize_t i
        with nogil:
            for i in range(offsets.shape[0]):
                tract_lines(insn, self._base + offsets[i], TRACT_LINE)

    def gather_lines(self, const int64_t[::1] offsets, uint8_t[:, ::1] out):
        """Copy the line at each offset into the rows of ``out`` (n, 64)."""
        if out.shape[0] != offsets.shape[0] or out.shape[1] != LINE:
            raise ValueError(f"out must be ({offsets.shape[0]}, {LINE}) bytes, got "
                             f"({out.shape[0]}, {out.shape[1]})")
        self._check_lines(offsets, TRACT_LINE)
        cdef Py_ssize_t i
        with nogil:
            for i in range(offsets.shape[0]):
                memcpy(&out[i, 0], self._base + offsets[i], TRACT_LINE)

    def scatter_lines(self, const int64_t[::1] offsets, const uint8_t[:, ::1] lines):
        """Write the rows of ``lines`` (n, 64) to the line at each offset
        (plain stores; the caller flushes and fences)."""
        if lines.shape[0] != offsets.shape[0] or lines.shape[1] != LINE:
            raise ValueError(f"lines must be ({offsets.shape[0]}, {LINE}) bytes, got "
                             f"({lines.shape[0]}, {lines.shape[1]})")
        self._check_lines(offsets, TRACT_LINE)
        cdef Py_ssize_t i
        with nogil:
            for i in range(offsets.shape[0]):
                memcpy(self._base + offsets[i], &lines[i, 0], TRACT_LINE)

    def local_add_u32s(self, const int64_t[::1] offsets, int64_t delta):
        """Add ``delta`` to the u32 at each offset, atomically among the
        processes of this host only: for lines of this host's node (R2),
        such as its pin counters.  A sum outside 0..2**32-1 is not stored.
        Returns the values found (uint32 array)."""
        self._check_lines(offsets, 4)
        result = numpy.empty(offsets.shape[0], dtype=numpy.uint32)
        cdef uint32_t[::1] found = result
        cdef Py_ssize_t i
        with nogil:
            for i in range(offsets.shape[0]):
                found[i] = tract_add_u32_bounded(<uint32_t *>(self._base + offsets[i]), delta)
        return result

    def local_add_u64s(self, int64_t offset, const uint64_t[::1] deltas):
        """Add ``deltas[i]`` to the u64 at ``offset + 8 * i`` (wrapping),
        atomically among the processes of this host only: for lines of this
        host's node (R2), such as its counters."""
        self._check_aligned(offset, 8)
        self._check(offset, deltas.shape[0] * 8)
        cdef Py_ssize_t i
        with nogil:
            for i in range(deltas.shape[0]):
                if deltas[i]:
                    tract_add_u64(<uint64_t *>(self._base + offset) + i, <int64_t>deltas[i])

    def store_u32s(self, const int64_t[::1] offsets, uint32_t value):
        """Store ``value`` at each (4-byte aligned) offset."""
        self._check_lines(offsets, 4)
        cdef Py_ssize_t i
        with nogil:
            for i in range(offsets.shape[0]):
                (<volatile uint32_t *>(self._base + offsets[i]))[0] = value

    # ------------------------------------------------------------- tracing

    @property
    def tracing(self):
        """Whether a cache-control trace is on (`trace_start`): it records
        every thread's native steps, so a caller that would spread one
        step over threads keeps it on one while it is."""
        return tract_trace.entries != NULL

    def trace_start(self, Py_ssize_t capacity=1 << 16, memory=None):
        """Record the cache control of this thread from now on, in every
        native step and kernel of the process (DESIGN.md §5): each line a
        flush, invalidate or write-back touches, and each fence, in call
        order, up to ``capacity`` entries.  One trace at a time.

        With ``memory`` (a writable C-contiguous uint8 array of whole lines,
        at most the mapping's size), this thread's steps also run against a
        shadow memory over the mapping's first ``len(memory)`` bytes: the
        mapping is then this host's cache, ``memory`` what memory holds,
        and only flushes, write-backs and streaming stores completed by a
        fence move bytes to it; an invalidated line is fetched from it at
        the fence (``_cachectl.h``, the shadow memory).  Each line's cache
        bytes count as fetched clean when the trace starts."""
        global _trace_buffer
        if capacity <= 0:
            raise ValueError(f"trace capacity must be positive, got {capacity}")
        if tract_trace.entries != NULL:
            raise RuntimeError("a cache-control trace is already on; trace_stop it first")
        self._check(0, 0)
        cdef uint8_t[::1] shadow_memory, fetched, queued, kinds
        cdef int64_t[::1] queue
        cdef size_t lines = 0
        if memory is not None:
            shadow_memory = memory
            if shadow_memory.shape[0] % LINE or <size_t>shadow_memory.shape[0] > self._size \
                    or shadow_memory.shape[0] == 0:
                raise ValueError(f"a shadow memory must be whole {LINE}-byte lines, at most "
                                 f"the mapping's {self._size} bytes; got "
                                 f"{shadow_memory.shape[0]} bytes")
            lines = shadow_memory.shape[0] // LINE
            fetched = numpy.frombuffer(self._base[:lines * LINE], dtype=numpy.uint8).copy()
            queued = numpy.zeros(lines * LINE, dtype=numpy.uint8)
            kinds = numpy.zeros(lines, dtype=numpy.uint8)
            queue = numpy.zeros(lines, dtype=numpy.int64)
        buffer = numpy.zeros((capacity, 2), dtype=numpy.int64)
        cdef int64_t[:, ::1] entries = buffer
        _trace_buffer = (buffer, memory, None, None, None, None) if memory is None else \
            (buffer, memory, fetched, queued, kinds, queue)
        tract_trace_begin(&entries[0, 0], capacity)
        if lines:
            tract_trace.shadow.memory = &shadow_memory[0]
            tract_trace.shadow.fetched = &fetched[0]
            tract_trace.shadow.queued = &queued[0]
            tract_trace.shadow.kinds = &kinds[0]
            tract_trace.shadow.queue = &queue[0]
            tract_trace.shadow.lines = lines
            tract_trace.shadow.count = 0
            tract_trace.shadow.base = self._base

    def trace_stop(self):
        """End the trace; an ``(n, 2)`` int64 array of ``(op, offset)``.

        ``op`` is the instruction of a line operation (its value in
        `INSTRUCTIONS`; an instruction ``none`` issues nothing and is not
        recorded) with the line's offset in this mapping, or a fence
        (`TRACE_FENCE`, `TRACE_STORE_FENCE`, `TRACE_LOAD_FENCE`) with
        offset -1.  Lines of other mappings are left out.  A trace that
        outgrew its capacity raises `OverflowError` (nothing is dropped
        silently)."""
        global _trace_buffer
        if tract_trace.entries == NULL:
            raise RuntimeError("no cache-control trace is on")
        cdef size_t made = tract_trace_end()
        buffer, _trace_buffer = _trace_buffer[0], None
        if made > <size_t>buffer.shape[0]:
            raise OverflowError(f"the cache-control trace held {buffer.shape[0]} entries "
                                f"and {made} were made: start it with more")
        self._check(0, 0)
        trace = buffer[:made].copy()
        fences = trace[:, 0] >= TRACT_TRACE_FENCE
        trace[fences, 1] = -1
        lines = ~fences
        trace[lines, 1] -= <int64_t><uintptr_t>self._base
        inside = fences | ((trace[:, 1] >= 0) & (trace[:, 1] < <int64_t>self._size))
        return trace[inside]

    # -------------------------------------------------- measured primitives

    def time_flush_lines(self, int64_t offset, int64_t nlines, bint dirty, int repeats=3):
        """Best nanoseconds per line to flush ``nlines`` lines, dirty or clean."""
        self._check(offset, nlines * LINE)
        cdef char *start = self._base + offset
        cdef uint64_t t0, best = <uint64_t>-1
        cdef int64_t i
        cdef int r
        with nogil:
            for r in range(repeats):
                tract_lines(self._flush_insn, start, nlines * TRACT_LINE)
                tract_fence()
                if dirty:
                    for i in range(nlines):
                        (<volatile uint64_t *>(start + i * TRACT_LINE))[0] += 1
                t0 = _now_ns()
                tract_lines(self._flush_insn, start, nlines * TRACT_LINE)
                tract_fence()
                t0 = _now_ns() - t0
                if t0 < best:
                    best = t0
        return best / <double>nlines

    def time_round_trip(self, int64_t offset, int64_t iterations):
        """Nanoseconds per store + flush + fence on the line at ``offset``.

        This is the unit the project's metadata costs are quoted in.
        """
        self._check_aligned(offset, 8)
        cdef volatile uint64_t *word = <volatile uint64_t *>(self._base + offset)
        cdef uint64_t t0
        cdef int64_t i
        with nogil:
            t0 = _now_ns()
            for i in range(iterations):
                word[0] = <uint64_t>i
                tract_lines(self._flush_insn, <const char *>word, 8)
                tract_fence()
            t0 = _now_ns() - t0
        return t0 / <double>iterations


cdef int _get_buffer(obj, Py_buffer *view, int flags, str what) except -1:
    try:
        PyObject_GetBuffer(obj, view, flags)
    except (BufferError, ValueError, TypeError) as error:
        need = "a writable C-contiguous buffer" if flags & PyBUF_WRITABLE else "a C-contiguous buffer"
        raise type(error)(f"{what} must be {need} (got {type(obj).__name__}): {error}") from None
    return 0


cdef inline uint64_t _fit(value, uint64_t limit, str width, int64_t offset) except? 0:
    if not 0 <= value <= limit:
        raise OverflowError(f"value {value!r} does not fit in {width} (0..{limit}) at offset {offset}")
    return <uint64_t>value


# the widest vector kind this CPU hashes with (digest without a region)
cdef int _VECTOR_KIND = (TRACT_NT_AVX512 if tract_cpu_features() & TRACT_HAS_AVX512F else
                         TRACT_NT_AVX2 if tract_cpu_features() & TRACT_HAS_AVX2 else
                         TRACT_NT_NONE)


def digest(data, uint64_t seed=0):
    """The digest `Region.copy_in_blocks` computes of one piece: XXH3-64
    (``xxhash.xxh3_64``) above 240 bytes, XXH64 (``xxhash.xxh64``) up to it."""
    cdef Py_buffer view
    cdef uint64_t result
    _get_buffer(data, &view, PyBUF_SIMPLE, "digest data")
    try:
        with nogil:
            result = tract_digest_copy(NULL, <const char *>view.buf, view.len, seed, 0,
                                       _VECTOR_KIND, TRACT_INSN_NONE)
        return result
    finally:
        PyBuffer_Release(&view)


def xxh64(data, uint64_t seed=0):
    """XXH64 of a C-contiguous buffer (the payload checksum of
    `Region.copy_in_blocks`; bit-exact with ``xxhash.xxh64``)."""
    cdef Py_buffer view
    cdef uint64_t digest
    _get_buffer(data, &view, PyBUF_SIMPLE, "xxh64 data")
    try:
        with nogil:
            digest = tract_xxh64(<const char *>view.buf, view.len, seed)
        return digest
    finally:
        PyBuffer_Release(&view)


def flat_segments(const int64_t[::1] offsets, blocks, int64_t block_bytes, int64_t piece,
                  bytes typed):
    """A transfer's walk over its blocks, for the common case, without a
    Python step per segment: every block a list or tuple of C-contiguous
    buffers (or one such buffer) of unsigned bytes or of format ``typed``
    (the layout's element, as ``memoryview`` names it), each a whole
    number of ``piece`` bytes, ``block_bytes`` in all.  Returns each
    segment's pool offset (its block's, plus the bytes of the segments
    before it) and the segments, flat; None for anything else, which the
    caller's own walk checks and explains.  Reads no pool memory."""
    cdef Py_ssize_t n = offsets.shape[0], i, count = 0, k = 0
    cdef Py_buffer view
    cdef int64_t total
    cdef const char *format
    cdef const char *want = typed
    if len(blocks) != n or piece <= 0:
        return None
    for block in blocks:
        count += len(block) if isinstance(block, (list, tuple)) else 1
    where = numpy.empty(count, dtype=numpy.int64)
    cdef int64_t[::1] at = where
    flat = []
    for i in range(n):
        block = blocks[i]
        segments = block if isinstance(block, (list, tuple)) else (block,)
        total = 0
        for segment in segments:
            try:
                PyObject_GetBuffer(segment, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
            except (BufferError, ValueError, TypeError):
                return None
            format = view.format
            good = (format == NULL or strcmp(format, "B") == 0 or strcmp(format, want) == 0) \
                and view.len > 0 and view.len % piece == 0
            at[k] = offsets[i] + total
            total += view.len
            PyBuffer_Release(&view)
            if not good:
                return None
            flat.append(segment)
            k += 1
        if total != block_bytes:
            return None
    return where, flat


def xxh64_rows(const uint64_t[:, ::1] rows, uint64_t seed=0):
    """`xxh64` of each row of a C-contiguous (n, k) uint64 array (a block's
    piece digests: its checksum), as an (n,) uint64 array."""
    cdef Py_ssize_t i, n = rows.shape[0]
    cdef size_t width = rows.shape[1] * sizeof(uint64_t)
    if width == 0:
        raise ValueError("xxh64_rows needs rows of at least one digest")
    out = numpy.empty(n, dtype=numpy.uint64)
    cdef uint64_t[::1] sums = out
    with nogil:
        for i in range(n):
            sums[i] = tract_xxh64(<const char *>&rows[i, 0], width, seed)
    return out


def map_fd(int fd, size_t size, off_t file_offset, str path, str kind, cache_control,
           bint populate=False):
    """Map ``size`` bytes of ``fd`` from ``file_offset`` shared and read-write.

    ``cache_control`` is a ``tract.platform.CacheControl``; its instruction
    and streaming-copy names are resolved here once.
    """
    if size == 0:
        raise ValueError(f"cannot map {path!r}: size is 0")
    cdef int flags = MAP_SHARED | (MAP_POPULATE if populate else 0)
    cdef void *base
    with nogil:
        base = mmap(NULL, size, PROT_READ | PROT_WRITE, flags, fd, file_offset)
    if base == MAP_FAILED:
        code = errno
        raise OSError(code, f"mmap of {size} bytes at offset {file_offset} of {path!r} "
                            f"(MAP_SHARED, read-write) failed: {strerror(code).decode()}", path)
    cdef Region region = Region.__new__(Region)
    region._base = <char *>base
    region._size = size
    region.path = path
    region.kind = kind
    region.cache_control = cache_control
    region._flush_insn = INSTRUCTIONS[cache_control.flush]
    region._invalidate_insn = INSTRUCTIONS[cache_control.invalidate]
    region._writeback_insn = INSTRUCTIONS[cache_control.writeback]
    region._payload_insn = INSTRUCTIONS[cache_control.payload]
    region._nt_kind = NONTEMPORAL[cache_control.nontemporal]
    return region


# ------------------------------------------------ for Numba kernels (C API)
# Exported through ``__pyx_capi__`` so that `tract._kernels.cachectl` binds
# them as external functions of jitted kernels; addresses are of a mapping
# the caller holds open and has range-checked.

cdef api void tract_api_lines(int insn, uint64_t address, int64_t length) noexcept nogil:
    tract_lines(insn, <const char *><uintptr_t>address, <size_t>length)


cdef api void tract_api_fence() noexcept nogil:
    tract_fence()


cdef api uint32_t tract_api_add_u32(uint64_t address, int64_t delta) noexcept nogil:
    return tract_add_u32_bounded(<uint32_t *><uintptr_t>address, delta)
