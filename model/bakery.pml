/*
 * bakery.pml -- Lamport's bakery over per-node lines, on non-coherent memory
 * (memory.pml).  Models the "bakery" global tier of tract's two-tier lock
 * (DESIGN.md, "Two-tier lock").
 *
 * Layout: node i owns line i = (choosing[i], number[i]); only node i stores
 * to it.  Word CH(i) = choosing[i], word NUM(i) = number[i].
 *
 * Node i, per acquisition (ACQ acquisitions per node, then it finishes):
 *   choosing[i]=1; flush(i); fence
 *   max=0; for each j (i included): invalidate(j); fence; max=max(max,number[j])
 *   number[i]=max+1; flush(i); fence
 *   choosing[i]=0; flush(i); fence
 *   for each j != i:
 *     repeat invalidate(j); fence  until choosing[j]==0
 *     repeat invalidate(j); fence  until number[j]==0 or (number[j],j) > (number[i],i)
 *   critical section
 *   number[i]=0; flush(i); fence
 * number[i] is kept in a local (mynum) as well: node i is its only writer.
 *
 * Bounds: N nodes (default 3; -DN=2), ACQ acquisitions per node (default 2,
 * so re-entry and numbers up to N*ACQ are covered).  Memory: memory.pml's
 * reduced model by default, its unreduced one (every operation a step, an
 * unbounded env process evicting/prefetching every line of every host) with
 * -DFULL_ENV.  The bounds check.sh uses are in its table of checks.
 *
 * Waits are busy loops; timeouts and backoff of the implementation are left
 * out (they only delay a poll).  The epoch line the implementation writes
 * after the waits (the fencing token) is not modelled.
 *
 * Configurations (-D flags to spin; check.sh runs them all):
 *   (none)                 safety: assert at most one node in the critical
 *                          section (incs <= 1), plus no invalid end state
 *                          (pan compiled with -DNOCLAIM).
 *                          liveness: ltl "done": <> all nodes finished their
 *                          ACQ acquisitions, under weak fairness (pan -a -f):
 *                          every node that requests eventually enters (no
 *                          deadlock, no livelock) while all nodes are live.
 *   -DBROKEN_NO_INVALIDATE reads of other nodes' lines skip the invalidate
 *                          (and so may read a stale cached copy): spin must
 *                          find a mutual-exclusion violation.
 *   -DBROKEN_NO_CHOOSING   omits the wait on choosing[j] (Lamport's classic
 *                          counter-example): spin must find a violation.
 *   -DBROKEN_NO_RELEASE_FLUSH  release stores number[i]=0 but never flushes
 *                          it (only a spontaneous eviction would publish it):
 *                          the liveness check must find a cycle in which a
 *                          waiter spins for ever.
 *   -DONE_FENCE            the acquire as tract/lock.py implements it (see
 *                          the comment at its proctype node): one invalidate
 *                          of all other lines and one fence after each half of
 *                          the doorway, copies that may be prefetched at any
 *                          time after that fence, torn two-word ticket reads,
 *                          one combined wait test.  Same properties.
 *   -DONE_FENCE -DBROKEN_NO_DOORWAY_FRESH  without the invalidate + fence
 *                          after the doorway: must be refuted.
 *   -DFULL_ENV             the same protocol on the unreduced memory model.
 *   -DCRASH                node N-1 crashes (stops for ever) at an arbitrary
 *                          point, possibly inside the critical section; after
 *                          it has crashed its heartbeat eventually goes stale
 *                          (stale[N-1]=1) and the other nodes skip it in their
 *                          waits.  Only the liveness of the live nodes is
 *                          checked (ltl "live_done"): mutual exclusion with a
 *                          node declared stale needs the epoch/fencing token,
 *                          which is outside this model.  Staleness of a live
 *                          but slow node is not modelled.  (pan -A: the
 *                          mutual-exclusion assertion is off in this run.)
 */

#ifndef N
#define N 3
#endif
#ifndef ACQ
#define ACQ 2
#endif

#define NH N      /* hosts: the N nodes */
#define NL N      /* line i belongs to node i */
#define LW 2      /* (choosing, number) */
#if N == 2
#define ENV_OPTIONS \
  ENV(0,0) ENV(0,1) \
  ENV(1,0) ENV(1,1)
