"""Named fail points, and the kill -9 and stall campaigns over them.

A process dies by SIGKILL at a chosen point of a protocol, as a crashing
host would, or stops there (SIGSTOP) for up to four leases and goes on, as
a host under a long pause would, so tests can prove that the rest of the
rack survives it (R6: every claim it held is a lease) and that a process
stalled past its lease writes nothing under its lapsed claims (it fences
itself, `tract.lease.OwnLease`, and rejoins as a new incarnation).

The points themselves are `tract._failpoints`'s (the protocol modules
call them; that module imports only the standard library), re-exported
here: armed from the environment, read once at import
(``TRACT_KILL_POINT=<name>``, ``TRACT_KILL_AFTER=<n>``: die the n-th time
the point is reached, default 1; ``TRACT_KILL_ACTION=stop``: stop there,
until SIGCONT), or in a process by `arm`.  Unarmed,
`point` is one comparison.

Points (`POINTS`):

``lock.acquired`` / ``lock.release``
    a pool lock just granted to this process / about to be given back;
``manager.grant``
    the lock manager has chosen the next holder, its grant line not written;
``alloc.locked`` / ``free.locked``
    inside the allocator's global lock, before an extent is taken / freed;
``store.copied``
    `Connector.store`: payloads copied into reserved blocks, not published;
``publish.locked``
    under the index lock, the entries checked, READY not yet written;
``evict.marked``
    eviction: entries marked EVICTING (in memory), pins not yet read;
``load.pinned``
    `Connector.load` and `Connector.take`: the hits pinned, not yet copied
    into the engine's blocks;
``handoff.pinned`` / ``handoff.released``
    `Connector.offer`: blocks pinned, no handoff record yet / an offer's
    pins dropped, its record not yet queued for freeing.

The kill campaign (`campaign`; ``python -m tract.testing.faults --points N
--seed S [--stall] [--lease L] [--json]``) runs worker processes on several node ids over one
pool (manager locks, every worker a standby manager).  Each runs a mixed
workload (store, lookup and load, P/D offer and take, raw alloc and free,
eviction) on self-describing payloads, armed with a random point; it dies
there by SIGKILL and is restarted on its node as a new incarnation.  The
checks:

- after each kill, every survivor completes an operation within
  `recovery_bound` (the lease, plus the time for the stale heartbeat to
  be seen and a standby manager to take over);
- no load or take serves bytes other than the key's own (a torn, stale or
  foreign block): workers compare every block they get;
- after each round, with every worker stopped and the leases lapsed,
  ``fsck --repair`` leaves a pool that checks clean: every chunk free,
  owned by a live node or referenced (none leaked);
- every store, load, offer, take, remove and eviction is recorded, with
  the pool's keys and pins at each round's end, and the whole history is
  checked at the end (`tract.testing.history`: every block got was stored
  under that key and version, no get is stale, no acknowledged store is
  lost silently, pins balance); ``--ack-before-publish`` runs the seeded
  broken variant it must catch.

The stall campaign (`stall_campaign`; ``--stall``) runs the same workers,
each armed to stop itself at a random point; the campaign resumes it after
a random time up to four leases, and it arms another point.  The same
checks hold (a worker gives up the raw allocations of an incarnation that
lapsed: they were reclaimable), and progress is judged after each stall
begins (every other worker) and after each resume (the stalled one).

Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid

from tract import _failpoints
from tract._failpoints import POINTS, arm, point

__all__ = ["POINTS", "arm", "campaign", "point", "recovery_bound", "soak", "stall_campaign"]

# ---------------------------------------------------------------- campaign

BLOCK_TOKENS = 16
PROMPT_BLOCKS = 4
FAMILIES = 12  # prompts k share their first two blocks with the others of family k // 4


def recovery_bound(lease: float) -> float:
    """How long after a kill every survivor must have made progress: one
    lease for the dead node's heartbeat to go stale, one more for a standby
    manager to see it and take over, with the 5x margin of the tests'
    other timing bounds (a campaign beside a core burner on 2 cores once
    took 2.6 s, against a median of 24 ms)."""
    return 5 * 2 * lease + 1.0


def _layout():
    from tract.transfer import KVLayout

    return KVLayout(model="tract-faults", dtype="uint8", num_layers=1, num_kv_heads=1,
                    head_size=256, block_size=BLOCK_TOKENS)


def _tokens(prompt: int):
    """Prompt ``prompt``'s tokens: two blocks of its family's prefix, two of its own."""
    import numpy as np

    family = np.random.default_rng(1_000_003 * (prompt // 4)).integers(
        0, 50_000, 2 * BLOCK_TOKENS)
    own = np.random.default_rng(prompt).integers(0, 50_000, (PROMPT_BLOCKS - 2) * BLOCK_TOKENS)
    return np.concatenate([family, own]).astype(np.int64)


def _payload(prompt: int, block: int, size: int, version: int):
    """Block ``block`` of prompt ``prompt`` as the store ``version`` writes
    it: bytes that name it (a shared prefix block names its family) and
    the version, so a torn, stale or foreign copy shows."""
    import numpy as np

    owner = (prompt // 4, block) if block < 2 else (FAMILIES * 4 + prompt, block)
    words = np.random.default_rng((*owner, version)).integers(0, 2**63, size // 8,
                                                              dtype=np.int64)
    words[0], words[1], words[2] = *owner, version
    return words.view(np.uint8)


def _version_of(prompt: int, block: int, got) -> int | None:
    """The version whose bytes ``got`` holds as block ``block`` of
    ``prompt``; None when they are no version's (torn, stale or foreign)."""
    import numpy as np

    version = int(got[16:24].view(np.int64)[0])
    return version if np.array_equal(got, _payload(prompt, block, got.size, version)) else None


