"""Metadata fuzzing: corrupt one metadata area of a populated pool, then
open, read, use and fsck it; R5 says the outcome is a clear error or a
repair, never a crash, a hang or an access outside the mapping.

Corruptions (drawn by hypothesis: lock mode, area, place, kind, value):
random bytes, a bit flip, a word set to a huge value, a word one or a line
off its value, a byte set to a small number where enums live, a word set
to the drawn value (targeted cases choose the word too); in the
header, the node table, the lock names and lock area, the allocator's
cursor, bitmap, owner records and free rings, the object directory, the index
entries and the per-node pin and stamp lines, the stats lines, and a P/D
handoff record (its head, taken line and keys).  A pool of each lock mode:
in manager mode the native fast paths of the lock and the allocator run,
and in both the native handoff read, so corrupt counts, lengths and
offsets reach the native code as well as the Python steps.

Each case runs on a fresh copy of the pool, in a child process (a segfault
kills only the child, and is reported with its case), under an alarm (a
hang is a finding).  The allowed outcomes of every step are success or a
`tract.errors.TractError` other than `BoundsError` (which would mean an
offset read from the pool reached the mapping's own bounds check unchecked);
after ``fsck --repair`` says it repaired to clean, a second check must agree.

    python -m tract.testing.fuzz --cases N [--seed S] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import threading
import traceback
import uuid

__all__ = ["AREAS", "KINDS", "LOCK_MODES", "fuzz", "main", "run_cases"]

AREAS = ("header", "node table", "lock names", "lock area", "allocator cursor",
         "allocator bitmap", "allocator owners", "free rings", "objects", "index entries",
         "index pins", "stats", "handoff record")
LOCK_MODES = ("bakery", "manager")
KINDS = ("random bytes", "bit flip", "huge word", "off by one", "off by a line", "small enum",
         "set word")
CASE_SECONDS = 20
_NODES, _USER, _REPAIRER = 4, 3, 2
_NAMES = ("kv/root", "kv/table", "tenant/a")
_OFFER = "handoff/offer"  # names the handoff record's range, for `areas`
_NONCE = 0x5EED_0F7A_C700_0001  # the record's nonce: its ticket is known before any corruption


def _layout():
    from tract.transfer import KVLayout

    return KVLayout(model="tract-fuzz", dtype="uint8", num_layers=1, num_kv_heads=1,
                    head_size=128, block_size=16)


def _tokens():
    import numpy as np

    return np.arange(4 * 16, dtype=np.int64) * 7 + 3


def template(path: str, lock_mode: str = "bakery") -> None:
    """A small pool in use: nodes that joined, named objects, extents and
    slab blocks, index entries with payloads, a pin left by a node, and a
    live handoff record of the stored blocks' keys."""
    import numpy as np

    from tract import handoff
    from tract.connector import Connector
    from tract.handoff import HandoffRecords
    from tract.pool import Pool

    Pool.create(path, 4 << 20, chunk_size=64 << 10, max_nodes=_NODES, index_capacity=256,
                max_objects=16, lock_mode=lock_mode, lease_timeout=0.2)
    manager = lock_mode == "manager"
    with Pool.open(path, 0, manager=manager) as pool, Pool.open(path, 1) as other:
        for name, size in zip(_NAMES, (300_000, 5000, 40_000)):
            pool.objects.put(name, pool.alloc(size), size)
        connector = Connector(pool, _layout())
        size = connector.layout.block_bytes
        blocks = [np.full(size, i, np.uint8) for i in range(4)]
        connector.store(_tokens(), blocks)
        Connector(other, _layout()).store(np.arange(64, dtype=np.int64), blocks)
        other.index.pin(connector.keys(_tokens())[:2])  # left pinned by node 1
        other.alloc(3000)
        keys = connector.keys(_tokens())
        size = handoff._KEYS_AT + 16 * len(keys)
        offset = pool.index.alloc(size)
        HandoffRecords(pool).fast.write(offset, _NONCE, pool.node, pool.epoch,
                                        pool.clock.wall() + 30 * 86400, keys)
        pool.objects.put(_OFFER, offset, size)
        connector.close()


def areas(path: str) -> dict[str, tuple[int, int]]:
    """Each metadata area's [start, end) in the pool at ``path``."""
    from tract.pool import Pool

    with Pool.observe(path) as pool:
        h, alloc = pool.header, pool.alloc_layout
        offer = pool.objects.get(_OFFER)
        return {"header": (0, 224), "node table": (h.node_table, h.names),
                "lock names": (h.names, h.lock_area),
                "lock area": (h.lock_area, h.lock_area + h.lock_area_size),
                "allocator cursor": (alloc.cursor_line, alloc.cursor_line + 64),
                "allocator bitmap": (alloc.bitmap, alloc.owners),
                "allocator owners": (alloc.owners, alloc.rings),
                "free rings": (alloc.rings, alloc.offset + alloc.nbytes),
                "objects": (h.objects, h.index),
                "index entries": (h.index, h.index + h.index_capacity * 64),
                "index pins": (h.index_nodes, h.stats), "stats": (h.stats, h.heap),
                "handoff record": (offer.offset, offer.offset + offer.size)}


