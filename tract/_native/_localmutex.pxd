# cython: language_level=3
"""C-level view of `LocalMutex` for other native modules (``cimport``)."""

from tract._native._pthread cimport pthread_mutex_t


cdef class LocalMutex:
    cdef pthread_mutex_t *_mutex
    cdef object _region
    cdef str _where


cdef int raise_code(int code, str call, str where) except -1
cdef int wait(LocalMutex mutex, timeout) except -1
