"""asv: moving KV blocks (`tract bench transfer`, the tract side): put
(reserve, copy, checksum, publish) and get (pin, fresh copy, checksum
check, unpin) of 8 blocks, next to memcpy (with and without the drop a fresh
read needs first) and the non-temporal copy of the same bytes, their
baselines, and the two copies a CPU handoff must make
(``two_copy_best``); and the handoff of 8 blocks from this process
(prefill, node 0) to a decode process on node 1, ticket sent by a pipe."""

import multiprocessing

import numpy as np

from tract.bench import transfer as bench
from tract.connector import Connector


class Blocks:
    params = [[256 << 10, 2 << 20], [True, False]]
    param_names = ["block_bytes", "checksum"]

    def setup(self, size, checksum):
        self.harness = bench.BenchPool(size * 16)
        self.pool = self.harness.pool
        self.connector = Connector(self.pool, bench.layout_of(size), checksum=checksum)
        self.blocks = bench.random_blocks(size, 8, 1)
        self.outs = [np.empty(size, np.uint8) for _ in range(8)]
        self.present = np.arange(16, dtype=np.uint64).reshape(8, 2)
        self.connector.store(self.present, self.blocks)
        self.offsets = np.array([self.pool.alloc(size) for _ in range(8)], dtype=np.int64)
        self.rng = np.random.default_rng(2)

    def teardown(self, size, checksum):
        self.harness.close()

    def time_put(self, size, checksum):
        keys = self.rng.integers(0, 2**63, size=(8, 2), dtype=np.uint64)
        self.connector.store(keys, self.blocks)  # allocation pressure evicts

    def time_get(self, size, checksum):
        self.connector.load(self.present, self.outs)

    def time_memcpy(self, size, checksum):
        for a, b in zip(self.blocks, self.outs):
            np.copyto(b, a)

    def time_memcpy_dropping(self, size, checksum):
        """The least a fresh read costs (R4): the ranges dropped and fenced,
        then memcpy out of the pool."""
        for offset in self.offsets.tolist():
            self.pool.region.invalidate(offset, size, payload=True)
        self.pool.region.fence()
        for offset, out in zip(self.offsets.tolist(), self.outs):
            np.copyto(out, np.frombuffer(self.pool.region.view(offset, size), np.uint8))

    def time_nontemporal_copy(self, size, checksum):
        self.pool.region.copy_in_blocks(self.offsets, self.blocks)

    def time_two_copy_best(self, size, checksum):
        """The handoff's bound: the non-temporal copy in, then memcpy out."""
        self.pool.region.copy_in_blocks(self.offsets, self.blocks)
        for offset, out in zip(self.offsets.tolist(), self.outs):
            np.copyto(out, np.frombuffer(self.pool.region.view(offset, size), np.uint8))


class Handoff:
    params = [[256 << 10, 2 << 20]]
    param_names = ["block_bytes"]

    def setup(self, size):
        self.harness = bench.BenchPool(size * 16)
        self.connector = Connector(self.harness.pool, bench.layout_of(size))
        self.blocks = bench.random_blocks(size, 8, 1)
        context = multiprocessing.get_context("fork")
        self.pipe, theirs = context.Pipe()
        self.decoder = context.Process(target=bench.decode_worker,
                                       args=(self.harness.path, size, 8, theirs, True))
        self.decoder.start()
        self.rng = np.random.default_rng(3)
        self.rounds = 0

    def teardown(self, size):
        self.pipe.send(None)
        self.decoder.join(30)
        self.connector.close()
        self.harness.close()

    def time_handoff(self, size):
        self.connector.release()  # the last round's pins (taken: its mark is in memory)
        keys = self.rng.integers(0, 2**63, size=(8, 2), dtype=np.uint64)
        self.rounds += 1
        ticket = self.connector.offer(f"asv-{self.rounds}", keys, self.blocks)
        self.pipe.send((ticket, 0.0))
        _, loaded = self.pipe.recv()
        assert loaded == 8, loaded