def _new_version() -> int:
    """A store's version: random, so no two stores of any run share one."""
    return int.from_bytes(os.urandom(7), "little")


TICKET_BYTES = 96


class StopFlag:
    """The end of a round, set by the campaign and read by its workers: one
    shared byte with no lock.  (A `multiprocessing.Event` takes a shared
    lock in `is_set`: a worker killed by SIGKILL while its main thread held
    it, another of its threads having reached the kill point, left every
    other worker blocked in `is_set` for good.)"""

    def __init__(self, context):
        self._value = context.RawValue("b", 0)

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return self._value.value != 0


class TicketBoard:
    """The latest offer of each worker, in shared memory (a seqlock per
    slot: its writer makes the sequence odd, writes, makes it even), so a
    worker killed mid-write blocks nobody and a torn slot is skipped."""

    def __init__(self, context, slots: int):
        self.sequence = context.Array("q", slots, lock=False)
        self.data = context.Array("c", slots * TICKET_BYTES, lock=False)

    def post(self, slot: int, prompt: int, ticket: str) -> None:
        text = f"{prompt} {ticket}".encode().ljust(TICKET_BYTES)
        self.sequence[slot] += 1
        self.data[slot * TICKET_BYTES:(slot + 1) * TICKET_BYTES] = text
        self.sequence[slot] += 1

    def read(self, slot: int) -> tuple[int, str] | None:
        before = self.sequence[slot]
        text = self.data[slot * TICKET_BYTES:(slot + 1) * TICKET_BYTES]
        if before % 2 or before == 0 or self.sequence[slot] != before:
            return None
        prompt, ticket = text.decode().split()
        return int(prompt), ticket


#: the counts a connector adds to its node's pool counters (they must agree)
CONNECTOR_COUNTS = ("lookups", "hit_blocks", "miss_blocks", "stored_blocks", "written_bytes",
                    "read_bytes", "checksum_failures", "offers", "takes", "handoff_misses")


