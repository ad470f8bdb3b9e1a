"""One vLLM instance, in its own process, for the connector tests: runs the
batches of a JSON spec through `vllm.LLM` and writes what came out.

    python engine.py SPEC.json

SPEC: ``model`` (a local model directory), ``out`` (where the results go),
``batches`` (each ``{"prompts": [[token ids]], "max_tokens": n}``, with
``"one_by_one": true`` to time each prompt alone, ``"concurrent": k`` to
serve them k at a time and time each one's first token, or ``"abort":
[indices]`` to abort those prompts' requests after the first engine step,
``"wait_for": path`` to serve the batch only once another process made
``path``; ``"remote_decode": true`` asks a NixlConnector producer to keep each
request's blocks for a decoder, ``"params_from": path`` with
``"params_offset": n`` gives request i the kv_transfer_params at n + i of
the list a producer wrote there), and optionally ``params_out`` and
``serve_until`` (after the batches: write every output's kv_transfer_params
there, then step the engine, serving NIXL's reads, until ``serve_until``
exists), and
``kv_transfer_config`` (a dict, as vLLM takes it), ``block_size`` and
``num_blocks`` (the KV cache's size in blocks: small, vLLM preempts) with
``max_model_len`` (which vLLM wants it to hold), ``max_num_batched_tokens``
(a step's tokens: small, vLLM prefills a prompt in chunks), ``kv_events`` (record the
KV events tract's connector hands vLLM's scheduler: `_event`).
Writes ``{"batches": [{"seconds", "outputs": [{"tokens", "finish",
"cached", "params"}], "each_s"}], "layout": ..., "layouts": [...],
"preemptions": n}``: ``layout`` is the worker connector's
`tract.transfer.KVLayout` (``layouts``: one per KV cache group it serves) and
``preemptions`` the requests it heard vLLM preempt (when it is tract's);
``events``: the recorded KV events.
"""

import dataclasses
import json
import os
import sys
import time


def _when_there(path: str, timeout: float = 600.0) -> None:
    """Return once another process made ``path``."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing at {path} after {timeout} s")
        time.sleep(0.05)


def _json_when_there(path: str, timeout: float = 600.0):
    """The JSON at ``path`` once another process wrote it (by rename)."""
    _when_there(path, timeout)
    with open(path) as source:
        return json.load(source)


def _serve_until(llm, path: str, timeout: float = 600.0) -> None:
    """Step the engine, so that it serves a decoder's reads of the blocks
    it keeps and frees them, until ``path`` exists."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        if scheduler.has_requests():
            llm.llm_engine.step()
        time.sleep(0.005)


def _settle(llm, timeout: float = 120.0) -> None:
    """Step the engine while its scheduler still holds requests, as a
    server's engine loop does: `LLM.generate` returns once its outputs are
    out, before delayed frees (asynchronous saves) ended."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine still held requests {timeout} s after the last "
                               f"batch (a transfer never ended?)")
        llm.llm_engine.step()
        time.sleep(0.001)


def _record_events(options) -> list:
    """Turn vLLM's KV events on (published nowhere) and record every
    event tract's connector hands the scheduler (`take_events`)."""
    from vllm.config import KVEventsConfig

    from tract.integrations.vllm import TractConnector

    options["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    recorded, take = [], TractConnector.take_events

    def recording(self):
        events = list(take(self))
        recorded.extend(events)
        return events

    TractConnector.take_events = recording
    return recorded


def _event(event) -> dict:
    """A recorded KV event as JSON: ``kind`` (stored or removed), the block
    hashes (ints, or digests as hex), the medium, the KV cache group (None
    unless the connector serves the model by group); a stored one's parent
    and token count too."""
    def name(value):
        return value.hex() if isinstance(value, bytes) else value

    record = {"kind": "removed", "hashes": [name(h) for h in event.block_hashes],
              "medium": event.medium, "group": getattr(event, "group_idx", None)}
    if hasattr(event, "token_ids"):
        record.update(kind="stored", parent=name(event.parent_block_hash),
                      tokens=len(event.token_ids))
    return record


def _abort_some(llm, prompts, samplings, aborted: set[int]) -> list:
    """Add every prompt, step once (an asynchronous load is then queued or
    running), abort the requests of the prompts at ``aborted``, and step
    until the others finish; their outputs, in prompt order."""
    engine = llm.llm_engine
    names = [f"abort-{index}" for index in range(len(prompts))]  # outputs carry these
    ids = [engine.add_request(name, prompt, sampling)
           for name, prompt, sampling in zip(names, prompts, samplings)]
    engine.step()
    engine.abort_request([ids[index] for index in sorted(aborted)], internal=True)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[name] for index, name in enumerate(names) if index not in aborted]


