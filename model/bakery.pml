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
 * Bounds: N=3 nodes, ACQ acquisitions per node (default 2, so re-entry and
 * numbers up to N*ACQ are covered); the environment (evictions, prefetches
 * of every line by every host) is unbounded.
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
 *   -DCRASH                node N-1 crashes (stops for ever) at an arbitrary
 *                          point, possibly inside the critical section; after
 *                          it has crashed its heartbeat eventually goes stale
 *                          (stale[N-1]=1) and the other nodes skip it in their
 *                          waits.  Only the liveness of the live nodes is
 *                          checked (ltl "live_done"): mutual exclusion with a
 *                          node declared stale needs the epoch/fencing token,
 *                          which is outside this model.  Staleness of a live
 *                          but slow node is not modelled.
 */

#define N 3
#ifndef ACQ
#define ACQ 2
#endif

#define NH N      /* hosts: the N nodes */
#define NL N      /* line i belongs to node i */
#define LW 2      /* (choosing, number) */
#define ENV_OPTIONS \
  ENV(0,0) ENV(0,1) ENV(0,2) \
  ENV(1,0) ENV(1,1) ENV(1,2) \
  ENV(2,0) ENV(2,1) ENV(2,2)
#include "memory.pml"

#define CH(i)  (LW*(i))
#define NUM(i) (LW*(i)+1)

byte incs;          /* nodes in the critical section */
bit fin[N];         /* node finished all its acquisitions */
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
    :: else -> break
    od;
    fin[i] = 1
  } unless { crashed[i] }
}

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
    run node(0); run node(1); run node(2);
    RUN_ENV;
#ifdef CRASH
    run crash();
#endif
  }
}

#ifdef CRASH
ltl live_done { <> (fin[0] && fin[1]) }
#else
ltl done { <> (fin[0] && fin[1] && fin[2]) }
#endif
