"""`tract bench churn`: tail latency of the connector's operations under
churn, against the same operation run alone, in the same run.

One pool; each role is a process on a node of its own, paced (a pause of
`PACE` seconds after each operation, as an engine's worker does other work
between its cache calls), so that the processes share the cores rather than
queue for them:

- ``writer``: stores fresh prompts (`PROMPT_BLOCKS` blocks each); the pool
  fills, so its stores evict to make room;
- ``reader``: loads prompts stored before the phase (a hit each);
- ``evictor``: evicts `EVICT` of the stalest entries at a time;
- ``producer`` and ``consumer``: the P/D handoff pair; the producer offers
  prompts, the consumer takes each (only the take is timed).

A round runs each timed operation alone (the writer alone for ``store``,
the reader alone for ``load``, the handoff pair alone for ``take``), then
every role at once (*churn*), for `SECONDS` each; rounds repeat, so the
alone and churn phases alternate (A B A B ...).  Reported per operation:
the p50, p99 and p99.9 of its latency alone and under churn, each against
the p50 alone (the issue's targets: p99 under churn at most 3x, p99.9 at
most 10x), with each node's lock waits under churn (the share of the tail
the pool's own locks explain).

The control, ``copy``: the reader also times a copy of the same bytes from
its own memory into the same buffers, right after each load, touching no
pool.  Its tail under churn is what the machine alone costs a call (five
busy processes on the cores, their page faults and caches): the share of
the tail that is not tract's.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import uuid

import numpy as np

from tract.bench import Result

PROMPT_BLOCKS = 4
BLOCK_TOKENS = 16
PACE = 1e-3  # seconds each role pauses after an operation
SECONDS = 2.0  # of each phase
EVICT = 4
ROLES = {"writer": 1, "reader": 2, "evictor": 3, "producer": 4, "consumer": 5}
TIMED = {"store": "writer", "load": "reader", "take": "consumer", "copy": "reader"}
ALONE = {"store": ("writer",), "load": ("reader",), "take": ("producer", "consumer")}
READ_PROMPTS = 64  # prompts the reader loads, stored before each phase
#: a timed role goes on past its phase's end until it timed this many operations
#: (a loaded machine may give it few in `SECONDS`), for at most `OVERTIME` seconds
MIN_TIMED, OVERTIME = 5, 60.0


def _layout():
    from tract.transfer import KVLayout

    # 16 tokens x 2 layers x 2 (K, V) x 8 heads x 64 x 2 bytes = 64 KiB a block
    return KVLayout(model="tract-bench-churn", dtype="float16", num_layers=2, num_kv_heads=8,
                    head_size=64, block_size=BLOCK_TOKENS)


def _tokens(prompt: int) -> np.ndarray:
    return np.random.default_rng(prompt).integers(0, 50_000, PROMPT_BLOCKS * BLOCK_TOKENS)


def _role(path, role, seconds, ready, start, enough, results, tickets, seed) -> None:
    """One role's process: warm up, say so on ``ready``, wait for
    ``start``, then its paced loop for ``seconds`` (a timed role's until it
    timed `MIN_TIMED` operations, the producer's until the consumer did:
    ``enough``, each for at most `OVERTIME` more); puts (role, latencies in
    ns, lock waits, lock wait ns, the reader's control copies' latencies in
    ns)."""
    from tract.connector import NO_OFFER, Connector
    from tract.errors import LeaseLost
    from tract.pool import Pool

    layout = _layout()
    blocks = [np.full(layout.block_bytes, seed & 0xFF, np.uint8) for _ in range(PROMPT_BLOCKS)]
    out = [np.empty(layout.block_bytes, np.uint8) for _ in range(PROMPT_BLOCKS)]
    copies = []  # the control: the same bytes copied from this process's own memory
    with Pool.open(path, ROLES[role], manager=True) as pool:
        kv = Connector(pool, layout, timeout=30.0)
        serial = seed << 20
        reads = [_tokens(prompt) for prompt in range(READ_PROMPTS)]

        def once() -> int | None:
            """One operation; its latency in ns when it is a timed one."""
            nonlocal serial
            serial += 1
            if role == "writer":
                tokens = _tokens(serial)
                begin = time.perf_counter_ns()
                kv.store(tokens, blocks)
                return time.perf_counter_ns() - begin
            if role == "reader":
                tokens = reads[serial % READ_PROMPTS]
                begin = time.perf_counter_ns()
                kv.load(tokens, out)
                took = time.perf_counter_ns() - begin
                begin = time.perf_counter_ns()
                for block, copy in zip(blocks, out):
                    np.copyto(copy, block)
                copies.append(time.perf_counter_ns() - begin)
                return took
            if role == "evictor":
                try:
                    pool.index.evict(EVICT)
                except LeaseLost:  # its grant went to a manager's take-over: next time
                    pass
                return None
            if role == "producer":
                ticket = kv.offer(f"churn-{serial}", _tokens(serial), blocks)
                if ticket != NO_OFFER:
                    try:
                        tickets.put(ticket, timeout=0.1)
                    except queue.Full:  # the consumer is done: the offer expires
                        kv.cancel(f"churn-{serial}")
                kv.release()
                return None
            try:
                ticket = tickets.get(timeout=0.1)  # the consumer
            except queue.Empty:
                return None
            begin = time.perf_counter_ns()
            kv.take(ticket, out)
            return time.perf_counter_ns() - begin

        for _ in range(20):  # warm up: kernels, pages, the lock's first grants
            if role == "consumer" and tickets.empty():
                break
            once()
        ready.put(role)
        start.wait()
        copies.clear()
        before = pool.counters().get(pool.node, {})
        latencies, deadline = [], time.monotonic() + seconds
        timed = role in TIMED.values()

        def going() -> bool:
            now = time.monotonic()
            if now < deadline:
                return True
            if now > deadline + OVERTIME:
                return False
            if role == "producer":
                return not enough.is_set()
            return timed and len(latencies) < MIN_TIMED

        while going():
            took = once()
            if took is not None:
                latencies.append(took)
                if role == "consumer" and len(latencies) >= MIN_TIMED:
                    enough.set()
            time.sleep(PACE)
        after = pool.counters().get(pool.node, {})
        kv.close()
    waits = [after.get(name, 0) - before.get(name, 0) for name in ("lock_waits", "lock_wait_ns")]
    results.put((role, latencies, *waits, copies))


def _phase(path: str, roles, seconds: float, context, seed: int) -> dict:
    """Run ``roles`` at once for ``seconds``; {role: (latencies, lock waits,
    wait ns)}, and the reader's control copies as role ``copy``."""
    ready, start, enough, results = context.Queue(), context.Event(), context.Event(), \
        context.Queue()
    tickets = context.Queue(maxsize=8)
    processes = [context.Process(target=_role, args=(path, role, seconds, ready, start, enough,
                                                     results, tickets, seed + index),
                                 daemon=True)
                 for index, role in enumerate(roles)]
    for process in processes:
        process.start()
    try:
        for _ in processes:  # every role opened and warmed up, however loaded the machine
            ready.get(timeout=300)
        start.set()
        found = {}
        for _ in processes:
            role, latencies, waits, wait_ns, copies = results.get(
                timeout=120 + 4 * seconds + OVERTIME)
            found[role] = (np.asarray(latencies, np.int64), waits, wait_ns)
            if copies:
                found["copy"] = (np.asarray(copies, np.int64), 0, 0)
        return found
    finally:
        for process in processes:
            process.join(30)
            if process.exitcode is None:
                process.kill()


