"""`tract bench tier`: what a rack miss costs when the cluster tier holds
the block, against recomputing it and against a rack hit.

Two racks (pools made from one hash key, each its own node 0) share one
Mooncake Store: its master and a segment holder, started here on 127.0.0.1
and stopped after.  Per block size (256 KiB: the demo's model, whose block
of 16 tokens is 256 KiB; 2 MiB: the same model with 64 layers), the
candidates are measured in turn, round by round (A B C D ...), each on
``BLOCKS`` blocks a sample:

- ``rack_hit``: rack B loads blocks its own pool holds;
- ``tier_hit``: rack B loads blocks only the tier holds (rack A stored them,
  written through, before the round), their promotion into rack B's pool
  included;
- ``promotion``: rack B stores as many fresh blocks into its pool, and
  only there (what a promotion adds to a tier hit);
- ``recompute``: the model computes the blocks' tokens (a prefill of
  ``BLOCKS`` x 16 tokens on one thread, as the demo's workers do).

Each figure is per block.  ``tier_hit`` is paired with ``recompute`` (how
many times faster than recomputing) and with ``rack_hit`` (how many times
slower than the rack); ``promotion`` is reported against ``tier_hit``, the
share of it.
"""

from __future__ import annotations

import os
import time
import uuid

import numpy as np

from tract.bench import Result, paired
from tract.bench.peers import SEGMENT_MAX, MooncakeCluster, Unavailable

BLOCKS = 16
SIZES = {"256KiB": 8, "2MiB": 64}  # block size -> the demo model's layers


class Racks:
    """Two pools from one hash key, each opened as node 0 with its manager."""

    def __init__(self, pool_bytes: int):
        from tract.pool import Pool

        key = os.urandom(16)
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        self.paths = [os.path.join(directory, f"tract-bench-tier-{os.getpid()}-"
                                   f"{uuid.uuid4().hex[:8]}") for _ in range(2)]
        self.pools = []
        try:
            for path in self.paths:
                Pool.create(path, pool_bytes, max_nodes=2, index_capacity=4096, hash_key=key)
                # every page made now: a store into a fresh page of /dev/shm
                # pays its fault, which a serving pool has long paid
                self.pools.append(Pool.open(path, 0, manager=True, populate=True))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        from tract.pool import Pool

        for pool in self.pools:
            pool.close()
        for path in self.paths:
            if os.path.exists(path):
                Pool.destroy(path)


def measure(label: str, layers: int, rounds: int, cluster: MooncakeCluster) -> list[Result]:
    """The figures of one block size: ``rounds`` alternating rounds on the
    demo model of ``layers`` layers, through the store ``cluster``."""
    import torch

    from tract.connector import Connector
    from tract.demo import BLOCK, DemoConfig, make_model

    config = DemoConfig(layers=layers, input_tokens=BLOCKS * BLOCK, output_tokens=1)
    layout = config.layout()
    size = layout.block_bytes
    model = make_model(config)
    rng = np.random.default_rng(layers)
    racks = Racks(4 * (rounds + 2) * BLOCKS * size + (64 << 20))  # nothing evicted
    url = cluster.url(staging_bytes=2 * BLOCKS * (size + 4096))
    prefill = Connector(racks.pools[0], layout, tier=url)
    decode = Connector(racks.pools[1], layout, tier=url)
    rack_only = Connector(racks.pools[1], layout)  # a promotion's store: no write-through
    times: dict[str, list[float]] = {name: [] for name in
                                     ("rack_hit", "tier_hit", "promotion", "recompute")}
    try:
        def fresh():
            tokens = rng.integers(0, config.vocab, BLOCKS * BLOCK, dtype=np.int32)
            blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(BLOCKS)]
            return tokens, blocks

        out = [np.empty(size, np.uint8) for _ in range(BLOCKS)]
        present, present_kv = fresh()
        decode.store(present, present_kv)
        for round_ in range(rounds + 1):  # the first round warms up and is dropped
            tokens, kv = fresh()
            if prefill.store(tokens, kv) != BLOCKS or prefill.stats["tier_stored_blocks"] < \
                    (round_ + 1) * BLOCKS:
                raise Unavailable(f"tier: rack A's store did not reach the tier "
                                  f"({prefill.tier.down or 'the store refused it'})")
            sample = {}
            start = time.perf_counter()
            got = decode.load(present, out)
            sample["rack_hit"] = time.perf_counter() - start
            start = time.perf_counter()
            got_tier = decode.load(tokens, out)
            sample["tier_hit"] = time.perf_counter() - start
            if got != BLOCKS or got_tier != BLOCKS:
                raise Unavailable(f"tier: a load got {got} and {got_tier} of {BLOCKS} blocks "
                                  f"({decode.tier.down or 'misses'})")
            promoted, promoted_kv = fresh()
            start = time.perf_counter()
            rack_only.store(promoted, promoted_kv)
            sample["promotion"] = time.perf_counter() - start
            start = time.perf_counter()
            with torch.no_grad():
                model(torch.from_numpy(tokens[None].astype(np.int64)), use_cache=True)
            sample["recompute"] = time.perf_counter() - start
            if round_:
                for name, seconds in sample.items():
                    times[name].append(seconds / BLOCKS)
    finally:
        for connector in (prefill, decode, rack_only):
            connector.close()
        racks.close()
    us = {name: float(np.median(values)) * 1e6 for name, values in times.items()}
    return [
        Result(f"tier[tier_hit,{label}] vs recompute", us["tier_hit"], "us/block", False,
               "recompute", us["recompute"], paired(times["tier_hit"], times["recompute"])),
        Result(f"tier[tier_hit,{label}] vs rack_hit", us["tier_hit"], "us/block", False,
               "rack_hit", us["rack_hit"], paired(times["tier_hit"], times["rack_hit"])),
        Result(f"tier[promotion,{label}] vs tier_hit", us["promotion"], "us/block", False,
               "tier_hit", us["tier_hit"], paired(times["promotion"], times["tier_hit"])),
        Result(f"tier[rack_hit,{label}]", us["rack_hit"], "us/block", False),
        Result(f"tier[recompute,{label}]", us["recompute"], "us/block", False),
    ]


def run(quick: bool = False) -> list[Result]:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        return [Result(f"unavailable: tier: mooncake-transfer-engine-non-cuda is not "
                       f"installed ({error})", 0.0, "note", True)]
    rounds = 3 if quick else 9
    results: list[Result] = []
    try:
        with MooncakeCluster(segment=SEGMENT_MAX) as cluster:
            for label, layers in SIZES.items():
                results += measure(label, layers, rounds, cluster)
    except Unavailable as why:
        results.append(Result(f"unavailable: {why}", 0.0, "note", True))
    return results

