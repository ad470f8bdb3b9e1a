"""The peers `tract bench transfer` compares against: the same handoff
(producer process -> consumer process, from the producer's first call to
the consumer holding the bytes) through Redis and Mooncake Store, each
server started here on 127.0.0.1 and stopped after.  Each peer is a
`Peer`: a sampler in an interpreter of its own, asked for one round at a
time, so the bench measures it in turn with tract's handoff (A B A B ...).
A peer that cannot be started or fails raises `Unavailable` with the
reason, which the report prints.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np

__all__ = ["PEERS", "MooncakeCluster", "Peer", "Unavailable", "handoff_sampler",
           "master_command"]


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


@contextlib.contextmanager
def handoff_sampler(produce, consume, clear=None):
    """A handoff, one round a call: ``sample(round_)`` runs
    ``produce(round_)`` here, then ``consume(round_)`` in a child told by a
    pipe, and returns the seconds from the producer's start to the
    consumer's end (one monotonic clock); ``clear(round_)``, untimed, then
    drops the round's keys (as tract's bench evicts its blocks)."""
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

    def sample(round_: int) -> float:
        started = time.monotonic()
        produce(round_)
        ours.send((round_, started))
        elapsed = ours.recv()
        if isinstance(elapsed, Exception):
            raise Unavailable(f"consumer failed: {elapsed}")
        if clear is not None:
            clear(round_)
        return elapsed

    try:
        yield sample
    finally:
        with contextlib.suppress(OSError):
            ours.send(None)
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()


# ------------------------------------------------------------------ Redis

@contextlib.contextmanager
def redis_handoff(size: int, count: int):
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

        with handoff_sampler(produce, consume, lambda round_: client.delete(
                *[f"r{round_}:{i}" for i in range(count)])) as sample:
            yield sample


# --------------------------------------------------------------- Mooncake

SEGMENT_MAX = (2 << 30) - (1 << 20)  # with a larger segment every put fails (-200, no space)


def master_command(master: int, metadata: int) -> list[str]:
    """`mooncake_master` with its RPC, HTTP metadata and metrics servers on
    127.0.0.1 (each on a port of its own: several masters may run at once)."""
    return ["mooncake_master", "--rpc_address=127.0.0.1", f"--rpc_port={master}",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={metadata}", "--metrics_host=127.0.0.1",
            f"--metrics_port={free_port()}"]


class MooncakeCluster:
    """A Mooncake Store on 127.0.0.1: its master (RPC and HTTP metadata
    servers) and one segment holder (``mooncake_client``) giving it
    ``segment`` bytes; `start` them, `stop` them (the master alone can be
    killed and started again on the same ports: `master_process`,
    `start_master`).  `url` names it as a `tract.tier` URL."""

    def __init__(self, segment: int = 64 << 20):
        self.master, self.metadata, self.holder = free_port(), free_port(), free_port()
        self.segment = segment
        self.master_process: subprocess.Popen | None = None
        self.stack = contextlib.ExitStack()

    def start_master(self) -> None:
        self.master_process = self.stack.enter_context(start_server(
            master_command(self.master, self.metadata), [self.master, self.metadata],
            "mooncake_master"))

    def start(self) -> MooncakeCluster:
        try:
            self.start_master()
            self.stack.enter_context(start_server(
                ["mooncake_client", "--host=127.0.0.1", f"--port={self.holder}",
                 f"--master_server_address=127.0.0.1:{self.master}",
                 f"--metadata_server=http://127.0.0.1:{self.metadata}/metadata",
                 f"--global_segment_size={self.segment}", "--protocol=tcp"],
                [self.holder], "mooncake_client"))
        except BaseException:
            self.stop()
            raise
        return self

    def url(self, **query) -> str:
        """The tier URL of this store, with ``query`` options."""
        extra = "".join(f"&{key}={value}" for key, value in query.items())
        return f"mooncake://127.0.0.1:{self.master}?metadata=http://127.0.0.1:" \
               f"{self.metadata}/metadata{extra}"

    def stop(self) -> None:
        self.stack.close()

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


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


@contextlib.contextmanager
def mooncake_tcp_handoff(size: int, count: int):
    """Mooncake Store over TCP, batched zero-copy calls from registered
    buffers (`batch_put_from` / `batch_get_into`)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        raise Unavailable(f"mooncake: mooncake-transfer-engine-non-cuda is not installed "
                          f"({error})") from None
    master, metadata = free_port(), free_port()
    segment = min(max(512 << 20, 4 * size * count), SEGMENT_MAX)
    with start_server(master_command(master, metadata), [master, metadata], "mooncake_master"):
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
            with handoff_sampler(produce, consume, lambda round_: _remove(
                    mine["store"], _keys("r", round_, count))) as sample:
                yield sample
        finally:
            with contextlib.suppress(Exception):
                mine["store"].close()