def _worker(path, node, seed, point_name, after, stop, progress, failures, tickets,
            lease, tallies=None, stops=None, history=None, ack_early=False) -> None:
    """One worker process: the mixed workload until ``stop``, or death at
    its armed point; a violation goes to ``failures``, and with ``tallies``
    its connector's counts at the end.  With ``stops`` (the stall
    campaign), it stops (SIGSTOP) at its armed point instead, having put
    the point's number there, and arms another once resumed.  Every cache
    operation is recorded in ``history`` (`tract.testing.history`); the
    seeded broken variant ``ack_early`` records each store as published
    before it runs."""
    import numpy as np

    from tract.connector import Connector
    from tract.errors import LeaseLost, PoolFull
    from tract.pool import Pool
    from tract.testing.history import Recorder, key_names

    rng = random.Random(seed)
    if stops is None:
        arm(point_name, after)
    else:
        def stopping(name):
            stops[node] = POINTS.index(name) + 1

        def resumed(name):
            if not stop.is_set():  # none after the round's end: it would wait for a resume
                arm(rng.choice(POINTS), rng.randint(1, 3), "stop")
        _failpoints.on_stop, _failpoints.on_resume = stopping, resumed
        arm(point_name, after, "stop")
    # a survivor the campaign finds stalled is asked for its stacks (SIGUSR1)
    stacks = open(_stack_file(path, node), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)  # and a crash's
    layout = _layout()
    size = layout.block_bytes
    prompts = FAMILIES * 4
    recorder = Recorder(history, node)

    def got(prompt, out, count, how) -> list:
        """The versions of the ``count`` blocks got; a block that holds no
        version's bytes is a violation."""
        versions = [_version_of(prompt, block, out[block]) for block in range(count)]
        if None in versions:
            failures.put(f"node {node}: {how} of prompt {prompt} served block "
                         f"{versions.index(None)} with other bytes (torn, stale or foreign)")
        return versions

    def sign(offset, mark):
        """Write this allocation's mark: another holder of it would overwrite it."""
        region.store_u64(offset, mark)
        region.flush(offset, 8)
        region.fence()

    def release(allocation):
        offset, mark = allocation
        region.invalidate(offset, 8)
        region.fence()
        if region.load_u64(offset) != mark:
            failures.put(f"node {node}: allocation at offset {offset} was overwritten while "
                         f"held (allocated twice)")
        pool.free(offset)

    try:
        with Pool.open(path, node, manager=True) as pool:
            region = pool.region
            recorder.watch(pool.index)
            connector = Connector(pool, layout, handoff_ttl=8 * lease, timeout=40 * lease)
            held, serial, epoch = [], 0, pool.epoch
            while not stop.is_set():
                pool.renew()  # a stall past its lease: a new incarnation first
                if pool.epoch != epoch:  # its raw allocations went with the last (R6)
                    held, epoch = [], pool.epoch
                prompt = rng.randrange(prompts)
                tokens = _tokens(prompt)
                keys = key_names(connector.keys(tokens))
                out = [np.zeros(size, np.uint8) for _ in range(PROMPT_BLOCKS)]
                operation = rng.random()
                try:
                    if operation < 0.25 or 0.5 <= operation < 0.62:
                        version = _new_version()
                        blocks = [_payload(prompt, b, size, version)
                                  for b in range(PROMPT_BLOCKS)]
                        kind = "store" if operation < 0.25 else "offer"
                        name = recorder.begin(kind, keys=keys, versions=[version] * len(keys))
                        if kind == "store":
                            if ack_early:  # the broken variant: acknowledged, then stored
                                recorder.end(name, kind, written=[True] * len(keys))
                            written = connector.store_each(tokens, blocks).written
                            if not ack_early:
                                recorder.end(name, kind, written=written.tolist())
                        else:
                            serial += 1
                            ticket = connector.offer(f"{node}-{serial}", tokens, blocks)
                            recorder.end(name, kind, ticket=ticket)
                            tickets.post(node, prompt, ticket)
                    elif operation < 0.5:
                        name = recorder.begin("load", keys=keys)
                        fenced = connector.stats["fenced"]
                        hit = connector.lookup(tokens) // BLOCK_TOKENS
                        count = connector.load(tokens[:hit * BLOCK_TOKENS], out[:hit])
                        missed = None if connector.stats["fenced"] > fenced \
                            or count == PROMPT_BLOCKS else count
                        recorder.end(name, "load", versions=got(prompt, out, count, "load"),
                                     missed=missed)
                    elif operation < 0.74:
                        posted = tickets.read(rng.randrange(1, len(progress)))
                        if posted is not None:
                            name = recorder.begin("take", keys=key_names(
                                connector.keys(_tokens(posted[0]))), ticket=posted[1])
                            taken = connector.take(posted[1], out)
                            recorder.end(name, "take",
                                         versions=got(posted[0], out, taken.blocks, "take"))
                    elif operation < 0.84:
                        connector.release()
                    elif operation < 0.94:
                        if len(held) > 3 or (held and rng.random() < 0.5):
                            release(held.pop(rng.randrange(len(held))))
                        else:
                            serial += 1
                            held.append((pool.alloc(rng.choice((3000, 70_000, 300_000))),
                                         node << 32 | serial))
                            sign(*held[-1])
                    elif operation < 0.97:
                        pool.index.evict(2)
                    else:
                        name = recorder.begin("remove", keys=keys)
                        removed = connector.remove(tokens)
                        recorder.end(name, "remove", removed=removed.tolist())
                except PoolFull:
                    try:
                        if held:
                            release(held.pop())
                    except LeaseLost:  # lapsed meanwhile: the rest go at the next renew
                        pass
                except LeaseLost:
                    pass  # fenced (R6): its grant or its own lease lapsed; nothing published
                progress[node] += 1
            pool.renew()
            for allocation in (held if pool.epoch == epoch else []):
                try:
                    release(allocation)
                except LeaseLost:  # lapsed meanwhile: the rest went with the incarnation
                    break
            connector.close()
            if tallies is not None:
                tallies.put((node, {name: connector.stats[name] for name in CONNECTOR_COUNTS}))
    except BaseException:
        failures.put(f"node {node}: {traceback.format_exc(limit=-8)}")  # the innermost
        raise SystemExit(1)
    finally:
        recorder.close()


