"""Fast twins (DESIGN.md §5): every native or Numba hot path held to the
Python step it replaces, by result, bytes and cache-control trace.

`TWINS` registers each fast entry point with its reference, the Python step
that the simulator and the mutation harness prove, and declares each
deliberate difference between them in one line.  `run` puts both on the
same starting bytes of a real mapping, each under the native trace
(`Region.trace_start`: the reference's Python calls go through the same
primitives), and `check` requires

- the same result (or the reference's error where the fast path hands a
  hard case back, having written nothing);
- the same bytes afterwards;
- the same fence-separated batches of ``(instruction, line)``: order inside
  a batch is free, the batches come in the same order, each closed by the
  same kind of fence;
- the same *memory* afterwards.  Each side runs against the shadow memory
  of the native trace (`Region.trace_start` with ``memory``): the mapping
  is this host's cache and the shadow what memory holds, which only a
  flush, write-back or streaming store completed by a fence changes, and
  from which only an invalidation completed by a fence refetches.  Every
  line of the areas starts *stale* in the cache (`STALE`: the bytes of
  memory inverted, as if another host had written them all since this host
  fetched them), so a read before its invalidation and fence reads what no
  host wrote, and a store after the write-back that should carry it never
  reaches memory: the order of the data against the cache control shows,
  which batches alone, free inside, do not.

So the simulator's verdict on a reference carries over to its twin, and the
mutation harness's deletions and moves in native code are caught here
(``python -m tract.testing.mutants``).  `tests/test_rules.py` fails when a
fast entry point has no entry here.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from tract._native._region import INSTRUCTIONS, LINE, TRACE_FENCE

__all__ = ["INSTRUCTIONS", "NOT_STEPS", "STALE", "TWINS", "UNPROVEN", "Outcome", "Twin", "batches",
           "both", "check", "compose", "drop_refetch", "hoist_reads", "merge_into_first", "run",
           "twin"]


@dataclasses.dataclass(frozen=True)
class Twin:
    """A fast entry point, the Python step it replaces, and each deliberate
    difference between them (one line each)."""

    fast: str
    reference: str
    differences: tuple[str, ...] = ()


TWINS: dict[str, Twin] = {twin.fast: twin for twin in (
    Twin("tract._kernels.indexfast.lookup", "tract.index.Index._probe"),
    Twin("tract._kernels.indexfast.pin", "tract.index.Index.pin",
         ("at a full pin word it stops: the pins after it are never taken, so never taken "
          "back",)),
    Twin("tract._kernels.indexfast.reserve_slots", "tract.index.Index._reserve_slots"),
    Twin("tract._kernels.indexfast.reserve_entries", "tract.index.Index._reserve_entries"),
    Twin("tract._kernels.indexfast.finish_entries", "tract.index.Index._finished"),
    Twin("tract._kernels.indexfast.write", "tract.index.Index._write"),
    Twin("tract._kernels.indexfast.stamp", "tract.index.Index._stamp_words"),
    Twin("tract._kernels.indexfast.unpin",
         "tract.index.Index._pin_words + tract.index.Index._unpin_words"),
    Twin("tract._native._allocfast.ChunkFastPath.alloc",
         "tract.alloc.Allocator._find + tract.lock.Lock.check + tract.alloc.Allocator._publish",
         ("the grant line is dropped with the first lines read and read after their fence, "
          "not in a batch of its own",
          "the bitmap, read fresh by the first batch, is not dropped and read again before "
          "its bits are set",
          "a hard case (no free run, a cursor out of range, a lost grant) is handed back "
          "before any write: the reference then decides it")),
    Twin("tract._native._allocfast.ChunkFastPath.free",
         "tract.alloc.Allocator._extent + tract.lock.Lock.check + tract.alloc.Allocator._release",
         ("the grant line is dropped with the first lines read and read after their fence, "
          "not in a batch of its own",
          "the bitmap lines are dropped with the owner records read, not in a batch of their "
          "own",
          "a hard case (records not whole, in range and of the kind expected, a lost grant) "
          "is handed back before any write: the reference then decides it")),
    Twin("tract._native._allocfast.ChunkFastPath.fresh_kind",
         "tract.alloc.Allocator.free (its look at the head record before the lock)"),
    Twin("tract._native._lockfast.ManagerFastPath.attempt",
         "tract.lock.ManagedLock.announce + tract.lock.ManagedLock.attempt",
         ("a torn line or a value out of range is handed back (ANNOUNCED) for the reference "
          "to raise",)),
    Twin("tract._native._lockfast.ManagerFastPath.still_granted",
         "tract.lock.ManagedLock.still_granted",
         ("a torn line or a value out of range answers False for the reference to raise",)),
    Twin("tract._native._lockfast.ManagerFastPath.repair", "tract.lock.ManagedLock.release"),
    Twin("tract._native._lockfast.ManagerFastPath.acquire", "tract.lock.Cohort.acquire",
         ("a torn line or a value out of range is handed back (ANNOUNCED) for the reference "
          "to raise",)),
    Twin("tract._native._lockfast.ManagerFastPath.release", "tract.lock.Cohort.release"),
    Twin("tract._native._lockfast.ManagerFastPath.sweep", "tract.lock.Cohort.sweep"),
    Twin("tract._native._lockfast.Heartbeat.start",
         "tract.lease.OwnLease.beat + tract.lease.NodeTable.beat",
         ("beats every period on a thread of its own, without the GIL",)),
    Twin("tract._native._handofffast.HandoffFastPath.write",
         "tract.handoff.HandoffRecords._write"),
    Twin("tract._native._handofffast.HandoffFastPath.read",
         "tract.handoff.HandoffRecords._read"),
    Twin("tract._native._handofffast.HandoffFastPath.mark",
         "tract.handoff.HandoffRecords._mark"),
    Twin("tract._native._handofffast.HandoffFastPath.taken",
         "tract.handoff.HandoffRecords._taken"),
    Twin("tract._native._handofffast.HandoffFastPath.withdraw",
         "tract.handoff.HandoffRecords._withdraw"),
    Twin("tract._native._region.Region.copy_in_blocks",
         "tract._native._region.Region.copy_in (non-temporal), per block",
         ("one store fence for the whole batch, not one per block",)),
    Twin("tract._native._region.Region.copy_out_blocks",
         "tract._native._region.Region.invalidate (payload) per block, fence, copy_out per "
         "block"),
    Twin("tract._native._region.Region.digest_blocks",
         "tract._native._region.digest (per piece)"),
)}

#: fast entry points that are no protocol step, and why they need no twin
NOT_STEPS: dict[str, str] = {
    "tract._native._lockfast.ManagerFastPath.slot_words":
        "reads the node-local slot words for tests; no pool memory",
    "tract._native._lockfast.Heartbeat.stop":
        "stops and joins the beating thread; writes nothing",
    "tract._native._region.flat_segments":
        "walks an engine's buffers, no pool memory: held to TransferEngine._walk by "
        "tests/test_transfer.py",
    "tract._native._nodeheap.NodeHeap":
        "node-local memory (one host, so coherent): no cache control; held to its "
        "result by tests/test_alloc.py",
}

#: fast entry points whose Python reference is not written yet; each is a
#: defect (DESIGN.md §5) that tests/test_rules.py lists and allows to shrink only
UNPROVEN: dict[str, str] = {}


def twin(fast: str) -> Twin:
    """The registered twin of a fast entry point (a KeyError names it)."""
    try:
        return TWINS[fast]
    except KeyError:
        raise KeyError(f"{fast} has no registered twin in tests/twins.py") from None


Batch = tuple[int, tuple[tuple[int, int], ...]]  # (closing fence or 0, sorted line ops)


def batches(trace: np.ndarray) -> list[Batch]:
    """The trace cut at its fences: each batch is the fence that closes it
    (0 for operations after the last fence) and its line operations,
    sorted (order inside a batch is free)."""
    out: list[Batch] = []
    pending: list[tuple[int, int]] = []
    for op, offset in trace.tolist():
        if op >= TRACE_FENCE:
            out.append((op, tuple(sorted(pending))))
            pending = []
        else:
            pending.append((op, offset))
    if pending:
        out.append((0, tuple(sorted(pending))))
    return out


Adjust = Callable[[list[Batch], list[Batch]], tuple[list[Batch], list[Batch]]]


def merge_into_first(lines: Callable[[int], bool]) -> Adjust:
    """A declared difference: the batches whose every line satisfies
    ``lines`` (for example the lock's manager and grant lines) are not
    batches of their own; their operations join the first batch."""
    def adjust(found: list[Batch], fast: list[Batch]) -> tuple[list[Batch], list[Batch]]:
        if not found:
            return found, fast
        moved = [batch for batch in found[1:] if batch[1] and all(lines(offset)
                                                               for _, offset in batch[1])]
        kept = [batch for batch in found[1:] if not any(batch is m for m in moved)]
        first = (found[0][0], tuple(sorted(found[0][1] + sum((m[1] for m in moved), ()))))
        return [first, *kept], fast
    return adjust


def drop_refetch(lines: Callable[[int], bool]) -> Adjust:
    """A declared difference: the reference drops and reads again lines
    (those satisfying ``lines``) that the first batch already read fresh
    and that nobody else may write meanwhile (R2); the operations on them in
    fenced batches after the first are not the fast path's."""
    def adjust(found: list[Batch], fast: list[Batch]) -> tuple[list[Batch], list[Batch]]:
        out = found[:1]
        for fence, ops in found[1:]:
            if fence:
                ops = tuple(op for op in ops if not lines(op[1]))
            out.append((fence, ops))
        return out, fast
    return adjust


def hoist_reads(lines: Callable[[int], bool]) -> Adjust:
    """A declared difference: the fast path drops lines (those satisfying
    ``lines``) with the batches of misses before them, where the reference
    drops them in a fenced batch of their own.  That batch is taken out of
    the reference, and its operations out of the fast path's batches before
    its place; when those are not exactly the same operations, nothing is
    taken out (and the comparison fails)."""
    def adjust(found: list[Batch], fast: list[Batch]) -> tuple[list[Batch], list[Batch]]:
        own = [index for index, (fence, ops) in enumerate(found)
               if fence and ops and all(lines(offset) for _, offset in ops)]
        if not own:
            return found, fast
        place = own[0]

        def ours(batches):
            return collections.Counter(op for _, ops in batches[:place] for op in ops
                                       if lines(op[1]))
        if ours(fast) - ours(found) != collections.Counter(found[place][1]):
            return found, fast
        extra = ours(fast) - ours(found)
        hoisted = []
        for fence, ops in fast[:place]:
            kept = []
            for op in ops:
                if extra[op]:
                    extra[op] -= 1
                else:
                    kept.append(op)
            hoisted.append((fence, tuple(kept)))
        return found[:place] + found[place + 1:], hoisted + fast[place:]
    return adjust


def compose(*adjustments: Adjust) -> Adjust:
    """Several declared differences, applied in order."""
    def adjust(found: list[Batch], fast: list[Batch]) -> tuple[list[Batch], list[Batch]]:
        for adjustment in adjustments:
            found, fast = adjustment(found, fast)
        return found, fast
    return adjust


@dataclasses.dataclass
class Outcome:
    """What one side did: its result (or its error's type and message), the
    bytes of the areas afterwards in its cache (the mapping) and in memory
    (the shadow; None without one), and its trace's batches."""

    result: object
    after: list[bytes]
    batches: list[Batch]
    memory: list[bytes] | None = None


Lines = Callable[[int], bool]


def STALE(offset: int) -> bool:  # noqa: N802 (a constant policy, named as one)
    """The default: every line of the areas starts stale in the cache."""
    return True


def run(region, areas: Sequence[tuple[int, int]], step: Callable[[], object],
        start: Sequence[bytes] | None = None, *, capacity: int = 1 << 16,
        errors: tuple[type[BaseException], ...] = (Exception,),
        stale: Lines | None = STALE, shadow: bool = True,
        also: Sequence[tuple[int, int]] = (), settle: bool = False) -> Outcome:
    """``step()`` from the bytes ``start`` of ``areas`` (``(offset,
    length)`` of ``region``; default: as they are) in memory, under the
    trace and, with ``shadow``, against the shadow memory, the lines of the
    areas that ``stale`` names (by offset) holding in the cache the bytes of
    memory inverted.  The areas ``also`` are shadowed and made stale too,
    but not compared (lines the step reads whose bytes differ between the
    runs for reasons of their own: a lock taken anew for each).  With
    ``settle``, a fence after the step completes what it left queued for
    the caller to fence (a lock's release does), and is not in its trace."""
    if start is not None:
        for (offset, _), data in zip(areas, start):
            region.copy_in(offset, data, nontemporal=False)
    memory, stale_lines = None, []
    if shadow:
        shadowed = [*areas, *also]
        extent = -(-max(offset + length for offset, length in shadowed) // LINE) * LINE
        memory = np.frombuffer(region.read(0, extent), dtype=np.uint8).copy()
        stale_lines = sorted({line for offset, length in shadowed
                              for line in range(offset // LINE * LINE, offset + length, LINE)
                              if stale is not None and stale(line)})
        for line in stale_lines:
            region.copy_in(line, ~memory[line:line + LINE], nontemporal=False)
    region.trace_start(capacity, memory=memory)
    try:
        try:
            result = step()
        except errors as error:
            result = (type(error), str(error))
        if settle:
            region.fence()
    finally:
        trace = region.trace_stop()
        if stale_lines:  # a line the step left as it was stale: fetched anew
            rows = np.asarray(stale_lines) // LINE
            now = np.frombuffer(region.read(0, extent), dtype=np.uint8).reshape(-1, LINE)
            untouched = (now[rows] == ~memory.reshape(-1, LINE)[rows]).all(axis=1)
            for line in rows[untouched] * LINE:
                region.copy_in(int(line), memory[line:line + LINE], nontemporal=False)
    if settle:
        assert trace[-1, 0] == TRACE_FENCE, "the settling fence is not the trace's last"
        trace = trace[:-1]
    return Outcome(result, [bytes(region.read(offset, length)) for offset, length in areas],
                   batches(trace),
                   None if memory is None else
                   [memory[offset:offset + length].tobytes() for offset, length in areas])


def both(region, areas, reference: Callable[[], object], fast: Callable[[], object], **options
         ) -> tuple[Outcome, Outcome]:
    """`run` the reference, then the fast path, from the same starting bytes."""
    start = [bytes(region.read(offset, length)) for offset, length in areas]
    return run(region, areas, reference, start, **options), \
        run(region, areas, fast, start, **options)


def check(name: str, reference: Outcome, fast: Outcome, *,
          same: Callable[[object, object], bool] | None = None,
          adjust: Adjust | None = None,
          context: object = None) -> None:
    """Hold ``fast`` to ``reference`` (see the module docstring); ``same``
    compares results (default ==), ``adjust`` applies the twin's declared
    differences to the reference's batches."""
    twin(name)
    where = f"{name}" + (f" [{context}]" if context is not None else "")
    agree = same(reference.result, fast.result) if same else _equal(reference.result,
                                                                     fast.result)
    assert agree, f"{where}: result {fast.result!r}, its reference {reference.result!r}"
    for what, wanted, found in (("area", reference.after, fast.after),
                                ("memory of area", reference.memory or [], fast.memory or [])):
        for index, (want, got) in enumerate(zip(wanted, found)):
            if want != got:
                at = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
                raise AssertionError(f"{where}: {what} {index} differs from its reference "
                                     f"first at byte {at}")
    assert (reference.memory is None) == (fast.memory is None), \
        f"{where}: one side ran against the shadow memory, the other did not"
    want, got = adjust(reference.batches, fast.batches) if adjust else \
        (reference.batches, fast.batches)
    if want != got:
        raise AssertionError(f"{where}: cache-control batches differ from the reference's:\n"
                             + _diff(want, got))


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _diff(want: list[Batch], got: list[Batch]) -> str:
    for index in range(max(len(want), len(got))):
        a = want[index] if index < len(want) else None
        b = got[index] if index < len(got) else None
        if a != b:
            def show(batch):
                if batch is None:
                    return "none"
                ops = collections.Counter(batch[1])
                return f"{len(batch[1])} line ops {sorted(ops)[:6]}... closed by {batch[0]}"
            return (f"  batch {index} of {len(want)} (reference) / {len(got)} (fast):\n"
                    f"    reference: {show(a)}\n    fast:      {show(b)}")
    return "  (equal)"
