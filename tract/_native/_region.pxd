# cython: language_level=3
"""C-level view of `Region` for other native modules (``cimport``).

A native user reads ``_base`` on every call and treats NULL as closed; it
checks its offsets once against ``_size`` when it is built.  A module that
includes ``_cachectl.h`` binds its primitives to the process's one
cache-control trace when it loads: ``tract_trace_bind(trace_state())``.
"""

from cpython.buffer cimport Py_buffer
from libc.stdint cimport int64_t, uint8_t, uint64_t

cdef extern from "_cachectl.h" nogil:
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
    void tract_trace_bind(tract_trace_t *shared) noexcept


cdef class Region:
    cdef char *_base
    cdef size_t _size
    cdef readonly str path
    cdef readonly str kind
    cdef readonly object cache_control
    cdef int _flush_insn
    cdef int _invalidate_insn
    cdef int _writeback_insn
    cdef int _payload_insn
    cdef int _nt_kind
    cdef Py_ssize_t _exports

    cdef int _check(self, int64_t offset, int64_t length) except -1
    cdef int _check_aligned(self, int64_t offset, int width) except -1
    cdef int _check_lines(self, const int64_t[::1] offsets, int width) except -1
    cdef Py_buffer *_views(self, const int64_t[::1] offsets, buffers, uint64_t[::1] sums,
                           int64_t piece, bint writable, Py_ssize_t *got) except NULL


cdef tract_trace_t *trace_state() noexcept nogil
