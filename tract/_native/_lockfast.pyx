# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Private: the native fast path of a manager-mode lock, with lock cohorting.

The protocol is `tract.lock`'s; its Python steps are the reference
(`tract.lock.Cohort` for this class as a whole, `tract.lock.ManagedLock` for
tier 2), and they are what runs under the simulator and the mutation harness.  This module does
the same steps in one call each, so an uncontended acquire + release costs
its cache-line round trips rather than ~30 Python calls:

``acquire``
    tier 1 (the node-local robust mutex), then either the tier-2 hold handed
    over by the last local holder (cohorting, below) or
    `ManagedLock.announce` + one `ManagedLock.attempt`;
``release``
    the cohort hand-off, or `ManagedLock.release`, then tier 1.

The fast path never decides a hard case: when the grant is not this node's,
or a line is torn, or a value is out of range, it reports ``ANNOUNCED`` and
the caller goes on with the reference (which waits, times out, or raises
`CorruptionError`).  tests/test_lock_fast.py runs both on the same memory
states and requires the same outcome, bytes and cache-control trace.

Cohorting (DESIGN.md §3).  A lock's slot in the node-local file is two
lines: its mutex, then ``held`` (grant epoch + 1 while this node's tier-2 hold is being
handed to the next local holder, else 0), ``waiters`` (processes of this
node blocked on the mutex; atomics: node-local memory is coherent) and
``passes`` (local hand-offs since the node last gave the grant back).  A
releasing process that sees a local waiter and has made fewer than the
bound of passes keeps the tier-2 hold and hands it over through the mutex,
touching no pool memory; every ``PASSES_PER_CHECK`` passes it first reads
the grant line and gives the grant back instead if the manager is revoking
it or it is no longer this node's (a lapsed lease: the fencing token, which
every holder checks before publishing, is what guards the data).  The bound
keeps other nodes from starving: the manager never takes back a grant whose
request is still in use.  ``held`` and ``passes`` change only
under the mutex; a holder that dies is repaired by the next (EOWNERDEAD:
tier 2 given back, slot cleared), or by `sweep`, which every process's
heartbeat runs, when no local process takes the lock again; `sweep` also
gives back a hand-off nobody took (a waiter that timed out).