#else
#define ENV_OPTIONS \
  ENV(0,0) ENV(0,1) ENV(0,2) \
  ENV(1,0) ENV(1,1) ENV(1,2) \
  ENV(2,0) ENV(2,1) ENV(2,2)
#endif
#include "memory.pml"

#define CH(i)  (LW*(i))
#define NUM(i) (LW*(i)+1)

byte incs;          /* nodes in the critical section */
bit fin[N];         /* node finished all its acquisitions */
byte nfin;          /* number of finished nodes */
bit crashed[N];     /* CRASH only */
bit stale[N];       /* CRASH only: others skip this node */

#ifdef CRASH
#define SKIP(j) stale[j]
#else
#define SKIP(j) false
#endif

/* read word x of node j's line into r, as one step: "invalidate(j); fence;
 * r = x" (read_fresh), or a plain load from a possibly stale copy */
#ifdef BROKEN_NO_INVALIDATE
#define READ_OTHER(i, j, x, r) _load(i, x, r)
#else
#define READ_OTHER(i, j, x, r) _flush(i, j); _load(i, x, r); _drop(i, j)
#endif
#ifdef FULL_ENV
/* the unreduced model: invalidate and load are separate steps */
#undef READ_OTHER
#ifdef BROKEN_NO_INVALIDATE
#define READ_OTHER(i, j, x, r) skip; d_step { _load(i, x, r)
#else
#define READ_OTHER(i, j, x, r) invalidate(i, j); d_step { _load(i, x, r)
#endif
#define BEGIN
#define END }
#else
#define BEGIN d_step {
#define END }
#endif

#ifdef ONE_FENCE
/*
 * The acquire of tract/lock.py (BakeryLock.acquire, commit 32bd86a): after
 * each half of the doorway, ONE invalidate of every other node's line and one
 * fence; each line is then read whenever the program gets to it, so the copy
 * may have been fetched (prefetched) at any time since that fence: armed[i,j]
 * marks that window and env_prefetch may fill i's copy of j's line within it.
 * A ticket (choosing, number) is read with two loads, and the line may be
 * evicted and refetched between them (MAY_TEAR).  The wait is one combined
 * test per read: choosing[j]==0 and (number[j]==0 or (number[j],j) >
 * (number[i],i)); when it fails: invalidate(j); fence; read again.  The scan
 * reads the other nodes' numbers only.
 */
bit armed[N*N];
#define AI(i,j) ((i)*N+(j))
hidden byte _u;

/* invalidate every line but i's own, then one fence; open the windows */
inline fresh_others(i) {
  _u = 0;
  do
  :: _u < N -> if
               :: _u != i -> _flush(i, _u); armed[AI(i,_u)] = 1
               :: else
               fi;
               _u++
  :: else -> break
  od;
  _u = 0
}

/* the copy read in the scan is dead (the next read of that line follows the
 * second fresh_others), so it is dropped at once -- except in
 * -DBROKEN_NO_DOORWAY_FRESH, which leaves out that second invalidate and
 * fence: the wait then starts from the copies the scan fetched, which must be
 * refuted */
#ifdef BROKEN_NO_DOORWAY_FRESH
#define SCAN_DROP(i, j) skip
#define POST_DOORWAY_FRESH(i) skip
#else
#define SCAN_DROP(i, j) _drop(i, j)
#define POST_DOORWAY_FRESH(i) d_step { fresh_others(i) }
#endif

#define PF(i,j) :: d_step { armed[AI(i,j)] && !valid[LI(i,j)] -> _fetch(i, j) }

proctype env_prefetch() {
end_pf:
  do
  PF(0,1) PF(1,0)
#if N > 2
  PF(0,2) PF(1,2) PF(2,0) PF(2,1)
#endif
  od
}

#define FAVOURS_I(i, j, c, n, mynum) \
  (c == 0 && (n == 0 || n > mynum || (n == mynum && j > i)))

