/*
 * manager.pml -- the TraCT-style manager lock with sticky grants, on
 * non-coherent memory (memory.pml).  Models the "manager" global tier of
 * tract's two-tier lock (DESIGN.md, "Two-tier lock").
 *
 * Hosts: nodes 0..N-1 and the manager M = N (a separate process, the only
 * writer of the grant line).  Lines: request line n (n < N) = (req_seq[n],
 * done_seq[n], used[n]), written only by node n; grant line G = N, written
 * only by the manager.
 *
 * The grant (holder, state, epoch), state in {NONE, GRANTED, REVOKING}:
 *   default        packed in ONE word (one aligned 64-bit word in the real
 *                  layout): written by one store, read by one load, so a
 *                  reader always sees one whole version of it.
 *   -DGRANT_SPLIT  three words of the grant line.  The manager stores holder,
 *                  then epoch, then state, then flushes; the line may be
 *                  evicted (published) after any of the stores (MAYBE_EVICT).
 *                  A node copies the three words from ONE copy of the line in
 *                  one step, so it sees one version, possibly a partly
 *                  written one.
 *
 * THE PROTOCOL AS FIRST SPECIFIED (-DAS_SPECIFIED) DEADLOCKS: the manager
 * revokes a sticky grant from h (REVOKING), while h bumps req_seq to re-enter
 * and reads REVOKING; h now waits for a grant with req_seq > done_seq, and the
 * manager waits for req_seq[h] == done_seq[h] for ever (both wait, nobody is
 * in the critical section).  The default model adds two rules that fix it:
 *   withdraw   a node that reads (itself, REVOKING) has not entered; it
 *              withdraws its request (done_seq = req_seq; flush; fence),
 *              waits until the grant is no longer (itself, REVOKING), then
 *              requests again (req_seq += 1; flush; fence);
 *   used       on release a node also writes used[n] = the epoch it held
 *              (same line and flush as done_seq); the manager revokes only a
 *              grant that its holder has used (used[h] == epoch).  Without
 *              this a grant issued for a request that was then withdrawn
 *              could be revoked before it is ever used, the holder withdraws
 *              again, and the grant can bounce between nodes without end
 *              (-DBROKEN_NO_USED_CHECK: the epoch bound below is exceeded).
 *
 * Node n, per acquisition (ACQ acquisitions per node, then it finishes):
 *   req_seq[n] += 1; flush(req line n); fence
 *   loop: invalidate(G); fence; read grant
 *         (n, GRANTED, e): enter the critical section with epoch e
 *         (n, REVOKING, _): withdraw (see above), then keep polling
 *   critical section
 *   used[n] = e; done_seq[n] = req_seq[n]; flush(req line n); fence
 * req_seq[n] is kept in a local (myreq): node n is its only writer.
 *
 * Manager loop (its own record of the grant is mg_*; it never reads G):
 *   state NONE: read (invalidate+fence) req line of w = rr; if
 *               req_seq[w] > done_seq[w]: grant (w, GRANTED, epoch+1), flush,
 *               fence; else rr = rr+1 mod N.
 *   state GRANTED to h: read the req lines of h+1, h+2, ... (round robin);
 *     first w with req_seq[w] > done_seq[w], and used[h] == epoch:
 *       grant = (h, REVOKING, epoch); flush; fence
 *       repeat: invalidate(req line h); fence; until req_seq[h] == done_seq[h]
 *       grant = (w, GRANTED, epoch+1); flush; fence
 *     nobody else waiting: keep the grant with h (sticky), read again.
 * The manager reads (req_seq, done_seq) with two loads, and the line may be
 * evicted and refetched between them (MAY_TEAR): torn reads are covered.
 *
 * Bounds: N=3 nodes (-DN=2 for the unreduced model), ACQ acquisitions per
 * node (default 2; -DACQ0=k gives node 0 k instead); epochs must stay below 16 (asserted: with the fixes each
 * grant after the first follows a completed critical section, so there are at
 * most N*ACQ grants).  Environment as in memory.pml.
 *
 * Checks (check.sh runs them all):
 *   (none)          safety: at most one node in the critical section
 *                   (incs <= 1); the node entering holds the current grant
 *                   (the manager's own record says holder n with the epoch n
 *                   read: the fencing token is current); epoch < 16; no
 *                   invalid end state.  liveness: ltl "done": <> all nodes
 *                   finished their ACQ acquisitions, under weak fairness.
 *   -DGRANT_SPLIT   the same, with the three-word grant line.
 *   -DNO_TOKEN_CHECK  drops the fencing-token assertion, leaving mutual
 *                   exclusion (incs <= 1) as the only safety property; the
 *                   broken variants are checked this way too, to show that
 *                   they break mutual exclusion itself.
 *   -DAS_SPECIFIED  no withdraw, no used check: liveness must be refuted.
 *   -DBROKEN_NO_USED_CHECK   withdraw but no used check: the epoch bound
 *                   must be refuted (the grant bounces without being used).
 *   -DBROKEN_NO_REVOKING      the manager moves the grant as soon as it reads
 *                   h's req line with req == done, without first publishing
 *                   REVOKING: the sticky re-entry race (h bumps req_seq,
 *                   reads its old GRANTED grant) must be found.
 *   -DBROKEN_NO_INVALIDATE    the manager reads the request lines without
 *                   invalidating (a copy may be stale or may have been
 *                   dropped): must be refuted.
 *   -DGRANT_SPLIT -DBROKEN_STATE_FIRST   the manager stores state before
 *                   holder/epoch, so a partly written line (old holder,
 *                   GRANTED) can be published: must be refuted.
 *   -DGRANT_SPLIT -DBROKEN_TORN_READ     a node reads holder, state and epoch
 *                   with three loads, and the line may be evicted and
 *                   refetched between them: must be refuted (the grant must
 *                   be read as one version: one word, or one line copy).
 */

