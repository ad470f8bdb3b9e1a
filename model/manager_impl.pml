/*
 * manager_impl.pml -- the manager mode of tract/lock.py as implemented
 * (ManagedLock + LockManager._step_lock, commit 32bd86a), for one lock and
 * one manager that stays live: no take-over, no stale nodes, the manager
 * epoch never changes (so the `ack` word, which only a new manager reads, is
 * left out).  Memory model: memory.pml (reduced), words widened to short.
 *
 * Lines: request line n (n < N) = (req_seq, done_seq, wait_seq), written only
 * by node n; grant line G = (F, C), written only by the manager M = N.
 * F packs the grant's fields (holder+1, state, seq, epoch); C is the check
 * word, written after F.  The implementation writes five fields then a check
 * word over them; any mix of old and new fields fails the check, so a reader
 * sees the old version, the new one, or a torn line -- exactly what (F, C)
 * with C a copy of F gives: torn iff F != C (a partly written line published
 * by an eviction, MAYBE_EVICT, or a read torn by an eviction between the two
 * loads, MAY_TEAR).  A torn grant reads as "no grant" (None).
 *
 * Node n (ManagedLock.acquire / release):
 *   seq = req_seq + 1; req_seq = seq; flush; fence
 *   first = true
 *   loop: invalidate(G); fence; read grant
 *         if grant whole, holder == n, GRANTED, and (first or grant.seq == seq):
 *             enter with epoch = grant.epoch
 *         if first: wait_seq = seq; flush; fence      ("I wait outside")
 *         first = false
 *   release: done_seq = seq; wait_seq = seq; flush; fence
 *
 * Manager, one step (LockManager._step_lock), repeated for ever:
 *   read every request line (invalidate + fence first; two tear points;
 *   in any order with -DREAD_ANY_ORDER, see READ_ALL)
 *   waiting = nodes other than the holder with req_seq != done_seq
 *   NONE:     if waiting: grant_next(round robin from `next`)
 *   GRANTED:  nobody waiting: keep it (sticky);
 *             holder's req != done and req == grant.seq: keep it (it has yet
 *             to use this grant, or uses it now);
 *             else: state = REVOKING; write; read every request line again
 *   then, if REVOKING and the holder is outside -- req == done, or
 *             wait == req and grant.seq != req (it waits for a newer grant)
 *             -- grant_next(round robin from holder+1)
 *   grant_next: the first node with req != done gets (node, GRANTED, req,
 *             epoch+1); none: (nobody, NONE, epoch+1) -- never happens here
 *             (asserted, see NOBODY below)
 *
 * Checks: as manager.pml -- safety (incs <= 1; the node entering holds the
 * manager's current grant: holder and epoch; epoch < 16) and liveness (ltl
 * "done" under weak fairness).  -DNO_TOKEN_CHECK drops the fencing-token
 * assertion (mutual exclusion alone).  Broken variants, each must be refuted:
 *   -DBROKEN_NO_SAY_WAITING  a node that fails its first poll does not write
 *       wait_seq: a holder that lost the sticky race against REVOKING is
 *       never seen outside (the deadlock of manager.pml -DAS_SPECIFIED):
 *       liveness refuted.
 *   -DBROKEN_NO_REVOKING     the manager takes a grant back without first
 *       publishing REVOKING and re-reading (no Dekker handshake): the holder
 *       re-enters on its sticky grant while the grant moves: safety refuted.
 *   -DBROKEN_NO_YET_TO_USE   the manager also revokes a grant whose holder
 *       has yet to use it (req == grant.seq, req != done): liveness refuted.
 * Found while building this model: with one manager that stays, the tests
 * "first or grant.seq == seq" (node) and "grant.seq != req" (manager's
 * outside test) never decide anything -- dropping either leaves the state
 * space unchanged (checked at N=2 with ACQ=2 and 3); they can only matter
 * across a manager take-over, which this model leaves out.
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

#define M  N
#define G  N
#define NH (N+1)
#define NL (N+1)
#define LW 3
#define WORD short
#include "memory.pml"

#define REQ(n)  (LW*(n))
#define DONE(n) (LW*(n)+1)
#define WAIT(n) (LW*(n)+2)
#define GF      (LW*G)
#define GC      (LW*G+1)

#define NONE     0
#define GRANTED  1
#define REVOKING 2

/* F = (holder+1) + 4*state + 16*seq + 64*epoch; holder+1 == 0: nobody */
#define ENC(h1,s,q,e) ((h1) + 4*(s) + 16*(q) + 64*(e))
#define DEC_H1(x) ((x) % 4)
#define DEC_S(x)  (((x) / 4) % 4)
#define DEC_Q(x)  (((x) / 16) % 4)
#define DEC_E(x)  ((x) / 64)