proctype node(byte i) {
  byte j, c, n, mx, mynum, k;
  {
    do
    :: k < ACQ ->
       publish(i, i, CH(i), 1);
       d_step { fresh_others(i) };
       do
       :: j == i -> j++
       :: j < N && j != i ->
          d_step { _load(i, NUM(j), n); armed[AI(i,j)] = 0; SCAN_DROP(i, j);
                   if :: n > mx -> mx = n :: else fi;
                   n = 0; j++ }
       :: j >= N -> d_step { mynum = mx + 1; mx = 0; j = 0 }; break
       od;
       publish(i, i, NUM(i), mynum);
       publish(i, i, CH(i), 0);
       POST_DOORWAY_FRESH(i);
       do
       :: j == i -> j++
       :: j < N && j != i ->
          /* first read: the copy may date from any time since the fence */
          d_step { _load(i, CH(j), c); armed[AI(i,j)] = 0 };
          MAY_TEAR(i, j);
          d_step { _load(i, NUM(j), n); _drop(i, j) };
          do
          :: FAVOURS_I(i, j, c, n, mynum) -> d_step { c = 0; n = 0; j++ }; break
          :: SKIP(j) -> d_step { c = 0; n = 0; j++ }; break
          :: else ->
             d_step { _flush(i, j); _load(i, CH(j), c) };
             MAY_TEAR(i, j);
             d_step { _load(i, NUM(j), n); _drop(i, j) }
          od
       :: j >= N -> d_step { j = 0; incs++ }; break
       od;
       assert(incs <= 1);
       incs--;
       publish(i, i, NUM(i), 0);
       d_step { mynum = 0; k++ }
    :: else -> d_step { fin[i] = 1; nfin++ }; break
    od
  } unless { crashed[i] }
}

#else

proctype node(byte i) {
  byte j, n, mx, mynum, k;
  {
    do
    :: k < ACQ ->
       /* doorway: choosing[i]=1; flush; fence */
       publish(i, i, CH(i), 1);
       /* max over number[j] of every j, each read after invalidate+fence */
       do
       :: j < N -> BEGIN READ_OTHER(i, j, NUM(j), n);
                   if :: n > mx -> mx = n :: else fi;
                   n = 0; j++ END
       :: else -> d_step { mynum = mx + 1; mx = 0; j = 0 }; break
       od;
       /* (a d_step is never the target of a break: spin rejects that) */
       /* number[i]=max+1; flush; fence.  choosing[i]=0; flush; fence */
       publish(i, i, NUM(i), mynum);
       publish(i, i, CH(i), 0);
       /* waits, for each j != i (stale nodes skipped in CRASH) */
       do
       :: j == i -> j++
       :: j < N && j != i ->
#ifndef BROKEN_NO_CHOOSING
          /* repeat invalidate(j); fence until choosing[j]==0 */
          do
          :: SKIP(j) -> break
          :: else -> BEGIN READ_OTHER(i, j, CH(j), n) END;
                     if :: n == 0 -> break :: else fi
          od;
#endif
          /* repeat invalidate(j); fence until number[j]==0 or
           * (number[j],j) > (number[i],i) */
          do
          :: SKIP(j) -> d_step { n = 0; j++ }; break
          :: else -> BEGIN READ_OTHER(i, j, NUM(j), n) END;
                     if
                     :: n == 0 || n > mynum || (n == mynum && j > i) ->
                        d_step { n = 0; j++ }; break
                     :: else
                     fi
          od
       :: j >= N ->
          /* critical section: entered with incs++, left with incs-- */
          d_step { j = 0; incs++ }; break
       od;
       assert(incs <= 1);
       incs--;
       /* release: number[i]=0; flush; fence */
#ifdef BROKEN_NO_RELEASE_FLUSH
       store(i, NUM(i), 0);
#else
       publish(i, i, NUM(i), 0);
#endif
       d_step { mynum = 0; k++ }
    :: else -> d_step { fin[i] = 1; nfin++ }; break
    od
  } unless { crashed[i] }
}

#endif

#ifdef CRASH
/* crash of node N-1 at any point (weak fairness makes it happen at some
 * finite time, which includes "after it finished"); its heartbeat goes
 * stale some time later */
proctype crash() {
  crashed[N-1] = 1;
  stale[N-1] = 1
}
#endif

init {
  atomic {
    run node(0); run node(1);
#if N > 2
    run node(2);
#endif
    RUN_ENV;
#ifdef ONE_FENCE
    run env_prefetch();
#endif
#ifdef CRASH
    run crash();
#endif
  }
}

#ifdef CRASH
ltl live_done { <> (fin[0] && fin[1]) }
#else
ltl done { <> (nfin == N) }
#endif
