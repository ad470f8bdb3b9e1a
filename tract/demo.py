"""`tract demo`: disaggregated prefill and decode of a real transformer,
across emulated nodes, with the KV moving through the pool.

What runs (all on this machine's CPUs):

- an emulated pool in /dev/shm, its lock manager in its own process
  (node 0), as `tract manager` would run it;
- one or more *prefill workers* (nodes 1..P) and one *decode worker* (node
  P+1), separate processes, each with the same small Llama model
  (`transformers`, built from a config with seeded weights: nothing is
  downloaded);
- a prefill looks up the prompt's blocks in the pool, loads the hits into
  its KV cache, computes only the rest, stores the new full blocks and hands
  the request to the decode worker (`Connector.offer`: a ticket);
- the decode worker loads every block of the prompt from the pool
  (`Connector.take`), then generates.

The same pipeline runs with the KV moved other ways, on the same
requests: over a TCP socket between the two workers, through Mooncake Store
over TCP (when it is installed), and through the pool with the prefix
cache off.  The paths take turns within each workload: each prompt arrives
once per path, one after another, in the order of a Williams square
(`_turns`), so whatever drifts on the machine (its neighbours, the queue)
falls on every path alike, and the TTFTs of two paths that compute the same
tokens (TCP and the pool without its prefix cache) differ by their KV paths
only.  Every path is a pull, as a P/D transfer is: the prefill side keeps
the request's KV and tells the decode side, which asks for it (TCP: a
request on the prefill worker's KV socket, served by its server thread;
Mooncake: ``batch_get_into``; tract: `Connector.take`); the KV load time
runs from that ask to the last byte in the decode worker's memory.

Each workload is shaped like the paper's synthetic ones, scaled to a CPU:
prompts of whole blocks around 1-2k tokens, a shared prefix whose length
sets the hit rate, requests arriving at random (Poisson) at a rate the
machine can serve: before the workloads, the demo measures this machine's
service rate of the pipeline with every token computed (a burst of
requests), and sends at ``load`` (default 0.7) of it, so a TTFT shows the
KV path and the prefix cache, not a growing queue.

Measured per workload and path: TTFT (arrival to the first token at the
decode worker, its KV loaded), the decode side's KV load time beside its
bounds, each timed in the decode worker right after that request's load
(the same process, the same neighbours at work: `LoadBounds`): a cold
memcpy of the same bytes, and the same memcpy with the bytes' lines
dropped from the cache first, timed (the least a read fresh from a pool
of ``coherence="none"`` costs, R4); each ratio is the median of the
requests' paired ratios, with its range.  Then prefill compute time, hit
rate, each path's TTFT over TCP's for the same prompt (the median of the
paired ratios, and their range), and each workload's throughput.
Every request's tokens are checked against a single-process run of the
same model (``token_exact``).

The KV layout: a block is ``layers x (K, V) x block_size x kv_heads x
head_dim`` float32, token-major inside each (layer, K/V) piece, so every
piece is one contiguous slice of a worker's per-layer buffers and a block
moves as its pieces in one native call.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import queue
import socket
import statistics
import struct
import sys
import threading
import time
import uuid
import warnings
from dataclasses import asdict, dataclass

import numpy as np

from tract.bench.peers import SEGMENT_MAX, Unavailable, free_port, master_command, start_server
from tract.errors import ConfigError
from tract.transfer import KVLayout

__all__ = ["DemoConfig", "main", "make_model", "run"]

MANAGER_NODE = 0
BLOCK = 16  # tokens per KV block
PATHS = ("tract", "tcp", "mooncake_tcp", "tract_no_prefix_cache")
NETWORK_PATHS = ("tcp", "mooncake_tcp")


@dataclass
class DemoConfig:
    """What the demo runs; `quick` and `full` are the two presets."""

    layers: int = 8
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    vocab: int = 4096
    input_tokens: int = 1536  # mean prompt length (whole blocks, within +-25%)
    output_tokens: int = 64
    requests: int = 16  # per workload and path
    load: float = 0.7  # arrivals at this fraction of the measured service rate
    qps: float | None = None  # a fixed arrival rate instead
    hit_rates: tuple = (0.25, 0.5, 0.75)
    prefixes: int = 2  # distinct shared prefixes per workload
    prefill_workers: int = 2
    seed: int = 0
    paths: tuple = PATHS
    experiment: str = "workloads"  # or "static" (`static`)
    lengths: tuple = ()  # the static experiment's input lengths

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(input_tokens=1024, output_tokens=32, requests=4, prefill_workers=1)

    @classmethod
    def static(cls, quick: bool = False) -> DemoConfig:
        """The paper's Fig. 5 scaled to a CPU: the prefix cache off, fixed
        input lengths, 3 output tokens; the pool without its prefix cache
        against TCP and Mooncake."""
        lengths = (512, 1024) if quick else (512, 1024, 2048, 3072)
        return cls(experiment="static", lengths=lengths, input_tokens=max(lengths),
                   output_tokens=3, requests=6 if quick else 12,  # whole squares
                   prefill_workers=1 if quick else 2,
                   paths=("tract_no_prefix_cache", "tcp", "mooncake_tcp"))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def max_tokens(self) -> int:
        if self.experiment == "static":
            return _whole(max(self.lengths)) + BLOCK
        return _whole(self.input_tokens * 5 // 4) + BLOCK

    def layout(self) -> KVLayout:
        return KVLayout(model=f"tract-demo-llama-{self.layers}x{self.hidden}-s{self.seed}",
                        dtype="float32", num_layers=self.layers, num_kv_heads=self.kv_heads,
                        head_size=self.head_dim, block_size=BLOCK,
                        engine_layout="hf_token_major")


def _whole(tokens: int) -> int:
    return max(BLOCK, tokens // BLOCK * BLOCK)


# ------------------------------------------------------------------ model

def make_model(config: DemoConfig):
    """The demo's Llama: a small config, weights from a seeded generator,
    eager attention, float32, one thread (the same bits in every process)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    _quiet()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    torch.manual_seed(config.seed)
    llama = LlamaConfig(vocab_size=config.vocab, hidden_size=config.hidden,
                        intermediate_size=config.intermediate,
                        num_hidden_layers=config.layers, num_attention_heads=config.heads,
                        num_key_value_heads=config.kv_heads,
                        max_position_embeddings=config.max_tokens + config.output_tokens + 64,
                        initializer_range=0.1, attn_implementation="eager")
    return LlamaForCausalLM(llama).eval()


