"""The history checker (`tract.testing.history`): each rule on small
histories written through a `Recorder`, the violation's events (the
minimal sub-history that shows it), and a torn last line skipped.  The
campaigns' histories are checked in tests/test_faults.py."""

import os
import types

import numpy as np

from tract.testing.history import Recorder, check, key_names, read

K1, K2 = key_names(np.array([[1, 2], [3, 4]], dtype=np.uint64))


class History:
    """A history written by fake processes, one `Recorder` per node."""

    def __init__(self, directory):
        self.directory = str(directory)
        self.recorders = {}

    def on(self, node) -> Recorder:
        if node not in self.recorders:
            self.recorders[node] = Recorder(self.directory, node)
        return self.recorders[node]

    def op(self, node, kind, begin, end=None) -> str:
        name = self.on(node).begin(kind, **begin)
        if end is not None:
            self.on(node).end(name, kind, **end)
        return name

    def store(self, node, version, written=True):
        return self.op(node, "store", {"keys": [K1, K2], "versions": [version] * 2},
                       {"written": [written] * 2})

    def load(self, node, versions, missed=None):
        return self.op(node, "load", {"keys": [K1, K2]},
                       {"versions": versions, "missed": missed})

    def evict(self, node, keys, done=True):
        """An eviction of ``keys``, told as an index tells its watchers;
        not ``done``: the evictor died after its intent."""
        index = types.SimpleNamespace(watchers=[])
        self.on(node).watch(index)
        words = np.array([(int(key[:16], 16), int(key[16:], 16)) for key in keys],
                         dtype=np.uint64)
        index.watchers[0]("evicting", words)
        if done:
            index.watchers[0]("evicted", words)

    def final(self, present, pins=None):
        self.op(0, "final", {"present": present, "pins": pins or {"1": 0}}, {})

    def checked(self):
        for recorder in self.recorders.values():
            recorder.close()
        return check(read(self.directory))


def test_a_consistent_history_has_no_violation(tmp_path):
    history = History(tmp_path)
    history.store(1, 7)
    history.load(2, [7, 7])
    history.evict(3, [K2])
    history.load(2, [7], missed=1)  # K2 gone: evicted
    history.store(1, 8)  # K1 present: only K2 written
    history.load(2, [7, 8])
    history.final([K1, K2])
    assert history.checked() == []


def test_bytes_of_no_version_or_of_a_version_never_stored_are_caught(tmp_path):
    history = History(tmp_path)
    history.store(1, 7)
    history.load(2, [7, None])
    history.load(2, [9])
    found = history.checked()
    assert [v.rule for v in found] == ["stored bytes", "stored bytes"]
    assert "no version" in found[0].message and "version 9" in found[1].message
    assert [e["op"] for e in found[1].events] == ["load", "load"]  # the get alone shows it


def test_a_get_of_a_version_an_eviction_had_removed_is_stale(tmp_path):
    history = History(tmp_path)
    history.store(1, 7)
    history.evict(3, [K1])
    history.load(2, [7])
    found = history.checked()
    assert [v.rule for v in found] == ["no stale get"]
    shown = [(e["op"], e["phase"]) for e in found[0].events]
    assert shown == [("store", "begin"), ("store", "end"), ("evict", "begin"),
                     ("evict", "end"), ("load", "begin"), ("load", "end")]
    assert "no stale get" in found[0].show() and "evict" in found[0].show()


def test_an_eviction_that_died_midway_or_began_before_the_store_ended_is_no_proof(tmp_path):
    history = History(tmp_path)
    history.store(1, 7)
    history.evict(3, [K1], done=False)  # the evictor died: K1 may or may not be gone
    history.load(2, [7])
    assert history.checked() == []


def test_an_acknowledged_store_found_missing_without_an_eviction_is_lost(tmp_path):
    history = History(tmp_path)
    history.store(1, 7)
    history.load(2, [], missed=0)
    history.final([K2])
    found = history.checked()
    assert [v.rule for v in found] == ["no silent loss", "no silent loss"]
    assert "load found key" in found[0].message and "round's end" in found[1].message
    assert {e["op"] for e in found[1].events} == {"store", "final"}


def test_an_eviction_since_the_store_explains_a_miss(tmp_path):
    history = History(tmp_path)
    history.store(1, 7)
    history.evict(3, [K1], done=False)
    history.load(2, [], missed=0)
    history.final([K2])
    assert history.checked() == []


def test_a_store_that_wrote_nothing_promises_nothing(tmp_path):
    history = History(tmp_path)
    history.store(1, 7, written=False)
    history.op(1, "store", {"keys": [K1], "versions": [8]})  # killed: no acknowledgement
    history.load(2, [], missed=0)
    history.final([])
    assert history.checked() == []


def test_pins_left_by_a_node_that_left_are_caught(tmp_path):
    history = History(tmp_path)
    history.final([], pins={"1": 0, "2": 3})
    found = history.checked()
    assert [v.rule for v in found] == ["pins balance"] and "'2': 3" in found[0].message


def test_a_torn_last_line_is_skipped(tmp_path):
    history = History(tmp_path)
    history.store(1, 7)
    history.checked()
    with open(os.path.join(tmp_path, "history-1-999.jsonl"), "w") as torn:
        torn.write('{"id": "999-1", "op": "lo')
    assert [event["op"] for event in read(str(tmp_path))] == ["store", "store"]
