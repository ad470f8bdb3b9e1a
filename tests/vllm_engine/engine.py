"""One vLLM instance, in its own process, for the connector tests: runs the
batches of a JSON spec through `vllm.LLM` and writes what came out.

    python engine.py SPEC.json

SPEC: ``model`` (a local model directory), ``out`` (where the results go),
``batches`` (each ``{"prompts": [[token ids]], "max_tokens": n}``, or
``"one_by_one": true`` to time each prompt alone), and optionally
``kv_transfer_config`` (a dict, as vLLM takes it), ``block_size`` and
``num_blocks`` (the KV cache's size in blocks: small, vLLM preempts) with
``max_model_len`` (which vLLM wants it to hold).
Writes ``{"batches": [{"seconds", "outputs": [{"tokens", "finish",
"cached", "params"}], "each_s"}], "layout": ..., "preemptions": n}``:
``layout`` is the worker connector's `tract.transfer.KVLayout` and
``preemptions`` the requests it heard vLLM preempt (when it is tract's).
"""

import dataclasses
import json
import sys
import time


def main(spec_path: str) -> None:
    with open(spec_path) as source:
        spec = json.load(source)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options = dict(model=spec["model"], skip_tokenizer_init=True, dtype="float32",
                   enforce_eager=True, max_model_len=spec.get("max_model_len") or 1024,
                   block_size=spec.get("block_size", 32),
                   enable_prefix_caching=spec.get("prefix_caching", False), seed=0,
                   max_num_batched_tokens=2048, disable_log_stats=False)
    if spec.get("num_blocks"):  # a KV cache this small makes vLLM preempt
        options["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("kv_transfer_config"):
        options["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(**options)
    report = {"batches": [], "layout": None, "preemptions": None}

    def outputs(results):
        return [{"tokens": list(r.outputs[0].token_ids), "finish": r.outputs[0].finish_reason,
                 "cached": r.num_cached_tokens, "params": r.kv_transfer_params}
                for r in results]

    for batch in spec["batches"]:
        sampling = SamplingParams(max_tokens=batch["max_tokens"], temperature=0.0,
                                  ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]]
        started = time.perf_counter()
        if batch.get("one_by_one"):
            results, each = [], []
            for prompt in prompts:
                began = time.perf_counter()
                results += llm.generate([prompt], sampling, use_tqdm=False)
                each.append(time.perf_counter() - began)
        else:
            results, each = llm.generate(prompts, sampling, use_tqdm=False), None
        report["batches"].append({"seconds": time.perf_counter() - started,
                                  "outputs": outputs(results), "each_s": each})
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        group = get_kv_transfer_group()
        layout = getattr(group, "layout", None)
        if layout is not None:
            report["layout"] = dataclasses.asdict(layout)
        report["preemptions"] = getattr(group, "preemptions", None)
    llm.llm_engine.engine_core.shutdown()  # the connectors' shutdown: pool counters published
    with open(spec["out"], "w") as sink:
        json.dump(report, sink)


if __name__ == "__main__":
    main(sys.argv[1])