@contextlib.contextmanager
def mooncake_shm_handoff(size: int, count: int):
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
    client_command = ["mooncake_client", "--host=127.0.0.1", f"--port={client}",
                      f"--master_server_address=127.0.0.1:{master}",
                      f"--metadata_server=http://127.0.0.1:{metadata}/metadata",
                      f"--global_segment_size={segment}", "--protocol=tcp"]
    with start_server(master_command(master, metadata), [master, metadata],
                      "mooncake_master"), \
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
            with handoff_sampler(produce, consume, lambda round_: _remove(
                    mine["store"], _keys("s", round_, count))) as sample:
                yield sample
        finally:
            with contextlib.suppress(Exception):
                mine["store"].close()


_SAMPLERS = {"redis": redis_handoff, "mooncake_tcp": mooncake_tcp_handoff,
             "mooncake_shm": mooncake_shm_handoff}
PEERS = tuple(_SAMPLERS)


def _serve(name: str, size: int, count: int, pipe) -> None:
    """A peer's process: its sampler set up, then one round per request."""
    quiet = os.open(os.devnull, os.O_WRONLY)  # the peers' own logging (glog) to stderr
    os.dup2(quiet, 2)
    try:
        with _SAMPLERS[name](size, count) as sample:
            pipe.send(("ready", None))
            while (round_ := pipe.recv()) is not None:
                pipe.send(("ok", sample(round_)))
    except Unavailable as why:
        pipe.send(("unavailable", why.args[0]))
    except Exception as error:  # noqa: BLE001 - reported as a reason
        pipe.send(("unavailable", f"{name}: {type(error).__name__}: {error}"))


class Peer:
    """One peer's handoff of ``count`` blocks of ``size`` bytes, sampled a
    round at a time in a fresh interpreter of its own: client libraries
    that start threads (Mooncake's) do not survive the forks of the
    samplers beside them.  Raises `Unavailable` at start, or at a sample,
    with the reason; no call waits longer than ``timeout`` seconds."""

    def __init__(self, name: str, size: int, count: int, timeout: float = 300.0):
        if name not in _SAMPLERS:
            raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
        self.name, self.timeout = name, timeout
        context = multiprocessing.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(name, size, count, theirs))
        self.process.start()
        theirs.close()
        self._answer()

    def _answer(self):
        if not self.pipe.poll(self.timeout):
            self.close()
            raise Unavailable(f"{self.name}: no answer within {self.timeout:.0f} s")
        try:
            kind, value = self.pipe.recv()
        except EOFError:
            self.close()
            raise Unavailable(f"{self.name}: its process died (exit code "
                              f"{self.process.exitcode})") from None
        if kind == "unavailable":
            self.close()
            raise Unavailable(value)
        return value

    def sample(self, round_: int) -> float:
        """Seconds of one round's handoff."""
        self.pipe.send(round_)
        return self._answer()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.pipe.send(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
