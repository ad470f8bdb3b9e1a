# cython: language_level=3
"""Raw declarations of the robust process-shared pthread mutex (one place)."""

from posix.time cimport timespec

cdef extern from "errno.h" nogil:
    int EBUSY, EOWNERDEAD, ETIMEDOUT

cdef extern from "pthread.h" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_mutexattr_t:
        pass
    int PTHREAD_PROCESS_SHARED
    int PTHREAD_MUTEX_ROBUST
    int pthread_mutexattr_init(pthread_mutexattr_t *)
    int pthread_mutexattr_destroy(pthread_mutexattr_t *)
    int pthread_mutexattr_setpshared(pthread_mutexattr_t *, int)
    int pthread_mutexattr_setrobust(pthread_mutexattr_t *, int)
    int pthread_mutex_init(pthread_mutex_t *, const pthread_mutexattr_t *)
    int pthread_mutex_lock(pthread_mutex_t *)
    int pthread_mutex_trylock(pthread_mutex_t *)
    int pthread_mutex_timedlock(pthread_mutex_t *, const timespec *)
    int pthread_mutex_unlock(pthread_mutex_t *)
    int pthread_mutex_consistent(pthread_mutex_t *)