byte incs;
byte nfin;
/* the manager's own copy of the grant (_Granting) */
byte mg_h1, mg_state, mg_seq, mg_epoch;
byte mg_next;      /* round-robin position */

/* node n reads the grant: ok = whole (F == C) */
#define READ_GRANT(n, f, c) \
  d_step { _flush(n, G); _load(n, GF, f) }; \
  MAY_TEAR(n, G); \
  d_step { _load(n, GC, c); _drop(n, G) }

/* the manager writes its grant: fields, maybe an eviction, check word */
#define WRITE_GRANT() \
  d_step { _store(M, GF, ENC(mg_h1, mg_state, mg_seq, mg_epoch)) }; \
  MAYBE_EVICT(M, G); \
  d_step { _store(M, GC, ENC(mg_h1, mg_state, mg_seq, mg_epoch)); _flush(M, G) }

proctype node(byte n) {
  short f, c;
  byte myreq, k;
  bit first;
  do
  :: k < (n == 0 -> ACQ0 : ACQ) ->
     myreq++;
     publish(n, n, REQ(n), myreq);
     first = 1;
     do
     :: READ_GRANT(n, f, c);
        if
        :: f == c && DEC_H1(f) == n + 1 && DEC_S(f) == GRANTED &&
           (first || DEC_Q(f) == myreq) -> break
        :: else ->
           if
           :: first -> d_step { f = 0; c = 0; first = 0 };
#ifndef BROKEN_NO_SAY_WAITING
                       publish(n, n, WAIT(n), myreq)
#else
                       skip
#endif
           :: else -> d_step { f = 0; c = 0 }
           fi
        fi
     od;
     /* critical section, holding epoch DEC_E(f) */
     incs++;
     assert(incs <= 1);
#ifndef NO_TOKEN_CHECK
     assert(mg_h1 == n + 1 && mg_state != NONE && mg_epoch == DEC_E(f));
#endif
     d_step { incs--; f = 0; c = 0; first = 0 };
     /* release: done_seq = wait_seq = seq; flush; fence */
     store(n, DONE(n), myreq);
     MAYBE_EVICT(n, n);
     publish(n, n, WAIT(n), myreq);
     k++
  :: else -> d_step { nfin++ }; break
  od
}

/* read every request line into rq/dn/wt.  The implementation invalidates
 * them all, fences once, then loads each line's three words; each line's copy
 * may be fetched at any time after that fence, so the versions read need not
 * follow the order of the loads.  -DREAD_ANY_ORDER reads the lines in every
 * order (each read fetching at its own time); without it the lines are read
 * in the order 0, 1, 2 (a restriction, used where any order is too costly).
 * Each line: three loads that an eviction may tear (MAY_TEAR). */
#define READ_LINE(t, bit) \
  d_step { _flush(M, t); _load(M, REQ(t), rq[t]) }; \
  MAY_TEAR(M, t); \
  load(M, DONE(t), dn[t]); \
  MAY_TEAR(M, t); \
  d_step { _load(M, WAIT(t), wt[t]); _drop(M, t); rd = rd | (bit) }

