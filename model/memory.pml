/*
 * memory.pml -- non-coherent shared memory without cross-host atomics,
 * shared by bakery.pml and manager.pml (included through spin's cpp).
 *
 * The including model defines, before #include "memory.pml":
 *   NH  number of hosts (every process that touches memory is a host)
 *   NL  number of cache lines
 *   LW  words per line (lines shorter than LW are padded; padding stays 0)
 * and, for -DFULL_ENV, the list ENV_OPTIONS of ENV(h,l) pairs; optionally
 * WORD, the type of a word (default byte).
 *
 * State
 *   mem[x]              the pool's memory, word x (word x lies in line x/LW)
 *   cache[CI(h,x)]      host h's private copy of word x
 *   valid[LI(h,l)]      host h holds line l
 *   dirty[LI(h,l)]      host h stored to line l since it last wrote it back
 * A dropped line's words are zeroed in the cache, so states that differ only
 * in a dead copy are one state (canonical form, not a semantic choice).
 * Each line has a single writing host (DESIGN.md R2); the models assert it
 * only by construction (no host ever stores to another host's line).
 *
 * Primitive operations (each one indivisible, a d_step):
 *   load(h,x,r)       if line x/LW is not valid in h: fetch it from mem;
 *                     r = h's copy.  A valid line is never refreshed by a
 *                     load: it may be stale.
 *   store(h,x,v)      fetch the line if not valid (read-for-ownership), write
 *                     h's copy, mark the line dirty.
 *   flush(h,l)        if dirty, write the WHOLE line back to mem; drop it.
 *   invalidate(h,l)   same as flush (clflush semantics: dirty data is written
 *                     back first, then the line is dropped).
 *   evict(h,l)        the environment's eviction: same effect as flush.
 *   fence             no-op, see "flush ordering".
 *
 * Flush ordering (choice): flush and invalidate complete immediately.  Real
 * clflushopt/clwb only queue the line; the queue completes at the next fence
 * or earlier.  Both protocols issue every flush/invalidate directly before a
 * fence, with no memory operation of the same host in between, so "completes
 * somewhere between issue and fence" and "completes at issue" give the same
 * observable behaviours (every other host's step can be ordered before or
 * after the completion, and the issuing host does nothing in between).
 *
 * Environment (spontaneous evictions and prefetches) -- two granularities:
 *
 * -DFULL_ENV (unreduced; checked with small bounds by check.sh):
 *   every operation above is its own step, and a separate process `env` may
 *   at any time, for any (host, line) pair in ENV_OPTIONS, evict the line
 *   (write back if dirty, then drop) or, if clean, (re)fetch it from mem
 *   (prefetch: the copy may then go stale).  Unbounded.
 *
 * default (reduced; the main checks): the environment acts only where it is
 * observable, which is exact for these protocols:
 *   - a dirty line can only exist between a store and the flush after it.
 *     Where the protocol stores once and flushes (publish), an eviction in
 *     between is the same as the flush happening earlier, and the store is
 *     invisible to every other host until then; so "store; flush; fence" is
 *     one step, publish(h,l,x,v).  Where the protocol stores several words
 *     before one flush (the manager's grant), the models write MAYBE_EVICT
 *     after each store: an explicit point where the partly written line may
 *     be published early.
 *   - in the correct variants every read of a line owned by another host is
 *     "invalidate; fence; load" with nothing in between, so a prefetch of
 *     that line (or a drop of a clean copy) is either overwritten by the
 *     invalidate or equivalent to the load fetching earlier; the copy left
 *     behind is dead (never read before the next invalidate drops it, never
 *     written back since it is clean) and is dropped at once: read_fresh is
 *     one step.  A read of several words of one line (read2_fresh) keeps the
 *     copy between the loads but MAY_TEAR lets the line be evicted in
 *     between, so the next load refetches a newer version: torn reads are
 *     covered.
 *   - a prefetch of a host's own line only refetches what that host last
 *     wrote back: invisible.
 * So no env process runs by default.  The broken variants that read without
 * invalidating keep their (stale) copies; dropping fewer copies than real
 * hardware would only removes behaviours, so a counter-example found there
 * is a real one.
 */

#define NW (NL*LW)
#define LINEOF(x) ((x)/LW)
#define CI(h,x) ((h)*NW+(x))
#define LI(h,l) ((h)*NL+(l))

#ifndef WORD
#define WORD byte    /* a model may widen the words (-DWORD or #define) */
#endif
WORD mem[NW];
WORD cache[NH*NW];
bit valid[NH*NL];
bit dirty[NH*NL];

