"""`tract bench hash`: chained block hashing (`tract.hashing`).

Throughput in GB/s of token bytes (int32 tokens, 16-token blocks) of the
keyed mode (SipHash-1-3-128) and the fast mode (XXH3-128), each against
baselines measured in the same run:

- vLLM's block hash done the vLLM way: SHA-256 of the pickled
  ``(parent, tuple(tokens), None)`` per block (`tract.hashing.vllm_block_hashes`);
- for the fast mode, also the ``xxhash`` package's xxh3_128 over the same
  token bytes as one contiguous buffer (no chaining: an upper bound).

The engine modes (vLLM, SGLang) are reported against the same baseline.
"""

from __future__ import annotations

import time

import numpy as np

from tract.bench import Result
from tract.hashing import BlockHasher, sglang_page_keys, vllm_block_hashes

BLOCK_SIZE = 16
KEY = bytes(range(16))


def tokens(count: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 128_000, size=count, dtype=np.int32)


def _best(function, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def run(quick: bool = False) -> list[Result]:
    try:
        import xxhash
    except ImportError:  # the upper-bound baseline is optional (pip install xxhash)
        xxhash = None
    count = 1 << (18 if quick else 20)
    sample = tokens(count)
    nbytes = sample.nbytes
    slow = sample[: (1 << 14) if quick else (1 << 16)]  # the per-block Python paths: a slice
    keyed, fast = BlockHasher(KEY, BLOCK_SIZE), BlockHasher(KEY, BLOCK_SIZE, mode="fast")
    keyed(sample[:BLOCK_SIZE]), fast(sample[:BLOCK_SIZE])  # compile or load
    buffer = sample.tobytes()
    repeats = 3 if quick else 7
    rate = {
        "keyed": nbytes / _best(lambda: keyed(sample), repeats),
        "fast": nbytes / _best(lambda: fast(sample), repeats),
        "vllm_sha256_pickle": slow.nbytes / _best(
            lambda: vllm_block_hashes(slow, BLOCK_SIZE, none_hash_seed="0"), 3),
        "sglang_sha256": slow.nbytes / _best(lambda: sglang_page_keys(slow, BLOCK_SIZE), 3),
    }
    if xxhash is not None:
        rate["xxhash_xxh3_128_buffer"] = nbytes / _best(
            lambda: xxhash.xxh3_128_intdigest(buffer, 7), repeats * 3)
    gbs = {name: value / 1e9 for name, value in rate.items()}
    vllm = "vllm_sha256_pickle"
    results = [
        Result("hash[keyed,siphash13_128]", gbs["keyed"], "GB/s", True, vllm, gbs[vllm]),
        Result("hash[fast,xxh3_128]", gbs["fast"], "GB/s", True, vllm, gbs[vllm]),
        Result("hash[sglang,sha256]", gbs["sglang_sha256"], "GB/s", True, vllm, gbs[vllm]),
    ]
    if "xxhash_xxh3_128_buffer" in gbs:
        results.insert(2, Result("hash[fast,xxh3_128]", gbs["fast"], "GB/s", True,
                                 "xxhash_xxh3_128_buffer", gbs["xxhash_xxh3_128_buffer"]))
    return results
