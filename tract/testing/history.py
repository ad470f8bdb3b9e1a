"""A history of every cache operation in the fault campaigns and the soak,
and a checker that proves it consistent (issue 27).

Recording (`Recorder`): each process appends one JSON line per event to a
file of its own in a history directory, with one ``write`` each (a process
killed by SIGKILL loses at most the event it was writing, and a torn last
line is skipped).  An operation is two events: ``begin`` before it starts
and ``end`` once it returned, both stamped with ``time.monotonic_ns``
(CLOCK_MONOTONIC: one clock for every process of the host).  An operation
killed midway has a begin and no end.  Keys are the pool's block keys
(32 hex digits); a version names one store's bytes (the campaigns' payloads
carry it, `tract.testing.faults._payload`).

Operations and their fields:

``store`` / ``offer``
    begin: ``keys``, ``versions`` (one per block); end: ``written`` (which
    blocks the call itself published: `tract.connector.Stored.written`;
    an offer's end has none, it is no acknowledgement);
``load`` / ``take``
    begin: ``keys`` (a take's: the prompt's); end: ``versions`` of the
    leading blocks got (None for a block whose bytes matched no version's),
    and ``missed``: the index of the first block found missing (None when
    all were got, or when the node was fenced: a fenced miss observes
    nothing);
``remove``
    begin: ``keys``; end: ``removed``;
``evict``
    from `tract.index.Index.watchers`, in whichever process evicts (for
    room, named, or on request): begin ``"evicting"``, the keys chosen,
    under the index lock before they are marked (an intent: the process
    may die and leave any of them evicted); end ``"evicted"``, the keys
    that are tombstones now;
``final``
    one event, written by the campaign between rounds with every worker
    stopped: ``present``, the keys the pool holds, and ``pins``, the pins
    each node that left holds (a node whose last process died keeps its
    pin words until it rejoins, read by no evictor: not counted).

The checker (`check`) proves, over the whole history:

1. **Stored bytes**: every block got was stored under that key and
   version, by a store or offer that began before the get ended (and its
   bytes were whole: a version's bytes, not a mix).
2. **No stale get**: no get observed a version that a completed eviction
   of its key had removed before the get began (an eviction that began
   after the version's store ended removes that version, or it was gone
   already; nothing brings a version back).
3. **No silent loss**: an acknowledged store (its end's ``written``) is
   loadable until an eviction of its key begins: a get that began after
   the acknowledgement and found the key missing, or a ``final`` that
   lacks it, with no eviction intent of the key since the store began, is
   a lost store.
4. **Pins balance**: every ``final`` finds no pin held by a node that left.

A violation carries the events that show it, and nothing else (the store,
the eviction, the get), printed in time order by `Violation.show`.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import time
from collections import defaultdict

__all__ = ["Recorder", "Violation", "check", "key_names", "read"]


def key_names(keys) -> list[str]:
    """Block keys, an (n, 2) uint64 array, as the history names them."""
    return [f"{int(high):016x}{int(low):016x}" for high, low in keys]


class Recorder:
    """One process's history file in ``directory``.  `begin` and `end`
    write an operation's two events; `watch` records an index's
    evictions."""

    def __init__(self, directory: str, node: int):
        self.node, self.pid = node, os.getpid()
        path = os.path.join(directory, f"history-{node}-{self.pid}.jsonl")
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._serial = 0
        self._evicting: str | None = None

    def _write(self, event: dict) -> None:
        event.update(t=time.monotonic_ns(), node=self.node, pid=self.pid)
        os.write(self._fd, (json.dumps(event) + "\n").encode())

    def begin(self, op: str, **fields) -> str:
        """Record ``op``'s start; returns its id, for `end`."""
        self._serial += 1
        name = f"{self.node}-{self.pid}-{self._serial}"
        self._write({"id": name, "op": op, "phase": "begin", **fields})
        return name

    def end(self, name: str, op: str, **fields) -> None:
        self._write({"id": name, "op": op, "phase": "end", **fields})

    def watch(self, index) -> None:
        """Record every eviction ``index`` (a `tract.index.Index`) makes."""
        index.watchers.append(self._eviction)

    def _eviction(self, phase: str, keys) -> None:
        if phase == "evicting":
            self._evicting = self.begin("evict", keys=key_names(keys))
        elif self._evicting is not None:
            self.end(self._evicting, "evict", keys=key_names(keys))
            self._evicting = None

    def close(self) -> None:
        os.close(self._fd)


def read(directory: str) -> list[dict]:
    """Every event recorded in ``directory``, in time order; a torn line
    (a process killed mid-write) is skipped."""
    events = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("history-") and name.endswith(".jsonl")):
            continue
        with open(os.path.join(directory, name)) as source:
            for line in source:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    events.sort(key=lambda event: event["t"])
    return events