hidden byte _w;   /* loop counter inside d_steps; not part of the state */

/* bodies: only ever used inside a d_step */
inline _fetch(_h_, _l_) {
  _w = (_l_)*LW;
  do
  :: _w < ((_l_)+1)*LW -> cache[CI(_h_,_w)] = mem[_w]; _w++
  :: else -> break
  od;
  valid[LI(_h_,_l_)] = 1;
  _w = 0
}

inline _writeback(_h_, _l_) {
  _w = (_l_)*LW;
  do
  :: _w < ((_l_)+1)*LW -> mem[_w] = cache[CI(_h_,_w)]; _w++
  :: else -> break
  od;
  dirty[LI(_h_,_l_)] = 0;
  _w = 0
}

inline _drop(_h_, _l_) {
  _w = (_l_)*LW;
  do
  :: _w < ((_l_)+1)*LW -> cache[CI(_h_,_w)] = 0; _w++
  :: else -> break
  od;
  valid[LI(_h_,_l_)] = 0;
  dirty[LI(_h_,_l_)] = 0;
  _w = 0
}

inline _load(_h_, _x_, _r_) {
  if
  :: !valid[LI(_h_,LINEOF(_x_))] -> _fetch(_h_, LINEOF(_x_))
  :: else
  fi;
  _r_ = cache[CI(_h_,_x_)]
}

inline _store(_h_, _x_, _v_) {
  if
  :: !valid[LI(_h_,LINEOF(_x_))] -> _fetch(_h_, LINEOF(_x_))
  :: else
  fi;
  cache[CI(_h_,_x_)] = _v_;
  dirty[LI(_h_,LINEOF(_x_))] = 1
}

inline _flush(_h_, _l_) {
  if
  :: dirty[LI(_h_,_l_)] -> _writeback(_h_, _l_)
  :: else
  fi;
  _drop(_h_, _l_)
}

/* primitive operations, one step each */
inline load(_h_, _x_, _r_) { d_step { _load(_h_, _x_, _r_) } }
inline store(_h_, _x_, _v_) { d_step { _store(_h_, _x_, _v_) } }
inline flush(_h_, _l_) { d_step { _flush(_h_, _l_) } }
inline invalidate(_h_, _l_) { d_step { _flush(_h_, _l_) } }
inline evict(_h_, _l_) { d_step { _flush(_h_, _l_) } }

#ifdef FULL_ENV

#define MAYBE_EVICT(h, l)
#define MAY_TEAR(h, l)

/* "x = v; flush(l); fence": two steps, the env may evict in between */
inline publish(_h_, _l_, _x_, _v_) {
  store(_h_, _x_, _v_);
  flush(_h_, _l_)
}

/* "invalidate(l); fence; r = x": two steps, the copy stays valid (and may
 * go stale, or be dropped/refetched by the env) afterwards */
inline read_fresh(_h_, _l_, _x_, _r_) {
  invalidate(_h_, _l_);
  load(_h_, _x_, _r_)
}

inline read2_fresh(_h_, _l_, _x1_, _r1_, _x2_, _r2_) {
  invalidate(_h_, _l_);
  load(_h_, _x1_, _r1_);
  load(_h_, _x2_, _r2_)
}

/* ENV(h,l): two options of env's loop */
#define ENV(h,l) \
  :: d_step { valid[LI(h,l)] -> _flush(h, l) } \
  :: d_step { !dirty[LI(h,l)] -> _fetch(h, l) }

proctype env() {
end_env:
  do
  ENV_OPTIONS
  od
}
#define RUN_ENV run env()

#else /* reduced */

#define MAYBE_EVICT(h, l) if :: skip :: evict(h, l) fi
#define MAY_TEAR(h, l) if :: skip :: evict(h, l) fi
#define RUN_ENV skip

inline publish(_h_, _l_, _x_, _v_) {
  d_step { _store(_h_, _x_, _v_); _flush(_h_, _l_) }
}

inline read_fresh(_h_, _l_, _x_, _r_) {
  d_step { _flush(_h_, _l_); _load(_h_, _x_, _r_); _drop(_h_, _l_) }
}

/* the line may be evicted between the two loads (MAY_TEAR), so r2 may come
 * from a newer version of the line than r1 */
inline read2_fresh(_h_, _l_, _x1_, _r1_, _x2_, _r2_) {
  d_step { _flush(_h_, _l_); _load(_h_, _x1_, _r1_) };
  MAY_TEAR(_h_, _l_);
  d_step { _load(_h_, _x2_, _r2_); _drop(_h_, _l_) }
}

#endif