#if N > 2
#define ALL_READ 7
#define THIRD_OPTION :: (rd & 4) == 0 -> READ_LINE(2, 4)
#define THIRD_READ READ_LINE(2, 4);
#else
#define ALL_READ 3
#define THIRD_OPTION
#define THIRD_READ
#endif

#ifdef READ_ANY_ORDER
#define READ_ALL() \
  rd = 0; \
  do \
  :: rd == ALL_READ -> rd = 0; break \
  :: (rd & 1) == 0 -> READ_LINE(0, 1) \
  :: (rd & 2) == 0 -> READ_LINE(1, 2) \
  THIRD_OPTION \
  od
#else
#define READ_ALL() \
  READ_LINE(0, 1); \
  READ_LINE(1, 2); \
  THIRD_READ \
  rd = 0
#endif

/* grant_next(start): the first node from start with req != done.
 * NOBODY: the implementation falls back to (nobody, NONE, epoch+1) when no
 * node waits; with one manager that stays, grant_next is only called when a
 * node other than the holder waits, and that node still waits, so the model
 * asserts the fallback unreachable (spin checks that it is) instead. */
#define GRANT_NEXT(start) \
  t = 0; \
  do \
  :: t < N && rq[((start) + t) % N] != dn[((start) + t) % N] -> \
     d_step { mg_h1 = ((start) + t) % N + 1; mg_state = GRANTED; \
              mg_seq = rq[((start) + t) % N]; mg_epoch++; assert(mg_epoch < 16); \
              mg_next = ((start) + t + 1) % N; t = 0 }; \
     WRITE_GRANT(); \
     break \
  :: t < N && rq[((start) + t) % N] == dn[((start) + t) % N] -> t++ \
  :: t == N -> \
     assert(0); /* unreachable (checked): see NOBODY */ \
     break \
  od

/* (starts with a plain statement: spin rejects a break into a d_step) */
#define CLEAR() t = 0; d_step { w = 0; h = 0; \
  rq[0] = 0; dn[0] = 0; wt[0] = 0; rq[1] = 0; dn[1] = 0; wt[1] = 0; \
  rq[2] = 0; dn[2] = 0; wt[2] = 0 }

proctype manager() {
  byte rq[3], dn[3], wt[3];   /* (req, done, wait) as read this step */
  byte t, w, h, rd;
end_mgr:
  do
  :: true ->
     READ_ALL();
     /* w = 1 if some node other than the holder waits */
     w = 0;
     d_step {
       t = 0;
       do
       :: t < N -> if
                   :: t + 1 != mg_h1 && rq[t] != dn[t] -> w = 1
                   :: else
                   fi;
                   t++
       :: else -> break
       od;
       t = 0;
       h = (mg_h1 > 0 -> mg_h1 - 1 : 0)
     };
     if
     :: mg_state == NONE ->
        if
        :: w -> GRANT_NEXT(mg_next)
        :: else
        fi
     :: mg_state == GRANTED && !w -> skip                     /* sticky */
#ifndef BROKEN_NO_YET_TO_USE
     :: mg_state == GRANTED && w && rq[h] != dn[h] && rq[h] == mg_seq -> skip
     :: mg_state == GRANTED && w && !(rq[h] != dn[h] && rq[h] == mg_seq) ->
#else
     :: mg_state == GRANTED && w ->
#endif
        mg_state = REVOKING;
#ifndef BROKEN_NO_REVOKING
        WRITE_GRANT();
        READ_ALL()
#else
        skip
#endif
     :: mg_state == REVOKING -> skip
     fi;
     if
     :: mg_state == REVOKING &&
        (rq[h] == dn[h] || (wt[h] == rq[h] && mg_seq != rq[h])) ->
        GRANT_NEXT(h + 1)
     :: else
     fi;
     CLEAR()
  od
}

init {
  atomic {
    run node(0); run node(1);
#if N > 2
    run node(2);
#endif
    run manager();
  }
}

ltl done { <> (nfin == N) }
