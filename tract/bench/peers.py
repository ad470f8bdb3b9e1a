"""The peers `tract bench transfer` compares against: the same handoff
(producer process -> consumer process, from the producer's first call to
the consumer holding the bytes) through Redis and Mooncake Store, each
server started here on 127.0.0.1 and stopped after.  A peer that cannot be
started raises `Unavailable` with the reason, which the report prints."""

from __future__ import annotations

import contextlib
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


def _free_port() -> int:
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
def _server(command: list[str], ports, what: str):
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


def _handoff(produce, consume, repeats: int, nbytes: int) -> float:
    """GB/s of a handoff: ``produce(round)`` in this process, then
    ``consume(round)`` in a child told by a pipe; timed from the producer's
    start to the consumer's end (one monotonic clock)."""
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
    port = _free_port()
    blocks = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
              for i in range(count)]
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--protected-mode", "yes"]
    with _server(command, [port], "redis-server"):
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

        return _handoff(produce, consume, repeats, size * count)


# --------------------------------------------------------------- Mooncake

def _mooncake_store(master: int, metadata: int, segment: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", f"http://127.0.0.1:{metadata}/metadata", segment,
                       segment, "tcp", "", f"127.0.0.1:{master}")
    if code:
        raise Unavailable(f"mooncake: setup returned {code}")
    return store


def mooncake_tcp_handoff(size: int, count: int, repeats: int) -> float:
    """Mooncake Store over TCP, batched zero-copy calls from registered
    buffers (`batch_put_from` / `batch_get_into`)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        raise Unavailable(f"mooncake: mooncake-transfer-engine-non-cuda is not installed "
                          f"({error})") from None
    master, metadata = _free_port(), _free_port()
    command = ["mooncake_master", "--rpc_address=127.0.0.1", f"--rpc_port={master}",
               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={metadata}"]
    segment = max(512 << 20, 4 * size * count)
    with _server(command, [master, metadata], "mooncake_master"):
        store = _mooncake_store(master, metadata, segment)
        source = np.random.default_rng(5).integers(0, 256, size * count, dtype=np.uint8)
        address = source.ctypes.data
        if store.register_buffer(address, source.nbytes):
            raise Unavailable("mooncake: register_buffer failed")
        state = {}

        def produce(round_):
            keys = [f"r{round_}:{i}" for i in range(count)]
            codes = store.batch_put_from(keys, [address + i * size for i in range(count)],
                                         [size] * count)
            if any(code != 0 for code in codes):
                raise Unavailable(f"mooncake: batch_put_from returned {codes[:3]}")

        def consume(round_):
            if "store" not in state:
                state["store"] = _mooncake_store(master, metadata, segment)
                state["out"] = np.empty(size * count, np.uint8)
                state["store"].register_buffer(state["out"].ctypes.data, size * count)
            out = state["out"]
            keys = [f"r{round_}:{i}" for i in range(count)]
            got = state["store"].batch_get_into(keys, [out.ctypes.data + i * size
                                                       for i in range(count)], [size] * count)
            assert all(n == size for n in got), got[:3]

        try:
            return _handoff(produce, consume, repeats, size * count)
        finally:
            with contextlib.suppress(Exception):
                store.close()


PEERS = {"redis": redis_handoff, "mooncake_tcp": mooncake_tcp_handoff}