#ifndef N
#define N 3
#endif
#ifndef ACQ
#define ACQ 2
#endif
#ifndef ACQ0
#define ACQ0 ACQ   /* node 0 may be given another bound (-DACQ0=...) */
#endif

#define M  N       /* the manager's host number */
#define G  N       /* the grant line */
#define NH (N+1)
#define NL (N+1)
#define LW 3
#if N == 2
#define ENV_OPTIONS \
  ENV(0,0) ENV(0,2) \
  ENV(1,1) ENV(1,2) \
  ENV(2,0) ENV(2,1) ENV(2,2)
#else
#define ENV_OPTIONS \
  ENV(0,0) ENV(0,3) \
  ENV(1,1) ENV(1,3) \
  ENV(2,2) ENV(2,3) \
  ENV(3,0) ENV(3,1) ENV(3,2) ENV(3,3)
#endif
#include "memory.pml"

#define REQ(n)  (LW*(n))
#define DONE(n) (LW*(n)+1)
#define USED(n) (LW*(n)+2)

#define NONE     0
#define GRANTED  1
#define REVOKING 2

#ifdef GRANT_SPLIT
#define HOLDER (LW*G)
#define STATE  (LW*G+1)
#define EPOCH  (LW*G+2)
#else
#define GW     (LW*G)            /* the packed grant word */
#define ENC(h,s,e) ((e)*16 + (s)*4 + (h))
#define DEC_H(x) ((x) % 4)
#define DEC_S(x) (((x) / 4) % 4)
#define DEC_E(x) ((x) / 16)
#endif

byte incs;                 /* nodes in the critical section */
byte nfin;                 /* nodes that finished all their acquisitions */
byte mg_holder, mg_state, mg_epoch;   /* the manager's record of the grant */

/* node n reads the grant into (h, s, e) */
#ifdef GRANT_SPLIT
#ifdef BROKEN_TORN_READ
#define READ_GRANT(n, h, s, e) \
  d_step { _flush(n, G); _load(n, HOLDER, h) }; \
  MAY_TEAR(n, G); \
  load(n, STATE, s); \
  MAY_TEAR(n, G); \
  d_step { _load(n, EPOCH, e); _drop(n, G) }
#else
#define READ_GRANT(n, h, s, e) \
  d_step { _flush(n, G); _load(n, HOLDER, h); _load(n, STATE, s); \
           _load(n, EPOCH, e); _drop(n, G) }
#endif
#else
#define READ_GRANT(n, h, s, e) \
  d_step { _flush(n, G); _load(n, GW, h); s = DEC_S(h); e = DEC_E(h); \
           h = DEC_H(h); _drop(n, G) }
#endif
#ifdef FULL_ENV
#undef READ_GRANT
#ifdef GRANT_SPLIT
#define READ_GRANT(n, h, s, e) \
  invalidate(n, G); load(n, HOLDER, h); load(n, STATE, s); load(n, EPOCH, e)
#else
#define READ_GRANT(n, h, s, e) \
  invalidate(n, G); \
  d_step { _load(n, GW, h); s = DEC_S(h); e = DEC_E(h); h = DEC_H(h) }
#endif
#endif

/* the manager reads node w's request line: (req, done) into (r, d), or
 * used into u */
#ifdef BROKEN_NO_INVALIDATE
#define READ_REQ(w, r, d) \
  MAY_TEAR(M, w); load(M, REQ(w), r); MAY_TEAR(M, w); load(M, DONE(w), d)
#define READ_USED(w, u) MAY_TEAR(M, w); load(M, USED(w), u)
#else
#define READ_REQ(w, r, d) read2_fresh(M, w, REQ(w), r, DONE(w), d)
#define READ_USED(w, u) read_fresh(M, w, USED(w), u)
#endif

/* the manager publishes a new grant (w, GRANTED, epoch+1).  (It starts with
 * a plain statement: spin rejects a break that jumps into a d_step.) */