def _waves(llm, prompts, samplings, width: int) -> tuple[list, list[float]]:
    """Serve ``prompts`` ``width`` at a time, a wave's requests added at
    once: their outputs, in prompt order, and each one's time from its
    wave's start to its first token."""
    engine = llm.llm_engine
    results, each = [], []
    for first in range(0, len(prompts), width):
        names = [f"wave-{first + index}" for index in range(len(prompts[first:first + width]))]
        began = time.perf_counter()
        for name, prompt, sampling in zip(names, prompts[first:first + width],
                                          samplings[first:first + width]):
            engine.add_request(name, prompt, sampling)
        first_token, finished = {}, {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.outputs[0].token_ids and output.request_id not in first_token:
                    first_token[output.request_id] = time.perf_counter() - began
                if output.finished:
                    finished[output.request_id] = output
        results += [finished[name] for name in names]
        each += [first_token[name] for name in names]
    return results, each


def main(spec_path: str) -> None:
    with open(spec_path) as source:
        spec = json.load(source)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options = dict(model=spec["model"], skip_tokenizer_init=True, dtype="float32",
                   enforce_eager=True, max_model_len=spec.get("max_model_len") or 1024,
                   block_size=spec.get("block_size", 32),
                   enable_prefix_caching=spec.get("prefix_caching", False), seed=0,
                   max_num_batched_tokens=spec.get("max_num_batched_tokens") or 2048,
                   disable_log_stats=False)
    if spec.get("num_blocks"):  # a KV cache this small makes vLLM preempt
        options["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("kv_transfer_config"):
        options["kv_transfer_config"] = spec["kv_transfer_config"]
    events = _record_events(options) if spec.get("kv_events") else None
    llm = LLM(**options)
    report = {"batches": [], "layout": None, "preemptions": None, "events": None}

    def outputs(results):
        return [{"tokens": list(r.outputs[0].token_ids), "finish": r.outputs[0].finish_reason,
                 "cached": r.num_cached_tokens, "params": r.kv_transfer_params}
                for r in results]

    for batch in spec["batches"]:
        if batch.get("wait_for"):
            _when_there(batch["wait_for"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]]
        transfer = [None] * len(prompts)
        if batch.get("remote_decode"):
            transfer = [{"do_remote_decode": True}] * len(prompts)
        elif batch.get("params_from"):
            at = batch.get("params_offset", 0)
            transfer = _json_when_there(batch["params_from"])[at:at + len(prompts)]
        samplings = [SamplingParams(max_tokens=batch["max_tokens"], temperature=0.0,
                                    ignore_eos=True,
                                    extra_args=None if params is None
                                    else {"kv_transfer_params": params})
                     for params in transfer]
        started = time.perf_counter()
        if batch.get("abort"):  # these prompts' requests are aborted after one engine step
            results = _abort_some(llm, prompts, samplings, set(batch["abort"]))
            each = None
        elif batch.get("concurrent"):
            results, each = _waves(llm, prompts, samplings, batch["concurrent"])
        elif batch.get("one_by_one"):
            results, each = [], []
            for prompt, sampling in zip(prompts, samplings):
                began = time.perf_counter()
                results += llm.generate([prompt], sampling, use_tqdm=False)
                each.append(time.perf_counter() - began)
        else:
            results, each = llm.generate(prompts, samplings, use_tqdm=False), None
        report["batches"].append({"seconds": time.perf_counter() - started,
                                  "outputs": outputs(results), "each_s": each})
    if spec.get("params_out"):
        written = spec["params_out"] + ".tmp"
        with open(written, "w") as sink:
            json.dump([o["params"] for b in report["batches"] for o in b["outputs"]], sink)
        os.replace(written, spec["params_out"])
        _serve_until(llm, spec["serve_until"])
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        group = get_kv_transfer_group()
        layout = getattr(group, "layout", None)
        if layout is not None:
            report["layout"] = dataclasses.asdict(layout)
            report["layouts"] = [dataclasses.asdict(each) for each in group.layouts]
        report["preemptions"] = getattr(group, "preemptions", None)
    _settle(llm)
    if events is not None:
        report["events"] = [_event(event) for event in events]
    llm.llm_engine.engine_core.shutdown()  # the connectors' shutdown: pool counters published
    with open(spec["out"], "w") as sink:
        json.dump(report, sink)


if __name__ == "__main__":
    main(sys.argv[1])