Rules relied on (DESIGN.md): R2 — the request line is written only by this
node, the slot only under its mutex; R3 — the request line is flushed and
fenced before the grant is read; R4 — the manager and grant lines are
invalidated and fenced before every read; R5 — a node or state out of range
sends the call to the reference, which raises.
"""

from libc.stdint cimport int64_t, uint64_t

from tract._native._localmutex cimport LocalMutex, raise_code, wait
from tract._native._pthread cimport EBUSY, EOWNERDEAD, pthread_mutex_trylock, pthread_mutex_unlock
from tract._native._region cimport Region, trace_state, tract_trace_bind

cdef extern from "_cachectl.h" nogil:
    void tract_lines(int insn, const char *addr, size_t length) noexcept
    void tract_fence() noexcept
    uint64_t tract_add_u64(uint64_t *addr, int64_t delta) noexcept
    uint64_t tract_load_u64(const uint64_t *addr) noexcept
    uint64_t tract_check_word(uint64_t tag, const volatile uint64_t *words, int n) noexcept

cdef extern from *:
    """
    /* a prefetch for writing (prefetchw where the build's target has it, else a read
       prefetch): a hint, neither a cache-control operation nor ordered by the fences */
    #define tract_prefetch_write(addr) __builtin_prefetch((const void *)(addr), 1, 3)
    """
    void tract_prefetch_write(const volatile void *addr) noexcept nogil

tract_trace_bind(trace_state())  # one cache-control trace per process (_region.pxd)

cdef enum Outcome:  # what `acquire` and `attempt` report
    OUTCOME_ACQUIRED = 0  # the lock is held; ``epoch`` is the grant's
    OUTCOME_OWNER_DIED = 1  # tier 1 held, its last holder died: `repair`, consistent, `attempt`
    OUTCOME_ANNOUNCED = 2  # tier 1 held, request ``seq`` announced, no grant yet: wait

ACQUIRED, OWNER_DIED, ANNOUNCED = OUTCOME_ACQUIRED, OUTCOME_OWNER_DIED, OUTCOME_ANNOUNCED

SLOT_BYTES = 128  # a lock's node-local slot: the mutex's line, the cohort line

cdef enum:
    LINE = 64
    STATE_GRANTED = 1
    HELD_WORD = 8  # u64 indexes in the slot: the cohort line
    WAITERS_WORD = 9
    PASSES_WORD = 10
    PASSES_PER_CHECK = 8  # hand-offs between two reads of the grant line

cdef uint64_t GRANT_TAG = 0x515241435447524E  # tract.lock.GRANT_TAG

#: byte offsets of the cohort words in a slot, and the hand-offs between two
#: reads of the grant line (`tract.lock.Cohort` repeats them; tests/test_rules.py)
COHORT_WORDS = {"held": 8 * HELD_WORD, "waiters": 8 * WAITERS_WORD, "passes": 8 * PASSES_WORD}
CHECK_EVERY = PASSES_PER_CHECK


cdef inline uint64_t _grant_check(const volatile uint64_t *fields) noexcept nogil:
    return tract_check_word(GRANT_TAG, fields, 5)


def grant_check(fields):
    """The check word of five grant fields (twin of ``tract.lock._grant_check``)."""
    cdef uint64_t words[5]
    for i in range(5):
        words[i] = fields[i]
    return _grant_check(words)


cdef class ManagerFastPath:
    """One lock, one node: the fast path over the pool region and the lock's
    node-local slot.  Offsets are checked here once; every call checks that
    neither mapping was closed since."""

    def __cinit__(self, Region pool, Region local_region, LocalMutex mutex, int64_t slot,
                  int64_t request, int64_t manager_line, int64_t grant_base, int node,
                  int max_nodes, int passes_bound):
        if not 0 <= node < max_nodes:
            raise ValueError(f"node {node} is outside 0..{max_nodes - 1}")
        for offset in (request, manager_line, grant_base):
            if offset % LINE:
                raise ValueError(f"lock line offset {offset} is not {LINE}-byte aligned")
        pool._check(request, LINE)
        pool._check(manager_line, LINE)
        pool._check(grant_base, max_nodes * LINE)
        local_region._check_aligned(slot, 8)
        local_region._check(slot, 2 * LINE)
        if <char *>mutex._mutex != local_region._base + slot:
            raise ValueError(f"the local mutex is not at the start of slot {slot}")
        if passes_bound < 0:
            raise ValueError(f"passes_bound {passes_bound} is negative")
        self.pool, self.local_region, self.mutex = pool, local_region, mutex
        self.slot, self.request, self.manager_line = slot, request, manager_line
        self.grant_base, self.last_grant = grant_base, -1
        self.me, self.max_nodes, self.passes_bound = node + 1, max_nodes, passes_bound
        self.epoch = self.seq = 0

    cdef uint64_t *_slot(self) except NULL:
        if self.pool._base == NULL or self.local_region._base == NULL:
            raise ValueError(f"lock fast path over {self.pool.path!r}: a mapping is closed")
        return <uint64_t *>(self.local_region._base + self.slot)

    # ------------------------------------------------------------- tier 2

    cdef void invalidate_grant(self) noexcept nogil:
        """Drop the manager line and the last grant line read (the caller fences)."""
        tract_lines(self.pool._invalidate_insn, self.pool._base + self.manager_line, LINE)
        if self.last_grant >= 0:
            tract_lines(self.pool._invalidate_insn, self.pool._base + self.last_grant, LINE)

    cdef volatile uint64_t *_grant_fenced(self, uint64_t *manager_epoch) noexcept nogil:
        """After `invalidate_grant` and a fence: the current manager's grant
        line, fresh (NULL when no manager is named, or one out of range)."""
        cdef char *base = self.pool._base
        cdef int64_t line
        cdef volatile uint64_t *manager = <volatile uint64_t *>(base + self.manager_line)
        cdef uint64_t node
        if self.last_grant >= 0:
            # the grant line read last time (invalidated before the caller's fence), loaded
            # now beside the manager line: the grant line's address depends on the manager
            # line, so these two misses would otherwise come one after the other.  A load
            # after the fence, like the reads below (R4); no cache-control operation added
            node = (<volatile uint64_t *>(base + self.last_grant))[0]
        node = manager[0]
        manager_epoch[0] = manager[1]
        if node == 0 or node > self.max_nodes:
            return NULL
        line = self.grant_base + <int64_t>(node - 1) * LINE
        if line != self.last_grant:
            self.last_grant = line
            tract_lines(self.pool._invalidate_insn, base + line, LINE)
            tract_fence()
        return <volatile uint64_t *>(base + line)

    cdef volatile uint64_t *_fresh_grant(self, uint64_t *manager_epoch) noexcept nogil:
        """`ManagedLock._current`: the current manager's grant line, fresh."""
        self.invalidate_grant()
        tract_fence()
        return self._grant_fenced(manager_epoch)

    cdef bint _mine(self, volatile uint64_t *grant, uint64_t manager_epoch) noexcept nogil:
        """A whole grant line, in range, granting this node under the current manager."""
        return (grant != NULL and _grant_check(grant) == grant[5] and grant[0] == self.me
                and grant[1] == STATE_GRANTED and grant[4] == manager_epoch)

    cdef int _attempt(self) noexcept nogil:
        """`ManagedLock.announce` then `ManagedLock.attempt(first=True)`."""
        cdef volatile uint64_t *request = <volatile uint64_t *>(self.pool._base + self.request)
        cdef uint64_t manager_epoch
        self.seq = request[0] + 1
        request[0] = self.seq
        tract_lines(self.pool._flush_insn, <char *>request, LINE)
        tract_fence()
        cdef volatile uint64_t *grant = self._fresh_grant(&manager_epoch)
        # this node's own request line (R2: no other host writes it), written back above,
        # fetched again for the release's write: a hint, no cache-control operation
        tract_prefetch_write(request)
        if self._mine(grant, manager_epoch):
            self.epoch = grant[3]
            return OUTCOME_ACQUIRED
        return OUTCOME_ANNOUNCED

    cdef void _give_back(self, uint64_t *slot) noexcept nogil:
        """`ManagedLock.release` (done and wait = request seq), and the slot cleared."""
        cdef volatile uint64_t *request = <volatile uint64_t *>(self.pool._base + self.request)
        tract_fence()  # the holder's flushes complete before the release is seen (R3)
        cdef uint64_t seq = request[0]
        request[1] = seq
        request[2] = seq
        tract_lines(self.pool._flush_insn, <char *>request, LINE)
        tract_fence()
        tract_prefetch_write(request)  # for the next acquire's write, as in `_attempt`
        slot[HELD_WORD] = 0
        slot[PASSES_WORD] = 0

    # ---------------------------------------------------------------- API

    def acquire(self, timeout=None):
        """Tier 1, then tier 2's fast attempt: ACQUIRED, OWNER_DIED or
        ANNOUNCED (see the module constants).  TimeoutError when tier 1
        stays busy ``timeout`` seconds."""
        cdef uint64_t *slot = self._slot()
        cdef int code = pthread_mutex_trylock(self.mutex._mutex)
        if code == EBUSY:
            tract_add_u64(&slot[WAITERS_WORD], 1)
            try:
                code = wait(self.mutex, timeout)
            finally:
                tract_add_u64(&slot[WAITERS_WORD], -1)
        elif code != 0 and code != EOWNERDEAD:
            raise_code(code, "pthread_mutex_trylock", self.mutex._where)
        if code == EOWNERDEAD:
            return OUTCOME_OWNER_DIED
        if slot[HELD_WORD]:  # handed over by the last local holder
            self.epoch = slot[HELD_WORD] - 1
            slot[HELD_WORD] = 0
            return OUTCOME_ACQUIRED
        return self._attempt()

    def attempt(self):
        """Announce a request and look once for the grant (tier 1 held)."""
        self._slot()
        return self._attempt()

    cdef bint granted_fenced(self) noexcept nogil:
        """After `invalidate_grant` and a fence: `still_granted`."""
        cdef uint64_t manager_epoch
        cdef volatile uint64_t *grant = self._grant_fenced(&manager_epoch)
        return self._mine(grant, manager_epoch) and grant[3] == self.epoch

    def still_granted(self):
        """`ManagedLock.still_granted` (False also for a torn or bad line)."""
        self._slot()
        self.invalidate_grant()
        tract_fence()
        return self.granted_fenced()

    def release(self):
        """Hand the tier-2 hold to a local waiter (cohorting) or give it
        back, then release tier 1."""
        cdef uint64_t *slot = self._slot()
        cdef uint64_t manager_epoch
        cdef volatile uint64_t *grant
        cdef bint keep = False
        if tract_load_u64(&slot[WAITERS_WORD]) and slot[PASSES_WORD] < self.passes_bound:
            keep = True
            if slot[PASSES_WORD] % PASSES_PER_CHECK == 0:
                grant = self._fresh_grant(&manager_epoch)
                keep = self._mine(grant, manager_epoch) and grant[3] == self.epoch
        if keep:
            slot[PASSES_WORD] += 1
            slot[HELD_WORD] = self.epoch + 1
        else:
            self._give_back(slot)
        cdef int code = pthread_mutex_unlock(self.mutex._mutex)
        if code:
            raise_code(code, "pthread_mutex_unlock", self.mutex._where)

    def repair(self):
        """After OWNER_DIED (or a failed wait): give tier 2 back, clear the slot."""
        self._give_back(self._slot())

    def sweep(self, bint stale=True):
        """Give back the tier-2 hold of a local process that died holding
        tier 1, or, when ``stale``, a hand-off no local process took.  True
        if it did."""
        cdef uint64_t *slot = self._slot()
        cdef int code = pthread_mutex_trylock(self.mutex._mutex)
        if code == EBUSY:
            return False
        if code != 0 and code != EOWNERDEAD:
            raise_code(code, "pthread_mutex_trylock", self.mutex._where)
        swept = code == EOWNERDEAD or (stale and slot[HELD_WORD] != 0)
        if swept:
            self._give_back(slot)
        if code == EOWNERDEAD:
            self.mutex.consistent()
        code = pthread_mutex_unlock(self.mutex._mutex)
        if code:
            raise_code(code, "pthread_mutex_unlock", self.mutex._where)
        return swept

    def slot_words(self):
        """(held, waiters, passes) as this node sees them (for tests and `tract pool info`)."""
        cdef uint64_t *slot = self._slot()
        return slot[HELD_WORD], tract_load_u64(&slot[WAITERS_WORD]), slot[PASSES_WORD]


