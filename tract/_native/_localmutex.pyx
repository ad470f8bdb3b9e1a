# cython: language_level=3
"""Private: a robust, process-shared pthread mutex placed in a mapping.

Tier 1 of the two-tier lock (DESIGN.md §3): node-local memory only (a small
file in /dev/shm keyed by pool and node), never the CXL pool — a pthread
mutex relies on atomics and coherence, which only hold inside one host.
When a holder dies, the next ``acquire`` returns ``True`` (EOWNERDEAD): the
caller repairs what the dead holder guarded, then calls ``consistent``.
"""

from libc.string cimport strerror
from libc.stdint cimport uintptr_t
from posix.time cimport CLOCK_REALTIME, clock_gettime, timespec

from tract._native._pthread cimport (
    EBUSY, EOWNERDEAD, ETIMEDOUT, PTHREAD_MUTEX_ROBUST, PTHREAD_PROCESS_SHARED,
    pthread_mutex_consistent, pthread_mutex_init, pthread_mutex_lock, pthread_mutex_t,
    pthread_mutex_timedlock, pthread_mutex_trylock, pthread_mutex_unlock,
    pthread_mutexattr_destroy, pthread_mutexattr_init, pthread_mutexattr_setpshared,
    pthread_mutexattr_setrobust, pthread_mutexattr_t)

SIZE = sizeof(pthread_mutex_t)


cdef int raise_code(int code, str call, str where) except -1:
    raise OSError(code, f"{call} on local mutex {where} failed: {strerror(code).decode()}")


cdef int wait(LocalMutex mutex, timeout) except -1:
    """Block (without the GIL) until ``mutex`` is ours: 0, or EOWNERDEAD when
    its last holder died holding it.  TimeoutError after ``timeout`` s."""
    cdef int code
    cdef timespec deadline
    if timeout is None:
        with nogil:
            code = pthread_mutex_lock(mutex._mutex)
    else:
        clock_gettime(CLOCK_REALTIME, &deadline)
        whole = int(timeout)
        deadline.tv_sec += whole
        deadline.tv_nsec += int((timeout - whole) * 1e9)
        if deadline.tv_nsec >= 1000000000:
            deadline.tv_sec += 1
            deadline.tv_nsec -= 1000000000
        with nogil:
            code = pthread_mutex_timedlock(mutex._mutex, &deadline)
    if code == 0 or code == EOWNERDEAD:
        return code
    if code == ETIMEDOUT:
        raise TimeoutError(f"local mutex {mutex._where} still held after {timeout} s")
    return raise_code(code, "pthread_mutex_lock", mutex._where)


cdef class LocalMutex:
    """A robust process-shared mutex at ``offset`` of ``region`` (a node-local mapping)."""

    # fields: _localmutex.pxd

    def __cinit__(self, region, Py_ssize_t offset):
        if offset % 8:
            raise ValueError(f"local mutex offset {offset} is not 8-byte aligned")
        self._mutex = <pthread_mutex_t *><uintptr_t>region.address(offset)
        region.address(offset + SIZE)  # the whole mutex lies inside the mapping
        self._region = region  # keeps the mapping alive
        self._where = f"{region.path}+{offset}"

    def initialize(self):
        """Make a fresh mutex here; only the creator of the file does this."""
        cdef pthread_mutexattr_t attr
        cdef int code = pthread_mutexattr_init(&attr)
        if code:
            raise_code(code, "pthread_mutexattr_init", self._where)
        try:
            for code, call in ((pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED),
                                "pthread_mutexattr_setpshared"),
                               (pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST),
                                "pthread_mutexattr_setrobust"),
                               (pthread_mutex_init(self._mutex, &attr), "pthread_mutex_init")):
                if code:
                    raise_code(code, call, self._where)
        finally:
            pthread_mutexattr_destroy(&attr)

    def acquire(self, timeout=None):
        """Take the mutex.  Returns True when the previous holder died
        holding it (call `consistent` after repairing), False otherwise.
        Raises TimeoutError after ``timeout`` seconds."""
        return wait(self, timeout) == EOWNERDEAD

    def try_acquire(self):
        """Take the mutex if free: None if busy, else as `acquire`."""
        cdef int code = pthread_mutex_trylock(self._mutex)
        if code == 0:
            return False
        if code == EOWNERDEAD:
            return True
        if code == EBUSY:
            return None
        raise_code(code, "pthread_mutex_trylock", self._where)

    def consistent(self):
        """Declare the state a dead holder left repaired (after EOWNERDEAD)."""
        cdef int code = pthread_mutex_consistent(self._mutex)
        if code:
            raise_code(code, "pthread_mutex_consistent", self._where)

    def release(self):
        cdef int code = pthread_mutex_unlock(self._mutex)
        if code:
            raise_code(code, "pthread_mutex_unlock", self._where)
