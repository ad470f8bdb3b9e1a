# cython: language_level=3
"""C-level view of `ManagerFastPath` for other native modules (``cimport``):
a critical section that reads its own lines can check the grant in the same
fence (`invalidate_grant`, then the caller's fence, then `granted_fenced`)."""

from libc.stdint cimport int64_t, uint64_t

from tract._native._localmutex cimport LocalMutex
from tract._native._region cimport Region


cdef class ManagerFastPath:
    cdef Region pool
    cdef Region local_region
    cdef LocalMutex mutex
    cdef int64_t slot, request, manager_line, grant_base, last_grant
    cdef uint64_t me, max_nodes, passes_bound
    cdef public uint64_t epoch
    cdef readonly uint64_t seq

    cdef uint64_t *_slot(self) except NULL
    cdef void invalidate_grant(self) noexcept nogil
    cdef volatile uint64_t *_grant_fenced(self, uint64_t *manager_epoch) noexcept nogil
    cdef bint _mine(self, volatile uint64_t *grant, uint64_t manager_epoch) noexcept nogil
    cdef bint granted_fenced(self) noexcept nogil
    cdef volatile uint64_t *_fresh_grant(self, uint64_t *manager_epoch) noexcept nogil
    cdef int _attempt(self) noexcept nogil
    cdef void _give_back(self, uint64_t *slot) noexcept nogil