# ------------------------------------------------------------ self-fencing

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cdef enum:  # `tract.lease`: the verdicts of `OwnLease.state`, the words of its lease
    LEASE_HELD = 0
    LEASE_LATE = 1
    LEASE_LAPSED = 2
    LEASE_REJOINED = 3
    BEATEN_WORD = 0
    CURRENT_WORD = 1
    LATE_WORD = 2

HELD, LATE, LAPSED, REJOINED = LEASE_HELD, LEASE_LATE, LEASE_LAPSED, LEASE_REJOINED


cdef inline int _lease_state(const volatile uint64_t *words, int64_t now, int64_t limit,
                             uint64_t epoch) noexcept nogil:
    if words[CURRENT_WORD] != epoch:
        return LEASE_REJOINED
    if words[LATE_WORD]:
        return LEASE_LAPSED
    if now - <int64_t>words[BEATEN_WORD] > limit:
        return LEASE_LATE
    return LEASE_HELD


def lease_state(uint64_t address, int64_t now_ns, int64_t limit_ns, uint64_t epoch):
    """`tract.lease.OwnLease.state` of the lease words at ``address`` (this
    host's memory: a node-local file or a process's own), at ``now_ns`` of
    the monotonic clock, read here when negative (the clock `time.monotonic`
    reads)."""
    cdef timespec ts
    if now_ns < 0:
        clock_gettime(CLOCK_MONOTONIC, &ts)
        now_ns = ts.tv_sec * 1000000000 + ts.tv_nsec
    return _lease_state(<const volatile uint64_t *>address, now_ns, limit_ns, epoch)



