"""The peers `tract bench transfer` compares against: the same handoff
(producer process -> consumer process, from the producer's first call to
the consumer holding the bytes) through Redis and Mooncake Store, each
server started here on 127.0.0.1 and stopped after.  A peer that cannot be
started raises `Unavailable` with the reason, which the report prints."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

__all__ = ["PEERS", "Unavailable"]


class Unavailable(Exception):
    """A peer that cannot run here; the message says why."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_port(port: int, process: subprocess.Popen, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise Unavailable(f"{what} exited at start (code {process.returncode})")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise Unavailable(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


@contextlib.contextmanager
def start_server(command: list[str], ports, what: str):
    # on PATH, or beside this interpreter (a venv's console scripts)
    program = shutil.which(command[0]) or shutil.which(
        command[0], path=os.path.dirname(sys.executable))
    if program is None:
        raise Unavailable(f"{what}: {command[0]} is not installed")
    process = subprocess.Popen([program, *command[1:]], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        for port in ports:
            _wait_port(port, process, what)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _handoff(produce, consume, repeats: int, nbytes: int, clear=None) -> float:
    """GB/s of a handoff: ``produce(round)`` in this process, then
    ``consume(round)`` in a child told by a pipe; timed from the producer's
    start to the consumer's end (one monotonic clock).  ``clear(round)``,
    untimed, drops the round's keys (as tract's bench evicts its blocks)."""
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()

    def child():
        while (message := theirs.recv()) is not None:
            round_, started = message
            try:
                consume(round_)
                theirs.send(time.monotonic() - started)
            except Exception as error:  # noqa: BLE001 - reported to the parent
                theirs.send(error)

    process = context.Process(target=child)
    process.start()
    times = []
    try:
        for round_ in range(repeats + 1):
            started = time.monotonic()
            produce(round_)
            ours.send((round_, started))
            elapsed = ours.recv()
            if isinstance(elapsed, Exception):
                raise Unavailable(f"consumer failed: {elapsed}")
            if round_:
                times.append(elapsed)
            if clear is not None:
                clear(round_)
    finally:
        ours.send(None)
        process.join(30)
    return nbytes / statistics.median(times) / 1e9


# ------------------------------------------------------------------ Redis

def redis_handoff(size: int, count: int, repeats: int) -> float:
    try:
        import redis
    except ImportError as error:
        raise Unavailable(f"redis: the redis client is not installed ({error})") from None
    port = free_port()
    blocks = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
              for i in range(count)]
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--protected-mode", "yes"]
    with start_server(command, [port], "redis-server"):
        client = redis.Redis(host="127.0.0.1", port=port)

        def produce(round_):
            pipe = client.pipeline(transaction=False)
            for i, block in enumerate(blocks):
                pipe.set(f"r{round_}:{i}", block)
            pipe.execute()

        def consume(round_):
            got = redis.Redis(host="127.0.0.1", port=port).mget(
                [f"r{round_}:{i}" for i in range(count)])
            assert all(len(value) == size for value in got)

        return _handoff(produce, consume, repeats, size * count,
                        lambda round_: client.delete(*[f"r{round_}:{i}" for i in range(count)]))


# --------------------------------------------------------------- Mooncake

SEGMENT_MAX = (2 << 30) - (1 << 20)  # with a larger segment every put fails (-200, no space)

def mooncake_store(master: int, metadata: int, segment: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", f"http://127.0.0.1:{metadata}/metadata", segment,
                       segment, "tcp", "", f"127.0.0.1:{master}")
    if code:
        raise Unavailable(f"mooncake: setup returned {code}")
    return store


def _keys(prefix: str, round_: int, count: int) -> list[str]:
    return [f"{prefix}{round_}:{i}" for i in range(count)]


def _put(store, keys: list[str], base: int, size: int) -> None:
    """`batch_put_from` of consecutive ``size``-byte buffers from ``base``."""
    codes = store.batch_put_from(keys, [base + i * size for i in range(len(keys))],
                                 [size] * len(keys))
    failed = [code for code in codes if code != 0]
    if failed:
        raise Unavailable(f"mooncake: batch_put_from failed for {len(failed)} of {len(codes)} "
                          f"keys (codes {sorted(set(failed))[:3]})")


def _remove(store, keys: list[str]) -> None:
    failed = [code for code in store.batch_remove(keys, True) if code != 0]
    if failed:
        raise Unavailable(f"mooncake: batch_remove failed for {len(failed)} of {len(keys)} "
                          f"keys (codes {sorted(set(failed))[:3]})")


def _get(store, keys: list[str], base: int, size: int) -> None:
    """`batch_get_into` consecutive ``size``-byte buffers from ``base``."""
    got = store.batch_get_into(keys, [base + i * size for i in range(len(keys))],
                               [size] * len(keys))
    short = [n for n in got if n != size]
    if short:
        raise Unavailable(f"mooncake: batch_get_into got {len(short)} of {len(got)} keys short "
                          f"(results {sorted(set(short))[:3]})")