def _quiet() -> None:
    """Filter the deprecation warnings the model code prints on every
    forward (transformers' ``past_key_values`` and cache notices): they
    say nothing about tract, and they would scroll over the progress bar."""
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=r"transformers(\.|$)")
        warnings.filterwarnings("ignore", category=category, module=r"torch(\.|$)")


class KVBuffer:
    """A worker's KV staging: ``kv[layer, k_or_v, token, head, dim]``
    (token-major), as the pool's block pieces lay it out."""

    def __init__(self, config: DemoConfig):
        self.config = config
        self.kv = np.zeros((config.layers, 2, config.max_tokens, config.kv_heads,
                            config.head_dim), dtype=np.float32)
        self._blocks = [[self.kv[layer, part, b * BLOCK:(b + 1) * BLOCK]
                         for layer in range(config.layers) for part in (0, 1)]
                        for b in range(config.max_tokens // BLOCK)]

    def blocks(self, first: int, count: int) -> list[list[np.ndarray]]:
        """Blocks ``first..first+count-1`` as their pieces (layer, K/V), in
        order: views made once, as an engine registers its KV cache's
        (a load's time is the copy's, not the making of thousands of views)."""
        return self._blocks[first:first + count]

    def layers(self, tokens: int) -> list[np.ndarray]:
        """Each layer's K then V of the first ``tokens`` tokens (contiguous)."""
        return [self.kv[layer, part, :tokens] for layer in range(self.config.layers)
                for part in (0, 1)]

    def cache(self, tokens: int):
        """A `transformers` cache holding the first ``tokens`` tokens."""
        import torch
        from transformers import DynamicCache

        cache = DynamicCache()
        if tokens:
            for layer in range(self.config.layers):
                keys, values = (torch.from_numpy(self.kv[layer, part, :tokens])
                                .transpose(0, 1).unsqueeze(0) for part in (0, 1))
                cache.update(keys, values, layer)
        return cache

    def fill(self, cache, start: int, end: int) -> None:
        """Copy tokens ``start..end-1`` of ``cache`` in."""
        import torch

        for layer in range(self.config.layers):
            for part, tensor in enumerate(_layer_kv(cache, layer)):
                torch.from_numpy(self.kv[layer, part, start:end]).copy_(
                    tensor[0, :, start:end].transpose(0, 1))


def _layer_kv(cache, layer: int):
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers < 4.56


def _greedy(model, logits, cache, count: int) -> list[int]:
    """``count`` tokens, greedily, the first from ``logits``."""
    import torch

    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < count:
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def reference(config: DemoConfig, prompts: list[np.ndarray]) -> list[list[int]]:
    """The tokens of a single-process run of the same model, per prompt."""
    import torch

    model = make_model(config)
    out = []
    for prompt in prompts:
        first = model(torch.from_numpy(prompt[None].astype(np.int64)), use_cache=True)
        out.append(_greedy(model, first.logits, first.past_key_values, config.output_tokens))
    return out


# --------------------------------------------------------------- workload

@dataclass
class Request:
    rid: str
    workload: str
    path: str
    prompt: np.ndarray
    arrival: float = 0.0  # time.monotonic() when it arrived


def workloads(config: DemoConfig) -> dict[str, list[np.ndarray]]:
    """Prompts per workload: a shared prefix (one of ``prefixes``) whose
    length is the hit rate's share of the prompt, then a unique suffix;
    for the static experiment, prompts of each length sharing nothing."""
    rng = np.random.default_rng(config.seed + 1)
    if config.experiment == "static":
        return {f"len{length}": [rng.integers(0, config.vocab, _whole(length), dtype=np.int64)
                                 for _ in range(config.requests)]
                for length in config.lengths}
    out = {}
    for rate in config.hit_rates:
        prefixes = [rng.integers(0, config.vocab, config.max_tokens, dtype=np.int64)
                    for _ in range(config.prefixes)]
        prompts = []
        for i in range(config.requests):
            length = _whole(int(config.input_tokens * rng.uniform(0.75, 1.25)))
            shared = _whole(int(length * rate))
            suffix = rng.integers(0, config.vocab, length - shared, dtype=np.int64)
            prompts.append(np.concatenate([prefixes[i % config.prefixes][:shared], suffix]))
        out[f"hit{int(rate * 100)}"] = prompts
    return out


# ---------------------------------------------------------------- workers

def _send_frame(sock, header: dict, arrays=()) -> None:
    raw = json.dumps(header).encode()
    sock.sendall(struct.pack("<I", len(raw)) + raw)
    for array in arrays:
        sock.sendall(memoryview(array).cast("B"))


def _recv_exact(sock, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("the prefill worker closed the KV socket")
        view = view[got:]


def _recv_header(sock) -> dict:
    size = bytearray(4)
    _recv_exact(sock, memoryview(size))
    raw = bytearray(struct.unpack("<I", size)[0])
    _recv_exact(sock, memoryview(raw))
    return json.loads(raw)


class KVServer:
    """A prefill worker's KV over TCP, pulled: the worker keeps each
    request's KV here (`hold`), and a thread serves each ask of the
    decode worker (a frame naming the request) with its bytes, as a
    network P/D transfer serves a pull."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: dict[str, list[np.ndarray]] = {}
        self._thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        self._thread.start()

    def hold(self, rid: str, views: list[np.ndarray]) -> None:
        """Keep a copy of ``views`` (the worker's buffer is the next
        request's) until the decode worker pulls them."""
        self.held[rid] = [view.copy() for view in views]

    def _serve(self) -> None:
        try:
            connection = self.listener.accept()[0]  # the decode worker's, once
        except OSError:  # closed: the worker finished before any pull
            return
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    ask = _recv_header(connection)
                except (ConnectionError, OSError):  # the decode worker finished
                    return
                for array in self.held.pop(ask["rid"]):
                    connection.sendall(memoryview(array).cast("B"))

    def close(self) -> None:
        self.listener.close()


@contextlib.contextmanager
def _glog_muted():
    """Mooncake's client logs its setup and teardown through glog, straight
    to file descriptor 2 (no flag of the environment quiets it): that
    descriptor goes to /dev/null meanwhile."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _mooncake(ports):
    """A Mooncake Store client (its setup's logging muted); close it with
    `_close_mooncake`."""
    from tract.bench.peers import mooncake_store

    with _glog_muted():
        return mooncake_store(ports[0], ports[1], SEGMENT_MAX)


def _close_mooncake(store) -> None:
    with _glog_muted():
        store.close()


def _kv_keys(rid: str, layers: int) -> list[str]:
    return [f"{rid}:{layer}:{part}" for layer in range(layers) for part in "kv"]


def prefill_worker(path: str, node: int, config: DemoConfig, requests, handoff, tcp: bool,
                   mooncake_ports) -> None:
    """Serve requests from ``requests`` until None: prefill with the
    path's KV route, then hand off to the decode worker (which pulls the
    KV); with ``tcp``, a `KVServer` serves the pulls over TCP."""
    import torch

    from tract.connector import Connector
    from tract.pool import Pool

    model, buffer = make_model(config), KVBuffer(config)
    with Pool.open(path, node, populate=True) as pool:
        connectors = {name: Connector(pool, config.layout(), salt=name, handoff_ttl=60.0)
                      for name in ("tract", "tract_no_prefix_cache")}
        server = KVServer() if tcp else None
        store = None
        if mooncake_ports:
            store = _mooncake(mooncake_ports)
            store.register_buffer(buffer.kv.ctypes.data, buffer.kv.nbytes)
        while (request := requests.get()) is not None:
            started = time.monotonic()
            prompt, count = request.prompt, request.prompt.size
            hit = 0
            if request.path == "tract":
                connector = connectors["tract"]
                hit = connector.lookup(prompt) // BLOCK
                hit = connector.load(prompt[:hit * BLOCK], buffer.blocks(0, hit)) * BLOCK
            compute = time.monotonic()
            cache = buffer.cache(hit)
            out = model(torch.from_numpy(prompt[None, hit:]), past_key_values=cache,
                        use_cache=True)
            first = int(out.logits[0, -1].argmax())
            buffer.fill(cache, hit, count)
            computed = time.monotonic()
            message = dict(rid=request.rid, workload=request.workload, path=request.path,
                           arrival=request.arrival, first=first, tokens=count, hit_tokens=hit,
                           queued_s=started - request.arrival, compute_s=computed - compute,
                           node=node, prompt=prompt.tolist())
            if request.path.startswith("tract"):
                connector = connectors[request.path]
                message["ticket"] = connector.offer(request.rid, prompt,
                                                    buffer.blocks(0, count // BLOCK))
                connector.release()
            elif request.path == "mooncake_tcp":
                keys = _kv_keys(request.rid, config.layers)
                views = buffer.layers(count)
                codes = store.batch_put_from(keys, [v.ctypes.data for v in views],
                                             [v.nbytes for v in views])
                if any(codes):
                    raise Unavailable(f"mooncake: batch_put_from returned {codes[:3]}")
            else:  # tcp
                server.hold(request.rid, buffer.layers(count))
                message["kv_port"] = server.port
            message["send_s"] = time.monotonic() - computed
            message["sent"] = time.monotonic()
            handoff.send(message)
        for connector in connectors.values():
            connector.close()
        if server is not None:
            server.close()
        if store is not None:
            _close_mooncake(store)


def decode_worker(path: str, node: int, config: DemoConfig, inbox, handoffs, results,
                  mooncake_ports) -> None:
    """Take handed-off requests (from the ``handoffs`` pipes), pull their
    KV and generate, as a continuous batch: a handoff joins after the step
    under way, and the running requests make a token each in turn (one
    sequence a step: the model is small and single-threaded), so a handoff
    waits for one step, not for whole requests, as on a serving engine.
    Results to ``results``, until ``inbox`` says stop."""
    from multiprocessing.connection import wait

    import torch

    from tract.connector import Connector
    from tract.pool import Pool

    model, buffer = make_model(config), KVBuffer(config)
    block_bytes = config.layout().block_bytes
    with Pool.open(path, node, populate=True) as pool, contextlib.ExitStack() as stack:
        bounds = LoadBounds(config.max_tokens // BLOCK * block_bytes)
        stack.callback(bounds.close)
        connectors = {name: Connector(pool, config.layout(), salt=name)
                      for name in ("tract", "tract_no_prefix_cache")}
        for connector in connectors.values():
            stack.callback(connector.close)
        store = None
        if mooncake_ports:
            store = _mooncake(mooncake_ports)
            stack.callback(_close_mooncake, store)
            store.register_buffer(buffer.kv.ctypes.data, buffer.kv.nbytes)
        pulls: dict[int, socket.socket] = {}  # a prefill worker's KV port -> its socket

        def admit(message: dict) -> dict:
            """Pull a handed-off request's KV (timed), its bounds beside it,
            and make its second token (the step that moves its cache out of
            the staging buffer, which the next pull fills)."""
            began = time.monotonic()
            count = message["tokens"]
            if message["path"] == "tcp":
                sock = pulls.get(message["kv_port"])
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", message["kv_port"]))
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    stack.callback(sock.close)
                    pulls[message["kv_port"]] = sock
                    began = time.monotonic()  # the connection is set up once, not timed
                _send_frame(sock, {"rid": message["rid"]})
                for view in buffer.layers(count):
                    _recv_exact(sock, memoryview(view).cast("B"))
                loaded = count
            elif message["path"].startswith("tract"):
                taken = connectors[message["path"]].take(message["ticket"],
                                                         buffer.blocks(0, count // BLOCK))
                loaded = taken.blocks * BLOCK
            else:  # mooncake_tcp
                keys, views = _kv_keys(message["rid"], config.layers), buffer.layers(count)
                got = store.batch_get_into(keys, [v.ctypes.data for v in views],
                                           [v.nbytes for v in views])
                loaded = count if all(g == v.nbytes for g, v in zip(got, views)) else 0
                store.batch_remove(keys, True)
            loaded_at = time.monotonic()
            cache = buffer.cache(loaded)
            prompt = message.pop("prompt")
            if loaded < count:  # what the pool lacked (evicted, a bad checksum): recompute
                missing = np.asarray(prompt[loaded:], dtype=np.int64)
                model(torch.from_numpy(missing[None]), past_key_values=cache, use_cache=True)
            ready_at = time.monotonic()  # the first token can go to the client
            nbytes = count // BLOCK * block_bytes  # the load's bounds, paired with it
            memcpy_s, floor_s = bounds.memcpy(nbytes), bounds.dropping(nbytes)
            first = message["first"]
            step = model(torch.tensor([[first]]), past_key_values=cache, use_cache=True)
            return dict(message, cache=cache, output=[first, int(step.logits[0, -1].argmax())],
                        memcpy_s=memcpy_s, floor_s=floor_s, load_s=loaded_at - began,
                        handoff_s=began - message["sent"], ttft_s=ready_at - message["arrival"],
                        ready_at=ready_at, loaded_tokens=loaded)

        running: collections.deque[dict] = collections.deque()  # admitted, generating
        while True:
            # a continuous batch: a handoff joins after the step under way,
            # then the running requests make a token each in turn
            for source in wait([inbox, *handoffs], timeout=0 if running else None):
                if source is inbox:
                    inbox.recv()
                    return
                running.append(admit(source.recv()))
            if not running:
                continue
            request = running.popleft()
            tokens = request["output"]
            if len(tokens) < config.output_tokens:
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=request["cache"],
                            use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) < config.output_tokens:
                running.append(request)
                continue
            request.pop("cache")
            done = time.monotonic()
            results.put(dict(request, decode_s=done - request.pop("ready_at"), done=done))


# ------------------------------------------------------------ orchestrator

def manage_locks(path: str, stop) -> None:
    """The pool's lock manager (node 0), as `tract manager` runs it."""
    from tract.pool import Pool

    with Pool.open(path, MANAGER_NODE) as pool:
        pool.manager().run(stop)


def _mooncake_ports(stack) -> tuple[tuple[int, int] | None, str | None]:
    """Start a Mooncake master on 127.0.0.1 (stopped with ``stack``):
    its (rpc, metadata) ports, or None and why not."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        if "libibverbs" in str(error):
            return None, (f"Mooncake needs the system library libibverbs1: "
                          f"`apt-get install -y libibverbs1` as root ({error})")
        return None, (f"mooncake-transfer-engine-non-cuda is not installed: "
                      f"`pip install 'tract[demo]'` ({error})")
    master, metadata = free_port(), free_port()
    try:
        stack.enter_context(start_server(master_command(master, metadata), [master, metadata],
                                         "mooncake_master"))
    except Unavailable as why:
        return None, str(why)
    return (master, metadata), None


def _pool_bytes(config: DemoConfig) -> int:
    """Room for the blocks of every workload on each pool path, and of the
    rate burst: nothing is evicted, so no store pays for evictions (which
    the network paths never do) and no prefix leaves the cache."""
    pool_paths = sum(name.startswith("tract") for name in config.paths)
    if config.experiment == "static":
        blocks = config.requests * sum(_whole(length) // BLOCK for length in config.lengths)
    else:
        blocks = len(config.hit_rates) * config.requests * (config.max_tokens // BLOCK)
    blocks = blocks * pool_paths + len(_rate_prompts(config)) * (config.max_tokens // BLOCK)
    return min(8 << 30, max(256 << 20, blocks * config.layout().block_bytes * 5 // 4))


def _warm_up() -> None:
    """Before the workers fork: import the model's libraries and compile
    every pool kernel the workers call (`tract.connector.warm_up`), so each
    worker inherits them instead of compiling its own (a fresh checkout has
    no Numba cache yet)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from tract.connector import warm_up

    warm_up()


def run(config: DemoConfig, progress: bool = True) -> dict:
    """Run every workload on every path; returns the report (`main` prints it)."""
    context = multiprocessing.get_context("fork")
    prompts = workloads(config)
    _warm_up()
    path = os.path.join("/dev/shm", f"tract-demo-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    from tract.pool import Pool

    unavailable = {}
    with contextlib.ExitStack() as stack:
        paths = list(config.paths)
        ports = None
        if "mooncake_tcp" in paths:
            ports, why = _mooncake_ports(stack)
            if ports is None:
                paths.remove("mooncake_tcp")
                unavailable["mooncake_tcp"] = why
        nodes = config.prefill_workers + 2
        Pool.create(path, _pool_bytes(config), max_nodes=nodes, lease_timeout=5.0)
        stack.callback(Pool.destroy, path)
        stop = context.Event()
        manager = context.Process(target=manage_locks, name="lock-manager", args=(path, stop),
                                  daemon=True)
        manager.start()
        stack.callback(manager.join, 30)
        stack.callback(stop.set)
        requests, results = context.Queue(), context.Queue()
        inbox_read, inbox_write = context.Pipe(duplex=False)
        pipes = [context.Pipe(duplex=False) for _ in range(config.prefill_workers)]
        decode = context.Process(target=decode_worker, name="decode", args=(
            path, nodes - 1, config, inbox_read, [r for r, _ in pipes], results, ports))
        decode.start()
        prefills = [context.Process(target=prefill_worker, name=f"prefill-{i}", args=(
            path, 1 + i, config, requests, pipes[i][1], "tcp" in paths, ports))
            for i in range(config.prefill_workers)]
        for worker in prefills:
            worker.start()

        def finish():
            """Stop the workers (each publishes its counters as it closes
            its pool); once only."""
            if not prefills:
                return
            for _ in prefills:
                requests.put(None)
            for worker in prefills:
                worker.join(60)
            inbox_write.send(None)
            decode.join(60)
            for worker in [*prefills, decode]:
                if worker.is_alive():
                    worker.kill()
            prefills.clear()
        stack.callback(finish)

        def phase(items: list[Request], qps: float) -> list[dict]:
            """Send ``items`` at Poisson arrivals, ``qps`` on average over
            them (the gaps scaled to it: a few dozen draws stray far from
            their mean); their results, in order."""
            gaps = np.random.default_rng(config.seed + len(items)).exponential(1.0, len(items))
            gaps *= (len(items) - 1) / (qps * (gaps.sum() - gaps[0])) if len(items) > 1 else 0
            out: dict[str, dict] = {}

            def collect(until: float | None) -> None:
                """Take results as they come (the bar moves), until the
                monotonic time ``until``, or until all are in."""
                while len(out) < len(items):
                    for worker in [*prefills, decode, manager]:
                        if worker.exitcode not in (None, 0):
                            raise RuntimeError(f"demo worker {worker.name} exited with code "
                                               f"{worker.exitcode}")
                    left = 1.0 if until is None else until - time.monotonic()
                    if left <= 0:
                        return
                    try:
                        result = results.get(timeout=min(left, 1.0))
                    except queue.Empty:
                        continue
                    out[result["rid"]] = result
                    bar.update(1)

            start = time.monotonic()
            for item, at in zip(items, np.cumsum(gaps) - gaps[0]):
                collect(start + at)
                item.arrival = time.monotonic()
                requests.put(item)
            collect(None)
            return [out[item.rid] for item in items]

        warm = np.arange(4 * BLOCK, dtype=np.int64)
        total = len(paths) * sum(len(p) for p in prompts.values())
        bar = _progress(total, progress)
        # warm-up: the first request of each path on each worker (not measured)
        bar.total += len(paths) * config.prefill_workers
        for name in paths:
            phase([Request(f"warm-{name}-{i}", "warm", name, warm + i)
                   for i in range(config.prefill_workers)], 50.0)
        qps, service = config.qps, None
        if qps is None:  # a burst, every token computed: the rate this machine serves
            probe = "tract_no_prefix_cache" if "tract_no_prefix_cache" in paths else paths[0]
            burst = [Request(f"rate-{i}", "rate", probe, prompt)
                     for i, prompt in enumerate(_rate_prompts(config))]
            bar.total += len(burst)
            served = phase(burst, 1e6)
            service = len(served) / (max(r["done"] for r in served)
                                     - min(r["arrival"] for r in served))
            qps = config.load * service
        runs, spans = {}, {}
        for workload, items in prompts.items():
            served = phase([Request(f"{workload}-{name}-{i}", workload, name, prompt)
                            for i, prompt in enumerate(items) for name in _turns(paths, i)],
                           qps)
            spans[workload] = (len(served), max(r["done"] for r in served)
                               - min(r["arrival"] for r in served))
            for name in paths:  # each path's results in prompt order
                runs[(workload, name)] = [r for r in served if r["path"] == name]
        bar.close()
        finish()  # counters publish every heartbeat: read them once the workers closed
        with Pool.observe(path) as pool:
            counters = pool.counters()
    expected = {}
    for workload, items in prompts.items():
        for i, tokens in enumerate(reference(config, items)):
            expected[(workload, i)] = tokens
    report = _report(config, runs, expected, counters, unavailable)
    report.update(arrival_rate_rps=qps, service_rate_rps=service,
                  throughput_rps={workload: count / span
                                  for workload, (count, span) in spans.items()})
    return report


def _turns(paths: list[str], i: int) -> list[str]:
    """The paths in the order prompt ``i``'s requests arrive: row ``i`` of
    a Williams square (its mirror too for an odd count, every other
    square), so over each square's prompts every path comes first,
    second... equally often, and right after every other path equally
    often (a cheap request, a prefix hit, eases the next one's queue)."""
    n = len(paths)
    base = [0]
    for k in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        base.append((k + 1) // 2 if k % 2 else n - k // 2)
    order = [paths[(b + i) % n] for b in base]
    return order[::-1] if n % 2 and (i // n) % 2 else order


def _rate_prompts(config: DemoConfig) -> list[np.ndarray]:
    """The burst that measures the service rate: prompts of the mean
    length (the static experiment's longest), shared with no workload."""
    rng = np.random.default_rng(config.seed + 2)
    return [rng.integers(0, config.vocab, _whole(config.input_tokens), dtype=np.int64)
            for _ in range(3 * config.prefill_workers + 1)]


class LoadBounds:
    """The bounds on a KV load of up to ``nbytes``, one timing per call, to
    pair with a load just made in the same process: `memcpy`, one copy
    between buffers no cache holds; `dropping`, the same copy out of a
    mapping whose range is dropped from this CPU's caches first (the
    payload instruction) and fenced, all timed (the least a read fresh
    from a pool of ``coherence="none"`` costs: R4).  Each begins with a
    64 MiB sweep, so no cache holds either side."""

    def __init__(self, nbytes: int):
        from tract.region import scratch_region

        self.source = np.ones(nbytes, np.uint8)
        self.target = np.zeros(nbytes, np.uint8)  # both faulted in
        self.sweep = np.empty(64 << 20, np.uint8)
        self.region = scratch_region(nbytes, name="demo-floor", populate=True)
        self.region.fill(0, nbytes, 1)

    def memcpy(self, nbytes: int) -> float:
        self.sweep.fill(1)
        began = time.perf_counter()
        np.copyto(self.target[:nbytes], self.source[:nbytes])
        return time.perf_counter() - began

    def dropping(self, nbytes: int) -> float:
        self.sweep.fill(1)
        began = time.perf_counter()
        self.region.invalidate(0, nbytes, payload=True)
        self.region.fence()
        self.region.copy_out(0, self.target[:nbytes])
        return time.perf_counter() - began

    def close(self) -> None:
        self.region.close()


def cold_memcpy_seconds(nbytes: int, trials: int = 5) -> float:
    """The median time of one copy of ``nbytes`` between buffers no cache
    holds (a 64 MiB sweep before each copy evicts them): the bound on a
    load of that many bytes into a worker's memory."""
    bounds = LoadBounds(nbytes)
    try:
        return statistics.median(bounds.memcpy(nbytes) for _ in range(trials))
    finally:
        bounds.close()


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        class Quiet:
            total = 0

            def update(self, _):
                pass

            def close(self):
                pass
        return Quiet()
    return tqdm(total=total, desc="tract demo", unit="req", file=sys.stderr)


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "p50": float(np.percentile(ordered, 50)),
            "p99": float(np.percentile(ordered, 99))}


def _paired(ours: list[float], theirs: list[float]) -> dict:
    """The median of the paired ratios ``ours[i] / theirs[i]``, and their range."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}


def _of_load(name: str, bounds: list[float], loads: list[float]) -> dict:
    """A bound's paired ratios to its loads: their median, and their range."""
    paired = _paired(bounds, loads)
    return {name: paired["median"], f"{name}_range": paired["range"]}


def _report(config, runs, expected, counters, unavailable) -> dict:
    workloads_out, exact = {}, True
    for (workload, name), results in runs.items():
        mismatched = [r["rid"] for i, r in enumerate(results)
                      if r["output"] != expected[(workload, i)]]
        exact &= not mismatched
        tokens = sum(r["tokens"] for r in results)
        loads = [r["load_s"] for r in results]
        workloads_out.setdefault(workload, {})[name] = {
            "requests": len(results),
            "ttft_s": _summary([r["ttft_s"] for r in results]),
            "kv_load_s": _summary(loads),
            "prefill_compute_s": _summary([r["compute_s"] for r in results]),
            "hit_rate": sum(r["hit_tokens"] for r in results) / tokens,
            "kv_bytes_per_request": statistics.fmean(
                r["tokens"] // BLOCK * config.layout().block_bytes for r in results),
            "mismatched": mismatched,
            "ttft_samples_s": [r["ttft_s"] for r in results],
            # each load and its bounds, timed right after it in its worker (`LoadBounds`)
            "kv_load_pairs_s": [[r["load_s"], r["memcpy_s"], r["floor_s"]] for r in results],
            "kv_memcpy_s": statistics.median(r["memcpy_s"] for r in results),
            "kv_floor_s": statistics.median(r["floor_s"] for r in results),
            **_of_load("kv_load_of_bound", [r["memcpy_s"] for r in results], loads),
            **_of_load("kv_load_of_floor", [r["floor_s"] for r in results], loads),
        }
    ratios = {}
    for workload, paths in workloads_out.items():
        ours = next((name for name in ("tract", "tract_no_prefix_cache") if name in paths), None)
        if ours is not None:
            ratios[workload] = {name: row["kv_load_s"]["mean"] / paths[ours]["kv_load_s"]["mean"]
                                for name, row in paths.items() if name in NETWORK_PATHS}
    ttft_of_tcp = {}  # each path's TTFT over tcp's for the same prompt (they arrive in turn)
    for workload, paths in workloads_out.items():
        if "tcp" in paths:
            ttft_of_tcp[workload] = {
                name: _paired(row["ttft_samples_s"], paths["tcp"]["ttft_samples_s"])
                for name, row in paths.items() if name != "tcp"}
    return {"token_exact": exact, "experiment": config.experiment, "config": asdict(config),
            "kv_block_bytes": config.layout().block_bytes, "workloads": workloads_out,
            "kv_load_speedup": ratios, "ttft_of_tcp": ttft_of_tcp, "unavailable": unavailable,
            "pool_counters": {str(node): c for node, c in counters.items()}}


def _table(report: dict) -> str:
    lines = []
    if report["service_rate_rps"] is not None:
        lines.append(f"arrivals: {report['arrival_rate_rps']:.2f} req/s, "
                     f"{report['config']['load']:.2f} of the {report['service_rate_rps']:.2f} "
                     f"req/s this machine served with every token computed")
    else:
        lines.append(f"arrivals: {report['arrival_rate_rps']:.2f} req/s (fixed)")
    lines.append(f"{'workload':<8} {'path':<22} {'TTFT mean':>10} {'p50':>8} {'p99':>8} "
                 f"{'KV load':>9} {'memcpy':>8} {'of it':>15} {'+drop':>8} {'of it':>15} "
                 f"{'prefill':>8} {'hit':>5}")
    for workload, paths in report["workloads"].items():
        for name, row in paths.items():
            lines.append(f"{workload:<8} {name:<22} {row['ttft_s']['mean'] * 1e3:8.0f}ms "
                         f"{row['ttft_s']['p50'] * 1e3:6.0f}ms {row['ttft_s']['p99'] * 1e3:6.0f}ms "
                         f"{row['kv_load_s']['mean'] * 1e3:7.1f}ms "
                         f"{row['kv_memcpy_s'] * 1e3:6.1f}ms {_ratio(row, 'kv_load_of_bound')} "
                         f"{row['kv_floor_s'] * 1e3:6.1f}ms {_ratio(row, 'kv_load_of_floor')} "
                         f"{row['prefill_compute_s']['mean'] * 1e3:6.0f}ms "
                         f"{row['hit_rate']:5.2f}")
    for workload, paths in report["workloads"].items():
        turns = f"{workload}: {sum(row['requests'] for row in paths.values())} requests, the " \
                f"paths in turn, served at {report['throughput_rps'][workload]:.2f} req/s"
        if workload in report["ttft_of_tcp"]:
            turns += "; TTFT / tcp's, by prompt: " + ", ".join(
                f"{name} {ratio['median']:.2f} [{ratio['range'][0]:.2f}-{ratio['range'][1]:.2f}]"
                for name, ratio in report["ttft_of_tcp"][workload].items())
        lines.append(turns)
    lines.append("(memcpy: a cold copy of the same bytes, the bound on a KV load; +drop: the "
                 "same with the bytes' lines dropped from the cache first, timed: the least a "
                 "read fresh from a non-coherent pool costs (R4); both timed in the decode "
                 "worker right after each load, medians; of it: the median of that time / "
                 "its request's KV load [range])")
    return "\n".join(lines)


def _ratio(row: dict, name: str) -> str:
    low, high = row[f"{name}_range"]
    return f"{row[name]:4.2f} [{low:.2f}-{high:.2f}]".rjust(15)


def _plots(report: dict, out_dir: str) -> list[str]:
    """One TTFT CDF per workload, a curve per path (PNG), titled with the
    machine and the load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tract.bench import machine

    where = machine()
    load = f"{report['arrival_rate_rps']:.2f} req/s"
    if report["service_rate_rps"] is not None:
        load += f" ({report['config']['load']:.1f} of {report['service_rate_rps']:.2f} served)"
    written = []
    for workload, paths in report["workloads"].items():
        figure, axes = plt.subplots(figsize=(6, 4))
        for name, row in paths.items():
            samples = np.sort(np.asarray(row["ttft_samples_s"]) * 1e3)
            axes.step(samples, np.arange(1, samples.size + 1) / samples.size, where="post",
                      label=name)
        axes.set_xlabel("TTFT (ms)")
        axes.set_ylabel("fraction of requests")
        axes.set_title(f"TTFT CDF, {report['experiment']} {workload}: "
                       f"{where['cpu_model'][:40]}, {where['cores']} cores, {load}",
                       fontsize=8)
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        target = os.path.join(out_dir, f"ttft_cdf_{report['experiment']}_{workload}.png")
        figure.savefig(target, dpi=100)
        plt.close(figure)
        written.append(target)
    return written


EXPERIMENTS = ("workloads", "static")
SIZES = ("layers", "input_tokens", "output_tokens", "requests")  # a preset's, each overridable


def main(quick: bool = False, as_json: bool = False, out_dir: str = "tract-demo-out",
         config: DemoConfig | None = None, load: float | None = None,
         experiment: str = "workloads", sizes: dict | None = None) -> int:
    if experiment not in EXPERIMENTS:
        raise ConfigError(f"the demo's experiments are {', '.join(EXPERIMENTS)}; got "
                          f"{experiment!r}")
    if config is None:
        config = DemoConfig.static(quick) if experiment == "static" else \
            DemoConfig.quick() if quick else DemoConfig()
    if load is not None:
        config.load = load
    for name, value in (sizes or {}).items():
        if name not in SIZES:
            raise ConfigError(f"the demo's sizes are {', '.join(SIZES)}; got {name!r}")
        if name == "input_tokens" and config.experiment == "static":
            raise ConfigError("the static experiment's input lengths are fixed "
                              f"({', '.join(map(str, config.lengths))} tokens); "
                              "--input-tokens is the workloads'")
        if not isinstance(value, int) or value < 1 or \
                name == "input_tokens" and value < 2 * BLOCK:
            raise ConfigError(f"the demo's {name.replace('_', ' ')} must be a whole number of "
                              f"at least {2 * BLOCK if name == 'input_tokens' else 1}, "
                              f"got {value!r}")
        setattr(config, name, value)
    if config.output_tokens < 2 or config.requests < 1:
        raise ConfigError("the demo needs at least 2 output tokens and 1 request")
    if not 0 < config.load <= 1:
        raise ConfigError(f"the demo's load must be in (0, 1] of the measured service rate, "
                          f"got {config.load}")
    started = time.monotonic()
    report = run(config, progress=not as_json)
    report["seconds"] = time.monotonic() - started
    os.makedirs(out_dir, exist_ok=True)
    report["plots"] = _plots(report, out_dir)
    report["json"] = os.path.join(out_dir, "demo.json" if config.experiment == "workloads"
                                  else f"demo_{config.experiment}.json")
    with open(report["json"], "w") as out:
        json.dump(report, out, indent=2)
    if as_json:
        print(json.dumps(report, indent=2))
        return 0 if report["token_exact"] else 1
    print(_table(report))
    for workload, ratios in report["kv_load_speedup"].items():
        for name, ratio in ratios.items():
            print(f"{workload}: the decode side pulls its KV {ratio:.1f}x faster through tract "
                  f"than through {name}")
    for name, why in report["unavailable"].items():
        print(f"{name}: not run ({why})")
    print(f"token_exact: {report['token_exact']} (every request's tokens equal a "
          f"single-process run of the same model)")
    print(f"wrote {report['json']} and {', '.join(report['plots'])} in "
          f"{report['seconds']:.0f} s")
    return 0 if report["token_exact"] else 1