cdef extern from "pthread.h" nogil:
    ctypedef unsigned long pthread_t
    int pthread_create(pthread_t *thread, const void *attr, void *(*start)(void *) noexcept nogil,
                       void *arg)
    int pthread_join(pthread_t thread, void **retval)

cdef extern from "time.h" nogil:
    int nanosleep(const timespec *request, timespec *remaining)

cdef enum:
    SLICE_NS = 5000000  # the beating thread looks at its stop flag this often


cdef inline int64_t _monotonic_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1000000000 + ts.tv_nsec


cdef int _beat_step(char *line, volatile uint64_t *words, int64_t now, int64_t limit,
                    int insn) noexcept nogil:
    """`tract.lease.OwnLease.beat` with `tract.lease.NodeTable.beat`: 1 when
    it beat; a beat more than ``limit`` after the last good one marks the
    node lapsed and writes nothing."""
    cdef volatile uint64_t *heartbeat = <volatile uint64_t *>line
    if words[LATE_WORD]:
        return 0
    if now - <int64_t>words[BEATEN_WORD] > limit:
        words[LATE_WORD] = 1
        return 0
    heartbeat[0] = heartbeat[0] + 1
    tract_lines(insn, line, LINE)
    tract_fence()
    if now > <int64_t>words[BEATEN_WORD]:
        words[BEATEN_WORD] = now
    return 1