def mooncake_tcp_handoff(size: int, count: int, repeats: int) -> float:
    """Mooncake Store over TCP, batched zero-copy calls from registered
    buffers (`batch_put_from` / `batch_get_into`)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        raise Unavailable(f"mooncake: mooncake-transfer-engine-non-cuda is not installed "
                          f"({error})") from None
    master, metadata = free_port(), free_port()
    command = ["mooncake_master", "--rpc_address=127.0.0.1", f"--rpc_port={master}",
               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={metadata}"]
    segment = min(max(512 << 20, 4 * size * count), SEGMENT_MAX)
    with start_server(command, [master, metadata], "mooncake_master"):
        source = np.random.default_rng(5).integers(0, 256, size * count, dtype=np.uint8)
        address = source.ctypes.data
        state, mine = {}, {}  # each process's client, made after the fork

        def produce(round_):
            if "store" not in mine:
                mine["store"] = mooncake_store(master, metadata, segment)
                if mine["store"].register_buffer(address, source.nbytes):
                    raise Unavailable("mooncake: register_buffer failed")
            _put(mine["store"], _keys("r", round_, count), address, size)

        def consume(round_):
            if "store" not in state:
                state["store"] = mooncake_store(master, metadata, segment)
                state["out"] = np.empty(size * count, np.uint8)
                state["store"].register_buffer(state["out"].ctypes.data, size * count)
            _get(state["store"], _keys("r", round_, count), state["out"].ctypes.data, size)

        try:
            return _handoff(produce, consume, repeats, size * count,
                            lambda round_: _remove(mine["store"], _keys("r", round_, count)))
        finally:
            with contextlib.suppress(Exception):
                mine["store"].close()


def mooncake_shm_handoff(size: int, count: int, repeats: int) -> float:
    """Mooncake Store's shared-memory path: both processes attach to one
    `mooncake_client` (the segment holder) with `setup_dummy`, their
    buffers come from its memory pool, and they move data with the batched
    zero-copy calls."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        raise Unavailable(f"mooncake: mooncake-transfer-engine-non-cuda is not installed "
                          f"({error})") from None
    master, metadata, client = free_port(), free_port(), free_port()
    segment = min(max(1 << 30, 4 * size * count), SEGMENT_MAX)
    master_command = ["mooncake_master", "--rpc_address=127.0.0.1", f"--rpc_port={master}",
                      "--enable_http_metadata_server=true",
                      "--http_metadata_server_host=127.0.0.1",
                      f"--http_metadata_server_port={metadata}"]
    client_command = ["mooncake_client", "--host=127.0.0.1", f"--port={client}",
                      f"--master_server_address=127.0.0.1:{master}",
                      f"--metadata_server=http://127.0.0.1:{metadata}/metadata",
                      f"--global_segment_size={segment}", "--protocol=tcp"]
    with start_server(master_command, [master, metadata], "mooncake_master"), \
            start_server(client_command, [client], "mooncake_client"):
        def attach():
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            code = store.setup_dummy(2 * size * count, 2 * size * count, f"127.0.0.1:{client}")
            if code:
                raise Unavailable(f"mooncake: setup_dummy returned {code}")
            buffer = store.alloc_from_mem_pool(size * count)
            if not buffer:
                raise Unavailable("mooncake: alloc_from_mem_pool gave no memory")
            if store.register_buffer(buffer, size * count):
                raise Unavailable("mooncake: register_buffer failed for a pool buffer")
            return store, buffer

        data = np.random.default_rng(6).integers(0, 256, size * count, dtype=np.uint8)
        state, mine = {}, {}  # each process's client, made after the fork

        def produce(round_):
            if "store" not in mine:
                mine["store"], mine["buffer"] = attach()
                ctypes.memmove(mine["buffer"], data.ctypes.data, data.nbytes)
            _put(mine["store"], _keys("s", round_, count), mine["buffer"], size)

        def consume(round_):
            if "store" not in state:
                state["store"], state["out"] = attach()
            _get(state["store"], _keys("s", round_, count), state["out"], size)

        try:
            return _handoff(produce, consume, repeats, size * count,
                            lambda round_: _remove(mine["store"], _keys("s", round_, count)))
        finally:
            with contextlib.suppress(Exception):
                mine["store"].close()


_PEERS = {"redis": redis_handoff, "mooncake_tcp": mooncake_tcp_handoff,
          "mooncake_shm": mooncake_shm_handoff}


def _isolated(name: str, size: int, count: int, repeats: int, results) -> None:
    quiet = os.open(os.devnull, os.O_WRONLY)  # the peers' own logging (glog) to stderr
    os.dup2(quiet, 2)
    try:
        results.put(("ok", _PEERS[name](size, count, repeats)))
    except Unavailable as why:
        results.put(("unavailable", why.args[0]))
    except Exception as error:  # noqa: BLE001 - reported as a reason
        results.put(("unavailable", f"{name}: {type(error).__name__}: {error}"))


def _measure(name: str):
    """A peer's measurement in a fresh interpreter of its own: client
    libraries that start threads (Mooncake's) do not survive the forks the
    next measurement makes."""
    def measure(size: int, count: int, repeats: int, timeout: float = 300.0) -> float:
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        process = context.Process(target=_isolated, args=(name, size, count, repeats, results))
        process.start()
        try:
            kind, value = results.get(timeout=timeout)
        except Exception:  # noqa: BLE001 - a hang or a crash: unavailable, with why
            process.kill()
            raise Unavailable(f"{name}: no result within {timeout:.0f} s (exit code "
                              f"{process.exitcode})") from None
        finally:
            process.join(30)
        if kind == "unavailable":
            raise Unavailable(value)
        return value

    return measure


PEERS = {name: _measure(name) for name in _PEERS}