@dataclasses.dataclass
class Violation:
    """A rule broken, and the events that show it."""

    rule: str
    message: str
    events: list[dict]

    def show(self, since: int = 0) -> str:
        """The violation and its events, one a line, times in ms from ``since``."""
        lines = [f"{self.rule}: {self.message}"]
        for event in sorted(self.events, key=lambda event: event["t"]):
            fields = {name: value for name, value in event.items()
                      if name not in ("t", "node", "pid", "id", "op", "phase")}
            text = json.dumps(fields)
            lines.append(f"  {(event['t'] - since) / 1e6:12.3f} ms  node {event['node']} "
                         f"pid {event['pid']}  {event['op']} {event['phase']} "
                         f"{text[:300]}")
        return "\n".join(lines)


@dataclasses.dataclass
class _Op:
    begin: dict
    end: dict | None = None

    @property
    def began(self) -> int:
        return self.begin["t"]

    @property
    def ended(self) -> int | None:
        return None if self.end is None else self.end["t"]

    def events(self) -> list[dict]:
        return [self.begin] + ([self.end] if self.end is not None else [])


def _operations(events: list[dict]) -> list[_Op]:
    ops: dict[str, _Op] = {}
    for event in events:
        if event["phase"] == "begin":
            ops[event["id"]] = _Op(event)
        elif event["id"] in ops:
            ops[event["id"]].end = event
    return sorted(ops.values(), key=lambda op: op.began)


def check(events: list[dict], limit: int = 20) -> list[Violation]:
    """The violations of rules 1-4 (see the module's docstring) in
    ``events`` (`read`), at most ``limit``."""
    ops = _operations(events)
    writers: dict[tuple[str, int], _Op] = {}  # (key, version) -> the store or offer writing it
    acked: dict[str, list[tuple[int, int, _Op]]] = defaultdict(list)  # key -> (ended, began, op)
    intents: dict[str, list[int]] = defaultdict(list)  # key -> when its evictions began
    evictions: dict[str, list[tuple[int, int, _Op]]] = defaultdict(list)  # (ended, began, op)
    gets, finals = [], []
    for op in ops:
        kind = op.begin["op"]
        if kind in ("store", "offer"):
            for key, version in zip(op.begin["keys"], op.begin["versions"]):
                writers.setdefault((key, version), op)
            if kind == "store" and op.end is not None:
                for key, written in zip(op.begin["keys"], op.end["written"]):
                    if written:
                        acked[key].append((op.ended, op.began, op))
        elif kind == "evict":
            for key in op.begin["keys"]:
                intents[key].append(op.began)  # ops come in order of their begins
            if op.end is not None:
                for key in op.end["keys"]:
                    evictions[key].append((op.ended, op.began, op))
        elif kind in ("load", "take") and op.end is not None:
            gets.append(op)
        elif kind == "final":
            finals.append(op)
    for table in (acked, evictions):
        for entries in table.values():
            entries.sort(key=lambda entry: entry[:2])
    found: list[Violation] = []

    def evicting(key, after, before) -> bool:
        """Whether an eviction of ``key`` began in (after, before)."""
        times = intents.get(key, [])
        at = bisect.bisect_right(times, after)
        return at < len(times) and times[at] < before

    def last_ack(key, before):
        """The acknowledged store of ``key`` that began last among those
        that ended before ``before``."""
        stores = [entry for entry in acked.get(key, []) if entry[0] < before]
        return max(stores, key=lambda entry: entry[1], default=None)

    for get in gets:
        keys, versions = get.begin["keys"], get.end["versions"]
        for block, version in enumerate(versions):
            key = keys[block]
            if version is None:
                found.append(Violation("stored bytes", f"{get.begin['op']} got block {block} of "
                                       f"key {key} with bytes of no version (torn or foreign)",
                                       get.events()))
                continue
            writer = writers.get((key, version))
            if writer is None or writer.began > get.ended:
                found.append(Violation("stored bytes", f"{get.begin['op']} got version "
                                       f"{version} of key {key}, which no store wrote before "
                                       f"it ended", get.events()
                                       + (writer.events() if writer else [])))
                continue
            if writer.ended is None:
                continue
            for ended, began, eviction in evictions.get(key, []):
                if ended >= get.began:
                    break
                if began > writer.ended:
                    found.append(Violation("no stale get", f"{get.begin['op']} got version "
                                           f"{version} of key {key} after an eviction that "
                                           f"began once that version was stored had ended",
                                           writer.events() + eviction.events() + get.events()))
                    break
        missed = get.end.get("missed")
        if missed is not None and missed < len(keys):
            key = keys[missed]
            store = last_ack(key, get.began)
            if store is not None and not evicting(key, store[1], get.ended):
                found.append(Violation("no silent loss", f"{get.begin['op']} found key {key} "
                                       f"missing, acknowledged as stored before it began and "
                                       f"never evicted since", store[2].events() + get.events()))
    for final in finals:
        present = set(final.begin["present"])
        for key in acked:
            store = last_ack(key, final.began)
            if key in present or store is None or evicting(key, store[1], final.began):
                continue
            found.append(Violation("no silent loss", f"key {key}, acknowledged as stored and "
                                   f"never evicted since, is not in the pool at a round's end",
                                   store[2].events() + final.events()))
        held = {node: pins for node, pins in final.begin["pins"].items() if pins}
        if held:
            found.append(Violation("pins balance", f"pins held at a round's end with every "
                                   f"worker stopped: {held}", final.events()))
    return found[:limit]
