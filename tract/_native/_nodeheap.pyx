# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Private: a node's slab heap, in node-local shared memory.

Objects up to half a chunk are carved from *slabs*: chunks this node took
from the pool's global bitmap (`tract.alloc`), each cut into equal blocks of
one size class (``min_block`` x 2**k).  The heap lives in a node-local file
(one host: coherent, atomics allowed, no flushes), shared by every process
of the node under one robust mutex, so the common alloc and free touch no
pool memory at all.

Layout of the heap region (from ``offset``):

    0     the mutex slot (`_lockfast.SLOT_BYTES`)
    128   header line: magic, chunks, chunk size, min block, classes, epoch,
          then the count of empty slabs (every block free: `trim`'s to give
          back), kept by every step that changes a slab's free count, and
          the count of blocks held by `ADOPTED` (the adopted-block sweep's)
    192   class lines: per class the first slab with a free block (chunk + 1)
    256   one record per chunk of the pool: class + 1 (0: not a slab of this
          node), free blocks, next and previous slab of its class with a
          free block (chunk + 1), then the block owners: the pid of the
          process each block was given to (0: free)

The owners make blocks of a dead process findable (`slabs`), and are
the truth: after a holder died inside the mutex (EOWNERDEAD), `repair`
rebuilds counts and lists from them.  The pool side of a slab (its owner
record, the global bitmap) is `tract.alloc`'s.
"""

from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memset

from tract._native._localmutex cimport LocalMutex, raise_code, wait
from tract._native._pthread cimport EBUSY, EOWNERDEAD, pthread_mutex_trylock, pthread_mutex_unlock
from tract._native._region cimport Region

from tract.errors import ConfigError, CorruptionError

cdef extern from "unistd.h" nogil:
    int getpid()

cdef enum:
    LINE = 64
    HEADER = 128
    CLASS_LINES = 192
    RECORDS = 256
    MAX_CLASSES = 16
    RECORD_HEAD = 16  # class+1, free, next, prev: u32 each

HEAP_MAGIC = 0x5041_4548_5443_4152  # "RACTHEAP"
NOT_MINE = -1  # `free`: the offset is not a block of this node's slabs
NOT_HELD = -2  # `free` with a holder: that process no longer holds the block
#: the holder of the blocks of an adopted slab (`add_slab` with a holder):
#: a gone node's slab that this node took over, each block held until the
#: reference to it is dropped and the block freed (no process has this pid)
cdef uint32_t _ADOPTED = 0xFFFFFFFF
ADOPTED = _ADOPTED


cdef class NodeHeap:
    """The slab heap of one node (see the module docstring)."""

    cdef Region local
    cdef LocalMutex mutex
    cdef int64_t offset, heap_base, chunk_size, min_block, record_bytes
    cdef uint32_t nchunks, nclasses, blocks_max
    cdef readonly int pid

    def __cinit__(self, Region local, LocalMutex mutex, int64_t offset, uint32_t nchunks,
                  int64_t chunk_size, int64_t min_block, int64_t heap_base):
        if min_block < 64 or min_block & (min_block - 1):
            raise ConfigError(f"min block {min_block} must be a power of two >= 64")
        if chunk_size < 2 * min_block or chunk_size & (chunk_size - 1):
            raise ConfigError(f"chunk size {chunk_size} must be a power of two >= 2 x min "
                              f"block ({min_block})")
        self.blocks_max = <uint32_t>(chunk_size // min_block)
        self.nclasses = 0
        while (min_block << self.nclasses) * 2 <= chunk_size:
            self.nclasses += 1
        if self.nclasses > MAX_CLASSES:
            raise ConfigError(f"chunk size {chunk_size} / min block {min_block} gives "
                              f"{self.nclasses} size classes; at most {MAX_CLASSES}")
        self.record_bytes = (RECORD_HEAD + 4 * self.blocks_max + LINE - 1) // LINE * LINE
        local._check(offset, heap_bytes(nchunks, chunk_size, min_block))
        if <char *>mutex._mutex != local._base + offset:
            raise ValueError(f"the heap mutex is not at the start of the heap ({offset})")
        self.local, self.mutex, self.offset = local, mutex, offset
        self.nchunks, self.chunk_size, self.min_block = nchunks, chunk_size, min_block
        self.heap_base = heap_base
        self.pid = getpid()

    # ------------------------------------------------------------ layout

    cdef inline char *_base(self) except NULL:
        if self.local._base == NULL:
            raise ValueError(f"node heap {self.local.path!r} is closed")
        return self.local._base + self.offset

    cdef inline uint32_t *_record(self, char *base, uint32_t chunk) noexcept nogil:
        return <uint32_t *>(base + RECORDS + <int64_t>chunk * self.record_bytes)

    cdef inline uint32_t *_head(self, char *base, uint32_t cls) noexcept nogil:
        return <uint32_t *>(base + CLASS_LINES) + cls

    cdef inline uint32_t _blocks(self, uint32_t cls) noexcept nogil:
        return self.blocks_max >> cls

    cdef inline uint64_t *_empty(self, char *base) noexcept nogil:
        """The count of empty slabs (header word 6)."""
        return <uint64_t *>(base + HEADER) + 6

    cdef inline uint64_t *_adopted(self, char *base) noexcept nogil:
        """The count of blocks held by `ADOPTED` (header word 7)."""
        return <uint64_t *>(base + HEADER) + 7

    cdef inline void _unlink(self, char *base, uint32_t chunk) noexcept nogil:
        cdef uint32_t *record = self._record(base, chunk)
        cdef uint32_t cls = record[0] - 1
        if record[3]:
            self._record(base, record[3] - 1)[2] = record[2]
        else:
            self._head(base, cls)[0] = record[2]
        if record[2]:
            self._record(base, record[2] - 1)[3] = record[3]
        record[2] = record[3] = 0

    cdef inline void _link(self, char *base, uint32_t chunk) noexcept nogil:
        cdef uint32_t *record = self._record(base, chunk)
        cdef uint32_t *head = self._head(base, record[0] - 1)
        record[3] = 0
        record[2] = head[0]
        if head[0]:
            self._record(base, head[0] - 1)[3] = chunk + 1
        head[0] = chunk + 1

    # ------------------------------------------------------------- mutex

    cdef int _lock(self, char *base) except -1:
        cdef int code = pthread_mutex_trylock(self.mutex._mutex)
        if code == EBUSY:
            code = wait(self.mutex, None)
        elif code != 0 and code != EOWNERDEAD:
            raise_code(code, "pthread_mutex_trylock", self.mutex._where)
        if code == EOWNERDEAD:  # its last holder died mid-update
            self._rebuild(base)
            self.mutex.consistent()
        return 0

    cdef int _unlock(self) except -1:
        cdef int code = pthread_mutex_unlock(self.mutex._mutex)
        if code:
            raise_code(code, "pthread_mutex_unlock", self.mutex._where)
        return 0

    cdef void _rebuild(self, char *base) noexcept nogil:
        """Counts and free lists from the block owners (the truth)."""
        cdef uint32_t chunk, block, cls, free
        cdef uint32_t *record
        memset(base + CLASS_LINES, 0, LINE)
        self._empty(base)[0] = 0
        self._adopted(base)[0] = 0
        for chunk in range(self.nchunks):
            record = self._record(base, chunk)
            record[2] = record[3] = 0
            if record[0] == 0 or record[0] > self.nclasses:
                record[0] = 0
                continue
            cls = record[0] - 1
            free = 0
            for block in range(self._blocks(cls)):
                free += record[4 + block] == 0
                self._adopted(base)[0] += record[4 + block] == _ADOPTED
            record[1] = free
            if free:
                self._link(base, chunk)
            if free == self._blocks(cls):
                self._empty(base)[0] += 1

    # --------------------------------------------------------------- API

    def format(self, uint64_t epoch):
        """Empty the heap for node incarnation ``epoch`` (under the caller's
        flock, and the heap's mutex: a node that rejoins formats it while
        its other processes and threads may be at it)."""
        cdef char *base = self._base()
        cdef uint64_t *header = <uint64_t *>(base + HEADER)
        self._lock(base)
        try:
            memset(base + HEADER, 0, heap_bytes(self.nchunks, self.chunk_size, self.min_block)
                   - HEADER)
            header[1], header[2], header[3], header[4], header[5] = \
                self.nchunks, self.chunk_size, self.min_block, self.nclasses, epoch
            header[0] = HEAP_MAGIC
        finally:
            self._unlock()

    @property
    def epoch(self):
        """The node incarnation this heap belongs to (0: never formatted)."""
        cdef uint64_t *header = <uint64_t *>(self._base() + HEADER)
        if header[0] != HEAP_MAGIC:
            return 0
        if (header[1], header[2], header[3], header[4]) != \
                (self.nchunks, self.chunk_size, self.min_block, self.nclasses):
            raise CorruptionError(f"node heap {self.local.path!r} was made for another pool "
                                  f"shape: {header[1]} chunks of {header[2]} bytes")
        return header[5]

    @property
    def max_size(self):
        """The largest object a slab serves (half a chunk)."""
        return self.chunk_size // 2

    def size_class(self, int64_t size):
        """(class index, block size) serving ``size`` bytes."""
        if size <= 0 or size > self.chunk_size // 2:
            raise ValueError(f"size {size} is outside 1..{self.chunk_size // 2} for a slab")
        cdef uint32_t cls = 0
        while (self.min_block << cls) < size:
            cls += 1
        return cls, self.min_block << cls

    def alloc(self, int64_t size):
        """Pool offset of a free block of ``size``'s class, given to this
        process; -1 when no slab of the class has a free block (the caller
        adds one with `add_slab`)."""
        cdef char *base = self._base()
        cls, _ = self.size_class(size)
        cdef uint32_t *record
        cdef uint32_t chunk, block
        cdef int64_t result = -1
        self._lock(base)
        head = self._head(base, cls)[0]
        if head:
            chunk = head - 1
            record = self._record(base, chunk)
            for block in range(self._blocks(cls)):
                if record[4 + block] == 0:
                    if record[1] == self._blocks(cls):
                        self._empty(base)[0] -= 1
                    record[4 + block] = self.pid
                    record[1] -= 1
                    if record[1] == 0:
                        self._unlink(base, chunk)
                    result = (self.heap_base + <int64_t>chunk * self.chunk_size
                              + <int64_t>block * (self.min_block << cls))
                    break
        self._unlock()
        return result

    def alloc_many(self, int64_t size, int64_t[::1] out):
        """Fill ``out`` with pool offsets of free blocks of ``size``'s class,
        given to this process, under one hold of the mutex; returns how many
        (fewer than ``len(out)`` when the class's slabs ran out: the caller
        adds one with `add_slab` for the rest)."""
        cdef char *base = self._base()
        cls, _ = self.size_class(size)
        cdef uint32_t *record
        cdef uint32_t chunk, block, head, blocks = self._blocks(cls)
        cdef int64_t filled = 0, before, step = self.min_block << cls
        self._lock(base)
        while filled < out.shape[0]:
            head = self._head(base, cls)[0]
            if not head:
                break
            chunk = head - 1
            record = self._record(base, chunk)
            before = filled
            for block in range(blocks):
                if record[4 + block] == 0:
                    if record[1] == blocks:
                        self._empty(base)[0] -= 1
                    record[4 + block] = self.pid
                    record[1] -= 1
                    out[filled] = self.heap_base + <int64_t>chunk * self.chunk_size + block * step
                    filled += 1
                    if record[1] == 0 or filled == out.shape[0]:
                        break
            if record[1] == 0:
                self._unlink(base, chunk)
            elif filled == before:  # a count the blocks belie: left to `alloc` to judge
                break
        self._unlock()
        return filled

    def add_slab(self, uint32_t chunk, int64_t size, uint32_t holder=0):
        """Make ``chunk`` (just taken from the global bitmap) a slab of
        ``size``'s class; with ``holder``, every block held by it (a slab
        adopted whole, `ADOPTED`: its blocks come free one by one)."""
        cdef char *base = self._base()
        cdef uint32_t block
        if chunk >= self.nchunks:
            raise ValueError(f"chunk {chunk} is outside 0..{self.nchunks - 1}")
        cls, _ = self.size_class(size)
        self._lock(base)
        record = self._record(base, chunk)
        try:
            if record[0]:
                raise CorruptionError(f"chunk {chunk} is already a slab of this node")
            memset(record, 0, self.record_bytes)
            record[0] = cls + 1
            if holder:
                for block in range(self._blocks(cls)):
                    record[4 + block] = holder
                if holder == _ADOPTED:
                    self._adopted(base)[0] += self._blocks(cls)
            else:
                record[1] = self._blocks(cls)
                self._link(base, chunk)
                self._empty(base)[0] += 1
        finally:
            self._unlock()

    cdef uint32_t *_slab_of(self, char *base, int64_t offset, int64_t *block) except? NULL:
        """Under the mutex: the record of this node's slab that holds pool
        ``offset`` (``block[0]``: the block's index in it), or NULL when no
        slab of this node does.  Raises ValueError for an offset inside a
        block."""
        cdef int64_t relative = offset - self.heap_base
        if relative < 0 or relative >= <int64_t>self.nchunks * self.chunk_size:
            return NULL
        cdef uint32_t chunk = <uint32_t>(relative // self.chunk_size)
        cdef uint32_t *record = self._record(base, chunk)
        if record[0] == 0:
            return NULL
        cdef int64_t size = self.min_block << (record[0] - 1)
        if relative % self.chunk_size % size:
            raise ValueError(f"offset {offset} is inside a {size}-byte block of chunk {chunk}, "
                             f"not at its start")
        block[0] = relative % self.chunk_size // size
        return record

    def free(self, int64_t offset, uint32_t holder=0):
        """Free the block at pool ``offset``: its slab's remaining used
        blocks (0: the slab is empty), or NOT_MINE when no slab of this node
        holds it.  Raises ValueError for an offset inside a block, or a
        block already free.  With ``holder`` (a pid): only while that
        process holds the block, else NOT_HELD (freed or given out again
        meanwhile)."""
        cdef char *base = self._base()
        cdef int64_t block
        cdef uint32_t *record
        self._lock(base)
        try:
            record = self._slab_of(base, offset, &block)
            if record == NULL:
                return NOT_MINE
            if holder and record[4 + block] != holder:
                return NOT_HELD
            if record[4 + block] == 0:
                raise ValueError(f"block at offset {offset} is already free (double free)")
            if record[4 + block] == _ADOPTED:
                self._adopted(base)[0] -= 1
            record[4 + block] = 0
            record[1] += 1
            if record[1] == 1:
                self._link(base, <uint32_t>((offset - self.heap_base) // self.chunk_size))
            if record[1] == self._blocks(record[0] - 1):
                self._empty(base)[0] += 1
            return self._blocks(record[0] - 1) - record[1]
        finally:
            self._unlock()

    def holder(self, int64_t offset):
        """The pid of the process that holds the block at pool ``offset``
        (0: the block is free), or NOT_MINE when no slab of this node holds
        it; raises ValueError for an offset inside a block."""
        cdef char *base = self._base()
        cdef int64_t block
        cdef uint32_t *record
        self._lock(base)
        try:
            record = self._slab_of(base, offset, &block)
            return NOT_MINE if record == NULL else record[4 + block]
        finally:
            self._unlock()

    def drop_slab(self, uint32_t chunk):
        """Forget ``chunk`` if it is an empty slab (its chunk goes back to the
        global bitmap); False when a block was taken meanwhile."""
        cdef char *base = self._base()
        if chunk >= self.nchunks:
            raise ValueError(f"chunk {chunk} is outside 0..{self.nchunks - 1}")
        self._lock(base)
        try:
            record = self._record(base, chunk)
            if record[0] == 0 or record[1] != self._blocks(record[0] - 1):
                return False
            self._unlink(base, chunk)
            self._empty(base)[0] -= 1
            record[0] = record[1] = 0
            return True
        finally:
            self._unlock()

    def forget_slab(self, uint32_t chunk):
        """Forget ``chunk`` whatever it holds (it was reclaimed for the pool)."""
        cdef char *base = self._base()
        cdef uint32_t block
        if chunk >= self.nchunks:
            raise ValueError(f"chunk {chunk} is outside 0..{self.nchunks - 1}")
        self._lock(base)
        try:
            record = self._record(base, chunk)
            if record[0]:
                if record[1]:
                    self._unlink(base, chunk)
                if record[0] <= self.nclasses:
                    if record[1] == self._blocks(record[0] - 1):
                        self._empty(base)[0] -= 1
                    for block in range(self._blocks(record[0] - 1)):
                        self._adopted(base)[0] -= record[4 + block] == _ADOPTED
                memset(record, 0, self.record_bytes)
        finally:
            self._unlock()

    @property
    def empty_slabs(self):
        """How many slabs have every block free (read without the mutex: a
        hint for `trim`, which decides under it)."""
        return self._empty(self._base())[0]

    @property
    def adopted_blocks(self):
        """How many blocks `ADOPTED` holds (read without the mutex: a hint
        for the adopted-block sweep, which decides under it)."""
        return self._adopted(self._base())[0]

    def empty_chunks(self):
        """The chunks of this node's empty slabs (a walk of every record,
        only when `empty_slabs` says there is one)."""
        cdef char *base = self._base()
        cdef uint32_t chunk
        cdef uint32_t *record
        found = []
        self._lock(base)
        try:
            for chunk in range(self.nchunks):
                record = self._record(base, chunk)
                if record[0] and record[0] <= self.nclasses \
                        and record[1] == self._blocks(record[0] - 1):
                    found.append(chunk)
        finally:
            self._unlock()
        return found

    def slabs(self):
        """[(chunk, block size, [(block offset, owner pid), ...])] for every
        slab of this node: what fsck and `tract pool info` report."""
        cdef char *base = self._base()
        cdef uint32_t chunk, block, cls
        cdef uint32_t *record
        result = []
        self._lock(base)
        try:
            for chunk in range(self.nchunks):
                record = self._record(base, chunk)
                if record[0] == 0:
                    continue
                cls = record[0] - 1
                size = self.min_block << cls
                start = self.heap_base + <int64_t>chunk * self.chunk_size
                used = [(start + block * size, record[4 + block])
                        for block in range(self._blocks(cls)) if record[4 + block]]
                result.append((chunk, size, used))
        finally:
            self._unlock()
        return result

    def release_blocks(self, blocks):
        """Free the given (offset, pid) blocks of processes that died, each
        only while that pid still holds it; returns how many were freed."""
        freed = 0
        for offset, pid in blocks:
            if self.free(offset, pid) >= 0:
                freed += 1
        return freed


def heap_bytes(uint32_t nchunks, int64_t chunk_size, int64_t min_block):
    """Size of a node heap region for a pool of ``nchunks`` chunks."""
    cdef int64_t record = (RECORD_HEAD + 4 * (chunk_size // min_block) + LINE - 1) // LINE * LINE
    return RECORDS + <int64_t>nchunks * record