def _store_reads(path: str) -> None:
    """The prompts the reader loads, stored (again, if evicted) before a phase."""
    from tract.connector import Connector
    from tract.pool import Pool

    layout = _layout()
    blocks = [np.full(layout.block_bytes, 7, np.uint8) for _ in range(PROMPT_BLOCKS)]
    with Pool.open(path, 0, manager=True) as pool:
        kv = Connector(pool, layout)
        for prompt in range(READ_PROMPTS):
            kv.store(_tokens(prompt), blocks)
        kv.close()


def measure(rounds: int = 3, seconds: float = SECONDS) -> dict:
    """{operation: {"alone": ns array, "churn": ns array}, "lock_waits":
    {role: (waits, ns)}} over ``rounds`` of alone and churn phases."""
    from tract.pool import Pool

    path = os.path.join("/dev/shm", f"tract-bench-churn-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    # room for a phase's reads and a fraction of the writer's stores: stores evict
    Pool.create(path, 128 << 20, chunk_size=1 << 20, max_nodes=len(ROLES) + 1,
                index_capacity=4096, lease_timeout=2.0)
    context = multiprocessing.get_context("spawn")
    samples = {op: {"alone": [], "churn": []} for op in TIMED}
    waits: dict[str, list[int]] = {role: [0, 0] for role in ROLES}
    try:
        for round_ in range(rounds):
            for op, roles in ALONE.items():
                _store_reads(path)
                found = _phase(path, roles, seconds, context, 1000 * round_)
                samples[op]["alone"].append(found[TIMED[op]][0])
                if op == "load":
                    samples["copy"]["alone"].append(found["copy"][0])
            _store_reads(path)
            found = _phase(path, list(ROLES), seconds, context, 1000 * round_ + 500)
            for op in TIMED:
                samples[op]["churn"].append(found[op if op == "copy" else TIMED[op]][0])
            for role, (_, count, ns) in found.items():
                if role not in ROLES:
                    continue
                waits[role][0] += count
                waits[role][1] += ns
    finally:
        Pool.destroy(path)
    out = {op: {phase: np.concatenate(runs) for phase, runs in phases.items()}
           for op, phases in samples.items()}
    out["lock_waits"] = {role: tuple(value) for role, value in waits.items()}
    return out


def _percentiles(ns: np.ndarray) -> tuple[float, float, float]:
    if not ns.size:
        raise RuntimeError("a phase timed no operation")
    return tuple(float(np.percentile(ns, q)) / 1e3 for q in (50, 99, 99.9))


def run(quick: bool = False) -> list[Result]:
    measured = measure(rounds=1 if quick else 3, seconds=1.0 if quick else SECONDS)
    results = []
    for op in TIMED:
        alone = _percentiles(measured[op]["alone"])
        churn = _percentiles(measured[op]["churn"])
        for phase, figures in (("alone", alone), ("churn", churn)):
            for label, value in zip(("p50", "p99", "p99.9"), figures):
                results.append(Result(f"churn[{op}] {phase} {label}", value, "us per operation",
                                      False, f"{op} alone p50", alone[0]))
        results.append(Result(f"churn[{op}] samples", float(measured[op]["churn"].size),
                              "operations timed under churn", True))
    for role, (count, ns) in measured["lock_waits"].items():
        results.append(Result(f"churn lock waits[{role}]", ns / 1e3 / max(count, 1),
                              f"us per wait ({count} waits)", False))
    return results