def _stack_file(path: str, node: int) -> str:
    return f"{path}.stacks-{node}"


def _destroy(path: str, workers: int) -> None:
    """The pool and the workers' stack files."""
    from tract.pool import Pool

    Pool.destroy(path)
    for node in range(workers + 1):
        if os.path.exists(_stack_file(path, node)):
            os.unlink(_stack_file(path, node))


def _stalled(path: str, nodes, running, progress) -> str:
    """What each stalled survivor in ``nodes`` is doing (how long since it
    started, its count of operations, its threads' stacks, asked for by
    SIGUSR1: `_worker` registers faulthandler), and the pool's nodes,
    manager and lock holders."""
    from tract.pool import pool_info

    for node in nodes:
        try:
            os.kill(running[node][0].pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(0.5)
    found = []
    try:
        info = pool_info(path, watch=0.1)
        found.append(json.dumps({key: info[key] for key in ("nodes", "manager", "locks")}))
    except Exception as error:  # a diagnosis must not hide the violation
        found.append(f"pool info: {error!r}")
    for node in nodes:
        process, point, since = running[node]
        found.append(f"node {node} (pid {process.pid}, armed at {point}, started "
                     f"{time.monotonic() - since:.2f} s ago, {progress[node]} operations):")
        try:
            with open(_stack_file(path, node)) as handle:
                found.append(handle.read()[-3000:] or "(no stacks written)")
        except OSError as error:
            found.append(f"no stacks ({error})")
    return "\n".join(found)


def _campaign_pool(kind: str, workers: int, lease: float) -> str:
    """A fresh pool in /dev/shm for a campaign's ``workers`` (and node 0);
    its path."""
    from tract.pool import Pool

    path = os.path.join("/dev/shm", f"tract-{kind}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    Pool.create(path, 24 << 20, chunk_size=256 << 10, max_nodes=workers + 1,
                index_capacity=512, lock_mode="manager", lease_timeout=lease)
    return path


def _start(context, args, **options):
    process = context.Process(target=_worker, args=args, kwargs=options, daemon=True)
    process.start()
    return process


def _warm_up(path: str, recorder) -> None:
    """Compile every kernel the workers run, once, before they fork (its
    operations recorded by ``recorder``, node 0's)."""
    import numpy as np

    from tract.connector import Connector
    from tract.pool import Pool
    from tract.testing.history import key_names

    with Pool.open(path, 0, manager=True) as pool:
        recorder.watch(pool.index)
        connector = Connector(pool, _layout())
        size = connector.layout.block_bytes
        tokens = _tokens(0)
        version = _new_version()
        blocks = [_payload(0, b, size, version) for b in range(PROMPT_BLOCKS)]
        out = [np.zeros(size, np.uint8) for _ in range(PROMPT_BLOCKS)]
        keys = key_names(connector.keys(tokens))
        name = recorder.begin("store", keys=keys, versions=[version] * len(keys))
        recorder.end(name, "store", written=connector.store_each(tokens, blocks).written.tolist())
        connector.load(tokens[:connector.lookup(tokens)], out)
        connector.take(connector.offer("warm", tokens, blocks), out)
        connector.release()
        pool.free(pool.alloc(300_000))
        pool.index.evict(2)
        connector.close()
        pool.index.watchers.clear()


def _history(kind: str):
    """A fresh history directory for a campaign, and node 0's recorder in it."""
    from tract.testing.history import Recorder

    directory = tempfile.mkdtemp(prefix=f"tract-history-{kind}-")
    return directory, Recorder(directory, 0)


def _final(path: str, directory: str, recorder) -> None:
    """Record the pool's state with every worker stopped: which of the
    keys ever stored it holds, and the pins of each node that left (a
    node whose last process was killed keeps its pin words until it
    rejoins: no evictor reads a dead node's pins, R6)."""
    import numpy as np

    from tract.lease import LEFT
    from tract.pool import Pool
    from tract.testing.history import read

    keys = sorted({key for event in read(directory) if event["op"] == "store"
                   and event["phase"] == "begin" for key in event["keys"]})
    words = np.array([(int(key[:16], 16), int(key[16:], 16)) for key in keys],
                     dtype=np.uint64).reshape(-1, 2)
    with Pool.observe(path) as pool:
        present = pool.index.present(words).tolist() if keys else []
        pins = {node: pool.index.pins_held(node) for node in range(pool.header.max_nodes)
                if pool.nodes.read(node)[2] == LEFT}
    name = recorder.begin("final", present=[key for key, here in zip(keys, present) if here],
                          pins=pins)
    recorder.end(name, "final")


def _checked(directory: str, recorder) -> dict:
    """The history's check (`tract.testing.history.check`): ``{"events",
    "violations"}``, each violation with the events that show it.  The
    directory is removed when it holds none, kept (and named) otherwise."""
    from tract.testing.history import check, read

    recorder.close()
    events = read(directory)
    found = [violation.show(events[0]["t"]) for violation in check(events)]
    if found:
        found[0] += f"\n(the whole history: {directory})"
    else:
        shutil.rmtree(directory)
    return {"events": len(events), "violations": found}


def campaign(points: int, seed: int = 0, workers: int = 3, lease: float = 0.4,
             kills_per_round: int = 25, progress_bar: bool = False,
             ack_early: bool = False) -> dict:
    """Kill ``points`` workers at random points (seeded); returns
    ``{"points", "violations", "recovered_s_max", ...}``, the history's
    violations among them.  ``ack_early``: the workers are the seeded
    broken variant that acknowledges a store before it is published."""
    import multiprocessing

    from tract.fsck import fsck

    if points < 1 or workers < 2:
        raise ValueError(f"a campaign needs at least 1 kill point and 2 workers, got "
                         f"points={points}, workers={workers}")
    rng = random.Random(seed)
    context = multiprocessing.get_context("fork")
    path = _campaign_pool("faults", workers, lease)
    history, recorder = _history("faults")
    violations, recoveries, by_point = [], [], dict.fromkeys(POINTS, 0)
    rounds = operations = 0
    bound = recovery_bound(lease)
    try:
        _warm_up(path, recorder)
        time.sleep(1.5 * lease)  # node 0's lease lapses: workers' managers take over
        progress = context.Array("q", workers + 1, lock=False)
        failures, tickets = context.Queue(), TicketBoard(context, workers + 1)
        killed, stalled = 0, False
        while killed < points and not stalled:
            rounds += 1
            stop = StopFlag(context)
            running: dict[int, tuple] = {}

            def launch(node):
                name = rng.choice(POINTS)
                process = _start(context, (path, node, rng.getrandbits(32), name,
                                           rng.randint(1, 3), stop, progress, failures,
                                           tickets, lease), history=history,
                                 ack_early=ack_early)
                running[node] = (process, name, time.monotonic())

            for node in range(1, workers + 1):
                launch(node)
            in_round, started = 0, time.monotonic()
            while in_round < kills_per_round and killed < points:
                time.sleep(0.005)
                for node, (process, name, since) in list(running.items()):
                    if killed >= points:
                        break
                    if process.exitcode is None:
                        if time.monotonic() - since > 20 * lease:
                            # its point was not reached: killed at a moment of no choosing,
                            # uncounted, and restarted with another
                            process.kill()
                            process.join()
                            launch(node)
                        continue
                    if process.exitcode != -signal.SIGKILL:
                        violations.append(f"worker on node {node} exited with "
                                          f"{process.exitcode}")
                        launch(node)
                        continue
                    killed += 1
                    in_round += 1
                    if name is not None:
                        by_point[name] += 1
                    died = time.monotonic()
                    survivors = {other: progress[other] for other, (p, _, _) in
                                 running.items() if other != node and p.exitcode is None}
                    launch(node)
                    waited, stalled = _await_progress(progress, survivors, running, died,
                                                      bound)
                    if stalled:
                        seen = _stalled(path, stalled, running, progress)
                        violations.append(f"kill {killed} ({name} on node {node}): survivors "
                                          f"{stalled} made no progress in {bound:.2f} s; "
                                          f"what they do:\n{seen}")
                    else:
                        recoveries.append(waited)
                    if progress_bar:
                        print(f"\rkill points: {killed}/{points}", end="", file=sys.stderr)
                if time.monotonic() - started > 120 + 60 * lease:
                    violations.append(f"round {rounds} made {in_round} kills in "
                                      f"{time.monotonic() - started:.0f} s: stalled")
                    stalled = True
                    break
            stop.set()
            for process, _, _ in running.values():
                process.join(10 * bound)
                if process.exitcode is None:
                    violations.append("a worker did not stop within "
                                      f"{10 * bound:.0f} s of being asked")
                    process.kill()
                    process.join()
            while not failures.empty():
                violations.append(failures.get())
            time.sleep(1.5 * lease)  # every worker's lease lapses
            fsck(path, repair=True, node=0, watch=False)
            after = fsck(path, watch=False)
            if not after["ok"]:
                violations.append(f"round {rounds}: fsck after repair: "
                                  f"{after['problems'][:2]}")
            _final(path, history, recorder)
            operations = sum(progress)
            time.sleep(1.5 * lease)  # node 0's lease lapses: the next workers' managers take over
        if progress_bar:
            print(file=sys.stderr)
    finally:
        _destroy(path, workers)
    checked = _checked(history, recorder)
    violations += checked["violations"]
    return {"points": killed, "violations": violations, "history_events": checked["events"],
            "recovered_s_max": max(recoveries, default=0.0),
            "recovered_s_median": sorted(recoveries)[len(recoveries) // 2] if recoveries else 0.0,
            "recovery_bound_s": bound, "lease_timeout_s": lease, "rounds": rounds,
            "operations": operations, "kills_by_point": by_point, "seed": seed}


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] in ("T", "t")
    except OSError:
        return False


def stall_campaign(points: int, seed: int = 0, workers: int = 3, lease: float = 0.4,
                   stalls_per_round: int = 50, progress_bar: bool = False) -> dict:
    """Stall workers ``points`` times: each stops itself (SIGSTOP) at a
    random armed point and is resumed (SIGCONT) after a random time up to
    4 leases, then arms another point.  The checks are the kill
    campaign's: no foreign, torn or stale block served (workers compare
    every block they get), no allocation held twice (a raw allocation's
    mark is checked when it is freed; allocations of an incarnation that
    lapsed are given up, R6), fsck clean after repair at the end of each
    round, and progress: after each stall begins, every other worker that
    is not stopped itself completes an operation within `recovery_bound`,
    and so does the stalled worker once resumed.  Returns ``{"points",
    "violations", "recovered_s_max", "stalled_s_max", ...}``."""
    import multiprocessing

    from tract.fsck import fsck

    if points < 1 or workers < 2:
        raise ValueError(f"a campaign needs at least 1 stall point and 2 workers, got "
                         f"points={points}, workers={workers}")
    rng = random.Random(seed)
    context = multiprocessing.get_context("fork")
    path = _campaign_pool("stalls", workers, lease)
    history, recorder = _history("stalls")
    violations, recoveries, by_point = [], [], dict.fromkeys(POINTS, 0)
    rounds = operations = stalled_points = 0
    longest = 0.0
    bound = recovery_bound(lease)
    try:
        _warm_up(path, recorder)
        time.sleep(1.5 * lease)
        progress = context.Array("q", workers + 1, lock=False)
        stops = context.Array("q", workers + 1, lock=False)
        failures, tickets = context.Queue(), TicketBoard(context, workers + 1)
        stuck = False
        while stalled_points < points and not stuck:
            rounds += 1
            stop = StopFlag(context)
            running = {}
            for node in range(1, workers + 1):
                process = _start(context, (path, node, rng.getrandbits(32), rng.choice(POINTS),
                                           rng.randint(1, 3), stop, progress, failures,
                                           tickets, lease, None, stops), history=history)
                running[node] = (process, "stall", time.monotonic())
            paused: dict[int, tuple[float, float, str]] = {}  # node -> (since, until, point)
            # (began, node whose progress is awaited -> its count then, the stall's node)
            awaited: list[tuple[float, dict[int, int], int]] = []
            in_round, started = 0, time.monotonic()
            while (in_round < stalls_per_round and stalled_points < points) or paused:
                time.sleep(0.003)
                now = time.monotonic()
                for node, (process, _, _) in running.items():
                    if process.exitcode is not None:
                        violations.append(f"worker on node {node} exited with "
                                          f"{process.exitcode}")
                        stuck = True
                    elif node not in paused and _stopped(process.pid) and stops[node]:
                        point_name = POINTS[stops[node] - 1]
                        length = rng.uniform(0, 4 * lease)
                        paused[node] = (now, now + length, point_name)
                        awaited.append((now, {other: progress[other] for other in running
                                              if other != node}, node))
                    elif node in paused and now >= paused[node][1]:
                        since, _, point_name = paused.pop(node)
                        stops[node] = 0
                        os.kill(process.pid, signal.SIGCONT)
                        stalled_points += 1
                        in_round += 1
                        by_point[point_name] += 1
                        longest = max(longest, now - since)
                        awaited.append((now, {node: progress[node]}, node))
                        if progress_bar:
                            print(f"\rstall points: {stalled_points}/{points}", end="",
                                  file=sys.stderr)
                for entry in list(awaited):
                    began, waiting, stalled = entry
                    for other in list(waiting):
                        if progress[other] > waiting[other] or other in paused:
                            del waiting[other]  # a stopped worker is judged on its own resume
                    if not waiting:
                        awaited.remove(entry)
                        recoveries.append(now - began)
                    elif now - began > bound:
                        awaited.remove(entry)
                        late = sorted(waiting)
                        seen = _stalled(path, late, running, progress)
                        violations.append(f"stall on node {stalled}: workers {late} made no "
                                          f"progress in {bound:.2f} s; what they do:\n{seen}")
                        stuck = True
                if stuck or now - started > 120 + 60 * lease:
                    if not stuck:
                        violations.append(f"round {rounds} made {in_round} stalls in "
                                          f"{now - started:.0f} s: stalled")
                    stuck = True
                    break
            stop.set()
            for process, _, _ in running.values():
                try:
                    os.kill(process.pid, signal.SIGCONT)
                except OSError:
                    pass
            for node, (process, _, _) in running.items():
                asked = time.monotonic()
                while process.exitcode is None and time.monotonic() - asked < 10 * bound:
                    if _stopped(process.pid):  # at a point armed before the round's end
                        os.kill(process.pid, signal.SIGCONT)
                    process.join(0.05)
                if process.exitcode is None:
                    violations.append(f"worker on node {node} did not stop within "
                                      f"{10 * bound:.0f} s of being asked")
                    process.kill()
                    process.join()
                elif process.exitcode != 0:
                    violations.append(f"worker on node {node} exited with {process.exitcode}")
            while not failures.empty():
                violations.append(failures.get())
            time.sleep(1.5 * lease)
            fsck(path, repair=True, node=0, watch=False)
            after = fsck(path, watch=False)
            if not after["ok"]:
                violations.append(f"round {rounds}: fsck after repair: "
                                  f"{after['problems'][:2]}")
            _final(path, history, recorder)
            operations = sum(progress)
            time.sleep(1.5 * lease)
        if progress_bar:
            print(file=sys.stderr)
    finally:
        _destroy(path, workers)
    checked = _checked(history, recorder)
    violations += checked["violations"]
    return {"points": stalled_points, "violations": violations,
            "history_events": checked["events"],
            "recovered_s_max": max(recoveries, default=0.0),
            "recovered_s_median": sorted(recoveries)[len(recoveries) // 2] if recoveries else 0.0,
            "stalled_s_max": longest, "recovery_bound_s": bound, "lease_timeout_s": lease,
            "rounds": rounds, "operations": operations, "stalls_by_point": by_point,
            "seed": seed}


def soak(seconds: float, seed: int = 0, workers: int = 3, lease: float = 0.4) -> dict:
    """The campaign's workload without kills for ``seconds``: payloads
    checked on every load and take, every raw allocation checked for a
    second holder when freed, and each node's pool counters checked
    against what its worker counted; then fsck."""
    import multiprocessing

    from tract.fsck import fsck
    from tract.pool import Pool

    rng = random.Random(seed)
    context = multiprocessing.get_context("fork")
    path = _campaign_pool("soak", workers, lease)
    history, recorder = _history("soak")
    violations = []
    try:
        _warm_up(path, recorder)
        time.sleep(1.5 * lease)
        progress = context.Array("q", workers + 1, lock=False)
        failures, tallies = context.Queue(), context.Queue()
        tickets, stop = TicketBoard(context, workers + 1), StopFlag(context)
        processes = [_start(context, (path, node, rng.getrandbits(32), None, 1, stop, progress,
                                      failures, tickets, lease, tallies), history=history)
                     for node in range(1, workers + 1)]
        time.sleep(seconds)
        stop.set()
        counted = {}
        for _ in processes:
            try:
                node, counts = tallies.get(timeout=60)
                counted[node] = counts
            except Exception:
                violations.append("a worker sent no counts at the end")
        for process in processes:
            process.join(60)
            if process.exitcode != 0:
                violations.append(f"a worker exited with {process.exitcode}")
        while not failures.empty():
            violations.append(failures.get())
        with Pool.observe(path) as pool:
            in_pool = pool.counters()
        for node, counts in counted.items():
            for name, value in counts.items():
                if in_pool.get(node, {}).get(name, 0) != value:
                    violations.append(f"node {node}'s pool counter {name} is "
                                      f"{in_pool.get(node, {}).get(name, 0)}; its worker "
                                      f"counted {value}")
        # handoff records still inside their TTL when a worker closed stay allocated
        # until a lease after their deadline: fsck --repair reclaims them
        time.sleep(8 * lease + 1.5 * lease)
        fsck(path, repair=True, node=0, watch=False)
        report = fsck(path, watch=False)
        if not report["ok"]:
            violations.append(f"fsck after the soak: {report['problems'][:2]}")
        _final(path, history, recorder)
        operations = sum(progress)
    finally:
        _destroy(path, workers)
    checked = _checked(history, recorder)
    return {"seconds": seconds, "workers": workers, "operations": operations,
            "violations": violations + checked["violations"],
            "history_events": checked["events"], "seed": seed}


def _await_progress(progress, survivors: dict[int, int], running, died: float,
                    bound: float) -> tuple[float, list[int]]:
    """Seconds until every survivor in ``survivors`` (node -> its count at
    the kill) completed an operation, and the survivors that had not past
    ``bound``.  A survivor that dies meanwhile is not waited for (its own
    kill is judged alone)."""
    waiting = dict(survivors)
    while waiting:
        now = time.monotonic()
        for node in list(waiting):
            process = running[node][0]
            if progress[node] > waiting[node] or process.exitcode is not None:
                del waiting[node]
        if not waiting:
            break
        if now - died > bound:
            return now - died, sorted(waiting)
        time.sleep(0.002)
    return time.monotonic() - died, []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tract.testing.faults",
                                     description="kill -9 and stall fault-injection campaigns")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--points", type=int, help="kill (or, with --stall, stall) points to "
                                                 "survive")
    mode.add_argument("--minutes", type=float, help="soak instead: no kills, for this long")
    parser.add_argument("--stall", action="store_true",
                        help="stall workers (SIGSTOP up to 4 leases, then SIGCONT) instead of "
                             "killing them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=3, help="worker processes (nodes)")
    parser.add_argument("--lease", type=float, default=0.4, help="lease timeout, seconds")
    parser.add_argument("--ack-before-publish", action="store_true",
                        help="the seeded broken variant: workers acknowledge each store before "
                             "it is published (the history check must catch it)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.minutes is not None:
        report = soak(args.minutes * 60, args.seed, args.workers, args.lease)
        summary = (f"soak: {report['operations']} operations in {report['seconds']:.0f} s on "
                   f"{report['workers']} nodes")
    elif args.stall:
        report = stall_campaign(args.points, args.seed, args.workers, args.lease,
                                progress_bar=not args.json)
        summary = (f"stall points survived: {report['points']} in {report['rounds']} rounds "
                   f"({report['operations']} operations; longest stall "
                   f"{report['stalled_s_max']:.3f} s); worst recovery "
                   f"{report['recovered_s_max']:.3f} s (bound {report['recovery_bound_s']:.2f} s, "
                   f"lease {report['lease_timeout_s']} s)")
    else:
        report = campaign(args.points, args.seed, args.workers, args.lease,
                          progress_bar=not args.json, ack_early=args.ack_before_publish)
        summary = (f"kill points survived: {report['points']} in {report['rounds']} rounds "
                   f"({report['operations']} operations); worst recovery "
                   f"{report['recovered_s_max']:.3f} s (bound {report['recovery_bound_s']:.2f} s, "
                   f"lease {report['lease_timeout_s']} s)")
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{summary}; violations: {len(report['violations'])}")
        for violation in report["violations"][:20]:
            print(f"  violation: {violation}")
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    # run the package's module, not this copy: the kill points live in its state
    from tract.testing import faults as _faults

    raise SystemExit(_faults.main())