def ticket(where: dict) -> str:
    """The ticket of the template's handoff record, as the decode side gets
    it with the request (from outside the pool, before any corruption)."""
    from tract.handoff import format_ticket

    return format_ticket(where["handoff record"][0], _NONCE)


def corrupt(path: str, where: dict, case: dict) -> str:
    """Apply ``case`` (area, at: a fraction of the area, kind, value) to
    the pool file; returns what was done."""
    import numpy as np

    start, end = where[case["area"]]
    at = start + (8 * case["word"] if "word" in case  # a chosen word, for targeted cases
                  else int(case["at"] * (end - start - 8)) // 8 * 8)
    with open(path, "r+b") as pool:
        pool.seek(at)
        word = int.from_bytes(pool.read(8), "little")
        kind, value = case["kind"], case["value"]
        if kind == "random bytes":
            count = 1 + value % 64
            raw = np.random.default_rng(value).integers(0, 256, count, np.uint8).tobytes()
            new = raw[:max(0, min(count, end - at))]
        elif kind == "bit flip":
            new = (word ^ (1 << (value % 64))).to_bytes(8, "little")
        elif kind == "huge word":
            new = (1 << 63 | value % (1 << 63) if value % 2 else (1 << 64) - 1 - value % 97
                   ).to_bytes(8, "little")
        elif kind == "off by one":
            new = ((word + (1 if value % 2 else -1)) % (1 << 64)).to_bytes(8, "little")
        elif kind == "off by a line":
            new = ((word + (64 if value % 2 else -64)) % (1 << 64)).to_bytes(8, "little")
        elif kind == "set word":
            new = (value % (1 << 64)).to_bytes(8, "little")
        else:  # a small number where an enum (state, kind, mode) may live
            new = bytes([value % 8])
        pool.seek(at)
        pool.write(new)
    return f"{kind} at offset {at} ({case['area']} [{start}, {end}))"


def _exercise(path: str, clear: list[str] | None = None, offer: str | None = None
              ) -> list[str]:
    """Open, read, use and fsck a corrupted pool; the findings (the steps
    that ended in a clear error go to ``clear``).  ``offer``: the ticket of
    the template's handoff record, taken as the decode side takes it."""
    findings, clear = [], [] if clear is None else clear
    hook = threading.excepthook

    def thread_died(args):  # a pool thread (heartbeat, manager) must survive corruption
        findings.append(f"thread {args.thread.name} died: {args.exc_type.__name__}: "
                        f"{args.exc_value}")

    threading.excepthook = thread_died
    try:
        return _steps(path, findings, clear, offer)
    finally:
        threading.excepthook = hook


def _steps(path: str, findings: list[str], clear: list[str], offer: str | None) -> list[str]:
    import numpy as np

    from tract.connector import Connector
    from tract.errors import BoundsError, TractError
    from tract.fsck import fsck
    from tract.handoff import parse_ticket
    from tract.pool import Pool

    def step(what, call):
        try:
            return call()
        except BoundsError as error:
            findings.append(f"{what}: an offset reached the mapping's bounds check unchecked: "
                            f"{error}")
        except TractError:
            clear.append(what)  # a clear error (R5)
            return None
        except Exception as error:
            findings.append(f"{what}: {type(error).__name__}: {error} "
                            f"[{traceback.format_exc(limit=-2).strip()}]")
        return None

    def use():
        with Pool.observe(path) as pool:
            manager = pool.header.lock_mode_name == "manager"
        with Pool.open(path, _USER, manager=manager) as pool:
            for name in _NAMES:
                step(f"objects.get({name!r})", lambda: pool.objects.get(name))
            connector = Connector(pool, _layout(), timeout=1.0)
            tokens = _tokens()
            out = [np.zeros(connector.layout.block_bytes, np.uint8) for _ in range(4)]
            hit = step("lookup", lambda: connector.lookup(tokens)) or 0
            step("load", lambda: connector.load(tokens[:hit], out[:hit // 16]))
            offset = step("alloc", lambda: pool.alloc(5000, timeout=1.0))
            if offset is not None:
                step("free", lambda: pool.free(offset, timeout=1.0))
            step("store", lambda: connector.store(np.arange(64, dtype=np.int64) + 999, out))
            if offer is not None:  # the decode side's take, then the producer's look
                step("take", lambda: connector.take(offer, out))
                step("taken", lambda: connector.handoff.taken([parse_ticket(offer)]))
            connector.close()

    step("open and use", use)
    step("fsck", lambda: fsck(path, watch=False))
    repaired = step("fsck --repair", lambda: fsck(path, repair=True, node=_REPAIRER,
                                                 watch=False))
    if repaired is not None and repaired["ok"]:
        after = step("fsck after repair", lambda: fsck(path, watch=False))
        if after is not None and not after["ok"]:
            findings.append(f"fsck --repair said clean, a second check found "
                            f"{after['problems'][:2]}")
    return findings


def _child(templates: dict, cases: list[dict], first: int, results) -> None:
    """Run ``cases`` from ``first`` on, each on a copy of its lock mode's
    template (``templates``: mode -> (path, areas)), reporting to ``results``."""
    def alarm(signum, frame):
        raise TimeoutError(f"the case ran past {CASE_SECONDS} s")

    signal.signal(signal.SIGALRM, alarm)
    for index in range(first, len(cases)):
        base, where = templates[cases[index]["lock mode"]]
        copy = f"{base}-case"
        results.send(("start", index))
        try:
            shutil.copyfile(base, copy)
            done = corrupt(copy, where, cases[index])
            signal.alarm(CASE_SECONDS)
            clear: list[str] = []
            try:
                findings = _exercise(copy, clear, ticket(where))
            except TimeoutError as error:
                findings = [f"hang: {error}"]
            finally:
                signal.alarm(0)
            results.send(("done", index, done, findings, len(clear)))
        finally:
            _remove(copy)


def _remove(path: str) -> None:
    from tract.pool import Pool

    try:
        Pool.destroy(path)
    except (OSError, ValueError):
        if os.path.exists(path):
            os.unlink(path)


def draw_cases(count: int, seed: int) -> list[dict]:
    """``count`` corruptions, drawn by hypothesis (seeded: the same list
    for the same seed)."""
    from hypothesis import HealthCheck, given, seed as with_seed, settings
    from hypothesis import strategies as st

    cases = []

    @with_seed(seed)
    @settings(max_examples=count, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.fixed_dictionaries({"lock mode": st.sampled_from(LOCK_MODES),
                                  "area": st.sampled_from(AREAS),
                                  "at": st.floats(0.0, 1.0, allow_nan=False),
                                  "kind": st.sampled_from(KINDS),
                                  "value": st.integers(0, 2**64 - 1)}))
    def draw(case):
        cases.append(case)

    draw()
    return cases[:count]


def fuzz(cases: int, seed: int = 0) -> dict:
    """Run ``cases`` corruptions; returns ``{"cases", "by_area",
    "findings": [...]}``."""
    return {**run_cases(draw_cases(cases, seed)), "seed": seed}


def run_cases(drawn: list[dict]) -> dict:
    """Run corruptions (`draw_cases`' dictionaries, or targeted ones with a
    ``word`` instead of ``at``), each on a copy of a template of its lock
    mode; returns ``{"cases", "by_area", "clear_errors", "findings"}``."""
    stem = os.path.join("/dev/shm", f"tract-fuzz-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    context = multiprocessing.get_context("fork")
    findings, by_area, tried, clear_errors = [], dict.fromkeys(AREAS, 0), 0, 0
    templates, made = {}, []
    try:
        for mode in sorted({case["lock mode"] for case in drawn}):
            base = f"{stem}-{mode}"
            made.append(base)
            template(base, mode)
            templates[mode] = base, areas(base)
            _exercise_warm(base, ticket(templates[mode][1]))
        next_case = 0
        while next_case < len(drawn):
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_child, args=(templates, drawn, next_case, send),
                                    daemon=True)
            child.start()
            send.close()
            running = None
            while True:
                try:
                    message = receive.recv()
                except EOFError:
                    break
                if message[0] == "start":
                    running = message[1]
                    continue
                _, index, done, found, errors = message
                tried += 1
                clear_errors += errors
                by_area[drawn[index]["area"]] += 1
                findings += [f"case {index} ({done}): {f}" for f in found]
                running = None
            child.join()
            if running is None:
                break
            tried += 1
            by_area[drawn[running]["area"]] += 1
            findings.append(f"case {running} ({drawn[running]}): the process died with "
                            f"code {child.exitcode}")
            next_case = running + 1
    finally:
        for base in made:
            _remove(base)
    return {"cases": tried, "by_area": by_area, "clear_errors": clear_errors,
            "findings": findings}


def _exercise_warm(base: str, offer: str) -> None:
    """Compile the kernels the children use, once, before they fork."""
    copy = f"{base}-warm"
    shutil.copyfile(base, copy)
    try:
        _exercise(copy, offer=offer)
    finally:
        _remove(copy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tract.testing.fuzz",
                                     description="corrupt pool metadata; expect clear errors")
    parser.add_argument("--cases", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = fuzz(args.cases, args.seed)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"corruptions tried: {report['cases']} ({', '.join(f'{a}: {n}' for a, n in report['by_area'].items())}); "
              f"clear errors raised: {report['clear_errors']}; findings: "
              f"{len(report['findings'])}")
        for finding in report["findings"][:30]:
            print(f"  {finding}")
    return 1 if report["findings"] else 0


if __name__ == "__main__":
    from tract.testing import fuzz as _fuzz

    raise SystemExit(_fuzz.main())