def beat_once(Region pool, int64_t line, uint64_t words, int64_t now_ns, int64_t limit_ns):
    """One `_beat_step` of the heartbeat line at ``line`` with the lease
    words at ``words`` (the twin of `tract.lease.OwnLease.beat`); whether
    it beat."""
    pool._check_aligned(line, LINE)
    pool._check(line, LINE)
    return bool(_beat_step(pool._base + line, <volatile uint64_t *>words, now_ns, limit_ns,
                           pool._flush_insn))


ctypedef struct Beating:
    char *line
    volatile uint64_t *words
    int64_t period
    int64_t limit
    int insn
    int stop
    uint64_t beats


cdef extern from *:
    """
    static inline int tract_stop_requested(const int *flag)
    { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }
    static inline void tract_request_stop(int *flag)
    { __atomic_store_n(flag, 1, __ATOMIC_RELEASE); }
    """
    int tract_stop_requested(const int *flag) noexcept nogil
    void tract_request_stop(int *flag) noexcept nogil


cdef void *_beating(void *argument) noexcept nogil:
    cdef Beating *state = <Beating *>argument
    cdef timespec pause
    cdef int64_t due = _monotonic_ns() + state.period, now
    while not tract_stop_requested(&state.stop):
        now = _monotonic_ns()
        if now >= due:
            state.beats += _beat_step(state.line, state.words, now, state.limit, state.insn)
            due = now + state.period
            continue
        pause.tv_sec = 0
        pause.tv_nsec = min(due - now, <int64_t>SLICE_NS)
        nanosleep(&pause, NULL)
    return NULL


cdef class Heartbeat:
    """A native thread that beats a node's heartbeat line every ``period``
    seconds through its lease words (`_beat_step`, the twin of
    `tract.lease.OwnLease.beat`), without the GIL: a Python pause (a long
    kernel, a collection) does not make the node look stale, while a stall
    of the whole process (SIGSTOP, memory pressure) stops it too, and its
    next beat comes late, so the node lapses (R6).  Stop it before either
    mapping closes."""

    cdef Region pool
    cdef object words_owner
    cdef Beating state
    cdef pthread_t thread
    cdef bint running

    def __cinit__(self, Region pool, int64_t line, words, double period, double limit):
        pool._check_aligned(line, LINE)
        pool._check(line, LINE)
        if not 0 < period < limit:
            raise ValueError(f"heartbeat period {period} s must be positive and under the "
                             f"limit {limit} s")
        self.pool, self.words_owner = pool, words
        self.state.line = pool._base + line
        self.state.words = <volatile uint64_t *><uint64_t>words.ctypes.data
        self.state.period = <int64_t>(period * 1e9)
        self.state.limit = <int64_t>(limit * 1e9)
        self.state.insn = pool._flush_insn
        self.state.stop = 0
        self.state.beats = 0
        self.running = False

    def start(self):
        if self.running:
            return
        if pthread_create(&self.thread, NULL, _beating, &self.state):
            raise OSError("pthread_create failed for the heartbeat thread")
        self.running = True

    def stop(self):
        """Stop and join the thread (within a few milliseconds)."""
        if not self.running:
            return
        tract_request_stop(&self.state.stop)
        with nogil:
            pthread_join(self.thread, NULL)
        self.running = False

    @property
    def beats(self):
        """Beats written so far."""
        return self.state.beats

    def __dealloc__(self):
        if self.running:
            tract_request_stop(&self.state.stop)
            pthread_join(self.thread, NULL)