#define NEXT_EPOCH mg_epoch++; assert(mg_epoch < 16); mg_state = GRANTED
#ifdef GRANT_SPLIT
#ifdef BROKEN_STATE_FIRST
#define GRANT(w) \
  mg_holder = w; \
  d_step { NEXT_EPOCH; _store(M, STATE, GRANTED) }; \
  MAYBE_EVICT(M, G); \
  store(M, HOLDER, w); \
  MAYBE_EVICT(M, G); \
  store(M, EPOCH, mg_epoch); \
  flush(M, G)   /* ; fence */
#else
#define GRANT(w) \
  mg_holder = w; \
  d_step { NEXT_EPOCH; _store(M, HOLDER, w) }; \
  MAYBE_EVICT(M, G); \
  store(M, EPOCH, mg_epoch); \
  MAYBE_EVICT(M, G); \
  store(M, STATE, GRANTED); \
  flush(M, G)   /* ; fence */
#endif
#define REVOKE() \
  mg_state = REVOKING; \
  publish(M, G, STATE, REVOKING)
#else
#define GRANT(w) \
  mg_holder = w; \
  d_step { NEXT_EPOCH }; \
  publish(M, G, GW, ENC(mg_holder, GRANTED, mg_epoch))
#define REVOKE() \
  mg_state = REVOKING; \
  publish(M, G, GW, ENC(mg_holder, REVOKING, mg_epoch))
#endif

proctype node(byte n) {
  byte myreq, h, s, e, k;
  do
  :: k < (n == 0 -> ACQ0 : ACQ) ->
     /* req_seq[n] += 1; flush; fence */
     myreq++;
     publish(n, n, REQ(n), myreq);
     /* poll the grant (invalidate; fence; read) */
     do
     :: READ_GRANT(n, h, s, e);
        if
        :: h == n && s == GRANTED -> break
#ifndef AS_SPECIFIED
        :: h == n && s == REVOKING ->
           /* lost the race against a revocation of our own sticky grant:
            * withdraw the request (done_seq = req_seq: "outside"), wait
            * until the grant has moved on, then request again */
           d_step { h = 0; s = 0; e = 0 };
           publish(n, n, DONE(n), myreq);
           do
           :: READ_GRANT(n, h, s, e);
              if
              :: h == n && s == REVOKING -> d_step { h = 0; s = 0; e = 0 }
              :: else -> d_step { h = 0; s = 0; e = 0; myreq++ }; break
              fi
           od;
           publish(n, n, REQ(n), myreq)
#endif
        :: else -> d_step { h = 0; s = 0; e = 0 }
        fi
     od;
     /* critical section, holding epoch e */
     incs++;
     assert(incs <= 1);
#ifndef NO_TOKEN_CHECK
     assert(mg_holder == n && mg_epoch == e);
#endif
     d_step { incs--; h = 0; s = 0 };
     /* used[n] = e; done_seq[n] = req_seq[n]; flush; fence */
     store(n, USED(n), e);
     MAYBE_EVICT(n, n);
     e = 0;
     publish(n, n, DONE(n), myreq);
     k++
  :: else -> d_step { nfin++ }; break
  od
}

proctype manager() {
  byte rr, t, w, r, d;
end_mgr:
  do
  :: mg_state == NONE ->
     READ_REQ(rr, r, d);
     if
     :: r > d -> d_step { w = rr; r = 0; d = 0 }; GRANT(w); w = 0
     :: else -> d_step { r = 0; d = 0; rr = (rr + 1) % N }
     fi
  :: mg_state == GRANTED ->
     /* look for another waiting node, round robin after the holder */
     t = 1;
     do
     :: t < N ->
        w = (mg_holder + t) % N;
        READ_REQ(w, r, d);
        if
        :: r > d -> d_step { r = 0; d = 0 }; break
        :: else -> d_step { r = 0; d = 0; t++ }
        fi
     :: else -> break
     od;
#if !defined(AS_SPECIFIED) && !defined(BROKEN_NO_USED_CHECK)
     /* w waits: revoke only a grant its holder has used (used[h] == epoch) */
     if
     :: t < N ->
        READ_USED(mg_holder, r);
        if
        :: r == mg_epoch -> r = 0
        :: else -> d_step { r = 0; t = N }
        fi
     :: else
     fi;
#endif
     if
     :: t < N ->
#ifndef BROKEN_NO_REVOKING
        REVOKE();
#endif
        /* wait until the holder is outside: req_seq[h] == done_seq[h] */
        do
        :: READ_REQ(mg_holder, r, d);
           if
           :: r == d -> d_step { r = 0; d = 0 }; break
           :: else -> d_step { r = 0; d = 0 }
           fi
        od;
        GRANT(w);
        d_step { t = 0; w = 0 }
     :: else -> d_step { t = 0; w = 0 }   /* the grant stays (sticky) */
     fi
  od
}

init {
  atomic {
    run node(0); run node(1);
#if N > 2
    run node(2);
#endif
    run manager();
    RUN_ENV
  }
}

ltl done { <> (nfin == N) }
